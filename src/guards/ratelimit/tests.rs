use super::*;
use crate::config::Config;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

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
        quota: None,
        override_unreadable: false,
    }
}

/// What the over-limit cache knows of a limit rejecting for `ms` with the configuration's
/// quota.
fn known(ms: u64) -> Option<Known> {
    Some(Known {
        wait_ms: ms,
        quota: None,
    })
}

/// The memo answers what [`key`] builds: for every limit of the fixture (tenant,
/// tenant + principal, client address, none), for inputs that would run together
/// without length prefixes or are too long to memoise, and with one slot, so every other
/// lookup collides.
#[test]
fn key_memo_gives_the_built_key() {
    let c = config();
    let policy = &c.policies[0];
    let request = |ip: Option<&str>| {
        Request::from_headers(
            vec![
                (":method".into(), "POST".into()),
                (":path".into(), "/o".into()),
            ],
            ip,
        )
    };
    // Too long to memoise: built each time.
    let long = "t".repeat(MAX_MEMO_INPUT);
    let inputs = [
        (long.as_str(), "c", None),
        ("ab", "c", Some("10.0.0.1:1")),
        ("a", "bc", Some("10.0.0.1:1")),
        ("ab", "c", None),
        ("", "", Some("10.0.0.2:2")),
        ("ab", "c", Some("10.0.0.1:1")),
    ];
    for slots in [0, 1, 256] {
        let memo = KeyMemo::new(slots);
        for round in 0..2 {
            for (tenant, principal, ip) in inputs {
                let caller = Caller {
                    tenant: tenant.into(),
                    principal: principal.into(),
                };
                let req = request(ip);
                for (i, limit) in policy.rate_limits.iter().enumerate() {
                    assert_eq!(
                        memo.key("cg", (0, policy), (i, limit), &caller, &req),
                        key("cg", policy, limit, &caller, &req),
                        "slots {slots}, round {round}, {tenant:?}/{principal:?}/{ip:?}, limit {i}"
                    );
                }
            }
        }
    }
    // Two keys of different limits never share a memo entry.
    let memo = KeyMemo::new(256);
    let caller = Caller {
        tenant: "t".into(),
        principal: "p".into(),
    };
    let req = request(None);
    let keys: Vec<String> = policy
        .rate_limits
        .iter()
        .enumerate()
        .map(|l| {
            memo.key("cg", (0, policy), l, &caller, &req)
                .text()
                .to_string()
        })
        .collect();
    let mut unique = keys.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), keys.len(), "{keys:?}");
}

/// The `problem_type_base` the tests answer with.
const TYPES: &str = crate::config::DEFAULT_PROBLEM_TYPE_BASE;

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
        TYPES,
    );
    // The token bucket (10 per 1 s, burst 20) shows its capacity: 20 per the 2 s it takes to
    // fill.
    assert_eq!(
        verdict,
        Verdict::Allow(vec![
            (
                "ratelimit-policy".into(),
                "\"user-burst\";q=20;w=2, \"global\";q=5;w=1, \"tenant\";q=100;w=60".into()
            ),
            (
                "ratelimit".into(),
                "\"user-burst\";r=3;t=1, \"global\";r=4;t=1, \"tenant\";r=50;t=30".into()
            ),
        ])
    );
}

/// A policy with a concurrency limit, a limit counted in tokens (`cost`, `unit`) and one in
/// content bytes.
fn units_config() -> Config {
    Config::parse(
        br#"{"redis": {"cluster": "gw"}, "policies": [
        {"name": "llm", "rate_limits": [
          {"name": "inflight", "by": ["tenant"], "algorithm": "concurrency", "limit": 4, "window": "30s"},
          {"name": "tokens", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000, "window": "1m",
           "cost": {"header": "x-tokens", "max": 10000}, "unit": "tokens"},
          {"name": "bytes", "by": ["tenant"], "algorithm": "token_bucket", "limit": 1000, "window": "1s",
           "burst": 5000, "cost": {"header": "x-bytes", "max": 5000}, "unit": "content-bytes"}
        ]}]}"#,
    )
    .expect("valid")
}

/// Every enforced limit is in the headers, with its unit: a concurrency limit's slots with
/// `qu="concurrent-requests"`, no window and no `t`; a registered unit and a service's own
/// as `qu`.
#[test]
fn concurrency_and_cost_limits_show_their_units() {
    let c = units_config();
    let verdict = decide(
        &c.policies[0],
        &[
            Some(st(true, 3, 30_000, 0)),
            Some(st(true, 99_000, 42_100, 0)),
            Some(st(true, 4_000, 1, 0)),
        ],
        TYPES,
    );
    assert_eq!(
        verdict,
        Verdict::Allow(vec![
            (
                "ratelimit-policy".into(),
                "\"inflight\";q=4;qu=\"concurrent-requests\", \
                 \"bytes\";q=5000;qu=\"content-bytes\";w=5, \
                 \"tokens\";q=100000;qu=\"tokens\";w=60"
                    .into()
            ),
            (
                "ratelimit".into(),
                "\"inflight\";r=3, \"bytes\";r=4000;t=1, \"tokens\";r=99000;t=43".into()
            ),
        ])
    );
}

/// A full concurrency limit answers `429` quota-exceeded with its item in both headers
/// (`r=0`, no `t`) and `Retry-After: 1`; beside a violated rate limit, both are listed and
/// the longest wait is the `Retry-After`.
#[test]
fn a_full_concurrency_limit_is_in_the_headers_of_its_429() {
    let c = units_config();
    let verdict = decide(
        &c.policies[0],
        &[
            Some(st(false, 0, 30_000, 1000)),
            Some(st(true, 99_000, 42_100, 0)),
            None,
        ],
        TYPES,
    );
    let Verdict::Reject(r) = verdict else {
        panic!("expected a rejection");
    };
    assert_eq!(r.problem, Some(Problem::ConcurrencyLimited));
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"inflight\";q=4;qu=\"concurrent-requests\"")
    );
    assert_eq!(r.header("ratelimit"), Some("\"inflight\";r=0"));
    let body: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(body["type"], serde_json::json!(local_reply::QUOTA_EXCEEDED));
    assert_eq!(body["violated-policies"], serde_json::json!(["inflight"]));

    let verdict = decide(
        &c.policies[0],
        &[
            Some(st(false, 0, 30_000, 1000)),
            Some(st(false, 10, 42_100, 42_100)),
            None,
        ],
        TYPES,
    );
    let Verdict::Reject(r) = verdict else {
        panic!("expected a rejection");
    };
    assert_eq!(r.problem, Some(Problem::RateLimited));
    assert_eq!(r.header("retry-after"), Some("43"));
    assert_eq!(
        r.header("ratelimit"),
        Some("\"inflight\";r=0, \"tokens\";r=10;t=43")
    );
}

/// A limit counted with a tenant's own quota (an override) shows it in `RateLimit-Policy`,
/// allowed or rejected; the others show the configuration's.
#[test]
fn a_tenants_own_quota_is_the_one_shown() {
    let c = config();
    let own = |mut s: LimitState| {
        s.quota = Some(Quota {
            limit: 500,
            window_ms: 120_000,
        });
        s
    };
    let verdict = decide(
        &c.policies[0],
        &[
            Some(own(st(true, 50, 30_000, 0))),
            Some(st(true, 3, 700, 0)),
            None,
            None,
        ],
        TYPES,
    );
    let Verdict::Allow(headers) = verdict else {
        panic!("expected an admission");
    };
    assert_eq!(
        headers[0].1,
        "\"user-burst\";q=20;w=2, \"tenant\";q=500;w=120"
    );
    // A tenant's own token bucket shows its limit and window (its burst is not in the
    // reply), and `r` at most that.
    let verdict = decide(
        &c.policies[0],
        &[None, Some(own(st(true, 700, 100, 0))), None, None],
        TYPES,
    );
    let Verdict::Allow(headers) = verdict else {
        panic!("expected an admission");
    };
    assert_eq!(headers[0].1, "\"user-burst\";q=500;w=120");
    assert_eq!(headers[1].1, "\"user-burst\";r=500;t=1");
    let verdict = decide(
        &c.policies[0],
        &[Some(own(st(false, 0, 9_000, 9_000))), None, None, None],
        TYPES,
    );
    let Verdict::Reject(r) = verdict else {
        panic!("expected a rejection");
    };
    assert_eq!(r.header("ratelimit-policy"), Some("\"tenant\";q=500;w=120"));
}

/// A `429` lists the limits it violated and only those, in `violated-policies` and in both
/// headers by the same names; it has the registered quota-exceeded type. Each `t` is at most
/// the `Retry-After` (the longest wait); a limit the request did not violate, whose quota may
/// come back later than that, is left out.
#[test]
fn reject_names_violated_limits() {
    let c = config();
    let verdict = decide(
        &c.policies[0],
        &[
            Some(st(false, 0, 16_200, 16_200)),
            Some(st(true, 3, 700, 0)),
            Some(st(true, 1, 10, 0)),
            // A reset later than its own wait (never from the script) is still shown no later
            // than the Retry-After.
            Some(st(false, 0, 90_000, 120)),
        ],
        TYPES,
    );
    let Verdict::Reject(r) = verdict else {
        panic!("expected a rejection");
    };
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("17"));
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"tenant\";q=100;w=60, \"global\";q=5;w=1")
    );
    assert_eq!(
        r.header("ratelimit"),
        Some("\"tenant\";r=0;t=17, \"global\";r=0;t=17")
    );
    let body: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(
        body["violated-policies"],
        serde_json::json!(["tenant", "global"])
    );
    assert_eq!(body["status"], serde_json::json!(429));
    assert_eq!(body["type"], serde_json::json!(local_reply::QUOTA_EXCEEDED));
    assert_eq!(body["title"], serde_json::json!("Quota Exceeded"));
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
        TYPES,
    );
    assert!(matches!(verdict, Verdict::Allow(_)));
}

/// The memo answers exactly what the verdict would say, for every combination of limits
/// known to reject and waits around whole seconds (within a second, across one, a limit
/// joining or leaving, the shadow limit, a second policy): a stale `Retry-After` or
/// `RateLimit` never goes out. Within one second of every wait the answer is shared.
#[test]
fn rejection_memo_answers_what_the_verdict_says() {
    let c = config();
    let memo = RejectionMemo::new(c.policies.len());
    let waits_ms = [
        1, 999, 1000, 1001, 1999, 2000, 2001, 59_999, 60_000, 3_600_000,
    ];
    let own = Some(Quota {
        limit: 7,
        window_ms: 2_000,
    });
    let mut cases: Vec<(usize, Vec<Option<Known>>)> = Vec::new();
    for &a in &waits_ms {
        for &b in &waits_ms {
            cases.push((0, vec![known(a), None, None, known(b)]));
            cases.push((0, vec![None, known(a), None, None]));
            cases.push((0, vec![known(a), known(b), known(a), None]));
            cases.push((1, vec![known(b)]));
            // The same waits counted with a tenant's own quota: another answer.
            let with_own = Known {
                wait_ms: a,
                quota: own,
            };
            cases.push((0, vec![Some(with_own), None, None, known(b)]));
        }
        cases.push((0, vec![None, None, known(a), None]));
    }
    for (index, waits) in cases.iter().chain(cases.iter().rev()) {
        let policy = &c.policies[*index];
        let fresh = match decide(policy, &rejecting(waits), TYPES) {
            Verdict::Reject(r) => Some(r),
            Verdict::Allow(_) => None,
        };
        let memoised = memo.cached(*index, policy, waits, TYPES);
        assert_eq!(
            memoised.as_deref(),
            fresh.as_ref(),
            "policy {index}, waits {waits:?}"
        );
    }
    let policy = &c.policies[0];
    let first = memo.cached(0, policy, &[known(1_001), None, None, None], TYPES);
    let same_second = memo.cached(0, policy, &[known(1_999), None, None, None], TYPES);
    let next_second = memo.cached(0, policy, &[known(2_001), None, None, None], TYPES);
    let (Some(first), Some(same), Some(next)) = (first, same_second, next_second) else {
        panic!("each rejects");
    };
    assert!(Rc::ptr_eq(&first, &same), "one answer within a second");
    assert_eq!(next.header("retry-after"), Some("3"));
    assert_eq!(first.header("retry-after"), Some("2"));
    assert!(
        memo.cached(0, policy, &[None, None, known(5), None], TYPES)
            .is_none(),
        "the shadow limit alone admits"
    );
    assert!(
        RejectionMemo::new(0)
            .cached(0, policy, &[known(5), None, None, None], TYPES)
            .is_some(),
        "a policy beyond the memo is answered unmemoised"
    );
}
