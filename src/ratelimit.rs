//! Rate limits of one request: which script calls to make, and what their replies mean.
//!
//! Keys, script arguments and the verdict. The calls themselves are planned by
//! [`crate::acquire`], which groups limits by hash tag.

use crate::config::{Policy, RateLimit};
use crate::keys;
use crate::request::{selector_value, Caller, Request};
use crate::respond::{self, LocalResponse, Problem, QuotaView};
use serde_json::{json, Map};
use std::fmt::Write;

/// The hash tag of a limit's key: the hashed tenant for tenant-scoped limits, else the policy.
pub fn tag(policy: &Policy, limit: &RateLimit, caller: &Caller) -> String {
    if limit.tenant_scoped() {
        keys::tenant_tag(&caller.tenant)
    } else {
        keys::policy_tag(&policy.name)
    }
}

/// The counter key of `limit` for this caller and request.
pub fn key(
    prefix: &str,
    policy: &Policy,
    limit: &RateLimit,
    caller: &Caller,
    req: &Request,
) -> String {
    let parts: Vec<(String, Option<&str>)> = limit
        .by
        .iter()
        .map(|sel| (sel.spelling(), selector_value(sel, caller, req)))
        .collect();
    keys::rate_limit_key(
        prefix,
        &tag(policy, limit, caller),
        policy,
        limit,
        &keys::scope_hash(&parts),
    )
}

/// The five per-limit arguments of `ratelimit.lua`.
pub fn limit_args(limit: &RateLimit) -> [String; 5] {
    [
        limit.code().to_string(),
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
/// `None` is a limit whose state is unknown (the over-limit cache answered for another one):
/// it is left out of the headers.
pub fn decide(policy: &Policy, states: &[Option<LimitState>]) -> Verdict {
    let enforced: Vec<(&RateLimit, &LimitState)> = policy
        .rate_limits
        .iter()
        .zip(states)
        .filter_map(|(l, s)| Some((l, s.as_ref()?)))
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
    let mut detail = String::from("rate limit ");
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            detail.push_str(", ");
        }
        detail.push('"');
        detail.push_str(n);
        detail.push('"');
    }
    let _ = write!(
        detail,
        " of operation \"{}\" exceeded; retry after {retry_after} s",
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
pub(crate) mod tests {
    use super::*;
    use crate::config::Config;

    /// A policy with one limit of each algorithm (one of them shadow), and one keyed by the
    /// client address only; the unit tests of this module and of `acquire` share it.
    pub(crate) fn config() -> Config {
        Config::parse(
            br#"{"redis": {"cluster": "gw", "key_prefix": "cg:demo"}, "policies": [
            {"name": "create-order", "rate_limits": [
              {"name": "tenant", "by": ["tenant"], "algorithm": "sliding_window", "limit": 100, "window": "1m"},
              {"name": "user-burst", "by": ["tenant", "principal"], "algorithm": "token_bucket", "limit": 10, "window": "1s", "burst": 20},
              {"name": "per-ip", "by": ["client_ip"], "algorithm": "fixed_window", "limit": 1000, "window": "1h", "shadow": true},
              {"name": "global", "by": [], "algorithm": "sliding_log", "limit": 5, "window": "250ms"}
            ]},
            {"name": "ip-only", "rate_limits": [
              {"name": "per-ip", "by": ["client_ip"], "algorithm": "fixed_window", "limit": 1000, "window": "1h"}
            ]}]}"#,
        )
        .expect("valid")
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
                Some(st(true, 50, 30_000, 0)),
                Some(st(true, 3, 700, 0)),
                Some(st(false, 0, 10, 10)),
                Some(st(true, 4, 250, 0)),
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
                Some(st(false, 0, 16_200, 16_200)),
                Some(st(true, 3, 700, 0)),
                Some(st(true, 1, 10, 0)),
                Some(st(false, 0, 200, 120)),
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
                Some(st(true, 1, 1, 0)),
                Some(st(true, 1, 1, 0)),
                Some(st(false, 0, 5, 5)),
                Some(st(true, 1, 1, 0)),
            ],
        );
        assert!(matches!(verdict, Verdict::Allow(_)));
    }
}
