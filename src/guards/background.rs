//! The calls a guard hands to the root because they must outlive the request or must not hold
//! it (async completion, releasing a record the request will not use, releasing and extending
//! leases): what to send and how its answer is read. The engine's outbox sends them.

use crate::guards::context::Purpose;
use crate::redis::ScriptCall;
use std::rc::Rc;

/// A call a request hands to the root: what to send and how to read its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Background {
    pub(crate) policy: usize,
    pub(crate) purpose: Purpose,
    pub(crate) call: Rc<ScriptCall>,
    /// Hash of the client's key, for logs.
    pub(crate) key_hash: String,
    /// False when the request may not own what this call gives back (a release sent while
    /// its acquire was still in flight, or a call sent again after the stream ended): then
    /// "not ours" is the expected answer, not a stale owner or a lost lease.
    pub(crate) certain: bool,
    /// Gives back what an acquire the request gave up on may have taken (the call carries the
    /// owner's cancellation marker): "released" then is a late acquire undone, not a release
    /// of something the request knew it held, and is not counted as one.
    pub(crate) compensation: bool,
}

impl Background {
    pub(crate) fn new(
        policy: usize,
        purpose: Purpose,
        call: impl Into<Rc<ScriptCall>>,
        key_hash: String,
    ) -> Background {
        Background {
            policy,
            purpose,
            call: call.into(),
            key_hash,
            certain: true,
            compensation: false,
        }
    }

    /// Gives back what `holder` holds (then no longer) or, with `in_flight`, what an acquire
    /// the request gave up on may have taken: then the release carries the owner's
    /// cancellation marker (`marker_ttl_ms`), so a late acquire takes nothing, and the call is
    /// a compensation (see [`Background::compensation`]).
    pub(crate) fn give_back(
        policy: usize,
        holder: &mut impl Holder,
        in_flight: bool,
        marker_ttl_ms: u64,
    ) -> Option<Background> {
        let certain = std::mem::take(holder.held());
        if !certain && !in_flight {
            return None;
        }
        let (purpose, call, key_hash) = holder.release((!certain).then_some(marker_ttl_ms));
        let call = Background::new(policy, purpose, call, key_hash);
        Some(if certain { call } else { call.compensation() })
    }

    /// A call whose "not ours" answer is expected (see [`Background::certain`]).
    pub(crate) fn uncertain(mut self) -> Background {
        self.certain = false;
        self
    }

    /// A release of what a late acquire may have taken (see [`Background::compensation`]).
    pub(crate) fn compensation(mut self) -> Background {
        self.certain = false;
        self.compensation = true;
        self
    }
}

/// A guard that holds something in Redis (the record, the lease) and gives it back from the
/// root (see [`Background::give_back`]).
pub(crate) trait Holder {
    /// Whether the request holds it.
    fn held(&mut self) -> &mut bool;
    /// The call that gives it back by owner (with the cancellation marker's TTL when the
    /// request may not hold it): its purpose, the call, the key hash for logs.
    fn release(&mut self, marker_ttl_ms: Option<u64>) -> (Purpose, ScriptCall, String);
}
