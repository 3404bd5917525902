//! Routing answers: a call handed to the host is remembered by its token with the tag it was
//! sent with, and its answer (or the host's refusal to send it) goes where the call came from:
//! a stream's flow, the root's outbox, or a batch whose members' answers go on to theirs. An
//! answer that does not carry the call's tag is another call's reply: it goes there as the
//! failure [`CallError::Foreign`], never as the call's answer ([`crate::redis::tag`]).

use super::effects::{Action, Callout, Dest, Effects, Route};
use super::Worker;
use crate::engine::flow::{Cx, Outgoing};
use crate::redis::scripts::batch::{BatchAnswer, InFlight};
use crate::redis::tag::untag;
use crate::redis::{resp::Reply, CallError};

impl<S: Copy + Ord> Worker<S> {
    /// A call was handed to the host: its answer comes back with `token`, or it was refused
    /// (then that is its answer, at once).
    pub fn sent(
        &mut self,
        cx: &Cx<'_>,
        route: Route<S>,
        token: Result<u32, CallError>,
    ) -> Effects<S> {
        let mut fx = Effects::new(Action::Pause);
        let tag = route.tag;
        match (route.dest, token) {
            (Dest::Batch(batch), Ok(token)) => self.batcher.sent(token, batch, tag),
            (dest, Ok(token)) => {
                if let Dest::Stream(s, _) = dest {
                    if let Some(entry) = self.streams.get_mut(&s) {
                        entry.calls.push(token);
                    }
                }
                self.routes.insert(token, (dest, tag));
            }
            (dest, Err(e)) => self.answer(cx, dest, Err(e), &mut fx),
        }
        fx
    }

    /// The answer of the call sent with `token`; `read` decodes it, asked only for a call
    /// the worker knows of. The reply the script's body gave goes on when the answer carries
    /// the call's tag; another call's reply goes on as [`CallError::Foreign`] (counted
    /// `redis.foreign_replies`).
    pub fn on_answer(
        &mut self,
        cx: &Cx<'_>,
        token: u32,
        read: impl FnOnce() -> Result<Reply, CallError>,
    ) -> Effects<S> {
        let mut fx = Effects::new(Action::Pause);
        let taken = match self.batcher.take(token) {
            Some((batch, tag)) => Some((Dest::Batch(batch), tag)),
            None => self.routes.remove(&token),
        };
        if let Some((Dest::Stream(s, _), _)) = &taken {
            if let Some(entry) = self.streams.get_mut(s) {
                if let Some(i) = entry.calls.iter().position(|&t| t == token) {
                    entry.calls.swap_remove(i);
                }
            }
        }
        match taken {
            Some((Dest::Stream(s, _), _)) if !self.streams.contains(&s) => {}
            Some((dest, tag)) => {
                let answer = untag(read(), &tag);
                if answer == Err(CallError::Foreign) {
                    cx.m.increment(cx.rt.metrics.redis.foreign);
                }
                self.answer(cx, dest, answer, &mut fx)
            }
            None => {}
        }
        fx
    }

    /// The tag the call sent with `token` was sent with (tests answer with it).
    #[cfg(test)]
    pub(crate) fn tag_of(&self, token: u32) -> Option<crate::redis::tag::CallTag> {
        match self.routes.get(&token) {
            Some((_, tag)) => Some(*tag),
            None => self.batcher.tag_of(token),
        }
    }

    /// Routes an answer (or a refusal to send) to where its call came from.
    fn answer(
        &mut self,
        cx: &Cx<'_>,
        dest: Dest<S>,
        answer: Result<Reply, CallError>,
        fx: &mut Effects<S>,
    ) {
        match dest {
            Dest::Stream(s, slot) => {
                if let Some(entry) = self.streams.get_mut(&s) {
                    let step = entry.flow.on_reply(cx, slot, answer);
                    self.carry(cx, s, None, step, fx);
                }
            }
            Dest::Outbox(slot) => {
                let settled = self.outbox.on_answer(cx, slot, answer);
                if let Some(out) = settled.resend {
                    fx.calls.push(callout(cx, &out, Dest::Outbox(out.slot)));
                }
                if let Some(key) = settled.freed {
                    self.wake_waiters(&key, cx.now_ms);
                }
            }
            Dest::Batch(batch) => {
                match self
                    .batcher
                    .answer(batch, answer, cx.now_ms, &cx.rt.metrics.redis, cx.m)
                {
                    BatchAnswer::Resend(batches) => {
                        for batch in batches {
                            fx.calls.push(batch_callout(cx, batch));
                        }
                    }
                    BatchAnswer::Members(members) => {
                        for (to, part) in members {
                            self.answer(cx, to, part, fx);
                        }
                    }
                }
            }
        }
    }
}

/// A call to send with the worker's next tag, counted as a Redis call.
pub(super) fn callout<S>(cx: &Cx<'_>, out: &Outgoing, dest: Dest<S>) -> Callout<S> {
    cx.m.increment(cx.rt.metrics.redis.calls);
    let tag = cx.rt.tags.next();
    Callout {
        body: out.encode(&cx.rt.scripts, &tag),
        route: Route { dest, tag },
    }
}

/// A batch to send with the worker's next tag (one for the batch), counted as a Redis call.
pub(super) fn batch_callout<S>(cx: &Cx<'_>, batch: InFlight<Dest<S>>) -> Callout<S> {
    cx.m.increment(cx.rt.metrics.redis.calls);
    let tag = cx.rt.tags.next();
    Callout {
        body: batch.encode(&cx.rt.scripts, &tag),
        route: Route {
            dest: Dest::Batch(batch),
            tag,
        },
    }
}
