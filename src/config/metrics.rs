//! The metrics a configuration defines: the proxy's own, and one set per policy and limit
//! (their names and ids are `support::metrics`'s).

use crate::config::{ChargeSource, Config};
use crate::support::metrics::{
    IdempotencyMetrics, Kind, LeaseMetrics, LimitMetrics, MemoryMetrics, Metrics, PolicyMetrics,
    RedisMetrics,
};

impl Metrics {
    /// Defines every metric through `define(kind, name) -> id`.
    pub fn define(config: &Config, mut define: impl FnMut(Kind, &str) -> u32) -> Metrics {
        let mut counter = |name: String| define(Kind::Counter, &name);
        let policies = config
            .policies
            .iter()
            .map(|p| {
                let base = format!("cg.policy.{}", p.name);
                PolicyMetrics {
                    failed_open: counter(format!("{base}.failed_open")),
                    failed_closed: counter(format!("{base}.failed_closed")),
                    missing_tenant: counter(format!("{base}.missing_tenant")),
                    ambiguous_input: counter(format!("{base}.ambiguous_input")),
                    limits: p
                        .rate_limits
                        .iter()
                        .map(|l| {
                            let lb = format!("{base}.limit.{}", l.name);
                            LimitMetrics {
                                allowed: counter(format!("{lb}.allowed")),
                                rejected: counter(format!("{lb}.rejected")),
                                shadow_rejected: counter(format!("{lb}.shadow_rejected")),
                                charged: if l.charge.is_some() {
                                    counter(format!("{lb}.charged"))
                                } else {
                                    u32::MAX
                                },
                                slot_orphaned: if l.concurrency() {
                                    counter(format!("{lb}.slot_orphaned"))
                                } else {
                                    u32::MAX
                                },
                                charge_unreadable: if l.charge.is_some() {
                                    counter(format!("{lb}.charge_unreadable"))
                                } else {
                                    u32::MAX
                                },
                                charge_missing: if l.charge.as_ref().is_some_and(|c| {
                                    matches!(c.source, ChargeSource::SseJson { .. })
                                }) {
                                    counter(format!("{lb}.charge_missing"))
                                } else {
                                    u32::MAX
                                },
                                override_unreadable: if l.overrides {
                                    counter(format!("{lb}.override_unreadable"))
                                } else {
                                    u32::MAX
                                },
                            }
                        })
                        .collect(),
                    record: p.idempotency.as_ref().map(|_| {
                        let mut c = |n: &str| counter(format!("{base}.idem.{n}"));
                        IdempotencyMetrics {
                            acquired: c("acquired"),
                            replayed: c("replayed"),
                            in_progress: c("in_progress"),
                            conflict: c("conflict"),
                            missing_key: c("missing_key"),
                            invalid_key: c("invalid_key"),
                            body_too_large: c("body_too_large"),
                            unreadable: c("unreadable"),
                            sealed_unreadable: c("sealed_unreadable"),
                            released: c("released"),
                            completed: c("completed"),
                            complete_failed: c("complete_failed"),
                            stale_owner: c("stale_owner"),
                            outcome_unknown: c("outcome_unknown"),
                            waited: c("waited"),
                        }
                    }),
                    lease: p.lease.as_ref().map(|_| {
                        let mut c = |n: &str| counter(format!("{base}.lease.{n}"));
                        LeaseMetrics {
                            acquired: c("acquired"),
                            busy: c("busy"),
                            waited: c("waited"),
                            released: c("released"),
                            extended: c("extended"),
                            lost: c("lost"),
                            missing_resource: c("missing_resource"),
                            orphaned: c("orphaned"),
                        }
                    }),
                }
            })
            .collect();
        let redis = RedisMetrics {
            calls: counter("cg.redis.calls".into()),
            errors: counter("cg.redis.errors".into()),
            timeouts: counter("cg.redis.timeouts".into()),
            noscript: counter("cg.redis.noscript".into()),
            retries: counter("cg.redis.retries".into()),
            retries_dropped: counter("cg.redis.retries_dropped".into()),
            foreign: counter("cg.redis.foreign_replies".into()),
            latency_ms: define(Kind::Histogram, "cg.redis.latency_ms"),
        };
        let over_limit_cache_hits = define(Kind::Counter, "cg.over_limit_cache.hits");
        let memory = MemoryMetrics {
            by_reference: define(Kind::Counter, "cg.memory.by_reference"),
            refused: define(Kind::Counter, "cg.memory.refused"),
        };
        Metrics {
            policies,
            redis,
            over_limit_cache_hits,
            memory,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::support::metrics::testing::Recorder;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn names_are_bounded_by_config() {
        let config = Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "create-order", "rate_limits": [
              {"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1, "window": "1s"}]}]}"#,
        )
        .expect("valid");
        let rec = Recorder::default();
        rec.metrics(&config);
        let names: Vec<String> = rec.names.borrow().iter().map(|(_, n)| n.clone()).collect();
        assert_eq!(
            names,
            vec![
                "cg.policy.create-order.failed_open",
                "cg.policy.create-order.failed_closed",
                "cg.policy.create-order.missing_tenant",
                "cg.policy.create-order.ambiguous_input",
                "cg.policy.create-order.limit.tenant.allowed",
                "cg.policy.create-order.limit.tenant.rejected",
                "cg.policy.create-order.limit.tenant.shadow_rejected",
                "cg.redis.calls",
                "cg.redis.errors",
                "cg.redis.timeouts",
                "cg.redis.noscript",
                "cg.redis.retries",
                "cg.redis.retries_dropped",
                "cg.redis.foreign_replies",
                "cg.redis.latency_ms",
                "cg.over_limit_cache.hits",
                "cg.memory.by_reference",
                "cg.memory.refused",
            ]
        );
    }
}
