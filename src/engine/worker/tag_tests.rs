//! Call tags through the worker: an answer that does not carry its call's tag (another call's
//! reply, as webdis hands a newer connection the reply of a command an older, closed one sent)
//! is never read as the call's answer. Its call's outcome is unknown, as after a timeout: the
//! policy's failure mode answers, what the call may have taken is given back with the owner's
//! cancellation marker, and it is counted (`redis.foreign_replies`, `redis.errors`).

use crate::engine::flow::test_support::{self, acquire, batch, noscript};
use crate::engine::flow::Runtime;
use crate::engine::worker::*;
use crate::redis::resp::Reply;
use crate::redis::tag::{wrap, CallTag, CallTags};
use crate::support::metrics::testing::Recorder;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// An idempotent operation that also takes a lease, failing closed; `BATCH` stands for the
/// `redis.batch` setting.
const CONFIG: &str = r#"{
  "redis": {"cluster": "gw", "timeout": "50ms", "key_prefix": "cg", "batch": BATCH},
  "failure_mode": "fail_closed",
  "policies": [
    {"name": "orders", "match": {"path_prefix": "/orders"},
     "idempotency": {"required": true, "fingerprint": ["method", "path"]},
     "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "10s"}}
  ]
}"#;

/// A completed record another request stored (of another tenant and key): the reply that
/// must never reach this one.
const OTHERS_RECORD: &str = r#"{"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:00","created_ms":1,"updated_ms":2,"response":{"status":201,"headers":[["content-type","application/json"]],"body":"eyJvdGhlciI6InRlbmFudCJ9"}}"#;

fn runtime(rec: &Recorder, batch: bool) -> Runtime {
    let batch = if batch {
        r#"{"max_delay": "1ms"}"#
    } else {
        "false"
    };
    test_support::runtime_of(rec, &CONFIG.replace("BATCH", batch))
}

fn worker(rt: &Runtime) -> Worker<u32> {
    Worker::new(TokenSource::with_seed(1, 2), rt.config.redis.batch, 25)
}

/// `POST /orders/<n>` of stream `s` with its own Idempotency-Key.
fn post(w: &mut Worker<u32>, cx: &Cx<'_>, s: u32) -> Effects<u32> {
    let req = test_support::request("POST", &format!("/orders/{s}"))
        .authority("api")
        .tenant("acme")
        .idempotency_key(&format!("\"key-{s}\""))
        .peer("127.0.0.1:4000")
        .build();
    w.on_request_headers(cx, s, 0, req, true)
}

/// Every call of `fx` (the streams' and the root's), handed to the host under tokens from
/// `next`: each token with the tag its call's body carries.
fn send(w: &mut Worker<u32>, cx: &Cx<'_>, fx: Effects<u32>, next: &mut u32) -> Vec<(u32, CallTag)> {
    let mut calls = fx.calls;
    for ops in fx.streams {
        calls.extend(ops.calls);
    }
    let mut sent = Vec::new();
    for call in calls {
        *next += 1;
        let tag = call.route.tag();
        let body = String::from_utf8_lossy(&call.body).into_owned();
        let at = body.find(std::str::from_utf8(tag.as_bytes()).expect("hex"));
        assert!(at.is_some(), "the body carries its tag: {body}");
        let more = w.sent(cx, call.route, Ok(*next));
        assert!(more.streams.is_empty() && more.calls.is_empty());
        sent.push((*next, tag));
    }
    sent
}

/// The statuses of the local replies in `fx`, by stream.
fn replies(fx: &Effects<u32>) -> Vec<(u32, u32)> {
    fx.streams
        .iter()
        .filter_map(|o| Some((o.stream, o.reply.as_ref()?.status)))
        .collect()
}

/// The replay another request's acquire would get: admitted, its record completed, no lease.
fn others_replay() -> Reply {
    acquire()
        .record_completed(OTHERS_RECORD)
        .lease_skipped()
        .reply()
}

/// A stream answered an unknown outcome: failed closed (`503`), nothing replayed or held, and
/// what its acquire may have taken given back from the root with the cancellation marker.
fn assert_unknown_outcome(
    w: &mut Worker<u32>,
    cx: &Cx<'_>,
    rec: &Recorder,
    fx: &Effects<u32>,
    s: u32,
) {
    assert_eq!(replies(fx), vec![(s, 503)], "{fx:?}");
    let reply = fx.streams[0].reply.as_ref().expect("a local reply");
    assert!(
        !reply
            .headers
            .iter()
            .any(|(n, _)| n == "idempotent-replayed"),
        "{reply:?}"
    );
    let body = String::from_utf8_lossy(&reply.body).into_owned();
    assert!(
        body.contains("guard-unavailable") || body.contains("guard_unavailable"),
        "{body}"
    );
    assert!(!body.contains(r#""other":"tenant""#), "{body}");
    assert_eq!(rec.count("cg.policy.orders.idem.replayed"), 0);
    assert_eq!(rec.count("cg.policy.orders.lease.acquired"), 0);
    // The record and the lease it may have taken go back, the marker first: a late run of
    // the acquire writes nothing.
    let out = w.on_queue_ready(cx);
    let bodies: Vec<String> = fx
        .calls
        .iter()
        .chain(&out.calls)
        .map(|c| String::from_utf8_lossy(&c.body).into_owned())
        .collect();
    assert!(
        bodies.iter().any(|b| b.contains("%3Acancel%3A")),
        "given back with the marker: {bodies:?}"
    );
}

#[test]
fn another_calls_reply_is_an_unknown_outcome_never_an_answer() {
    let rec = Recorder::default();
    let rt = runtime(&rec, false);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    // Two requests in flight; stream 1 gets the reply (a replay) that carries stream 2's tag.
    let fx = post(&mut w, &cx, 1);
    let one = send(&mut w, &cx, fx, &mut next);
    let fx = post(&mut w, &cx, 2);
    let two = send(&mut w, &cx, fx, &mut next);
    assert_eq!((one.len(), two.len()), (1, 1));
    assert_ne!(one[0].1, two[0].1, "each call its own tag");
    let foreign = wrap(&two[0].1, others_replay());
    let fx = w.on_answer(&cx, one[0].0, || Ok(foreign));
    assert_unknown_outcome(&mut w, &cx, &rec, &fx, 1);
    assert_eq!(rec.count("cg.redis.foreign_replies"), 1);
    assert_eq!(rec.count("cg.redis.errors"), 1);
    assert_eq!(rec.count("cg.policy.orders.failed_closed"), 1);
    // Stream 2's own answer, with its tag, is its answer.
    let granted = acquire().record_new().lease_granted(7).reply();
    let fx = w.on_answer(&cx, two[0].0, || Ok(wrap(&two[0].1, granted)));
    assert_eq!(fx.streams[0].resume, Some(Dir::Request), "{fx:?}");
    assert!(replies(&fx).is_empty());
    assert_eq!(rec.count("cg.redis.foreign_replies"), 1);
}

#[test]
fn a_reply_without_a_tag_is_an_unknown_outcome() {
    for (what, untagged) in [
        ("a reply of the script without the wrapper", others_replay()),
        ("an integer", Reply::Int(1)),
        ("a string", Reply::Bulk(Some(b"OK".to_vec()))),
        ("a nil array", Reply::Array(None)),
        (
            "the tag of another worker's call of the same count",
            wrap(&CallTags::with_prefix(0xdead).next(), others_replay()),
        ),
    ] {
        let rec = Recorder::default();
        let rt = runtime(&rec, false);
        let cx = Cx::new(&rt, 0, &rec);
        let mut w = worker(&rt);
        let fx = post(&mut w, &cx, 1);
        let sent = send(&mut w, &cx, fx, &mut 0);
        let fx = w.on_answer(&cx, sent[0].0, || Ok(untagged));
        assert_unknown_outcome(&mut w, &cx, &rec, &fx, 1);
        assert_eq!(rec.count("cg.redis.foreign_replies"), 1, "{what}");
        assert_eq!(rec.count("cg.redis.errors"), 1, "{what}");
    }
}

#[test]
fn a_batch_reply_with_another_tag_is_an_unknown_outcome_for_every_member() {
    let rec = Recorder::default();
    let rt = runtime(&rec, true);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    post(&mut w, &cx, 1);
    post(&mut w, &cx, 2);
    let fx = w.on_queue_ready(&cx);
    let sent = send(&mut w, &cx, fx, &mut next);
    assert_eq!(sent.len(), 1, "one batch for both, with one tag");
    // The batch's answer as it would come, but another call's.
    let other = CallTags::with_prefix(0xbeef).next();
    let answer = wrap(&other, batch([others_replay(), others_replay()]));
    let fx = w.on_answer(&cx, sent[0].0, || Ok(answer));
    let mut got = replies(&fx);
    got.sort_unstable();
    assert_eq!(got, vec![(1, 503), (2, 503)], "{fx:?}");
    assert_eq!(rec.count("cg.policy.orders.idem.replayed"), 0);
    assert_eq!(rec.count("cg.redis.foreign_replies"), 1, "one reply");
    assert_eq!(rec.count("cg.redis.errors"), 2, "each member's call");
    // Both streams' records and leases go back with their markers, in the next batch.
    let out = w.on_queue_ready(&cx);
    let body = out
        .calls
        .iter()
        .map(|c| String::from_utf8_lossy(&c.body).into_owned())
        .collect::<String>();
    assert!(body.matches("%3Acancel%3A").count() >= 2, "{body}");
    // The same batch answered with its own tag: each member its answer.
    post(&mut w, &cx, 3);
    let fx = w.on_queue_ready(&cx);
    let sent = send(&mut w, &cx, fx, &mut next);
    let (token, tag) = *sent.last().expect("a batch");
    let granted = batch([acquire().record_new().lease_granted(9)]);
    let fx = w.on_answer(&cx, token, || Ok(wrap(&tag, granted)));
    assert!(
        fx.streams
            .iter()
            .any(|o| o.stream == 3 && o.resume == Some(Dir::Request) && o.reply.is_none()),
        "{fx:?}"
    );
}

#[test]
fn an_untagged_noscript_still_resends_by_eval_under_a_new_tag() {
    let rec = Recorder::default();
    let rt = runtime(&rec, false);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    let fx = post(&mut w, &cx, 1);
    let first = send(&mut w, &cx, fx, &mut next);
    // Redis answers NOSCRIPT before any script runs: an error carries no tag.
    let fx = w.on_answer(&cx, first[0].0, || Ok(noscript()));
    assert!(replies(&fx).is_empty(), "{fx:?}");
    let body = String::from_utf8_lossy(&fx.streams[0].calls[0].body).into_owned();
    assert!(body.starts_with("EVAL/"), "{body}");
    let again = send(&mut w, &cx, fx, &mut next);
    assert_ne!(again[0].1, first[0].1, "each send its own tag");
    // The first send's tag does not answer the resend.
    let stale = wrap(&first[0].1, acquire().record_new().lease_granted(7).reply());
    let fx = w.on_answer(&cx, again[0].0, || Ok(stale));
    assert_eq!(replies(&fx), vec![(1, 503)]);
    assert_eq!(rec.count("cg.redis.noscript"), 1);
    assert_eq!(rec.count("cg.redis.foreign_replies"), 1);
}
