//! A client that hangs up, by where its request was.
//!
//! - **Still deciding** (its acquire in flight, its body buffering, a busy lease or record
//!   waited for): the request never reached the service; what it holds or an acquire in flight
//!   may take is given back at once (see `decide.rs`: with the owner's cancellation marker
//!   while an acquire may still run).
//! - **Forwarded, before the response's headers**: the service may still be working (Envoy
//!   resets its request, which a service rarely notices). The lease and the concurrency
//!   slots stay held, no longer extended, and expire after the lease's `ttl` and the limit's
//!   `window` ([`Flow::orphan`], counted `lease.orphaned`, `limit.<l>.slot_orphaned`), as the
//!   idempotency record stays `PROCESSING` (`outcome_unknown`).
//! - **After the response's headers**: the service answered; whatever is still held is given
//!   back when the stream ends, as for any response.

use super::{Flow, Pcx};

impl Flow {
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
