//! `cg-admin explain`: what the filter would do with a described request, and why: which
//! policy it matches (and why each one before it does not), the answer the filter gives by
//! itself if it gives one, and otherwise each limit, the record and the lease it would use,
//! with their keys and the script calls they ride in. Nothing is read from Redis.

use crate::admin::args::Args;
use crate::admin::request::{
    identity_json, shown_identity, Answer, Described, Filter, Prepared, OWNER, REQUEST_OPTIONS,
};
use crate::admin::show::{self, rows};
use crate::admin::{AdminError, Context, Report};
use crate::config::{Config, FingerprintPart, IdSource, Match, Policy};
use crate::engine::flow::checks;
use crate::guards::lease::resource_parts;
use crate::guards::ratelimit;
use crate::http::identity::Caller;
use crate::http::matching::Selected;
use crate::http::request::Request;
use crate::http::selectors::selector_value;
use crate::redis::keys::limit_code;
use crate::redis::scripts::acquire::{self, Ask, Asker};
use serde_json::{json, Value};
use std::fmt::Write;

/// What the owner token stands for in the keys shown: a request's own is random.
const OWNER_SHOWN: &str = "<owner token>";

pub(crate) fn run(ctx: &mut Context, args: &[String]) -> Result<Report, AdminError> {
    let a = Args::parse(args, &REQUEST_OPTIONS, &[])?;
    let config = &ctx.config;
    let d = Described::new(config, &a, |_| None)?;
    let filter = Filter::new(config);
    let mut text = String::new();
    let mut json = json!({"request": request_json(&d)});
    let mut r = vec![("request", format!("{} {}", d.req.method, d.path))];
    if d.req.path() != d.path.split('?').next().unwrap_or_default() {
        r.push(("path read as", d.req.path().to_string()));
    }
    if !d.req.host().is_empty() {
        r.push(("host", d.req.host().to_string()));
    }
    if let Some(ip) = &d.req.client_ip {
        r.push(("client", ip.clone()));
    }
    // Why the policies before the one chosen do not fit.
    let upto = d.selected.map_or(config.policies.len(), Selected::index);
    let misfits: Vec<(String, String)> = config
        .policies
        .iter()
        .take(upto)
        .map(|p| (p.name.clone(), misfit(&p.matcher, &d.req)))
        .collect();
    json["not_matched"] = Value::Array(
        misfits
            .iter()
            .map(|(p, why)| json!({"policy": p, "why": why}))
            .collect(),
    );
    for (p, why) in &misfits {
        r.push(("not", format!("{p}: {why}")));
    }
    let index = match d.selected {
        None => {
            r.push(("policy", "none".into()));
            r.push(("answer", "forwarded untouched: no policy guards it".into()));
            rows(&mut text, 0, &r);
            json["policy"] = Value::Null;
            json["matched"] = json!("none");
            json["answer"] = Value::Null;
            json["forwarded"] = json!(true);
            return Ok(Report { text, json });
        }
        Some(s) => s.index(),
    };
    let Some(policy) = config.policies.get(index) else {
        return Err(AdminError::Usage("no such policy".into()));
    };
    json["policy"] = json!(policy.name);
    json["policy_index"] = json!(index);
    if let Some(Selected::AmbiguousPath(_)) = d.selected {
        r.push((
            "policy",
            format!(
                "{}: one of the path's readings fits it ({})",
                policy.name,
                policy.matcher.describe()
            ),
        ));
        json["matched"] = json!("ambiguous_path");
        return Ok(answered(
            text,
            json,
            r,
            &Answer::of(&checks::ambiguous_path(&config.problem_type_base)),
        ));
    }
    json["matched"] = json!("policy");
    r.push((
        "policy",
        format!(
            "{} (policy {} of {}): the first whose match fits: {}",
            policy.name,
            index + 1,
            config.policies.len(),
            policy.matcher.describe()
        ),
    ));
    let caller = match &d.caller {
        Ok(c) => c,
        Err(e) => {
            r.push(("caller", caller_sources(config)));
            return Ok(answered(
                text,
                json,
                r,
                &Answer::of(&filter.tenant_problem(index, *e)),
            ));
        }
    };
    r.push((
        "caller",
        format!(
            "tenant {}, principal {} ({})",
            shown_identity(&caller.tenant),
            shown_identity(&caller.principal),
            caller_sources(config)
        ),
    ));
    json["tenant"] = identity_json(&caller.tenant);
    json["principal"] = identity_json(&caller.principal);
    let prepared = match filter.prepare(index, caller, &d.req) {
        Ok(p) => p,
        Err(problem) => return Ok(answered(text, json, r, &Answer::of(&problem))),
    };
    let parts = Parts::of(config, policy, caller, &d.req, &prepared);
    let asks_redis =
        !policy.rate_limits.is_empty() || prepared.lease.is_some() || prepared.record.is_some();
    r.push((
        "answer",
        if asks_redis {
            format!(
                "asks Redis in {} script call(s), one per hash tag (below); forwarded if they \
                 admit it",
                parts.calls.len()
            )
        } else {
            "forwarded: the policy asks Redis nothing for this request".into()
        },
    ));
    json["answer"] = Value::Null;
    json["forwarded"] = json!(!asks_redis);
    rows(&mut text, 0, &r);
    parts.write(&mut text, &mut json, config, policy);
    Ok(Report { text, json })
}

/// The report of a request the filter answers by itself.
fn answered(
    mut text: String,
    mut json: Value,
    mut r: Vec<(&'static str, String)>,
    a: &Answer,
) -> Report {
    r.push((
        "answer",
        format!(
            "{} {}, by the filter itself, before any Redis call:\n{}",
            a.status, a.problem, a.detail
        ),
    ));
    rows(&mut text, 0, &r);
    json["answer"] = a.json();
    json["forwarded"] = json!(false);
    Report { text, json }
}

fn request_json(d: &Described) -> Value {
    json!({
        "method": d.req.method,
        "path": d.path,
        "path_read_as": d.req.path(),
        "path_ambiguous": d.req.path_ambiguous,
        "host": d.req.host(),
        "client_ip": d.req.client_ip,
    })
}

/// Where the identity is read from.
fn caller_sources(config: &Config) -> String {
    let from = |s: &IdSource| match s {
        IdSource::Header(h) => format!("header {h}"),
        IdSource::Metadata(_) => s.describe(),
    };
    format!(
        "tenant from {}, principal from {}",
        from(&config.identity.tenant),
        from(&config.identity.principal)
    )
}

/// Why `m` does not fit `req`: the first of its conditions that fails, each tested alone by
/// the filter's own match.
fn misfit(m: &Match, req: &Request) -> String {
    let alone = |f: &dyn Fn(&mut Match)| {
        let mut one = Match::default();
        f(&mut one);
        one.matches(req)
    };
    if !alone(&|o| o.methods = m.methods.clone()) {
        return format!("method {} is not {}", req.method, m.methods.join("|"));
    }
    if !alone(&|o| {
        o.path_prefix = m.path_prefix.clone();
        o.path_exact = m.path_exact.clone();
        o.path_template = m.path_template.clone();
    }) {
        return match (&m.path_exact, &m.path_prefix, &m.path_template) {
            (Some(e), _, _) => format!("path {} is not {e}", req.path()),
            (None, Some(p), _) => format!("path {} is not under {p}", req.path()),
            (None, None, Some(t)) => {
                format!(
                    "path {} does not fit the template {}",
                    req.path(),
                    t.as_str()
                )
            }
            _ => "its path does not fit".into(),
        };
    }
    if !alone(&|o| o.host = m.host.clone()) {
        return format!(
            "host {:?} is not {}",
            req.host(),
            m.host.as_deref().unwrap_or_default()
        );
    }
    for h in &m.headers {
        if !alone(&|o| o.headers = vec![h.clone()]) {
            let want = Match {
                headers: vec![h.clone()],
                ..Match::default()
            }
            .describe();
            return match req.single_header(&h.name) {
                Err(_) => format!("{want} does not hold: the header appears more than once"),
                Ok(None) => format!("{want} does not hold: the request has no {}", h.name),
                Ok(Some(v)) => format!("{want} does not hold: it is {v:?}"),
            };
        }
    }
    "its match does not fit".into()
}

/// What a request that passed the filter's checks uses: its limits, record and lease, and the
/// script calls they ride in.
struct Parts {
    limits: Vec<Value>,
    limit_text: String,
    record: Value,
    record_text: String,
    lease: Value,
    lease_text: String,
    calls: Vec<Value>,
    calls_text: String,
}

impl Parts {
    fn of(
        config: &Config,
        policy: &Policy,
        caller: &Caller,
        req: &Request,
        prepared: &Prepared,
    ) -> Parts {
        let prefix = &config.redis.key_prefix;
        let keys: Vec<_> = policy
            .rate_limits
            .iter()
            .map(|l| ratelimit::key(prefix, policy, l, caller, req))
            .collect();
        // The override keys the filter passes with a limit that has `overrides: true`.
        let overrides: Vec<_> = policy
            .rate_limits
            .iter()
            .zip(&keys)
            .map(|(l, key)| ratelimit::override_keys(prefix, policy, l, key, caller))
            .collect();
        let cost = |i: usize| prepared.costs.get(i).copied().unwrap_or(1);
        let mut limits = Vec::new();
        let mut limit_text = String::new();
        for (i, (l, key)) in policy.rate_limits.iter().zip(&keys).enumerate() {
            let scope: Vec<Value> = l
                .by
                .iter()
                .map(|s| json!({"selector": s.spelling(), "value": selector_value(s, caller, req)}))
                .collect();
            let scope_text: Vec<String> =
                l.by.iter()
                    .map(|s| match selector_value(s, caller, req) {
                        Some(v) => format!("{}={:?}", s.spelling(), shown_identity(v)),
                        None => format!("{} absent", s.spelling()),
                    })
                    .collect();
            let _ = writeln!(limit_text, "limit {}: {}", l.name, show::limit_line(l));
            let mut r = vec![
                ("key", key.text().to_string()),
                ("hash tag", key.tag().to_string()),
            ];
            if !scope_text.is_empty() {
                r.push(("scope", scope_text.join(", ")));
            }
            let own = overrides.get(i).and_then(Option::as_ref);
            if let Some(o) = own {
                let keys: Vec<&str> = o
                    .principal
                    .iter()
                    .chain([&o.tenant])
                    .map(String::as_str)
                    .collect();
                r.push(("overrides", keys.join(", ")));
            }
            r.push(("cost", cost(i).to_string()));
            rows(&mut limit_text, 2, &r);
            limits.push(json!({
                "name": l.name,
                "key": key.text(),
                "hash_tag": key.tag(),
                "algorithm": show::algorithm(l),
                "code": limit_code(l),
                "scope": scope,
                "cost": cost(i),
                "override_keys": own.map(|o| o.principal.iter().chain([&o.tenant]).collect::<Vec<_>>()),
                "shadow": l.shadow,
            }));
        }
        let (record, record_text) = record(policy, req, prepared);
        let (lease, lease_text) = lease(policy, caller, req, prepared);
        let asks: Vec<Option<Ask<'_>>> = keys
            .iter()
            .enumerate()
            .map(|(i, key)| {
                Some(Ask {
                    key,
                    cost: cost(i),
                    overrides: overrides.get(i).and_then(Option::as_ref),
                })
            })
            .collect();
        let asker = Asker {
            nonce: OWNER,
            prefix,
            owner: OWNER,
        };
        let groups = acquire::plan(
            policy,
            &asks,
            &asker,
            prepared.record.as_ref().map(|g| &g.acquire),
            prepared.lease.as_ref().map(|g| &g.acquire),
        );
        let mut calls = Vec::new();
        let mut calls_text = String::new();
        // With the record or the lease in one slot and limits in another, the limits' calls
        // go first and the record's follows only if they admit (see docs/design.md).
        let later = groups.iter().any(|g| g.record || g.lease) && groups.len() > 1;
        for (n, g) in groups.iter().enumerate() {
            let names: Vec<&str> = g
                .limits
                .iter()
                .filter_map(|&i| policy.rate_limits.get(i).map(|l| l.name.as_str()))
                .collect();
            let keys: Vec<String> = g
                .call
                .keys
                .iter()
                .map(|k| k.replace(OWNER, OWNER_SHOWN))
                .collect();
            let mut what: Vec<String> = names.iter().map(|n| format!("limit {n}")).collect();
            if g.record {
                what.push("the record".into());
            }
            if g.lease {
                what.push("the lease".into());
            }
            let when = if later && (g.record || g.lease) {
                " (after the other calls, only if they admit)"
            } else {
                ""
            };
            let _ = writeln!(
                calls_text,
                "call {}: {{{}}}: {}{when}",
                n + 1,
                g.tag,
                what.join(", ")
            );
            for k in &keys {
                let _ = writeln!(calls_text, "  {k}");
            }
            calls.push(json!({
                "hash_tag": g.tag,
                "limits": names,
                "record": g.record,
                "lease": g.lease,
                "keys": keys,
                "after_the_others": later && (g.record || g.lease),
            }));
        }
        Parts {
            limits,
            limit_text,
            record,
            record_text,
            lease,
            lease_text,
            calls,
            calls_text,
        }
    }

    fn write(self, text: &mut String, json: &mut Value, config: &Config, policy: &Policy) {
        text.push_str(&self.limit_text);
        text.push_str(&self.record_text);
        text.push_str(&self.lease_text);
        text.push_str(&self.calls_text);
        let leased = policy.rate_limits.iter().any(|l| l.leased);
        if !policy.rate_limits.is_empty() {
            let _ = writeln!(
                text,
                "(a counter this proxy saw reject is answered from its over-limit cache{}, \
                 without a call)",
                if leased {
                    ", a leased limit from its slice"
                } else {
                    ""
                }
            );
        }
        json["limits"] = Value::Array(self.limits);
        json["record"] = self.record;
        json["lease"] = self.lease;
        json["calls"] = Value::Array(self.calls);
        json["key_prefix"] = json!(config.redis.key_prefix);
    }
}

/// The record the request would take, or why none.
fn record(policy: &Policy, req: &Request, prepared: &Prepared) -> (Value, String) {
    let mut text = String::new();
    let Some(cfg) = &policy.idempotency else {
        return (Value::Null, text);
    };
    match &prepared.record {
        Some(g) => {
            let parts: Vec<String> = cfg
                .fingerprint
                .iter()
                .map(FingerprintPart::spelling)
                .collect();
            text.push_str("record (idempotency)\n");
            rows(
                &mut text,
                2,
                &[
                    ("key", g.acquire.key.clone()),
                    ("hash tag", g.acquire.tag.clone()),
                    ("key hash", g.key_hash.clone()),
                    (
                        "cancel marker",
                        g.acquire.cancel_key.replace(OWNER, OWNER_SHOWN),
                    ),
                    ("fingerprint", format!("sha256 of {}", parts.join(" + "))),
                    (
                        "kept",
                        format!(
                            "{} while processing, {} once completed",
                            show::duration(cfg.processing_ttl_ms),
                            show::duration(cfg.completed_ttl_ms)
                        ),
                    ),
                ],
            );
            (
                json!({
                    "key": g.acquire.key,
                    "hash_tag": g.acquire.tag,
                    "key_hash": g.key_hash,
                    "cancel_marker": g.acquire.cancel_key.replace(OWNER, OWNER_SHOWN),
                }),
                text,
            )
        }
        None => {
            let why = if cfg.applies_to(&req.method) {
                format!("the request has no {} header (optional here)", cfg.header)
            } else {
                format!(
                    "records are kept for {} only, not {}",
                    cfg.methods.join(", "),
                    req.method
                )
            };
            let _ = writeln!(text, "record    none: {why}");
            (json!({"key": null, "why": why}), text)
        }
    }
}

/// The lease the request would take.
fn lease(policy: &Policy, caller: &Caller, req: &Request, prepared: &Prepared) -> (Value, String) {
    let mut text = String::new();
    let (Some(cfg), Some(g)) = (&policy.lease, &prepared.lease) else {
        return (Value::Null, text);
    };
    let resource: Vec<String> = resource_parts(cfg, caller, req)
        .map(|parts| {
            parts
                .iter()
                .map(|(s, v)| {
                    format!(
                        "{}={:?}",
                        s.spelling(),
                        v.map(shown_identity).unwrap_or_default()
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    text.push_str("lease\n");
    rows(
        &mut text,
        2,
        &[
            ("key", g.acquire.key.clone()),
            ("fence key", g.acquire.fence_key.clone()),
            ("hash tag", g.acquire.tag.clone()),
            ("resource", resource.join(", ")),
            (
                "cancel marker",
                g.acquire.cancel_key.replace(OWNER, OWNER_SHOWN),
            ),
            (
                "ttl",
                format!(
                    "{}{}",
                    show::duration(cfg.ttl_ms),
                    if cfg.extend {
                        ", extended while the request runs"
                    } else {
                        ""
                    }
                ),
            ),
        ],
    );
    (
        json!({
            "key": g.acquire.key,
            "fence_key": g.acquire.fence_key,
            "hash_tag": g.acquire.tag,
            "cancel_marker": g.acquire.cancel_key.replace(OWNER, OWNER_SHOWN),
        }),
        text,
    )
}
