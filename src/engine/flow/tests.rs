use crate::config::Config;
use crate::config::Replay;
use crate::engine::flow::test_support::*;
use crate::engine::flow::*;
use crate::guards::idempotency::capture::{response_shape, Shape};
use crate::http::request::Request;
use crate::redis::scripts::ScriptId;
use crate::redis::{resp::Reply, CallError};
use crate::support::metrics::testing::Recorder;
use crate::support::metrics::NoMetrics;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// What became of a background call's answer, as the tests read it.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    /// Settled or given up: the outbox let it go.
    Done,
    /// Kept, to be sent again at this time.
    Retry(u64),
    /// Sent again at once (by `EVAL`).
    Resend,
}

/// Hands `answer` at `now` to the one call the outbox holds.
fn settle(
    outbox: &mut Outbox,
    rt: &Runtime,
    slot: usize,
    answer: Result<Reply, CallError>,
    now: u64,
    rec: &Recorder,
) -> Next {
    let settled = outbox.on_answer(&Cx::new(rt, now, rec), slot, answer);
    if settled.resend.is_some() {
        Next::Resend
    } else if let Some(due) = outbox.next_due_ms() {
        Next::Retry(due)
    } else {
        Next::Done
    }
}

/// Sends `bg` alone at `now` and hands it `answer` then.
fn answer_once(
    rt: &Runtime,
    bg: Background,
    answer: Result<Reply, CallError>,
    now: u64,
    rec: &Recorder,
) -> Next {
    let mut outbox = Outbox::default();
    outbox.add(bg);
    let sent = outbox.take_due(now);
    assert_eq!(sent.len(), 1);
    settle(&mut outbox, rt, sent[0].slot, answer, now, rec)
}

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
    Runtime::new(config, metrics, None)
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

#[test]
fn unmatched_request_passes_untouched() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    assert_eq!(
        flow.on_request(
            &Cx::new(&rt, 0, &rec),
            req("DELETE", "/x", None),
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
            req("PUT", "/x", Some("t")),
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
            req("POST", "/orders", None),
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
        req("POST", "/orders", Some("acme")),
        "n",
        "o",
        true,
    ));
    assert_eq!(out.len(), 2, "tenant group and policy group");
    assert!(String::from_utf8_lossy(&out[0].encode(&rt.scripts)).starts_with("EVALSHA/"));
    assert_eq!(flow.deadline_ms(), Some(1_050));
    assert_eq!(
        flow.on_reply(
            &Cx::new(&rt, 1_010, &rec),
            0,
            Ok(ints(&[1, 1, 1, 59_000, 0]))
        )
        .next,
        Move::Wait
    );
    let step = flow.on_reply(
        &Cx::new(&rt, 1_020, &rec),
        1,
        Ok(ints(&[1, 0, 0, 1_000, 1_000])),
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
        flow.on_reply(&Cx::new(&rt, 1_030, &rec), 0, Ok(ints(&[0, 0, 0, 0, 1])))
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
        req("POST", "/orders", Some("acme")),
        "n",
        "o",
        true,
    ));
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 1, &rec), 1, Ok(ints(&[1, 1, 99, 1, 0])))
            .next,
        Move::Wait
    );
    let Move::Respond(r) = flow
        .on_reply(
            &Cx::new(&rt, 2, &rec),
            0,
            Ok(ints(&[0, 0, 0, 30_000, 30_000])),
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
        req("GET", "/r", Some("acme")),
        "n",
        "o",
        true,
    ));
    let noscript = Reply::Error("NOSCRIPT No matching script. Please use EVAL.".into());
    let again = dispatched(flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(noscript.clone())));
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].slot, 0);
    assert!(String::from_utf8_lossy(&again[0].encode(&rt.scripts)).starts_with("EVAL/"));
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
            req("POST", "/orders", Some("a")),
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
                .on_reply(&Cx::new(&rt, 2, &rec), 1, Ok(ints(&[1, 1, 1, 1, 0])))
                .next,
            Move::Wait
        );

        let mut open = Flow::default();
        dispatched(open.on_request(
            &Cx::new(&rt, 0, &rec),
            req("GET", "/r", Some("a")),
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
        req("POST", "/orders", Some("a")),
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
            .on_reply(&Cx::new(&rt, 200, &rec), 0, Ok(ints(&[1, 1, 1, 1, 0])))
            .next,
        Move::Wait
    );

    let mut open = Flow::default();
    dispatched(open.on_request(
        &Cx::new(&rt, 100, &rec),
        req("GET", "/r", Some("a")),
        "n",
        "o",
        true,
    ));
    assert_eq!(open.on_tick(&Cx::new(&rt, 151, &rec)).next, Move::Continue);
    assert_eq!(rec.count("cg.policy.reads.failed_open"), 1);
    assert_eq!(open.deadline_ms(), None);
}

const IDEM_CONFIG: &str = r#"{
  "redis": {"cluster": "gw", "timeout": "50ms", "key_prefix": "cg"},
  "policies": [
    {"name": "orders", "match": {"path_prefix": "/orders"}, "failure_mode": "fail_closed",
     "rate_limits": [{"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window", "limit": 5, "window": "1m"}],
     "idempotency": {"max_request_body": "1KiB", "replay_headers": ["content-type", "location"]}},
    {"name": "async", "match": {"path_prefix": "/async"},
     "idempotency": {"complete": "async", "required": false, "fingerprint": ["method", "path"]}}
  ]
}"#;

fn idem_runtime(rec: &Recorder) -> Runtime {
    let config = Config::parse(IDEM_CONFIG.as_bytes()).expect("valid");
    let metrics = rec.metrics(&config);
    Runtime::new(config, metrics, None)
}

fn idem_req(path: &str, key: Option<&str>, extra: &[(&str, &str)]) -> Request {
    let mut headers = vec![
        (":method".to_string(), "POST".to_string()),
        (":path".to_string(), path.to_string()),
        ("x-tenant-id".to_string(), "acme".to_string()),
        ("content-type".to_string(), "application/json".to_string()),
    ];
    if let Some(k) = key {
        headers.push(("idempotency-key".into(), k.into()));
    }
    for (n, v) in extra {
        headers.push((n.to_string(), v.to_string()));
    }
    Request::from_headers(headers, None)
}

/// An acquire reply: one fixed-window limit (admitted) plus the idempotency section.
fn acquire_reply(code: i64, record: &str) -> Reply {
    Reply::Array(Some(vec![
        Reply::Int(1),
        Reply::Int(1),
        Reply::Int(4),
        Reply::Int(60_000),
        Reply::Int(0),
        Reply::Int(code),
        Reply::Int(100_000),
        Reply::Bulk(Some(record.as_bytes().to_vec())),
    ]))
}

/// Headers, then the body in two chunks: returns the acquire dispatch.
fn start_with_body(flow: &mut Flow, rt: &Runtime, rec: &Recorder, body: &[u8]) -> Vec<Outgoing> {
    let step = flow.on_request(
        &Cx::new(rt, 0, rec),
        idem_req("/orders", Some("\"k-1\""), &[]),
        "n",
        "owner-1",
        false,
    );
    assert_eq!(
        step.next,
        Move::Wait,
        "headers are held while the body is read"
    );
    assert_eq!(
        flow.on_request_body(&Cx::new(rt, 1, rec), 3, false, Vec::new)
            .next,
        Move::Wait
    );
    dispatched(flow.on_request_body(&Cx::new(rt, 2, rec), body.len(), true, || body.to_vec()))
}

#[test]
fn acquire_then_complete_sync() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = Flow::default();
    let out = start_with_body(&mut flow, &rt, &rec, br#"{ "b": 2, "a": 1 }"#);
    assert_eq!(out.len(), 1, "the record rides with the tenant limit");
    let body = String::from_utf8_lossy(&out[0].encode(&rt.scripts)).into_owned();
    assert!(
        body.contains("%3Aidem%3A%7Bt%2Ed2e79529ba2c46b2%7D%3Aorders%3A"),
        "{body}"
    );
    assert!(!body.contains("k-1"), "the client's key never appears raw");
    let step = flow.on_reply(&Cx::new(&rt, 3, &rec), 0, Ok(acquire_reply(1, "")));
    assert_eq!(step.next, Move::Continue);
    assert_eq!(rec.count("cg.policy.orders.idem.acquired"), 1);
    let fp = step.out.upstream_headers;
    assert_eq!(fp.len(), 1);
    assert_eq!(fp[0].0, FINGERPRINT_HEADER);
    assert!(fp[0].1.starts_with("sha256:") && fp[0].1.len() == 71);

    // The same body with keys in another order has the same fingerprint.
    let mut again = Flow::default();
    start_with_body(&mut again, &rt, &rec, br#"{"a":1,"b":2}"#);
    let step = again.on_reply(&Cx::new(&rt, 3, &rec), 0, Ok(acquire_reply(1, "")));
    assert_eq!(step.out.upstream_headers, fp);

    let headers = vec![
        (":status".to_string(), "201".to_string()),
        ("content-type".to_string(), "application/json".to_string()),
        ("location".to_string(), "/orders/7".to_string()),
        ("x-secret".to_string(), "not stored".to_string()),
    ];
    let step = flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &headers,
        false,
    );
    assert_eq!(
        step.next,
        Move::Continue,
        "the headers go on; the body is copied as it passes and only its end waits"
    );
    let out = dispatched(
        flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 8, true, || {
            b"{\"id\":7}".to_vec()
        }),
    );
    let body = String::from_utf8_lossy(&out[0].encode(&rt.scripts)).into_owned();
    assert!(body.starts_with("EVALSHA/"), "{body}");
    assert!(
        body.contains("location") && !body.contains("x-secret"),
        "{body}"
    );
    assert_eq!(
        flow.deadline_ms(),
        Some(55),
        "the completion is bounded by the timeout"
    );
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 6, &rec), out[0].slot, Ok(Reply::Int(1)))
            .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.policy.orders.idem.completed"), 1);
    assert!(flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
}

#[test]
fn answers_by_stored_state() {
    let completed = r#"{"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:ab","created_ms":1,"updated_ms":2,
        "response":{"status":201,"headers":[["location","/orders/7"]],"body":"{\"id\":7}"}}"#;
    let cases: Vec<(i64, &str, u32, &str)> = vec![
        (2, "", 409, "cg.policy.orders.idem.in_progress"),
        (4, "", 422, "cg.policy.orders.idem.conflict"),
        (5, "", 422, "cg.policy.orders.idem.unreadable"),
        (3, "not json", 422, "cg.policy.orders.idem.unreadable"),
        (3, completed, 201, "cg.policy.orders.idem.replayed"),
    ];
    for (code, record, status, metric) in cases {
        let rec = Recorder::default();
        let rt = idem_runtime(&rec);
        let mut flow = Flow::default();
        start_with_body(&mut flow, &rt, &rec, b"{}");
        let step = flow.on_reply(&Cx::new(&rt, 3, &rec), 0, Ok(acquire_reply(code, record)));
        let Move::Respond(r) = step.next else {
            panic!("code {code}: expected a local answer");
        };
        assert_eq!(r.status, status, "code {code}");
        assert_eq!(rec.count(metric), 1, "code {code}");
        match status {
            409 => assert_eq!(r.header("retry-after"), Some("1")),
            201 => {
                assert_eq!(r.header(REPLAYED_HEADER), Some("true"));
                assert_eq!(r.header("location"), Some("/orders/7"));
                assert_eq!(r.body, b"{\"id\":7}".to_vec());
            }
            _ => {
                assert_eq!(r.header("content-type"), Some("application/problem+json"));
                let body = String::from_utf8_lossy(&r.body);
                assert!(body.contains("idempotency_key_conflict"), "{body}");
            }
        }
        assert!(
            step.out.upstream_headers.is_empty(),
            "nothing goes upstream"
        );
        assert!(
            flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty(),
            "nothing to release: not ours"
        );
    }
}

/// `IDEM_CONFIG` with `encryption` on the `orders` policy: `current` (and `previous`) are
/// the record keys' bytes, handed in through the environment as the VM would.
fn sealed_runtime(rec: &Recorder, current: u8, previous: Option<u8>) -> Runtime {
    use crate::support::text::base64_encode;
    let mut v: serde_json::Value = serde_json::from_str(IDEM_CONFIG).expect("json");
    let mut encryption = serde_json::json!({"key_env": "CG_RECORD_KEY"});
    if previous.is_some() {
        encryption["previous_key_env"] = "CG_RECORD_KEY_OLD".into();
    }
    v["policies"][0]["idempotency"]["encryption"] = encryption;
    let env = |name: &str| match name {
        "CG_RECORD_KEY" => Some(base64_encode(&[current; 32])),
        "CG_RECORD_KEY_OLD" => previous.map(|p| base64_encode(&[p; 32])),
        _ => None,
    };
    let config = Config::from_value_with_env(&v, &env).expect("valid");
    let metrics = rec.metrics(&config);
    Runtime::new(config, metrics, None)
}

/// A request with client key `key` and body `{}`, acquired; returns the flow and the
/// fingerprint the acquire sent.
fn acquired(rt: &Runtime, rec: &Recorder, key: &str) -> (Flow, String) {
    let mut flow = Flow::default();
    let req = idem_req("/orders", Some(key), &[("content-length", "2")]);
    let held = flow.on_request(&Cx::new(rt, 0, rec), req, "n", "owner-1", false);
    assert_eq!(held.next, Move::Wait, "the body is fingerprinted");
    let out = dispatched(flow.on_request_body(&Cx::new(rt, 1, rec), 2, true, || b"{}".to_vec()));
    let fingerprint = out[0].call.args.iter().find(|a| a.starts_with("sha256:"));
    let fingerprint = fingerprint.expect("the acquire carries the fingerprint");
    (flow, fingerprint.to_string())
}

/// What a request with client key `key` is answered when the acquire finds `record`.
fn answer_to(rt: &Runtime, rec: &Recorder, key: &str, record: &str) -> LocalResponse {
    let mut flow = Flow::default();
    let req = idem_req("/orders", Some(key), &[("content-length", "2")]);
    flow.on_request(&Cx::new(rt, 0, rec), req, "n", "owner-2", false);
    flow.on_request_body(&Cx::new(rt, 1, rec), 2, true, || b"{}".to_vec());
    match flow
        .on_reply(&Cx::new(rt, 3, rec), 0, Ok(acquire_reply(3, record)))
        .next
    {
        Move::Respond(r) => Rc::unwrap_or_clone(r),
        other => panic!("expected a local answer, got {other:?}"),
    }
}

/// Runs a response through an acquired flow: the `response` argument of its complete call.
fn completed_response(rt: &Runtime, rec: &Recorder, mut flow: Flow) -> String {
    flow.on_reply(&Cx::new(rt, 3, rec), 0, Ok(acquire_reply(1, "")));
    let headers = pairs(&[
        (":status", "201"),
        ("content-type", "application/json"),
        ("location", "/orders/MARKER-location"),
    ]);
    flow.on_response_headers(
        &Cx::new(rt, 4, rec),
        201,
        true,
        "via_upstream",
        &headers,
        false,
    );
    let out = dispatched(flow.on_response_body(&Cx::new(rt, 5, rec), 23, true, || {
        br#"{"id":"MARKER-in-body"}"#.to_vec()
    }));
    assert_eq!(out[0].script, ScriptId::Complete);
    out[0].call.args[3].to_string()
}

fn completed_record(fingerprint: &str, response: &str) -> String {
    format!(
        r#"{{"schema_version":1,"state":"COMPLETED","fingerprint":"{fingerprint}","created_ms":1,"updated_ms":2,"response":{response}}}"#
    )
}

#[test]
fn sealed_responses_replay_only_where_they_open() {
    use crate::guards::idempotency::seal::RecordKey;
    let kid = |b: u8| {
        RecordKey::from_bytes(&[b; 32])
            .expect("key")
            .kid()
            .to_string()
    };
    let rec = Recorder::default();
    let rt = sealed_runtime(&rec, 0xa1, None);
    let (flow, fingerprint) = acquired(&rt, &rec, "\"k-1\"");
    let response = completed_response(&rt, &rec, flow);
    let prefix = format!(
        r#"{{"sealed":{{"alg":"A256GCM","kid":"{}","nonce":""#,
        kid(0xa1)
    );
    assert!(response.starts_with(&prefix), "{response}");
    for clear in ["MARKER", "location", "201", "content-type"] {
        assert!(
            !response.contains(clear),
            "{clear} is in the clear: {response}"
        );
    }
    // Every seal has a nonce of its own.
    let (again, _) = acquired(&rt, &rec, "\"k-1\"");
    let other = completed_response(&rt, &rec, again);
    let nonce = |r: &str| r.split("\"nonce\":\"").nth(1).map(|n| n[..16].to_string());
    assert_ne!(nonce(&response), nonce(&other));
    let record = completed_record(&fingerprint, &response);

    let replayed = |r: &LocalResponse, case: &str| {
        assert_eq!(r.status, 201, "{case}");
        assert_eq!(r.header(REPLAYED_HEADER), Some("true"), "{case}");
        assert_eq!(
            r.header("location"),
            Some("/orders/MARKER-location"),
            "{case}"
        );
        assert_eq!(r.body, br#"{"id":"MARKER-in-body"}"#.to_vec(), "{case}");
    };
    let refused = |r: &LocalResponse, rec: &Recorder, case: &str| {
        assert_eq!(r.status, 422, "{case}");
        assert_eq!(r.header(REPLAYED_HEADER), None, "{case}");
        assert!(
            !String::from_utf8_lossy(&r.body).contains("MARKER"),
            "{case}"
        );
        let counts = ["unreadable", "sealed_unreadable", "conflict", "replayed"]
            .map(|m| rec.count(&format!("cg.policy.orders.idem.{m}")));
        assert_eq!(counts, [1, 1, 1, 0], "{case}");
    };
    let rec = Recorder::default();
    replayed(
        &answer_to(&sealed_runtime(&rec, 0xa1, None), &rec, "\"k-1\"", &record),
        "same key",
    );
    assert_eq!(rec.count("cg.policy.orders.idem.replayed"), 1);
    let rec = Recorder::default();
    let rotated = sealed_runtime(&rec, 0xb2, Some(0xa1));
    replayed(
        &answer_to(&rotated, &rec, "\"k-1\"", &record),
        "rotated: A is the previous key",
    );
    let (flow, _) = acquired(&rotated, &rec, "\"k-3\"");
    assert!(
        completed_response(&rotated, &rec, flow).contains(&kid(0xb2)),
        "new records: B"
    );

    // The same record where it must not open.
    let tampered = {
        let ct_at = record.find("\"ct\":\"").expect("ct") + 6;
        let mut bytes = record.clone().into_bytes();
        bytes[ct_at] = if bytes[ct_at] == b'A' { b'B' } else { b'A' };
        String::from_utf8(bytes).expect("ascii")
    };
    let plain_rt = |rec: &Recorder| idem_runtime(rec);
    type Case<'a> = (&'a str, Box<dyn Fn(&Recorder) -> Runtime>, &'a str, String);
    let cases: Vec<Case> = vec![
        (
            "key_dropped",
            Box::new(|r| sealed_runtime(r, 0xb2, None)),
            "\"k-1\"",
            record.clone(),
        ),
        (
            "no_encryption",
            Box::new(plain_rt),
            "\"k-1\"",
            record.clone(),
        ),
        (
            "moved_to_another_key",
            Box::new(|r| sealed_runtime(r, 0xa1, None)),
            "\"k-2\"",
            record.clone(),
        ),
        (
            "tampered",
            Box::new(|r| sealed_runtime(r, 0xa1, None)),
            "\"k-1\"",
            tampered,
        ),
    ];
    for (case, runtime, key, record) in cases {
        let rec = Recorder::default();
        refused(&answer_to(&runtime(&rec), &rec, key, &record), &rec, case);
    }

    // A record written in the clear before encryption was turned on still replays.
    let rec = Recorder::default();
    let plain = completed_record(
        &fingerprint,
        r#"{"status":201,"headers":[["location","/orders/MARKER-location"]],"body":"{\"id\":\"MARKER-in-body\"}"}"#,
    );
    replayed(
        &answer_to(&sealed_runtime(&rec, 0xa1, None), &rec, "\"k-1\"", &plain),
        "plain",
    );
}

#[test]
fn bad_keys_and_bodies() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let cases: Vec<(Request, u32, &str)> = vec![
        (
            idem_req("/orders", None, &[]),
            400,
            "cg.policy.orders.idem.missing_key",
        ),
        (
            idem_req("/orders", Some("\"open"), &[]),
            400,
            "cg.policy.orders.idem.invalid_key",
        ),
        (
            idem_req("/orders", Some(&"x".repeat(256)), &[]),
            400,
            "cg.policy.orders.idem.invalid_key",
        ),
        (
            idem_req("/orders", Some("k"), &[("content-length", "2048")]),
            413,
            "cg.policy.orders.idem.body_too_large",
        ),
    ];
    for (req, status, metric) in cases {
        let before = rec.count(metric);
        let mut flow = Flow::default();
        let Move::Respond(r) = flow
            .on_request(&Cx::new(&rt, 0, &rec), req, "n", "o", false)
            .next
        else {
            panic!("expected {status}");
        };
        assert_eq!(r.status, status);
        assert_eq!(rec.count(metric), before + 1, "{metric}");
    }
    // A body that grows past the limit while buffering.
    let mut flow = Flow::default();
    assert_eq!(
        flow.on_request(
            &Cx::new(&rt, 0, &rec),
            idem_req("/orders", Some("k"), &[]),
            "n",
            "o",
            false
        )
        .next,
        Move::Wait
    );
    let Move::Respond(r) = flow
        .on_request_body(&Cx::new(&rt, 1, &rec), 1025, false, Vec::new)
        .next
    else {
        panic!("expected 413");
    };
    assert_eq!(r.status, 413);
    // Not required: no key, no idempotency.
    let mut flow = Flow::default();
    assert_eq!(
        flow.on_request(
            &Cx::new(&rt, 0, &rec),
            idem_req("/async", None, &[]),
            "n",
            "o",
            false
        )
        .next,
        Move::Continue
    );
}

#[test]
fn body_that_never_comes_times_out() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = Flow::default();
    assert_eq!(
        flow.on_request(
            &Cx::new(&rt, 0, &rec),
            idem_req("/orders", Some("k"), &[]),
            "n",
            "o",
            false
        )
        .next,
        Move::Wait
    );
    assert_eq!(flow.deadline_ms(), Some(BODY_IDLE_TIMEOUT_MS));
    assert_eq!(
        flow.on_tick(&Cx::new(&rt, BODY_IDLE_TIMEOUT_MS - 1, &rec))
            .next,
        Move::Wait
    );
    let Move::Respond(r) = flow.on_tick(&Cx::new(&rt, BODY_IDLE_TIMEOUT_MS, &rec)).next else {
        panic!("expected 408");
    };
    assert_eq!(r.status, 408);
}

fn forwarded(rt: &Runtime, rec: &Recorder) -> Flow {
    let mut flow = Flow::default();
    start_with_body(&mut flow, rt, rec, b"{}");
    assert_eq!(
        flow.on_reply(&Cx::new(rt, 3, rec), 0, Ok(acquire_reply(1, "")))
            .next,
        Move::Continue
    );
    flow
}

#[test]
fn retryable_statuses_release() {
    for status in [500, 503, 408, 425, 429] {
        let rec = Recorder::default();
        let rt = idem_runtime(&rec);
        let mut flow = forwarded(&rt, &rec);
        let out = dispatched(flow.on_response_headers(
            &Cx::new(&rt, 4, &rec),
            status,
            true,
            "via_upstream",
            &[],
            false,
        ));
        let body = String::from_utf8_lossy(&out[0].encode(&rt.scripts)).into_owned();
        assert!(
            body.contains(&rt.scripts.release.sha1),
            "status {status} releases"
        );
        assert_eq!(
            flow.on_reply(&Cx::new(&rt, 5, &rec), out[0].slot, Ok(Reply::Int(1)))
                .next,
            Move::Continue
        );
        assert_eq!(rec.count("cg.policy.orders.idem.released"), 1);
    }
    // 400 is a final answer: stored.
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = forwarded(&rt, &rec);
    let out = dispatched(flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        400,
        true,
        "via_upstream",
        &[],
        true,
    ));
    assert!(
        String::from_utf8_lossy(&out[0].encode(&rt.scripts)).contains(&rt.scripts.complete.sha1)
    );
}

#[test]
fn stale_owner_and_failed_completion_are_counted() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = forwarded(&rt, &rec);
    let out = dispatched(flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &[],
        true,
    ));
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 5, &rec), out[0].slot, Ok(Reply::Int(-1)))
            .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.policy.orders.idem.stale_owner"), 1);

    let mut flow = forwarded(&rt, &rec);
    let out = dispatched(flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &[],
        true,
    ));
    assert_eq!(
        flow.on_reply(
            &Cx::new(&rt, 5, &rec),
            out[0].slot,
            Err(CallError::Gateway(503))
        )
        .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.policy.orders.idem.complete_failed"), 1);

    let mut flow = forwarded(&rt, &rec);
    dispatched(flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &[],
        true,
    ));
    assert_eq!(
        flow.on_tick(&Cx::new(&rt, 1_000, &rec)).next,
        Move::Continue,
        "a slow completion lets the response go"
    );
    assert_eq!(rec.count("cg.policy.orders.idem.complete_failed"), 2);
}

#[test]
fn envoy_local_replies() {
    // Never reached an upstream: released.
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = forwarded(&rt, &rec);
    let out = dispatched(flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        503,
        false,
        "no_healthy_upstream",
        &[],
        true,
    ));
    assert!(String::from_utf8_lossy(&out[0].encode(&rt.scripts)).contains(&rt.scripts.release.sha1));
    // Timed out after it was sent: kept PROCESSING.
    let mut flow = forwarded(&rt, &rec);
    let step = flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        504,
        false,
        "upstream_response_timeout",
        &[],
        true,
    );
    assert_eq!(step.next, Move::Continue);
    assert_eq!(rec.count("cg.policy.orders.idem.outcome_unknown"), 1);
    assert!(flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
}

#[test]
fn stream_ends_early() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    // Client gone while the acquire is in flight: release by owner, from the root.
    let mut flow = Flow::default();
    start_with_body(&mut flow, &rt, &rec, b"{}");
    let bg = flow.on_done(&Cx::new(&rt, 0, &rec));
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::Release);
    // With the owner's cancellation marker: the acquire may still run after this release.
    assert!(bg[0].compensation);
    assert_eq!(
        bg[0].call.args,
        vec!["owner-1".to_string(), "120000".into()]
    );
    assert_eq!(
        &bg[0].call.keys[1],
        "cg:cancel:{t.d2e79529ba2c46b2}:orders:owner-1"
    );
    // Forwarded, then the stream ended without a response: outcome unknown, kept.
    let mut flow = forwarded(&rt, &rec);
    assert!(flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
    assert_eq!(rec.count("cg.policy.orders.idem.outcome_unknown"), 1);
}

#[test]
fn async_completion_goes_to_the_root() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = Flow::default();
    let out = dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        idem_req("/async", Some("k"), &[]),
        "n",
        "o",
        true,
    ));
    assert_eq!(out.len(), 1);
    let reply = Reply::Array(Some(vec![
        Reply::Int(1),
        Reply::Int(1),
        Reply::Int(-2),
        Reply::Bulk(Some(vec![])),
    ]));
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(reply)).next,
        Move::Continue
    );
    assert_eq!(
        flow.on_response_headers(
            &Cx::new(&rt, 2, &rec),
            200,
            true,
            "via_upstream",
            &[],
            false
        )
        .next,
        Move::Continue
    );
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 3, &NoMetrics), 2, false, || b"ab".to_vec())
            .next,
        Move::Continue
    );
    let step = flow.on_response_body(&Cx::new(&rt, 4, &NoMetrics), 1, true, || b"c".to_vec());
    assert_eq!(step.next, Move::Continue);
    let bg = step.out.background;
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::Complete);
    assert!(
        bg[0].call.args[3].contains("\"body\":\"abc\""),
        "{}",
        &bg[0].call.args[3]
    );
}

#[test]
fn rate_limits_of_other_slots_go_before_the_record() {
    // The record is acquired in the tenant group while another group rejects.
    let config = Config::parse(
        br#"{"redis": {"cluster": "gw"}, "over_limit_cache": {"entries": 0}, "policies": [{"name": "p",
          "rate_limits": [{"name": "ip", "by": ["client_ip"], "algorithm": "fixed_window", "limit": 1, "window": "1m"}],
          "idempotency": {"fingerprint": ["method"]}}]}"#,
    )
    .expect("valid");
    let rec = Recorder::default();
    let metrics = rec.metrics(&config);
    let rt = Runtime::new(config, metrics, None);
    let mut flow = Flow::default();
    let out = dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        idem_req("/x", Some("k"), &[]),
        "n",
        "own",
        true,
    ));
    // The rate limit of the other slot goes first; the record waits for its verdict.
    assert_eq!(out.len(), 1);
    assert!(!String::from_utf8_lossy(&out[0].encode(&rt.scripts)).contains("idem"));
    let Move::Respond(r) = flow
        .on_reply(
            &Cx::new(&rt, 2, &rec),
            out[0].slot,
            Ok(ints(&[0, 0, 0, 100, 100])),
        )
        .next
    else {
        panic!("expected 429");
    };
    assert_eq!(r.status, 429);
    assert_eq!(
        r.header("ratelimit"),
        Some("\"ip\";r=0;t=1"),
        "only the limit that was asked"
    );
    assert!(
        flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty(),
        "no record was taken, none to release"
    );

    // Admitted by the first round: then the record is acquired.
    let mut flow = Flow::default();
    let out = dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        idem_req("/x", Some("k"), &[]),
        "n",
        "own",
        true,
    ));
    let second = dispatched(flow.on_reply(
        &Cx::new(&rt, 1, &rec),
        out[0].slot,
        Ok(ints(&[1, 1, 0, 100, 0])),
    ));
    assert!(String::from_utf8_lossy(&second[0].encode(&rt.scripts)).contains("%3Aidem%3A"));
    let acquired = Reply::Array(Some(vec![
        Reply::Int(1),
        Reply::Int(1),
        Reply::Int(-2),
        Reply::Bulk(Some(vec![])),
    ]));
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 2, &rec), second[0].slot, Ok(acquired))
            .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.policy.p.idem.acquired"), 1);
}

const LEASE_CONFIG: &str = r#"{
  "redis": {"cluster": "gw", "timeout": "50ms", "key_prefix": "cg"},
  "policies": [
    {"name": "activate", "match": {"path_prefix": "/orders"},
     "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "10s", "on_busy": "reject"}},
    {"name": "wait", "match": {"path_prefix": "/wait"},
     "lease": {"resource": ["path_segment:2"], "ttl": "2s", "on_busy": "wait", "max_wait": "200ms",
               "fencing_header": "x-lease-token", "extend": false}}
  ]
}"#;

fn lease_runtime(rec: &Recorder) -> Runtime {
    let config = Config::parse(LEASE_CONFIG.as_bytes()).expect("valid");
    let metrics = rec.metrics(&config);
    Runtime::new(config, metrics, None)
}

/// Sends a lease request of [`LEASE_CONFIG`] (`POST /orders/123/activate`) at 0: its acquire.
fn activate(flow: &mut Flow, rt: &Runtime, rec: &Recorder) -> Vec<Outgoing> {
    dispatched(flow.on_request(
        &Cx::new(rt, 0, rec),
        req("POST", "/orders/123/activate", Some("acme")),
        "n",
        "own",
        true,
    ))
}

fn lease_reply(code: i64, value: &[u8]) -> Reply {
    Reply::Array(Some(vec![
        Reply::Int(1),
        Reply::Int(code),
        Reply::Bulk(Some(value.to_vec())),
    ]))
}

#[test]
fn lease_acquired_forwards_the_token_and_releases_after_the_response() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    let out = activate(&mut flow, &rt, &rec);
    assert_eq!(out.len(), 1);
    let body = String::from_utf8_lossy(&out[0].encode(&rt.scripts)).into_owned();
    assert!(
        body.contains("%3Alease%3A%7Bt%2Ed2e79529ba2c46b2%7D%3Aactivate%3A"),
        "{body}"
    );
    assert!(
        !body.contains("123"),
        "the resource never appears raw: {body}"
    );
    let step = flow.on_reply(
        &Cx::new(&rt, 1, &rec),
        0,
        Ok(lease_reply(1, b"1795988269215845")),
    );
    assert_eq!(step.next, Move::Continue);
    assert_eq!(
        step.out.upstream_headers,
        &[(
            "x-fencing-token".to_string(),
            "1795988269215845".to_string()
        )]
    );
    assert_eq!(rec.count("cg.policy.activate.lease.acquired"), 1);
    // Extension is due at half the TTL.
    assert_eq!(flow.deadline_ms(), Some(5_001));
    let step = flow.on_tick(&Cx::new(&rt, 5_001, &rec));
    assert_eq!(step.next, Move::Wait);
    let bg = step.out.background;
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::LeaseExtend);
    assert_eq!(
        bg[0].call.args,
        vec!["own".to_string(), "10000".to_string()]
    );
    assert_eq!(flow.deadline_ms(), Some(10_001));
    // The response waits for the release, so the client's next request finds it free.
    let out = dispatched(flow.on_response_headers(
        &Cx::new(&rt, 6_000, &rec),
        200,
        true,
        "via_upstream",
        &[],
        true,
    ));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].script, ScriptId::LeaseRelease);
    assert_eq!(out[0].call.args, vec!["own".to_string()]);
    assert_eq!(
        flow.deadline_ms(),
        Some(6_050),
        "bounded by the Redis timeout"
    );
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 6_001, &rec), out[0].slot, Ok(Reply::Int(1)))
            .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.policy.activate.lease.released"), 1);
    assert_eq!(flow.deadline_ms(), None, "no more extensions");
    assert!(
        flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty(),
        "released once"
    );
}

#[test]
fn busy_lease_rejects_with_retry_after() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    activate(&mut flow, &rt, &rec);
    let Move::Respond(r) = flow
        .on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(lease_reply(2, b"4200")))
        .next
    else {
        panic!("expected 409");
    };
    assert_eq!(r.status, 409);
    assert_eq!(r.header("retry-after"), Some("5"));
    assert!(String::from_utf8_lossy(&r.body).contains("resource_locked"));
    assert_eq!(rec.count("cg.policy.activate.lease.busy"), 1);
    assert!(
        flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty(),
        "nothing held, nothing released"
    );
}

#[test]
fn busy_lease_waits_then_runs() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/wait/9/x", Some("acme")),
        "n",
        "own",
        true,
    ));
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(lease_reply(2, b"900")))
            .next,
        Move::Wait
    );
    let poll_at = flow.deadline_ms().expect("a poll is scheduled");
    assert!(
        (1 + LEASE_POLL_FIRST_MS / 2..=1 + LEASE_POLL_FIRST_MS).contains(&poll_at),
        "first poll after half to all of the first backoff: {poll_at}"
    );
    assert!(flow.holds_request());
    let out = dispatched(flow.on_tick(&Cx::new(&rt, poll_at, &rec)));
    let body = String::from_utf8_lossy(&out[0].encode(&rt.scripts)).into_owned();
    assert!(
        body.starts_with("EVALSHA/") && body.contains("/3/") && body.contains("%3Acancel%3A"),
        "a lease-only acquire, with the owner's cancellation marker: {body}"
    );
    let step = flow.on_reply(&Cx::new(&rt, 30, &rec), 0, Ok(lease_reply(1, b"77")));
    assert_eq!(step.next, Move::Continue);
    assert_eq!(
        step.out.upstream_headers,
        &[("x-lease-token".to_string(), "77".to_string())]
    );
    assert_eq!(rec.count("cg.policy.wait.lease.waited"), 1);
    assert_eq!(flow.deadline_ms(), None, "extend: false");
}

#[test]
fn busy_lease_gives_up_after_max_wait() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/wait/9/x", Some("acme")),
        "n",
        "own",
        true,
    ));
    let mut now = 1;
    let mut step = flow.on_reply(&Cx::new(&rt, now, &rec), 0, Ok(lease_reply(2, b"1500")));
    let mut polls = 0;
    while step.next == Move::Wait {
        now = flow.deadline_ms().expect("a poll is scheduled");
        dispatched(flow.on_tick(&Cx::new(&rt, now, &rec)));
        polls += 1;
        step = flow.on_reply(&Cx::new(&rt, now + 1, &rec), 0, Ok(lease_reply(2, b"1500")));
    }
    let Move::Respond(r) = step.next else {
        panic!("expected 409, got {step:?}");
    };
    assert_eq!(r.status, 409);
    assert_eq!(
        now, 201,
        "the last poll is exactly at max_wait (200 ms after the first busy answer)"
    );
    assert!((2..=5).contains(&polls), "backoff: {polls} polls");
    assert_eq!(rec.count("cg.policy.wait.lease.busy"), 1);
}

#[test]
fn a_lease_waiter_whose_poll_fails_answers_busy_even_failing_open() {
    let rec = Recorder::default();
    let json = LEASE_CONFIG.replace(
        r#""match": {"path_prefix": "/wait"},"#,
        r#""match": {"path_prefix": "/wait"}, "failure_mode": "fail_open","#,
    );
    let config = Config::parse(json.as_bytes()).expect("valid");
    let metrics = rec.metrics(&config);
    let rt = Runtime::new(config, metrics, None);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/wait/9/x", Some("acme")),
        "n",
        "own",
        true,
    ));
    let step = flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(lease_reply(2, b"2500")));
    assert_eq!(step.next, Move::Wait, "busy: it waits");
    let now = flow.deadline_ms().expect("a poll is scheduled");
    dispatched(flow.on_tick(&Cx::new(&rt, now, &rec)));
    // The gateway fails the poll (Redis down): the holder still runs.
    let step = flow.on_reply(
        &Cx::new(&rt, now + 1, &rec),
        0,
        Err(crate::redis::CallError::Gateway(503)),
    );
    let Move::Respond(r) = step.next else {
        panic!("expected 409, got {step:?}");
    };
    assert_eq!(r.status, 409);
    assert!(String::from_utf8_lossy(&r.body).contains("resource_locked"));
    assert!(r
        .headers
        .iter()
        .any(|(n, v)| n == "retry-after" && v == "3"));
    assert_eq!(rec.count("cg.policy.wait.failed_open"), 0);
    assert_eq!(rec.count("cg.policy.wait.failed_closed"), 1);
    assert_eq!(rec.count("cg.policy.wait.lease.busy"), 1);
    assert!(step.out.upstream_headers.is_empty(), "no fencing token");
}

#[test]
fn missing_resource_is_400() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    let Move::Respond(r) = flow
        .on_request(
            &Cx::new(&rt, 0, &rec),
            req("POST", "/orders", Some("acme")),
            "n",
            "o",
            true,
        )
        .next
    else {
        panic!("expected 400");
    };
    assert_eq!(r.status, 400);
    let body: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(body["missing-selector"], "path_segment:2");
    assert_eq!(rec.count("cg.policy.activate.lease.missing_resource"), 1);
}

#[test]
fn stream_reset_orphans_a_forwarded_lease_and_releases_it_otherwise() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/orders/1/a", Some("acme")),
        "n",
        "own",
        true,
    ));
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(lease_reply(1, b"5")))
            .next,
        Move::Continue
    );
    assert!(flow.deadline_ms().is_some(), "extended while held");
    // Forwarded, no response yet: the service may still be working. The lease is left to
    // expire after its TTL, no longer extended.
    assert!(flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
    assert_eq!(flow.deadline_ms(), None);
    assert_eq!(rec.count("cg.policy.activate.lease.orphaned"), 1);
    assert_eq!(rec.count("cg.policy.activate.lease.released"), 0);
    // A release still in flight when the stream ends is sent again from the root.
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/orders/1/a", Some("acme")),
        "n",
        "own",
        true,
    ));
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(lease_reply(1, b"5")))
            .next,
        Move::Continue
    );
    dispatched(flow.on_response_headers(
        &Cx::new(&rt, 2, &rec),
        200,
        true,
        "via_upstream",
        &[],
        true,
    ));
    let bg = flow.on_done(&Cx::new(&rt, 0, &rec));
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::LeaseRelease);
    // Client gone while the acquire is in flight: released by owner too.
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/orders/1/a", Some("acme")),
        "n",
        "own",
        true,
    ));
    assert_eq!(flow.on_done(&Cx::new(&rt, 0, &rec)).len(), 1);
}

#[test]
fn over_limit_cache_rejects_locally_until_the_deadline() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut first = Flow::default();
    dispatched(first.on_request(
        &Cx::new(&rt, 1_000, &rec),
        req("POST", "/orders", Some("acme")),
        "n",
        "o",
        true,
    ));
    assert_eq!(
        first
            .on_reply(&Cx::new(&rt, 1_001, &rec), 1, Ok(ints(&[1, 1, 99, 1, 0])))
            .next,
        Move::Wait
    );
    let Move::Respond(r) = first
        .on_reply(
            &Cx::new(&rt, 1_002, &rec),
            0,
            Ok(ints(&[0, 0, 0, 30_000, 30_000])),
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
            req("POST", "/orders", Some("acme")),
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
        req("POST", "/orders", Some("globex")),
        "n",
        "o",
        true,
    ));
    let mut later = Flow::default();
    dispatched(later.on_request(
        &Cx::new(&rt, 31_002, &rec),
        req("POST", "/orders", Some("acme")),
        "n",
        "o",
        true,
    ));
}

#[test]
fn leased_quota_admits_from_local_slices() {
    let config = Config::parse(
        br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "p", "rate_limits": [
          {"name": "t", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100, "window": "1m", "mode": "leased"}]}]}"#,
    )
    .expect("valid");
    let rec = Recorder::default();
    let metrics = rec.metrics(&config);
    let rt = Runtime::new(config, metrics, None);
    // The first request asks Redis, which grants a slice of 12 (an eighth of 100).
    let mut first = Flow::default();
    let out = dispatched(first.on_request(
        &Cx::new(&rt, 0, &rec),
        req("GET", "/", Some("acme")),
        "n",
        "o",
        true,
    ));
    assert!(String::from_utf8_lossy(&out[0].encode(&rt.scripts)).contains("/lq/"));
    let step = first.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(ints(&[1, 1, 12, 60_000, 0])));
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
                req("GET", "/", Some("acme")),
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
            req("GET", "/", Some("acme")),
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
        req("GET", "/", Some("globex")),
        "n",
        "o",
        true,
    ));
    // After the window the slice is gone.
    let mut late = Flow::default();
    assert_eq!(
        late.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(ints(&[1, 1, 1, 1, 0])))
            .next,
        Move::Wait,
        "idle flow ignores answers"
    );
    dispatched(late.on_request(
        &Cx::new(&rt, 61_000, &rec),
        req("GET", "/", Some("acme")),
        "n",
        "o",
        true,
    ));
}

#[test]
fn expected_not_ours_answers_are_not_stale_owners() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    // Client gone while the acquire is in flight: the release may find nothing of ours.
    let mut flow = Flow::default();
    start_with_body(&mut flow, &rt, &rec, b"{}");
    let bg = flow.on_done(&Cx::new(&rt, 0, &rec));
    assert!(!bg[0].certain);
    assert_eq!(
        answer_once(&rt, bg[0].clone(), Ok(Reply::Int(0)), 5, &rec),
        Next::Done
    );
    assert_eq!(rec.count("cg.policy.orders.idem.stale_owner"), 0);
    // A release of a record we did own that finds it gone is a stale owner.
    let mut flow = forwarded(&rt, &rec);
    assert!(
        flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty(),
        "kept PROCESSING: outcome unknown"
    );
    let owned = Background::new(
        0,
        Purpose::Release,
        crate::redis::ScriptCall::new(["k"], ["o"]),
        "h".into(),
    );
    assert!(owned.certain);
    answer_once(&rt, owned, Ok(Reply::Int(-1)), 5, &rec);
    assert_eq!(rec.count("cg.policy.orders.idem.stale_owner"), 1);
}

fn never_read() -> Vec<u8> {
    panic!("a body over max_response_body must not be read")
}

fn cl(n: u64) -> Vec<(String, String)> {
    vec![
        ("content-type".to_string(), "text/plain".to_string()),
        ("content-length".to_string(), n.to_string()),
    ]
}

/// The complete call of `out` stores a reference: status and replay headers, no body.
fn assert_reference(out: &[Outgoing]) {
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].script, ScriptId::Complete);
    let stored = &out[0].call.args[3];
    assert!(stored.contains("\"reference\":true"), "{stored}");
    assert!(!stored.contains("\"body"), "{stored}");
    assert!(stored.contains("\"status\":201"), "{stored}");
}

#[test]
fn sync_response_declared_too_large_streams_and_holds_only_its_last_piece() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = forwarded(&rt, &rec);
    // content-length over max_response_body (64 KiB): never buffered, headers go on at once.
    let step = flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &cl(100_000),
        false,
    );
    assert_eq!(step.next, Move::Continue);
    assert_eq!(flow.deadline_ms(), None);
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 60_000, false, never_read)
            .next,
        Move::Continue
    );
    // The piece that reaches the declared length waits for the record.
    let out =
        dispatched(flow.on_response_body(&Cx::new(&rt, 6, &NoMetrics), 40_000, false, never_read));
    assert_reference(&out);
    assert_eq!(flow.deadline_ms(), Some(6 + 50));
    // The host's empty end of stream comes later and waits too.
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 7, &NoMetrics), 0, true, never_read)
            .next,
        Move::Wait
    );
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 8, &rec), out[0].slot, Ok(Reply::Int(1)))
            .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.policy.orders.idem.completed"), 1);
    let bg = flow.on_done(&Cx::new(&rt, 0, &rec));
    assert_eq!(rec.count("cg.policy.orders.idem.outcome_unknown"), 0);
    assert!(bg.is_empty());
}

#[test]
fn sync_response_copies_its_body_and_streams_past_max_response_body() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = forwarded(&rt, &rec);
    let chunked = vec![("content-type".to_string(), "text/plain".to_string())];
    assert_eq!(
        flow.on_response_headers(
            &Cx::new(&rt, 4, &rec),
            201,
            true,
            "via_upstream",
            &chunked,
            false
        )
        .next,
        Move::Continue,
        "never held in Envoy's buffer"
    );
    // Copied while it may fit (body_size is each piece) ...
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 30_000, false, || vec![
            b'a';
            30_000
        ])
        .next,
        Move::Continue
    );
    // ... then only counted once it cannot.
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 6, &NoMetrics), 40_000, false, never_read)
            .next,
        Move::Continue
    );
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 7, &NoMetrics), 16_384, false, never_read)
            .next,
        Move::Continue
    );
    // Its end: the last piece waits for the reference record.
    let out = dispatched(flow.on_response_body(&Cx::new(&rt, 8, &NoMetrics), 10, true, never_read));
    assert_reference(&out);
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 9, &rec), out[0].slot, Ok(Reply::Int(1)))
            .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.policy.orders.idem.completed"), 1);
}

#[test]
fn response_trailers_end_a_streaming_body() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = forwarded(&rt, &rec);
    let chunked = vec![("content-type".to_string(), "text/plain".to_string())];
    flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &chunked,
        false,
    );
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 70_000, false, never_read)
            .next,
        Move::Continue
    );
    let out = dispatched(flow.on_response_trailers(&Cx::new(&rt, 6, &NoMetrics), &[]));
    assert_reference(&out);
    // Trailers of a body that fits: it is stored whole.
    let mut flow = forwarded(&rt, &rec);
    flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &chunked,
        false,
    );
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 2, false, || b"ok".to_vec())
            .next,
        Move::Continue
    );
    let out = dispatched(flow.on_response_trailers(&Cx::new(&rt, 6, &NoMetrics), &[]));
    assert!(out[0].call.args[3].contains("\"body\":\"ok\""));
}

#[test]
fn a_response_that_never_ends_is_never_stored_completed() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    // Streaming (declared too large), still buffering, and async copying: the stream ends
    // (upstream reset) before the body's end of stream.
    let mut streaming = forwarded(&rt, &rec);
    streaming.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &cl(100_000),
        false,
    );
    assert_eq!(
        streaming
            .on_response_body(&Cx::new(&rt, 5, &NoMetrics), 60_000, false, never_read)
            .next,
        Move::Continue
    );
    let mut buffering = forwarded(&rt, &rec);
    buffering.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &[],
        false,
    );
    assert_eq!(
        buffering
            .on_response_body(&Cx::new(&rt, 5, &NoMetrics), 10, false, || vec![b'a'; 10])
            .next,
        Move::Continue
    );
    for mut flow in [streaming, buffering] {
        assert!(flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
    }
    assert_eq!(rec.count("cg.policy.orders.idem.outcome_unknown"), 2);
    assert_eq!(rec.count("cg.policy.orders.idem.completed"), 0);

    let mut copying = Flow::default();
    dispatched(copying.on_request(
        &Cx::new(&rt, 0, &rec),
        idem_req("/async", Some("k"), &[]),
        "n",
        "o",
        true,
    ));
    let acquired = Reply::Array(Some(vec![
        Reply::Int(1),
        Reply::Int(1),
        Reply::Int(-2),
        Reply::Bulk(Some(vec![])),
    ]));
    assert_eq!(
        copying
            .on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(acquired))
            .next,
        Move::Continue
    );
    copying.on_response_headers(
        &Cx::new(&rt, 2, &rec),
        201,
        true,
        "via_upstream",
        &cl(100_000),
        false,
    );
    assert_eq!(
        copying
            .on_response_body(&Cx::new(&rt, 3, &NoMetrics), 50_000, false, never_read)
            .next,
        Move::Continue
    );
    assert!(
        copying.on_done(&Cx::new(&rt, 0, &rec)).is_empty(),
        "nothing completed"
    );
    assert_eq!(rec.count("cg.policy.async.idem.outcome_unknown"), 1);
}

#[test]
fn async_response_over_max_is_stored_by_reference_at_its_end() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        idem_req("/async", Some("k"), &[]),
        "n",
        "o",
        true,
    ));
    let acquired = Reply::Array(Some(vec![
        Reply::Int(1),
        Reply::Int(1),
        Reply::Int(-2),
        Reply::Bulk(Some(vec![])),
    ]));
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(acquired)).next,
        Move::Continue
    );
    // No content-length: copied while it fits, then only counted.
    flow.on_response_headers(
        &Cx::new(&rt, 2, &rec),
        201,
        true,
        "via_upstream",
        &[],
        false,
    );
    let first = flow.on_response_body(&Cx::new(&rt, 3, &NoMetrics), 40_000, false, || {
        vec![b'a'; 40_000]
    });
    assert_eq!(first.next, Move::Continue);
    let second = flow.on_response_body(&Cx::new(&rt, 4, &NoMetrics), 40_000, false, never_read);
    assert_eq!(second.next, Move::Continue);
    // The declared length is not the end for async: the end of stream is.
    assert!(first.out.background.is_empty() && second.out.background.is_empty());
    let step = flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 40_000, true, never_read);
    assert_eq!(step.next, Move::Continue);
    let bg = step.out.background;
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::Complete);
    assert!(
        bg[0].call.args[3].contains("\"reference\":true"),
        "{}",
        &bg[0].call.args[3]
    );
    assert!(!bg[0].call.args[3].contains("aaaa"));
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
        let mut headers = vec![
            (":method".to_string(), "POST".to_string()),
            (":path".to_string(), path.to_string()),
        ];
        if extra.iter().all(|(n, _)| *n != "x-tenant-id") {
            headers.push(("x-tenant-id".into(), "acme".into()));
        }
        headers.extend(extra.iter().map(|(n, v)| (n.to_string(), v.to_string())));
        let mut flow = Flow::default();
        let step = flow.on_request(
            &Cx::new(&rt, 0, &rec),
            Request::from_headers(headers, None),
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
    let config = Config::parse(
        br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "q", "lease":
            {"resource": ["query:id"], "ttl": "1s"}}]}"#,
    )
    .expect("valid");
    let metrics = rec.metrics(&config);
    let rt = Runtime::new(config, metrics, None);
    for (path, status) in [
        ("/x?id=1&id=2", 400),
        ("/x?id=1&i%64=1", 400),
        ("/x?id=1", 0),
    ] {
        let mut flow = Flow::default();
        let step = flow.on_request(
            &Cx::new(&rt, 0, &rec),
            req("POST", path, Some("t")),
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

#[test]
fn fail_open_sends_no_fingerprint() {
    let config = Config::parse(
        br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "o", "failure_mode": "fail_open",
            "idempotency": {"fingerprint": ["method", "path"]}}]}"#,
    )
    .expect("valid");
    let rec = Recorder::default();
    let metrics = rec.metrics(&config);
    let rt = Runtime::new(config, metrics, None);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        idem_req("/o", Some("\"k\""), &[]),
        "n",
        "o",
        true,
    ));
    let step = flow.on_reply(&Cx::new(&rt, 60, &rec), 0, Err(CallError::Timeout));
    assert_eq!(step.next, Move::Continue);
    assert!(step.out.upstream_headers.is_empty(), "nothing was acquired");
    assert_eq!(rec.count("cg.policy.o.failed_open"), 1);
}

/// A client key's acquire under the idempotency config, answered with `answer`; returns the
/// step and what the flow handed to the root.
fn acquire_fails(answer: Result<Reply, CallError>) -> (Step, Vec<Background>, Recorder) {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = Flow::default();
    start_with_body(&mut flow, &rt, &rec, b"{}");
    let step = flow.on_reply(&Cx::new(&rt, 3, &rec), 0, answer);
    let bg = step.out.background.clone();
    (step, bg, rec)
}

#[test]
fn a_call_that_provably_did_not_run_is_not_compensated() {
    for e in [
        CallError::Gateway(503),
        CallError::Gateway(403),
        CallError::NotSent,
    ] {
        let (step, bg, rec) = acquire_fails(Err(e.clone()));
        assert!(
            matches!(step.next, Move::Respond(ref r) if r.status == 503),
            "{e:?}"
        );
        assert!(
            bg.is_empty(),
            "{e:?}: nothing was written, nothing to release"
        );
        assert_eq!(rec.count("cg.policy.orders.idem.complete_failed"), 0);
    }
    // Unknown outcomes keep the compensation, with the marker.
    for e in [
        CallError::Transport,
        CallError::Gateway(502),
        CallError::Redis("OOM".into()),
    ] {
        let (_, bg, _) = acquire_fails(Err(e.clone()));
        assert_eq!(bg.len(), 1, "{e:?}");
        assert!(bg[0].compensation && bg[0].call.keys.len() == 2, "{e:?}");
    }
    // A reply that ran but cannot be read: the record may exist.
    let (_, bg, _) = acquire_fails(Ok(ints(&[1, 1])));
    assert_eq!(bg.len(), 1);
    assert!(bg[0].compensation);
}

#[test]
fn a_timed_out_acquire_is_compensated_with_the_marker() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = Flow::default();
    start_with_body(&mut flow, &rt, &rec, b"{}");
    let deadline = flow.deadline_ms().expect("waiting on Redis");
    let step = flow.on_tick(&Cx::new(&rt, deadline, &rec));
    assert!(matches!(step.next, Move::Respond(ref r) if r.status == 503));
    let bg = step.out.background;
    assert_eq!(bg.len(), 1);
    assert!(bg[0].compensation && !bg[0].certain);
    assert!(
        flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty(),
        "handed over once"
    );
    // The late answer is ignored; nothing more is sent.
    let step = flow.on_reply(
        &Cx::new(&rt, deadline + 900, &rec),
        0,
        Ok(acquire_reply(1, "")),
    );
    assert_eq!(step.next, Move::Wait);
    assert!(step.out.background.is_empty());
    assert_eq!(rec.count("cg.policy.orders.idem.acquired"), 0);
}

#[test]
fn a_late_lease_is_compensated_and_never_counted_released() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    activate(&mut flow, &rt, &rec);
    let deadline = flow.deadline_ms().expect("waiting on Redis");
    let step = flow.on_tick(&Cx::new(&rt, deadline, &rec));
    assert!(matches!(step.next, Move::Respond(_)));
    let bg = step.out.background;
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::LeaseRelease);
    assert!(bg[0].compensation);
    // The stream's end does not send it a second time.
    assert!(flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
    assert_eq!(bg[0].call.keys.len(), 2);
    assert!(bg[0].call.keys[1].contains(":cancel:{t."));
    // The late acquire took the lease and the compensation gave it back: not "released".
    assert_eq!(
        answer_once(&rt, bg[0].clone(), Ok(Reply::Int(1)), deadline + 10, &rec),
        Next::Done
    );
    assert_eq!(rec.count("cg.policy.activate.lease.released"), 0);
    assert_eq!(rec.count("cg.policy.activate.lease.acquired"), 0);
    assert_eq!(rec.count("cg.policy.activate.lease.lost"), 0);
}

#[test]
fn releases_are_retried_with_backoff_bounded_in_count_and_time() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let (_, bg, _) = acquire_fails(Err(CallError::Timeout));
    let mut outbox = Outbox::default();
    outbox.add(bg.into_iter().next().expect("a compensation"));
    let mut now = 1_000;
    let mut sends = Vec::new();
    loop {
        let sent = outbox.take_due(now);
        assert_eq!(sent.len(), 1);
        sends.push(now);
        now += 500; // each send times out (the host's timeout)
        match settle(
            &mut outbox,
            &rt,
            sent[0].slot,
            Err(CallError::Timeout),
            now,
            &rec,
        ) {
            Next::Retry(due) => {
                assert!(due > now);
                assert!(
                    outbox.take_due(due - 1).is_empty(),
                    "not before its backoff"
                );
                now = due;
            }
            Next::Done => break,
            Next::Resend => panic!("no NOSCRIPT here"),
        }
    }
    assert!(outbox.is_empty());
    assert_eq!(sends.len() as u32, MAX_SENDS);
    assert_eq!(sends, vec![1_000, 1_600, 2_300, 3_200, 4_500, 6_600]);
    assert_eq!(rec.count("cg.redis.retries"), u64::from(MAX_SENDS) - 1);
    // Given up: the record may exist.
    assert_eq!(rec.count("cg.policy.orders.idem.complete_failed"), 1);

    // A Redis answer is not retried (it would be the same again).
    let (_, bg, _) = acquire_fails(Err(CallError::Timeout));
    let bg = bg.into_iter().next().expect("a compensation");
    assert_eq!(
        answer_once(&rt, bg, Err(CallError::Redis("ERR".into())), 5, &rec),
        Next::Done
    );
    // The time window bounds the retries too.
    let (_, bg, _) = acquire_fails(Err(CallError::Timeout));
    let mut outbox = Outbox::default();
    outbox.add(bg.into_iter().next().expect("a compensation"));
    let sent = outbox.take_due(0);
    assert_eq!(
        settle(
            &mut outbox,
            &rt,
            sent[0].slot,
            Err(CallError::Timeout),
            5,
            &rec
        ),
        Next::Retry(105)
    );
    let sent = outbox.take_due(RETRY_WINDOW_MS - 50);
    assert_eq!(
        settle(
            &mut outbox,
            &rt,
            sent[0].slot,
            Err(CallError::Timeout),
            RETRY_WINDOW_MS,
            &rec
        ),
        Next::Done
    );
    // Extensions and completions are not retried.
    let ext = Background::new(
        0,
        Purpose::Complete,
        crate::redis::ScriptCall::new(["k"], ["o"]),
        "h".into(),
    );
    assert_eq!(
        answer_once(&rt, ext, Err(CallError::Timeout), 5, &rec),
        Next::Done
    );
}

#[test]
fn the_root_sends_only_what_is_due() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let (_, bg, _) = acquire_fails(Err(CallError::Timeout));
    let mut outbox = Outbox::default();
    outbox.add(bg[0].clone());
    let sent = outbox.take_due(100);
    assert_eq!(sent.len(), 1);
    assert!(outbox.take_due(100).is_empty(), "in flight: not sent twice");
    let retry = settle(
        &mut outbox,
        &rt,
        sent[0].slot,
        Err(CallError::Timeout),
        150,
        &rec,
    );
    assert_eq!(retry, Next::Retry(250));
    assert!(outbox.take_due(249).is_empty());
    assert_eq!(outbox.take_due(250).len(), 1);
}

#[test]
fn a_release_sent_again_that_finds_its_lease_gone_counts_as_released() {
    // The first send's answer is lost (a timeout) after Redis deleted the lease: the second
    // finds nothing (`0`) or another owner's lease (`-1`). That is the first send's release.
    for gone in [0, -1] {
        let rec = Recorder::default();
        let rt = lease_runtime(&rec);
        let mut flow = Flow::default();
        activate(&mut flow, &rt, &rec);
        flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(lease_reply(1, b"9")));
        // An event stream holds the lease until it ends, and the root gives it back then.
        let h = headers(&[(":status", "200"), ("content-type", "text/event-stream")]);
        flow.on_response_headers(&Cx::new(&rt, 2, &rec), 200, true, "", &h, false);
        let bg = flow.on_done(&Cx::new(&rt, 2, &rec));
        assert_eq!(bg.len(), 1);
        assert!(bg[0].certain);
        let mut outbox = Outbox::default();
        outbox.add(bg[0].clone());
        let sent = outbox.take_due(10);
        let retry = settle(
            &mut outbox,
            &rt,
            sent[0].slot,
            Err(CallError::Timeout),
            60,
            &rec,
        );
        let Next::Retry(due) = retry else {
            panic!("a timed-out release is sent again: {retry:?}")
        };
        let sent = outbox.take_due(due);
        assert_eq!(sent.len(), 1);
        let settled = outbox.on_answer(
            &Cx::new(&rt, due + 1, &rec),
            sent[0].slot,
            Ok(Reply::Int(gone)),
        );
        assert!(settled.freed.is_some(), "waiters may poll");
        assert!(outbox.is_empty());
        assert_eq!(rec.count("cg.policy.activate.lease.released"), 1, "{gone}");
        assert_eq!(rec.count("cg.policy.activate.lease.lost"), 0, "{gone}");

        // Sent once, the same answer is a lost lease.
        let rec = Recorder::default();
        let rt = lease_runtime(&rec);
        assert_eq!(
            answer_once(&rt, bg[0].clone(), Ok(Reply::Int(gone)), 5, &rec),
            Next::Done
        );
        assert_eq!(rec.count("cg.policy.activate.lease.released"), 0);
        assert_eq!(rec.count("cg.policy.activate.lease.lost"), 1);
    }
}

#[test]
fn fence_ttl_setting_reaches_the_acquire_and_the_polls() {
    let rec = Recorder::default();
    let config = Config::parse(
        br#"{"redis": {"cluster": "gw"}, "policies": [
          {"name": "wait", "lease": {"resource": ["path_segment:2"], "ttl": "2s", "on_busy": "wait",
                                     "fence_ttl": "1h"}}]}"#,
    )
    .expect("valid");
    let metrics = rec.metrics(&config);
    let rt = Runtime::new(config, metrics, None);
    let mut flow = Flow::default();
    let out = dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/wait/9/x", Some("acme")),
        "n",
        "own",
        true,
    ));
    fn tail(args: &crate::redis::Words) -> Vec<&str> {
        args.from_index(args.len() - 3)
    }
    assert_eq!(
        tail(&out[0].call.args),
        vec!["own".to_string(), "2000".to_string(), "3600000".to_string()]
    );
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(lease_reply(2, b"1500")))
            .next,
        Move::Wait
    );
    let now = flow.deadline_ms().expect("a poll is scheduled");
    let poll = dispatched(flow.on_tick(&Cx::new(&rt, now, &rec)));
    assert_eq!(
        tail(&poll[0].call.args),
        vec!["own".to_string(), "2000".to_string(), "3600000".to_string()]
    );
}

#[test]
fn waiters_poll_with_jitter_and_wake_when_the_lease_is_freed_here() {
    let rec = Recorder::default();
    let config = Config::parse(
        br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "wait", "lease":
            {"resource": ["path_segment:2"], "ttl": "10s", "on_busy": "wait", "max_wait": "5s"}}]}"#,
    )
    .expect("valid");
    let metrics = rec.metrics(&config);
    let rt = Runtime::new(config, metrics, None);
    let waiter = |owner: &str| {
        let mut flow = Flow::default();
        dispatched(flow.on_request(
            &Cx::new(&rt, 0, &rec),
            req("POST", "/wait/9/x", Some("acme")),
            "n",
            owner,
            true,
        ));
        assert_eq!(
            flow.on_reply(&Cx::new(&rt, 0, &rec), 0, Ok(lease_reply(2, b"5000")))
                .next,
            Move::Wait
        );
        flow
    };
    // Waiters that met the same busy lease at the same moment do not poll together.
    let mut firsts: Vec<u64> = (0..16)
        .map(|i| waiter(&format!("{i:032x}")).deadline_ms().expect("polls"))
        .collect();
    assert!(firsts
        .iter()
        .all(|d| (LEASE_POLL_FIRST_MS / 2..=LEASE_POLL_FIRST_MS).contains(d)));
    firsts.sort();
    firsts.dedup();
    assert!(firsts.len() >= 6, "spread: {firsts:?}");
    // Backoff doubles up to the cap, each pause jittered within it.
    let mut flow = waiter("owner-a");
    assert_eq!(
        flow.waiting_for().map(|k| k.contains(":lease:")),
        Some(true)
    );
    let mut now = 0;
    let mut pauses = Vec::new();
    for _ in 0..6 {
        let next = flow.deadline_ms().expect("polls");
        pauses.push(next - now);
        now = next;
        dispatched(flow.on_tick(&Cx::new(&rt, now, &rec)));
        assert_eq!(
            flow.on_reply(&Cx::new(&rt, now, &rec), 0, Ok(lease_reply(2, b"5000")))
                .next,
            Move::Wait
        );
    }
    assert!(pauses.iter().all(|p| *p <= LEASE_POLL_MAX_MS), "{pauses:?}");
    assert!(pauses[5] >= LEASE_POLL_MAX_MS / 2, "{pauses:?}");
    // The holder on this worker gave the lease back: the waiter polls at the next tick.
    flow.wake(now + 3);
    assert_eq!(flow.deadline_ms(), Some(now + 3));
    dispatched(flow.on_tick(&Cx::new(&rt, now + 3, &rec)));
    assert_eq!(flow.waiting_for(), None, "polling, not waiting");
}

#[test]
fn a_holder_reports_the_lease_it_freed() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/orders/5/act", Some("acme")),
        "n",
        "own",
        true,
    ));
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(lease_reply(1, b"9")))
            .next,
        Move::Continue
    );
    let step =
        flow.on_response_headers(&Cx::new(&rt, 2, &rec), 200, true, "via_upstream", &[], true);
    assert_eq!(step.out.freed, None, "not before Redis said so");
    let out = dispatched(step);
    let step = flow.on_reply(&Cx::new(&rt, 3, &rec), out[0].slot, Ok(Reply::Int(1)));
    let freed = step.out.freed.expect("freed");
    assert!(freed.contains(":lease:"), "{freed}");
    assert_eq!(flow.on_tick(&Cx::new(&rt, 4, &rec)).out.freed, None, "once");
}

/// A gRPC request with an Idempotency-Key.
fn grpc_req(content_type: &str) -> Request {
    let headers = pairs(&[
        (":method", "POST"),
        (":path", "/orders"),
        ("x-tenant-id", "acme"),
        ("content-type", content_type),
        ("idempotency-key", "\"k-1\""),
    ]);
    Request::from_headers(headers, None)
}

/// A gRPC request (`content-type: application/grpc`) that acquired its record.
fn grpc_forwarded(rt: &Runtime, rec: &Recorder) -> Flow {
    let mut flow = Flow::default();
    let step = flow.on_request(
        &Cx::new(rt, 0, rec),
        grpc_req("application/grpc"),
        "n",
        "owner-1",
        false,
    );
    assert_eq!(step.next, Move::Wait);
    dispatched(flow.on_request_body(&Cx::new(rt, 2, rec), 7, true, || b"\0\0\0\0\x02hi".to_vec()));
    assert_eq!(
        flow.on_reply(&Cx::new(rt, 3, rec), 0, Ok(acquire_reply(1, "")))
            .next,
        Move::Continue
    );
    flow
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

#[test]
fn grpc_outcome_is_read_from_grpc_status() {
    // (headers, trailers or None for trailers-only, released, stored fragment)
    type Pairs = Vec<(String, String)>;
    let cases: Vec<(Pairs, Option<Pairs>, bool, &str)> = vec![
        // Trailers-only, retryable: released (an HTTP 200 says nothing).
        (
            pairs(&[("content-type", "application/grpc"), ("grpc-status", "14")]),
            None,
            true,
            "",
        ),
        // Trailers-only, not retryable: completed with its status and message.
        (
            pairs(&[
                ("content-type", "application/grpc"),
                ("grpc-status", "5"),
                ("grpc-message", "no%20such%20order"),
            ]),
            None,
            false,
            r#""trailers":[["grpc-status","5"],["grpc-message","no%20such%20order"]]"#,
        ),
        // Status in the trailers after a message.
        (
            pairs(&[("content-type", "application/grpc")]),
            Some(pairs(&[("grpc-status", "10"), ("grpc-message", "x")])),
            true,
            "",
        ),
        (
            pairs(&[("content-type", "application/grpc")]),
            Some(pairs(&[
                ("grpc-status", "0"),
                ("x-checksum", "abc"),
                ("x-other", "dropped"),
            ])),
            false,
            r#""trailers":[["grpc-status","0"]]"#,
        ),
    ];
    for (headers, trailers, released, stored) in cases {
        let rec = Recorder::default();
        let rt = idem_runtime(&rec);
        let mut flow = grpc_forwarded(&rt, &rec);
        let at_headers = flow.on_response_headers(
            &Cx::new(&rt, 4, &rec),
            200,
            true,
            "via_upstream",
            &headers,
            trailers.is_none(),
        );
        let out = match &trailers {
            None => dispatched(at_headers),
            Some(t) => {
                // Decided only at the trailers; the message passes meanwhile (copied).
                assert_eq!(at_headers.next, Move::Continue, "{headers:?}");
                assert_eq!(
                    flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 9, false, || {
                        b"\0\0\0\0\x04done".to_vec()
                    })
                    .next,
                    Move::Continue
                );
                // The trailers wait for the record (sync): the client cannot see the end of
                // the response before an immediate retry finds the record settled.
                dispatched(flow.on_response_trailers(&Cx::new(&rt, 6, &NoMetrics), t))
            }
        };
        assert_eq!(out.len(), 1);
        if released {
            assert_eq!(out[0].script, ScriptId::Release, "{headers:?} {trailers:?}");
        } else {
            assert_eq!(
                out[0].script,
                ScriptId::Complete,
                "{headers:?} {trailers:?}"
            );
            let json = &out[0].call.args[3];
            assert!(json.contains(stored), "{json}");
            assert!(!json.contains("x-other"), "{json}");
        }
        assert_eq!(
            flow.on_reply(&Cx::new(&rt, 7, &rec), out[0].slot, Ok(Reply::Int(1)))
                .next,
            Move::Continue
        );
        let metric = if released { "released" } else { "completed" };
        assert_eq!(rec.count(&format!("cg.policy.orders.idem.{metric}")), 1);
    }
}

#[test]
fn grpc_replays_and_local_replies() {
    let trailers_only = r#"{"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:ab",
        "response":{"status":200,"headers":[["content-type","application/grpc"]],
        "trailers":[["grpc-status","5"],["grpc-message","no%20such%20order"]]}}"#;
    let with_message = r#"{"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:ab",
        "response":{"status":200,"headers":[["content-type","application/grpc"]],
        "body_base64":"AAAAAAJoaQ==","trailers":[["grpc-status","0"]]}}"#;
    // (acquire code, record, grpc-status, grpc-message)
    let cases: Vec<(i64, &str, u32, &str)> = vec![
        (3, trailers_only, 5, "no%20such%20order"),
        (
            3,
            with_message,
            6,
            "the call with this idempotency key already completed with OK; its response message cannot be replayed to a gRPC client",
        ),
        (
            2,
            "",
            10,
            "a request with this Idempotency-Key is still being processed; retry later",
        ),
        (
            4,
            "",
            9,
            "this Idempotency-Key was already used for a different request",
        ),
    ];
    for (code, record, status, message) in cases {
        let rec = Recorder::default();
        let rt = idem_runtime(&rec);
        let mut flow = Flow::default();
        flow.on_request(
            &Cx::new(&rt, 0, &rec),
            grpc_req("application/grpc+proto"),
            "n",
            "owner-1",
            false,
        );
        flow.on_request_body(&Cx::new(&rt, 1, &rec), 2, true, || b"hi".to_vec());
        let Move::Respond(r) = flow
            .on_reply(&Cx::new(&rt, 3, &rec), 0, Ok(acquire_reply(code, record)))
            .next
        else {
            panic!("code {code}: expected a local answer");
        };
        assert_eq!(r.grpc_status, Some(status), "code {code}");
        assert_eq!(r.header("grpc-status"), Some(status.to_string().as_str()));
        assert_eq!(
            r.header("grpc-message").map(|m| m.replace("%20", " ")),
            Some(message.replace("%20", " ")),
            "code {code}"
        );
        assert!(
            r.body.is_empty(),
            "code {code}: the host would turn a body into the message"
        );
        assert_ne!(r.header("content-type"), Some("application/problem+json"));
        if code == 3 {
            assert_eq!(r.header(REPLAYED_HEADER), Some("true"));
        }
    }
}

// --- upgrades and streams ----------------------------------------------------------------------

fn upgrade_req(method: &str, path: &str) -> Request {
    let mut h = headers(&[
        (":method", method),
        (":path", path),
        (":authority", "api"),
        ("x-tenant-id", "acme"),
        ("content-type", "application/json"),
        ("idempotency-key", "k-up"),
    ]);
    if method != "CONNECT" {
        h.extend(headers(&[
            ("connection", "upgrade"),
            ("upgrade", "websocket"),
        ]));
    }
    Request::from_headers(h, None)
}

#[test]
fn response_shapes() {
    let sse = headers(&[("content-type", "Text/Event-Stream; charset=utf-8")]);
    let mjpeg = headers(&[("content-type", "multipart/x-mixed-replace; boundary=f")]);
    let json = headers(&[("content-type", "application/json")]);
    type Case<'a> = (u32, bool, bool, &'a [(String, String)], bool, Shape);
    let cases: &[Case] = &[
        (101, true, false, &[], false, Shape::Tunnel),
        (200, true, true, &[], false, Shape::Tunnel),
        (204, true, true, &[], true, Shape::Tunnel),
        (407, true, true, &[], false, Shape::Plain),
        (200, true, false, &[], false, Shape::Plain),
        (200, true, false, &sse, false, Shape::EventStream),
        (200, true, false, &mjpeg, false, Shape::EventStream),
        // Nothing follows the headers: it has ended.
        (200, true, false, &sse, true, Shape::Plain),
        (200, true, false, &json, false, Shape::Plain),
        // Envoy's own replies are never streams.
        (101, false, false, &[], false, Shape::Plain),
        (200, false, false, &sse, false, Shape::Plain),
    ];
    for (status, via, connect, h, eos, want) in cases {
        assert_eq!(
            response_shape(*status, *via, *connect, h, *eos),
            *want,
            "{status} via_upstream={via} connect={connect} {h:?} eos={eos}"
        );
    }
}

#[test]
fn an_upgrade_holds_its_lease_until_the_stream_ends_and_keeps_extending_it() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    let out = dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        upgrade_req("GET", "/orders/7/live"),
        "n",
        "own",
        false,
    ));
    assert_eq!(out.len(), 1);
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(lease_reply(1, b"42")))
            .next,
        Move::Continue
    );
    // The 101 goes on at once and the lease stays held.
    let h = headers(&[("upgrade", "websocket"), ("connection", "upgrade")]);
    let step = flow.on_response_headers(
        &Cx::new(&rt, 100, &rec),
        101,
        true,
        "via_upstream",
        &h,
        false,
    );
    assert_eq!(step.next, Move::Continue);
    assert!(step.out.background.is_empty(), "not released at the 101");
    assert!(flow.wants_response(&Cx::new(&rt, 100, &rec)));
    // Still registered for the watchdog: extended at every half TTL while open.
    for due in [5_001, 10_001, 15_001] {
        assert_eq!(flow.deadline_ms(), Some(due));
        assert_eq!(
            flow.on_response_body(&Cx::new(&rt, due - 1, &NoMetrics), 10, false, never_read)
                .next,
            Move::Continue,
            "frames pass"
        );
        let step = flow.on_tick(&Cx::new(&rt, due, &rec));
        assert_eq!(step.next, Move::Wait);
        let bg = step.out.background;
        assert_eq!(bg.len(), 1);
        assert_eq!(bg[0].purpose, Purpose::LeaseExtend);
    }
    // The session ends: released once, from the root.
    let bg = flow.on_done(&Cx::new(&rt, 0, &rec));
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::LeaseRelease);
    assert!(bg[0].certain);
    assert_eq!(flow.deadline_ms(), None);
    assert!(
        flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty(),
        "released once"
    );

    // An upgrade the service declines is an ordinary response: released before it goes on.
    let mut declined = Flow::default();
    dispatched(declined.on_request(
        &Cx::new(&rt, 0, &rec),
        upgrade_req("GET", "/orders/7/live"),
        "n",
        "own",
        false,
    ));
    declined.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(lease_reply(1, b"43")));
    let out = dispatched(declined.on_response_headers(
        &Cx::new(&rt, 2, &rec),
        426,
        true,
        "via_upstream",
        &[],
        true,
    ));
    assert_eq!(out[0].script, ScriptId::LeaseRelease);
}

#[test]
fn an_event_stream_holds_its_lease_until_it_ends() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/orders/9/feed", Some("acme")),
        "n",
        "own",
        true,
    ));
    flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(lease_reply(1, b"9")));
    let sse = headers(&[("content-type", "text/event-stream")]);
    assert_eq!(
        flow.on_response_headers(
            &Cx::new(&rt, 2, &rec),
            200,
            true,
            "via_upstream",
            &sse,
            false
        )
        .next,
        Move::Continue
    );
    assert_eq!(flow.deadline_ms(), Some(5_001), "still extended");
    let bg = flow.on_done(&Cx::new(&rt, 0, &rec));
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::LeaseRelease);
}

#[test]
fn an_upgrade_is_acquired_without_waiting_for_a_body_and_its_record_released_at_the_101() {
    for method in ["POST", "CONNECT"] {
        let rec = Recorder::default();
        let mut rt = idem_runtime(&rec);
        if let Some(i) = rt.config.policies[0].idempotency.as_mut() {
            i.methods.push("CONNECT".into());
        }
        let mut flow = Flow::default();
        // The fingerprint covers the body, but an upgrade's body is the new protocol: the
        // acquire goes out with the headers.
        let out = dispatched(flow.on_request(
            &Cx::new(&rt, 0, &rec),
            upgrade_req(method, "/orders/live"),
            "n",
            "o",
            false,
        ));
        assert_eq!(out.len(), 1, "{method}");
        assert_eq!(
            flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(acquire_reply(1, "")))
                .next,
            Move::Continue
        );
        let status = if method == "CONNECT" { 200 } else { 101 };
        let out = dispatched(flow.on_response_headers(
            &Cx::new(&rt, 2, &rec),
            status,
            true,
            "via_upstream",
            &[],
            false,
        ));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].script, ScriptId::Release, "{method}: never stored");
        assert_eq!(
            flow.on_reply(&Cx::new(&rt, 3, &rec), out[0].slot, Ok(Reply::Int(1)))
                .next,
            Move::Continue
        );
        assert_eq!(
            flow.on_response_body(&Cx::new(&rt, 4, &NoMetrics), 5, false, never_read)
                .next,
            Move::Continue
        );
        assert!(flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
        assert_eq!(rec.count("cg.policy.orders.idem.released"), 1);
        assert_eq!(rec.count("cg.policy.orders.idem.completed"), 0);
        assert_eq!(rec.count("cg.policy.orders.idem.outcome_unknown"), 0);
    }
}

#[test]
fn an_event_stream_is_never_buffered_and_stored_by_reference_once_it_ended() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let sse = headers(&[("content-type", "text/event-stream")]);
    let mut flow = forwarded(&rt, &rec);
    assert_eq!(
        flow.on_response_headers(
            &Cx::new(&rt, 4, &rec),
            201,
            true,
            "via_upstream",
            &sse,
            false
        )
        .next,
        Move::Continue
    );
    for t in 5..8 {
        assert_eq!(
            flow.on_response_body(&Cx::new(&rt, t, &NoMetrics), 100_000, false, never_read)
                .next,
            Move::Continue,
            "events pass as they come"
        );
    }
    assert_reference(&dispatched(flow.on_response_body(
        &Cx::new(&rt, 9, &NoMetrics),
        0,
        true,
        never_read,
    )));
    // One that never ends (the client leaves): the outcome is unknown, nothing is stored.
    let mut endless = forwarded(&rt, &rec);
    endless.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &sse,
        false,
    );
    endless.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 10, false, never_read);
    assert!(endless.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
    assert_eq!(rec.count("cg.policy.orders.idem.outcome_unknown"), 1);
}

#[test]
fn replay_reference_is_stored_only_once_the_body_ended() {
    let rec = Recorder::default();
    let mut rt = idem_runtime(&rec);
    if let Some(i) = rt.config.policies[0].idempotency.as_mut() {
        i.replay = Replay::Reference;
    }
    // Sync: the body passes untouched; the piece that completes it waits for the record.
    let mut flow = forwarded(&rt, &rec);
    assert_eq!(
        flow.on_response_headers(
            &Cx::new(&rt, 4, &rec),
            201,
            true,
            "via_upstream",
            &cl(100),
            false
        )
        .next,
        Move::Continue
    );
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 60, false, never_read)
            .next,
        Move::Continue
    );
    assert_reference(&dispatched(flow.on_response_body(
        &Cx::new(&rt, 6, &NoMetrics),
        40,
        false,
        never_read,
    )));
    // Reset before its end: never stored.
    let mut reset = forwarded(&rt, &rec);
    reset.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &cl(100),
        false,
    );
    reset.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 60, false, never_read);
    assert!(reset.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
    assert_eq!(rec.count("cg.policy.orders.idem.outcome_unknown"), 1);
    // A response without a body is complete at its headers.
    let mut empty = forwarded(&rt, &rec);
    assert_reference(&dispatched(empty.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &[],
        true,
    )));
}

#[test]
fn a_lease_is_released_with_the_record_when_the_body_passes() {
    let rec = Recorder::default();
    let config = Config::parse(
        br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "both",
            "idempotency": {"fingerprint": ["method", "path"]},
            "lease": {"resource": ["tenant"], "ttl": "10s", "extend": false}}]}"#,
    )
    .expect("valid");
    let metrics = rec.metrics(&config);
    let rt = Runtime::new(config, metrics, None);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        idem_req("/x", Some("\"k\""), &[]),
        "n",
        "own",
        true,
    ));
    let acquired = Reply::Array(Some(vec![
        Reply::Int(1),
        Reply::Int(1),
        Reply::Int(100_000),
        Reply::Bulk(Some(vec![])),
        Reply::Int(1),
        Reply::Bulk(Some(b"77".to_vec())),
    ]));
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(acquired)).next,
        Move::Continue
    );
    // The headers go on at once: nothing is released yet, so nothing is paused on Redis.
    let step = flow.on_response_headers(
        &Cx::new(&rt, 2, &rec),
        201,
        true,
        "via_upstream",
        &[],
        false,
    );
    assert_eq!(step.next, Move::Continue);
    assert!(step.out.background.is_empty(), "no release from the root");
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 3, &rec), 5, false, || b"hello".to_vec())
            .next,
        Move::Continue
    );
    // The body's end waits for both: the record written and the lease given back.
    let out = dispatched(flow.on_response_body(&Cx::new(&rt, 4, &rec), 1, true, || b"!".to_vec()));
    let scripts: Vec<ScriptId> = out.iter().map(|o| o.script).collect();
    assert_eq!(scripts, vec![ScriptId::Complete, ScriptId::LeaseRelease]);
    assert!(
        out[0].call.args[3].contains("hello!"),
        "{}",
        &out[0].call.args[3]
    );
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 5, &rec), out[0].slot, Ok(Reply::Int(1)))
            .next,
        Move::Wait
    );
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 6, &rec), out[1].slot, Ok(Reply::Int(1)))
            .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.policy.both.lease.released"), 1);
    assert_eq!(rec.count("cg.policy.both.idem.completed"), 1);
}

#[test]
fn every_resend_of_a_worker_draws_on_one_budget() {
    // 100 compensations fail at once, each would be re-sent: the worker re-sends
    // RETRY_BUDGET of them, then RETRY_BUDGET_PER_S a second; the others are given up on,
    // counted and warned about (they expire at their TTL).
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let (_, bg, _) = acquire_fails(Err(CallError::Timeout));
    let bg = bg.into_iter().next().expect("a compensation");
    let mut outbox = Outbox::default();
    for _ in 0..100 {
        outbox.add(bg.clone());
    }
    let sent = outbox.take_due(1_000);
    assert_eq!(sent.len(), 100);
    let cx = Cx::new(&rt, 1_050, &rec);
    for out in &sent {
        outbox.on_answer(&cx, out.slot, Err(CallError::Timeout));
    }
    assert_eq!(rec.count("cg.redis.retries"), RETRY_BUDGET);
    assert_eq!(rec.count("cg.redis.retries_dropped"), 100 - RETRY_BUDGET);
    assert_eq!(
        rec.count("cg.policy.orders.idem.complete_failed"),
        100 - RETRY_BUDGET
    );
    assert_eq!(outbox.len() as u64, RETRY_BUDGET);
    // A second later the budget holds RETRY_BUDGET_PER_S re-sends again.
    let resent = outbox.take_due(10_000);
    let cx = Cx::new(&rt, 2_050, &rec);
    for out in &resent {
        outbox.on_answer(&cx, out.slot, Err(CallError::Timeout));
    }
    assert_eq!(
        rec.count("cg.redis.retries"),
        RETRY_BUDGET + RETRY_BUDGET_PER_S
    );
    assert_eq!(outbox.len() as u64, RETRY_BUDGET_PER_S);
}
