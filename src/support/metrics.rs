//! Metric names and ids. Every metric is defined once at configure time from the
//! configuration, so names are bounded by the config: never a tenant, principal or key.
//! [`Metrics::define`] reads the configuration, a layer above this one: it is in
//! `config::metrics`.
//!
//! Names (Envoy shows them as `wasmcustom.<name>`):
//!
//! * `cg.policy.<policy>.limit.<limit>.allowed|rejected|shadow_rejected`, `.charged` (units
//!   charged after responses) and `.charge_unreadable` (responses charged the `unreadable`
//!   fallback) for a limit with `charge`, `.charge_missing` (event streams that ended without
//!   their charge, charged `missing`) for one with a `response_sse_json` charge, and
//!   `.slot_orphaned` for a concurrency limit
//! * `cg.policy.<policy>.failed_open|failed_closed|missing_tenant|ambiguous_input`
//! * `cg.policy.<policy>.idem.acquired|replayed|in_progress|conflict|missing_key|invalid_key|
//!   body_too_large|unreadable|sealed_unreadable|released|completed|complete_failed|stale_owner|
//!   outcome_unknown|waited`
//! * `cg.policy.<policy>.lease.acquired|busy|waited|released|extended|lost|missing_resource|
//!   orphaned`
//! * `cg.redis.calls|errors|timeouts|noscript|retries|retries_dropped|foreign_replies`,
//!   histogram `cg.redis.latency_ms`
//! * `cg.over_limit_cache.hits`
//! * `cg.memory.by_reference|refused`: the worker's memory budget at work (records stored by
//!   reference, requests answered `503 guard_overloaded`)

/// What kind of metric to define.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Histogram,
}

/// Where metric updates go: the host's counters in the VM, a recorder in tests.
pub trait MetricSink {
    fn increment(&self, id: u32);
    /// Adds `n` to a counter.
    fn add(&self, id: u32, n: u64);
    fn record(&self, id: u32, value: u64);
}

/// A sink that drops everything (metric definition failed, or a test that does not care).
pub struct NoMetrics;

impl MetricSink for NoMetrics {
    fn increment(&self, _id: u32) {}
    fn add(&self, _id: u32, _n: u64) {}
    fn record(&self, _id: u32, _value: u64) {}
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LimitMetrics {
    pub(crate) allowed: u32,
    pub(crate) rejected: u32,
    pub(crate) shadow_rejected: u32,
    /// Units charged after responses (limits with `charge`).
    pub(crate) charged: u32,
    /// Slots left held, to expire after the window, by requests whose client left after
    /// they were forwarded and before the response's headers (concurrency limits).
    pub(crate) slot_orphaned: u32,
    /// Responses whose charge could not be read, charged the `unreadable` fallback.
    pub(crate) charge_unreadable: u32,
    /// Event streams that ended (or were cut) before any event carried the charge, charged
    /// `missing` (limits with a `response_sse_json` charge).
    pub(crate) charge_missing: u32,
    /// Requests that found a stored override of the limit unreadable and counted without it
    /// (limits with `overrides`).
    pub(crate) override_unreadable: u32,
}

/// `cg.policy.<policy>.idem.<name>`, defined for policies with `idempotency`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IdempotencyMetrics {
    pub(crate) acquired: u32,
    pub(crate) replayed: u32,
    pub(crate) in_progress: u32,
    pub(crate) conflict: u32,
    pub(crate) missing_key: u32,
    pub(crate) invalid_key: u32,
    pub(crate) body_too_large: u32,
    pub(crate) unreadable: u32,
    /// Sealed responses that did not open (also counted in `unreadable`): an unknown key id,
    /// a tag that does not verify, or no `encryption` to open them with.
    pub(crate) sealed_unreadable: u32,
    pub(crate) released: u32,
    pub(crate) completed: u32,
    pub(crate) complete_failed: u32,
    pub(crate) stale_owner: u32,
    pub(crate) outcome_unknown: u32,
    /// Duplicates that waited for the first request (`in_progress: wait`) and were answered
    /// by its record (replayed, or ran after it was released).
    pub(crate) waited: u32,
}

/// `cg.policy.<policy>.lease.<name>`, defined for policies with `lease`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LeaseMetrics {
    pub(crate) acquired: u32,
    pub(crate) busy: u32,
    pub(crate) waited: u32,
    pub(crate) released: u32,
    pub(crate) extended: u32,
    pub(crate) lost: u32,
    pub(crate) missing_resource: u32,
    /// Leases left held, to expire after their TTL, by requests whose client left after they
    /// were forwarded and before the response's headers (the service may still be working).
    pub(crate) orphaned: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PolicyMetrics {
    pub(crate) failed_open: u32,
    pub(crate) failed_closed: u32,
    pub(crate) missing_tenant: u32,
    /// Requests refused because an input had more than one reading: an ambiguous path, a
    /// repeated principal header or selector input.
    pub(crate) ambiguous_input: u32,
    /// One entry per rate limit, in config order.
    pub(crate) limits: Vec<LimitMetrics>,
    pub(crate) record: Option<IdempotencyMetrics>,
    pub(crate) lease: Option<LeaseMetrics>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RedisMetrics {
    pub calls: u32,
    pub(crate) errors: u32,
    pub(crate) timeouts: u32,
    pub(crate) noscript: u32,
    /// Background calls (releases) sent again after a failure.
    pub(crate) retries: u32,
    /// Releases not sent again after a failure because the worker's retry budget was spent.
    pub(crate) retries_dropped: u32,
    /// Answers that were another call's reply (without the call's tag): each call's outcome
    /// was unknown (also counted in `errors`, once per call, a batch's members each).
    pub(crate) foreign: u32,
    pub(crate) latency_ms: u32,
}

/// `cg.memory.<name>`: what the worker's memory budget refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MemoryMetrics {
    /// Records stored by reference because their body could not be held.
    pub(crate) by_reference: u32,
    /// Requests answered `503 guard_overloaded`: a body to fingerprint or a gateway answer
    /// the budget could not hold.
    pub(crate) refused: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metrics {
    /// One entry per policy, in config order.
    pub(crate) policies: Vec<PolicyMetrics>,
    pub(crate) redis: RedisMetrics,
    /// Requests rejected by the over-limit cache, without a Redis call.
    pub(crate) over_limit_cache_hits: u32,
    pub(crate) memory: MemoryMetrics,
}

#[cfg(test)]
pub(crate) mod testing {
    //! A recording sink for unit tests.
    use super::*;
    use crate::config::Config;
    use std::cell::RefCell;
    use std::collections::BTreeMap;

    #[derive(Default)]
    pub(crate) struct Recorder {
        pub(crate) names: RefCell<Vec<(Kind, String)>>,
        pub(crate) counts: RefCell<BTreeMap<u32, u64>>,
        pub(crate) samples: RefCell<Vec<(u32, u64)>>,
    }

    impl Recorder {
        pub(crate) fn metrics(&self, config: &Config) -> Metrics {
            Metrics::define(config, |kind, name| {
                let mut names = self.names.borrow_mut();
                names.push((kind, name.to_string()));
                u32::try_from(names.len() - 1).unwrap_or(u32::MAX)
            })
        }

        pub(crate) fn count(&self, name: &str) -> u64 {
            let names = self.names.borrow();
            let Some(id) = names.iter().position(|(_, n)| n == name) else {
                panic!("metric {name} not defined");
            };
            let id = u32::try_from(id).unwrap_or(u32::MAX);
            self.counts.borrow().get(&id).copied().unwrap_or(0)
        }
    }

    impl MetricSink for Recorder {
        fn increment(&self, id: u32) {
            *self.counts.borrow_mut().entry(id).or_default() += 1;
        }
        fn add(&self, id: u32, n: u64) {
            *self.counts.borrow_mut().entry(id).or_default() += n;
        }
        fn record(&self, id: u32, value: u64) {
            self.samples.borrow_mut().push((id, value));
        }
    }
}
