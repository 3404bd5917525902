//! Redis's answers to the stream's calls, and the watchdog that decides calls, bodies and
//! lease waits that outlived their time.

use crate::engine::calls::{count_failure, Answer};
use crate::engine::flow::{Cx, Flow, Pcx, Phase, Purpose, Step, BODY_IDLE_TIMEOUT_MS};
use crate::http::local_reply::{self, Problem};
use crate::redis::scripts::acquire::{self, IdemAnswer, LeaseAnswer};
use crate::redis::{resp::Reply, CallError};
use crate::support::lograte::WarnKind;

impl Flow {
    /// A gateway answer (or a failure to send) for `slot`.
    pub fn on_reply(&mut self, cx: &Cx<'_>, slot: usize, answer: Result<Reply, CallError>) -> Step {
        if self.gone {
            return match self.at(cx) {
                Some(at) => self.gone_reply(&at, slot, answer),
                None => Step::Wait,
            };
        }
        let accepts = matches!(
            self.phase,
            Phase::Acquiring { .. } | Phase::Completing { .. } | Phase::Response(_)
        );
        let Some(at) = self.at(cx).filter(|_| accepts) else {
            return Step::Wait;
        };
        let (purpose, answer) = match self.calls.answer(&at.cx(), slot, answer) {
            Answer::Unknown => return Step::Wait,
            Answer::Resend(out) => return Step::Dispatch(vec![out]),
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
        idem: Option<IdemAnswer>,
        lease: Option<LeaseAnswer>,
    ) {
        self.settled_call(slot);
        if let (Some(answer), Some(i)) = (idem, self.idem.as_mut()) {
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
    fn on_answer(&mut self, at: &Pcx<'_>, slot: usize, purpose: Purpose, reply: &Reply) -> Step {
        let Some(tag) = self.calls.get(slot).map(|c| &c.tag) else {
            return Step::Wait;
        };
        match purpose {
            Purpose::LeaseRetry => {
                let read = match acquire::read_reply(reply, 0, false, true) {
                    Ok(r) => r,
                    Err(e) => return self.unreadable(at, slot, &e),
                };
                self.settled_call(slot);
                let answer = read.lease.unwrap_or(LeaseAnswer::Skipped);
                let headers = std::mem::take(&mut self.response_headers);
                self.on_lease_answer(at, answer, headers)
            }
            Purpose::RecordRetry => {
                let lease = tag.lease;
                let read = match acquire::read_reply(reply, 0, true, lease) {
                    Ok(r) => r,
                    Err(e) => return self.unreadable(at, slot, &e),
                };
                self.settled_with(slot, read.idem, read.lease);
                let headers = std::mem::take(&mut self.response_headers);
                self.guards_decide(at, headers)
            }
            Purpose::Acquire => {
                let limits = &tag.limits;
                let read = match acquire::read_reply(reply, limits.len(), tag.idem, tag.lease) {
                    Ok(r) => r,
                    Err(e) => return self.unreadable(at, slot, &e),
                };
                self.admission
                    .answered(at, limits, read.states, read.admitted);
                self.settled_with(slot, read.idem, read.lease);
                self.acquire_answered(at)
            }
            Purpose::LeaseRelease => {
                if let Some(l) = self.lease.as_mut() {
                    l.released(at, reply);
                }
                self.response_calls_done()
            }
            Purpose::SlotRelease => self.response_calls_done(),
            Purpose::LeaseExtend | Purpose::SlotExtend | Purpose::Charge => Step::Wait,
            Purpose::Complete | Purpose::Release => {
                if let Some(i) = self.idem.as_mut() {
                    i.settled(at, purpose, reply);
                }
                self.response_calls_done()
            }
        }
    }

    /// An acquire reply that cannot be read.
    fn unreadable(&mut self, at: &Pcx<'_>, slot: usize, e: &CallError) -> Step {
        at.m.increment(at.rt.metrics.redis.errors);
        self.call_failed(at, slot, Purpose::Acquire, e)
    }

    /// One acquire answered: wait for the others, then send the deferred record/lease call
    /// (unless the rate limits already rejected), then decide.
    fn acquire_answered(&mut self, at: &Pcx<'_>) -> Step {
        if self.calls.any_open() {
            return Step::Wait;
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
            return Step::Dispatch(out.into_iter().collect());
        }
        self.decide(at)
    }

    fn call_failed(
        &mut self,
        at: &Pcx<'_>,
        slot: usize,
        purpose: Purpose,
        err: &CallError,
    ) -> Step {
        match purpose {
            Purpose::Complete | Purpose::Release => {
                self.calls.close(slot);
                if let Some(i) = self.idem.as_mut() {
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
    pub(super) fn response_calls_done(&mut self) -> Step {
        if self.calls.any_open() {
            return Step::Wait;
        }
        if matches!(self.phase, Phase::Completing { .. }) {
            self.phase = Phase::Done;
            return Step::Continue;
        }
        Step::Wait
    }

    /// The watchdog: extends a held lease when due, polls a busy lease, and decides a stream
    /// whose body or calls outlived their time.
    pub fn on_tick(&mut self, cx: &Cx<'_>) -> Step {
        let Some(at) = self.at(cx) else {
            return Step::Wait;
        };
        if self.gone {
            return self.gone_tick(&at);
        }
        if let Some(bg) = self
            .lease
            .as_mut()
            .and_then(|l| l.extend(at.index, at.now_ms))
        {
            self.background.push(bg);
        }
        self.extend_slots(&at);
        let now = at.now_ms;
        match self.phase {
            Phase::LeaseWaiting { poll_at_ms } if now >= poll_at_ms => self.poll_lease(&at),
            Phase::RecordWaiting { poll_at_ms } if now >= poll_at_ms => self.poll_record(&at),
            Phase::Buffering { until_ms, .. } if now >= until_ms => {
                log::warn!(
                    "policy {}: no request body data for {} s; if no body ever arrives, the host \
                     must set allow_on_headers_stop_iteration: true on the Wasm plugin",
                    at.policy.name,
                    BODY_IDLE_TIMEOUT_MS / 1000
                );
                self.answer(local_reply::problem(
                    Problem::RequestBodyTimeout,
                    "the request body did not arrive in time",
                    &[],
                    Vec::new(),
                ))
            }
            Phase::Acquiring { deadline_ms, .. } if now >= deadline_ms => {
                at.m.increment(at.rt.metrics.redis.timeouts);
                self.fail(&at, &CallError::Timeout)
            }
            Phase::Completing { deadline_ms } if now >= deadline_ms => {
                at.m.increment(at.rt.metrics.redis.timeouts);
                self.completion_timed_out(&at)
            }
            _ => Step::Wait,
        }
    }

    /// The response goes out; late answers are ignored.
    fn completion_timed_out(&mut self, at: &Pcx<'_>) -> Step {
        let slots: Vec<usize> = self
            .calls
            .open_slots()
            .filter(|(_, c)| c.tag.purpose == Purpose::SlotRelease)
            .map(|(slot, _)| slot)
            .collect();
        for slot in slots {
            self.slot_release_to_root(at, slot);
        }
        let record_pending = self
            .calls
            .open()
            .any(|c| matches!(c.tag.purpose, Purpose::Complete | Purpose::Release));
        self.calls.iter_mut().for_each(|c| c.open = false);
        if record_pending {
            if let Some(i) = self.idem.as_mut() {
                i.settle_failed(at, &CallError::Timeout);
            }
        }
        self.phase = Phase::Done;
        Step::Continue
    }
}
