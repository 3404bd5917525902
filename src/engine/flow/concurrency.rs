//! Concurrency slots of one request: taken by the acquire (the slot's member is the request's
//! nonce), kept alive at half their window while the request runs, and given back once the
//! upstream answered (the response waits for the release) or, from the root, when the stream
//! ends otherwise or the request is refused. A slot an acquire may have taken after the
//! filter gave up on it is given back with the owner's cancellation marker, so a late acquire
//! takes none.

use crate::config::{Policy, RateLimit};
use crate::engine::flow::{Flow, Outgoing, Pending};
use crate::guards::background::Background;
use crate::guards::context::{Pcx, Purpose};
use crate::guards::ratelimit::admission::{Admission, LimitSlot};
use crate::redis::scripts::acquire::Asker;
use crate::redis::scripts::slot;

/// The concurrency limits of `policy` whose slot the request holds, with their slots.
fn held<'a>(
    policy: &'a Policy,
    admission: &'a Admission,
) -> impl Iterator<Item = (&'a RateLimit, &'a LimitSlot)> {
    policy
        .rate_limits
        .iter()
        .zip(admission.all())
        .filter(|(l, s)| l.concurrency() && s.consumed)
}

impl Flow {
    /// The acquire answered: when the slots it took are to be extended first.
    pub(super) fn slots_taken(&mut self, at: &Pcx<'_>) {
        let window = held(at.policy, &self.admission)
            .map(|(l, _)| l.window_ms)
            .min();
        self.slots_extend_ms = window.map(|w| at.now_ms.saturating_add((w / 2).max(1)));
    }

    /// Extends the slots this request holds, when due (from the root: the stream may end).
    pub(super) fn extend_slots(&mut self, at: &Pcx<'_>) {
        let Some(due) = self.slots_extend_ms.filter(|d| at.now_ms >= *d) else {
            return;
        };
        let mut next = u64::MAX;
        for (limit, s) in held(at.policy, &self.admission) {
            let call = slot::extend(s.key.text(), &self.nonce, limit.window_ms);
            self.out.background.push(Background::new(
                at.index,
                Purpose::SlotExtend,
                call,
                String::new(),
            ));
            next = next.min(
                due.max(at.now_ms)
                    .saturating_add((limit.window_ms / 2).max(1)),
            );
        }
        self.slots_extend_ms = (next != u64::MAX).then_some(next);
    }

    /// Whether the request holds a concurrency slot.
    pub(super) fn holds_slots(&self, at: &Pcx<'_>) -> bool {
        held(at.policy, &self.admission).next().is_some()
    }

    /// The releases of the slots this request holds, sent now: the response waits for them.
    pub(super) fn slots_release_now(&mut self, at: &Pcx<'_>) -> Vec<Outgoing> {
        let mut out = Vec::new();
        let limits = at.policy.rate_limits.iter();
        for (limit, s) in limits.zip(self.admission.all_mut()) {
            if limit.concurrency() && std::mem::take(&mut s.consumed) {
                let call = slot::release(s.key.text(), &self.nonce, None);
                let tag = Pending::of(Purpose::SlotRelease);
                out.extend(self.calls.push_and_send(
                    tag,
                    Purpose::SlotRelease.script(),
                    call,
                    at.now_ms,
                ));
            }
        }
        if !out.is_empty() {
            self.slots_extend_ms = None;
        }
        out
    }

    /// A release the response waited for did not answer (failed, or timed out): the root
    /// sends it again.
    pub(super) fn slot_release_to_root(&mut self, at: &Pcx<'_>, slot: usize) {
        if let Some(c) = self.calls.get(slot) {
            let bg = Background::new(
                at.index,
                Purpose::SlotRelease,
                c.call.clone(),
                String::new(),
            );
            self.out.background.push(bg.uncertain());
        }
        self.calls.close(slot);
    }

    /// Gives back, from the root, the slots this request holds and those an acquire it gave
    /// up on may have taken (with the owner's cancellation marker); once.
    pub(super) fn release_slots(&mut self, at: &Pcx<'_>) {
        let marker_ttl = self.marker_ttl_ms(at);
        let asker = Asker {
            nonce: &self.nonce,
            prefix: &at.rt.config.redis.key_prefix,
            owner: &self.owner,
        };
        let limits = at.policy.rate_limits.iter();
        for (i, (limit, s)) in limits.zip(self.admission.all_mut()).enumerate() {
            if !limit.concurrency() {
                continue;
            }
            let in_flight = self
                .calls
                .iter_mut()
                .any(|c| c.tag.slots_unsettled && c.tag.limits.contains(&i));
            let certain = std::mem::take(&mut s.consumed);
            if !certain && !in_flight {
                continue;
            }
            let marker = (!certain).then(|| (asker.marker(at.policy, s.key.tag()), marker_ttl));
            let call = slot::release(s.key.text(), asker.nonce, marker);
            let bg = Background::new(at.index, Purpose::SlotRelease, call, String::new());
            self.out
                .background
                .push(if certain { bg } else { bg.compensation() });
        }
        self.calls
            .iter_mut()
            .for_each(|c| c.tag.slots_unsettled = false);
        self.slots_extend_ms = None;
    }
}
