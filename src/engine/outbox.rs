//! Calls the root context sends on a request's behalf because they must outlive it or must
//! not hold it: async completion, releasing a record the request will not use, releasing and
//! extending leases.
//!
//! Releases are retried: a release that fails in a way that may not have reached Redis (a
//! timeout, a lost or refused gateway connection) is sent again, with backoff
//! ([`RETRY_FIRST_MS`], doubling up to [`RETRY_MAX_BACKOFF_MS`]), at most [`MAX_SENDS`] times
//! and not after [`RETRY_WINDOW_MS`] from the first send. The [`Outbox`] decides when; the
//! root sends what is due on its tick ([`Outbox::take_due`]). Every re-send of a worker draws
//! on one budget ([`RETRY_BUDGET`] at once, [`RETRY_BUDGET_PER_S`] a second after that): a
//! gateway that fails every call is not sent five more of each, and what is not re-sent
//! expires (a lease at its TTL, a record at its processing TTL, a slot at its window).

use crate::engine::calls::{count_failure, Answer, Call, Calls};
use crate::guards::background::Background;
use crate::guards::context::{Cx, Outgoing, Purpose, Runtime};
use crate::guards::idempotency::guard::count_settlement;
use crate::guards::lease::count_lease;
use crate::redis::scripts::record::{outcome, Outcome};
use crate::redis::{resp::Reply, CallError};
use crate::support::lograte::WarnKind;
use crate::support::metrics::MetricSink;

/// The first pause before a release is sent again; it doubles with every attempt.
pub(crate) const RETRY_FIRST_MS: u64 = 100;
/// The largest pause between two sends of a release.
pub(crate) const RETRY_MAX_BACKOFF_MS: u64 = 1600;
/// A release is sent at most this many times (the first send included).
pub(crate) const MAX_SENDS: u32 = 6;
/// No release is sent again later than this after its first send.
pub(crate) const RETRY_WINDOW_MS: u64 = 10_000;
/// Re-sends a worker may make at once (the budget when full)...
pub(crate) const RETRY_BUDGET: u64 = 30;
/// ...and the rate at which its budget fills again.
pub(crate) const RETRY_BUDGET_PER_S: u64 = 10;

/// What the root keeps of a background call while it is queued or in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Tag {
    policy: usize,
    purpose: Purpose,
    key_hash: String,
    certain: bool,
    compensation: bool,
    /// Sent again after a failure that may have reached Redis (see [`earlier_send`]).
    resent: bool,
}

/// What became of a background call's answer.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Settled {
    /// Send this now (by `EVAL`, after `NOSCRIPT`).
    pub(crate) resend: Option<Outgoing>,
    /// The lease this call gave back, or the record it settled: a request of this worker
    /// waiting for it may poll at once.
    pub(crate) freed: Option<String>,
}

/// The root's background calls: queued until due, in flight, retried.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    calls: Calls<Tag>,
    budget: RetryBudget,
}

/// The worker's budget of re-sends: a token bucket of [`RETRY_BUDGET`] re-sends, filled at
/// [`RETRY_BUDGET_PER_S`], full at first. In thousandths of a re-send.
#[derive(Debug, Default)]
struct RetryBudget {
    level: u64,
    /// When `level` was last updated; `None`: never drawn on (full).
    at_ms: Option<u64>,
}

impl RetryBudget {
    /// Draws one re-send at `now_ms`; `false` when the budget is spent.
    fn take(&mut self, now_ms: u64) -> bool {
        let full = RETRY_BUDGET.saturating_mul(1000);
        let level = match self.at_ms {
            None => full,
            Some(at) => self
                .level
                .saturating_add(now_ms.saturating_sub(at).saturating_mul(RETRY_BUDGET_PER_S))
                .min(full),
        };
        self.at_ms = Some(now_ms.max(self.at_ms.unwrap_or(0)));
        let drawn = level >= 1000;
        self.level = if drawn { level - 1000 } else { level };
        drawn
    }
}

/// `due_ms` of a call in flight: not due again until its answer says so.
const IN_FLIGHT: u64 = u64::MAX;

impl Outbox {
    /// Queues a call, to be sent at once.
    pub(crate) fn add(&mut self, bg: Background) {
        let tag = Tag {
            policy: bg.policy,
            purpose: bg.purpose,
            key_hash: bg.key_hash,
            certain: bg.certain,
            compensation: bg.compensation,
            resent: false,
        };
        self.calls.push(tag, bg.purpose.script(), bg.call);
    }

    /// The calls due at `now_ms`, in order, to send now; retries waiting for their backoff
    /// stay.
    pub(crate) fn take_due(&mut self, now_ms: u64) -> Vec<Outgoing> {
        let mut out = Vec::new();
        for slot in self.calls.due(now_ms) {
            if let Some(c) = self.calls.get_mut(slot) {
                c.due_ms = IN_FLIGHT;
            }
            out.extend(self.calls.send(slot, now_ms));
        }
        out
    }

    #[cfg(test)]
    /// When the next queued call is due (a retry waiting for its backoff).
    pub(crate) fn next_due_ms(&self) -> Option<u64> {
        self.calls
            .open()
            .map(|c| c.due_ms)
            .filter(|&d| d != IN_FLIGHT)
            .min()
    }

    #[cfg(test)]
    /// Calls queued or in flight.
    pub(crate) fn len(&self) -> usize {
        self.calls.iter().count()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Handles the answer (or a failure to send) of the call in `slot`.
    pub(crate) fn on_answer(
        &mut self,
        cx: &Cx<'_>,
        slot: usize,
        answer: Result<Reply, CallError>,
    ) -> Settled {
        let (tag, reply, attempts, first_ms) = match self.calls.answer(cx, slot, answer) {
            Answer::Unknown => return Settled::default(),
            Answer::Resend(out) => {
                return Settled {
                    resend: Some(out),
                    freed: None,
                }
            }
            Answer::Reply(c, reply) => (c.tag.clone(), reply, c.attempts, c.first_ms),
        };
        let reply = reply.map(|r| earlier_send(&tag, r));
        let freed = freed(&tag, &reply, self.calls.get(slot));
        let retry_at = match reply {
            Ok(reply) => {
                settled(cx.rt, &tag, &reply, cx.m);
                None
            }
            Err(e) => failed(cx, &tag, &e, (attempts, first_ms), &mut self.budget),
        };
        match (retry_at, self.calls.get_mut(slot)) {
            (Some(at), Some(c)) => {
                c.due_ms = at;
                c.tag.resent = true;
            }
            _ => {
                self.calls.remove(slot);
            }
        }
        Settled {
            resend: None,
            freed,
        }
    }
}

/// A release sent again finds nothing of its owner's (`0` gone, `-1` another owner's) when
/// the send before it, whose answer was lost (a timeout), released it: that is the likely
/// case, so such an answer counts as released, not as a lost lease or a stale owner. A
/// release not sent again, or a call whose "not ours" answer is expected anyway
/// ([`Background::certain`]), is read as it is.
fn earlier_send(tag: &Tag, reply: Reply) -> Reply {
    let release = matches!(tag.purpose, Purpose::Release | Purpose::LeaseRelease);
    if tag.resent && tag.certain && release && outcome(&reply) == Outcome::NotOurs {
        log::debug!(
            "{:?} sent again found nothing of its owner's: an earlier send released it",
            tag.purpose
        );
        Reply::Int(1)
    } else {
        reply
    }
}

/// The lease a release gave back, or the record a completion or release settled, if its
/// answer says it did.
fn freed(tag: &Tag, answer: &Result<Reply, CallError>, call: Option<&Call<Tag>>) -> Option<String> {
    let settles = matches!(
        tag.purpose,
        Purpose::LeaseRelease | Purpose::Complete | Purpose::Release
    );
    let freed = settles && matches!(answer, Ok(r) if outcome(r) == Outcome::Done);
    freed
        .then(|| call?.call.keys.first().map(str::to_string))
        .flatten()
}

/// Counts a background call's answer.
fn settled(rt: &Runtime, tag: &Tag, reply: &Reply, m: &dyn MetricSink) {
    let (Some(policy), Some(pm)) = (
        rt.config.policies.get(tag.policy),
        rt.metrics.policies.get(tag.policy),
    ) else {
        return;
    };
    let lease = matches!(tag.purpose, Purpose::LeaseRelease | Purpose::LeaseExtend);
    if let Some(what) = quota_call(tag.purpose) {
        // A slot already gone (expired, or never taken by a late acquire) is not an error:
        // the slot's window bounds it; a charge's reply is what it moved.
        if matches!(reply, Reply::Error(_)) {
            log::warn!("policy {}: {what} failed: {reply:?}", policy.name);
        }
    } else if !tag.certain && matches!(reply.as_int(), Some(0 | -1)) {
        log::debug!(
            "policy {}: nothing of this request's to settle ({:?})",
            policy.name,
            tag.purpose
        );
    } else if tag.compensation && reply.as_int() == Some(1) {
        log::debug!(
            "policy {}: a late acquire was undone ({:?})",
            policy.name,
            tag.purpose
        );
    } else if let (true, Some(lm)) = (lease, pm.lease.as_ref()) {
        count_lease(lm, tag.purpose, reply, &policy.name, m);
    } else if let Some(im) = pm.record.as_ref() {
        count_settlement(im, tag.purpose, reply, &policy.name, &tag.key_hash, m);
    }
}

/// What a concurrency-slot or charge call does, for logs; `None` for the other calls.
fn quota_call(purpose: Purpose) -> Option<&'static str> {
    match purpose {
        Purpose::SlotRelease => Some("giving back a concurrency slot"),
        Purpose::SlotExtend => Some("extending a concurrency slot"),
        Purpose::Charge => Some("charging a response's cost"),
        _ => None,
    }
}

/// After a failed send (`sends`: how many so far, and when the first was): when to send it
/// again, if at all and if the worker's budget allows (see the module's rustdoc); when given
/// up, the warning that it is.
fn failed(
    cx: &Cx<'_>,
    tag: &Tag,
    e: &CallError,
    (attempts, first_ms): (u32, Option<u64>),
    budget: &mut RetryBudget,
) -> Option<u64> {
    let (rt, now_ms, m) = (cx.rt, cx.now_ms, cx.m);
    count_failure(rt, e, m);
    if *e == CallError::OverBudget {
        // It ran in Redis; only its answer was not read (it shared a batch with a large one
        // the worker could not hold): nothing to send again, nothing failed.
        rt.warnings
            .warn(WarnKind::MemoryBudget, tag.policy, now_ms, || {
                format!(
                    "a {:?} call's answer was not read (it came with one larger than this \
                     worker's memory budget can hold now); it ran in Redis",
                    tag.purpose
                )
            });
        return None;
    }
    let mut dropped = false;
    if let Some(at) = retry_at(tag.purpose, e, attempts, first_ms, now_ms) {
        if budget.take(now_ms) {
            m.increment(rt.metrics.redis.retries);
            return Some(at);
        }
        m.increment(rt.metrics.redis.retries_dropped);
        dropped = true;
    }
    let (Some(policy), Some(pm)) = (
        rt.config.policies.get(tag.policy),
        rt.metrics.policies.get(tag.policy),
    ) else {
        return None;
    };
    let tries = match (attempts > 1, dropped) {
        (_, true) => format!(", {attempts} sent, the worker's retry budget spent"),
        (true, false) => format!(", {attempts} attempts"),
        (false, false) => String::new(),
    };
    let lease = matches!(tag.purpose, Purpose::LeaseRelease | Purpose::LeaseExtend);
    if let Some(what) = quota_call(tag.purpose) {
        rt.warnings
            .warn(WarnKind::QuotaNotSettled, tag.policy, now_ms, || {
                format!(
                    "policy {}: {what} failed ({}{tries}); a slot expires at its window, a \
                     charge is lost",
                    policy.name,
                    e.describe()
                )
            });
        return None;
    }
    match pm.record.as_ref().filter(|_| !lease) {
        Some(im) => {
            // Only sent for a record that exists or may exist.
            m.increment(im.complete_failed);
            rt.warnings.warn(WarnKind::RecordNotSettled, tag.policy, now_ms, || {
                format!(
                    "idempotency record of policy {} key {} not settled ({}{tries}); it expires at its processing TTL",
                    policy.name,
                    tag.key_hash,
                    e.describe()
                )
            });
        }
        None => rt
            .warnings
            .warn(WarnKind::LeaseNotSettled, tag.policy, now_ms, || {
                format!(
                    "lease of policy {} not {} ({}{tries}); it expires at its TTL",
                    policy.name,
                    if tag.purpose == Purpose::LeaseExtend {
                        "extended"
                    } else {
                        "released"
                    },
                    e.describe()
                )
            }),
    }
    None
}

/// Only releases are retried (they are idempotent: compare-and-delete by owner, the marker
/// set again), only after failures that may not have reached Redis, bounded in count and time.
fn retry_at(
    purpose: Purpose,
    err: &CallError,
    attempts: u32,
    first_ms: Option<u64>,
    now_ms: u64,
) -> Option<u64> {
    if !matches!(
        purpose,
        Purpose::Release | Purpose::LeaseRelease | Purpose::SlotRelease
    ) || !err.retryable()
        || attempts >= MAX_SENDS
    {
        return None;
    }
    let shift = attempts.saturating_sub(1).min(16);
    let backoff = (RETRY_FIRST_MS << shift).min(RETRY_MAX_BACKOFF_MS);
    let at = now_ms.saturating_add(backoff);
    let first = first_ms.unwrap_or(now_ms);
    (at <= first.saturating_add(RETRY_WINDOW_MS)).then_some(at)
}
