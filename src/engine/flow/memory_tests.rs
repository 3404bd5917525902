//! The worker's memory budget through the flow: what is refused, stored by reference or
//! charged the fallback when the heap (as [`crate::support::heap::pretend_held`] says) is nearly full.

use crate::engine::flow::test_support::*;
use crate::engine::flow::*;
use crate::redis::CallError;
use crate::support::heap::pretend_held;
use crate::support::metrics::testing::Recorder;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const BUDGET: usize = 8 << 20;

const CONFIG: &str = r#"{
  "redis": {"cluster": "gw", "timeout": "50ms", "key_prefix": "cg"},
  "memory_budget": "8MiB",
  "policies": [
    {"name": "orders", "match": {"path_prefix": "/orders"}, "failure_mode": "fail_open",
     "rate_limits": [{"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window", "limit": 5, "window": "1m"}],
     "idempotency": {"max_request_body": "512KiB", "max_response_body": "512KiB"}},
    {"name": "llm", "match": {"path_prefix": "/llm"}, "rate_limits": [
      {"name": "tokens", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000, "window": "1m",
       "cost": {"header": "x-cost", "max": 10000},
       "charge": {"response_json": "/usage/total_tokens"}}]}
  ]
}"#;

fn runtime(rec: &Recorder) -> Runtime {
    runtime_of(rec, CONFIG)
}

/// A keyed request whose headers came; its body is still to come.
fn buffering(rt: &Runtime, rec: &Recorder) -> Flow {
    let mut flow = Flow::default();
    let step = flow.on_request(
        &Cx::new(rt, 0, rec),
        json_post("/orders").idempotency_key("\"k-1\"").build(),
        "n",
        "owner-1",
        false,
    );
    assert_eq!(step.next, Move::Wait);
    flow
}

fn assert_overloaded(step: Step) {
    let r = respond_with(step);
    assert_eq!(r.status, 503);
    assert_eq!(header(&r, "retry-after"), Some("1"));
    let body = String::from_utf8_lossy(&r.body);
    assert!(body.contains("guard_overloaded"), "{body}");
}

/// A JSON body larger than a brief copy that is always made ([`crate::support::memory::SMALL`]).
fn big_json() -> Vec<u8> {
    format!(r#"{{"a":"{}"}}"#, "x".repeat(100_000)).into_bytes()
}

#[test]
fn a_body_to_fingerprint_that_the_budget_cannot_hold_is_refused_before_any_call() {
    let body = &big_json()[..];
    // The body itself does not fit.
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = buffering(&rt, &rec);
    pretend_held(BUDGET - body.len() + 1);
    let step = flow.on_request_body(&Cx::new(&rt, 1, &rec), body.len(), true, || {
        panic!("not read")
    });
    assert_overloaded(step.clone());
    assert!(step.out.background.is_empty(), "nothing asked of Redis");
    assert_eq!(rec.count("cg.memory.refused"), 1);
    assert_eq!(rec.count("cg.policy.orders.idem.acquired"), 0);

    // The body fits, its canonical form's copies do not.
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = buffering(&rt, &rec);
    pretend_held(BUDGET - 3 * body.len());
    let step = flow.on_request_body(&Cx::new(&rt, 1, &rec), body.len(), true, || body.to_vec());
    assert_overloaded(step);
    assert_eq!(rec.count("cg.memory.refused"), 1);

    // The host could not hand it over (short).
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = buffering(&rt, &rec);
    pretend_held(0);
    let step = flow.on_request_body(&Cx::new(&rt, 1, &rec), body.len(), true, Vec::new);
    assert_overloaded(step);

    // Room again: fingerprinted and acquired.
    let mut flow = buffering(&rt, &rec);
    let out = dispatched(
        flow.on_request_body(&Cx::new(&rt, 1, &rec), body.len(), true, || body.to_vec()),
    );
    assert_eq!(out.len(), 1);
}

/// A keyed request acquired and forwarded, its response headers in (not declaring a length).
fn responding(rt: &Runtime, rec: &Recorder) -> Flow {
    pretend_held(0);
    let mut flow = buffering(rt, rec);
    dispatched(flow.on_request_body(&Cx::new(rt, 1, rec), 2, true, || b"{}".to_vec()));
    let reply = acquire().limit_ok(4, 60_000).record_new().reply();
    assert_eq!(
        flow.on_reply(&Cx::new(rt, 2, rec), 0, Ok(reply)).next,
        Move::Continue
    );
    let headers = vec![(":status".to_string(), "201".to_string())];
    let step = flow.on_response_headers(
        &Cx::new(rt, 3, rec),
        201,
        true,
        "via_upstream",
        &headers,
        false,
    );
    assert_eq!(step.next, Move::Continue);
    flow
}

fn stored_by_reference(out: &[Outgoing]) -> bool {
    out.len() == 1 && out[0].call.args[3].contains("\"reference\":true")
}

#[test]
fn a_response_body_the_budget_cannot_hold_is_stored_by_reference() {
    // While it passes: copying stops, the rest streams, the record is a reference.
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = responding(&rt, &rec);
    let cx = Cx::new(&rt, 4, &rec);
    assert_eq!(
        flow.on_response_body(&cx, 1000, false, || vec![b'a'; 1000])
            .next,
        Move::Continue
    );
    pretend_held(BUDGET - 1500);
    assert_eq!(
        flow.on_response_body(&cx, 1000, false, || panic!("not read"))
            .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.memory.by_reference"), 1);
    pretend_held(0);
    let out = dispatched(flow.on_response_body(&cx, 10, true, || panic!("not read either")));
    assert!(stored_by_reference(&out));
    assert_eq!(rec.count("cg.memory.by_reference"), 1, "counted once");

    // Copied whole, but writing the record would pass the budget.
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = responding(&rt, &rec);
    let cx = Cx::new(&rt, 4, &rec);
    assert_eq!(
        flow.on_response_body(&cx, 20_000, false, || vec![b'"'; 20_000])
            .next,
        Move::Continue
    );
    pretend_held(BUDGET - 100_000);
    let out = dispatched(flow.on_response_body(&cx, 0, true, Vec::new));
    assert!(
        stored_by_reference(&out),
        "20000 quotes take 6 bytes each in the call"
    );
    assert_eq!(rec.count("cg.memory.by_reference"), 1);

    // Within the budget: stored whole.
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = responding(&rt, &rec);
    let cx = Cx::new(&rt, 4, &rec);
    let out = dispatched(flow.on_response_body(&cx, 3, true, || b"abc".to_vec()));
    assert!(!stored_by_reference(&out));
    assert!(out[0].call.args[3].contains("\"body\":\"abc\""));
    assert_eq!(rec.count("cg.memory.by_reference"), 0);
}

#[test]
fn an_answer_the_budget_cannot_hold_is_refused_whatever_the_failure_mode() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    pretend_held(0);
    let mut flow = buffering(&rt, &rec);
    dispatched(flow.on_request_body(&Cx::new(&rt, 1, &rec), 2, true, || b"{}".to_vec()));
    // A replay it may have been must not run again: no fail_open here.
    let step = flow.on_reply(&Cx::new(&rt, 2, &rec), 0, Err(CallError::OverBudget));
    assert_overloaded(step.clone());
    assert_eq!(rec.count("cg.memory.refused"), 1);
    assert_eq!(rec.count("cg.policy.orders.failed_open"), 0);
    assert_eq!(rec.count("cg.redis.errors"), 0, "Redis answered");
    // The record it may have taken is given back.
    let bg = step.out.background;
    assert_eq!(bg.len(), 1);
    assert!(bg[0].compensation);
}

#[test]
fn a_charge_piece_the_budget_cannot_hold_is_charged_the_fallback() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    pretend_held(0);
    let mut flow = Flow::default();
    let cx = Cx::new(&rt, 0, &rec);
    let out = dispatched(flow.on_request(
        &cx,
        json_post("/llm").header("x-cost", "7").build(),
        "n",
        "o",
        true,
    ));
    let admitted = acquire().limit_ok(99_993, 60_000).reply();
    assert_eq!(
        flow.on_reply(&cx, out[0].slot, Ok(admitted)).next,
        Move::Continue
    );
    let json = vec![
        (":status".to_string(), "200".to_string()),
        ("content-type".to_string(), "application/json".to_string()),
    ];
    flow.on_response_headers(&cx, 200, true, "via_upstream", &json, false);
    assert!(flow.wants_response_body());
    assert_eq!(
        flow.on_response_body(&cx, 10, false, || br#"{"usage":{"#.to_vec())
            .next,
        Move::Continue
    );
    pretend_held(BUDGET);
    assert_eq!(
        flow.on_response_body(&cx, 100_000, false, || panic!("not read"))
            .next,
        Move::Continue
    );
    assert!(!flow.wants_response_body(), "the scan gave up");
    pretend_held(0);
    let bg = flow.on_done(&cx);
    assert_eq!(bg.len(), 1);
    assert_eq!(&bg[0].call.args[4], "9993", "10000 (max) instead of 7");
    assert_eq!(rec.count("cg.policy.llm.limit.tokens.charge_unreadable"), 1);
}

#[test]
fn a_settlement_whose_answer_was_not_read_ran_and_is_neither_retried_nor_failed() {
    // A release the root sends, whose batch came back too large to read: it ran in Redis.
    let rec = Recorder::default();
    let rt = runtime(&rec);
    pretend_held(0);
    let mut flow = buffering(&rt, &rec);
    dispatched(flow.on_request_body(&Cx::new(&rt, 1, &rec), 2, true, || b"{}".to_vec()));
    let release = flow
        .on_reply(&Cx::new(&rt, 2, &rec), 0, Err(CallError::Timeout))
        .out
        .background
        .into_iter()
        .next()
        .expect("a compensation");
    let mut outbox = Outbox::default();
    outbox.add(release);
    let sent = outbox.take_due(10);
    assert_eq!(sent.len(), 1);
    let cx = Cx::new(&rt, 10, &rec);
    outbox.on_answer(&cx, sent[0].slot, Err(CallError::OverBudget));
    assert!(outbox.is_empty(), "not sent again");
    assert_eq!(rec.count("cg.policy.orders.idem.complete_failed"), 0);
    assert_eq!(rec.count("cg.redis.retries"), 0);
    assert_eq!(rec.count("cg.redis.errors"), 0);
}
