//! Rate-limit admission of one request: each limit's key, the state Redis (or this worker's
//! leased slice, or the over-limit cache) gave it, together in one [`LimitSlot`]; the verdict
//! and what the verdict leaves behind (slices, over-limit marks, metrics).

use crate::guards::context::Pcx;
use crate::guards::ratelimit::{self, Known, LimitState, Verdict};
use crate::http::identity::Caller;
use crate::http::local_reply::LocalResponse;
use crate::http::request::Request;
use crate::redis::keys::LimitKey;
use crate::redis::scripts::acquire::{Ask, OverrideKeys};
use crate::redis::CallError;
use std::rc::Rc;

/// One rate limit of the request, in policy order.
#[derive(Debug)]
pub(crate) struct LimitSlot {
    /// The counter's Redis key (its hash indexes the over-limit cache and the slices).
    pub(crate) key: LimitKey,
    /// What the counter said; `None` while not asked (or never, after an early rejection).
    pub(crate) state: Option<LimitState>,
    /// Admitted from this worker's leased slice (no Redis call for it).
    pub(crate) local: bool,
    /// The slice Redis granted this leased limit in this request's acquire (0: none).
    pub(crate) granted: u64,
    /// Units this request consumes from the limit (its `cost`, else 1).
    pub(crate) cost: u64,
    /// Consumed in Redis: the limit's call admitted the request and this limit allowed it
    /// (a concurrency limit: the slot is held until given back).
    pub(crate) consumed: bool,
    /// Where the caller's own quota may be stored (limits with `overrides`, asked in Redis).
    pub(crate) overrides: Option<OverrideKeys>,
}

#[derive(Debug, Default)]
pub(crate) struct Admission {
    slots: Vec<LimitSlot>,
    /// The first limit the over-limit cache answered the request's `429` for (the
    /// decision's limit: the cache leaves that limit's state unknown).
    cached: Option<usize>,
}

impl Admission {
    /// The request's limits, with its cost to each (`costs[i]`, else 1); leased limits admit
    /// from this worker's slice while it lasts.
    /// Built in this admission's room, whose limits are dropped: a reused stream box allocates
    /// no list for them.
    pub(crate) fn start(
        self,
        at: &Pcx<'_>,
        caller: &Caller,
        req: &Request,
        costs: &[u64],
    ) -> Admission {
        let rt = at.rt;
        let mut buffer = self.emptied().slots;
        let slots = at.policy.rate_limits.iter().enumerate().map(|(i, limit)| {
            let key = rt.keys.key(
                &rt.config.redis.key_prefix,
                (at.index, at.policy),
                (i, limit),
                caller,
                req,
            );
            let taken = limit
                .leased
                .then(|| rt.quota.take(key.hash(), at.now_ms))
                .flatten();
            // Read in the counter's own call (none for a unit from the leased slice).
            let overrides = taken
                .is_none()
                .then(|| {
                    ratelimit::override_keys(
                        &rt.config.redis.key_prefix,
                        at.policy,
                        limit,
                        &key,
                        caller,
                    )
                })
                .flatten();
            LimitSlot {
                state: taken.map(|(left, expires, quota)| LimitState {
                    allowed: true,
                    remaining: left,
                    reset_ms: expires.saturating_sub(at.now_ms),
                    retry_after_ms: 0,
                    quota,
                    override_unreadable: false,
                }),
                local: taken.is_some(),
                key,
                granted: 0,
                cost: costs.get(i).copied().unwrap_or(1),
                consumed: false,
                overrides,
            }
        });
        buffer.extend(slots);
        Admission {
            slots: buffer,
            cached: None,
        }
    }

    /// No limits, in this admission's room.
    pub(crate) fn emptied(self) -> Admission {
        let mut slots = self.slots;
        slots.clear();
        Admission {
            slots,
            cached: None,
        }
    }

    /// Whether every limit was admitted locally (none, or each from this worker's slice):
    /// Redis has nothing to be asked about them.
    pub(crate) fn all_local(&self) -> bool {
        self.slots.iter().all(|s| s.local)
    }

    /// The limits Redis must be asked about (`None` for a limit admitted locally).
    pub(crate) fn asks(&self) -> Vec<Option<Ask<'_>>> {
        self.slots
            .iter()
            .map(|s| {
                (!s.local).then_some(Ask {
                    key: &s.key,
                    cost: s.cost,
                    overrides: s.overrides.as_ref(),
                })
            })
            .collect()
    }

    /// The limit the over-limit cache rejected the request for, if it did.
    pub(crate) fn cached_rejection_limit(&self) -> Option<usize> {
        self.cached
    }

    /// The request's limits, in policy order.
    pub(crate) fn all(&self) -> &[LimitSlot] {
        &self.slots
    }

    /// The request's limits, to mark what was given back.
    pub(crate) fn all_mut(&mut self) -> &mut [LimitSlot] {
        &mut self.slots
    }

    /// A 429 from the over-limit cache, when one of the request's enforced counters is known
    /// to reject: no Redis call, nothing acquired, nothing consumed (local units go back).
    pub(crate) fn cached_rejection(&mut self, at: &Pcx<'_>) -> Option<Rc<LocalResponse>> {
        let rt = at.rt;
        if !rt.over_limit.enabled() {
            return None;
        }
        // Allocated at the first hit: most requests have none.
        let mut waits: Option<Vec<Option<Known>>> = None;
        let mut first = None;
        for (i, (limit, slot)) in at.policy.rate_limits.iter().zip(&self.slots).enumerate() {
            // A unit from this worker's slice was counted in Redis when the slice was taken:
            // it admits whatever the counter says now.
            if limit.shadow || slot.local {
                continue;
            }
            if let Some((until, quota)) = rt.over_limit.rejecting_until(slot.key.hash(), at.now_ms)
            {
                first = first.or(Some(i));
                let all = waits.get_or_insert_with(|| vec![None; self.slots.len()]);
                if let Some(wait) = all.get_mut(i) {
                    *wait = Some(Known {
                        wait_ms: until - at.now_ms,
                        quota,
                    });
                }
                if let Some(lm) = at.pm.limits.get(i) {
                    at.m.increment(lm.rejected);
                }
            }
        }
        let waits = waits?;
        at.m.increment(rt.metrics.over_limit_cache_hits);
        let types = &rt.config.problem_type_base;
        let response = rt.rejections.cached(at.index, at.policy, &waits, types)?;
        self.cached = first;
        self.refund_local(at);
        Some(response)
    }

    /// An acquire call's states for the limits it carried (`limits`, policy indices).
    /// `admitted` says whether that call admitted: a leased limit's "remaining" is then the
    /// slice it granted.
    pub(crate) fn answered(
        &mut self,
        at: &Pcx<'_>,
        limits: &[usize],
        states: Vec<LimitState>,
        admitted: bool,
    ) {
        for (&i, mut state) in limits.iter().zip(states) {
            let limit = at.policy.rate_limits.get(i);
            let leased = limit.is_some_and(|l| l.leased);
            let Some(slot) = self.slots.get_mut(i) else {
                continue;
            };
            // A tenant's own quota that says what the configuration says is none.
            if let Some(l) = limit {
                state.quota = state.quota.filter(|q| *q != l.quota());
            }
            if state.override_unreadable {
                if let Some(lm) = at.pm.limits.get(i) {
                    at.m.increment(lm.override_unreadable);
                }
            }
            if leased && admitted && state.allowed {
                slot.granted = state.remaining;
            }
            slot.consumed = admitted && state.allowed;
            slot.state = Some(state);
        }
    }

    /// An enforced limit already rejected (a later round need not be asked).
    pub(crate) fn rejected(&self, at: &Pcx<'_>) -> bool {
        at.policy
            .rate_limits
            .iter()
            .zip(&self.slots)
            .any(|(l, s)| !l.shadow && s.state.is_some_and(|s| !s.allowed))
    }

    /// Every limit answered: the verdict, with the slices, over-limit marks and metrics it
    /// leaves. `Err` for a broken reply (a limit without a state that was not skipped).
    pub(crate) fn decide(&mut self, at: &Pcx<'_>) -> Result<Verdict, CallError> {
        // A limit without a state was not asked (its round was skipped after a rejection);
        // any other gap is a broken reply.
        let rejected_early = self
            .slots
            .iter()
            .any(|s| s.state.is_some_and(|s| !s.allowed));
        if !rejected_early && self.slots.iter().any(|s| s.state.is_none()) {
            return Err(CallError::UnexpectedReply("missing limit state".into()));
        }
        let admitted = self.admitted(at);
        self.keep_slices(at, admitted);
        if !admitted {
            self.refund_local(at);
        }
        self.mark_over_limit(at);
        let states: Vec<Option<LimitState>> = self.slots.iter().map(|s| s.state).collect();
        let verdict = ratelimit::decide(at.policy, &states, &at.rt.config.problem_type_base);
        self.count(at, matches!(verdict, Verdict::Allow(_)));
        Ok(verdict)
    }

    /// The answers of a request whose client left before they came (see `gone.rs`): the
    /// over-limit marks and the slices Redis granted are kept (every unit of a slice stays
    /// for later requests: this one runs nowhere), the units it took from local slices go
    /// back, and each limit counts what Redis decided.
    pub(crate) fn gone(&mut self, at: &Pcx<'_>) {
        let admitted = self.admitted(at);
        self.keep_slices(at, false);
        self.refund_local(at);
        self.mark_over_limit(at);
        self.count(at, admitted);
    }

    /// Whether every enforced limit's answer admits the request (shadow limits never reject).
    fn admitted(&self, at: &Pcx<'_>) -> bool {
        at.policy
            .rate_limits
            .iter()
            .zip(&self.slots)
            .all(|(l, s)| l.shadow || s.state.is_some_and(|s| s.allowed))
    }

    /// Slices granted by Redis: this request uses one unit if it is admitted; the rest (or
    /// all of it) is admitted locally later.
    fn keep_slices(&mut self, at: &Pcx<'_>, admitted: bool) {
        for slot in self.slots.iter_mut().filter(|s| s.granted > 0) {
            let left = if admitted {
                slot.granted - 1
            } else {
                slot.granted
            };
            let (reset, quota) = slot.state.map_or((0, None), |s| (s.reset_ms, s.quota));
            at.rt.quota.add(
                slot.key.hash(),
                left,
                at.now_ms.saturating_add(reset),
                at.now_ms,
                quota,
            );
            if let Some(s) = slot.state.as_mut() {
                s.remaining = left;
            }
        }
    }

    /// Remembers counters that reject, until the script says they could admit again.
    fn mark_over_limit(&self, at: &Pcx<'_>) {
        for (limit, slot) in at.policy.rate_limits.iter().zip(&self.slots) {
            let Some(state) = slot.state else {
                continue;
            };
            // Only a counter that can only get fuller until `retry_after` is cached: not a
            // concurrency slot (it frees when a request ends, which no clock says), not a
            // charged limit (a charge can lower the counter), not a costly request's rejection
            // while units are left (a cheaper request may fit).
            let cacheable = !limit.concurrency()
                && limit.charge.is_none()
                && (slot.cost <= 1 || state.remaining == 0);
            if !state.allowed && !limit.shadow && cacheable && state.retry_after_ms > 0 {
                let until = at.now_ms.saturating_add(state.retry_after_ms);
                if limit.overrides {
                    // An override set meanwhile is read within a refresh.
                    let over = &at.rt.over_limit;
                    over.mark_overridable(slot.key.hash(), until, at.now_ms, state.quota);
                } else {
                    at.rt.over_limit.mark(slot.key.hash(), until);
                }
            }
        }
    }

    /// A limit counts `allowed` only for admitted requests, `rejected` when it is one the
    /// request violated, `shadow_rejected` when a shadow limit would have rejected.
    fn count(&self, at: &Pcx<'_>, admitted: bool) {
        let limits = at
            .policy
            .rate_limits
            .iter()
            .zip(&self.slots)
            .zip(&at.pm.limits);
        for ((limit, slot), lm) in limits {
            let Some(state) = slot.state else {
                continue;
            };
            let metric = match (state.allowed, limit.shadow) {
                (true, _) if admitted => Some(lm.allowed),
                (true, _) => None,
                (false, true) => Some(lm.shadow_rejected),
                (false, false) => Some(lm.rejected),
            };
            if let Some(id) = metric {
                at.m.increment(id);
            }
        }
    }

    /// Gives back the units this request took from local slices (it was rejected).
    fn refund_local(&mut self, at: &Pcx<'_>) {
        for slot in self.slots.iter_mut() {
            if std::mem::take(&mut slot.local) {
                at.rt.quota.refund(slot.key.hash());
            }
        }
    }
}
