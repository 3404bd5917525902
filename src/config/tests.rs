use crate::config::*;
use serde_json::json;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn base() -> Value {
    json!({
        "redis": {
            "protocol": "webdis",
            "cluster": "redis_gateway",
            "authority": "redis-gateway",
            "timeout": "50ms",
            "authorization": "Basic Y2c6c2VjcmV0",
            "key_prefix": "cg:demo"
        },
        "identity": {
            "tenant_header": "x-tenant-id",
            "principal_header": "x-user-id",
            "missing_tenant": "reject"
        },
        "failure_mode": "fail_closed",
        "response_headers": true,
        "policies": [
            {
                "name": "create-order",
                "match": { "methods": ["POST"], "path_prefix": "/orders" },
                "failure_mode": "fail_closed",
                "rate_limits": [
                    { "name": "tenant", "by": ["tenant"], "algorithm": "sliding_window", "limit": 100, "window": "1m" },
                    { "name": "user-burst", "by": ["tenant", "principal"], "algorithm": "token_bucket", "limit": 10, "window": "1s", "burst": 20 },
                    { "name": "per-ip", "by": ["client_ip"], "algorithm": "fixed_window", "limit": 1000, "window": "1h", "shadow": true }
                ]
            },
            { "name": "default", "rate_limits": [ { "name": "global", "by": [], "algorithm": "fixed_window", "limit": 5000, "window": "1s" } ] }
        ]
    })
}

/// Applies `edit` to the base config at a JSON pointer and returns the error text.
fn error_after(pointer: &str, edit: Value) -> String {
    let mut v = base();
    if edit.is_null() {
        let (parent, field) = pointer.rsplit_once('/').expect("pointer has a parent");
        v.pointer_mut(parent)
            .and_then(Value::as_object_mut)
            .expect("parent is an object")
            .remove(field);
    } else {
        let (parent, field) = pointer.rsplit_once('/').expect("pointer has a parent");
        let target = v.pointer_mut(parent).expect("parent exists");
        match target {
            Value::Object(map) => {
                map.insert(field.to_string(), edit);
            }
            Value::Array(items) => {
                let i: usize = field.parse().expect("array index");
                if i < items.len() {
                    items[i] = edit;
                } else {
                    items.push(edit);
                }
            }
            _ => panic!("cannot edit {pointer}"),
        }
    }
    match Config::from_value(&v) {
        Ok(_) => "OK".to_string(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_issue_example_is_valid() {
    let c = Config::from_value(&base()).expect("valid");
    assert_eq!(c.redis.timeout_ms, 50);
    assert_eq!(c.redis.key_prefix, "cg:demo");
    assert_eq!(c.policies.len(), 2);
    let p = &c.policies[0];
    assert_eq!(p.matcher.methods, vec!["POST"]);
    assert_eq!(p.rate_limits[0].window_ms, 60_000);
    assert_eq!(p.rate_limits[0].burst, 100, "burst defaults to limit");
    assert_eq!(p.rate_limits[1].burst, 20);
    assert!(p.rate_limits[2].shadow);
    assert_eq!(
        c.policies[1].failure_mode,
        FailureMode::Closed,
        "inherits top level"
    );
}

#[test]
fn defaults() {
    let c = Config::parse(br#"{"redis": {"cluster": "gw"}}"#).expect("valid");
    assert_eq!(c.redis.authority, "gw");
    assert_eq!(c.redis.timeout_ms, DEFAULT_TIMEOUT_MS);
    assert_eq!(c.redis.key_prefix, "cg");
    assert_eq!(c.redis.authorization, None);
    assert_eq!(c.identity.tenant, IdSource::Header("x-tenant-id".into()));
    assert_eq!(c.identity.missing_tenant, MissingTenant::Reject);
    assert_eq!(c.failure_mode, FailureMode::Closed);
    assert!(c.response_headers);
    assert!(c.policies.is_empty());
}

#[test]
fn policy_failure_mode_overrides_default() {
    let mut v = base();
    v["failure_mode"] = json!("fail_open");
    let c = Config::from_value(&v).expect("valid");
    assert_eq!(c.policies[0].failure_mode, FailureMode::Closed);
    assert_eq!(c.policies[1].failure_mode, FailureMode::Open);
}

#[test]
fn bad_configs_name_the_field() {
    let cases: &[(&str, &str, Value, &str)] = &[
        ("bad_window", "/policies/1/rate_limits/0/window", json!("5x"),
         "policies[1].rate_limits[0].window: \"5x\" is not a duration (use e.g. \"250ms\", \"2s\", \"1m\", \"24h\")"),
        ("zero_window", "/policies/0/rate_limits/2/window", json!("0s"),
         "policies[0].rate_limits[2].window: \"0s\" is not a duration (use e.g. \"250ms\", \"2s\", \"1m\", \"24h\")"),
        ("numeric_window", "/policies/0/rate_limits/0/window", json!(60),
         "policies[0].rate_limits[0].window: 60 is not a duration (a string such as \"2s\")"),
        ("zero_limit", "/policies/0/rate_limits/0/limit", json!(0),
         "policies[0].rate_limits[0].limit: 0 is not a positive integer (must be > 0)"),
        ("negative_limit", "/policies/0/rate_limits/1/limit", json!(-3),
         "policies[0].rate_limits[1].limit: -3 is not a positive integer (must be > 0)"),
        ("fractional_limit", "/policies/0/rate_limits/1/limit", json!(1.5),
         "policies[0].rate_limits[1].limit: 1.5 is not a positive integer (must be > 0)"),
        ("missing_limit", "/policies/0/rate_limits/0/limit", Value::Null,
         "policies[0].rate_limits[0].limit: is required"),
        ("huge_limit", "/policies/0/rate_limits/0/limit", json!(2_000_000_000u64),
         "policies[0].rate_limits[0].limit: 2000000000 is too large (at most 1000000000)"),
        ("empty_policy_name", "/policies/1/name", json!(""),
         "policies[1].name: must not be empty"),
        ("dotted_policy_name", "/policies/1/name", json!("a.b"),
         "policies[1].name: \"a.b\" must be 1-64 characters of [A-Za-z0-9_-]"),
        ("duplicate_policy", "/policies/1/name", json!("create-order"),
         "policies[1].name: duplicate policy name \"create-order\""),
        ("duplicate_limit", "/policies/0/rate_limits/1/name", json!("tenant"),
         "policies[0].rate_limits[1].name: duplicate rate limit name \"tenant\" in this policy"),
        ("empty_limit_name", "/policies/0/rate_limits/1/name", json!(""),
         "policies[0].rate_limits[1].name: must not be empty"),
        ("unknown_top", "/rate_limit", json!(1),
         "rate_limit: unknown field (known here: envoy_buffer_limit, failure_mode, identity, memory_budget, over_limit_cache, policies, problem_type_base, redis, response_headers)"),
        ("unknown_in_limit", "/policies/0/rate_limits/0/windw", json!("1s"),
         "policies[0].rate_limits[0].windw: unknown field (did you mean `window`?)"),
        ("path_with_double_slash", "/policies/0/match/path_prefix", json!("/orders//x"),
         "policies[0].match.path_prefix: \"/orders//x\" is not a normalised path (requests are matched decoded, with slashes merged and dot segments removed): write \"/orders/x\""),
        ("path_with_escape", "/policies/0/match/path_exact", json!("/%6Frders"),
         "policies[0].match.path_exact: \"/%6Frders\" is not a normalised path (requests are matched decoded, with slashes merged and dot segments removed): write \"/orders\""),
        ("path_with_encoded_slash", "/policies/0/match/path_prefix", json!("/a%2Fb"),
         "policies[0].match.path_prefix: \"/a%2Fb\" is not a normalised path (requests are matched decoded, with slashes merged and dot segments removed): spell it without encoded '/', '\\', NUL, ';' or '..'"),
        ("template_unclosed", "/policies/1/match", json!({"path_template": "/orders/{id"}),
         "policies[1].match.path_template: \"/orders/{id\" is not a path template: a '{' has no '}'"),
        ("template_escape", "/policies/1/match", json!({"path_template": "/%6Frders/{id}"}),
         "policies[1].match.path_template: \"/%6Frders/{id}\" is not a path template: \"%6Frders\" holds '%': requests are matched decoded, so write the character itself (an encoded '/', '\\' or NUL is refused in a request)"),
        ("template_glob_after_rest", "/policies/1/match", json!({"path_template": "/files/{rest=**}/{name}"}),
         "policies[1].match.path_template: \"/files/{rest=**}/{name}\" is not a path template: '**' must be the last operator: only literals may follow it (a variable without '=' is a '*')"),
        ("template_beside_prefix", "/policies/0/match/path_template", json!("/orders/{id}"),
         "policies[0].match.path_template: give one of path_prefix, path_exact and path_template, not path_prefix and path_template both"),
        ("exact_beside_prefix", "/policies/0/match/path_exact", json!("/orders"),
         "policies[0].match.path_exact: give one of path_prefix, path_exact and path_template, not path_prefix and path_exact both"),
        ("path_param_without_template", "/policies/0/rate_limits/1/by/1", json!("path_param:id"),
         "policies[0].rate_limits[1].by[1]: path_param:id reads a variable of match.path_template, and this policy's match has none (e.g. \"path_template\": \"/accounts/{id}/transfer\")"),
        ("path_param_bad_name", "/policies/0/rate_limits/1/by/1", json!("path_param:1d"),
         "policies[0].rate_limits[1].by[1]: \"path_param:1d\" is not a selector (tenant, principal, client_ip, method, path, header:<name>, path_segment:<n>, query:<name>, path_param:<name>)"),
        ("query_selector_with_escape", "/policies/0/rate_limits/1/by/1", json!("query:i%64"),
         "policies[0].rate_limits[1].by[1]: \"query:i%64\" is not a selector (tenant, principal, client_ip, method, path, header:<name>, path_segment:<n>, query:<name>, path_param:<name>)"),
        ("unknown_in_match", "/policies/0/match/path", json!("/x"),
         "policies[0].match.path: unknown field (known here: headers, host, methods, path_exact, path_prefix, path_template)"),
        ("bad_algorithm", "/policies/0/rate_limits/0/algorithm", json!("leaky"),
         "policies[0].rate_limits[0].algorithm: \"leaky\" is not one of fixed_window, sliding_window, sliding_log, token_bucket, concurrency"),
        ("bad_selector", "/policies/0/rate_limits/1/by/1", json!("user"),
         "policies[0].rate_limits[1].by[1]: \"user\" is not a selector (tenant, principal, client_ip, method, path, header:<name>, path_segment:<n>, query:<name>, path_param:<name>)"),
        ("bad_header_selector", "/policies/0/rate_limits/1/by/1", json!("header:"),
         "policies[0].rate_limits[1].by[1]: \"header:\" is not a selector (tenant, principal, client_ip, method, path, header:<name>, path_segment:<n>, query:<name>, path_param:<name>)"),
        ("duplicate_selector", "/policies/0/rate_limits/1/by/1", json!("tenant"),
         "policies[0].rate_limits[1].by[1]: \"tenant\" is listed twice"),
        ("burst_on_window", "/policies/0/rate_limits/0/burst", json!(5),
         "policies[0].rate_limits[0].burst: only applies to algorithm token_bucket"),
        ("zero_burst", "/policies/0/rate_limits/1/burst", json!(0),
         "policies[0].rate_limits[1].burst: 0 is not a positive integer (must be > 0)"),
        ("bad_failure_mode", "/policies/0/failure_mode", json!("open"),
         "policies[0].failure_mode: \"open\" is not one of \"fail_open\", \"fail_closed\""),
        ("bad_top_failure_mode", "/failure_mode", json!(true),
         "failure_mode: expected a string, found a boolean"),
        ("bad_timeout", "/redis/timeout", json!("fast"),
         "redis.timeout: \"fast\" is not a duration (use e.g. \"250ms\", \"2s\", \"1m\", \"24h\")"),
        ("bad_protocol", "/redis/protocol", json!("resp"),
         "redis.protocol: \"resp\" is not supported (supported: \"webdis\")"),
        ("missing_cluster", "/redis/cluster", Value::Null, "redis.cluster: is required"),
        ("empty_cluster", "/redis/cluster", json!(""), "redis.cluster: must not be empty"),
        ("braced_prefix", "/redis/key_prefix", json!("cg:{x}"),
         "redis.key_prefix: \"cg:{x}\" must be 1-64 printable ASCII characters without spaces, '{' or '}'"),
        ("bad_missing_tenant", "/identity/missing_tenant", json!("allow"),
         "identity.missing_tenant: \"allow\" is not one of \"reject\", \"anonymous\""),
        ("bad_tenant_header", "/identity/tenant_header", json!("x tenant"),
         "identity.tenant_header: \"x tenant\" is not an HTTP header name"),
        ("bad_method", "/policies/0/match/methods/0", json!("PO ST"),
         "policies[0].match.methods[0]: \"PO ST\" is not an HTTP method"),
        ("relative_prefix", "/policies/0/match/path_prefix", json!("orders"),
         "policies[0].match.path_prefix: \"orders\" must start with '/'"),
        ("policies_not_array", "/policies", json!({}),
         "policies: expected an array, found an object"),
        ("limit_not_object", "/policies/0/rate_limits/0", json!("tenant"),
         "policies[0].rate_limits[0]: expected an object, found a string"),
        ("tb_window_too_short", "/policies/0/rate_limits/1/window", json!("5ms"),
         "policies[0].rate_limits[1].window: token_bucket needs window >= limit milliseconds (10ms)"),
        ("shadow_not_bool", "/policies/0/rate_limits/2/shadow", json!("yes"),
         "policies[0].rate_limits[2].shadow: expected true or false, found a string"),
        ("bad_align", "/policies/0/rate_limits/2/align", json!("midnight"),
         "policies[0].rate_limits[2].align: \"midnight\" is not one of \"first_hit\", \"calendar\""),
        ("calendar_sliding_window", "/policies/0/rate_limits/0/align", json!("calendar"),
         "policies[0].rate_limits[0].align: \"calendar\" needs algorithm fixed_window (a quota \
          per calendar day, week or month); a sliding window, a log, a bucket or an in-flight \
          cap has no period to align"),
        ("calendar_duration_window", "/policies/0/rate_limits/2/align", json!("calendar"),
         "policies[0].rate_limits[2].window: \"1h\" is not a calendar period: with align \
          \"calendar\" the window is \"1d\" (a day), \"1w\" (a week from Monday) or \"1mo\" \
          (a month)"),
        ("month_without_align", "/policies/0/rate_limits/2/window", json!("1mo"),
         "policies[0].rate_limits[2].window: \"1mo\" is a calendar period: add \"align\": \
          \"calendar\" (a fixed window from the start of each week or month in a zone), or give \
          a duration"),
        ("zone_without_align", "/policies/0/rate_limits/2/zone", json!("+02:00"),
         "policies[0].rate_limits[2].zone: only applies with \"align\": \"calendar\""),
        ("bad_authorization", "/redis/authorization", json!("Basic\nx"),
         "redis.authorization: must be a non-empty printable ASCII header value"),
        ("problem_type_base_not_string", "/problem_type_base", json!(1),
         "problem_type_base: expected a string, found a number"),
        ("problem_type_base_relative", "/problem_type_base", json!("/docs/problems#"),
         "problem_type_base: \"/docs/problems#\" is not an absolute https:// or http:// URI"),
        ("problem_type_base_urn", "/problem_type_base", json!("urn:example:problem:"),
         "problem_type_base: \"urn:example:problem:\" is not an absolute https:// or http:// URI"),
        ("problem_type_base_no_host", "/problem_type_base", json!("https:///problems/"),
         "problem_type_base: \"https:///problems/\" names no host"),
        ("problem_type_base_quote", "/problem_type_base", json!("https://x.example/\"p\"/"),
         "problem_type_base: \"https://x.example/\\\"p\\\"/\" holds a character a URI cannot (a space, a quote, '<', '>', '\\', a control or non-ASCII character): percent-encode it"),
        ("problem_type_base_space", "/problem_type_base", json!("https://x.example/a b/"),
         "problem_type_base: \"https://x.example/a b/\" holds a character a URI cannot (a space, a quote, '<', '>', '\\', a control or non-ASCII character): percent-encode it"),
        ("problem_type_base_angle", "/problem_type_base", json!("https://x.example/<p>/"),
         "problem_type_base: \"https://x.example/<p>/\" holds a character a URI cannot (a space, a quote, '<', '>', '\\', a control or non-ASCII character): percent-encode it"),
        ("problem_type_base_unicode", "/problem_type_base", json!("https://x.example/ü/"),
         "problem_type_base: \"https://x.example/ü/\" holds a character a URI cannot (a space, a quote, '<', '>', '\\', a control or non-ASCII character): percent-encode it"),
        ("problem_type_base_no_separator", "/problem_type_base", json!("https://x.example/problems"),
         "problem_type_base: \"https://x.example/problems\" must end with '/', '#' or '=': the problem's name (e.g. guard_unavailable) is appended to it"),
        ("problem_type_base_too_long", "/problem_type_base", json!(format!("https://x.example/{}/", "a".repeat(500))),
         "problem_type_base: is longer than 512 bytes"),
        ("unit_not_string", "/policies/0/rate_limits/0/unit", json!(["tokens"]),
         "policies[0].rate_limits[0].unit: expected a string, found an array"),
        ("unit_upper_case", "/policies/0/rate_limits/0/unit", json!("Tokens"),
         "policies[0].rate_limits[0].unit: \"Tokens\" is not a quota unit: 1-32 of [a-z0-9-], starting with a letter (e.g. \"requests\", \"content-bytes\", \"tokens\")"),
        ("unit_quote", "/policies/0/rate_limits/0/unit", json!("tok\"ens"),
         "policies[0].rate_limits[0].unit: \"tok\\\"ens\" is not a quota unit: 1-32 of [a-z0-9-], starting with a letter (e.g. \"requests\", \"content-bytes\", \"tokens\")"),
        ("unit_empty", "/policies/0/rate_limits/0/unit", json!(""),
         "policies[0].rate_limits[0].unit: \"\" is not a quota unit: 1-32 of [a-z0-9-], starting with a letter (e.g. \"requests\", \"content-bytes\", \"tokens\")"),
        ("unit_too_long", "/policies/0/rate_limits/0/unit", json!("t".repeat(33)),
         "policies[0].rate_limits[0].unit: \"ttttttttttttttttttttttttttttttttt\" is not a quota unit: 1-32 of [a-z0-9-], starting with a letter (e.g. \"requests\", \"content-bytes\", \"tokens\")"),
        ("unit_concurrent_on_a_window", "/policies/0/rate_limits/0/unit", json!("concurrent-requests"),
         "policies[0].rate_limits[0].unit: \"concurrent-requests\" is the unit of algorithm concurrency"),
        ("unit_misspelt", "/policies/0/rate_limits/0/units", json!("tokens"),
         "policies[0].rate_limits[0].units: unknown field (did you mean `unit`?)"),
    ];
    for (name, pointer, edit, want) in cases {
        assert_eq!(&error_after(pointer, edit.clone()), want, "case {name}");
    }
}

#[test]
fn not_json_is_refused() {
    let err = Config::parse(b"{redis").expect_err("invalid");
    assert!(
        err.to_string()
            .starts_with("configuration is not valid JSON"),
        "{err}"
    );
}

#[test]
fn missing_redis_is_refused() {
    let err = Config::parse(b"{}").expect_err("invalid");
    assert_eq!(err.to_string(), "redis: is required");
}

fn with_idempotency(idem: Value) -> std::result::Result<Config, ConfigError> {
    let mut v = base();
    v["policies"][0]["idempotency"] = idem;
    Config::from_value(&v)
}

#[test]
fn idempotency_defaults_and_example() {
    let c = with_idempotency(json!({})).expect("valid");
    let i = c.policies[0].idempotency.as_ref().expect("present");
    assert_eq!(i.header, "idempotency-key");
    assert!(i.required);
    assert_eq!(i.methods, vec!["POST", "PATCH"]);
    assert_eq!(
        (i.processing_ttl_ms, i.completed_ttl_ms),
        (120_000, 86_400_000)
    );
    assert_eq!(
        i.fingerprint,
        vec![
            FingerprintPart::Method,
            FingerprintPart::Path,
            FingerprintPart::Principal,
            FingerprintPart::Body
        ]
    );
    // Half of Envoy's default 1 MiB buffer limit for requests (1 MiB once it is raised).
    assert_eq!(
        (i.max_request_body, i.max_response_body),
        (512 << 10, 64 << 10)
    );
    assert_eq!(c.envoy_buffer_limit, 1 << 20);
    assert_eq!(i.replay, Replay::Full);
    assert_eq!(i.replay_headers, vec!["content-type", "location", "etag"]);
    assert!(i.replay_trailers.is_empty());
    assert_eq!(i.retryable_grpc_codes, vec![14, 4, 8, 10]);
    for (code, retry) in [
        (14, true),
        (4, true),
        (8, true),
        (10, true),
        (0, false),
        (2, false),
        (5, false),
        (13, false),
    ] {
        assert_eq!(i.retryable_grpc(code), retry, "{code}");
    }
    assert_eq!(i.conflict_status, 422);
    assert_eq!(i.complete, Completion::Sync);
    for (status, retry) in [
        (500, true),
        (503, true),
        (408, true),
        (425, true),
        (429, true),
        (400, false),
        (409, false),
        (201, false),
        (302, false),
    ] {
        assert_eq!(i.retryable(status), retry, "{status}");
    }
    let example = with_idempotency(json!({
        "header": "Idempotency-Key", "required": true, "methods": ["POST", "PATCH"],
        "processing_ttl": "2m", "completed_ttl": "24h", "fingerprint": ["method", "path", "body"],
        "max_request_body": "512KiB", "replay": "full", "max_response_body": "64KiB",
        "replay_headers": ["content-type", "location", "etag"], "conflict_status": 409,
        "retryable_statuses": ["5xx", 429], "complete": "async"
    }))
    .expect("valid");
    let i = example.policies[0].idempotency.as_ref().expect("present");
    assert_eq!(i.conflict_status, 409);
    assert!(!i.fingerprint.contains(&FingerprintPart::Principal));
    assert!(!i.retryable(408));
    assert_eq!(i.complete, Completion::Async);
    let grpc = with_idempotency(json!({
        "replay_trailers": ["X-Checksum", "grpc-status-details-bin"],
        "retryable_grpc_codes": ["UNAVAILABLE", 13, "aborted", "4"]
    }))
    .expect("valid");
    let i = grpc.policies[0].idempotency.as_ref().expect("present");
    assert_eq!(
        i.replay_trailers,
        vec!["x-checksum", "grpc-status-details-bin"]
    );
    assert_eq!(i.retryable_grpc_codes, vec![14, 13, 10, 4]);
    assert!(!i.retryable_grpc(8));
    let none = with_idempotency(json!({"retryable_grpc_codes": []})).expect("valid");
    let i = none.policies[0].idempotency.as_ref().expect("present");
    assert!(!i.retryable_grpc(14));
}

#[test]
fn bad_idempotency_names_the_field() {
    let cases: &[(&str, Value, &str)] = &[
        ("ttl", json!({"processing_ttl": "2 minutes"}),
         "policies[0].idempotency.processing_ttl: \"2 minutes\" is not a duration (use e.g. \"250ms\", \"2s\", \"1m\", \"24h\")"),
        ("size", json!({"max_request_body": "1GB"}),
         "policies[0].idempotency.max_request_body: \"1GB\" is not a size (use e.g. \"64KiB\", \"1MiB\")"),
        ("request_at_envoy_limit", json!({"max_request_body": "1MiB"}),
         "policies[0].idempotency.max_request_body: 1048576 bytes is not below envoy_buffer_limit (1048576 bytes): Envoy answers 413 itself once a filter buffers more of a request body than the listener's per_connection_buffer_limit_bytes; lower it, or raise that Envoy setting and envoy_buffer_limit together"),
        ("response_over_envoy_limit", json!({"max_response_body": "2MiB"}),
         "policies[0].idempotency.max_response_body: 2097152 bytes is not below envoy_buffer_limit (1048576 bytes): Envoy answers 500 itself once a filter buffers more of a response body than the upstream cluster's per_connection_buffer_limit_bytes; lower it, or raise that Envoy setting and envoy_buffer_limit together"),
        ("size_too_big", json!({"max_response_body": "8MiB"}),
         "policies[0].idempotency.max_response_body: \"8MiB\" is larger than the maximum of 4194304 bytes"),
        ("conflict", json!({"conflict_status": 400}),
         "policies[0].idempotency.conflict_status: 400 is not 409 or 422"),
        ("fingerprint", json!({"fingerprint": ["method", "cookie"]}),
         "policies[0].idempotency.fingerprint[1]: \"cookie\" is not one of method, path, query, principal, body, header:<name>"),
        ("fingerprint_twice", json!({"fingerprint": ["body", "body"]}),
         "policies[0].idempotency.fingerprint[1]: \"body\" is listed twice"),
        ("replay", json!({"replay": "partial"}),
         "policies[0].idempotency.replay: \"partial\" is not one of \"full\", \"reference\""),
        ("replay_header", json!({"replay_headers": ["content type"]}),
         "policies[0].idempotency.replay_headers[0]: \"content type\" is not an HTTP header name"),
        ("retryable_success", json!({"retryable_statuses": [200]}),
         "policies[0].idempotency.retryable_statuses[0]: 200 is not a 4xx or 5xx status; only failures can be retryable"),
        ("retryable_bad", json!({"retryable_statuses": ["5xy"]}),
         "policies[0].idempotency.retryable_statuses[0]: \"5xy\" is not a status (100-599) or a class like \"5xx\""),
        ("replay_trailer", json!({"replay_trailers": ["ok", ":status"]}),
         "policies[0].idempotency.replay_trailers[1]: \":status\" is not an HTTP header name"),
        ("replay_trailers_type", json!({"replay_trailers": "grpc-status"}),
         "policies[0].idempotency.replay_trailers: expected an array, found a string"),
        ("grpc_code_name", json!({"retryable_grpc_codes": ["UNAVAILABLE", "BUSY"]}),
         "policies[0].idempotency.retryable_grpc_codes[1]: \"BUSY\" is not a gRPC status code (a name like \"UNAVAILABLE\" or a number 1-16)"),
        ("grpc_code_number", json!({"retryable_grpc_codes": [17]}),
         "policies[0].idempotency.retryable_grpc_codes[0]: 17 is not a gRPC status code (a name like \"UNAVAILABLE\" or a number 1-16)"),
        ("grpc_code_ok", json!({"retryable_grpc_codes": [14, "OK"]}),
         "policies[0].idempotency.retryable_grpc_codes[1]: \"OK\" is OK; only failures can be retryable"),
        ("grpc_code_twice", json!({"retryable_grpc_codes": [14, "UNAVAILABLE"]}),
         "policies[0].idempotency.retryable_grpc_codes[1]: \"UNAVAILABLE\" is listed twice"),
        ("methods_empty", json!({"methods": []}),
         "policies[0].idempotency.methods: must list at least one method"),
        ("complete", json!({"complete": "later"}),
         "policies[0].idempotency.complete: \"later\" is not one of \"sync\", \"async\""),
        ("unknown", json!({"ttl": "1m"}),
         "policies[0].idempotency.ttl: unknown field (known here: complete, completed_ttl, conflict_status, encryption, fingerprint, header, in_progress, in_progress_status, max_request_body, max_response_body, max_wait, methods, processing_ttl, replay, replay_headers, replay_trailers, required, retryable_grpc_codes, retryable_statuses)"),
        ("header", json!({"header": ""}),
         "policies[0].idempotency.header: \"\" is not an HTTP header name"),
        ("max_wait_too_long", json!({"in_progress": "wait", "max_wait": "30001ms"}),
         "policies[0].idempotency.max_wait: 30001ms is longer than the maximum of 30s (a waiting request polls Redis several times a second and holds its connection meanwhile)"),
        ("max_wait_30s", json!({"in_progress": "wait", "max_wait": "30s"}), "OK"),
    ];
    for (name, idem, want) in cases {
        let got = match with_idempotency(idem.clone()) {
            Ok(_) => "OK".to_string(),
            Err(e) => e.to_string(),
        };
        assert_eq!(&got, want, "case {name}");
    }
}

#[test]
fn lease_config() {
    let mut v = base();
    v["policies"][0]["lease"] = json!({"resource": ["tenant", "path_segment:2"]});
    let c = Config::from_value(&v).expect("valid");
    let l = c.policies[0].lease.as_ref().expect("lease");
    assert_eq!(l.resource, vec![Selector::Tenant, Selector::PathSegment(2)]);
    assert_eq!((l.ttl_ms, l.max_wait_ms), (10_000, 2_000));
    assert_eq!(l.on_busy, OnBusy::Reject);
    assert_eq!(l.fencing_header, "x-fencing-token");
    assert!(l.extend);
    assert_eq!(l.fence_ttl_ms, 7 * 86_400_000);
    let cases: &[(&str, Value, &str)] = &[
        ("empty_resource", json!({"resource": []}), "policies[0].lease.resource: must name at least one selector"),
        ("bad_segment", json!({"resource": ["path_segment:0"]}),
         "policies[0].lease.resource[0]: \"path_segment:0\" is not a selector (tenant, principal, client_ip, method, path, header:<name>, path_segment:<n>, query:<name>, path_param:<name>)"),
        ("bad_on_busy", json!({"resource": ["tenant"], "on_busy": "queue"}),
         "policies[0].lease.on_busy: \"queue\" is not one of \"reject\", \"wait\""),
        ("bad_ttl", json!({"resource": ["tenant"], "ttl": "10"}),
         "policies[0].lease.ttl: \"10\" is not a duration (use e.g. \"250ms\", \"2s\", \"1m\", \"24h\")"),
        ("unknown", json!({"resource": ["tenant"], "fence": true}),
         "policies[0].lease.fence: unknown field (known here: extend, fence_ttl, fencing_header, max_wait, on_busy, resource, ttl)"),
        ("max_wait_too_long", json!({"resource": ["tenant"], "on_busy": "wait", "max_wait": "1h"}),
         "policies[0].lease.max_wait: 3600000ms is longer than the maximum of 30s (a waiting request polls Redis several times a second and holds its connection meanwhile)"),
    ];
    for (name, lease, want) in cases {
        let mut v = base();
        v["policies"][0]["lease"] = lease.clone();
        let got = Config::from_value(&v)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(&got, want, "case {name}");
    }
}

/// `match.path_template` and the `path_param:<name>` selectors that read its variables.
#[test]
fn path_templates_and_their_params() {
    let mut v = base();
    v["policies"][0]["match"] =
        json!({"methods": ["POST"], "path_template": "/accounts/{id}/transfer"});
    v["policies"][0]["rate_limits"][1]["by"] = json!(["tenant", "path_param:id"]);
    v["policies"][0]["lease"] = json!({"resource": ["tenant", "path_param:id"]});
    let c = Config::from_value(&v).expect("valid");
    let p = &c.policies[0];
    let template = p.matcher.path_template.as_ref().expect("a template");
    assert_eq!(template.as_str(), "/accounts/{id}/transfer");
    assert_eq!(
        p.matcher.describe(),
        "POST, path template /accounts/{id}/transfer ({id}: segment 2)"
    );
    // Each selector is bound to the policy's own template.
    let lease = p.lease.as_ref().expect("lease");
    for sel in [&p.rate_limits[1].by[1], &lease.resource[1]] {
        let Selector::PathParam(param) = sel else {
            panic!("{sel:?}");
        };
        assert_eq!(param.name, "id");
        assert_eq!(param.value("/accounts/42/transfer"), Some("42"));
        assert_eq!(param.value("/accounts/42/close"), None);
        assert_eq!(sel.spelling(), "path_param:id");
    }
    assert_eq!(
        Selector::describe_all(&lease.resource),
        "tenant + path_param:id"
    );

    let cases: &[(&str, Value, Value, &str)] = &[
        ("unknown_variable", json!({"path_template": "/accounts/{id}/transfer"}),
         json!({"resource": ["tenant", "path_param:account"]}),
         "policies[0].lease.resource[1]: path_param:account names no variable of match.path_template \"/accounts/{id}/transfer\" (it defines id)"),
        ("template_without_variables", json!({"path_template": "/accounts/*/transfer"}),
         json!({"resource": ["path_param:id"]}),
         "policies[0].lease.resource[0]: path_param:id names no variable of match.path_template \"/accounts/*/transfer\" (it defines none)"),
        ("no_template", json!({"path_prefix": "/accounts/"}),
         json!({"resource": ["path_param:id"]}),
         "policies[0].lease.resource[0]: path_param:id reads a variable of match.path_template, and this policy's match has none (e.g. \"path_template\": \"/accounts/{id}/transfer\")"),
        ("duplicate_param", json!({"path_template": "/accounts/{id}"}),
         json!({"resource": ["path_param:id", "path_param:id"]}),
         "policies[0].lease.resource[1]: \"path_param:id\" is listed twice"),
        ("dot_segment", json!({"path_template": "/accounts/../{id}"}),
         json!({"resource": ["path_param:id"]}),
         "policies[0].match.path_template: \"/accounts/../{id}\" is not a path template: the segment \"..\" never matches: dot segments are removed from requests before they are matched"),
        ("semicolon", json!({"path_template": "/accounts/{id};v=1"}),
         json!({"resource": ["path_param:id"]}),
         "policies[0].match.path_template: \"/accounts/{id};v=1\" is not a path template: \";v=1\" holds ';': path parameters make a request's path read more than one way, and such a request is refused (ambiguous_path)"),
        ("too_many_variables", json!({"path_template": "/{a}/{b}/{c}/{d}/{e}/{f}"}),
         json!({"resource": ["path_param:a"]}),
         "policies[0].match.path_template: \"/{a}/{b}/{c}/{d}/{e}/{f}\" is not a path template: defines more than 5 variables"),
        ("relative", json!({"path_template": "accounts/{id}"}),
         json!({"resource": ["path_param:id"]}),
         "policies[0].match.path_template: \"accounts/{id}\" is not a path template: must start with '/'"),
        ("misspelt", json!({"path_templte": "/accounts/{id}"}),
         json!({"resource": ["path_param:id"]}),
         "policies[0].match.path_templte: unknown field (did you mean `path_template`?)"),
        ("not_a_string", json!({"path_template": 7}),
         json!({"resource": ["tenant"]}),
         "policies[0].match.path_template: expected a string, found a number"),
    ];
    for (name, matcher, lease, want) in cases {
        let mut v = base();
        v["policies"][0]["match"] = matcher.clone();
        v["policies"][0]["lease"] = lease.clone();
        let got = Config::from_value(&v)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(&got, want, "case {name}");
    }
}

#[test]
fn tick_follows_timeout_leases_and_batching() {
    // As when the host gives the root a queue to wake it: batches do not set the tick.
    let tick = |v: Value| Config::from_value(&v).expect("valid").tick_ms(false);
    assert_eq!(tick(json!({"redis": {"cluster": "gw"}})), 25);
    assert_eq!(
        tick(json!({"redis": {"cluster": "gw", "timeout": "1s"}})),
        500
    );
    assert_eq!(
        tick(json!({"redis": {"cluster": "gw", "timeout": "5ms"}})),
        5
    );
    assert_eq!(
        tick(
            json!({"redis": {"cluster": "gw", "timeout": "1s"}, "policies": [
            {"name": "p", "lease": {"resource": ["tenant"], "ttl": "1s"}}]})
        ),
        250
    );
    // Without that queue, the root's tick flushes the batches: every `max_delay`.
    let by_tick = |v: Value| Config::from_value(&v).expect("valid").tick_ms(true);
    assert_eq!(
        by_tick(json!({"redis": {"cluster": "gw", "batch": {"max_delay": "2ms"}}})),
        2
    );
    assert_eq!(
        by_tick(json!({"redis": {"cluster": "gw"}})),
        1,
        "batching is on by default"
    );
    assert_eq!(
        by_tick(json!({"redis": {"cluster": "gw", "batch": false}})),
        25
    );
}

#[test]
fn batching_is_on_unless_turned_off() {
    let batch = |v: Value| Config::from_value(&json!({"redis": v})).map(|c| c.redis.batch);
    let on = Some(Batch {
        max_delay_ms: 1,
        max_requests: 32,
        cross_slot: true,
    });
    assert_eq!(batch(json!({"cluster": "gw"})), Ok(on));
    assert_eq!(batch(json!({"cluster": "gw", "batch": true})), Ok(on));
    assert_eq!(batch(json!({"cluster": "gw", "batch": false})), Ok(None));
    assert_eq!(
        batch(json!({"cluster": "gw", "batch": {"cross_slot": false}})),
        Ok(on.map(|b| Batch {
            cross_slot: false,
            ..b
        }))
    );
    let err = batch(json!({"cluster": "gw", "batch": "yes"}))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("redis.batch") && err.contains("true, false or an object"),
        "{err}"
    );
}

#[test]
fn envoy_buffer_limit_bounds_what_the_filter_buffers() {
    let mut v = base();
    v["envoy_buffer_limit"] = json!("4MiB");
    v["policies"][0]["idempotency"] =
        json!({"max_request_body": "3MiB", "max_response_body": "3MiB"});
    let c = Config::from_value(&v).expect("valid with the limit raised");
    let i = c.policies[0].idempotency.as_ref().expect("present");
    assert_eq!(c.envoy_buffer_limit, 4 << 20);
    assert_eq!(
        (i.max_request_body, i.max_response_body),
        (3 << 20, 3 << 20)
    );
    // Defaults: 1 MiB / 64 KiB, never more than half of the limit.
    v["policies"][0]["idempotency"] = json!({});
    let c = Config::from_value(&v).expect("valid");
    let i = c.policies[0].idempotency.as_ref().expect("present");
    assert_eq!(
        (i.max_request_body, i.max_response_body),
        (1 << 20, 64 << 10)
    );
    v["envoy_buffer_limit"] = json!("64KiB");
    let c = Config::from_value(&v).expect("valid");
    let i = c.policies[0].idempotency.as_ref().expect("present");
    assert_eq!(
        (i.max_request_body, i.max_response_body),
        (32 << 10, 32 << 10)
    );
    // Just below the limit is accepted, at the limit refused.
    v["policies"][0]["idempotency"] = json!({"max_response_body": 65535});
    assert!(Config::from_value(&v).is_ok());
    v["policies"][0]["idempotency"] = json!({"max_response_body": 65536});
    let err = Config::from_value(&v)
        .expect_err("at the limit")
        .to_string();
    assert!(
        err.starts_with("policies[0].idempotency.max_response_body: 65536 bytes is not below envoy_buffer_limit (65536 bytes)"),
        "{err}"
    );
    for (bad, want) in [
        (
            json!("lots"),
            "envoy_buffer_limit: \"lots\" is not a size (use e.g. \"64KiB\", \"1MiB\")",
        ),
        (
            json!(0),
            "envoy_buffer_limit: 0 is not a size between 1 and 1073741824 bytes",
        ),
    ] {
        let mut v = base();
        v["envoy_buffer_limit"] = bad;
        assert_eq!(Config::from_value(&v).expect_err("bad").to_string(), want);
    }
}

#[test]
fn fence_ttl_defaults_and_bounds() {
    let lease = |extra: Value| {
        let mut l = json!({"resource": ["tenant"], "ttl": "10s"});
        for (k, v) in extra.as_object().expect("object") {
            l[k] = v.clone();
        }
        let mut v = base();
        v["policies"][0]["lease"] = l;
        Config::from_value(&v).map(|c| c.policies[0].lease.as_ref().expect("lease").fence_ttl_ms)
    };
    let cases: &[(&str, Value, std::result::Result<u64, &str>)] = &[
        ("default_7d", json!({}), Ok(7 * 86_400_000)),
        ("default_100x_ttl", json!({"ttl": "2h"}), Ok(200 * 3_600_000)),
        ("set", json!({"fence_ttl": "1h"}), Ok(3_600_000)),
        ("equal_to_ttl", json!({"fence_ttl": "10s"}), Ok(10_000)),
        ("max", json!({"fence_ttl": "365d"}), Ok(365 * 86_400_000)),
        ("shorter_than_ttl", json!({"fence_ttl": "9s"}),
         Err("policies[0].lease.fence_ttl: 9000ms is shorter than the lease ttl (10000ms): the fence key must outlive the lease")),
        ("too_long", json!({"fence_ttl": "366d"}),
         Err("policies[0].lease.fence_ttl: 31622400000ms is longer than the maximum of 365d")),
        ("not_a_duration", json!({"fence_ttl": "7 days"}),
         Err("policies[0].lease.fence_ttl: \"7 days\" is not a duration (use e.g. \"250ms\", \"2s\", \"1m\", \"24h\")")),
        ("number", json!({"fence_ttl": 60}),
         Err("policies[0].lease.fence_ttl: 60 is not a duration (a string such as \"2s\")")),
    ];
    for (name, extra, want) in cases {
        let got = lease(extra.clone()).map_err(|e| e.to_string());
        assert_eq!(got, want.map_err(str::to_string), "case {name}");
    }
}

#[test]
fn authorization_env_reads_the_vm_environment() {
    const SECRET: &str = "Basic c2VjcmV0OnZhbHVl";
    let env = |name: &str| match name {
        "CG_GATEWAY_AUTH" => Some(SECRET.to_string()),
        "CG_EMPTY" => Some(String::new()),
        "CG_NEWLINE" => Some(format!("{SECRET}\n")),
        _ => None,
    };
    let parse = |redis_edits: Value| {
        let mut v = base();
        let redis = v["redis"].as_object_mut().expect("redis");
        redis.remove("authorization");
        for (k, e) in redis_edits.as_object().expect("object") {
            redis.insert(k.clone(), e.clone());
        }
        Config::from_value_with_env(&v, &env).map(|c| c.redis.authorization)
    };
    let unset = "redis.authorization_env: environment variable CG_UNSET is not set in the Wasm VM (Envoy: vm_config.environment_variables; Istio: vmConfig.env)";
    type Want = std::result::Result<Option<&'static str>, &'static str>;
    let cases: &[(&str, Value, Want)] = &[
        ("from_env", json!({"authorization_env": "CG_GATEWAY_AUTH"}), Ok(Some(SECRET))),
        ("inline", json!({"authorization": "Basic eDp5"}), Ok(Some("Basic eDp5"))),
        ("neither", json!({}), Ok(None)),
        ("both", json!({"authorization": "Basic eDp5", "authorization_env": "CG_GATEWAY_AUTH"}),
         Err("redis.authorization_env: cannot be combined with redis.authorization: give the credential one way")),
        ("unset", json!({"authorization_env": "CG_UNSET"}), Err(unset)),
        ("empty", json!({"authorization_env": "CG_EMPTY"}),
         Err("redis.authorization_env: environment variable CG_EMPTY is empty")),
        ("not_a_header_value", json!({"authorization_env": "CG_NEWLINE"}),
         Err("redis.authorization_env: environment variable CG_NEWLINE is not a printable ASCII header value")),
        ("empty_name", json!({"authorization_env": ""}),
         Err("redis.authorization_env: \"\" is not an environment variable name (1-128 of [A-Za-z0-9_], not starting with a digit)")),
        ("bad_name", json!({"authorization_env": "CG-AUTH"}),
         Err("redis.authorization_env: \"CG-AUTH\" is not an environment variable name (1-128 of [A-Za-z0-9_], not starting with a digit)")),
        ("digit_first", json!({"authorization_env": "1AUTH"}),
         Err("redis.authorization_env: \"1AUTH\" is not an environment variable name (1-128 of [A-Za-z0-9_], not starting with a digit)")),
        ("not_a_string", json!({"authorization_env": 5}),
         Err("redis.authorization_env: expected a string, found a number")),
    ];
    for (name, edits, want) in cases {
        let got = parse(edits.clone()).map_err(|e| e.to_string());
        let want = want.map(|a| a.map(str::to_string)).map_err(str::to_string);
        assert_eq!(got, want, "case {name}");
        if let Err(e) = &got {
            assert!(
                !e.contains(SECRET.trim_start_matches("Basic ")),
                "case {name} shows the secret"
            );
        }
    }
    // The default entry points see no environment at all.
    let v = json!({"redis": {"cluster": "gw", "authorization_env": "CG_GATEWAY_AUTH"}});
    let err = Config::parse(v.to_string().as_bytes()).expect_err("no environment");
    assert!(
        err.to_string().contains("CG_GATEWAY_AUTH is not set"),
        "{err}"
    );
    let ok = Config::parse_with_env(v.to_string().as_bytes(), &env).expect("valid");
    assert_eq!(ok.redis.authorization.as_deref(), Some(SECRET));
}

#[test]
fn encryption_reads_its_keys_from_the_vm_environment() {
    use crate::guards::idempotency::seal::RecordKey;
    use crate::support::text::base64_encode;
    let key_a = base64_encode(&[0xa1; 32]);
    let key_b = base64_encode(&[0xb2; 32]);
    let kid = |text: &str| RecordKey::from_base64(text).map(|k| k.kid().to_string());
    let (kid_a, kid_b) = (kid(&key_a).expect("key"), kid(&key_b).expect("key"));
    let env = |name: &str| {
        Some(match name {
            "CG_RECORD_KEY" => key_a.clone(),
            "CG_RECORD_KEY_OLD" => key_b.clone(),
            "CG_KEY_NEWLINE" => format!("{key_a}\n"),
            "CG_EMPTY" => String::new(),
            "CG_SHORT" => base64_encode(&[1; 16]),
            "CG_LONG" => base64_encode(&[1; 48]),
            "CG_NOT_BASE64" => "correct horse battery staple".into(),
            _ => return None,
        })
    };
    let parse = |encryption: Value| {
        let mut v = base();
        v["policies"][0]["idempotency"] = json!({ "encryption": encryption });
        Config::from_value_with_env(&v, &env).map(|c| {
            c.policies[0]
                .idempotency
                .as_ref()
                .and_then(|i| i.encryption.as_ref())
                .map(|k| {
                    (
                        k.current_kid().to_string(),
                        k.previous_kid().map(str::to_string),
                    )
                })
        })
    };
    let at = "policies[0].idempotency.encryption";
    let hint = "it must hold a base64 32-byte AES-256 key (e.g. `openssl rand -base64 32`)";
    type Want = std::result::Result<(String, Option<String>), String>;
    let cases: Vec<(&str, Value, Want)> = vec![
        ("current_only", json!({"key_env": "CG_RECORD_KEY"}), Ok((kid_a.clone(), None))),
        ("with_previous", json!({"key_env": "CG_RECORD_KEY", "previous_key_env": "CG_RECORD_KEY_OLD"}),
         Ok((kid_a.clone(), Some(kid_b.clone())))),
        ("trailing_newline", json!({"key_env": "CG_KEY_NEWLINE"}), Ok((kid_a.clone(), None))),
        ("missing_key_env", json!({"previous_key_env": "CG_RECORD_KEY_OLD"}),
         Err(format!("{at}.key_env: is required"))),
        ("unset", json!({"key_env": "CG_UNSET"}),
         Err(format!("{at}.key_env: environment variable CG_UNSET is not set in the Wasm VM (Envoy: vm_config.environment_variables; Istio: vmConfig.env)"))),
        ("empty", json!({"key_env": "CG_EMPTY"}),
         Err(format!("{at}.key_env: environment variable CG_EMPTY is empty"))),
        ("short", json!({"key_env": "CG_SHORT"}),
         Err(format!("{at}.key_env: environment variable CG_SHORT holds 16 bytes, not 32: {hint}"))),
        ("long", json!({"key_env": "CG_LONG"}),
         Err(format!("{at}.key_env: environment variable CG_LONG holds 48 bytes, not 32: {hint}"))),
        ("not_base64", json!({"key_env": "CG_NOT_BASE64"}),
         Err(format!("{at}.key_env: environment variable CG_NOT_BASE64 is not base64 (standard alphabet, with padding): {hint}"))),
        ("previous_unset", json!({"key_env": "CG_RECORD_KEY", "previous_key_env": "CG_GONE"}),
         Err(format!("{at}.previous_key_env: environment variable CG_GONE is not set in the Wasm VM (Envoy: vm_config.environment_variables; Istio: vmConfig.env)"))),
        ("previous_short", json!({"key_env": "CG_RECORD_KEY", "previous_key_env": "CG_SHORT"}),
         Err(format!("{at}.previous_key_env: environment variable CG_SHORT holds 16 bytes, not 32: {hint}"))),
        ("bad_name", json!({"key_env": "CG-KEY"}),
         Err(format!("{at}.key_env: \"CG-KEY\" is not an environment variable name (1-128 of [A-Za-z0-9_], not starting with a digit)"))),
        ("inline_key", json!({"key_env": "CG_RECORD_KEY", "key": key_a.clone()}),
         Err(format!("{at}.key: unknown field (known here: key_env, previous_key_env)"))),
        ("not_an_object", json!("CG_RECORD_KEY"),
         Err(format!("{at}: expected an object, found a string"))),
    ];
    for (name, encryption, want) in cases {
        let got = parse(encryption).map_err(|e| e.to_string());
        assert_eq!(got, want.map(Some), "case {name}");
        if let Err(e) = &got {
            for secret in [&key_a, &key_b] {
                assert!(!e.contains(secret.as_str()), "case {name} shows a key");
            }
        }
    }
    // No `encryption`: responses are stored in the clear, as before.
    assert_eq!(parse(Value::Null), Ok(None));
}

#[test]
fn per_request_facts_are_derived_once_per_policy() {
    let c = Config::parse(
        br#"{"redis": {"cluster": "gw"}, "policies": [
          {"name": "plain", "rate_limits": [{"name": "t", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1, "window": "1s"}]},
          {"name": "ip", "rate_limits": [{"name": "t", "by": ["tenant", "client_ip"], "algorithm": "fixed_window", "limit": 1, "window": "1s"}]},
          {"name": "ip-lease", "lease": {"resource": ["client_ip"]}},
          {"name": "log", "rate_limits": [{"name": "t", "by": [], "algorithm": "sliding_log", "limit": 1, "window": "1s"}]},
          {"name": "idem", "idempotency": {}}
        ]}"#,
    )
    .expect("valid");
    let facts: Vec<(&str, bool, bool)> = c
        .policies
        .iter()
        .map(|p| (p.name.as_str(), p.uses_client_ip, p.needs_tokens))
        .collect();
    assert_eq!(
        facts,
        vec![
            ("plain", false, false),
            ("ip", true, false),
            ("ip-lease", true, true),
            ("log", false, true),
            ("idem", false, true),
        ]
    );
}

#[test]
fn identity_sources() {
    let parse = |identity: Value| {
        let mut v = base();
        v["identity"] = identity;
        Config::from_value(&v).map(|c| c.identity)
    };
    let jwt = |claim: &str| {
        IdSource::Metadata(vec![
            "envoy.filters.http.jwt_authn".into(),
            "payload".into(),
            claim.into(),
        ])
    };
    let ok = parse(json!({
        "tenant": {"metadata": ["envoy.filters.http.jwt_authn", "payload", "tid"]},
        "principal": {"header": "X-Sub"}}))
    .expect("valid");
    assert_eq!(ok.tenant, jwt("tid"));
    assert_eq!(ok.principal, IdSource::Header("x-sub".into()));
    assert!(ok.uses_metadata());
    let short = parse(json!({"tenant_header": "x-org"})).expect("valid");
    assert_eq!(short.tenant, IdSource::Header("x-org".into()));
    assert_eq!(short.principal, IdSource::Header("x-user-id".into()));
    assert!(!short.uses_metadata());
    for (identity, want) in [
        (json!({"tenant_header": "x", "tenant": {"header": "y"}}),
         "identity.tenant: give either tenant or tenant_header, not both"),
        (json!({"principal": {"header": "x", "metadata": ["a", "b"]}}),
         "identity.principal: must be {\"header\": \"<name>\"} or {\"metadata\": [path...]}"),
        (json!({"tenant": {}}),
         "identity.tenant: must be {\"header\": \"<name>\"} or {\"metadata\": [path...]}"),
        (json!({"tenant": {"metadata": ["only-one"]}}),
         "identity.tenant.metadata: must be 2 to 8 non-empty names: [filter, key, ...], e.g. [\"envoy.filters.http.jwt_authn\", \"payload\", \"sub\"]"),
        (json!({"tenant": {"metadata": ["a", ""]}}),
         "identity.tenant.metadata: must be 2 to 8 non-empty names: [filter, key, ...], e.g. [\"envoy.filters.http.jwt_authn\", \"payload\", \"sub\"]"),
        (json!({"tenant": {"claim": "tid"}}),
         "identity.tenant.claim: unknown field (known here: header, metadata)"),
    ] {
        assert_eq!(parse(identity).expect_err("bad").to_string(), want);
    }
}

#[test]
fn header_matches() {
    let parse = |headers: Value| {
        let mut v = base();
        v["policies"][0]["match"]["headers"] = headers;
        Config::from_value(&v).map(|c| c.policies[0].matcher.headers.clone())
    };
    let ok = parse(
        json!([{"name": "X-Plan", "exact": "gold"}, {"name": "x-b", "prefix": "fr"},
                          {"name": "x-c", "present": false}]),
    )
    .expect("valid");
    assert_eq!(
        ok,
        vec![
            HeaderMatch {
                name: "x-plan".into(),
                test: HeaderTest::Exact("gold".into())
            },
            HeaderMatch {
                name: "x-b".into(),
                test: HeaderTest::Prefix("fr".into())
            },
            HeaderMatch {
                name: "x-c".into(),
                test: HeaderTest::Present(false)
            },
        ]
    );
    for (headers, want) in [
        (
            json!([{"name": "x", "exact": "a", "prefix": "b"}]),
            "policies[0].match.headers[0]: must have exactly one of exact, prefix, present",
        ),
        (
            json!([{"name": "x"}]),
            "policies[0].match.headers[0]: must have exactly one of exact, prefix, present",
        ),
        (
            json!([{"exact": "a"}]),
            "policies[0].match.headers[0].name: is required",
        ),
        (
            json!([{"name": "a b", "exact": "a"}]),
            "policies[0].match.headers[0].name: \"a b\" is not an HTTP header name",
        ),
    ] {
        assert_eq!(parse(headers).expect_err("bad").to_string(), want);
    }
}

#[test]
fn concurrency_cost_and_charge() {
    let mut v = base();
    v["policies"][1]["rate_limits"] = json!([
        { "name": "inflight", "by": ["tenant"], "algorithm": "concurrency", "limit": 20, "window": "30s" },
        { "name": "tokens", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000, "window": "1m",
          "cost": { "header": "X-Request-Cost", "default": 0, "max": 10000 },
          "charge": { "response_json": "/usage/total_tokens" } },
        { "name": "calls", "by": ["tenant"], "algorithm": "token_bucket", "limit": 10, "window": "1s", "burst": 50,
          "cost": { "header": "x-cost" }, "charge": { "trailer": "x-used" } }
    ]);
    let c = Config::from_value(&v).expect("valid");
    let l = &c.policies[1].rate_limits;
    assert!(l[0].concurrency() && l[0].cost.is_none());
    assert_eq!(crate::redis::keys::limit_code(&l[0]), "cc");
    assert!(
        c.policies[1].needs_tokens,
        "a slot's member is the request's nonce"
    );
    assert_eq!(
        l[1].cost,
        Some(Cost {
            header: "x-request-cost".into(),
            default: 0,
            min: 0,
            max: 10_000
        }),
        "min: 0 with a default of 0"
    );
    assert_eq!(
        l[1].charge,
        Some(Charge {
            source: ChargeSource::Json {
                pointer: Pointer::parse("/usage/total_tokens").expect("a pointer"),
                max_body: CHARGE_MAX_BODY
            },
            unreadable: Fallback::Max(10_000),
        })
    );
    assert_eq!(
        l[2].cost.as_ref().map(|c| (c.default, c.max)),
        Some((1, 50)),
        "max: the burst"
    );
    assert_eq!(
        l[2].cost.as_ref().map(|c| c.min),
        Some(1),
        "min: 1 unless given, so a client cannot declare its requests free"
    );
    assert_eq!(
        l[2].charge,
        Some(Charge {
            source: ChargeSource::Trailer("x-used".into()),
            unreadable: Fallback::Max(50),
        })
    );
}

#[test]
fn an_event_stream_charge() {
    let mut v = base();
    v["policies"][1]["rate_limits"] = json!([
        { "name": "prompt", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000, "window": "1d",
          "cost": { "header": "x-cost", "max": 4000 },
          "charge": { "response_sse_json": "/usage/prompt_tokens" } },
        { "name": "completion", "by": ["tenant"], "algorithm": "token_bucket", "limit": 1000, "window": "1m",
          "charge": { "response_sse_json": "/usage/completion_tokens", "max_body": "64KiB",
                      "missing": "max", "unreadable": 5 } }
    ]);
    let c = Config::from_value(&v).expect("valid");
    let l = &c.policies[1].rate_limits;
    let pointer = |p: &str| Pointer::parse(p).expect("a pointer");
    assert_eq!(
        l[0].charge,
        Some(Charge {
            source: ChargeSource::SseJson {
                pointer: pointer("/usage/prompt_tokens"),
                max_body: CHARGE_MAX_BODY,
                missing: Fallback::Cost,
            },
            unreadable: Fallback::Max(4000),
        }),
        "missing: the admitted cost unless given"
    );
    assert_eq!(
        l[1].charge,
        Some(Charge {
            source: ChargeSource::SseJson {
                pointer: pointer("/usage/completion_tokens"),
                max_body: 64 * 1024,
                missing: Fallback::Max(1000),
            },
            unreadable: Fallback::Units(5),
        })
    );
    assert_eq!(
        l[1].charge.as_ref().and_then(|c| c.source.pointer()),
        Some(&pointer("/usage/completion_tokens"))
    );
}

#[test]
fn cost_and_charge_errors_name_the_field() {
    let limit = |extra: Value| {
        let mut l = json!({ "name": "l", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100, "window": "1m" });
        for (k, val) in extra.as_object().expect("object") {
            l[k] = val.clone();
        }
        let mut v = base();
        v["policies"][1]["rate_limits"] = json!([l]);
        Config::from_value(&v).expect_err("refused").to_string()
    };
    let at = "policies[1].rate_limits[0]";
    let cases = [
        (json!({"algorithm": "sliding_log", "cost": {"header": "x-c"}}),
         format!("{at}.cost: is not supported with algorithm sliding_log: use fixed_window, sliding_window or token_bucket")),
        (json!({"algorithm": "concurrency", "charge": {"response_header": "x-c"}}),
         format!("{at}.charge: is not supported with algorithm concurrency: use fixed_window, sliding_window or token_bucket")),
        (json!({"mode": "leased", "cost": {"header": "x-c"}}),
         format!("{at}.cost: is not supported with mode \"leased\": use fixed_window, sliding_window or token_bucket")),
        (json!({"algorithm": "concurrency", "mode": "leased"}),
         format!("{at}.mode: \"leased\" needs algorithm fixed_window and no shadow")),
        (json!({"cost": {}}), format!("{at}.cost.header: is required")),
        (json!({"cost": {"header": "x-c", "max": 101}}),
         format!("{at}.cost.max: 101 is more than the limit can ever admit (100)")),
        (json!({"cost": {"header": "x-c", "default": 5, "max": 4}}),
         format!("{at}.cost.default: 5 is not between min (1) and max (4)")),
        (json!({"cost": {"header": "x-c", "min": 2}}),
         format!("{at}.cost.default: 1 is not between min (2) and max (100)")),
        (json!({"cost": {"header": "x-c", "default": -1}}),
         format!("{at}.cost.default: -1 is not an integer between 0 and 1000000000")),
        (json!({"charge": {}}),
         format!("{at}.charge: must have exactly one of response_header, trailer, response_json, response_sse_json")),
        (json!({"charge": {"response_header": "x-a", "trailer": "x-b"}}),
         format!("{at}.charge: must have exactly one of response_header, trailer, response_json, response_sse_json")),
        (json!({"charge": {"response_json": "/a", "response_sse_json": "/a"}}),
         format!("{at}.charge: must have exactly one of response_header, trailer, response_json, response_sse_json")),
        (json!({"charge": {"response_json": "usage"}}),
         format!("{at}.charge.response_json: \"usage\" is not a JSON pointer (RFC 6901), e.g. \"/usage/total_tokens\"")),
        (json!({"charge": {"response_sse_json": "usage/total_tokens"}}),
         format!("{at}.charge.response_sse_json: \"usage/total_tokens\" is not a JSON pointer (RFC 6901), e.g. \"/usage/total_tokens\"")),
        (json!({"charge": {"response_sse_json": "/usage/a~2"}}),
         format!("{at}.charge.response_sse_json: \"/usage/a~2\" is not a JSON pointer (RFC 6901): \"a~2\" has a '~' not followed by 0 or 1 (write ~0 for '~', ~1 for '/')")),
        (json!({"charge": {"response_sse_json": 7}}),
         format!("{at}.charge.response_sse_json: expected a string, found a number")),
        (json!({"charge": {"response_header": "x-a", "max_body": "1KiB"}}),
         format!("{at}.charge.max_body: only applies to response_json and response_sse_json")),
        (json!({"charge": {"response_json": "/a", "missing": "cost"}}),
         format!("{at}.charge.missing: only applies to response_sse_json")),
        (json!({"charge": {"trailer": "x-a", "missing": 3}}),
         format!("{at}.charge.missing: only applies to response_sse_json")),
        (json!({"charge": {"response_sse_json": "/a", "missing": "estimate"}}),
         format!("{at}.charge.missing: \"estimate\" is not \"cost\", \"max\" or a whole number of units from 0 to 1000000000")),
        (json!({"charge": {"response_sse_json": "/a", "missing": -1}}),
         format!("{at}.charge.missing: -1 is not \"cost\", \"max\" or a whole number of units from 0 to 1000000000")),
        (json!({"charge": {"response_sse_json": "/a", "max_body": "32MiB"}}),
         format!("{at}.charge.max_body: \"32MiB\" is larger than the maximum of 16777216 bytes")),
        // Nothing of an event is held, so there is no bound on one to set.
        (json!({"charge": {"response_sse_json": "/a", "max_event": "1KiB"}}),
         format!("{at}.charge.max_event: unknown field (known here: max_body, missing, response_header, response_json, response_sse_json, trailer, unreadable)")),
        (json!({"charge": {"response_sse_jsn": "/a"}}),
         format!("{at}.charge.response_sse_jsn: unknown field (did you mean `response_sse_json`?)")),
        (json!({"algorithm": "concurrent"}),
         format!("{at}.algorithm: \"concurrent\" is not one of fixed_window, sliding_window, sliding_log, token_bucket, concurrency")),
        (json!({"algorithm": "concurrency", "unit": "requests"}),
         format!("{at}.unit: \"requests\": a concurrency limit counts \"concurrent-requests\"")),
    ];
    for (extra, want) in cases {
        assert_eq!(limit(extra.clone()), want, "{extra}");
    }
}

/// A limit's `unit`: requests unless configured (written without `qu`), a concurrency
/// limit's `concurrent-requests`; a registered unit or one of the service's own is shown as
/// `qu` in its `RateLimit-Policy` item.
#[test]
fn units_are_shown_in_the_policy_items() {
    let mut v = base();
    v["policies"][1]["rate_limits"] = json!([
        { "name": "inflight", "by": ["tenant"], "algorithm": "concurrency", "limit": 20, "window": "30s" },
        { "name": "tokens", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000, "window": "1m",
          "cost": { "header": "x-tokens", "max": 10000 }, "unit": "tokens" },
        { "name": "bytes", "by": ["tenant"], "algorithm": "sliding_window", "limit": 1048576, "window": "1s",
          "cost": { "header": "content-length", "max": 65536 }, "unit": "content-bytes" },
        { "name": "calls", "by": ["tenant"], "algorithm": "token_bucket", "limit": 3, "window": "1s",
          "burst": 10, "unit": "requests" },
        { "name": "inflight-2", "by": [], "algorithm": "concurrency", "limit": 5, "window": "10s",
          "unit": "concurrent-requests" }
    ]);
    let c = Config::from_value(&v).expect("valid");
    let shown: Vec<(&str, &str)> = c.policies[1]
        .rate_limits
        .iter()
        .map(|l| (l.unit.as_str(), l.policy_item.as_str()))
        .collect();
    assert_eq!(
        shown,
        [
            (
                "concurrent-requests",
                "\"inflight\";q=20;qu=\"concurrent-requests\""
            ),
            ("tokens", "\"tokens\";q=100000;qu=\"tokens\";w=60"),
            (
                "content-bytes",
                "\"bytes\";q=1048576;qu=\"content-bytes\";w=1"
            ),
            // 10 tokens at 3 a second: full in 3.33 s, shown as 4 (rounded up).
            ("requests", "\"calls\";q=10;w=4"),
            (
                "concurrent-requests",
                "\"inflight-2\";q=5;qu=\"concurrent-requests\""
            ),
        ]
    );
    let c = Config::from_value(&base()).expect("valid");
    assert!(c
        .policies
        .iter()
        .flat_map(|p| &p.rate_limits)
        .all(|l| l.unit == UNIT_REQUESTS));
}

/// `problem_type_base` defaults to the project's page of problem types; any absolute http(s)
/// URI prefix that ends where a name can follow is taken as it is.
#[test]
fn problem_type_base_is_a_uri_prefix() {
    let c = Config::from_value(&base()).expect("valid");
    assert_eq!(c.problem_type_base, DEFAULT_PROBLEM_TYPE_BASE);
    assert!(DEFAULT_PROBLEM_TYPE_BASE.ends_with("/docs/problems.md#"));
    for base_uri in [
        "https://api.example.com/problems/",
        "http://docs.internal:8080/errors#",
        "https://example.com/problem?type=",
        "https://example.com/p%20q/",
    ] {
        let mut v = base();
        v["problem_type_base"] = json!(base_uri);
        let c = Config::from_value(&v).expect("valid");
        assert_eq!(c.problem_type_base, base_uri);
    }
}

/// `overrides` is off unless asked for, and only on a limit counted per tenant: the override
/// keys carry the tenant's hash tag, so they share the counter's slot only then.
#[test]
fn overrides_need_a_limit_counted_per_tenant() {
    let config = Config::from_value(&base()).expect("valid");
    assert!(config
        .policies
        .iter()
        .flat_map(|p| &p.rate_limits)
        .all(|l| !l.overrides));
    let mut v = base();
    v["policies"][0]["rate_limits"][0]["overrides"] = json!(true);
    v["policies"][0]["rate_limits"][1]["overrides"] = json!(true);
    v["policies"][0]["rate_limits"][1]["algorithm"] = json!("concurrency");
    v["policies"][0]["rate_limits"][1]
        .as_object_mut()
        .expect("object")
        .remove("burst");
    let config = Config::from_value(&v).expect("valid");
    let limits = &config.policies[0].rate_limits;
    assert!(limits[0].overrides && limits[1].overrides && !limits[2].overrides);
    assert!(!limits[0].per_principal() && limits[1].per_principal());
    assert_eq!(
        limits[0].quota(),
        Quota {
            limit: 100,
            window_ms: 60_000
        }
    );
    for (at, edit, want) in [
        (
            "/policies/0/rate_limits/2/overrides",
            json!(true),
            "policies[0].rate_limits[2].overrides: needs a limit counted per tenant (\"tenant\" \
             in by): a tenant's overrides are stored in its hash slot",
        ),
        (
            "/policies/1/rate_limits/0/overrides",
            json!(true),
            "policies[1].rate_limits[0].overrides: needs a limit counted per tenant (\"tenant\" \
             in by): a tenant's overrides are stored in its hash slot",
        ),
        (
            "/policies/0/rate_limits/0/overrides",
            json!("yes"),
            "policies[0].rate_limits[0].overrides: expected true or false, found a string",
        ),
    ] {
        assert_eq!(error_after(at, edit), want, "{at}");
    }
}

/// `align: "calendar"`: a fixed window per calendar day, week or month in a zone (UTC unless
/// given), as a spec the scripts read; its `RateLimit-Policy` item has no `w`.
#[test]
fn calendar_windows() {
    let with = |extra: Value| {
        let mut v = base();
        let limit = &mut v["policies"][1]["rate_limits"][0];
        for (k, val) in extra.as_object().expect("object") {
            limit[k] = val.clone();
        }
        Config::from_value(&v).map(|c| c.policies[1].rate_limits[0].clone())
    };
    let monthly = with(json!({"align": "calendar", "window": "1mo", "limit": 10000,
        "zone": {"name": "Europe/Berlin", "rule": "CET-1CEST,M3.5.0,M10.5.0/3"}}))
    .expect("valid");
    let calendar = monthly.calendar.as_ref().expect("calendar");
    assert_eq!(calendar.period, Period::Month);
    assert_eq!(calendar.spec, "1mo@3600,7200,M3.5.0/7200,M10.5.0/10800");
    assert_eq!(monthly.window_ms, 31 * 86_400_000);
    assert_eq!(monthly.policy_item, "\"global\";q=10000");
    let cases = [
        (json!({"align": "calendar", "window": "1d"}), "1d@0"),
        (
            json!({"align": "calendar", "window": "1w", "zone": "+05:30"}),
            "1w@19800",
        ),
        (
            json!({"align": "calendar", "window": "1mo", "zone": "-03:00"}),
            "1mo@-10800",
        ),
        (
            json!({"align": "calendar", "window": "1d", "zone": "UTC", "mode": "leased"}),
            "1d@0",
        ),
    ];
    for (extra, spec) in cases {
        let l = with(extra.clone()).expect("valid");
        assert_eq!(l.calendar.map(|c| c.spec).as_deref(), Some(spec), "{extra}");
    }
    // The default, and first_hit said out loud, are the window of old.
    for extra in [json!({}), json!({"align": "first_hit"})] {
        let l = with(extra).expect("valid");
        assert_eq!((l.calendar, l.window_ms), (None, 1_000));
        assert_eq!(l.policy_item, "\"global\";q=5000;w=1");
    }
    let at = "policies[1].rate_limits[0]";
    let errors = [
        (
            json!({"align": "calendar", "window": "24h"}),
            format!(
                "{at}.window: \"24h\" is not a calendar period: with align \"calendar\" the \
                  window is \"1d\" (a day), \"1w\" (a week from Monday) or \"1mo\" (a month)"
            ),
        ),
        (
            json!({"align": "calendar", "window": "1mo", "zone": "Europe/Berlin"}),
            format!(
                "{at}.zone: \"Europe/Berlin\" is a time-zone name, and the filter carries no \
                  time-zone database: give it with its POSIX TZ rule, {{\"name\": \
                  \"Europe/Berlin\", \"rule\": \"<rule>\"}} (`cg-check --zone Europe/Berlin` or \
                  `make zone ZONE=Europe/Berlin` prints it from this machine's tzdata)"
            ),
        ),
        (
            json!({"align": "calendar", "window": "1mo", "zone": "+25:00"}),
            format!(
                "{at}.zone: \"+25:00\" is not \"UTC\", a UTC offset from \"-12:00\" to \
                  \"+14:00\" (\"+02:00\", \"-05:30\") or a zone given by {{\"name\", \"rule\"}}"
            ),
        ),
        (
            json!({"align": "calendar", "window": "1mo", "zone": {"name": "Europe/Berlin",
                "rule": "CET-1CEST,M3.5.0"}}),
            format!(
                "{at}.zone.rule: \"CET-1CEST,M3.5.0\" is not a POSIX TZ rule (expected ',' \
                  before the change back to standard time at byte 16)"
            ),
        ),
        (
            json!({"align": "calendar", "window": "1mo", "zone": {"name": "Europe/Berlin",
                "rules": "CET-1CEST,M3.5.0,M10.5.0/3"}}),
            format!("{at}.zone.rules: unknown field (did you mean `rule`?)"),
        ),
        (
            json!({"align": "calendar", "window": "1d", "algorithm": "token_bucket"}),
            format!(
                "{at}.align: \"calendar\" needs algorithm fixed_window (a quota per calendar \
                  day, week or month); a sliding window, a log, a bucket or an in-flight cap has \
                  no period to align"
            ),
        ),
        (
            json!({"align": "calendar", "window": "1d", "by": ["tenant"], "overrides": true}),
            format!(
                "{at}.overrides: is not supported with align \"calendar\": a tenant's own quota \
                  holds a window in milliseconds, not a calendar period"
            ),
        ),
        (
            json!({"zone": "UTC"}),
            format!("{at}.zone: only applies with \"align\": \"calendar\""),
        ),
        (
            json!({"window": "1w"}),
            format!(
                "{at}.window: \"1w\" is a calendar period: add \"align\": \"calendar\" (a fixed \
                  window from the start of each week or month in a zone), or give a duration"
            ),
        ),
    ];
    for (extra, want) in errors {
        assert_eq!(
            with(extra.clone()).map(|_| ()).unwrap_err().to_string(),
            want,
            "{extra}"
        );
    }
}

/// Each limit's `RateLimit-Policy` item is written at configuration, from its own name,
/// limit and window (in whole seconds, rounded up, at least 1), as every response shows it:
/// a token bucket's from its burst and the time the bucket takes to fill.
#[test]
fn each_limit_carries_its_policy_item() {
    let mut v = base();
    v["policies"][1]["rate_limits"][0]["window"] = json!("250ms");
    let config = Config::from_value(&v).expect("valid");
    let items: Vec<&str> = config
        .policies
        .iter()
        .flat_map(|p| &p.rate_limits)
        .map(|l| l.policy_item.as_str())
        .collect();
    assert_eq!(
        items,
        [
            "\"tenant\";q=100;w=60",
            "\"user-burst\";q=20;w=2",
            "\"per-ip\";q=1000;w=3600",
            "\"global\";q=5000;w=1",
        ]
    );
}

/// Every object of the configuration, each field of it at least once: a rename of any field
/// below is refused as unknown, naming the field it was meant as.
fn every_object() -> Value {
    json!({
        "redis": {
            "protocol": "webdis", "cluster": "gw", "authority": "gw", "timeout": "50ms",
            "authorization_env": "CG_AUTH", "key_prefix": "cg",
            "batch": {"max_delay": "1ms", "max_requests": 8, "cross_slot": true}
        },
        "identity": {"tenant": {"header": "x-tenant"}, "principal_header": "x-user",
                     "missing_tenant": "reject"},
        "failure_mode": "fail_closed",
        "response_headers": true,
        "envoy_buffer_limit": "1MiB",
        "over_limit_cache": {"entries": 10},
        "problem_type_base": "https://example.com/problems/",
        "policies": [{
            "name": "p",
            "match": {"methods": ["POST"], "path_prefix": "/a", "host": "h",
                      "headers": [{"name": "x-a", "exact": "1"}]},
            "failure_mode": "fail_open",
            "rate_limits": [
                {"name": "t", "by": ["tenant"], "algorithm": "token_bucket", "limit": 10,
                 "window": "1s", "burst": 20, "shadow": false, "mode": "exact",
                 "cost": {"header": "x-cost", "default": 1, "min": 0, "max": 5},
                 "charge": {"response_json": "/n", "max_body": "1KiB"}, "overrides": true,
                 "unit": "tokens"},
                {"name": "monthly", "algorithm": "fixed_window", "limit": 10, "window": "1mo",
                 "align": "calendar", "zone": {"name": "Europe/Berlin",
                 "rule": "CET-1CEST,M3.5.0,M10.5.0/3"}}
            ],
            "idempotency": {
                "header": "idempotency-key", "required": true, "methods": ["POST"],
                "processing_ttl": "1m", "completed_ttl": "1h", "fingerprint": ["method"],
                "max_request_body": "1KiB", "replay": "full", "max_response_body": "1KiB",
                "replay_headers": ["etag"], "replay_trailers": [], "conflict_status": 422,
                "in_progress": "wait", "max_wait": "1s", "in_progress_status": 409,
                "retryable_statuses": [503], "retryable_grpc_codes": [14], "complete": "sync",
                "encryption": {"key_env": "CG_KEY", "previous_key_env": "CG_KEY"}
            },
            "lease": {"resource": ["path"], "ttl": "10s", "on_busy": "wait", "max_wait": "1s",
                      "fencing_header": "x-fence", "extend": true, "fence_ttl": "7d"}
        }]
    })
}

fn parse_every_object(v: &Value) -> std::result::Result<Config, ConfigError> {
    let key = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=".to_string();
    Config::from_value_with_env(v, &|_| Some(key.clone()))
}

#[test]
fn a_misspelt_field_is_unknown_before_a_required_one_is_missing() {
    assert!(parse_every_object(&every_object()).is_ok());
    // (the object's JSON pointer, its path in messages, the field, the misspelling)
    let cases: &[(&str, &str, &str, &str)] = &[
        ("", "", "redis", "rediss"),
        ("", "", "policies", "polices"),
        ("", "", "over_limit_cache", "over_limit_cach"),
        ("", "", "problem_type_base", "problem_type_bas"),
        ("/redis", "redis.", "cluster", "clustr"),
        ("/redis", "redis.", "authorization_env", "authorisation_env"),
        (
            "/redis/batch",
            "redis.batch.",
            "max_requests",
            "max_request",
        ),
        ("/identity", "identity.", "missing_tenant", "missing_tennat"),
        ("/identity/tenant", "identity.tenant.", "header", "haeder"),
        (
            "/over_limit_cache",
            "over_limit_cache.",
            "entries",
            "entris",
        ),
        ("/policies/0", "policies[0].", "name", "nmae"),
        ("/policies/0", "policies[0].", "rate_limits", "rate_limit"),
        (
            "/policies/0/match",
            "policies[0].match.",
            "path_prefix",
            "path_prefx",
        ),
        (
            "/policies/0/match/headers/0",
            "policies[0].match.headers[0].",
            "exact",
            "exakt",
        ),
        (
            "/policies/0/rate_limits/0",
            "policies[0].rate_limits[0].",
            "window",
            "windw",
        ),
        (
            "/policies/0/rate_limits/0",
            "policies[0].rate_limits[0].",
            "window",
            "Window",
        ),
        (
            "/policies/0/rate_limits/0",
            "policies[0].rate_limits[0].",
            "algorithm",
            "algoritm",
        ),
        (
            "/policies/0/rate_limits/0",
            "policies[0].rate_limits[0].",
            "limit",
            "limt",
        ),
        (
            "/policies/0/rate_limits/1",
            "policies[0].rate_limits[1].",
            "align",
            "aligne",
        ),
        (
            "/policies/0/rate_limits/1/zone",
            "policies[0].rate_limits[1].zone.",
            "rule",
            "rul",
        ),
        (
            "/policies/0/rate_limits/0/cost",
            "policies[0].rate_limits[0].cost.",
            "header",
            "headr",
        ),
        (
            "/policies/0/rate_limits/0/charge",
            "policies[0].rate_limits[0].charge.",
            "response_json",
            "response_jsn",
        ),
        (
            "/policies/0/idempotency",
            "policies[0].idempotency.",
            "fingerprint",
            "fingerprints",
        ),
        (
            "/policies/0/idempotency/encryption",
            "policies[0].idempotency.encryption.",
            "key_env",
            "key_evn",
        ),
        (
            "/policies/0/lease",
            "policies[0].lease.",
            "resource",
            "resorce",
        ),
        ("/policies/0/lease", "policies[0].lease.", "ttl", "tll"),
    ];
    for (object, at, field, typo) in cases {
        let mut v = every_object();
        let map = v
            .pointer_mut(object)
            .and_then(Value::as_object_mut)
            .expect("an object");
        let value = map.remove(*field).expect("the field is there");
        map.insert((*typo).to_string(), value);
        let err = parse_every_object(&v)
            .expect_err("a misspelt field")
            .to_string();
        assert_eq!(
            err,
            format!("{at}{typo}: unknown field (did you mean `{field}`?)"),
            "{object} {field}"
        );
    }
}

#[test]
fn an_unknown_field_far_from_every_name_lists_them() {
    let mut v = every_object();
    v["policies"][0]["lease"]["colour"] = json!("red");
    assert_eq!(
        parse_every_object(&v).expect_err("unknown").to_string(),
        "policies[0].lease.colour: unknown field (known here: extend, fence_ttl, fencing_header, max_wait, on_busy, resource, ttl)"
    );
    // An unknown field is reported before an invalid one of the same object.
    v["policies"][0]["lease"]["ttl"] = json!("soon");
    assert!(parse_every_object(&v)
        .expect_err("unknown")
        .to_string()
        .starts_with("policies[0].lease.colour: unknown field"));
}

#[test]
fn the_nearest_name_is_suggested_only_when_close() {
    let names = [
        "window",
        "burst",
        "by",
        "limit",
        "rate_limits",
        "path_exact",
        "path_prefix",
    ];
    for (given, want) in [
        ("windw", Some("window")),
        ("widnow", Some("window")),
        ("WINDOW", Some("window")),
        ("windows", Some("window")),
        ("bursts", Some("burst")),
        ("bye", Some("by")),
        ("rate_limit", Some("rate_limits")),
        ("rate-limits", Some("rate_limits")),
        ("path_prefx", Some("path_prefix")),
        ("path", None),
        ("wind", None),
        ("b", Some("by")),
        ("x", None),
        ("", None),
        ("colour", None),
        ("limiter", Some("limit")),
        ("timeout", None),
        ("wndw", None),
        ("a_name_far_longer_than_any_known_one", None),
    ] {
        assert_eq!(reader::nearest(given, &names), want, "{given:?}");
    }
    // A tie goes to the first name.
    assert_eq!(reader::nearest("ab", &["ax", "ay"]), Some("ax"));
}

#[test]
fn the_memory_budget_bounds_the_body_limits() {
    let with = |top: Value, idem: Value| {
        let mut v = base();
        for (k, val) in top.as_object().expect("object") {
            v[k] = val.clone();
        }
        v["policies"] = json!([{"name": "p", "idempotency": idem}]);
        Config::from_value(&v)
    };
    let c = with(json!({}), json!({})).expect("valid");
    assert_eq!(c.memory_budget, DEFAULT_MEMORY_BUDGET);
    let c = with(json!({"memory_budget": "4MiB"}), json!({})).expect("valid");
    let i = c.policies[0].idempotency.as_ref().expect("idempotency");
    assert_eq!(
        (i.max_request_body, i.max_response_body),
        (512 << 10, 64 << 10),
        "defaults within an eighth of the budget"
    );
    for (top, idem, want) in [
        (json!({"memory_budget": "1MiB"}), json!({}),
         "memory_budget: 1048576 bytes is less than the smallest budget, 4194304 bytes (4MiB)"),
        (json!({"memory_budget": "512MiB"}), json!({}),
         "memory_budget: \"512MiB\" is larger than the maximum of 268435456 bytes"),
        (json!({"memory_budget": "8MiB", "envoy_buffer_limit": "4MiB"}),
         json!({"max_response_body": "2MiB"}),
         "policies[0].idempotency.max_response_body: 2097152 bytes is more than an eighth of memory_budget (8388608 bytes): storing one such body takes several copies of it, and a worker that cannot hold them stores it by reference; lower it, or raise memory_budget to at least 16777216 bytes"),
        (json!({"envoy_buffer_limit": "32MiB"}), json!({"max_request_body": "16MiB"}),
         "policies[0].idempotency.max_request_body: 16777216 bytes is more than an eighth of memory_budget (67108864 bytes): fingerprinting one such body takes several copies of it, and a worker that cannot hold them answers 503 guard_overloaded; lower it, or raise memory_budget to at least 134217728 bytes"),
    ] {
        assert_eq!(with(top, idem).expect_err("refused").to_string(), want);
    }
    // Envoy's limit is named first when a body limit breaks both.
    let err = with(
        json!({"memory_budget": "4MiB"}),
        json!({"max_request_body": "1MiB"}),
    )
    .expect_err("refused")
    .to_string();
    assert!(err.contains("is not below envoy_buffer_limit"), "{err}");
}

#[test]
fn a_charge_body_is_no_larger_than_envoys_buffer() {
    let limit = |charge: Value, top: Value| {
        let mut v = base();
        for (k, val) in top.as_object().expect("object") {
            v[k] = val.clone();
        }
        v["policies"][1]["rate_limits"] = json!([{ "name": "l", "by": ["tenant"],
            "algorithm": "fixed_window", "limit": 100, "window": "1m", "charge": charge }]);
        Config::from_value(&v)
    };
    let at = "policies[1].rate_limits[0].charge";
    let err = limit(
        json!({"response_json": "/u", "max_body": "2MiB"}),
        json!({}),
    )
    .expect_err("refused");
    assert_eq!(err.to_string(), format!("{at}.max_body: 2097152 bytes is above envoy_buffer_limit (1048576 bytes): lower it, or raise Envoy's per_connection_buffer_limit_bytes and envoy_buffer_limit together"));
    let c = limit(
        json!({"response_json": "/u"}),
        json!({"envoy_buffer_limit": "256KiB"}),
    )
    .expect("valid");
    assert!(
        matches!(
            c.policies[1].rate_limits[0]
                .charge
                .as_ref()
                .map(|c| &c.source),
            Some(ChargeSource::Json {
                max_body: 262_144,
                ..
            })
        ),
        "the default follows a smaller buffer limit"
    );
    for (charge, want) in [
        (json!({"response_json": "/a~2"}), format!("{at}.response_json: \"/a~2\" is not a JSON pointer (RFC 6901): \"a~2\" has a '~' not followed by 0 or 1 (write ~0 for '~', ~1 for '/')")),
        (json!({"response_header": "x-u", "unreadable": "maximum"}), format!("{at}.unreadable: \"maximum\" is not \"cost\", \"max\" or a whole number of units from 0 to 1000000000")),
        (json!({"response_header": "x-u", "unreadable": -1}), format!("{at}.unreadable: -1 is not \"cost\", \"max\" or a whole number of units from 0 to 1000000000")),
        (json!({"response_header": "x-u", "unreadable": 1.5}), format!("{at}.unreadable: 1.5 is not \"cost\", \"max\" or a whole number of units from 0 to 1000000000")),
    ] {
        assert_eq!(limit(charge, json!({})).expect_err("refused").to_string(), want);
    }
}
