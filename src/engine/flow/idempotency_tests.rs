//! The idempotency record through the flow: the body fingerprinted and the record acquired,
//! each stored state's answer (replays, sealed ones included), the record completed or released
//! by the response, gRPC's outcomes, and the compensations of records a request may have taken
//! without knowing.

use crate::config::Config;
use crate::engine::flow::test_support::*;
use crate::engine::flow::*;
use crate::guards::idempotency::guard::REPLAYED_HEADER;
use crate::http::local_reply;
use crate::http::request::Request;
use crate::redis::scripts::ScriptId;
use crate::redis::{resp::Reply, CallError};
use crate::support::metrics::testing::Recorder;
use crate::support::metrics::NoMetrics;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

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

/// The runtime of [`IDEM_CONFIG`].
pub(super) fn idem_runtime(rec: &Recorder) -> Runtime {
    runtime_of(rec, IDEM_CONFIG)
}

/// The acquire answer of the `orders` policy so far: its tenant limit admits (4 left, the
/// window ends in a minute). The record's section follows.
pub(super) fn orders_admitted() -> AcquireReply {
    acquire().limit_ok(4, 60_000)
}

/// Headers, then the body in two chunks: returns the acquire dispatch.
fn start_with_body(flow: &mut Flow, rt: &Runtime, rec: &Recorder, body: &[u8]) -> Vec<Outgoing> {
    let step = flow.on_request(
        &Cx::new(rt, 0, rec),
        json_post("/orders").idempotency_key("\"k-1\"").build(),
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

/// A keyed `POST /orders` whose record was acquired: forwarded, its response to come.
pub(super) fn forwarded(rt: &Runtime, rec: &Recorder) -> Flow {
    let mut flow = Flow::default();
    start_with_body(&mut flow, rt, rec, b"{}");
    assert_eq!(
        flow.on_reply(
            &Cx::new(rt, 3, rec),
            0,
            Ok(orders_admitted().record_new().reply())
        )
        .next,
        Move::Continue
    );
    flow
}

#[test]
fn acquire_then_complete_sync() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = Flow::default();
    let out = start_with_body(&mut flow, &rt, &rec, br#"{ "b": 2, "a": 1 }"#);
    assert_eq!(out.len(), 1, "the record rides with the tenant limit");
    let body = String::from_utf8_lossy(&out[0].encode(&rt.scripts, &rt.tags.next())).into_owned();
    assert!(
        body.contains("%3Aidem%3A%7Bt%2Ed2e79529ba2c46b2%7D%3Aorders%3A"),
        "{body}"
    );
    assert!(!body.contains("k-1"), "the client's key never appears raw");
    let step = flow.on_reply(
        &Cx::new(&rt, 3, &rec),
        0,
        Ok(orders_admitted().record_new().reply()),
    );
    assert_eq!(step.next, Move::Continue);
    assert_eq!(rec.count("cg.policy.orders.idem.acquired"), 1);
    let fp = step.out.upstream_headers;
    assert_eq!(fp.len(), 1);
    assert_eq!(fp[0].0, FINGERPRINT_HEADER);
    assert!(fp[0].1.starts_with("sha256:") && fp[0].1.len() == 71);

    // The same body with keys in another order has the same fingerprint.
    let mut again = Flow::default();
    start_with_body(&mut again, &rt, &rec, br#"{"a":1,"b":2}"#);
    let step = again.on_reply(
        &Cx::new(&rt, 3, &rec),
        0,
        Ok(orders_admitted().record_new().reply()),
    );
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
    let body = String::from_utf8_lossy(&out[0].encode(&rt.scripts, &rt.tags.next())).into_owned();
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
        flow.on_reply(&Cx::new(&rt, 6, &rec), out[0].slot, Ok(settled()))
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
    let cases: Vec<(&str, AcquireReply, u32, &str)> = vec![
        (
            "in progress",
            orders_admitted().record_in_progress(),
            409,
            "cg.policy.orders.idem.in_progress",
        ),
        (
            "conflict",
            orders_admitted().record_conflict(),
            422,
            "cg.policy.orders.idem.conflict",
        ),
        (
            "unreadable",
            orders_admitted().record_unreadable(),
            422,
            "cg.policy.orders.idem.unreadable",
        ),
        (
            "completed, not JSON",
            orders_admitted().record_completed("not json"),
            422,
            "cg.policy.orders.idem.unreadable",
        ),
        (
            "completed",
            orders_admitted().record_completed(completed),
            201,
            "cg.policy.orders.idem.replayed",
        ),
    ];
    for (case, answer, status, metric) in cases {
        let rec = Recorder::default();
        let rt = idem_runtime(&rec);
        let mut flow = Flow::default();
        start_with_body(&mut flow, &rt, &rec, b"{}");
        let step = flow.on_reply(&Cx::new(&rt, 3, &rec), 0, Ok(answer.reply()));
        let Move::Respond(r) = step.next else {
            panic!("{case}: expected a local answer");
        };
        assert_eq!(r.status, status, "{case}");
        assert_eq!(rec.count(metric), 1, "{case}");
        // Every one, the replay too, goes out so that the caller's Envoy does not retry it.
        let wire = local_reply::wire_headers(&r);
        assert_eq!(
            wire.iter().filter(|h| **h == local_reply::NO_RETRY).count(),
            1,
            "{case}"
        );
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
    let req = json_post("/orders")
        .idempotency_key(key)
        .content_length(2)
        .build();
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
    let req = json_post("/orders")
        .idempotency_key(key)
        .content_length(2)
        .build();
    flow.on_request(&Cx::new(rt, 0, rec), req, "n", "owner-2", false);
    flow.on_request_body(&Cx::new(rt, 1, rec), 2, true, || b"{}".to_vec());
    match flow
        .on_reply(
            &Cx::new(rt, 3, rec),
            0,
            Ok(orders_admitted().record_completed(record).reply()),
        )
        .next
    {
        Move::Respond(r) => Rc::unwrap_or_clone(r),
        other => panic!("expected a local answer, got {other:?}"),
    }
}

/// Runs a response through an acquired flow: the `response` argument of its complete call.
fn completed_response(rt: &Runtime, rec: &Recorder, mut flow: Flow) -> String {
    flow.on_reply(
        &Cx::new(rt, 3, rec),
        0,
        Ok(orders_admitted().record_new().reply()),
    );
    let headers = headers(&[
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
            json_post("/orders").build(),
            400,
            "cg.policy.orders.idem.missing_key",
        ),
        (
            json_post("/orders").idempotency_key("\"open").build(),
            400,
            "cg.policy.orders.idem.invalid_key",
        ),
        (
            json_post("/orders")
                .idempotency_key(&"x".repeat(256))
                .build(),
            400,
            "cg.policy.orders.idem.invalid_key",
        ),
        (
            json_post("/orders")
                .idempotency_key("k")
                .content_length(2048)
                .build(),
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
            json_post("/orders").idempotency_key("k").build(),
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
            json_post("/async").build(),
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
            json_post("/orders").idempotency_key("k").build(),
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
        let body =
            String::from_utf8_lossy(&out[0].encode(&rt.scripts, &rt.tags.next())).into_owned();
        assert!(
            body.contains(&rt.scripts.release.sha1),
            "status {status} releases"
        );
        assert_eq!(
            flow.on_reply(&Cx::new(&rt, 5, &rec), out[0].slot, Ok(settled()))
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
        String::from_utf8_lossy(&out[0].encode(&rt.scripts, &rt.tags.next()))
            .contains(&rt.scripts.complete.sha1)
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
        flow.on_reply(&Cx::new(&rt, 5, &rec), out[0].slot, Ok(another_owner()))
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
    assert!(
        String::from_utf8_lossy(&out[0].encode(&rt.scripts, &rt.tags.next()))
            .contains(&rt.scripts.release.sha1)
    );
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
        json_post("/async").idempotency_key("k").build(),
        "n",
        "o",
        true,
    ));
    assert_eq!(out.len(), 1);
    let reply = acquire().record_new().reply();
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
    let rec = Recorder::default();
    let rt = runtime_of(
        &rec,
        r#"{"redis": {"cluster": "gw"}, "over_limit_cache": {"entries": 0}, "policies": [{"name": "p",
          "rate_limits": [{"name": "ip", "by": ["client_ip"], "algorithm": "fixed_window", "limit": 1, "window": "1m"}],
          "idempotency": {"fingerprint": ["method"]}}]}"#,
    );
    let mut flow = Flow::default();
    let out = dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        json_post("/x").idempotency_key("k").build(),
        "n",
        "own",
        true,
    ));
    // The rate limit of the other slot goes first; the record waits for its verdict.
    assert_eq!(out.len(), 1);
    assert!(
        !String::from_utf8_lossy(&out[0].encode(&rt.scripts, &rt.tags.next())).contains("idem")
    );
    let Move::Respond(r) = flow
        .on_reply(
            &Cx::new(&rt, 2, &rec),
            out[0].slot,
            Ok(acquire().limit_over(0, 100, 100).reply()),
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
        json_post("/x").idempotency_key("k").build(),
        "n",
        "own",
        true,
    ));
    let second = dispatched(flow.on_reply(
        &Cx::new(&rt, 1, &rec),
        out[0].slot,
        Ok(acquire().limit_ok(0, 100).reply()),
    ));
    assert!(
        String::from_utf8_lossy(&second[0].encode(&rt.scripts, &rt.tags.next()))
            .contains("%3Aidem%3A")
    );
    let acquired = acquire().record_new().reply();
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 2, &rec), second[0].slot, Ok(acquired))
            .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.policy.p.idem.acquired"), 1);
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
        answer_once(&rt, bg[0].clone(), Ok(missing()), 5, &rec),
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
    answer_once(&rt, owned, Ok(another_owner()), 5, &rec);
    assert_eq!(rec.count("cg.policy.orders.idem.stale_owner"), 1);
}

#[test]
fn fail_open_sends_no_fingerprint() {
    let rec = Recorder::default();
    let rt = runtime_of(
        &rec,
        r#"{"redis": {"cluster": "gw"}, "policies": [{"name": "o", "failure_mode": "fail_open",
            "idempotency": {"fingerprint": ["method", "path"]}}]}"#,
    );
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        json_post("/o").idempotency_key("\"k\"").build(),
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
pub(super) fn acquire_fails(answer: Result<Reply, CallError>) -> (Step, Vec<Background>, Recorder) {
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
        Ok(orders_admitted().record_new().reply()),
    );
    assert_eq!(step.next, Move::Wait);
    assert!(step.out.background.is_empty());
    assert_eq!(rec.count("cg.policy.orders.idem.acquired"), 0);
}

/// A gRPC request with an Idempotency-Key.
fn grpc_req(content_type: &str) -> Request {
    request("POST", "/orders")
        .tenant("acme")
        .content_type(content_type)
        .idempotency_key("\"k-1\"")
        .build()
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
        flow.on_reply(
            &Cx::new(rt, 3, rec),
            0,
            Ok(orders_admitted().record_new().reply())
        )
        .next,
        Move::Continue
    );
    flow
}

#[test]
fn grpc_outcome_is_read_from_grpc_status() {
    // (headers, trailers or None for trailers-only, released, stored fragment)
    type Pairs = Vec<(String, String)>;
    let cases: Vec<(Pairs, Option<Pairs>, bool, &str)> = vec![
        // Trailers-only, retryable: released (an HTTP 200 says nothing).
        (
            headers(&[("content-type", "application/grpc"), ("grpc-status", "14")]),
            None,
            true,
            "",
        ),
        // Trailers-only, not retryable: completed with its status and message.
        (
            headers(&[
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
            headers(&[("content-type", "application/grpc")]),
            Some(headers(&[("grpc-status", "10"), ("grpc-message", "x")])),
            true,
            "",
        ),
        (
            headers(&[("content-type", "application/grpc")]),
            Some(headers(&[
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
            flow.on_reply(&Cx::new(&rt, 7, &rec), out[0].slot, Ok(settled()))
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
    // (case, acquire answer, a replay, grpc-status, grpc-message)
    let cases: Vec<(&str, AcquireReply, bool, u32, &str)> = vec![
        (
            "completed, trailers only",
            orders_admitted().record_completed(trailers_only),
            true,
            5,
            "no%20such%20order",
        ),
        (
            "completed with a message",
            orders_admitted().record_completed(with_message),
            true,
            6,
            "the call with this idempotency key already completed with OK; its response message cannot be replayed to a gRPC client",
        ),
        (
            "in progress",
            orders_admitted().record_in_progress(),
            false,
            10,
            "a request with this Idempotency-Key is still being processed; retry later",
        ),
        (
            "conflict",
            orders_admitted().record_conflict(),
            false,
            9,
            "this Idempotency-Key was already used for a different request",
        ),
    ];
    for (case, answer, replay, status, message) in cases {
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
            .on_reply(&Cx::new(&rt, 3, &rec), 0, Ok(answer.reply()))
            .next
        else {
            panic!("{case}: expected a local answer");
        };
        assert_eq!(r.grpc_status, Some(status), "{case}");
        assert_eq!(r.header("grpc-status"), Some(status.to_string().as_str()));
        assert_eq!(
            r.header("grpc-message").map(|m| m.replace("%20", " ")),
            Some(message.replace("%20", " ")),
            "{case}"
        );
        assert!(
            r.body.is_empty(),
            "{case}: the host would turn a body into the message"
        );
        assert_ne!(r.header("content-type"), Some("application/problem+json"));
        if replay {
            assert_eq!(r.header(REPLAYED_HEADER), Some("true"));
        }
    }
}
