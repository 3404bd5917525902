//! Calls the root context sends on a request's behalf because they must outlive it or must
//! not hold it: async completion, and releasing a record the request will not use.

use super::{Purpose, Runtime};
use crate::metrics::{IdemMetrics, MetricSink};
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
        }
    }

    fn script(&self) -> ScriptId {
        match self.purpose {
            Purpose::Release => ScriptId::Release,
            Purpose::Complete => ScriptId::Complete,
            Purpose::Acquire => ScriptId::Acquire,
        }
    }

    /// The gateway request body; counts the call.
    pub fn encode(&mut self, rt: &Runtime, now_ms: u64, m: &dyn MetricSink) -> Vec<u8> {
        m.increment(rt.metrics.redis.calls);
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
        let Some(im) = rt
            .metrics
            .policies
            .get(self.policy)
            .and_then(|p| p.idem.as_ref())
        else {
            return false;
        };
        match answer {
            Ok(reply) if is_noscript(&reply) && self.by_sha => {
                m.increment(rt.metrics.redis.noscript);
                self.by_sha = false;
                true
            }
            Ok(reply) => {
                count_settlement(im, self.purpose, &reply, &policy.name, &self.key_hash, m);
                false
            }
            Err(e) => {
                m.increment(rt.metrics.redis.errors);
                m.increment(im.complete_failed);
                log::warn!(
                    "idempotency record of policy {} key {} not settled ({}); it expires at its processing TTL",
                    policy.name,
                    self.key_hash,
                    e.describe()
                );
                false
            }
        }
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
