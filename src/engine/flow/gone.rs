//! The stream's end ([`Flow::on_done`]): what the request still holds is given back or left
//! to expire, and a client that hangs up, by where its request was.
//!
//! - **Still deciding** (its acquire in flight): what the acquire may take is given back, as
//!   it always was. When the acquire went out in a batch from the root, its answer still comes
//!   back, and the flow stays (detached from the stream, see [`Flow::detach`]) to read it:
//!   a rejection feeds the over-limit cache like any other (a flood of requests that hang up
//!   right after sending would otherwise never learn its 429 and cost an acquire each), and
//!   only what the answer says it took is given back, without a cancellation marker. Only an
//!   acquire that does not answer in time is compensated with the owner's marker.
//! - **Forwarded, before the response's headers**: the service may still be working (Envoy
//!   resets its request, which a service rarely notices). The lease and the concurrency
//!   slots stay held, no longer extended, and expire after the lease's `ttl` and the limit's
//!   `window` ([`Flow::orphan`], counted `lease.orphaned`, `limit.<l>.slot_orphaned`), as the
//!   idempotency record stays `PROCESSING` (`outcome_unknown`).
//! - **After the response's headers**: the service answered; whatever is still held is given
//!   back when the stream ends, as for any response.

use crate::engine::calls::{count_failure, Answer};
use crate::engine::flow::{Cx, Flow, Move, Pcx, Phase, Purpose};
use crate::guards::background::Background;
use crate::redis::scripts::acquire;
use crate::redis::{resp::Reply, CallError};

impl Flow {
    /// The stream is gone. A record we still own is released if the request never left
    /// Envoy, and kept `PROCESSING` (outcome unknown) otherwise. A request forwarded with no
    /// response yet (the client left) keeps its lease and slots until they expire (see
    /// [`Flow::orphan`]); anything else still held is given back. What it owes then goes to the root:
    /// the calls returned.
    pub fn on_done(&mut self, cx: &Cx<'_>) -> Vec<Background> {
        self.done(cx);
        std::mem::take(&mut self.out).background
    }

    fn done(&mut self, cx: &Cx<'_>) {
        let Some(at) = self.at(cx) else {
            self.phase = Phase::Done;
            return;
        };
        if matches!(self.phase, Phase::Forwarded) {
            self.orphan(&at);
        }
        self.release_lease(&at);
        self.release_slots(&at);
        if self.forwarded() {
            let corrections = self.meter.corrections(&at, &self.admission);
            self.out.background.extend(corrections);
        }
        // Response-side calls still outstanding may be cancelled with the stream: the root
        // sends them again (an answer that arrives twice is counted twice, nothing worse).
        let key_hash = self
            .record
            .as_ref()
            .map_or(String::new(), |i| i.key_hash.clone());
        let unfinished: Vec<Background> = self
            .calls
            .open()
            .filter(|c| {
                matches!(
                    c.tag.purpose,
                    Purpose::Complete
                        | Purpose::Release
                        | Purpose::LeaseRelease
                        | Purpose::SlotRelease
                )
            })
            .map(|c| {
                // The first call may have done it already: "not ours" is then expected.
                Background::new(at.index, c.tag.purpose, c.call.clone(), key_hash.clone())
                    .uncertain()
            })
            .collect();
        self.out.background.extend(unfinished);
        let owned = self.record.as_ref().is_some_and(|i| i.owned);
        match self.phase {
            Phase::Acquiring { .. } => self.release_record(&at),
            _ if !owned => {}
            Phase::Completing { .. } => {}
            _ if !self.forwarded() => self.release_record(&at),
            Phase::Forwarded => self.outcome_unknown(&at, ""),
            // Never stored as completed: the client did not get the whole response either.
            Phase::Response(_) => {
                self.outcome_unknown(&at, "the response ended before its end of stream")
            }
            _ => {}
        }
        self.phase = Phase::Done;
    }

    /// The client left while this request's acquire calls are in flight and their answers
    /// will come back (the worker says so: they went out from the root). The flow stays to
    /// read them: it never forwards, answers or sends another call (a deferred round is
    /// dropped), and gives back what the answers say it took (see the module's doc). `false`:
    /// nothing in flight to wait for (then [`Flow::on_done`] as usual).
    pub(crate) fn detach(&mut self) -> bool {
        let Phase::Acquiring { deferred, .. } = &mut self.phase else {
            return false;
        };
        if !self.calls.any_open() {
            return false;
        }
        *deferred = None;
        self.gone = true;
        true
    }

    /// A detached request (its client left) with nothing more to wait for: forgotten now.
    pub(crate) fn gone_and_settled(&self) -> bool {
        self.gone && !matches!(self.phase, Phase::Acquiring { .. })
    }

    /// An answer (or a failure to send) for a detached request's call in `slot`.
    pub(super) fn gone_reply(
        &mut self,
        at: &Pcx<'_>,
        slot: usize,
        answer: Result<Reply, CallError>,
    ) -> Move {
        if !matches!(self.phase, Phase::Acquiring { .. }) {
            return Move::Wait;
        }
        let (purpose, answer) = match self.calls.answer(&at.cx(), slot, answer) {
            Answer::Unknown => return Move::Wait,
            // NOSCRIPT: the script did not run, so it took nothing; not sent again for a
            // client that left.
            Answer::Resend(_) => {
                self.calls.close(slot);
                self.settled_call(slot);
                return self.gone_answered(at);
            }
            Answer::Reply(call, answer) => (call.tag.purpose, answer),
        };
        self.calls.close(slot);
        match answer {
            Ok(reply) => {
                if self.gone_read(at, slot, purpose, &reply).is_err() {
                    at.m.increment(at.rt.metrics.redis.errors);
                }
            }
            Err(e) => {
                count_failure(at.rt, &e, at.m);
                if !e.may_have_run() {
                    self.settled_call(slot);
                }
            }
        }
        self.gone_answered(at)
    }

    /// Settles a detached request once none of its calls is outstanding.
    fn gone_answered(&mut self, at: &Pcx<'_>) -> Move {
        if !self.calls.any_open() {
            self.gone_settle(at);
        }
        Move::Wait
    }

    /// Reads a detached request's acquire answer into its guards; an unreadable one leaves
    /// the call unsettled (it may have run: its release carries the marker).
    fn gone_read(
        &mut self,
        at: &Pcx<'_>,
        slot: usize,
        purpose: Purpose,
        reply: &Reply,
    ) -> Result<(), CallError> {
        let Some(tag) = self.calls.get(slot).map(|c| &c.tag) else {
            return Ok(());
        };
        let (n, record, lease) = match purpose {
            Purpose::Acquire => (tag.limits.len(), tag.record, tag.lease),
            Purpose::LeaseRetry => (0, false, true),
            Purpose::RecordRetry => (0, true, tag.lease),
            _ => return Ok(()),
        };
        let read = acquire::read_reply(reply, n, record, lease)?;
        if purpose == Purpose::Acquire {
            let limits = &tag.limits;
            self.admission
                .answered(at, limits, read.states, read.admitted);
        }
        self.settled_with(slot, read.record, read.lease);
        Ok(())
    }

    /// The watchdog, for a detached request: an acquire that has not answered by its
    /// deadline is given up on (what it may take is given back with the owner's marker).
    pub(super) fn gone_tick(&mut self, at: &Pcx<'_>) -> Move {
        if let Phase::Acquiring { deadline_ms, .. } = self.phase {
            if at.now_ms >= deadline_ms {
                at.m.increment(at.rt.metrics.redis.timeouts);
                self.calls.iter_mut().for_each(|c| c.open = false);
                self.gone_settle(at);
            }
        }
        Move::Wait
    }

    /// Every call of a detached request answered or was given up on: the rate limits' answers
    /// are kept (over-limit marks, slices; counted as Redis decided them), and the record,
    /// the lease and the slots go back: plainly what an answer said it took, with the
    /// owner's marker what a call that did not answer may have taken. Those releases undo
    /// acquires the request never used: compensations, not counted as releases.
    fn gone_settle(&mut self, at: &Pcx<'_>) {
        self.admission.gone(at);
        let start = self.out.background.len();
        self.release_record(at);
        self.release_lease(at);
        self.release_slots(at);
        for bg in self.out.background.iter_mut().skip(start) {
            bg.certain = false;
            bg.compensation = true;
        }
        self.phase = Phase::Done;
    }

    /// The client left after the request was forwarded and before the response's headers:
    /// the service may still be working, so the lease and the concurrency slots it holds are
    /// not given back. They are no longer extended either, and expire after the lease's
    /// `ttl` and each limit's `window`. Counted per lease and per slot.
    pub(super) fn orphan(&mut self, at: &Pcx<'_>) {
        if let (Some(lease), Some(lm)) = (self.lease.as_mut(), at.pm.lease.as_ref()) {
            if lease.orphan() {
                at.m.increment(lm.orphaned);
            }
        }
        let limits = at.policy.rate_limits.iter().zip(&at.pm.limits);
        for ((limit, lm), slot) in limits.zip(self.admission.all_mut()) {
            if limit.concurrency() && std::mem::take(&mut slot.consumed) {
                at.m.increment(lm.slot_orphaned);
            }
        }
        self.slots_extend_ms = None;
    }
}
