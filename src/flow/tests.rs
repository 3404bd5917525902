use super::*;
use crate::metrics::testing::Recorder;
use crate::redis::Scripts;

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
    let config = Config::parse(CONFIG.as_bytes()).expect("valid");
    let metrics = rec.metrics(&config);
    Runtime {
        config,
        scripts: Scripts::load(),
        metrics,
    }
}

fn req(method: &str, path: &str, tenant: Option<&str>) -> Request {
    let mut headers = vec![
        (":method".to_string(), method.to_string()),
        (":path".to_string(), path.to_string()),
        (":authority".to_string(), "api".to_string()),
    ];
    if let Some(t) = tenant {
        headers.push(("x-tenant-id".into(), t.into()));
    }
    Request::from_headers(headers, Some("127.0.0.1:4000"))
}

fn ints(v: &[i64]) -> Reply {
    Reply::Array(Some(v.iter().map(|n| Reply::Int(*n)).collect()))
}

fn dispatched(step: Step) -> Vec<Outgoing> {
    match step {
        Step::Dispatch(out) => out,
        other => panic!("expected Dispatch, got {other:?}"),
    }
}

#[test]
fn unmatched_request_passes_untouched() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    assert_eq!(
        flow.on_request(&rt, req("DELETE", "/x", None), "n", "o", true, 0, &rec),
        Step::Continue
    );
    assert_eq!(flow.deadline_ms(), None);
}

#[test]
fn policy_without_limits_forwards() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    assert_eq!(
        flow.on_request(&rt, req("PUT", "/x", Some("t")), "n", "o", true, 0, &rec),
        Step::Continue
    );
}

#[test]
fn missing_tenant_is_401() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let Step::Respond(r) =
        flow.on_request(&rt, req("POST", "/orders", None), "n", "o", true, 0, &rec)
    else {
        panic!("expected a local response");
    };
    assert_eq!(r.status, 401);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(rec.count("cg.policy.orders.missing_tenant"), 1);
}

#[test]
fn allowed_request_continues_with_headers() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let out = dispatched(flow.on_request(
        &rt,
        req("POST", "/orders", Some("acme")),
        "n",
        "o",
        true,
        1_000,
        &rec,
    ));
    assert_eq!(out.len(), 2, "tenant group and policy group");
    assert!(String::from_utf8_lossy(&out[0].body).starts_with("EVALSHA/"));
    assert_eq!(flow.deadline_ms(), Some(1_050));
    assert_eq!(
        flow.on_reply(&rt, 0, Ok(ints(&[1, 1, 1, 59_000, 0])), 1_010, &rec),
        Step::Wait
    );
    assert_eq!(
        flow.on_reply(&rt, 1, Ok(ints(&[1, 0, 0, 1_000, 1_000])), 1_020, &rec),
        Step::Continue
    );
    assert_eq!(
        flow.response_headers(),
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
    assert_eq!(rec.count("cg.redis.calls"), 2);
    assert_eq!(rec.samples.borrow().len(), 2, "latency recorded per answer");
    // A late duplicate answer changes nothing.
    assert_eq!(
        flow.on_reply(&rt, 0, Ok(ints(&[0, 0, 0, 0, 1])), 1_030, &rec),
        Step::Wait
    );
    assert_eq!(
        flow.on_tick(&rt, 5_000, &rec),
        Step::Wait,
        "decided requests never time out"
    );
}

#[test]
fn rejected_request_gets_429() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &rt,
        req("POST", "/orders", Some("acme")),
        "n",
        "o",
        true,
        0,
        &rec,
    ));
    assert_eq!(
        flow.on_reply(&rt, 1, Ok(ints(&[1, 1, 99, 1, 0])), 1, &rec),
        Step::Wait
    );
    let Step::Respond(r) = flow.on_reply(&rt, 0, Ok(ints(&[0, 0, 0, 30_000, 30_000])), 2, &rec)
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
    dispatched(flow.on_request(&rt, req("GET", "/r", Some("acme")), "n", "o", true, 0, &rec));
    let noscript = Reply::Error("NOSCRIPT No matching script. Please use EVAL.".into());
    let again = dispatched(flow.on_reply(&rt, 0, Ok(noscript.clone()), 1, &rec));
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].slot, 0);
    assert!(String::from_utf8_lossy(&again[0].body).starts_with("EVAL/"));
    assert_eq!(rec.count("cg.redis.noscript"), 1);
    // A second NOSCRIPT (EVAL cannot produce one) is an error, not a loop.
    let step = flow.on_reply(&rt, 0, Ok(noscript), 2, &rec);
    assert_eq!(step, Step::Continue, "reads policy fails open");
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
            &rt,
            req("POST", "/orders", Some("a")),
            "n",
            "o",
            true,
            0,
            &rec,
        ));
        let Step::Respond(r) = closed.on_reply(&rt, 0, answer.clone(), 1, &rec) else {
            panic!("fail_closed answers locally for {answer:?}");
        };
        assert_eq!(r.status, 503);
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_eq!(rec.count("cg.policy.orders.failed_closed"), 1);
        assert_eq!(
            closed.on_reply(&rt, 1, Ok(ints(&[1, 1, 1, 1, 0])), 2, &rec),
            Step::Wait
        );

        let mut open = Flow::default();
        dispatched(open.on_request(&rt, req("GET", "/r", Some("a")), "n", "o", true, 0, &rec));
        assert_eq!(open.on_reply(&rt, 0, answer, 1, &rec), Step::Continue);
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
        &rt,
        req("POST", "/orders", Some("a")),
        "n",
        "o",
        true,
        100,
        &rec,
    ));
    assert_eq!(closed.on_tick(&rt, 149, &rec), Step::Wait);
    let Step::Respond(r) = closed.on_tick(&rt, 150, &rec) else {
        panic!("expected 503");
    };
    assert_eq!(r.status, 503);
    assert_eq!(rec.count("cg.redis.timeouts"), 1);
    // The late answer is ignored.
    assert_eq!(
        closed.on_reply(&rt, 0, Ok(ints(&[1, 1, 1, 1, 0])), 200, &rec),
        Step::Wait
    );

    let mut open = Flow::default();
    dispatched(open.on_request(&rt, req("GET", "/r", Some("a")), "n", "o", true, 100, &rec));
    assert_eq!(open.on_tick(&rt, 151, &rec), Step::Continue);
    assert_eq!(rec.count("cg.policy.reads.failed_open"), 1);
    assert_eq!(open.deadline_ms(), None);
}
