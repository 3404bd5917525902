//! The watchdog: when a stream must go on (its body, its calls or its wait outlived their
//! time) or a held lease or concurrency slot is to be extended, what the root's tick then
//! does, and waking a request that waits for a lease or a record given back on this worker.

use crate::engine::flow::{Cx, Flow, Move, Pcx, Phase, Purpose, Step, BODY_IDLE_TIMEOUT_MS};
use crate::guards::lease::LeaseGuard;
use crate::http::local_reply::{self, Problem};
use crate::redis::CallError;

impl Flow {
    /// When the stream is paused (on Redis, or waiting for the request body or a lease), the
    /// time by which it must go on; or when a held lease or slot is to be extended.
    pub(crate) fn deadline_ms(&self) -> Option<u64> {
        let stream = match self.phase {
            Phase::Buffering { until_ms, .. } => Some(until_ms),
            Phase::Acquiring { deadline_ms, .. } | Phase::Completing { deadline_ms } => {
                Some(deadline_ms)
            }
            Phase::LeaseWaiting { poll_at_ms } | Phase::RecordWaiting { poll_at_ms } => {
                Some(poll_at_ms)
            }
            _ => None,
        };
        let extend = self.lease.as_ref().and_then(LeaseGuard::next_extend_ms);
        [stream, extend, self.slots_extend_ms]
            .into_iter()
            .flatten()
            .min()
    }

    /// The lease (`on_busy: wait`) or record (`in_progress: wait`) this request waits for,
    /// while it waits.
    pub(crate) fn waiting_for(&self) -> Option<&str> {
        match self.phase {
            Phase::LeaseWaiting { .. } => self.lease.as_ref().map(|l| l.acquire.key.as_str()),
            Phase::RecordWaiting { .. } => self.record.as_ref().map(|i| i.acquire.key.as_str()),
            _ => None,
        }
    }

    /// What this request waits for was just given back (or settled) on this worker: poll it
    /// at the next tick instead of at the end of the backoff.
    pub(crate) fn wake(&mut self, now_ms: u64) {
        if let Phase::LeaseWaiting { poll_at_ms } | Phase::RecordWaiting { poll_at_ms } =
            &mut self.phase
        {
            *poll_at_ms = (*poll_at_ms).min(now_ms);
        }
    }

    /// The watchdog: extends a held lease when due, polls a busy lease, and decides a stream
    /// whose body or calls outlived their time.
    pub(crate) fn on_tick(&mut self, cx: &Cx<'_>) -> Step {
        self.step(cx, |f| f.tick(cx))
    }

    fn tick(&mut self, cx: &Cx<'_>) -> Move {
        let Some(at) = self.at(cx) else {
            return Move::Wait;
        };
        if self.gone {
            return self.gone_tick(&at);
        }
        if let Some(bg) = self
            .lease
            .as_mut()
            .and_then(|l| l.extend(at.index, at.now_ms))
        {
            self.out.background.push(bg);
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
                    &at.rt.config.problem_type_base,
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
            _ => Move::Wait,
        }
    }

    /// The response goes out; late answers are ignored.
    fn completion_timed_out(&mut self, at: &Pcx<'_>) -> Move {
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
            if let Some(i) = self.record.as_mut() {
                i.settle_failed(at, &CallError::Timeout);
            }
        }
        self.phase = Phase::Done;
        Move::Continue
    }
}
