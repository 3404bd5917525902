//! Calls the root context sends on a request's behalf because they must outlive it or must
//! not hold it: async completion, releasing a record the request will not use, releasing and
//! extending leases.
//!
//! Releases are retried: a release that fails in a way that may not have reached Redis (a
//! timeout, a lost or refused gateway connection) is sent again, with backoff
//! ([`RETRY_FIRST_MS`], doubling up to [`RETRY_MAX_BACKOFF_MS`]), at most [`MAX_SENDS`] times
//! and not after [`RETRY_WINDOW_MS`] from the first send. The core decides when
//! ([`Background::due_ms`]); the root sends what is due on its tick ([`take_due`]).

use super::{Purpose, Runtime};
use crate::lograte::WarnKind;
use crate::lua::record::{outcome, Outcome};
use crate::metrics::{IdemMetrics, LeaseMetrics, MetricSink};
use crate::redis::{resend_by_eval, resp::Reply, CallError, ScriptCall};

/// The first pause before a release is sent again; it doubles with every attempt.
pub const RETRY_FIRST_MS: u64 = 100;
/// The largest pause between two sends of a release.
pub const RETRY_MAX_BACKOFF_MS: u64 = 1600;
/// A release is sent at most this many times (the first send included).
pub const MAX_SENDS: u32 = 6;
/// No release is sent again later than this after its first send.
pub const RETRY_WINDOW_MS: u64 = 10_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Background {
    pub policy: usize,
    pub purpose: Purpose,
    pub call: ScriptCall,
    /// Hash of the client's key, for logs.
    pub key_hash: String,
    by_sha: bool,
    pub sent_ms: u64,
    /// False when the request may not own what this call gives back (a release sent while
    /// its acquire was still in flight, or a call sent again after the stream ended): then
    /// "not ours" is the expected answer, not a stale owner or a lost lease.
    pub certain: bool,
    /// Gives back what an acquire the request gave up on may have taken (the call carries the
    /// owner's cancellation marker): "released" then is a late acquire undone, not a release
    /// of something the request knew it held, and is not counted as one.
    pub compensation: bool,
    /// Sends so far.
    pub attempts: u32,
    /// When it was first sent.
    pub first_ms: Option<u64>,
    /// Not to be sent before this time (a retry's backoff); 0 for at once.
    pub due_ms: u64,
}

/// What the root does with a background call after its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Settled (or given up): drop it.
    Done,
    /// Send it again now (by `EVAL`, after `NOSCRIPT`).
    Resend,
    /// Keep it and send it again at [`Background::due_ms`].
    Retry,
}

impl Background {
    pub fn new(policy: usize, purpose: Purpose, call: ScriptCall, key_hash: String) -> Background {
        Background {
            policy,
            purpose,
            call,
            key_hash,
            by_sha: true,
            sent_ms: 0,
            certain: true,
            compensation: false,
            attempts: 0,
            first_ms: None,
            due_ms: 0,
        }
    }

    /// A call whose "not ours" answer is expected (see [`Background::certain`]).
    pub fn uncertain(mut self) -> Background {
        self.certain = false;
        self
    }

    /// A release of what a late acquire may have taken (see [`Background::compensation`]).
    pub fn compensation(mut self) -> Background {
        self.certain = false;
        self.compensation = true;
        self
    }

    /// The gateway request body; counts the send.
    pub fn encode(&mut self, rt: &Runtime, now_ms: u64) -> Vec<u8> {
        self.sent_ms = now_ms;
        self.attempts = self.attempts.saturating_add(1);
        self.first_ms.get_or_insert(now_ms);
        self.call
            .encode(rt.scripts.get(self.purpose.script()), self.by_sha)
    }

    /// After a failed send: when to send it again, if at all. Only releases are retried
    /// (they are idempotent: compare-and-delete by owner, the marker set again), only after
    /// failures that may not have reached Redis, bounded in count and time.
    fn retry_at(&self, err: &CallError, now_ms: u64) -> Option<u64> {
        if !matches!(self.purpose, Purpose::Release | Purpose::LeaseRelease)
            || !err.retryable()
            || self.attempts >= MAX_SENDS
        {
            return None;
        }
        let shift = self.attempts.saturating_sub(1).min(16);
        let backoff = (RETRY_FIRST_MS << shift).min(RETRY_MAX_BACKOFF_MS);
        let at = now_ms.saturating_add(backoff);
        let first = self.first_ms.unwrap_or(now_ms);
        (at <= first.saturating_add(RETRY_WINDOW_MS)).then_some(at)
    }

    /// The lease this call gave back, if `answer` says it did: a request of this worker
    /// waiting for it may poll at once.
    pub fn freed_lease(&self, answer: &Result<Reply, CallError>) -> Option<&str> {
        let freed = self.purpose == Purpose::LeaseRelease
            && matches!(answer, Ok(r) if outcome(r) == Outcome::Done);
        freed
            .then(|| self.call.keys.first().map(String::as_str))
            .flatten()
    }

    /// Handles the answer (or a failure to send).
    pub fn on_answer(
        &mut self,
        rt: &Runtime,
        answer: Result<Reply, CallError>,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Next {
        m.record(
            rt.metrics.redis.latency_ms,
            now_ms.saturating_sub(self.sent_ms),
        );
        let Some(policy) = rt.config.policies.get(self.policy) else {
            return Next::Done;
        };
        let Some(pm) = rt.metrics.policies.get(self.policy) else {
            return Next::Done;
        };
        let lease = matches!(self.purpose, Purpose::LeaseRelease | Purpose::LeaseExtend);
        if resend_by_eval(&mut self.by_sha, &answer, &rt.metrics.redis, m) {
            return Next::Resend;
        }
        match answer {
            Ok(reply) if !self.certain && matches!(reply.as_int(), Some(0 | -1)) => {
                log::debug!(
                    "policy {}: nothing of this request's to settle ({:?})",
                    policy.name,
                    self.purpose
                );
                Next::Done
            }
            Ok(reply) if self.compensation && reply.as_int() == Some(1) => {
                log::debug!(
                    "policy {}: a late acquire was undone ({:?})",
                    policy.name,
                    self.purpose
                );
                Next::Done
            }
            Ok(reply) => {
                if let (true, Some(lm)) = (lease, pm.lease.as_ref()) {
                    count_lease(lm, self.purpose, &reply, &policy.name, m);
                } else if let Some(im) = pm.idem.as_ref() {
                    count_settlement(im, self.purpose, &reply, &policy.name, &self.key_hash, m);
                }
                Next::Done
            }
            Err(e) => {
                m.increment(if e == CallError::Timeout {
                    rt.metrics.redis.timeouts
                } else {
                    rt.metrics.redis.errors
                });
                if let Some(at) = self.retry_at(&e, now_ms) {
                    m.increment(rt.metrics.redis.retries);
                    self.due_ms = at;
                    return Next::Retry;
                }
                let tries = if self.attempts > 1 {
                    format!(", {} attempts", self.attempts)
                } else {
                    String::new()
                };
                match pm.idem.as_ref().filter(|_| !lease) {
                    Some(im) => {
                        // Only sent for a record that exists or may exist.
                        m.increment(im.complete_failed);
                        let compensation = self.compensation;
                        rt.warnings.warn(WarnKind::RecordNotSettled, self.policy, now_ms, || {
                            if compensation {
                                // The acquire timed out: a record exists only if it ran late.
                                format!(
                                    "policy {} key {}: could not make sure that a late acquire left no record ({}{tries}); if it did, the record expires at its processing TTL",
                                    policy.name,
                                    self.key_hash,
                                    e.describe()
                                )
                            } else {
                                format!(
                                    "idempotency record of policy {} key {} not settled ({}{tries}); it expires at its processing TTL",
                                    policy.name,
                                    self.key_hash,
                                    e.describe()
                                )
                            }
                        });
                    }
                    None => {
                        rt.warnings
                            .warn(WarnKind::LeaseNotSettled, self.policy, now_ms, || {
                                format!(
                                    "lease of policy {} not {} ({}{tries}); it expires at its TTL",
                                    policy.name,
                                    if self.purpose == Purpose::LeaseExtend {
                                        "extended"
                                    } else {
                                        "released"
                                    },
                                    e.describe()
                                )
                            })
                    }
                }
                Next::Done
            }
        }
    }
}

/// Takes the calls of `outbox` that are due at `now_ms`, in order; the rest stay.
pub fn take_due(outbox: &mut Vec<Background>, now_ms: u64) -> Vec<Background> {
    let (due, later): (Vec<Background>, Vec<Background>) = std::mem::take(outbox)
        .into_iter()
        .partition(|b| b.due_ms <= now_ms);
    *outbox = later;
    due
}

/// Counts what a lease release (`1` released) or extension (`1` extended) found; `0` (expired)
/// and `-1` (another owner) mean the lease was lost.
pub fn count_lease(
    lm: &LeaseMetrics,
    purpose: Purpose,
    reply: &Reply,
    policy: &str,
    m: &dyn MetricSink,
) {
    match (purpose, outcome(reply)) {
        (Purpose::LeaseRelease, Outcome::Done) => m.increment(lm.released),
        (Purpose::LeaseExtend, Outcome::Done) => m.increment(lm.extended),
        (_, Outcome::NotOurs) => {
            m.increment(lm.lost);
            log::warn!(
                "policy {policy}: a lease was lost (it expired{}); the upstream's fencing check protects the data",
                if reply.as_int() == Some(-1) { " and another request holds it" } else { "" }
            );
        }
        _ => log::warn!("policy {policy}: unexpected answer to a lease update: {reply:?}"),
    }
}

/// Counts what a complete (`1` written, `0` missing, `-1` not owner) or release (`1`
/// released, `0` missing, `-1` not owner) call found.
pub fn count_settlement(
    im: &IdemMetrics,
    purpose: Purpose,
    reply: &Reply,
    policy: &str,
    key_hash: &str,
    m: &dyn MetricSink,
) {
    match (purpose, outcome(reply)) {
        (Purpose::Complete, Outcome::Done) => m.increment(im.completed),
        (Purpose::Release, Outcome::Done) => m.increment(im.released),
        (_, Outcome::NotOurs) => {
            m.increment(im.stale_owner);
            log::warn!(
                "policy {policy} key {key_hash}: the record is no longer ours (its processing TTL expired); not overwritten"
            );
        }
        _ => {
            m.increment(im.complete_failed);
            log::warn!(
                "policy {policy} key {key_hash}: unexpected answer to a record update: {reply:?}"
            );
        }
    }
}
