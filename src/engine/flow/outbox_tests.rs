//! The root's outbox: the calls a request hands over (compensations, releases, completions)
//! sent again with backoff, bounded in count, time and the worker's budget of re-sends.

use crate::engine::flow::idempotency_tests::{acquire_fails, idem_runtime};
use crate::engine::flow::test_support::*;
use crate::engine::flow::*;
use crate::engine::outbox::{MAX_SENDS, RETRY_BUDGET, RETRY_BUDGET_PER_S, RETRY_WINDOW_MS};
use crate::redis::CallError;
use crate::support::metrics::testing::Recorder;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

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
