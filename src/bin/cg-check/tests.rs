//! cg-check's checks of plugin JSON: summaries and the errors the filter would log.

use super::*;
// As in every test module: built for wasm32-unknown-unknown, tests run under
// wasm_bindgen_test (this host-only tool's are never built there).
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// The plugin JSON's check: no environment declared.
fn check_json(bytes: &[u8]) -> Result<String, String> {
    check(bytes, &Environment(None)).map(|(summary, warnings)| {
        assert!(warnings.is_empty(), "{warnings:?}");
        summary
    })
}

#[test]
fn a_valid_config_is_summarised() {
    let summary = check_json(
            br#"{"redis": {"cluster": "gw", "authorization_env": "CG_AUTH", "key_prefix": "cg:x"},
                 "policies": [
                   {"name": "orders", "match": {"methods": ["POST"], "path_prefix": "/orders"},
                    "rate_limits": [{"name": "t", "by": ["tenant"], "algorithm": "token_bucket",
                                     "limit": 10, "window": "1s", "burst": 20}],
                    "idempotency": {"encryption": {"key_env": "CG_KEY", "previous_key_env": "CG_OLD"}}},
                   {"name": "act", "match": {"path_exact": "/act"}, "failure_mode": "fail_open",
                    "lease": {"resource": ["path_segment:1"], "on_busy": "wait"}}]}"#,
        )
        .expect("valid");
    for want in [
            "credential from $CG_AUTH in the VM's environment",
            "policy 1 orders: POST, path /orders*",
            "limit t: 10 per 1s by tenant (token bucket, burst 20), shown as \"t\";q=20;w=2",
            "problems: type https://github.com/coordination-guard/coordination-guard/blob/main/docs/problems.md#<name> (problem_type_base), a 429 https://iana.org/assignments/http-problem-types#quota-exceeded",
            "key cg:x:rl:{t.<tenant>}:orders:t:tb:",
            "idempotency: idempotency-key on POST|PATCH (required)",
            "responses sealed (AES-256-GCM) with the key in $CG_KEY, opened also with $CG_OLD (not checked here)",
            "policy 2 act: path = /act",
            "fail_open",
            "lease on path_segment:1 (per tenant) for 10s, busy: wait up to 2s",
        ] {
            assert!(summary.contains(want), "{want:?} in\n{summary}");
        }
    assert!(summary.lines().count() < 25, "one screen:\n{summary}");
}

#[test]
fn a_path_template_and_its_params_are_summarised() {
    let summary = check_json(
        br#"{"redis": {"cluster": "gw", "key_prefix": "cg:x"}, "policies": [
             {"name": "transfer", "match": {"methods": ["POST"], "path_template": "/accounts/{id}/transfer"},
              "rate_limits": [{"name": "per-account", "by": ["tenant", "path_param:id"],
                               "algorithm": "fixed_window", "limit": 5, "window": "1m"}],
              "lease": {"resource": ["tenant", "path_param:id"]}},
             {"name": "files", "match": {"path_template": "/files/{rest=**}"}}]}"#,
    )
    .expect("valid");
    for want in [
        "policy 1 transfer: POST, path template /accounts/{id}/transfer ({id}: segment 2)",
        "limit per-account: 5 per 1m by tenant + path_param:id (fixed window)",
        "lease on tenant + path_param:id (per tenant) for 10s, busy: 409",
        "policy 2 files: path template /files/{rest=**} ({rest}: segments 2 on, any number (none included))",
    ] {
        assert!(summary.contains(want), "{want:?} in\n{summary}");
    }
    let err = check_json(
        br#"{"redis": {"cluster": "gw"}, "policies": [
             {"name": "transfer", "match": {"path_template": "/accounts/{id}/transfer"},
              "lease": {"resource": ["tenant", "path_param:account"]}}]}"#,
    )
    .expect_err("invalid");
    assert!(
        err.contains("policies[0].lease.resource[1]: path_param:account names no variable of match.path_template \"/accounts/{id}/transfer\" (it defines id)"),
        "{err}"
    );
}

#[test]
fn a_limit_that_reads_overrides_says_where() {
    let summary = check_json(
        br#"{"redis": {"cluster": "gw", "key_prefix": "cg:x"}, "policies": [{"name": "api",
             "rate_limits": [
               {"name": "t", "by": ["tenant"], "algorithm": "fixed_window", "limit": 10,
                "window": "1s", "overrides": true},
               {"name": "u", "by": ["tenant", "principal"], "algorithm": "fixed_window",
                "limit": 10, "window": "1s", "overrides": true},
               {"name": "plain", "by": ["tenant"], "algorithm": "fixed_window", "limit": 10,
                "window": "1s"}]}]}"#,
    )
    .expect("valid");
    for want in [
        "overrides: a tenant's own limit from cg:x:ovr:{t.<tenant>}:api:t:t, set with cg-admin override",
        "overrides: a tenant's own limit from cg:x:ovr:{t.<tenant>}:api:u:t (a principal's: …:p.<principal>, first), set with cg-admin override",
    ] {
        assert!(summary.contains(want), "{want:?} in\n{summary}");
    }
    assert_eq!(summary.matches("overrides:").count(), 2, "{summary}");
}

#[test]
fn a_cost_the_client_declares_with_no_charge_is_warned_about() {
    let config = br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "llm", "rate_limits": [
            {"name": "tokens", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000,
             "window": "1m", "cost": {"header": "x-request-cost", "max": 10000}},
            {"name": "charged", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000,
             "window": "1m", "cost": {"header": "x-request-cost", "max": 10000},
             "charge": {"response_json": "/usage/total_tokens"}}]}]}"#;
    let (summary, warnings) = check(config, &Environment(None)).expect("valid");
    assert_eq!(
        warnings,
        [
            "policies[0].rate_limits[0] (llm/tokens): the client declares its own cost in \
              x-request-cost and no charge corrects it, so a client pays what it says (at least \
              min, 1): add a charge read from the response, or let a layer the client cannot \
              bypass set x-request-cost"
        ]
    );
    assert!(
        summary.contains(
            "charged from the JSON body at /usage/total_tokens (up to 1048576 bytes), \
                 unreadable: 10000 (max)"
        ),
        "{summary}"
    );
    assert!(
        summary.contains("memory: 67108864 bytes per worker"),
        "{summary}"
    );
}

/// Each enforced limit says how the RateLimit headers show it: its unit, a concurrency
/// limit's slots, a token bucket's capacity; a shadow limit is never shown. The problem type
/// base is the configured one.
#[test]
fn the_summary_shows_each_limit_as_the_headers_do() {
    let summary = check_json(
        br#"{"redis": {"cluster": "gw"}, "problem_type_base": "https://api.example.com/problems/",
             "policies": [{"name": "llm", "rate_limits": [
               {"name": "inflight", "by": ["tenant"], "algorithm": "concurrency", "limit": 4,
                "window": "30s"},
               {"name": "tokens", "by": ["tenant"], "algorithm": "sliding_window", "limit": 100000,
                "window": "1m", "cost": {"header": "x-tokens", "max": 10000},
                "charge": {"response_json": "/usage/total_tokens"}, "unit": "tokens"},
               {"name": "shadow", "by": ["tenant"], "algorithm": "fixed_window", "limit": 10,
                "window": "1s", "shadow": true}]}]}"#,
    )
    .expect("valid");
    for want in [
        "limit inflight: 4 at once by tenant (in flight, a slot lives 30s unless extended), \
         shown as \"inflight\";q=4;qu=\"concurrent-requests\"",
        "unreadable: 10000 (max)), shown as \"tokens\";q=100000;qu=\"tokens\";w=60",
        "limit shadow: 10 per 1s by tenant (fixed window), shadow: counted, never rejects",
        "problems: type https://api.example.com/problems/<name> (problem_type_base)",
    ] {
        assert!(summary.contains(want), "{want:?} in\n{summary}");
    }
    assert_eq!(summary.matches("shown as").count(), 2, "{summary}");
}

#[test]
fn an_event_stream_charge_is_explained_and_its_cut_streams_warned_about() {
    let config = br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "chat", "rate_limits": [
            {"name": "prompt", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000,
             "window": "1d", "cost": {"header": "x-request-cost", "max": 10000},
             "charge": {"response_sse_json": "/usage/prompt_tokens"}},
            {"name": "completion", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000,
             "window": "1d", "charge": {"response_sse_json": "/usage/completion_tokens",
             "missing": "max", "unreadable": 0}},
            {"name": "total", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000,
             "window": "1d", "charge": {"response_sse_json": "/usage/total_tokens"}}]}]}"#;
    let (summary, warnings) = check(config, &Environment(None)).expect("valid");
    for want in [
        "charged from the last event of an event stream with a number at /usage/prompt_tokens \
         (or a JSON answer's, up to 1048576 bytes), a stream without it: the admitted cost, \
         unreadable: 10000 (max)",
        "charged from the last event of an event stream with a number at \
         /usage/completion_tokens (or a JSON answer's, up to 1048576 bytes), a stream without \
         it: 100000 (max), unreadable: 0",
    ] {
        assert!(summary.contains(want), "{want:?} in\n{summary}");
    }
    assert_eq!(
        warnings,
        [
            "policies[0].rate_limits[0] (chat/prompt): an event stream that ends before its \
             usage (the client left) is charged the admitted cost, which the client declares in \
             x-request-cost (at least min, 1): set charge.missing to \"max\" or a number of \
             units if a client could leave early to pay less",
            "policies[0].rate_limits[2] (chat/total): an event stream that ends before its \
             usage (the client left) is charged the admitted cost, 1 unit (no cost is set): set \
             charge.missing to \"max\" or a number of units if a client could leave early to \
             pay less",
        ]
    );
}

#[test]
fn an_invalid_config_gives_the_filters_error() {
    for (config, want) in [
        (
            r#"{"redis": {"cluster": "gw"}, "policies": [{"name": "p", "rate_limits": [
                    {"name": "t", "by": [], "algorithm": "fixed_window", "limit": 1, "window": "5x"}]}]}"#,
            "policies[0].rate_limits[0].window: \"5x\" is not a duration",
        ),
        (r#"{"policies": []}"#, "redis: is required"),
        ("{", "configuration is not valid JSON"),
    ] {
        let err = check_json(config.as_bytes()).expect_err("invalid");
        assert!(err.contains(want), "{want:?} in {err}");
    }
}

/// A calendar quota is explained as one: its period, its zone by name and rule, and where a
/// period starts.
#[test]
fn a_calendar_quota_says_its_period_and_zone() {
    let summary = check_json(
        br#"{"redis": {"cluster": "gw", "key_prefix": "cg:x"}, "policies": [{"name": "api",
             "rate_limits": [
               {"name": "monthly", "by": ["tenant"], "algorithm": "fixed_window",
                "limit": 10000, "window": "1mo", "align": "calendar",
                "zone": {"name": "Europe/Berlin", "rule": "CET-1CEST,M3.5.0,M10.5.0/3"}},
               {"name": "daily", "by": ["tenant"], "algorithm": "fixed_window", "limit": 500,
                "window": "1d", "align": "calendar", "zone": "+05:30"},
               {"name": "weekly", "by": [], "algorithm": "fixed_window", "limit": 9,
                "window": "1w", "align": "calendar"}]}]}"#,
    )
    .expect("valid");
    for want in [
        "limit monthly: 10000 per calendar month, Europe/Berlin (CET-1CEST,M3.5.0,M10.5.0/3) by \
         tenant (fixed window from the local midnight that starts each month)",
        "limit daily: 500 per calendar day, +05:30 by tenant (fixed window from each local \
         midnight)",
        "limit weekly: 9 per calendar week (from Monday), UTC by the whole policy (fixed \
         window from each Monday's local midnight)",
        "key cg:x:rl:{t.<tenant>}:api:monthly:fw:",
    ] {
        assert!(summary.contains(want), "{want:?} in\n{summary}");
    }
}

/// A zone given by its bare name is refused by the filter (it has no time-zone database); the
/// check adds the object to write when this machine's tzdata has the zone.
#[test]
fn a_bare_zone_name_is_refused_with_the_object_to_write() {
    let config = |zone: &str| {
        format!(
            r#"{{"redis": {{"cluster": "gw"}}, "policies": [{{"name": "p", "rate_limits": [
                {{"name": "m", "by": [], "algorithm": "fixed_window", "limit": 1,
                  "window": "1mo", "align": "calendar", "zone": "{zone}"}}]}}]}}"#
        )
    };
    let err = check_json(config("Europe/Berlin").as_bytes()).expect_err("a bare name");
    assert!(
        err.starts_with(
            "policies[0].rate_limits[0].zone: \"Europe/Berlin\" is a time-zone name, and the \
             filter carries no time-zone database"
        ),
        "{err}"
    );
    let rule = zoneinfo::rule("Europe/Berlin").expect("this machine's tzdata has Europe/Berlin");
    assert!(
        err.ends_with(&format!(
            "\n  this machine's tzdata gives: \"zone\": {{\"name\": \"Europe/Berlin\", \"rule\": \
             \"{rule}\"}}"
        )),
        "{err}"
    );
    // No such zone here: the filter's error alone.
    let err = check_json(config("Mars/Olympus_Mons").as_bytes()).expect_err("a bare name");
    assert!(!err.contains("tzdata gives"), "{err}");
}

/// A configured rule that is not the one this machine's tzdata gives for its name is warned
/// about (the periods follow the configuration's rule).
#[test]
fn a_rule_unlike_this_machines_tzdata_is_warned_about() {
    let config = |rule: &str| {
        format!(
            r#"{{"redis": {{"cluster": "gw"}}, "policies": [{{"name": "p", "rate_limits": [
                {{"name": "m", "by": [], "algorithm": "fixed_window", "limit": 1,
                  "window": "1mo", "align": "calendar",
                  "zone": {{"name": "Europe/Berlin", "rule": "{rule}"}}}}]}}]}}"#
        )
    };
    let here = zoneinfo::rule("Europe/Berlin").expect("this machine's tzdata has Europe/Berlin");
    let (_, warnings) = check(config(&here).as_bytes(), &Environment(None)).expect("valid");
    assert!(warnings.is_empty(), "{warnings:?}");
    let (_, warnings) = check(config("CET-1").as_bytes(), &Environment(None)).expect("valid");
    assert_eq!(
        warnings,
        [format!(
            "policies[0].rate_limits[0].zone (p/m): the rule \"CET-1\" is not the one this \
             machine's tzdata gives for Europe/Berlin, \"{here}\": the periods follow the \
             configuration's; if the zone's rules changed, write \"zone\": {{\"name\": \
             \"Europe/Berlin\", \"rule\": \"{here}\"}}"
        )]
    );
}
