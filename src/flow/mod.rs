//! The per-request state machine. Host callbacks feed it events; it never does I/O and
//! answers with the next [`Step`] for the adapter to carry out.

use crate::config::{Config, FailureMode, Policy};
use crate::metrics::{MetricSink, Metrics, PolicyMetrics};
use crate::ratelimit::{self, Group, LimitState, Verdict};
use crate::redis::{is_noscript, resp::Reply, CallError, Scripts};
use crate::request::{identify, select_policy, Request};
use crate::respond::{self, LocalResponse, Problem};
use serde_json::Map;

/// Everything a VM keeps after `on_configure`.
pub struct Runtime {
    pub config: Config,
    pub scripts: Scripts,
    pub metrics: Metrics,
}

/// One gateway request to send: `slot` comes back with the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub slot: usize,
    pub body: Vec<u8>,
}

/// What the adapter does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Let the request go on to the upstream.
    Continue,
    /// Send these calls and keep the request paused.
    Dispatch(Vec<Outgoing>),
    /// Keep the request paused; answers are still outstanding.
    Wait,
    /// Answer the client locally.
    Respond(LocalResponse),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No decision needed yet or no policy applies.
    Idle,
    /// Rate-limit calls are outstanding.
    Limiting,
    /// The request went on to the upstream.
    Forwarded,
    /// The filter answered locally; later answers are ignored.
    Answered,
}

#[derive(Debug)]
struct Pending {
    group: Group,
    by_sha: bool,
    sent_ms: u64,
    done: bool,
}

#[derive(Debug)]
pub struct Flow {
    policy: usize,
    phase: Phase,
    pending: Vec<Pending>,
    states: Vec<Option<LimitState>>,
    deadline_ms: u64,
    response_headers: Vec<(String, String)>,
}

impl Default for Flow {
    fn default() -> Self {
        Flow {
            policy: 0,
            phase: Phase::Idle,
            pending: Vec::new(),
            states: Vec::new(),
            deadline_ms: 0,
            response_headers: Vec::new(),
        }
    }
}

impl Flow {
    /// Request headers arrived: pick the policy, identify the caller, start the Redis calls.
    pub fn on_request(
        &mut self,
        rt: &Runtime,
        req: &Request,
        nonce: &str,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        let Some(policy) = select_policy(&rt.config.policies, req) else {
            return Step::Continue;
        };
        self.policy = rt
            .config
            .policies
            .iter()
            .position(|p| std::ptr::eq(p, policy))
            .unwrap_or(0);
        let Some(pm) = rt.metrics.policies.get(self.policy) else {
            return Step::Continue;
        };
        let caller = match identify(&rt.config.identity, req) {
            Ok(c) => c,
            Err(()) => {
                m.increment(pm.missing_tenant);
                self.phase = Phase::Answered;
                return Step::Respond(respond::problem(
                    Problem::MissingTenant,
                    &format!(
                        "this operation requires the {} header",
                        rt.config.identity.tenant_header
                    ),
                    Map::new(),
                    Vec::new(),
                ));
            }
        };
        if policy.rate_limits.is_empty() {
            self.phase = Phase::Forwarded;
            return Step::Continue;
        }
        let groups = ratelimit::plan(&rt.config.redis.key_prefix, policy, &caller, req, nonce);
        self.states = vec![None; policy.rate_limits.len()];
        self.pending = groups
            .into_iter()
            .map(|group| Pending {
                group,
                by_sha: true,
                sent_ms: now_ms,
                done: false,
            })
            .collect();
        self.phase = Phase::Limiting;
        self.deadline_ms = now_ms.saturating_add(rt.config.redis.timeout_ms);
        let out = (0..self.pending.len())
            .map(|slot| self.outgoing(rt, slot, now_ms, m))
            .collect();
        Step::Dispatch(out)
    }

    fn outgoing(&mut self, rt: &Runtime, slot: usize, now_ms: u64, m: &dyn MetricSink) -> Outgoing {
        m.increment(rt.metrics.redis.calls);
        let p = &mut self.pending[slot];
        p.sent_ms = now_ms;
        Outgoing {
            slot,
            body: p.group.call.encode(&rt.scripts.ratelimit, p.by_sha),
        }
    }

    /// The adapter could not send a call, or the gateway answered.
    pub fn on_reply(
        &mut self,
        rt: &Runtime,
        slot: usize,
        answer: Result<Reply, CallError>,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        if self.phase != Phase::Limiting {
            return Step::Wait;
        }
        let Some(p) = self.pending.get_mut(slot).filter(|p| !p.done) else {
            return Step::Wait;
        };
        m.record(
            rt.metrics.redis.latency_ms,
            now_ms.saturating_sub(p.sent_ms),
        );
        let reply = match answer {
            Ok(reply) if is_noscript(&reply) && p.by_sha => {
                m.increment(rt.metrics.redis.noscript);
                p.by_sha = false;
                return Step::Dispatch(vec![self.outgoing(rt, slot, now_ms, m)]);
            }
            Ok(reply) => reply,
            Err(e) => {
                m.increment(rt.metrics.redis.errors);
                return self.fail(rt, &e, m);
            }
        };
        let read = match ratelimit::read_reply(&reply, p.group.limits.len()) {
            Ok(r) => r,
            Err(e) => {
                m.increment(rt.metrics.redis.errors);
                return self.fail(rt, &e, m);
            }
        };
        p.done = true;
        for (&i, state) in p.group.limits.iter().zip(read.states) {
            if let Some(s) = self.states.get_mut(i) {
                *s = Some(state);
            }
        }
        if self.pending.iter().any(|p| !p.done) {
            return Step::Wait;
        }
        self.finish_limits(rt, m)
    }

    fn policy<'a>(&self, rt: &'a Runtime) -> Option<(&'a Policy, &'a PolicyMetrics)> {
        Some((
            rt.config.policies.get(self.policy)?,
            rt.metrics.policies.get(self.policy)?,
        ))
    }

    fn finish_limits(&mut self, rt: &Runtime, m: &dyn MetricSink) -> Step {
        let Some((policy, pm)) = self.policy(rt) else {
            return Step::Continue;
        };
        let states: Vec<LimitState> = self.states.iter().flatten().copied().collect();
        if states.len() != policy.rate_limits.len() {
            return self.fail(
                rt,
                &CallError::UnexpectedReply("missing limit state".into()),
                m,
            );
        }
        for ((limit, state), lm) in policy.rate_limits.iter().zip(&states).zip(&pm.limits) {
            m.increment(match (state.allowed, limit.shadow) {
                (true, _) => lm.allowed,
                (false, true) => lm.shadow_rejected,
                (false, false) => lm.rejected,
            });
        }
        match ratelimit::decide(policy, &states) {
            Verdict::Allow(headers) => {
                if rt.config.response_headers {
                    self.response_headers = headers;
                }
                self.phase = Phase::Forwarded;
                Step::Continue
            }
            Verdict::Reject(response) => {
                self.phase = Phase::Answered;
                Step::Respond(response)
            }
        }
    }

    /// The one place a failed Redis call becomes the policy's answer.
    fn fail(&mut self, rt: &Runtime, err: &CallError, m: &dyn MetricSink) -> Step {
        let Some((policy, pm)) = self.policy(rt) else {
            return Step::Continue;
        };
        log::warn!(
            "redis call for policy {} failed ({}); {}",
            policy.name,
            err.describe(),
            match policy.failure_mode {
                FailureMode::Open => "failing open",
                FailureMode::Closed => "failing closed",
            }
        );
        match policy.failure_mode {
            FailureMode::Open => {
                m.increment(pm.failed_open);
                self.phase = Phase::Forwarded;
                Step::Continue
            }
            FailureMode::Closed => {
                m.increment(pm.failed_closed);
                self.phase = Phase::Answered;
                Step::Respond(respond::problem(
                    Problem::GuardUnavailable,
                    "the coordination store did not answer in time; retry shortly",
                    Map::new(),
                    vec![("retry-after".into(), "1".into())],
                ))
            }
        }
    }

    /// When the request is paused on Redis, the time by which it must be decided.
    pub fn deadline_ms(&self) -> Option<u64> {
        (self.phase == Phase::Limiting).then_some(self.deadline_ms)
    }

    /// The watchdog: decides a request whose calls outlived the timeout.
    pub fn on_tick(&mut self, rt: &Runtime, now_ms: u64, m: &dyn MetricSink) -> Step {
        match self.deadline_ms() {
            Some(deadline) if now_ms >= deadline => {
                m.increment(rt.metrics.redis.timeouts);
                self.fail(rt, &CallError::Timeout, m)
            }
            _ => Step::Wait,
        }
    }

    /// Headers to add to the upstream's response (`RateLimit-Policy`, `RateLimit`).
    pub fn response_headers(&self) -> &[(String, String)] {
        &self.response_headers
    }
}

#[cfg(test)]
mod tests;
