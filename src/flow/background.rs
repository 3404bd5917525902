//! Calls the root context sends on a request's behalf because they must outlive it or must
//! not hold it: async completion, releasing a record the request will not use, releasing and
//! extending leases.

use super::{Purpose, Runtime};
use crate::metrics::{IdemMetrics, LeaseMetrics, MetricSink};
use crate::redis::{is_noscript, resp::Reply, CallError, ScriptCall, ScriptId};

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
        }
    }

    /// A call whose "not ours" answer is expected (see [`Background::certain`]).
    pub fn uncertain(mut self) -> Background {
        self.certain = false;
        self
    }

    fn script(&self) -> ScriptId {
        match self.purpose {
            Purpose::Release => ScriptId::Release,
            Purpose::Complete => ScriptId::Complete,
            Purpose::Acquire | Purpose::LeaseRetry => ScriptId::Acquire,
            Purpose::LeaseRelease => ScriptId::LeaseRelease,
            Purpose::LeaseExtend => ScriptId::LeaseExtend,
        }
    }

    /// The gateway request body.
    pub fn encode(&mut self, rt: &Runtime, now_ms: u64) -> Vec<u8> {
        self.sent_ms = now_ms;
        self.call.encode(rt.scripts.get(self.script()), self.by_sha)
    }

    /// Handles the answer; `true` means send it again (by EVAL after `NOSCRIPT`).
    pub fn on_answer(
        &mut self,
        rt: &Runtime,
        answer: Result<Reply, CallError>,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> bool {
        m.record(
            rt.metrics.redis.latency_ms,
            now_ms.saturating_sub(self.sent_ms),
        );
        let Some(policy) = rt.config.policies.get(self.policy) else {
            return false;
        };
        let Some(pm) = rt.metrics.policies.get(self.policy) else {
            return false;
        };
        let lease = matches!(self.purpose, Purpose::LeaseRelease | Purpose::LeaseExtend);
        match answer {
            Ok(reply) if is_noscript(&reply) && self.by_sha => {
                m.increment(rt.metrics.redis.noscript);
                self.by_sha = false;
                true
            }
            Ok(reply) if !self.certain && matches!(reply.as_int(), Some(0 | -1)) => {
                log::debug!(
                    "policy {}: nothing of this request's to settle ({:?})",
                    policy.name,
                    self.purpose
                );
                false
            }
            Ok(reply) => {
                if let (true, Some(lm)) = (lease, pm.lease.as_ref()) {
                    count_lease(lm, self.purpose, &reply, &policy.name, m);
                } else if let Some(im) = pm.idem.as_ref() {
                    count_settlement(im, self.purpose, &reply, &policy.name, &self.key_hash, m);
                }
                false
            }
            Err(e) => {
                m.increment(if e == CallError::Timeout {
                    rt.metrics.redis.timeouts
                } else {
                    rt.metrics.redis.errors
                });
                match pm.idem.as_ref().filter(|_| !lease) {
                    Some(im) => {
                        m.increment(im.complete_failed);
                        log::warn!(
                            "idempotency record of policy {} key {} not settled ({}); it expires at its processing TTL",
                            policy.name,
                            self.key_hash,
                            e.describe()
                        );
                    }
                    None => log::warn!(
                        "lease of policy {} not {} ({}); it expires at its TTL",
                        policy.name,
                        if self.purpose == Purpose::LeaseExtend {
                            "extended"
                        } else {
                            "released"
                        },
                        e.describe()
                    ),
                }
                false
            }
        }
    }
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
    match (purpose, reply.as_int()) {
        (Purpose::LeaseRelease, Some(1)) => m.increment(lm.released),
        (Purpose::LeaseExtend, Some(1)) => m.increment(lm.extended),
        (_, Some(0 | -1)) => {
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
    match (purpose, reply.as_int()) {
        (Purpose::Complete, Some(1)) => m.increment(im.completed),
        (Purpose::Release, Some(1)) => m.increment(im.released),
        (_, Some(0 | -1)) => {
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
