//! One table of script calls, for a stream's calls (the acquire, a sync completion, a lease
//! release the response waits for) and for the root's background calls alike. It owns what
//! every call has: its slot (which comes back with the answer), when it was sent (latency),
//! how often, and whether it goes by `EVALSHA` or, after one `NOSCRIPT`, by `EVAL`.

use crate::guards::context::{Cx, Outgoing, Runtime};
use crate::redis::scripts::ScriptId;
use crate::redis::{resend_by_eval, resp::Reply, CallError, ScriptCall};
use crate::support::metrics::MetricSink;
use std::rc::Rc;

/// A call and what its owner keeps with it (`tag`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Call<T> {
    pub(crate) tag: T,
    pub(crate) script: ScriptId,
    /// Shared with every [`Outgoing`] that sends it: a send copies no keys or arguments.
    pub(crate) call: Rc<ScriptCall>,
    by_sha: bool,
    sent_ms: u64,
    /// Sends so far.
    pub(crate) attempts: u32,
    /// When it was first sent.
    pub(crate) first_ms: Option<u64>,
    /// Not to be sent before this time (a retry's backoff); 0 for at once.
    pub(crate) due_ms: u64,
    /// Waiting for its answer (or to be sent).
    pub(crate) open: bool,
}

/// What an answer means once the table has taken its share (latency, `NOSCRIPT`).
#[derive(Debug)]
pub(crate) enum Answer<'a, T> {
    /// No open call has this slot (a late or duplicate answer): ignored.
    Unknown,
    /// `NOSCRIPT`: the same call again, by `EVAL`.
    Resend(Outgoing),
    /// The answer for the call (still open: its owner closes it).
    Reply(&'a mut Call<T>, Result<Reply, CallError>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Calls<T> {
    slots: Vec<Option<Call<T>>>,
}

impl<T> Default for Calls<T> {
    fn default() -> Self {
        Calls { slots: Vec::new() }
    }
}

impl<T> Calls<T> {
    /// No calls, in `self`'s room: what a reused stream box starts from.
    pub(crate) fn emptied(self) -> Calls<T> {
        let mut slots = self.slots;
        slots.clear();
        Calls { slots }
    }

    /// Adds a call (in a free slot) and returns its slot.
    pub(crate) fn push(
        &mut self,
        tag: T,
        script: ScriptId,
        call: impl Into<Rc<ScriptCall>>,
    ) -> usize {
        let entry = Call {
            tag,
            script,
            call: call.into(),
            by_sha: true,
            sent_ms: 0,
            attempts: 0,
            first_ms: None,
            due_ms: 0,
            open: true,
        };
        match self.slots.iter().position(Option::is_none) {
            Some(slot) => {
                self.slots[slot] = Some(entry);
                slot
            }
            None => {
                self.slots.push(Some(entry));
                self.slots.len() - 1
            }
        }
    }

    /// The call of `slot`, to send now (counted as a send).
    pub(crate) fn send(&mut self, slot: usize, now_ms: u64) -> Option<Outgoing> {
        let c = self.slots.get_mut(slot)?.as_mut()?;
        c.sent_ms = now_ms;
        c.attempts = c.attempts.saturating_add(1);
        c.first_ms.get_or_insert(now_ms);
        Some(Outgoing {
            slot,
            script: c.script,
            call: Rc::clone(&c.call),
            by_sha: c.by_sha,
        })
    }

    /// Adds a call and returns it to send now.
    pub(crate) fn push_and_send(
        &mut self,
        tag: T,
        script: ScriptId,
        call: ScriptCall,
        now_ms: u64,
    ) -> Option<Outgoing> {
        let slot = self.push(tag, script, call);
        self.send(slot, now_ms)
    }

    pub(crate) fn get(&self, slot: usize) -> Option<&Call<T>> {
        self.slots.get(slot)?.as_ref()
    }

    pub(crate) fn get_mut(&mut self, slot: usize) -> Option<&mut Call<T>> {
        self.slots.get_mut(slot)?.as_mut()
    }

    /// Frees `slot` for a later call and returns what it held.
    pub(crate) fn remove(&mut self, slot: usize) -> Option<Call<T>> {
        self.slots.get_mut(slot)?.take()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Call<T>> {
        self.slots.iter().flatten()
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Call<T>> {
        self.slots.iter_mut().flatten()
    }

    /// The calls still waiting for their answers.
    pub(crate) fn open(&self) -> impl Iterator<Item = &Call<T>> {
        self.iter().filter(|c| c.open)
    }

    /// The calls still waiting for their answers, with their slots.
    pub(crate) fn open_slots(&self) -> impl Iterator<Item = (usize, &Call<T>)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, c)| Some((i, c.as_ref()?)))
            .filter(|(_, c)| c.open)
    }

    pub(crate) fn any_open(&self) -> bool {
        self.open().next().is_some()
    }

    /// Closes `slot`: a later answer for it is ignored.
    pub(crate) fn close(&mut self, slot: usize) {
        if let Some(c) = self.get_mut(slot) {
            c.open = false;
        }
    }

    /// Whether no call was ever made (every round that clears the table sends one at once).
    pub(crate) fn none_made(&self) -> bool {
        self.slots.is_empty()
    }

    /// Drops every call (a new round starts).
    pub(crate) fn clear(&mut self) {
        self.slots.clear();
    }

    /// Slots of the open calls due at `now_ms`.
    pub(crate) fn due(&self, now_ms: u64) -> Vec<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, c)| c.as_ref().is_some_and(|c| c.open && c.due_ms <= now_ms))
            .map(|(slot, _)| slot)
            .collect()
    }

    /// Takes the answer for `slot`: records the round trip's latency, and after `NOSCRIPT`
    /// sends the call again by `EVAL` (once: a call already by `EVAL` is answered as it is).
    pub(crate) fn answer(
        &mut self,
        cx: &Cx<'_>,
        slot: usize,
        answer: Result<Reply, CallError>,
    ) -> Answer<'_, T> {
        let Some(c) = self.get_mut(slot).filter(|c| c.open) else {
            return Answer::Unknown;
        };
        let redis = &cx.rt.metrics.redis;
        cx.m.record(redis.latency_ms, cx.now_ms.saturating_sub(c.sent_ms));
        if resend_by_eval(&mut c.by_sha, &answer, redis, cx.m) {
            return match self.send(slot, cx.now_ms) {
                Some(out) => Answer::Resend(out),
                None => Answer::Unknown,
            };
        }
        match self.get_mut(slot) {
            Some(c) => Answer::Reply(c, answer),
            None => Answer::Unknown,
        }
    }
}

/// Counts a failed call as a timeout or an error (an answer the memory budget could not hold
/// is neither: Redis answered; it is counted where the request is refused).
pub(crate) fn count_failure(rt: &Runtime, err: &CallError, m: &dyn MetricSink) {
    match err {
        CallError::OverBudget => {}
        CallError::Timeout => m.increment(rt.metrics.redis.timeouts),
        _ => m.increment(rt.metrics.redis.errors),
    }
}
