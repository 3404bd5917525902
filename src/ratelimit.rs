//! Rate limits of one request: which script calls to make, and what their replies mean.
//!
//! Limits are grouped by their key's hash tag (the hashed tenant for tenant-scoped limits,
//! else the policy); each group is one call of `ratelimit.lua`, which checks every limit of
//! the group and consumes from all of them only if all allow. Groups are independent calls:
//! a request admitted by one group and rejected by another has consumed from the first.

use crate::config::{Policy, RateLimit};
use crate::keys;
use crate::redis::{resp::Reply, CallError, ScriptCall};
use crate::request::{selector_value, Caller, Request};
use crate::respond::{self, LocalResponse, Problem, QuotaView};
use serde_json::{json, Map};

/// One script call: the limits (indices into `policy.rate_limits`) whose keys share `tag`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub tag: String,
    pub limits: Vec<usize>,
    pub call: ScriptCall,
}

/// Builds one call per hash tag, tenant group first. `nonce` must be unique per request.
pub fn plan(
    prefix: &str,
    policy: &Policy,
    caller: &Caller,
    req: &Request,
    nonce: &str,
) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    for (i, limit) in policy.rate_limits.iter().enumerate() {
        let tag = if limit.tenant_scoped() {
            keys::tenant_tag(&caller.tenant)
        } else {
            keys::policy_tag(&policy.name)
        };
        let key = keys::rate_limit_key(prefix, &tag, policy, limit, &scope(limit, caller, req));
        let pos = match groups.iter().position(|g| g.tag == tag) {
            Some(pos) => pos,
            None => {
                groups.push(Group {
                    tag,
                    limits: Vec::new(),
                    call: ScriptCall {
                        keys: Vec::new(),
                        args: vec!["1".into(), nonce.to_string()],
                    },
                });
                groups.len() - 1
            }
        };
        let g = &mut groups[pos];
        g.limits.push(i);
        g.call.keys.push(key);
        g.call.args.extend(limit_args(limit));
    }
    groups.sort_by_key(|g| !g.tag.starts_with("t."));
    groups
}

fn scope(limit: &RateLimit, caller: &Caller, req: &Request) -> String {
    let parts: Vec<(String, Option<&str>)> = limit
        .by
        .iter()
        .map(|sel| (sel.spelling(), selector_value(sel, caller, req)))
        .collect();
    keys::scope_hash(&parts)
}

/// The five per-limit arguments of `ratelimit.lua`.
fn limit_args(limit: &RateLimit) -> [String; 5] {
    [
        limit.algorithm.code().to_string(),
        limit.limit.to_string(),
        limit.window_ms.to_string(),
        limit.burst.to_string(),
        if limit.shadow { "1" } else { "0" }.to_string(),
    ]
}

/// One limit's answer for this request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitState {
    pub allowed: bool,
    pub remaining: u64,
    pub reset_ms: u64,
    pub retry_after_ms: u64,
}

/// A group's reply: admitted, and each limit's state in group order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupReply {
    pub admitted: bool,
    pub states: Vec<LimitState>,
}

/// Reads `ratelimit.lua`'s reply: `[admitted, (allowed, remaining, reset_ms, retry_ms) * n]`.
pub fn read_reply(reply: &Reply, n: usize) -> Result<GroupReply, CallError> {
    let bad = |why: &str| CallError::UnexpectedReply(format!("ratelimit reply: {why}"));
    if let Reply::Error(e) = reply {
        return Err(CallError::Redis(e.clone()));
    }
    let items = reply.as_array().ok_or_else(|| bad("not an array"))?;
    if items.len() != 1 + 4 * n {
        return Err(bad(&format!("{} values for {n} limits", items.len())));
    }
    let mut ints = Vec::with_capacity(items.len());
    for item in items {
        ints.push(item.as_int().ok_or_else(|| bad("non-integer value"))?);
    }
    let flag = |v: i64| match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(bad("flag is neither 0 nor 1")),
    };
    let count = |v: i64| u64::try_from(v).map_err(|_| bad("negative count"));
    let admitted = flag(ints[0])?;
    let mut states = Vec::with_capacity(n);
    for chunk in ints[1..].chunks_exact(4) {
        states.push(LimitState {
            allowed: flag(chunk[0])?,
            remaining: count(chunk[1])?,
            reset_ms: count(chunk[2])?,
            retry_after_ms: count(chunk[3])?,
        });
    }
    Ok(GroupReply { admitted, states })
}

fn view<'a>((l, s): &(&'a RateLimit, &LimitState)) -> QuotaView<'a> {
    QuotaView {
        name: l.name.as_str(),
        quota: l.limit,
        window_ms: l.window_ms,
        remaining: s.remaining,
        reset_ms: s.reset_ms,
    }
}

/// The request's verdict once every group answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Forward; add these `(name, value)` headers to the response if configured.
    Allow(Vec<(String, String)>),
    Reject(LocalResponse),
}

/// Decides from every limit's state (`states[i]` for `policy.rate_limits[i]`).
/// Rejected when any non-shadow limit rejected.
pub fn decide(policy: &Policy, states: &[LimitState]) -> Verdict {
    let enforced: Vec<(&RateLimit, &LimitState)> = policy
        .rate_limits
        .iter()
        .zip(states)
        .filter(|(l, _)| !l.shadow)
        .collect();
    let violated: Vec<&(&RateLimit, &LimitState)> =
        enforced.iter().filter(|(_, s)| !s.allowed).collect();
    if violated.is_empty() {
        let mut views: Vec<QuotaView<'_>> = enforced.iter().map(view).collect();
        views.sort_by_key(|v| v.remaining);
        let (p, r) = respond::ratelimit_headers(&views);
        if views.is_empty() {
            return Verdict::Allow(Vec::new());
        }
        return Verdict::Allow(vec![
            ("ratelimit-policy".into(), p),
            ("ratelimit".into(), r),
        ]);
    }
    let retry_ms = violated
        .iter()
        .map(|(_, s)| s.retry_after_ms)
        .max()
        .unwrap_or(1000);
    let mut views: Vec<QuotaView<'_>> = violated.iter().map(|e| view(e)).collect();
    views.extend(enforced.iter().filter(|(_, s)| s.allowed).map(view));
    let (p, r) = respond::ratelimit_headers(&views);
    let names: Vec<&str> = violated.iter().map(|(l, _)| l.name.as_str()).collect();
    let retry_after = respond::retry_after_secs(retry_ms);
    let mut extra = Map::new();
    extra.insert("violated-policies".into(), json!(names));
    let detail = format!(
        "rate limit {} of operation \"{}\" exceeded; retry after {retry_after} s",
        names
            .iter()
            .map(|n| format!("\"{n}\""))
            .collect::<Vec<_>>()
            .join(", "),
        policy.name
    );
    Verdict::Reject(respond::problem(
        Problem::RateLimited,
        &detail,
        extra,
        vec![
            ("retry-after".into(), retry_after.to_string()),
            ("ratelimit-policy".into(), p),
            ("ratelimit".into(), r),
        ],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn config() -> Config {
        Config::parse(
            br#"{"redis": {"cluster": "gw", "key_prefix": "cg:demo"}, "policies": [
            {"name": "create-order", "rate_limits": [
              {"name": "tenant", "by": ["tenant"], "algorithm": "sliding_window", "limit": 100, "window": "1m"},
              {"name": "user-burst", "by": ["tenant", "principal"], "algorithm": "token_bucket", "limit": 10, "window": "1s", "burst": 20},
              {"name": "per-ip", "by": ["client_ip"], "algorithm": "fixed_window", "limit": 1000, "window": "1h", "shadow": true},
              {"name": "global", "by": [], "algorithm": "sliding_log", "limit": 5, "window": "250ms"}
            ]}]}"#,
        )
        .expect("valid")
    }

    fn request() -> (Caller, Request) {
        let req = Request::from_headers(
            vec![
                (":method".into(), "POST".into()),
                (":path".into(), "/orders".into()),
            ],
            Some("10.0.0.9:1234"),
        );
        let caller = Caller {
            tenant: "acme".into(),
            principal: "alice".into(),
        };
        (caller, req)
    }

    #[test]
    fn groups_by_hash_tag() {
        let c = config();
        let (caller, req) = request();
        let groups = plan("cg:demo", &c.policies[0], &caller, &req, "n1");
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].tag, "t.d2e79529ba2c46b2");
        assert_eq!(groups[0].limits, vec![0, 1]);
        assert_eq!(groups[1].tag, "p.create-order");
        assert_eq!(groups[1].limits, vec![2, 3]);
        let g = &groups[0].call;
        assert!(g.keys[0]
            .starts_with("cg:demo:rl:{t.d2e79529ba2c46b2}:create-order:tenant:sw:100/60000:"));
        assert!(g.keys[1]
            .starts_with("cg:demo:rl:{t.d2e79529ba2c46b2}:create-order:user-burst:tb:10/1000/20:"));
        assert_eq!(
            g.args,
            vec!["1", "n1", "sw", "100", "60000", "100", "0", "tb", "10", "1000", "20", "0"]
        );
        assert_eq!(
            groups[1].call.keys[1],
            "cg:demo:rl:{p.create-order}:create-order:global:sl:5/250:_"
        );
        assert_eq!(
            &groups[1].call.args[2..7],
            &["fw", "1000", "3600000", "1000", "1"]
        );
        // No raw identifier in any key.
        for g in &groups {
            for k in &g.call.keys {
                assert!(
                    !k.contains("acme") && !k.contains("alice") && !k.contains("10.0.0.9"),
                    "{k}"
                );
            }
        }
    }

    #[test]
    fn scopes_separate_callers() {
        let c = config();
        let (caller, req) = request();
        let other = Caller {
            tenant: "globex".into(),
            principal: "alice".into(),
        };
        let a = plan("cg", &c.policies[0], &caller, &req, "n");
        let b = plan("cg", &c.policies[0], &other, &req, "n");
        assert_ne!(a[0].call.keys, b[0].call.keys, "tenant-scoped keys differ");
        assert_eq!(
            a[1].call.keys, b[1].call.keys,
            "ip and global keys are shared"
        );
    }

    fn reply(values: &[i64]) -> Reply {
        Reply::Array(Some(values.iter().map(|v| Reply::Int(*v)).collect()))
    }

    #[test]
    fn reads_replies() {
        let got = read_reply(&reply(&[1, 1, 99, 60000, 0, 0, 0, 400, 250]), 2).expect("valid");
        assert!(got.admitted);
        assert_eq!(
            got.states[1],
            LimitState {
                allowed: false,
                remaining: 0,
                reset_ms: 400,
                retry_after_ms: 250
            }
        );
        let bad = [
            (reply(&[1, 1, 2, 3]), 1usize),
            (reply(&[2, 1, 2, 3, 4]), 1),
            (reply(&[1, 1, -2, 3, 4]), 1),
            (Reply::Int(1), 1),
            (Reply::Array(Some(vec![Reply::Status("OK".into())])), 0),
        ];
        for (r, n) in bad {
            assert!(
                matches!(read_reply(&r, n), Err(CallError::UnexpectedReply(_))),
                "{r:?}"
            );
        }
        assert_eq!(
            read_reply(&Reply::Error("ERR boom".into()), 1),
            Err(CallError::Redis("ERR boom".into()))
        );
    }

    fn st(allowed: bool, remaining: u64, reset_ms: u64, retry_after_ms: u64) -> LimitState {
        LimitState {
            allowed,
            remaining,
            reset_ms,
            retry_after_ms,
        }
    }

    #[test]
    fn allow_lists_most_restrictive_first_and_hides_shadow() {
        let c = config();
        let verdict = decide(
            &c.policies[0],
            &[
                st(true, 50, 30_000, 0),
                st(true, 3, 700, 0),
                st(false, 0, 10, 10),
                st(true, 4, 250, 0),
            ],
        );
        assert_eq!(
            verdict,
            Verdict::Allow(vec![
                (
                    "ratelimit-policy".into(),
                    "\"user-burst\";q=10;w=1, \"global\";q=5;w=1, \"tenant\";q=100;w=60".into()
                ),
                (
                    "ratelimit".into(),
                    "\"user-burst\";r=3;t=1, \"global\";r=4;t=1, \"tenant\";r=50;t=30".into()
                ),
            ])
        );
    }

    #[test]
    fn reject_names_violated_limits() {
        let c = config();
        let verdict = decide(
            &c.policies[0],
            &[
                st(false, 0, 16_200, 16_200),
                st(true, 3, 700, 0),
                st(true, 1, 10, 0),
                st(false, 0, 200, 120),
            ],
        );
        let Verdict::Reject(r) = verdict else {
            panic!("expected a rejection");
        };
        assert_eq!(r.status, 429);
        assert_eq!(r.header("retry-after"), Some("17"));
        assert_eq!(
            r.header("ratelimit-policy"),
            Some("\"tenant\";q=100;w=60, \"global\";q=5;w=1, \"user-burst\";q=10;w=1")
        );
        assert_eq!(
            r.header("ratelimit"),
            Some("\"tenant\";r=0;t=17, \"global\";r=0;t=1, \"user-burst\";r=3;t=1")
        );
        let body: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(body["violated-policies"], json!(["tenant", "global"]));
        assert_eq!(body["status"], json!(429));
    }

    #[test]
    fn shadow_over_limit_never_rejects() {
        let c = config();
        let verdict = decide(
            &c.policies[0],
            &[
                st(true, 1, 1, 0),
                st(true, 1, 1, 0),
                st(false, 0, 5, 5),
                st(true, 1, 1, 0),
            ],
        );
        assert!(matches!(verdict, Verdict::Allow(_)));
    }
}
