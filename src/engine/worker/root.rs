//! The root's own work: its tick (what the other workers told the over-limit cache, the
//! streams whose deadline passed, the root's due calls and the batches), its wake-up, the
//! tick's period (fine while a request waits for a lease), and waking the requests that wait
//! for a lease or record given back on this worker.

use super::effects::{Action, Dest, Effects};
use super::routes::{batch_callout, callout};
use super::Worker;
use crate::engine::flow::Cx;

/// The root's tick while a request of this worker waits for a busy lease: its polls are due
/// at jittered times, which the watchdog's coarser tick would bunch together again.
pub(crate) const LEASE_WAIT_TICK_MS: u64 = 5;

impl<S: Copy + Ord> Worker<S> {
    /// The root's tick: what the other workers told the over-limit cache, the streams whose
    /// deadline passed (what they hand over goes out in this same tick), the tick period, then
    /// the root's due calls and the batches.
    pub(crate) fn on_tick(&mut self, cx: &Cx<'_>) -> Effects<S> {
        let mut fx = Effects::new(Action::Continue);
        cx.rt.over_limit.sync(cx.now_ms);
        let due: Vec<S> = self
            .waiting
            .iter()
            .filter(|s| {
                self.streams
                    .get(s)
                    .and_then(|e| e.flow.deadline_ms())
                    .is_some_and(|d| cx.now_ms >= d)
            })
            .copied()
            .collect();
        for s in due {
            if let Some(entry) = self.streams.get_mut(&s) {
                let step = entry.flow.on_tick(cx);
                self.carry(cx, s, None, step, &mut fx);
            }
        }
        if self.fine_tick && !self.any_lease_waiter() {
            self.set_fine_tick(false, &mut fx);
        }
        self.send_due(cx, &mut fx);
        self.flush(cx, &mut fx);
        fx
    }

    /// The root was woken: the calls it holds for streams (releases, completions) go out,
    /// and queued acquires as batches.
    pub fn on_queue_ready(&mut self, cx: &Cx<'_>) -> Effects<S> {
        let mut fx = Effects::new(Action::Continue);
        self.send_due(cx, &mut fx);
        self.flush(cx, &mut fx);
        fx
    }

    /// The root's calls that are due, sent now (those a batch takes with the next flush).
    fn send_due(&mut self, cx: &Cx<'_>, fx: &mut Effects<S>) {
        self.woken = false;
        for out in self.outbox.take_due(cx.now_ms) {
            if let Some(sub) = self.batcher.takes(out.script, out.by_sha) {
                self.batcher.queue(Dest::Outbox(out.slot), sub, out.call);
            } else {
                let slot = out.slot;
                fx.calls.push(callout(cx, &out, Dest::Outbox(slot)));
            }
        }
    }

    /// The lease `key` was given back: this worker's requests waiting for it poll at the next
    /// tick instead of at the end of their backoff.
    pub(super) fn wake_waiters(&mut self, key: &str, now_ms: u64) {
        for s in &self.waiting {
            if let Some(entry) = self.streams.get_mut(s) {
                if entry.flow.waiting_for() == Some(key) {
                    entry.flow.wake(now_ms);
                }
            }
        }
    }

    fn any_lease_waiter(&self) -> bool {
        self.waiting.iter().any(|s| {
            self.streams
                .get(s)
                .is_some_and(|e| e.flow.waiting_for().is_some())
        })
    }

    /// Switches the root's tick to the fine one (`true`) or back.
    pub(super) fn set_fine_tick(&mut self, fine: bool, fx: &mut Effects<S>) {
        if self.fine_tick != fine {
            self.fine_tick = fine;
            fx.tick_ms = Some(if fine {
                LEASE_WAIT_TICK_MS
            } else {
                self.tick_ms
            });
        }
    }

    /// The queued calls (acquires, the root's settlements) as batches to send.
    fn flush(&mut self, cx: &Cx<'_>, fx: &mut Effects<S>) {
        for batch in self
            .batcher
            .flush(cx.now_ms, &cx.rt.config.redis.key_prefix)
        {
            fx.calls.push(batch_callout(cx, batch));
        }
    }
}
