//! The request a command describes (`--method`, `--path`, `--header`, `--tenant`, ...), made
//! into the filter's own [`Request`] and matched to a policy by the filter's own functions, and
//! the answers the filter gives by itself before it asks Redis anything, written by the
//! filter's own code: the tool never has a second idea of what a request means.

use crate::admin::args::Args;
use crate::admin::AdminError;
use crate::config::{Config, IdSource, Policy};
use crate::engine::flow::checks;
use crate::guards::context::{Pcx, Runtime};
use crate::guards::idempotency::guard::IdempotencyGuard;
use crate::guards::lease::LeaseGuard;
use crate::http::claims::Claim;
use crate::http::identity::{identify, Caller, TenantError, ANONYMOUS};
use crate::http::local_reply::LocalResponse;
use crate::http::matching::{parsed_policy_index, Selected};
use crate::http::request::Request;
use crate::support::metrics::{Metrics, NoMetrics};
use serde_json::{json, Value};

/// The options that describe a request, each taking a value (`--header` may repeat).
pub(crate) const REQUEST_OPTIONS: [&str; 9] = [
    "--policy",
    "--method",
    "--path",
    "--host",
    "--header",
    "--tenant",
    "--principal",
    "--client-ip",
    "--idempotency-key",
];

/// The owner token the tool's derivations are made with: a request's real one is random, and
/// only names its cancellation marker, which the tool shows as `<owner token>`.
pub(crate) const OWNER: &str = "00000000000000000000000000000000";

/// A request as a command line describes it, and what the policies make of it.
pub(crate) struct Described {
    /// The request as the filter reads it.
    pub(crate) req: Request,
    /// The method and the path as sent (before the filter's normalisation).
    pub(crate) method: String,
    pub(crate) path: String,
    /// What the policies make of it (`None`: no policy guards it).
    pub(crate) selected: Option<Selected>,
    /// Who is calling, or why the filter cannot tell.
    pub(crate) caller: Result<Caller, TenantError>,
}

impl Described {
    /// The request `args` describes. Left out, the method is `method_hint` of the named policy
    /// (`--policy`), else the first method its match names, else `GET`; the path is its match's
    /// exact path or prefix, else `/`. With `--policy`, the request must match that policy.
    pub(crate) fn new(
        config: &Config,
        args: &Args,
        method_hint: impl Fn(&Policy) -> Option<String>,
    ) -> Result<Described, AdminError> {
        let named = match args.value("--policy")? {
            None => None,
            Some(name) => Some(policy_named(config, name)?),
        };
        let method = match (args.value("--method")?, named) {
            (Some(m), _) => m.to_string(),
            (None, Some((_, p))) => method_hint(p)
                .or_else(|| p.matcher.methods.first().cloned())
                .unwrap_or_else(|| "GET".into()),
            (None, None) => "GET".into(),
        };
        let path = match (args.value("--path")?, named) {
            (Some(p), _) => p.to_string(),
            (None, Some((_, p))) => p
                .matcher
                .path_exact
                .clone()
                .or_else(|| p.matcher.path_prefix.clone())
                .unwrap_or_else(|| "/".into()),
            (None, None) => "/".into(),
        };
        if !path.starts_with('/') {
            return Err(AdminError::Usage(format!(
                "--path must start with '/', got {path:?}"
            )));
        }
        let mut headers = vec![
            (":method".to_string(), method.clone()),
            (":path".to_string(), path.clone()),
        ];
        if let Some(host) = args.value("--host")? {
            headers.push((":authority".into(), host.to_string()));
        }
        for h in args.values("--header") {
            headers.push(header(h)?);
        }
        let mut claims = (Claim::Absent, Claim::Absent);
        for (option, source, claim) in [
            ("--tenant", &config.identity.tenant, &mut claims.0),
            ("--principal", &config.identity.principal, &mut claims.1),
        ] {
            let Some(value) = args.value(option)? else {
                continue;
            };
            match source {
                IdSource::Header(name) => headers.push((name.clone(), value.to_string())),
                IdSource::Metadata(_) => *claim = Claim::Text(value.to_string()),
            }
        }
        let client_ip = args.value("--client-ip")?;
        let key = args.value("--idempotency-key")?;
        let build = |idem_header: Option<&str>| {
            let mut all = headers.clone();
            if let (Some(name), Some(key)) = (idem_header, key) {
                all.push((name.to_string(), key.to_string()));
            }
            let mut req = Request::from_headers(all, client_ip);
            req.tenant_claim = claims.0.clone();
            req.principal_claim = claims.1.clone();
            let selected = parsed_policy_index(&config.policies, &req);
            (req, selected)
        };
        // The Idempotency-Key goes in the header of the policy that guards the request; a
        // policy's match could read that header, so the request is matched again with it.
        let guess = named
            .map(|(_, p)| p)
            .or_else(|| config.policies.iter().find(|p| p.idempotency.is_some()));
        let first = idem_header(guess);
        let (mut req, mut selected) = build(first);
        let matched = selected.and_then(|s| config.policies.get(s.index()));
        if key.is_some() && idem_header(matched) != first && matched.is_some() {
            (req, selected) = build(idem_header(matched));
        }
        if let Some((index, policy)) = named {
            if selected.map(Selected::index) != Some(index) {
                let found = match selected.and_then(|s| config.policies.get(s.index())) {
                    Some(p) => format!("policy {:?}", p.name),
                    None => "no policy".to_string(),
                };
                return Err(AdminError::Usage(format!(
                    "the request {method} {path} matches {found}, not {:?}; describe it with \
                     --method, --path, --host and --header as the client sends it",
                    policy.name
                )));
            }
        }
        let caller = identify(&config.identity, &req);
        Ok(Described {
            req,
            method,
            path,
            selected,
            caller,
        })
    }

    /// The policy that guards the request, for a command that needs one: no policy, or a
    /// path the filter refuses, is a usage error that says so.
    pub(crate) fn guarded<'c>(
        &self,
        config: &'c Config,
    ) -> Result<(usize, &'c Policy), AdminError> {
        match self.selected {
            Some(Selected::Policy(i)) => config
                .policies
                .get(i)
                .map(|p| (i, p))
                .ok_or_else(|| AdminError::Usage("no such policy".into())),
            Some(Selected::AmbiguousPath(_)) => Err(refused(
                &format!("{} {}", self.method, self.path),
                &checks::ambiguous_path(&config.problem_type_base),
            )),
            None => Err(AdminError::Usage(format!(
                "no policy guards {} {}: the filter forwards it untouched",
                self.method, self.path
            ))),
        }
    }

    /// The caller, for a command that needs one: a tenant the filter cannot tell is a usage
    /// error with the filter's own answer.
    pub(crate) fn caller(&self, filter: &Filter, index: usize) -> Result<&Caller, AdminError> {
        match &self.caller {
            Ok(c) => Ok(c),
            Err(e) => Err(refused("the request", &filter.tenant_problem(index, *e))),
        }
    }
}

/// The usage error of a request the filter answers itself: its status, problem and detail.
pub(crate) fn refused(what: &str, answer: &LocalResponse) -> AdminError {
    let a = Answer::of(answer);
    AdminError::Usage(format!(
        "the filter answers {what} itself: {} {} ({}); nothing of it is in Redis",
        a.status, a.problem, a.detail
    ))
}

/// The policy named `name`, with its index.
pub(crate) fn policy_named<'c>(
    config: &'c Config,
    name: &str,
) -> Result<(usize, &'c Policy), AdminError> {
    config
        .policies
        .iter()
        .enumerate()
        .find(|(_, p)| p.name == name)
        .ok_or_else(|| {
            let names: Vec<&str> = config.policies.iter().map(|p| p.name.as_str()).collect();
            let names = if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            };
            AdminError::Usage(format!(
                "no policy is named {name:?}; the policies are {names}"
            ))
        })
}

fn idem_header(policy: Option<&Policy>) -> Option<&str> {
    policy
        .and_then(|p| p.idempotency.as_ref())
        .map(|i| i.header.as_str())
}

/// `name: value` as a header the filter reads: the name in lower case, the value without the
/// blanks around it.
fn header(text: &str) -> Result<(String, String), AdminError> {
    let (name, value) = text
        .split_once(':')
        .filter(|(n, _)| !n.trim().is_empty() && !n.starts_with(':'))
        .ok_or_else(|| {
            AdminError::Usage(format!(
                "--header takes 'name: value', got {text:?} (pseudo-headers are --method, \
                 --path and --host)"
            ))
        })?;
    Ok((
        name.trim().to_ascii_lowercase(),
        value.trim_matches([' ', '\t']).to_string(),
    ))
}

/// The filter's runtime for the configuration, with no host behind its metrics: what the
/// filter's own checks and guards are called with.
pub(crate) struct Filter {
    rt: Runtime,
}

impl Filter {
    pub(crate) fn new(config: &Config) -> Filter {
        let config = config.clone();
        let metrics = Metrics::define(&config, |_, _| 0);
        Filter {
            rt: Runtime::new(config, metrics, None),
        }
    }

    /// The context of a request of policy `index`, as the filter's checks take it.
    fn at(&self, index: usize) -> Option<Pcx<'_>> {
        Some(Pcx {
            rt: &self.rt,
            now_ms: 0,
            m: &NoMetrics,
            index,
            policy: self.rt.config.policies.get(index)?,
            pm: self.rt.metrics.policies.get(index)?,
        })
    }

    /// The filter's answer to a request whose caller it cannot tell.
    pub(crate) fn tenant_problem(&self, index: usize, e: TenantError) -> LocalResponse {
        match self.at(index) {
            Some(at) => checks::tenant_problem(&at, e),
            None => checks::ambiguous_path(&self.rt.config.problem_type_base),
        }
    }

    /// The filter's answer to a request that carries an input a limit or the lease is keyed
    /// by more than once (which value names the counter would be a guess).
    pub(crate) fn repeated_selector(&self, index: usize, req: &Request) -> Option<LocalResponse> {
        checks::repeated_selector(&self.at(index)?, req)
    }

    /// The filter's own answers before any Redis call, in its order, after the caller: a
    /// repeated input a limit or the lease is keyed by, a cost it refuses, a missing lease
    /// resource, an Idempotency-Key it refuses. `Ok`: the costs (empty: 1 each) and the guards
    /// the request would carry.
    pub(crate) fn prepare(
        &self,
        index: usize,
        caller: &Caller,
        req: &Request,
    ) -> Result<Prepared, LocalResponse> {
        let Some(at) = self.at(index) else {
            return Ok(Prepared::default());
        };
        if let Some(problem) = checks::repeated_selector(&at, req) {
            return Err(problem);
        }
        let costs = checks::costs(&at, req)?;
        let lease = match LeaseGuard::prepare(&at, caller, req, OWNER) {
            Ok(lease) => lease,
            Err(missing) => return Err(checks::lease_resource_missing(&at, &missing)),
        };
        let record = match at.policy.idempotency.as_ref() {
            Some(cfg) if cfg.applies_to(&req.method) => {
                IdempotencyGuard::prepare(&at, cfg, caller, req, OWNER)?
            }
            _ => None,
        };
        Ok(Prepared {
            costs,
            lease,
            record,
        })
    }
}

/// What the filter's guards make of a request that passed its checks.
#[derive(Default)]
pub(crate) struct Prepared {
    pub(crate) costs: Vec<u64>,
    pub(crate) lease: Option<LeaseGuard>,
    pub(crate) record: Option<IdempotencyGuard>,
}

/// A local answer, as the tool reports it.
pub(crate) struct Answer {
    pub(crate) status: u32,
    pub(crate) problem: String,
    pub(crate) detail: String,
}

impl Answer {
    pub(crate) fn of(r: &LocalResponse) -> Answer {
        let body: Value = serde_json::from_slice(&r.body).unwrap_or_default();
        Answer {
            status: r.status,
            problem: r.problem.map_or("", |p| p.slug()).to_string(),
            detail: body
                .get("detail")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
        }
    }

    pub(crate) fn json(&self) -> Value {
        json!({"status": self.status, "problem": self.problem, "detail": self.detail})
    }
}

/// A tenant or principal as the tool shows it: the anonymous one by name.
pub(crate) fn shown_identity(s: &str) -> &str {
    if s == ANONYMOUS {
        "(anonymous)"
    } else {
        s
    }
}

/// The identity as JSON: `null` for the anonymous one.
pub(crate) fn identity_json(s: &str) -> Value {
    if s == ANONYMOUS {
        Value::Null
    } else {
        Value::String(s.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn config() -> Config {
        Config::parse(
            br#"{"redis": {"cluster": "gw", "key_prefix": "cg:t"},
            "identity": {"tenant_header": "x-tenant-id", "principal_header": "x-user-id"},
            "policies": [
              {"name": "activate", "match": {"methods": ["POST"], "path_prefix": "/orders/"},
               "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "10s"}},
              {"name": "create", "match": {"methods": ["POST"], "path_prefix": "/orders"},
               "rate_limits": [{"name": "t", "by": ["tenant"], "algorithm": "fixed_window",
                                "limit": 3, "window": "1m"}],
               "idempotency": {"header": "idempotency-key"}}]}"#,
        )
        .unwrap()
    }

    fn described(args: &[&str]) -> Result<Described, AdminError> {
        let a = Args::parse(&strings(args), &REQUEST_OPTIONS, &[]).unwrap();
        Described::new(&config(), &a, |_| None)
    }

    #[test]
    fn a_described_request_is_the_filters_request() {
        let d = described(&[
            "--method",
            "post",
            "--path",
            "/orders/%31%32/x",
            "--tenant",
            "acme",
            "--header",
            "X-Trace:  a b ",
        ])
        .unwrap();
        assert_eq!(d.selected, Some(Selected::Policy(0)));
        assert_eq!(d.req.method, "POST");
        assert_eq!(d.req.path(), "/orders/12/x");
        assert_eq!(d.req.header("x-trace"), Some("a b"));
        assert_eq!(d.caller.unwrap().tenant, "acme");
        // The named policy's match fills in what is left out.
        let d = described(&["--policy", "create", "--tenant", "acme"]).unwrap();
        assert_eq!((d.method.as_str(), d.path.as_str()), ("POST", "/orders"));
        assert_eq!(d.selected, Some(Selected::Policy(1)));
        let d = described(&["--policy", "create", "--idempotency-key", "\"k\""]).unwrap();
        assert_eq!(d.req.header("idempotency-key"), Some("\"k\""));
        assert!(d.caller.is_err(), "no tenant");
    }

    #[test]
    fn a_named_policy_must_be_the_one_matched() {
        let err = described(&["--policy", "activate", "--path", "/orders"])
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("matches policy \"create\""),
            "{err}"
        );
        let err = described(&["--policy", "create", "--method", "GET"])
            .err()
            .unwrap();
        assert!(err.to_string().contains("matches no policy"), "{err}");
        let err = described(&["--policy", "nope"]).err().unwrap();
        assert!(err.to_string().contains("activate, create"), "{err}");
        assert!(described(&["--path", "orders"]).is_err());
        assert!(described(&["--header", "no colon"]).is_err());
        assert!(described(&["--header", ":path: /x"]).is_err());
    }

    #[test]
    fn the_filters_own_answers_come_from_its_code() {
        let config = config();
        let filter = Filter::new(&config);
        let d = described(&["--path", "/orders/1", "--method", "POST"]).unwrap();
        let err = d.caller(&filter, 0).err().unwrap().to_string();
        assert!(err.contains("401 missing_tenant"), "{err}");
        let d = described(&["--path", "/orders/%2F1", "--method", "POST"]).unwrap();
        let err = d.guarded(&config).err().unwrap().to_string();
        assert!(err.contains("400 ambiguous_path"), "{err}");
        let d = described(&["--path", "/orders", "--method", "POST", "--tenant", "a"]).unwrap();
        let caller = d.caller.as_ref().unwrap();
        let problem = filter.prepare(1, caller, &d.req).err().unwrap();
        assert_eq!(Answer::of(&problem).problem, "idempotency_key_missing");
        let d = described(&[
            "--policy",
            "create",
            "--tenant",
            "acme",
            "--idempotency-key",
            "k",
        ]);
        let d = d.unwrap();
        let caller = d.caller.as_ref().unwrap();
        let prepared = filter.prepare(1, caller, &d.req).ok().unwrap();
        let record = prepared.record.expect("a record");
        assert_eq!(
            record.acquire.key,
            "cg:t:idem:{t.d2e79529ba2c46b2}:create:".to_string()
                + &crate::redis::keys::client_key_hash("k")
        );
        assert!(prepared.lease.is_none());
        let d = described(&["--path", "/orders/", "--method", "POST", "--tenant", "a"]).unwrap();
        let caller = d.caller.as_ref().unwrap();
        let problem = filter.prepare(0, caller, &d.req).err().unwrap();
        assert_eq!(Answer::of(&problem).problem, "lease_resource_missing");
    }
}
