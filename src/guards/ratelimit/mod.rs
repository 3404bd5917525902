//! Rate limits of one request: which script calls to make, and what their replies mean.
//!
//! Keys and the verdict. The calls themselves, with each limit's arguments, are planned by
//! [`crate::redis::scripts::acquire`], which groups limits by hash tag.

pub(crate) mod admission;
pub(crate) mod charge;
pub(crate) mod leased;
pub(crate) mod overlimit;

use crate::config::{Policy, Quota, RateLimit};
use crate::http::identity::{Caller, ANONYMOUS};
use crate::http::local_reply::{self, LocalResponse, Member, Problem, QuotaView};
use crate::http::request::Request;
use crate::http::selectors::selector_value;
use crate::redis::keys::{self, LimitKey};
/// Each limit's answer: what `acquire.lua` says of it (the script's contract reads it), or
/// what a local slice or the over-limit cache knows.
pub(crate) use crate::redis::scripts::acquire::LimitState;
use crate::redis::scripts::acquire::OverrideKeys;
use crate::support::slots::SlotTable;
use crate::support::text::push_u64;
use std::cell::RefCell;
use std::rc::Rc;

/// The counter key of `limit` for this caller and request.
pub fn key(
    prefix: &str,
    policy: &Policy,
    limit: &RateLimit,
    caller: &Caller,
    req: &Request,
) -> LimitKey {
    keys::write_rate_limit_key(
        prefix,
        policy,
        limit,
        // The hash tag: the hashed tenant for tenant-scoped limits, else the policy.
        |k| {
            if limit.tenant_scoped() {
                keys::push_tenant_tag(k, &caller.tenant);
            } else {
                keys::push_policy_tag(k, &policy.name);
            }
        },
        |k| {
            keys::push_scope_hash(
                k,
                limit
                    .by
                    .iter()
                    .map(|sel| (sel, selector_value(sel, caller, req))),
            )
        },
    )
}

/// The override keys of `limit` for this caller, when the limit has `overrides: true`: in the
/// counter's own hash tag (`key`'s, the tenant's), the principal's only for a request that
/// names one. The filter passes them in the counter's call; the operator's tool plans its
/// calls with the same.
pub(crate) fn override_keys(
    prefix: &str,
    policy: &Policy,
    limit: &RateLimit,
    key: &LimitKey,
    caller: &Caller,
) -> Option<OverrideKeys> {
    limit.overrides.then(|| {
        let principal = Some(caller.principal.as_ref()).filter(|p| *p != ANONYMOUS);
        OverrideKeys::new(prefix, key.tag(), policy, limit, principal)
    })
}

/// Rate-limit keys this worker built, by what they were built from: a key costs two SHA-256
/// digests, and the requests of one tenant build the same keys again and again.
///
/// A [`SlotTable`] indexed by a hash of the inputs; a slot stores the inputs in full, so a
/// colliding request rebuilds its key (and takes the slot) instead of reading another's.
pub(crate) struct KeyMemo {
    slots: SlotTable<Memo>,
}

/// A memo slot: the inputs a key was built from, and the key.
struct Memo {
    input: Vec<u8>,
    key: LimitKey,
}

/// Slots of [`KeyMemo`] per worker.
pub(crate) const KEY_MEMO_SLOTS: usize = 256;

/// Inputs longer than this (a long header value as a selector) are not memoised, so a slot
/// holds at most this plus a key (a few hundred bytes): the table stays around 100 KiB.
const MAX_MEMO_INPUT: usize = 256;

impl KeyMemo {
    pub(crate) fn new(slots: usize) -> KeyMemo {
        KeyMemo {
            slots: SlotTable::new(slots),
        }
    }

    /// [`key`] of limit `limit_index` of policy `policy_index`, from the table when this
    /// worker built it before.
    pub(crate) fn key(
        &self,
        prefix: &str,
        (policy_index, policy): (usize, &Policy),
        (limit_index, limit): (usize, &RateLimit),
        caller: &Caller,
        req: &Request,
    ) -> LimitKey {
        if self.slots.capacity() == 0 {
            return key(prefix, policy, limit, caller, req);
        }
        // Everything the key depends on besides the config (the tag is the tenant, one of the
        // selected values, or the policy), length-prefixed so that no two requests with
        // different inputs have the same bytes; written on the stack, copied only into a slot.
        let mut input = MemoInput::default();
        for n in [policy_index, limit_index] {
            input.push(&(n as u64).to_le_bytes());
        }
        for value in limit.by.iter().map(|sel| selector_value(sel, caller, req)) {
            match value {
                Some(v) => {
                    input.push(&[1]);
                    input.push(&(v.len() as u64).to_le_bytes());
                    input.push(v.as_bytes());
                }
                None => input.push(&[0]),
            }
        }
        let Some(input) = input.bytes() else {
            return key(prefix, policy, limit, caller, req);
        };
        // FNV-1a: the slot only needs spreading (the inputs are compared in full), and
        // SipHash costs more than the rest of the lookup.
        let hash = input.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let found = self.slots.update(hash, |slot| match slot {
            Some(memo) if memo.input == input => memo.key.clone(),
            _ => {
                let built = key(prefix, policy, limit, caller, req);
                *slot = Some(Memo {
                    input: input.to_vec(),
                    key: built.clone(),
                });
                built
            }
        });
        found.unwrap_or_else(|| key(prefix, policy, limit, caller, req))
    }
}

/// A memo lookup's inputs, at most [`MAX_MEMO_INPUT`] bytes (longer ones are not memoised).
struct MemoInput {
    bytes: [u8; MAX_MEMO_INPUT],
    len: usize,
    too_long: bool,
}

impl Default for MemoInput {
    fn default() -> MemoInput {
        MemoInput {
            bytes: [0; MAX_MEMO_INPUT],
            len: 0,
            too_long: false,
        }
    }
}

impl MemoInput {
    fn push(&mut self, more: &[u8]) {
        let end = self.len + more.len();
        match self.bytes.get_mut(self.len..end) {
            Some(room) if !self.too_long => {
                room.copy_from_slice(more);
                self.len = end;
            }
            _ => self.too_long = true,
        }
    }

    /// The inputs, unless they were too long to memoise.
    fn bytes(&self) -> Option<&[u8]> {
        if self.too_long {
            return None;
        }
        self.bytes.get(..self.len)
    }
}

fn view<'a>((l, s): &(&'a RateLimit, &LimitState)) -> QuotaView<'a> {
    QuotaView {
        limit: l,
        quota: s.quota,
        remaining: s.remaining,
        reset_ms: s.reset_ms,
    }
}

/// The request's verdict once every group answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Forward; add these `(name, value)` headers to the response if configured.
    Allow(Vec<(String, String)>),
    Reject(LocalResponse),
}

/// Decides from every limit's state (`states[i]` for `policy.rate_limits[i]`).
/// Rejected when any non-shadow limit rejected. `types` is the configuration's
/// `problem_type_base`.
/// `None` is a limit whose state is unknown (the over-limit cache answered for another one):
/// it is left out of the headers.
///
/// An admitted request's headers show every enforced limit, the most restrictive (least
/// remaining) first; concurrency limits too, with `qu="concurrent-requests"` and no `t`. A
/// `429` shows the limits it violated, and only those: each one's `t` is at most its own wait,
/// so none is later than `Retry-After` (the longest wait), as the draft asks, and the names of
/// `violated-policies` are those of the `RateLimit-Policy` items. A request only concurrency
/// limits reject is answered `concurrency_limited` (`Retry-After: 1`).
pub(crate) fn decide(policy: &Policy, states: &[Option<LimitState>], types: &str) -> Verdict {
    // Walked again where needed rather than collected: this runs for every request.
    let enforced = || {
        policy
            .rate_limits
            .iter()
            .zip(states)
            .filter_map(|(l, s)| Some((l, s.as_ref()?)))
            .filter(|(l, _)| !l.shadow)
    };
    let violated = || enforced().filter(|(_, s)| !s.allowed);
    if violated().next().is_none() {
        let mut each = enforced();
        let (p, r) = match (each.next(), each.next()) {
            (None, _) => return Verdict::Allow(Vec::new()),
            // The usual policy counts one limit: no list to sort.
            (Some(one), None) => local_reply::ratelimit_headers(&[view(&one)], None),
            _ => {
                let mut views: Vec<QuotaView<'_>> = enforced().map(|e| view(&e)).collect();
                views.sort_by_key(|v| v.remaining);
                local_reply::ratelimit_headers(&views, None)
            }
        };
        return Verdict::Allow(vec![
            ("ratelimit-policy".into(), p),
            ("ratelimit".into(), r),
        ]);
    }
    let names: Vec<&str> = violated().map(|(l, _)| l.name.as_str()).collect();
    let views: Vec<QuotaView<'_>> = violated().map(|e| view(&e)).collect();
    if violated().all(|(l, _)| l.concurrency()) {
        let (p, r) = local_reply::ratelimit_headers(&views, Some(1));
        return Verdict::Reject(concurrency_limited(policy, &names, types, p, r));
    }
    let retry_ms = violated()
        .map(|(_, s)| s.retry_after_ms)
        .max()
        .unwrap_or(1000);
    let retry_after = local_reply::whole_secs(retry_ms);
    let (p, r) = local_reply::ratelimit_headers(&views, Some(retry_after));
    let mut detail = String::with_capacity(96);
    detail.push_str("rate limit ");
    push_names(&mut detail, &names);
    detail.push_str(" of operation \"");
    detail.push_str(&policy.name);
    detail.push_str("\" exceeded; retry after ");
    push_u64(&mut detail, retry_after);
    detail.push_str(" s");
    let mut retry_after_value = String::with_capacity(8);
    push_u64(&mut retry_after_value, retry_after);
    Verdict::Reject(local_reply::problem(
        types,
        Problem::RateLimited,
        &detail,
        &[("violated-policies", Member::Strs(&names))],
        vec![
            ("retry-after".into(), retry_after_value),
            ("ratelimit-policy".into(), p),
            ("ratelimit".into(), r),
        ],
    ))
}

/// The `429` of a full concurrency limit: a slot frees when a request ends, so retry soon.
fn concurrency_limited(
    policy: &Policy,
    names: &[&str],
    types: &str,
    ratelimit_policy: String,
    ratelimit: String,
) -> LocalResponse {
    let mut detail = String::with_capacity(96);
    detail.push_str("concurrency limit ");
    push_names(&mut detail, names);
    detail.push_str(" of operation \"");
    detail.push_str(&policy.name);
    detail.push_str("\" is full (too many requests in flight); retry after 1 s");
    local_reply::problem(
        types,
        Problem::ConcurrencyLimited,
        &detail,
        &[("violated-policies", Member::Strs(names))],
        vec![
            ("retry-after".into(), "1".into()),
            ("ratelimit-policy".into(), ratelimit_policy),
            ("ratelimit".into(), ratelimit),
        ],
    )
}

/// The over-limit cache's last 429 per policy. Such a 429 depends on the policy, on which of
/// its limits the cache knows to reject, on each one's wait in whole seconds (its
/// `RateLimit` reset, and the largest as `Retry-After`) and on the quota each was counted
/// with (a tenant's own shows in `RateLimit-Policy`), so the requests of a rejected tenant
/// within one second get the same answer: written once, copied after.
pub(crate) struct RejectionMemo {
    last: RefCell<Vec<Option<Rejection>>>,
}

/// What the over-limit cache knows of a limit that rejects: for how long still, and the
/// tenant's own quota it was counted with (`None`: the configuration's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Known {
    /// Never 0.
    pub(crate) wait_ms: u64,
    pub(crate) quota: Option<Quota>,
}

/// A memoised 429 and, per limit, the wait in whole seconds (0: unknown) and the quota it was
/// written for.
struct Rejection {
    known: Vec<(u64, Option<Quota>)>,
    response: Rc<LocalResponse>,
}

impl RejectionMemo {
    /// A memo for `policies` policies (one answer each).
    pub(crate) fn new(policies: usize) -> RejectionMemo {
        RejectionMemo {
            last: RefCell::new((0..policies).map(|_| None).collect()),
        }
    }

    /// The verdict on a request of policy `index` whose limits the over-limit cache knows:
    /// `waits[i]` is what it knows of limit `i` (`None`: not known to reject; a known wait is
    /// never 0). Each known limit rejects with nothing remaining until its wait ends. `None` if
    /// that admits (no limit known to reject is enforced).
    pub(crate) fn cached(
        &self,
        index: usize,
        policy: &Policy,
        waits: &[Option<Known>],
        types: &str,
    ) -> Option<Rc<LocalResponse>> {
        let key = |w: &Option<Known>| {
            w.map_or((0, None), |k| (local_reply::whole_secs(k.wait_ms), k.quota))
        };
        let written = || match decide(policy, &rejecting(waits), types) {
            Verdict::Reject(response) => Some(Rc::new(response)),
            Verdict::Allow(_) => None,
        };
        let Ok(mut last) = self.last.try_borrow_mut() else {
            return written();
        };
        let Some(slot) = last.get_mut(index) else {
            return written();
        };
        if let Some(r) = slot.as_ref() {
            if r.known.len() == waits.len() && r.known.iter().zip(waits).all(|(k, w)| *k == key(w))
            {
                return Some(Rc::clone(&r.response));
            }
        }
        let response = written()?;
        *slot = Some(Rejection {
            known: waits.iter().map(key).collect(),
            response: Rc::clone(&response),
        });
        Some(response)
    }
}

/// The states of limits known to reject (see [`RejectionMemo::cached`]).
fn rejecting(waits: &[Option<Known>]) -> Vec<Option<LimitState>> {
    waits
        .iter()
        .map(|w| {
            w.map(|k| LimitState {
                allowed: false,
                remaining: 0,
                reset_ms: k.wait_ms,
                retry_after_ms: k.wait_ms,
                quota: k.quota,
                override_unreadable: false,
            })
        })
        .collect()
}

/// `"a", "b"`
fn push_names(out: &mut String, names: &[&str]) {
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push('"');
        out.push_str(n);
        out.push('"');
    }
}

#[cfg(test)]
pub(crate) mod tests;
