//! Carrying out a stream's [`Step`]: what the stream does next becomes its effects for the
//! adapter (headers to set, calls to send or to queue for a batch, a local reply, a resumed
//! direction), and what the step handed out beside it goes where it belongs (the response's
//! headers kept for the response, the calls for the root to the outbox, a freed lease or
//! record to its waiters), with the tick registry following the stream's deadline.

use super::effects::{Action, Dest, Dir, Effects, StreamEffects};
use super::routes::callout;
use super::Worker;
use crate::engine::flow::{Background, Cx, Move, Step};

impl<S: Copy + Ord> Worker<S> {
    /// Carries out a stream's step: `dir` is the direction of the host callback that raised
    /// it, or `None` for an answer or a tick, where a paused direction is resumed instead.
    pub(super) fn carry(
        &mut self,
        cx: &Cx<'_>,
        s: S,
        dir: Option<Dir>,
        step: Step,
        fx: &mut Effects<S>,
    ) {
        let Some(entry) = self.streams.get_mut(&s) else {
            return;
        };
        let Step { next, out } = step;
        let mut ops = StreamEffects::new(s);
        ops.decision = out.decision;
        fx.action = Action::Pause;
        let responded = matches!(next, Move::Respond(_));
        match next {
            Move::Continue => {
                let paused = entry.paused.take();
                // The flow hands the request's headers out with the step that forwards it,
                // which comes while the host holds the request.
                if dir == Some(Dir::Request) || paused == Some(Dir::Request) {
                    ops.set_request_headers = out.upstream_headers;
                }
                if dir.is_none() {
                    ops.resume = paused;
                }
                fx.action = Action::Continue;
            }
            Move::Wait => entry.paused = dir.or(entry.paused),
            Move::Respond(r) => {
                entry.paused = None;
                ops.reply = Some(r);
            }
            Move::Dispatch(calls) => {
                entry.paused = dir.or(entry.paused);
                for call in calls {
                    if let Some(sub) = self.batcher.takes(call.script, call.by_sha) {
                        fx.wake |= self
                            .batcher
                            .queue(Dest::Stream(s, call.slot), sub, call.call);
                    } else {
                        ops.calls
                            .push(callout(cx, &call, Dest::Stream(s, call.slot)));
                    }
                }
            }
        }
        // Handed out once, when the request is forwarded: kept for its response's headers.
        if !out.response_headers.is_empty() {
            entry.response_headers = out.response_headers;
        }
        // A detached stream's host context is gone: nothing of it reaches the host (its flow
        // neither answers nor resumes nor sends; this is the belt to those braces).
        let detached = entry.detached;
        if !ops.is_empty() && !detached {
            fx.streams.push(ops);
        }
        self.settle(cx, s, out.background, out.freed, fx);
        if detached {
            self.forget_if_settled(s);
            return;
        }
        // A local answer that took nothing: the stream's later events (the answer's own
        // response headers, its end) have nothing to do, so the worker forgets it now.
        if responded
            && self
                .streams
                .get(&s)
                .is_some_and(|e| e.flow.answered_without_calls())
        {
            self.close(s);
        }
    }

    /// After a stream's step: the `background` calls it handed out go to the outbox, the tick
    /// registry and period follow its deadline and lease wait, and a lease or record it
    /// `freed` wakes its waiters.
    pub(super) fn settle(
        &mut self,
        cx: &Cx<'_>,
        s: S,
        background: Vec<Background>,
        freed: Option<String>,
        fx: &mut Effects<S>,
    ) {
        let Some(entry) = self.streams.get_mut(&s) else {
            return;
        };
        let flow = &mut entry.flow;
        let deadline = flow.deadline_ms();
        let was_waiting = std::mem::replace(&mut entry.waits, deadline.is_some());
        let waits = flow.waiting_for().is_some();
        if waits {
            self.set_fine_tick(true, fx);
        }
        if !background.is_empty() && !self.woken {
            // A release must not wait for the tick: the stream's next request (or another
            // sidecar's) would find the slot, lease or record still held.
            fx.wake = true;
            self.woken = true;
        }
        background.into_iter().for_each(|bg| self.outbox.add(bg));
        match (deadline.is_some(), was_waiting) {
            (true, false) => {
                self.waiting.insert(s);
            }
            (false, true) => {
                self.waiting.remove(&s);
            }
            _ => {}
        }
        if let Some(key) = freed {
            self.wake_waiters(&key, cx.now_ms);
        }
    }
}
