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
use crate::redis::tag::CallTag;
use crate::redis::{resend_by_eval, resp::Reply, CallError, ScriptCall, Words};
use crate::support::ids::ByToken;
use crate::support::metrics::{MetricSink, RedisMetrics};
use std::rc::Rc;

/// The calls waiting for the next batch, and the batches in flight with whose answers they
/// carry. `S` names where a call's answer goes (a paused request's call slot, or the root's
/// outbox; anything in tests).
pub(crate) struct Batcher<S> {
    cfg: Option<Batch>,
    /// Whether a batch may mix hash slots.
    mixing: Mixing,
    queue: Vec<Queued<S>>,
    /// The batches sent, with the tag each was sent with.
    in_flight: ByToken<(InFlight<S>, CallTag)>,
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
pub(crate) struct InFlight<S> {
    members: Vec<Queued<S>>,
    call: ScriptCall,
    by_sha: bool,
}

impl<S> InFlight<S> {
    /// The gateway request body, sent with `tag` (one for the whole batch).
    pub(crate) fn encode(&self, scripts: &Scripts, tag: &CallTag) -> Vec<u8> {
        self.call
            .encode(scripts.get(ScriptId::Batch), self.by_sha, tag)
    }
}

/// What a batch's answer means.
pub(crate) enum BatchAnswer<S> {
    /// Send these instead: the batch again (by `EVAL`, after `NOSCRIPT`), or its calls per
    /// hash slot (after `CROSSSLOT`).
    Resend(Vec<InFlight<S>>),
    /// Each member's own answer, for where it goes.
    Members(Vec<(S, Result<Reply, CallError>)>),
}

impl<S> Batcher<S> {
    /// Batching per `cfg` (`redis.batch`); `None` never batches.
    pub(crate) fn new(cfg: Option<Batch>) -> Batcher<S> {
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
    pub(crate) fn takes(&self, script: ScriptId, by_sha: bool) -> Option<Batched> {
        script.batched().filter(|_| self.cfg.is_some() && by_sha)
    }

    /// Queues a call; true when it is the first since the last flush (the adapter then wakes
    /// the root on the event loop's next turn).
    pub(crate) fn queue(
        &mut self,
        to: S,
        script: Batched,
        call: impl Into<Rc<ScriptCall>>,
    ) -> bool {
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
    pub(crate) fn flush(&mut self, now_ms: u64, prefix: &str) -> Vec<InFlight<S>> {
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

    /// A batch was sent with `tag`: its answer comes back with `token`.
    pub(crate) fn sent(&mut self, token: u32, batch: InFlight<S>, tag: CallTag) {
        self.in_flight.insert(token, (batch, tag));
    }

    /// The batch sent with `token`, if it is one of ours, and the tag it was sent with.
    pub(crate) fn take(&mut self, token: u32) -> Option<(InFlight<S>, CallTag)> {
        self.in_flight.remove(&token)
    }

    /// The tag the batch sent with `token` was sent with.
    #[cfg(test)]
    pub(crate) fn tag_of(&self, token: u32) -> Option<CallTag> {
        self.in_flight.get(&token).map(|(_, tag)| *tag)
    }

    /// Routes a batch's answer (or a failure to send it) to its members. A batch of several
    /// hash slots that Redis refuses with `CROSSSLOT` (a Redis Cluster refuses it before the
    /// script runs, so nothing of it ran) is sent again per hash slot, and from then on this
    /// worker batches per hash slot; so does a probe refused so. A probe that Redis ran lets
    /// batches mix slots; one that failed otherwise is sent again after `PROBE_RETRY_MS`.
    pub(crate) fn answer(
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
pub(crate) fn build<'a, I>(calls: I) -> ScriptCall
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
pub(crate) fn split(reply: &Reply, n: usize) -> Result<Vec<Result<Reply, CallError>>, CallError> {
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
#[path = "batch_tests.rs"]
mod tests;
