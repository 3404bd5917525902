//! Leases through the flow: acquired and forwarded with the fencing token, extended, given
//! back after the response (or at the end of a stream that holds it), busy leases rejected or
//! waited for, and the compensations of leases a request may have taken without knowing.

use crate::engine::flow::response_tests::upgrade_req;
use crate::engine::flow::test_support::*;
use crate::engine::flow::tests::req;
use crate::engine::flow::*;
use crate::guards::lease::{LEASE_POLL_FIRST_MS, LEASE_POLL_MAX_MS};
use crate::http::local_reply;
use crate::redis::scripts::ScriptId;
use crate::redis::CallError;
use crate::support::metrics::testing::Recorder;
use crate::support::metrics::NoMetrics;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

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

/// The runtime of [`LEASE_CONFIG`].
pub(super) fn lease_runtime(rec: &Recorder) -> Runtime {
    runtime_of(rec, LEASE_CONFIG)
}

/// Sends a lease request of [`LEASE_CONFIG`] (`POST /orders/123/activate`) at 0: its acquire.
fn activate(flow: &mut Flow, rt: &Runtime, rec: &Recorder) -> Vec<Outgoing> {
    dispatched(flow.on_request(
        &Cx::new(rt, 0, rec),
        req("POST", "/orders/123/activate").tenant("acme").build(),
        "n",
        "own",
        true,
    ))
}

#[test]
fn lease_acquired_forwards_the_token_and_releases_after_the_response() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    let out = activate(&mut flow, &rt, &rec);
    assert_eq!(out.len(), 1);
    let body = String::from_utf8_lossy(&out[0].encode(&rt.scripts, &rt.tags.next())).into_owned();
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
        Ok(acquire().lease_granted(1_795_988_269_215_845).reply()),
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
        flow.on_reply(&Cx::new(&rt, 6_001, &rec), out[0].slot, Ok(settled()))
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
        .on_reply(
            &Cx::new(&rt, 1, &rec),
            0,
            Ok(acquire().lease_busy(4200).reply()),
        )
        .next
    else {
        panic!("expected 409");
    };
    assert_eq!(r.status, 409);
    assert_eq!(r.header("retry-after"), Some("5"));
    assert!(String::from_utf8_lossy(&r.body).contains("resource_locked"));
    // Not to be retried by the caller's Envoy, even one that retries 409s.
    assert!(local_reply::wire_headers(&r).contains(&local_reply::NO_RETRY));
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
        req("POST", "/wait/9/x").tenant("acme").build(),
        "n",
        "own",
        true,
    ));
    assert_eq!(
        flow.on_reply(
            &Cx::new(&rt, 1, &rec),
            0,
            Ok(acquire().lease_busy(900).reply())
        )
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
    let body = String::from_utf8_lossy(&out[0].encode(&rt.scripts, &rt.tags.next())).into_owned();
    assert!(
        body.starts_with("EVALSHA/") && body.contains("/3/") && body.contains("%3Acancel%3A"),
        "a lease-only acquire, with the owner's cancellation marker: {body}"
    );
    let step = flow.on_reply(
        &Cx::new(&rt, 30, &rec),
        0,
        Ok(acquire().lease_granted(77).reply()),
    );
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
        req("POST", "/wait/9/x").tenant("acme").build(),
        "n",
        "own",
        true,
    ));
    let mut now = 1;
    let mut step = flow.on_reply(
        &Cx::new(&rt, now, &rec),
        0,
        Ok(acquire().lease_busy(1500).reply()),
    );
    let mut polls = 0;
    while step.next == Move::Wait {
        now = flow.deadline_ms().expect("a poll is scheduled");
        dispatched(flow.on_tick(&Cx::new(&rt, now, &rec)));
        polls += 1;
        step = flow.on_reply(
            &Cx::new(&rt, now + 1, &rec),
            0,
            Ok(acquire().lease_busy(1500).reply()),
        );
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
    let rt = runtime_of(&rec, &json);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/wait/9/x").tenant("acme").build(),
        "n",
        "own",
        true,
    ));
    let step = flow.on_reply(
        &Cx::new(&rt, 1, &rec),
        0,
        Ok(acquire().lease_busy(2500).reply()),
    );
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

/// A waiter whose poll fails answers with what was left of the lease when it last saw it,
/// less the time since: the holder's remaining time, not the PTTL of an older answer.
#[test]
fn a_lease_waiter_whose_poll_fails_late_says_what_is_left_of_the_lease() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/wait/9/x").tenant("acme").build(),
        "n",
        "own",
        true,
    ));
    let step = flow.on_reply(
        &Cx::new(&rt, 1, &rec),
        0,
        Ok(acquire().lease_busy(2500).reply()),
    );
    assert_eq!(step.next, Move::Wait, "busy: it waits");
    let now = flow.deadline_ms().expect("a poll is scheduled");
    dispatched(flow.on_tick(&Cx::new(&rt, now, &rec)));
    // The poll's answer fails 1.6 s after the lease was seen with 2.5 s left.
    let step = flow.on_reply(
        &Cx::new(&rt, 1_601, &rec),
        0,
        Err(crate::redis::CallError::Gateway(503)),
    );
    let Move::Respond(r) = step.next else {
        panic!("expected 409, got {step:?}");
    };
    assert_eq!(r.status, 409);
    assert_eq!(
        r.header("retry-after"),
        Some("1"),
        "900 ms left, rounded up"
    );
}

#[test]
fn missing_resource_is_400() {
    let rec = Recorder::default();
    let rt = lease_runtime(&rec);
    let mut flow = Flow::default();
    let Move::Respond(r) = flow
        .on_request(
            &Cx::new(&rt, 0, &rec),
            req("POST", "/orders").tenant("acme").build(),
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
        req("POST", "/orders/1/a").tenant("acme").build(),
        "n",
        "own",
        true,
    ));
    assert_eq!(
        flow.on_reply(
            &Cx::new(&rt, 1, &rec),
            0,
            Ok(acquire().lease_granted(5).reply())
        )
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
        req("POST", "/orders/1/a").tenant("acme").build(),
        "n",
        "own",
        true,
    ));
    assert_eq!(
        flow.on_reply(
            &Cx::new(&rt, 1, &rec),
            0,
            Ok(acquire().lease_granted(5).reply())
        )
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
        req("POST", "/orders/1/a").tenant("acme").build(),
        "n",
        "own",
        true,
    ));
    assert_eq!(flow.on_done(&Cx::new(&rt, 0, &rec)).len(), 1);
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
        answer_once(&rt, bg[0].clone(), Ok(settled()), deadline + 10, &rec),
        Next::Done
    );
    assert_eq!(rec.count("cg.policy.activate.lease.released"), 0);
    assert_eq!(rec.count("cg.policy.activate.lease.acquired"), 0);
    assert_eq!(rec.count("cg.policy.activate.lease.lost"), 0);
}

#[test]
fn a_release_sent_again_that_finds_its_lease_gone_counts_as_released() {
    // The first send's answer is lost (a timeout) after Redis deleted the lease: the second
    // finds nothing (`0`) or another owner's lease (`-1`). That is the first send's release.
    for gone in [missing(), another_owner()] {
        let rec = Recorder::default();
        let rt = lease_runtime(&rec);
        let mut flow = Flow::default();
        activate(&mut flow, &rt, &rec);
        flow.on_reply(
            &Cx::new(&rt, 1, &rec),
            0,
            Ok(acquire().lease_granted(9).reply()),
        );
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
        let settled =
            outbox.on_answer(&Cx::new(&rt, due + 1, &rec), sent[0].slot, Ok(gone.clone()));
        assert!(settled.freed.is_some(), "waiters may poll");
        assert!(outbox.is_empty());
        assert_eq!(
            rec.count("cg.policy.activate.lease.released"),
            1,
            "{gone:?}"
        );
        assert_eq!(rec.count("cg.policy.activate.lease.lost"), 0, "{gone:?}");

        // Sent once, the same answer is a lost lease.
        let rec = Recorder::default();
        let rt = lease_runtime(&rec);
        assert_eq!(
            answer_once(&rt, bg[0].clone(), Ok(gone), 5, &rec),
            Next::Done
        );
        assert_eq!(rec.count("cg.policy.activate.lease.released"), 0);
        assert_eq!(rec.count("cg.policy.activate.lease.lost"), 1);
    }
}

#[test]
fn fence_ttl_setting_reaches_the_acquire_and_the_polls() {
    let rec = Recorder::default();
    let rt = runtime_of(
        &rec,
        r#"{"redis": {"cluster": "gw"}, "policies": [
          {"name": "wait", "lease": {"resource": ["path_segment:2"], "ttl": "2s", "on_busy": "wait",
                                     "fence_ttl": "1h"}}]}"#,
    );
    let mut flow = Flow::default();
    let out = dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        req("POST", "/wait/9/x").tenant("acme").build(),
        "n",
        "own",
        true,
    ));
    fn tail(args: &crate::redis::Words) -> Vec<&str> {
        args.words_from(args.len() - 3)
    }
    assert_eq!(
        tail(&out[0].call.args),
        vec!["own".to_string(), "2000".to_string(), "3600000".to_string()]
    );
    assert_eq!(
        flow.on_reply(
            &Cx::new(&rt, 1, &rec),
            0,
            Ok(acquire().lease_busy(1500).reply())
        )
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
    let rt = runtime_of(
        &rec,
        r#"{"redis": {"cluster": "gw"}, "policies": [{"name": "wait", "lease":
            {"resource": ["path_segment:2"], "ttl": "10s", "on_busy": "wait", "max_wait": "5s"}}]}"#,
    );
    let waiter = |owner: &str| {
        let mut flow = Flow::default();
        dispatched(flow.on_request(
            &Cx::new(&rt, 0, &rec),
            req("POST", "/wait/9/x").tenant("acme").build(),
            "n",
            owner,
            true,
        ));
        assert_eq!(
            flow.on_reply(
                &Cx::new(&rt, 0, &rec),
                0,
                Ok(acquire().lease_busy(5000).reply())
            )
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
            flow.on_reply(
                &Cx::new(&rt, now, &rec),
                0,
                Ok(acquire().lease_busy(5000).reply())
            )
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
        req("POST", "/orders/5/act").tenant("acme").build(),
        "n",
        "own",
        true,
    ));
    assert_eq!(
        flow.on_reply(
            &Cx::new(&rt, 1, &rec),
            0,
            Ok(acquire().lease_granted(9).reply())
        )
        .next,
        Move::Continue
    );
    let step =
        flow.on_response_headers(&Cx::new(&rt, 2, &rec), 200, true, "via_upstream", &[], true);
    assert_eq!(step.out.freed, None, "not before Redis said so");
    let out = dispatched(step);
    let step = flow.on_reply(&Cx::new(&rt, 3, &rec), out[0].slot, Ok(settled()));
    let freed = step.out.freed.expect("freed");
    assert!(freed.contains(":lease:"), "{freed}");
    assert_eq!(flow.on_tick(&Cx::new(&rt, 4, &rec)).out.freed, None, "once");
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
        flow.on_reply(
            &Cx::new(&rt, 1, &rec),
            0,
            Ok(acquire().lease_granted(42).reply())
        )
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
    declined.on_reply(
        &Cx::new(&rt, 1, &rec),
        0,
        Ok(acquire().lease_granted(43).reply()),
    );
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
        req("POST", "/orders/9/feed").tenant("acme").build(),
        "n",
        "own",
        true,
    ));
    flow.on_reply(
        &Cx::new(&rt, 1, &rec),
        0,
        Ok(acquire().lease_granted(9).reply()),
    );
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
fn a_lease_is_released_with_the_record_when_the_body_passes() {
    let rec = Recorder::default();
    let rt = runtime_of(
        &rec,
        r#"{"redis": {"cluster": "gw"}, "policies": [{"name": "both",
            "idempotency": {"fingerprint": ["method", "path"]},
            "lease": {"resource": ["tenant"], "ttl": "10s", "extend": false}}]}"#,
    );
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        json_post("/x").idempotency_key("\"k\"").build(),
        "n",
        "own",
        true,
    ));
    let acquired = acquire().record_new().lease_granted(77).reply();
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
        flow.on_reply(&Cx::new(&rt, 5, &rec), out[0].slot, Ok(settled()))
            .next,
        Move::Wait
    );
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 6, &rec), out[1].slot, Ok(settled()))
            .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.policy.both.lease.released"), 1);
    assert_eq!(rec.count("cg.policy.both.idem.completed"), 1);
}
