//! The batch contract's tests.

use super::*;
use crate::redis::tag::CallTags;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// A member: a request and its call's slot.
type M = (&'static str, usize);

/// `script` as a batch's sub-call.
fn sub(script: ScriptId) -> Batched {
    script.batched().expect("a script batch.lua runs")
}

/// Queues an acquire of `key` (no arguments) for `to`; as [`Batcher::queue`].
fn queue_acquire(b: &mut Batcher<M>, to: M, key: &str) -> bool {
    b.queue(to, sub(ScriptId::Acquire), call(&[key], &[]))
}

fn call(keys: &[&str], args: &[&str]) -> ScriptCall {
    ScriptCall::new(
        keys.iter().collect::<Words>(),
        args.iter().collect::<Words>(),
    )
}

fn batcher(max_requests: usize, cross_slot: bool) -> Batcher<M> {
    Batcher::new(Some(Batch {
        max_delay_ms: 5,
        max_requests,
        cross_slot,
    }))
}

fn redis_metrics() -> RedisMetrics {
    RedisMetrics {
        calls: 1,
        errors: 2,
        timeouts: 3,
        noscript: 4,
        retries: 5,
        retries_dropped: 7,
        foreign: 8,
        latency_ms: 6,
    }
}

/// A `cross_slot` batcher whose probe Redis ran (a single Redis): batches mix slots.
fn mixing(max_requests: usize) -> Batcher<M> {
    let rec = crate::support::metrics::testing::Recorder::default();
    let mut b = batcher(max_requests, true);
    queue_acquire(&mut b, ("r0", 0), "cg:{t.a}:x");
    queue_acquire(&mut b, ("r1", 0), "cg:{t.b}:x");
    let probe = b.flush(0, "cg").remove(0);
    assert!(probe.members.is_empty());
    let ran = Ok(Reply::Array(Some(Vec::new())));
    let BatchAnswer::Members(none) = b.answer(probe, ran, 0, &redis_metrics(), &rec) else {
        panic!("a probe is not sent again");
    };
    assert!(none.is_empty());
    assert_eq!(b.mixing, Mixing::Yes);
    b
}

fn members(b: &InFlight<M>) -> Vec<M> {
    b.members.iter().map(|q| q.to).collect()
}

#[test]
fn batches_per_hash_tag_in_order_and_bounded() {
    let mut b = batcher(2, false);
    assert_eq!(
        b.takes(ScriptId::Acquire, true),
        Some(sub(ScriptId::Acquire))
    );
    assert!(
        b.takes(ScriptId::Acquire, false).is_none(),
        "an EVAL resend goes alone"
    );
    assert!(
        b.takes(ScriptId::Complete, true).is_some(),
        "a settlement too"
    );
    assert!(
        b.takes(ScriptId::LeaseExtend, true).is_none(),
        "not a script batch.lua runs"
    );
    assert!(b.queue(
        ("r1", 0),
        sub(ScriptId::Acquire),
        call(&["cg:rl:{t.a}:x"], &["1"])
    ));
    assert!(!b.queue(
        ("r2", 1),
        sub(ScriptId::Acquire),
        call(&["cg:rl:{p.o}:y"], &["2"])
    ));
    assert!(!b.queue(
        ("r3", 0),
        sub(ScriptId::Acquire),
        call(&["cg:rl:{t.a}:z"], &["3"])
    ));
    assert!(!b.queue(
        ("r4", 0),
        sub(ScriptId::Acquire),
        call(&["cg:rl:{t.a}:w"], &["4"])
    ));
    let sent = b.flush(0, "cg");
    assert_eq!(sent.len(), 3);
    assert_eq!(members(&sent[0]), vec![("r1", 0), ("r3", 0)]);
    assert_eq!(members(&sent[1]), vec![("r4", 0)], "at most max_requests");
    assert_eq!(members(&sent[2]), vec![("r2", 1)]);
    assert_eq!(sent[0].call.keys, vec!["cg:rl:{t.a}:x", "cg:rl:{t.a}:z"]);
    assert!(String::from_utf8_lossy(
        &sent[0].encode(&Scripts::load(), &CallTags::with_prefix(1).next())
    )
    .starts_with("EVALSHA/"));
    assert!(b.flush(0, "cg").is_empty(), "flushed once");
    assert!(
        queue_acquire(&mut b, ("r5", 0), "k"),
        "first again after a flush"
    );
    let mut off: Batcher<M> = Batcher::new(None);
    assert!(off.takes(ScriptId::Acquire, true).is_none());
    queue_acquire(&mut off, ("r", 0), "k");
    assert!(off.flush(0, "cg").is_empty());
}

#[test]
fn routes_each_member_its_answer() {
    use crate::support::metrics::testing::Recorder;
    let rec = Recorder::default();
    let metrics = redis_metrics();
    let mut b = batcher(10, false);
    queue_acquire(&mut b, ("r1", 0), "cg:{t}:a");
    queue_acquire(&mut b, ("r2", 3), "cg:{t}:b");
    let batch = b.flush(0, "cg").pop().expect("one batch");
    let tag = CallTags::with_prefix(1).next();
    b.sent(7, batch, tag);
    assert!(b.take(8).is_none(), "not a batch of ours");
    let (batch, sent_with) = b.take(7).expect("in flight");
    assert_eq!(sent_with, tag);
    // NOSCRIPT: once by EVAL, then the answer is the answer.
    let noscript = || Ok(Reply::Error("NOSCRIPT x".into()));
    let BatchAnswer::Resend(mut again) = b.answer(batch, noscript(), 0, &metrics, &rec) else {
        panic!("expected a resend");
    };
    assert_eq!(again.len(), 1);
    let batch = again.remove(0);
    assert!(String::from_utf8_lossy(
        &batch.encode(&Scripts::load(), &CallTags::with_prefix(1).next())
    )
    .starts_with("EVAL/"));
    let BatchAnswer::Members(parts) = b.answer(batch, noscript(), 0, &metrics, &rec) else {
        panic!("NOSCRIPT is retried once");
    };
    assert_eq!(parts.len(), 2);
    assert!(parts
        .iter()
        .all(|p| p.1 == Err(CallError::Redis("NOSCRIPT x".into()))));
    queue_acquire(&mut b, ("r1", 0), "cg:{t}:a");
    queue_acquire(&mut b, ("r2", 3), "cg:{t}:b");
    let batch = b.flush(0, "cg").pop().expect("one batch");
    let reply = Reply::Array(Some(vec![
        Reply::Int(1),
        Reply::Int(9),
        Reply::Int(-1),
        Reply::Bulk(Some(b"ERR boom".to_vec())),
    ]));
    let BatchAnswer::Members(parts) = b.answer(batch, Ok(reply), 0, &metrics, &rec) else {
        panic!("expected answers");
    };
    assert_eq!(
        parts,
        vec![
            (("r1", 0), Ok(Reply::Array(Some(vec![Reply::Int(9)])))),
            (("r2", 3), Err(CallError::Redis("ERR boom".into()))),
        ]
    );
    // A batch that failed as a whole fails every member.
    queue_acquire(&mut b, ("r1", 0), "cg:{t}:a");
    let batch = b.flush(0, "cg").pop().expect("one batch");
    let BatchAnswer::Members(parts) = b.answer(batch, Err(CallError::Timeout), 0, &metrics, &rec)
    else {
        panic!("expected answers");
    };
    assert_eq!(parts, vec![(("r1", 0), Err(CallError::Timeout))]);
}

#[test]
fn a_batch_across_slots_that_redis_refuses_is_sent_again_per_slot() {
    use crate::support::metrics::testing::Recorder;
    let rec = Recorder::default();
    let metrics = redis_metrics();
    let crossslot = || {
        Ok(Reply::Error(
            "CROSSSLOT Keys in request don't hash to the same slot".into(),
        ))
    };
    let mut b = mixing(2);
    for (r, key) in [
        ("r1", "cg:{t.a}:x"),
        ("r2", "cg:{t.b}:y"),
        ("r3", "cg:{t.a}:z"),
        ("r4", "cg:{t.a}:w"),
    ] {
        queue_acquire(&mut b, (r, 0), key);
    }
    let sent = b.flush(0, "cg");
    assert_eq!(sent.len(), 2, "across slots, at most max_requests each");
    let mut batches = sent.into_iter();
    let first = batches.next().expect("a batch");
    assert_eq!(members(&first), vec![("r1", 0), ("r2", 0)]);
    // Nothing of it ran: its calls go again, per hash tag.
    let BatchAnswer::Resend(again) = b.answer(first, crossslot(), 0, &metrics, &rec) else {
        panic!("expected the calls again");
    };
    assert_eq!(
        again.iter().map(members).collect::<Vec<_>>(),
        vec![vec![("r1", 0)], vec![("r2", 0)]]
    );
    assert_eq!(again[0].call.keys, vec!["cg:{t.a}:x"]);
    // The worker batches per hash tag from now on.
    queue_acquire(&mut b, ("r5", 1), "cg:{t.a}:v");
    queue_acquire(&mut b, ("r6", 1), "cg:{t.b}:u");
    assert_eq!(b.flush(0, "cg").len(), 2);
    // A batch of one hash tag refused so is not split again: its members get the error.
    let second = batches.next().expect("a batch");
    assert_eq!(members(&second), vec![("r3", 0), ("r4", 0)]);
    let BatchAnswer::Members(parts) = b.answer(second, crossslot(), 0, &metrics, &rec) else {
        panic!("expected answers");
    };
    assert!(parts
        .iter()
        .all(|p| matches!(&p.1, Err(CallError::Redis(e)) if e.starts_with("CROSSSLOT"))));
}

#[test]
fn batches_mix_slots_only_once_a_probe_shows_redis_runs_them() {
    use crate::support::metrics::testing::Recorder;
    let rec = Recorder::default();
    let metrics = redis_metrics();
    let two_tags = |b: &mut Batcher<M>| {
        queue_acquire(b, ("r1", 0), "cg:rl:{t.a}:x");
        queue_acquire(b, ("r2", 0), "cg:rl:{p.o}:y");
    };
    let mut b = batcher(10, true);
    assert!(b.flush(0, "cg").is_empty(), "no traffic, no probe");
    queue_acquire(&mut b, ("r1", 0), "cg:rl:{t.a}:x");
    queue_acquire(&mut b, ("r2", 0), "cg:rl:{t.a}:y");
    assert_eq!(b.flush(0, "cg").len(), 1, "one hash tag: no probe needed");
    // Until the probe answers, per hash tag: the probe goes first.
    two_tags(&mut b);
    let mut sent = b.flush(5, "cg:x").into_iter();
    let probe = sent.next().expect("the probe");
    assert!(probe.members.is_empty());
    assert_eq!(probe.call.keys, vec!["cg:x:probe:{a}", "cg:x:probe:{b}"]);
    // Hash slots 15495 and 3300 (CRC16 of "a" and "b"); tests/test_scripts_batch.py
    // sends this probe to a real Redis Cluster.
    assert_eq!(
        (hash_tag(&probe.call.keys[0]), hash_tag(&probe.call.keys[1])),
        ("a", "b")
    );
    assert_eq!(probe.call.args, vec!["0"], "no sub-calls");
    assert_eq!(sent.len(), 2, "per hash tag while probing");
    two_tags(&mut b);
    assert_eq!(b.flush(6, "cg").len(), 2, "one probe at a time");
    // A probe that failed (Redis unreachable) goes again a while later.
    let answer = b.answer(probe, Err(CallError::Timeout), 10, &metrics, &rec);
    assert!(matches!(answer, BatchAnswer::Members(m) if m.is_empty()));
    two_tags(&mut b);
    assert_eq!(b.flush(10 + PROBE_RETRY_MS - 1, "cg").len(), 2, "not yet");
    two_tags(&mut b);
    let sent = b.flush(10 + PROBE_RETRY_MS, "cg");
    assert_eq!(sent.len(), 3, "the probe again, then per hash tag");
    // A NOSCRIPT probe goes again by EVAL; one that ran lets batches mix slots.
    let probe = sent.into_iter().next().expect("the probe");
    let noscript = Ok(Reply::Error("NOSCRIPT x".into()));
    let BatchAnswer::Resend(mut again) = b.answer(probe, noscript, 11, &metrics, &rec) else {
        panic!("expected the probe again");
    };
    let ran = Ok(Reply::Array(Some(Vec::new())));
    b.answer(again.remove(0), ran, 12, &metrics, &rec);
    two_tags(&mut b);
    assert_eq!(b.flush(13, "cg").len(), 1, "one batch across slots");
    // A Redis Cluster refuses the probe: per hash tag for good, no probe again.
    let mut b = batcher(10, true);
    two_tags(&mut b);
    let probe = b.flush(0, "cg").remove(0);
    let crossslot = Ok(Reply::Error("CROSSSLOT Keys in request don't hash".into()));
    let answer = b.answer(probe, crossslot, 1, &metrics, &rec);
    assert!(matches!(answer, BatchAnswer::Resend(r) if r.is_empty()));
    two_tags(&mut b);
    assert_eq!(b.flush(u64::MAX, "cg").len(), 2, "per hash tag, no probe");
    // cross_slot: false never probes.
    let mut b = batcher(10, false);
    two_tags(&mut b);
    assert_eq!(b.flush(0, "cg").len(), 2);
}

#[test]
fn large_calls_split_batches_by_size() {
    let mut b = batcher(10, false);
    let big = "x".repeat(MAX_BATCH_BYTES / 2);
    for r in ["r1", "r2", "r3"] {
        b.queue(
            (r, 0),
            sub(ScriptId::Complete),
            call(&["cg:{t.a}:k"], &[&big]),
        );
    }
    b.queue(
        ("r4", 0),
        sub(ScriptId::Complete),
        call(&["cg:{t.a}:k"], &["small"]),
    );
    let huge = "x".repeat(MAX_BATCH_BYTES + 1);
    b.queue(
        ("r5", 0),
        sub(ScriptId::Complete),
        call(&["cg:{t.a}:k"], &[&huge]),
    );
    let sent = b.flush(0, "cg");
    assert_eq!(
        sent.iter().map(members).collect::<Vec<_>>(),
        vec![
            vec![("r1", 0)],
            vec![("r2", 0)],
            vec![("r3", 0), ("r4", 0)],
            vec![("r5", 0)]
        ],
        "two halves and their keys exceed the bound; a call larger than it goes alone"
    );
}

#[test]
fn builds_the_batch() {
    let a = call(&["k1", "k2"], &["x"]);
    let b = call(&["k3"], &["y", "z"]);
    let batch = build([(sub(ScriptId::Acquire), &a), (sub(ScriptId::Complete), &b)]);
    assert_eq!(batch.keys, vec!["k1", "k2", "k3"]);
    assert_eq!(
        batch.args,
        vec!["2", "1", "2", "1", "x", "2", "1", "2", "y", "z"],
        "count, then per sub-call: script, nkeys, nargs, its arguments"
    );
}

#[test]
fn splits_replies() {
    let r = |v: i64| Reply::Int(v);
    let reply = Reply::Array(Some(vec![
        r(2),
        r(1),
        r(0),
        r(-1),
        Reply::Bulk(Some(b"ERR boom".to_vec())),
        r(1),
        Reply::Bulk(Some(b"77".to_vec())),
        r(-2),
        Reply::Bulk(Some(b"1".to_vec())),
    ]));
    let parts = split(&reply, 4).expect("valid");
    assert_eq!(parts[0], Ok(Reply::Array(Some(vec![r(1), r(0)]))));
    assert_eq!(parts[1], Err(CallError::Redis("ERR boom".into())));
    assert_eq!(
        parts[2],
        Ok(Reply::Array(Some(vec![Reply::Bulk(Some(b"77".to_vec()))])))
    );
    // An integer reply (a settlement's), as webdis 0.1.9 gives it: a bulk string.
    assert_eq!(parts[3], Ok(Reply::Bulk(Some(b"1".to_vec()))));
    assert_eq!(parts[3].as_ref().ok().and_then(Reply::as_int), Some(1));
    assert!(split(&reply, 5).is_err(), "too short");
    assert!(split(&reply, 3).is_err(), "too long");
    let cut = Reply::Array(Some(vec![r(-2)]));
    assert!(
        split(&cut, 1).is_err(),
        "an integer reply without its value"
    );
    assert_eq!(
        split(&Reply::Error("NOSCRIPT x".into()), 1),
        Err(CallError::Redis("NOSCRIPT x".into()))
    );
}
