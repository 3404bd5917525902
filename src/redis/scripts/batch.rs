//! Callout coalescing: the acquire calls of several paused requests of one worker, and the
//! settlements its root sends in one turn, sent to Redis as one `batch.lua` call, each answer
//! routed to where it goes. The script runs the sub-calls one after the other exactly as
//! separate calls would, so every decision is the same as without batching.
//!
//! Whether one batch may carry calls of different hash slots depends on what is behind the
//! gateway: a single Redis runs it, a Redis Cluster refuses it (`CROSSSLOT`), and Envoy's
//! `redis_proxy` sends it whole to the node of its first key, so while a node is down such a
//! batch would fail the calls of every other node with it. A worker therefore batches per hash
//! slot until a probe (an empty batch whose two keys are in different slots) has shown that
//! Redis runs a batch across slots.

use crate::config::Batch;
use crate::redis::keys::hash_tag;
use crate::redis::scripts::{Batched, ScriptId, Scripts};
use crate::redis::{resend_by_eval, resp::Reply, CallError, ScriptCall, Words};
use crate::support::ids::ByToken;
use crate::support::metrics::{MetricSink, RedisMetrics};
use std::rc::Rc;

/// The calls waiting for the next batch, and the batches in flight with whose answers they
/// carry. `S` names where a call's answer goes (a paused request's call slot, or the root's
/// outbox; anything in tests).
pub struct Batcher<S> {
    cfg: Option<Batch>,
    /// Whether a batch may mix hash slots.
    mixing: Mixing,
    queue: Vec<Queued<S>>,
    in_flight: ByToken<InFlight<S>>,
}

/// What a worker knows of whether Redis runs a batch across hash slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mixing {
    /// Not known yet (batches go per hash slot): the next probe goes with the first flush at
    /// or after `probe_at` (ms).
    Unknown { probe_at: u64 },
    /// A probe is in flight (batches go per hash slot).
    Probing,
    /// Redis ran the probe: batches may mix hash slots.
    Yes,
    /// Per hash slot for good: `cross_slot: false`, or Redis refused a batch across slots.
    No,
}

/// A batch's keys and arguments stay under this unless one call alone is larger (a completion
/// carries its response): a call of many large completions would hold the others' answers
/// back while webdis and Redis take it in.
const MAX_BATCH_BYTES: usize = 256 * 1024;

/// How long a worker waits before probing again after a probe failed (Redis unreachable).
const PROBE_RETRY_MS: u64 = 1_000;

/// A call waiting for the next batch, or carried by one.
#[derive(Debug)]
struct Queued<S> {
    to: S,
    script: Batched,
    call: Rc<ScriptCall>,
}

/// One batch call: whose answers it carries, and how it is sent.
#[derive(Debug)]
pub struct InFlight<S> {
    members: Vec<Queued<S>>,
    call: ScriptCall,
    by_sha: bool,
}

impl<S> InFlight<S> {
    /// The gateway request body.
    pub fn encode(&self, scripts: &Scripts) -> Vec<u8> {
        self.call.encode(&scripts.batch, self.by_sha)
    }
}

/// What a batch's answer means.
pub enum BatchAnswer<S> {
    /// Send these instead: the batch again (by `EVAL`, after `NOSCRIPT`), or its calls per
    /// hash slot (after `CROSSSLOT`).
    Resend(Vec<InFlight<S>>),
    /// Each member's own answer, for where it goes.
    Members(Vec<(S, Result<Reply, CallError>)>),
}

impl<S> Batcher<S> {
    /// Batching per `cfg` (`redis.batch`); `None` never batches.
    pub fn new(cfg: Option<Batch>) -> Batcher<S> {
        Batcher {
            cfg,
            mixing: if cfg.is_some_and(|c| c.cross_slot) {
                Mixing::Unknown { probe_at: 0 }
            } else {
                Mixing::No
            },
            queue: Vec::new(),
            in_flight: ByToken::default(),
        }
    }

    /// Whether a call of `script` sent `by_sha` waits for the next batch (then `script` as the
    /// batch's sub-call, for [`Batcher::queue`]): only the scripts `batch.lua` runs, and never a
    /// resend by `EVAL`.
    pub fn takes(&self, script: ScriptId, by_sha: bool) -> Option<Batched> {
        script.batched().filter(|_| self.cfg.is_some() && by_sha)
    }

    /// Queues a call; true when it is the first since the last flush (the adapter then wakes
    /// the root on the event loop's next turn).
    pub fn queue(&mut self, to: S, script: Batched, call: impl Into<Rc<ScriptCall>>) -> bool {
        self.queue.push(Queued {
            to,
            script,
            call: call.into(),
        });
        self.queue.len() == 1
    }

    /// The queued calls as batches to send: per hash tag unless batches may mix slots, at
    /// most `max_requests` each, in queue order; first the probe, when one is due and the
    /// calls span several hash tags (its keys under `prefix`, which an ACL on the filter's keys
    /// allows).
    pub fn flush(&mut self, now_ms: u64, prefix: &str) -> Vec<InFlight<S>> {
        let Some(cfg) = self.cfg else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if matches!(self.mixing, Mixing::Unknown { probe_at } if now_ms >= probe_at)
            && slots(&self.queue) > 1
        {
            self.mixing = Mixing::Probing;
            out.push(probe(prefix));
        }
        out.extend(group(
            std::mem::take(&mut self.queue),
            self.mixing == Mixing::Yes,
            cfg.max_requests,
        ));
        out
    }

    /// A batch was sent: its answer comes back with `token`.
    pub fn sent(&mut self, token: u32, batch: InFlight<S>) {
        self.in_flight.insert(token, batch);
    }

    /// The batch sent with `token`, if it is one of ours.
    pub fn take(&mut self, token: u32) -> Option<InFlight<S>> {
        self.in_flight.remove(&token)
    }

    /// Routes a batch's answer (or a failure to send it) to its members. A batch of several
    /// hash slots that Redis refuses with `CROSSSLOT` (a Redis Cluster refuses it before the
    /// script runs, so nothing of it ran) is sent again per hash slot, and from then on this
    /// worker batches per hash slot; so does a probe refused so. A probe that Redis ran lets
    /// batches mix slots; one that failed otherwise is sent again after `PROBE_RETRY_MS`.
    pub fn answer(
        &mut self,
        mut batch: InFlight<S>,
        answer: Result<Reply, CallError>,
        now_ms: u64,
        metrics: &RedisMetrics,
        m: &dyn MetricSink,
    ) -> BatchAnswer<S> {
        if resend_by_eval(&mut batch.by_sha, &answer, metrics, m) {
            return BatchAnswer::Resend(vec![batch]);
        }
        let crossslot = matches!(&answer, Ok(Reply::Error(e)) if e.starts_with("CROSSSLOT"));
        if crossslot && (batch.members.is_empty() || slots(&batch.members) > 1) {
            if self.mixing != Mixing::No {
                log::info!(
                    "redis.batch: Redis refused a batch across hash slots (CROSSSLOT: a Redis \
                     Cluster); this worker batches per hash slot"
                );
            }
            self.mixing = Mixing::No;
            let max = self.cfg.map_or(1, |c| c.max_requests);
            return BatchAnswer::Resend(group(batch.members, false, max));
        }
        if batch.members.is_empty() {
            if self.mixing == Mixing::Probing {
                self.mixing = match answer {
                    Ok(Reply::Array(_)) => Mixing::Yes,
                    _ => Mixing::Unknown {
                        probe_at: now_ms.saturating_add(PROBE_RETRY_MS),
                    },
                };
            }
            return BatchAnswer::Members(Vec::new());
        }
        let n = batch.members.len();
        let parts = match answer.and_then(|r| split(&r, n)) {
            Ok(parts) => parts,
            Err(e) => vec![Err(e); n],
        };
        BatchAnswer::Members(
            batch
                .members
                .into_iter()
                .zip(parts)
                .map(|(q, part)| (q.to, part))
                .collect(),
        )
    }
}

/// The probe: a batch of no calls whose two keys are in different hash slots (`a` and `b`).
/// A single Redis answers an empty array; a Redis Cluster refuses it with `CROSSSLOT`.
fn probe<S>(prefix: &str) -> InFlight<S> {
    let keys = [
        format!("{prefix}:probe:{{a}}"),
        format!("{prefix}:probe:{{b}}"),
    ];
    InFlight {
        members: Vec::new(),
        call: ScriptCall::new(
            keys.iter().collect::<Words>(),
            ["0"].iter().collect::<Words>(),
        ),
        by_sha: true,
    }
}

/// The hash tag a call's keys share ("" for a call without keys).
fn tag_of(call: &ScriptCall) -> &str {
    call.keys.first().map_or("", hash_tag)
}

/// How many hash tags the calls of a batch span.
fn slots<S>(members: &[Queued<S>]) -> usize {
    let mut tags: Vec<&str> = members.iter().map(|q| tag_of(&q.call)).collect();
    tags.sort_unstable();
    tags.dedup();
    tags.len()
}

/// `calls` as batches: per hash tag unless `cross_slot`, at most `max` each, in order.
fn group<S>(calls: Vec<Queued<S>>, cross_slot: bool, max: usize) -> Vec<InFlight<S>> {
    let mut groups: Vec<(String, Vec<Queued<S>>)> = Vec::new();
    for q in calls {
        let tag = if cross_slot { "" } else { tag_of(&q.call) };
        match groups.iter_mut().find(|g| g.0 == tag) {
            Some(g) => g.1.push(q),
            None => groups.push((tag.to_string(), vec![q])),
        }
    }
    let mut out = Vec::new();
    for (_, members) in groups {
        let mut chunk: Vec<Queued<S>> = Vec::new();
        let mut bytes = 0;
        for q in members {
            let size = q.call.keys.bytes() + q.call.args.bytes();
            if !chunk.is_empty() && (chunk.len() >= max.max(1) || bytes + size > MAX_BATCH_BYTES) {
                out.push(in_flight(std::mem::take(&mut chunk)));
                bytes = 0;
            }
            bytes += size;
            chunk.push(q);
        }
        if !chunk.is_empty() {
            out.push(in_flight(chunk));
        }
    }
    out
}

/// A batch of `members`, sent by `EVALSHA`.
fn in_flight<S>(members: Vec<Queued<S>>) -> InFlight<S> {
    InFlight {
        call: build(members.iter().map(|q| (q.script, &*q.call))),
        members,
        by_sha: true,
    }
}

/// The batch call for `calls`, in order.
pub fn build<'a, I>(calls: I) -> ScriptCall
where
    I: IntoIterator<Item = (Batched, &'a ScriptCall)>,
    I::IntoIter: Clone,
{
    let calls = calls.into_iter();
    let (mut count, mut words, mut key_bytes, mut arg_bytes) = (0usize, 0, 0, 0);
    for (_, call) in calls.clone() {
        count += 1;
        words += call.keys.len();
        key_bytes += call.keys.bytes();
        arg_bytes += call.args.bytes();
    }
    let mut keys = Words::with_capacity(words, key_bytes);
    let mut args = Words::with_capacity(1 + 3 * count + words, arg_bytes + 9 * count + 4);
    args.push_u64(count as u64);
    for (script, call) in calls {
        keys.extend_from(&call.keys);
        args.push_u64(script.index());
        args.push_u64(call.keys.len() as u64);
        args.push_u64(call.args.len() as u64);
        args.extend_from(&call.args);
    }
    ScriptCall { keys, args }
}

/// Splits a batch reply into the `n` sub-replies: an array, an integer (as webdis gives it: a
/// bulk string from webdis 0.1.9), or an error for a sub-call that failed.
pub fn split(reply: &Reply, n: usize) -> Result<Vec<Result<Reply, CallError>>, CallError> {
    let bad = |why: &str| CallError::UnexpectedReply(format!("batch reply: {why}"));
    if let Reply::Error(e) = reply {
        return Err(CallError::Redis(e.clone()));
    }
    let items = reply.as_array().ok_or_else(|| bad("not an array"))?;
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    while out.len() < n {
        let len = items
            .get(at)
            .and_then(Reply::as_int)
            .ok_or_else(|| bad("missing length"))?;
        at += 1;
        if len == -2 {
            let value = items.get(at).ok_or_else(|| bad("missing value"))?;
            at += 1;
            out.push(Ok(value.clone()));
            continue;
        }
        if len < 0 {
            let text = items
                .get(at)
                .and_then(Reply::as_bytes)
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default();
            at += 1;
            out.push(Err(CallError::Redis(text)));
            continue;
        }
        let len = usize::try_from(len).map_err(|_| bad("bad length"))?;
        let part = items
            .get(at..at + len)
            .ok_or_else(|| bad("shorter than its lengths"))?;
        at += len;
        out.push(Ok(Reply::Array(Some(part.to_vec()))));
    }
    if at != items.len() {
        return Err(bad("longer than its lengths"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert!(String::from_utf8_lossy(&sent[0].encode(&Scripts::load())).starts_with("EVALSHA/"));
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
        b.sent(7, batch);
        assert!(b.take(8).is_none(), "not a batch of ours");
        let batch = b.take(7).expect("in flight");
        // NOSCRIPT: once by EVAL, then the answer is the answer.
        let noscript = || Ok(Reply::Error("NOSCRIPT x".into()));
        let BatchAnswer::Resend(mut again) = b.answer(batch, noscript(), 0, &metrics, &rec) else {
            panic!("expected a resend");
        };
        assert_eq!(again.len(), 1);
        let batch = again.remove(0);
        assert!(String::from_utf8_lossy(&batch.encode(&Scripts::load())).starts_with("EVAL/"));
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
        let BatchAnswer::Members(parts) =
            b.answer(batch, Err(CallError::Timeout), 0, &metrics, &rec)
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
}
