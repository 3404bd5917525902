//! Redis's answers to the stream's calls: an acquire's (rate limits, the record, the lease)
//! read into the guards and, once every call of the round answered, decided; a poll's; the
//! response side's (complete, release, the lease's and the slots' releases), which the
//! response waits for; and calls that failed.

use crate::engine::calls::{count_failure, Answer};
use crate::engine::flow::{Cx, Flow, Move, Pcx, Phase, Purpose, Step};
use crate::redis::scripts::acquire::{self, LeaseAnswer, RecordAnswer};
use crate::redis::{resp::Reply, CallError};
use crate::support::lograte::WarnKind;

impl Flow {
    /// A gateway answer (or a failure to send) for `slot`.
    pub fn on_reply(&mut self, cx: &Cx<'_>, slot: usize, answer: Result<Reply, CallError>) -> Step {
        self.step(cx, |f| f.reply(cx, slot, answer))
    }

    fn reply(&mut self, cx: &Cx<'_>, slot: usize, answer: Result<Reply, CallError>) -> Move {
        if self.gone {
            return match self.at(cx) {
                Some(at) => self.gone_reply(&at, slot, answer),
                None => Move::Wait,
            };
        }
        let accepts = matches!(
            self.phase,
            Phase::Acquiring { .. } | Phase::Completing { .. } | Phase::Response(_)
        );
        let Some(at) = self.at(cx).filter(|_| accepts) else {
            return Move::Wait;
        };
        let (purpose, answer) = match self.calls.answer(&at.cx(), slot, answer) {
            Answer::Unknown => return Move::Wait,
            Answer::Resend(out) => return Move::Dispatch(vec![out]),
            Answer::Reply(call, answer) => (call.tag.purpose, answer),
        };
        match answer {
            Ok(reply) => {
                self.calls.close(slot);
                self.on_answer(&at, slot, purpose, &reply)
            }
            Err(e) => {
                count_failure(at.rt, &e, at.m);
                if !e.may_have_run() {
                    // Provably not run (never sent, or refused by the gateway): nothing was
                    // written, so nothing is to be given back for this call.
                    self.calls.close(slot);
                    self.settled_call(slot);
                }
                self.call_failed(&at, slot, purpose, &e)
            }
        }
    }

    /// The call in `slot` was read: it is settled, and the record's and the lease's answers it
    /// carried go to their guards.
    pub(super) fn settled_with(
        &mut self,
        slot: usize,
        record: Option<RecordAnswer>,
        lease: Option<LeaseAnswer>,
    ) {
        self.settled_call(slot);
        if let (Some(answer), Some(i)) = (record, self.record.as_mut()) {
            i.answered(answer);
        }
        if let (Some(answer), Some(l)) = (lease, self.lease.as_mut()) {
            l.answered(answer);
        }
    }

    /// The call in `slot` can no longer have left anything this request does not know of.
    pub(super) fn settled_call(&mut self, slot: usize) {
        if let Some(c) = self.calls.get_mut(slot) {
            c.tag.record_unsettled = false;
            c.tag.lease_unsettled = false;
            c.tag.slots_unsettled = false;
        }
    }

    /// The answer of the call in `slot`, of `purpose`; what else the reading needs (the limits
    /// and sections it carried) is read from the call's tag, not copied out of it.
    fn on_answer(&mut self, at: &Pcx<'_>, slot: usize, purpose: Purpose, reply: &Reply) -> Move {
        let Some(tag) = self.calls.get(slot).map(|c| &c.tag) else {
            return Move::Wait;
        };
        match purpose {
            Purpose::LeaseRetry => {
                let read = match acquire::read_reply(reply, 0, false, true) {
                    Ok(r) => r,
                    Err(e) => return self.unreadable(at, slot, &e),
                };
                self.settled_call(slot);
                let answer = read.lease.unwrap_or(LeaseAnswer::Skipped);
                let headers = std::mem::take(&mut self.limit_headers);
                self.on_lease_answer(at, answer, headers)
            }
            Purpose::RecordRetry => {
                let lease = tag.lease;
                let read = match acquire::read_reply(reply, 0, true, lease) {
                    Ok(r) => r,
                    Err(e) => return self.unreadable(at, slot, &e),
                };
                self.settled_with(slot, read.record, read.lease);
                let headers = std::mem::take(&mut self.limit_headers);
                self.guards_decide(at, headers)
            }
            Purpose::Acquire => {
                let limits = &tag.limits;
                let read = match acquire::read_reply(reply, limits.len(), tag.record, tag.lease) {
                    Ok(r) => r,
                    Err(e) => return self.unreadable(at, slot, &e),
                };
                self.admission
                    .answered(at, limits, read.states, read.admitted);
                self.settled_with(slot, read.record, read.lease);
                self.acquire_answered(at)
            }
            Purpose::LeaseRelease => {
                if let Some(l) = self.lease.as_mut() {
                    self.out.freed = l.released(at, reply);
                }
                self.response_calls_done()
            }
            Purpose::SlotRelease => self.response_calls_done(),
            Purpose::LeaseExtend | Purpose::SlotExtend | Purpose::Charge => Move::Wait,
            Purpose::Complete | Purpose::Release => {
                if let Some(i) = self.record.as_mut() {
                    self.out.freed = i.settled(at, purpose, reply);
                }
                self.response_calls_done()
            }
        }
    }

    /// An acquire reply that cannot be read.
    fn unreadable(&mut self, at: &Pcx<'_>, slot: usize, e: &CallError) -> Move {
        at.m.increment(at.rt.metrics.redis.errors);
        self.call_failed(at, slot, Purpose::Acquire, e)
    }

    /// One acquire answered: wait for the others, then send the deferred record/lease call
    /// (unless the rate limits already rejected), then decide.
    fn acquire_answered(&mut self, at: &Pcx<'_>) -> Move {
        if self.calls.any_open() {
            return Move::Wait;
        }
        let deferred = match &mut self.phase {
            Phase::Acquiring { deferred, .. } => deferred.take(),
            _ => None,
        };
        // Rejected by the first round: the deferred limits are not asked.
        if let Some(group) = deferred.filter(|_| !self.admission.rejected(at)) {
            let out = self.send_acquire(at, group);
            self.phase = Phase::Acquiring {
                deadline_ms: at.call_deadline(),
                deferred: None,
            };
            return Move::Dispatch(out.into_iter().collect());
        }
        self.decide(at)
    }

    fn call_failed(
        &mut self,
        at: &Pcx<'_>,
        slot: usize,
        purpose: Purpose,
        err: &CallError,
    ) -> Move {
        match purpose {
            Purpose::Complete | Purpose::Release => {
                self.calls.close(slot);
                if let Some(i) = self.record.as_mut() {
                    i.settle_failed(at, err);
                }
                self.response_calls_done()
            }
            Purpose::SlotRelease => {
                self.slot_release_to_root(at, slot);
                self.response_calls_done()
            }
            Purpose::LeaseRelease => {
                self.calls.close(slot);
                at.rt
                    .warnings
                    .warn(WarnKind::LeaseNotSettled, at.index, at.now_ms, || {
                        format!(
                            "lease of policy {} not released ({}); it expires at its TTL",
                            at.policy.name,
                            err.describe()
                        )
                    });
                self.response_calls_done()
            }
            _ => self.fail(at, err),
        }
    }

    /// After a response-side call answered: go on once none is outstanding.
    pub(super) fn response_calls_done(&mut self) -> Move {
        if self.calls.any_open() {
            return Move::Wait;
        }
        if matches!(self.phase, Phase::Completing { .. }) {
            self.phase = Phase::Done;
            return Move::Continue;
        }
        Move::Wait
    }
}
