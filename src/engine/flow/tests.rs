//! Requests through the flow: matching, rate limits and their headers, the failure modes and
//! the watchdog, the over-limit cache, leased quotas, and the inputs refused before any call.

use crate::engine::flow::lease_tests::lease_runtime;
use crate::engine::flow::test_support::*;
use crate::engine::flow::*;
use crate::redis::{resp::Reply, CallError};
use crate::support::metrics::testing::Recorder;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const CONFIG: &str = r#"{
  "redis": {"cluster": "gw", "timeout": "50ms", "key_prefix": "cg"},
  "identity": {"missing_tenant": "reject"},
  "failure_mode": "fail_closed",
  "policies": [
    {"name": "orders", "match": {"methods": ["POST"], "path_prefix": "/orders"}, "rate_limits": [
      {"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window", "limit": 2, "window": "1m"},
      {"name": "ip", "by": ["client_ip"], "algorithm": "fixed_window", "limit": 100, "window": "1m", "shadow": true}
    ]},
    {"name": "reads", "match": {"methods": ["GET"]}, "failure_mode": "fail_open", "rate_limits": [
      {"name": "global", "by": [], "algorithm": "token_bucket", "limit": 5, "window": "1s"}
    ]},
    {"name": "free", "match": {"methods": ["PUT"]}}
  ]
}"#;

fn runtime(rec: &Recorder) -> Runtime {
    runtime_of(rec, CONFIG)
}

/// A request of `method` to `path` from the client the `ip` limit counts, `127.0.0.1`.
pub(super) fn req(method: &str, path: &str) -> RequestBuilder {
    request(method, path)
        .authority("api")
        .peer("127.0.0.1:4000")
}

#[test]
fn unmatched_request_passes_untouched() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    assert_eq!(
        flow.on_request(
            &Cx::new(&rt, 0, &rec),
            req("DELETE", "/x").build(),
            "n",
            "o",
            true
        )
        .next,
        Move::Continue
    );
    assert_eq!(flow.deadline_ms(), None);
}

#[test]
fn policy_without_limits_forwards() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    assert_eq!(
        flow.on_request(
            &Cx::new(&rt, 0, &rec),
            req("PUT", "/x").tenant("t").build(),
            "n",
            "o",
            true
        )
        .next,
        Move::Continue
    );
}

#[test]
fn missing_tenant_is_401() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let Move::Respond(r) = flow
        .on_request(
            &Cx::new(&rt, 0, &rec),
            req("POST", "/orders").build(),
            "n",
            "o",
            true,
        )
        .next
    else {
        panic!("expected a local response");
    };
    assert_eq!(r.status, 401);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(
        r.header("www-authenticate"),
        Some("Tenant header=\"x-tenant-id\"")
    );
    assert_eq!(rec.count("cg.policy.orders.missing_tenant"), 1);
}

#[test]
fn allowed_request_continues_with_headers() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let out = dispatched(flow.on_request(
        &Cx::new(&rt, 1_000, &rec),
        req("POST", "/orders").tenant("acme").build(),
        "n",
        "o",
        true,
    ));
    assert_eq!(out.len(), 2, "tenant group and policy group");
    assert!(
        String::from_utf8_lossy(&out[0].encode(&rt.scripts, &rt.tags.next()))
            .starts_with("EVALSHA/")
    );
    assert_eq!(flow.deadline_ms(), Some(1_050));
    assert_eq!(
        flow.on_reply(
            &Cx::new(&rt, 1_010, &rec),
            0,
            Ok(acquire().limit_ok(1, 59_000).reply())
        )
        .next,
        Move::Wait
    );
    let step = flow.on_reply(
        &Cx::new(&rt, 1_020, &rec),
        1,
        Ok(acquire().shadow_over(0, 1_000, 1_000).reply()),
    );
    assert_eq!(step.next, Move::Continue);
    assert_eq!(
        step.out.response_headers,
        &[
            (
                "ratelimit-policy".to_string(),
                "\"tenant\";q=2;w=60".to_string()
            ),
            ("ratelimit".to_string(), "\"tenant\";r=1;t=59".to_string()),
        ]
    );
    assert_eq!(rec.count("cg.policy.orders.limit.tenant.allowed"), 1);
    assert_eq!(rec.count("cg.policy.orders.limit.ip.shadow_rejected"), 1);
    assert_eq!(rec.samples.borrow().len(), 2, "latency recorded per answer");
    // A late duplicate answer changes nothing.
    assert_eq!(
        flow.on_reply(
            &Cx::new(&rt, 1_030, &rec),
            0,
            Ok(acquire().limit_over(0, 0, 1).reply())
        )
        .next,
        Move::Wait
    );
    assert_eq!(
        flow.on_tick(&Cx::new(&rt, 5_000, &rec)).next,
        Move::Wait,
        "decided requests never time out"
    );
}

#[test]
fn rejected_request_gets_429() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/orders").tenant("acme").build(),
        "n",
        "o",
        true,
    ));
    assert_eq!(
        flow.on_reply(
            &Cx::new(&rt, 1, &rec),
            1,
            Ok(acquire().limit_ok(99, 1).reply())
        )
        .next,
        Move::Wait
    );
    let Move::Respond(r) = flow
        .on_reply(
            &Cx::new(&rt, 2, &rec),
            0,
            Ok(acquire().limit_over(0, 30_000, 30_000).reply()),
        )
        .next
    else {
        panic!("expected 429");
    };
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("30"));
    assert_eq!(r.header("ratelimit"), Some("\"tenant\";r=0;t=30"));
    assert_eq!(rec.count("cg.policy.orders.limit.tenant.rejected"), 1);
    assert_eq!(
        rec.count("cg.policy.orders.limit.ip.allowed"),
        0,
        "limits count allowed only for admitted requests"
    );
}

#[test]
fn noscript_retries_with_eval_once() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("GET", "/r").tenant("acme").build(),
        "n",
        "o",
        true,
    ));
    let noscript = noscript();
    let again = dispatched(flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(noscript.clone())));
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].slot, 0);
    assert!(
        String::from_utf8_lossy(&again[0].encode(&rt.scripts, &rt.tags.next()))
            .starts_with("EVAL/")
    );
    assert_eq!(rec.count("cg.redis.noscript"), 1);
    // A second NOSCRIPT (EVAL cannot produce one) is an error, not a loop.
    let step = flow.on_reply(&Cx::new(&rt, 2, &rec), 0, Ok(noscript));
    assert_eq!(step.next, Move::Continue, "reads policy fails open");
    assert_eq!(rec.count("cg.policy.reads.failed_open"), 1);
}

#[test]
fn errors_follow_the_failure_mode() {
    let errors = [
        Err(CallError::Gateway(503)),
        Err(CallError::Transport),
        Ok(Reply::Error("ERR script failed".into())),
        Ok(Reply::Int(1)),
    ];
    for answer in errors {
        let rec = Recorder::default();
        let rt = runtime(&rec);
        let mut closed = Flow::default();
        dispatched(closed.on_request(
            &Cx::new(&rt, 0, &rec),
            req("POST", "/orders").tenant("a").build(),
            "n",
            "o",
            true,
        ));
        let Move::Respond(r) = closed
            .on_reply(&Cx::new(&rt, 1, &rec), 0, answer.clone())
            .next
        else {
            panic!("fail_closed answers locally for {answer:?}");
        };
        assert_eq!(r.status, 503);
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_eq!(rec.count("cg.policy.orders.failed_closed"), 1);
        assert_eq!(
            closed
                .on_reply(
                    &Cx::new(&rt, 2, &rec),
                    1,
                    Ok(acquire().limit_ok(1, 1).reply())
                )
                .next,
            Move::Wait
        );

        let mut open = Flow::default();
        dispatched(open.on_request(
            &Cx::new(&rt, 0, &rec),
            req("GET", "/r").tenant("a").build(),
            "n",
            "o",
            true,
        ));
        assert_eq!(
            open.on_reply(&Cx::new(&rt, 1, &rec), 0, answer).next,
            Move::Continue
        );
        assert_eq!(rec.count("cg.policy.reads.failed_open"), 1);
        assert_eq!(rec.count("cg.redis.errors"), 2);
    }
}

#[test]
fn watchdog_times_out_per_failure_mode() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut closed = Flow::default();
    dispatched(closed.on_request(
        &Cx::new(&rt, 100, &rec),
        req("POST", "/orders").tenant("a").build(),
        "n",
        "o",
        true,
    ));
    assert_eq!(closed.on_tick(&Cx::new(&rt, 149, &rec)).next, Move::Wait);
    let Move::Respond(r) = closed.on_tick(&Cx::new(&rt, 150, &rec)).next else {
        panic!("expected 503");
    };
    assert_eq!(r.status, 503);
    assert_eq!(rec.count("cg.redis.timeouts"), 1);
    // The late answer is ignored.
    assert_eq!(
        closed
            .on_reply(
                &Cx::new(&rt, 200, &rec),
                0,
                Ok(acquire().limit_ok(1, 1).reply())
            )
            .next,
        Move::Wait
    );

    let mut open = Flow::default();
    dispatched(open.on_request(
        &Cx::new(&rt, 100, &rec),
        req("GET", "/r").tenant("a").build(),
        "n",
        "o",
        true,
    ));
    assert_eq!(open.on_tick(&Cx::new(&rt, 151, &rec)).next, Move::Continue);
    assert_eq!(rec.count("cg.policy.reads.failed_open"), 1);
    assert_eq!(open.deadline_ms(), None);
}

#[test]
fn over_limit_cache_rejects_locally_until_the_deadline() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut first = Flow::default();
    dispatched(first.on_request(
        &Cx::new(&rt, 1_000, &rec),
        req("POST", "/orders").tenant("acme").build(),
        "n",
        "o",
        true,
    ));
    assert_eq!(
        first
            .on_reply(
                &Cx::new(&rt, 1_001, &rec),
                1,
                Ok(acquire().limit_ok(99, 1).reply())
            )
            .next,
        Move::Wait
    );
    let Move::Respond(r) = first
        .on_reply(
            &Cx::new(&rt, 1_002, &rec),
            0,
            Ok(acquire().limit_over(0, 30_000, 30_000).reply()),
        )
        .next
    else {
        panic!("expected 429");
    };
    assert_eq!(r.status, 429);

    // Same tenant, 10 s later: answered locally, with the remaining wait.
    let mut second = Flow::default();
    let Move::Respond(r) = second
        .on_request(
            &Cx::new(&rt, 11_002, &rec),
            req("POST", "/orders").tenant("acme").build(),
            "n",
            "o",
            true,
        )
        .next
    else {
        panic!("expected a cached 429");
    };
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("20"));
    assert_eq!(r.header("ratelimit"), Some("\"tenant\";r=0;t=20"));
    assert_eq!(rec.count("cg.over_limit_cache.hits"), 1);
    assert_eq!(rec.count("cg.policy.orders.limit.tenant.rejected"), 2);

    // Another tenant is not affected; after the deadline the tenant goes to Redis again.
    let mut other = Flow::default();
    dispatched(other.on_request(
        &Cx::new(&rt, 11_002, &rec),
        req("POST", "/orders").tenant("globex").build(),
        "n",
        "o",
        true,
    ));
    let mut later = Flow::default();
    dispatched(later.on_request(
        &Cx::new(&rt, 31_002, &rec),
        req("POST", "/orders").tenant("acme").build(),
        "n",
        "o",
        true,
    ));
}

#[test]
fn leased_quota_admits_from_local_slices() {
    let rec = Recorder::default();
    let rt = runtime_of(
        &rec,
        r#"{"redis": {"cluster": "gw"}, "policies": [{"name": "p", "rate_limits": [
          {"name": "t", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100, "window": "1m", "mode": "leased"}]}]}"#,
    );
    // The first request asks Redis, which grants a slice of 12 (an eighth of 100).
    let mut first = Flow::default();
    let out = dispatched(first.on_request(
        &Cx::new(&rt, 0, &rec),
        req("GET", "/").tenant("acme").build(),
        "n",
        "o",
        true,
    ));
    assert!(String::from_utf8_lossy(&out[0].encode(&rt.scripts, &rt.tags.next())).contains("/lq/"));
    let step = first.on_reply(
        &Cx::new(&rt, 1, &rec),
        0,
        Ok(acquire().limit_ok(12, 60_000).reply()),
    );
    assert_eq!(step.next, Move::Continue);
    assert_eq!(step.out.response_headers[1].1, "\"t\";r=11;t=60");
    // Another worker then learns that the counter rejects (the shared over-limit cache): the
    // units of this worker's slice were counted when it was taken, so they still admit.
    rt.over_limit
        .mark(first.admission.all()[0].key.hash(), 50_000);
    // The next 11 are admitted locally: no call.
    for i in 0..11 {
        let mut f = Flow::default();
        assert_eq!(
            f.on_request(
                &Cx::new(&rt, 2 + i, &rec),
                req("GET", "/").tenant("acme").build(),
                "n",
                "o",
                true
            )
            .next,
            Move::Continue,
            "{i}"
        );
    }
    // The 13th has no slice left: the over-limit cache answers.
    let mut again = Flow::default();
    match again
        .on_request(
            &Cx::new(&rt, 20, &rec),
            req("GET", "/").tenant("acme").build(),
            "n",
            "o",
            true,
        )
        .next
    {
        Move::Respond(r) => assert_eq!(r.status, 429),
        other => panic!("expected a 429 from the over-limit cache, got {other:?}"),
    }
    assert_eq!(rec.count("cg.policy.p.limit.t.allowed"), 12);
    // Another tenant has its own counter and slice.
    let mut other = Flow::default();
    dispatched(other.on_request(
        &Cx::new(&rt, 20, &rec),
        req("GET", "/").tenant("globex").build(),
        "n",
        "o",
        true,
    ));
    // After the window the slice is gone.
    let mut late = Flow::default();
    assert_eq!(
        late.on_reply(
            &Cx::new(&rt, 1, &rec),
            0,
            Ok(acquire().limit_ok(1, 1).reply())
        )
        .next,
        Move::Wait,
        "idle flow ignores answers"
    );
    dispatched(late.on_request(
        &Cx::new(&rt, 61_000, &rec),
        req("GET", "/").tenant("acme").build(),
        "n",
        "o",
        true,
    ));
}

#[test]
fn reserved_headers_are_every_filter_owned_header() {
    let rec = Recorder::default();
    assert_eq!(
        *lease_runtime(&rec).reserved_headers,
        [FINGERPRINT_HEADER, "x-fencing-token", "x-lease-token"]
    );
    assert_eq!(*runtime(&rec).reserved_headers, [FINGERPRINT_HEADER]);
}

#[test]
fn ambiguous_inputs_are_400_before_any_call() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 5] = [
        ("/orders/1%2F2/act", &[], "ambiguous_path"),
        ("/orders;x=1/7/act", &[], "ambiguous_path"),
        ("/x%2F..%2Forders/7", &[], "ambiguous_path"),
        (
            "/orders/7/act",
            &[("x-tenant-id", "acme"), ("x-tenant-id", "acme")],
            "ambiguous_tenant",
        ),
        (
            "/orders/7/act",
            &[("x-user-id", "a"), ("x-user-id", "b")],
            "ambiguous_principal",
        ),
    ];
    for (path, extra, slug) in cases {
        let mut sent = request("POST", path);
        if extra.iter().all(|(n, _)| *n != "x-tenant-id") {
            sent = sent.tenant("acme");
        }
        let mut flow = Flow::default();
        let step = flow.on_request(
            &Cx::new(&rt, 0, &rec),
            sent.headers(extra).build(),
            "n",
            "o",
            true,
        );
        let Move::Respond(r) = step.next else {
            panic!("{path}: expected a local answer, got {step:?}");
        };
        assert_eq!(r.status, 400, "{path}");
        let body = String::from_utf8_lossy(&r.body).into_owned();
        assert!(body.contains(slug), "{path}: {body}");
        assert_eq!(flow.deadline_ms(), None, "nothing outstanding");
        assert!(step.out.background.is_empty(), "nothing to give back");
    }
    assert_eq!(rec.count("cg.policy.activate.ambiguous_input"), 4);

    // A repeated query parameter a lease resource reads.
    let rt = runtime_of(
        &rec,
        r#"{"redis": {"cluster": "gw"}, "policies": [{"name": "q", "lease":
            {"resource": ["query:id"], "ttl": "1s"}}]}"#,
    );
    for (path, status) in [
        ("/x?id=1&id=2", 400),
        ("/x?id=1&i%64=1", 400),
        ("/x?id=1", 0),
    ] {
        let mut flow = Flow::default();
        let step = flow.on_request(
            &Cx::new(&rt, 0, &rec),
            req("POST", path).tenant("t").build(),
            "n",
            "o",
            true,
        );
        match step.next {
            Move::Respond(r) => {
                assert_eq!(r.status, status, "{path}");
                assert!(String::from_utf8_lossy(&r.body).contains("\"selector\":\"query:id\""));
            }
            Move::Dispatch(_) => assert_eq!(status, 0, "{path}"),
            other => panic!("{path}: {other:?}"),
        }
    }
}

/// The tag the decision line carries for tenant `acme` (its keys' hash tag).
const ACME: &str = "t.d2e79529ba2c46b2";

#[test]
fn each_guarded_request_hands_out_its_decision_once() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    // No policy: no line.
    let mut flow = Flow::default();
    let step = flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("DELETE", "/x").tenant("acme").build(),
        "n",
        "o",
        true,
    );
    assert_eq!(step.out.decision, None);
    // Allowed, with a shadow limit that would reject: named, with what it has left; the
    // line leaves with the step that forwards the request, and only then.
    let mut flow = Flow::default();
    let step = flow.on_request(
        &Cx::new(&rt, 1_000, &rec),
        req("POST", "/orders").tenant("acme").build(),
        "n",
        "o",
        true,
    );
    assert_eq!(step.out.decision, None, "not decided yet");
    let step = flow.on_reply(
        &Cx::new(&rt, 1_010, &rec),
        0,
        Ok(acquire().limit_ok(1, 59_000).reply()),
    );
    assert_eq!(step.out.decision, None);
    let step = flow.on_reply(
        &Cx::new(&rt, 1_020, &rec),
        1,
        Ok(acquire().shadow_over(0, 1_000, 1_000).reply()),
    );
    assert_eq!(
        step.out.decision.as_deref(),
        Some(
            "policy=orders verdict=shadow_rejected limit=ip remaining=0 \
             tenant=t.d2e79529ba2c46b2 status=-"
        )
    );
    let step = flow.on_response_headers(
        &Cx::new(&rt, 1_030, &rec),
        200,
        true,
        "via_upstream",
        &[],
        true,
    );
    assert_eq!(step.out.decision, None, "once per request");
    // Rejected: the limit that rejected, and the status answered.
    let mut flow = Flow::default();
    flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/orders").tenant("acme").build(),
        "n",
        "o",
        true,
    );
    flow.on_reply(
        &Cx::new(&rt, 1, &rec),
        1,
        Ok(acquire().limit_ok(99, 1).reply()),
    );
    let step = flow.on_reply(
        &Cx::new(&rt, 2, &rec),
        0,
        Ok(acquire().limit_over(0, 30_000, 30_000).reply()),
    );
    assert_eq!(
        step.out.decision,
        Some(format!(
            "policy=orders verdict=rejected limit=tenant remaining=0 tenant={ACME} status=429"
        ))
    );
    // Refused before the tenant is known: no tag.
    let mut flow = Flow::default();
    let step = flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/orders").build(),
        "n",
        "o",
        true,
    );
    assert_eq!(
        step.out.decision.as_deref(),
        Some("policy=orders verdict=refused limit=- remaining=- tenant=- status=401")
    );
    // Redis fails and the policy fails open: forwarded, so no status.
    let mut flow = Flow::default();
    flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("GET", "/r").tenant("acme").build(),
        "n",
        "o",
        true,
    );
    let step = flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Err(CallError::Transport));
    assert_eq!(step.next, Move::Continue);
    assert_eq!(
        step.out.decision,
        Some(format!(
            "policy=reads verdict=failed_open limit=- remaining=- tenant={ACME} status=-"
        ))
    );
}
