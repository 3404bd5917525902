//! What every event of the flow brings, and the calls it makes: the VM's [`Runtime`], the
//! event's context ([`Cx`], and [`Pcx`] for the request's policy), why a call was made
//! ([`Purpose`]) and a call to send ([`Outgoing`]). The guards and the call tables read these
//! and nothing else of the flow, so the module graph only runs down. (What an event answers,
//! its step, is the flow's own: see `flow/step.rs`.)

use crate::config::{Config, Policy};
use crate::guards::ratelimit::leased::{LeasedQuota, QUOTA_SLOTS};
use crate::guards::ratelimit::overlimit::{OverLimitCache, SharedStore};
use crate::guards::ratelimit::{KeyMemo, RejectionMemo, KEY_MEMO_SLOTS};
use crate::redis::scripts::{ScriptId, Scripts};
use crate::redis::tag::{CallTag, CallTags};
use crate::redis::ScriptCall;
use crate::support::lograte::Warnings;
use crate::support::memory::Budget;
use crate::support::metrics::{MetricSink, Metrics, PolicyMetrics};
use std::rc::Rc;

/// Everything a VM keeps after `on_configure`.
pub struct Runtime {
    pub config: Config,
    pub scripts: Scripts,
    pub(crate) metrics: Metrics,
    pub(crate) over_limit: OverLimitCache,
    pub(crate) quota: LeasedQuota,
    pub(crate) keys: KeyMemo,
    /// The over-limit cache's last 429 per policy.
    pub(crate) rejections: RejectionMemo,
    /// Request headers only the filter may set (the fingerprint, every lease's fencing
    /// header): removed from every request the filter sees, guarded or not, so a client can
    /// never hand the service a value of its own.
    pub(crate) reserved_headers: std::rc::Rc<[String]>,
    /// This worker's rate limiter of repeated warnings.
    pub(crate) warnings: Warnings,
    /// This worker's memory budget.
    pub(crate) memory: Budget,
    /// This worker's call tags: each call sent gets the next.
    pub(crate) tags: CallTags,
}

impl Runtime {
    /// `shared` mirrors the over-limit cache across the proxy's workers.
    pub fn new(config: Config, metrics: Metrics, shared: Option<Box<dyn SharedStore>>) -> Runtime {
        let over_limit = OverLimitCache::new(config.over_limit_cache_entries, shared);
        let mut reserved_headers = vec![FINGERPRINT_HEADER.to_string()];
        for lease in config.policies.iter().filter_map(|p| p.lease.as_ref()) {
            if !reserved_headers.contains(&lease.fencing_header) {
                reserved_headers.push(lease.fencing_header.clone());
            }
        }
        let rejections = RejectionMemo::new(config.policies.len());
        let memory = Budget::new(config.memory_budget);
        Runtime {
            reserved_headers: reserved_headers.into(),
            config,
            scripts: Scripts::load(),
            metrics,
            over_limit,
            quota: LeasedQuota::new(QUOTA_SLOTS),
            keys: KeyMemo::new(KEY_MEMO_SLOTS),
            rejections,
            memory,
            warnings: Warnings::default(),
            tags: CallTags::from_entropy(),
        }
    }

    /// The benchmarks' runtime, for the unit tests: one policy on `/api` that limits each
    /// tenant to a billion requests an hour in `mode` (`exact` or `leased`), with no host
    /// behind its metrics. Its configuration is `benches/per_tenant.json` (`MODE` stands for
    /// the mode), which the core benchmark reads too, so the allocation tests and the
    /// benchmark measure the same request.
    #[cfg(test)]
    pub(crate) fn per_tenant_benchmark(mode: &str) -> Result<Runtime, crate::config::ConfigError> {
        let json = include_str!("../../benches/per_tenant.json").replace("MODE", mode);
        let config = Config::parse(json.as_bytes())?;
        let metrics = Metrics::define(&config, |_, _| 0);
        Ok(Runtime::new(config, metrics, None))
    }
}

/// The header that carries the request fingerprint to the upstream.
pub const FINGERPRINT_HEADER: &str = "x-idempotency-fingerprint";

/// How long the filter waits for the next piece of a request body it must fingerprint.
pub const BODY_IDLE_TIMEOUT_MS: u64 = 10_000;

/// The least TTL of a cancellation marker (see [`Flow::marker_ttl_ms`]): longer than the
/// whole retry window of a release, so every retry finds the marker of the ones before.
pub const MARKER_MIN_TTL_MS: u64 = 60_000;

/// What every event brings: the VM's runtime, the time, where metrics go.
#[derive(Clone, Copy)]
pub struct Cx<'a> {
    pub rt: &'a Runtime,
    pub(crate) now_ms: u64,
    pub(crate) m: &'a dyn MetricSink,
}

impl<'a> Cx<'a> {
    pub fn new(rt: &'a Runtime, now_ms: u64, m: &'a dyn MetricSink) -> Cx<'a> {
        Cx { rt, now_ms, m }
    }
}

/// An event's context for the request's policy: what the guards read.
#[derive(Clone, Copy)]
pub struct Pcx<'a> {
    pub rt: &'a Runtime,
    pub(crate) now_ms: u64,
    pub(crate) m: &'a dyn MetricSink,
    pub(crate) index: usize,
    pub(crate) policy: &'a Policy,
    pub(crate) pm: &'a PolicyMetrics,
}

impl<'a> Pcx<'a> {
    /// The event's context, without the policy.
    pub(crate) fn cx(&self) -> Cx<'a> {
        Cx::new(self.rt, self.now_ms, self.m)
    }

    /// When a call sent now has timed out.
    pub(crate) fn call_deadline(&self) -> u64 {
        self.now_ms.saturating_add(self.rt.config.redis.timeout_ms)
    }
}

/// Why a call was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Acquire,
    /// A lease-only acquire while waiting for a busy lease.
    LeaseRetry,
    /// A record-only acquire while waiting for a duplicate still in progress.
    RecordRetry,
    Complete,
    Release,
    LeaseRelease,
    LeaseExtend,
    /// A concurrency slot given back, or kept alive.
    SlotRelease,
    SlotExtend,
    /// Counters corrected by the response's charge.
    Charge,
}

impl Purpose {
    /// The script a call of this purpose runs.
    pub(crate) fn script(self) -> ScriptId {
        match self {
            Purpose::Acquire | Purpose::LeaseRetry | Purpose::RecordRetry => ScriptId::Acquire,
            Purpose::Complete => ScriptId::Complete,
            Purpose::Release => ScriptId::Release,
            Purpose::LeaseRelease => ScriptId::LeaseRelease,
            Purpose::LeaseExtend => ScriptId::LeaseExtend,
            Purpose::SlotRelease => ScriptId::SlotRelease,
            Purpose::SlotExtend => ScriptId::SlotExtend,
            Purpose::Charge => ScriptId::Charge,
        }
    }
}

/// One gateway request to send: `slot` comes back with the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub slot: usize,
    pub(crate) script: ScriptId,
    /// The call as its table keeps it (shared, not copied).
    pub(crate) call: Rc<ScriptCall>,
    /// `EVALSHA` (else `EVAL` with the source, after `NOSCRIPT`).
    pub(crate) by_sha: bool,
}

impl Outgoing {
    /// The gateway request body, sent with `tag`.
    pub fn encode(&self, scripts: &Scripts, tag: &CallTag) -> Vec<u8> {
        self.call.encode(scripts.get(self.script), self.by_sha, tag)
    }
}
