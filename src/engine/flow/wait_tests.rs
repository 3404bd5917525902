//! Duplicates that wait for the first request's answer (`in_progress: wait`).

use crate::engine::flow::test_support::*;
use crate::engine::flow::*;
use crate::guards::idempotency::guard::REPLAYED_HEADER;
use crate::http::request::Request;
use crate::support::metrics::testing::Recorder;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const CONFIG: &str = r#"{
  "redis": {"cluster": "gw", "timeout": "50ms", "key_prefix": "cg"},
  "policies": [
    {"name": "pay", "match": {"path_prefix": "/pay"},
     "idempotency": {"fingerprint": ["method", "path"], "in_progress": "wait", "max_wait": "1s",
                     "in_progress_status": 425}}
  ]
}"#;

const COMPLETED: &str = r#"{"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:ab","created_ms":1,"updated_ms":2,
    "response":{"status":201,"headers":[["location","/pay/7"]],"body":"{\"id\":7}"}}"#;

fn runtime(rec: &Recorder) -> Runtime {
    runtime_of(rec, CONFIG)
}

/// The keyed `POST /pay` every test here sends.
fn req() -> Request {
    request("POST", "/pay")
        .authority("api")
        .tenant("acme")
        .idempotency_key("\"k-1\"")
        .build()
}

/// A duplicate that met the record in progress: it waits, returning when it polls first.
fn waiting(flow: &mut Flow, rt: &Runtime, rec: &Recorder) -> u64 {
    let out = dispatched(flow.on_request(&Cx::new(rt, 0, rec), req(), "n1", "o1", true));
    let step = flow.on_reply(
        &Cx::new(rt, 5, rec),
        out[0].slot,
        Ok(acquire().record_in_progress().reply()),
    );
    assert_eq!(step.next, Move::Wait);
    assert_eq!(
        rec.count("cg.policy.pay.idem.in_progress"),
        0,
        "not answered yet"
    );
    let poll_at = flow.deadline_ms().expect("a poll is due");
    assert!(
        (30..=55).contains(&poll_at),
        "{poll_at}: within the first backoff"
    );
    assert!(flow.waiting_for().is_some_and(|k| k.contains(":idem:")));
    poll_at
}

#[test]
fn a_waiting_duplicate_gets_the_stored_response() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let poll_at = waiting(&mut flow, &rt, &rec);
    assert_eq!(
        flow.on_tick(&Cx::new(&rt, poll_at - 1, &rec)).next,
        Move::Wait
    );
    let out = dispatched(flow.on_tick(&Cx::new(&rt, poll_at, &rec)));
    assert_eq!(out.len(), 1);
    let call = &out[0].call;
    assert_eq!(
        &call.args.words_from(0)[..3],
        &["0", "n1", "1"],
        "no limits again, the record"
    );
    assert_eq!(call.args.last(), Some("0"), "no lease");
    assert!(call.keys[1].contains(":cancel:"), "with the owner's marker");
    let step = flow.on_reply(
        &Cx::new(&rt, poll_at + 3, &rec),
        out[0].slot,
        Ok(acquire().record_completed(COMPLETED).reply()),
    );
    let Move::Respond(r) = step.next else {
        panic!("expected the replay, got {step:?}");
    };
    assert_eq!(r.status, 201);
    assert!(r
        .headers
        .iter()
        .any(|(n, v)| n == REPLAYED_HEADER && v == "true"));
    assert_eq!(rec.count("cg.policy.pay.idem.replayed"), 1);
    assert_eq!(rec.count("cg.policy.pay.idem.waited"), 1);
}

#[test]
fn a_waiting_duplicate_runs_when_the_record_is_released() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let poll_at = waiting(&mut flow, &rt, &rec);
    let out = dispatched(flow.on_tick(&Cx::new(&rt, poll_at, &rec)));
    let step = flow.on_reply(
        &Cx::new(&rt, poll_at + 3, &rec),
        out[0].slot,
        Ok(acquire().record_new().reply()),
    );
    assert_eq!(step.next, Move::Continue);
    assert!(
        flow.wants_response(&Cx::new(&rt, poll_at + 4, &rec)),
        "it owns the record now"
    );
    assert!(step
        .out
        .upstream_headers
        .iter()
        .any(|(n, _)| n == FINGERPRINT_HEADER));
    assert_eq!(rec.count("cg.policy.pay.idem.acquired"), 1);
    assert_eq!(rec.count("cg.policy.pay.idem.waited"), 1);
}

#[test]
fn a_duplicate_waits_at_most_max_wait_then_gets_the_reject_answer() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let mut now = waiting(&mut flow, &rt, &rec);
    let mut polls = 0;
    let answer = loop {
        let out = dispatched(flow.on_tick(&Cx::new(&rt, now, &rec)));
        polls += 1;
        match flow
            .on_reply(
                &Cx::new(&rt, now + 2, &rec),
                out[0].slot,
                Ok(acquire().record_in_progress().reply()),
            )
            .next
        {
            Move::Wait => now = flow.deadline_ms().expect("next poll"),
            Move::Respond(r) => break r,
            other => panic!("{other:?}"),
        }
        assert!(
            now <= 1_005,
            "never past max_wait after the first answer: {now}"
        );
    };
    assert_eq!(answer.status, 425, "in_progress_status");
    assert!(answer
        .headers
        .iter()
        .any(|(n, v)| n == "retry-after" && v == "1"));
    assert!(String::from_utf8_lossy(&answer.body).contains("idempotency_key_in_use"));
    assert!(
        polls <= 12,
        "{polls} polls in 1 s: backoff up to 200 ms, not a poll per tick"
    );
    assert_eq!(rec.count("cg.policy.pay.idem.in_progress"), 1);
    assert_eq!(rec.count("cg.policy.pay.idem.waited"), 0);
}

#[test]
fn a_settlement_on_this_worker_wakes_its_waiters() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let poll_at = waiting(&mut flow, &rt, &rec);
    flow.wake(10);
    assert_eq!(flow.deadline_ms(), Some(10.min(poll_at)));
    let out = dispatched(flow.on_tick(&Cx::new(&rt, 10, &rec)));
    assert_eq!(out.len(), 1);
}

fn fail_open_runtime(rec: &Recorder) -> Runtime {
    let json = CONFIG.replace(
        r#""match": {"path_prefix": "/pay"},"#,
        r#""match": {"path_prefix": "/pay"}, "failure_mode": "fail_open","#,
    );
    runtime_of(rec, &json)
}

#[test]
fn a_waiting_duplicate_whose_poll_fails_answers_in_progress_even_failing_open() {
    let rec = Recorder::default();
    let rt = fail_open_runtime(&rec);
    let mut flow = Flow::default();
    let poll_at = waiting(&mut flow, &rt, &rec);
    dispatched(flow.on_tick(&Cx::new(&rt, poll_at, &rec)));
    // The poll is not answered within the timeout (Redis paused): the watchdog decides.
    let step = flow.on_tick(&Cx::new(&rt, poll_at + 60, &rec));
    let Move::Respond(r) = step.next else {
        panic!("expected the in-progress answer, got {step:?}");
    };
    assert_eq!(r.status, 425, "in_progress_status, never forwarded");
    assert!(String::from_utf8_lossy(&r.body).contains("idempotency_key_in_use"));
    assert_eq!(rec.count("cg.policy.pay.failed_open"), 0);
    assert_eq!(rec.count("cg.policy.pay.failed_closed"), 1);
    assert_eq!(rec.count("cg.policy.pay.idem.in_progress"), 1);
    // The poll may still run once Redis answers: what it could take is given back.
    assert_eq!(
        step.out.background.len(),
        1,
        "a release with the owner's marker"
    );

    // A request whose first acquire fails never saw the record: it fails open.
    let mut fresh = Flow::default();
    dispatched(fresh.on_request(&Cx::new(&rt, 0, &rec), req(), "n2", "o2", true));
    assert_eq!(fresh.on_tick(&Cx::new(&rt, 60, &rec)).next, Move::Continue);
    assert_eq!(rec.count("cg.policy.pay.failed_open"), 1);
}
