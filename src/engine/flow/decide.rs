//! The acquire round and what it decides: rate limits first (the record or lease call
//! deferred while other slots hold limits), then the record, then the lease (polled again
//! while it is busy and the policy waits); the failure mode when Redis does not answer; and
//! giving back what the request will not use.

use crate::config::FailureMode;
use crate::engine::flow::{
    Flow, Held, Move, Pending, Phase, FINGERPRINT_HEADER, MARKER_MIN_TTL_MS,
};
use crate::guards::background::Background;
use crate::guards::context::{Outgoing, Pcx, Purpose};
use crate::guards::idempotency::guard::IdempotencyDecision;
use crate::guards::lease::LeaseDecision;
use crate::guards::ratelimit::Verdict;
use crate::http::local_reply::{self, Problem};
use crate::redis::scripts::acquire::{self, LeaseAnswer};
use crate::redis::scripts::ScriptId;
use crate::redis::{CallError, ScriptCall};
use crate::support::lograte::WarnKind;

impl Flow {
    pub(super) fn start_acquire(&mut self, at: &Pcx<'_>, held: Held, body: &[u8]) -> Move {
        let Some(caller) = self.caller.as_ref() else {
            return Move::Continue;
        };
        if let (Some(record), Some(cfg)) = (self.record.as_mut(), at.policy.idempotency.as_ref()) {
            record.fingerprint(cfg, caller, &held.req, body);
        }
        self.nonce = held.nonce;
        self.admission =
            std::mem::take(&mut self.admission).start(at, caller, &held.req, &held.costs);
        if let Some(rejection) = self.admission.cached_rejection(at) {
            return self.answer(rejection);
        }
        if self.admission.all_local() && self.record.is_none() && self.lease.is_none() {
            // Every limit answered locally, nothing else to acquire: no Redis call. Otherwise
            // the plan holds a group for each limit asked and for the record and the lease.
            return self.decide(at);
        }
        let asker = acquire::Asker {
            nonce: &self.nonce,
            prefix: &at.rt.config.redis.key_prefix,
            owner: &self.owner,
        };
        let groups = acquire::plan(
            at.policy,
            &self.admission.asks(),
            &asker,
            self.record.as_ref().map(|i| &i.acquire),
            self.lease.as_ref().map(|l| &l.acquire),
        );
        // Rate limits first: when the record or the lease rides in one slot and other slots
        // hold rate limits, those go first and the record/lease call only once they admit,
        // so a rate-limited request never takes a lease or a record (a second round trip).
        let carries = |g: &acquire::Group| g.record || g.lease;
        let (first, deferred) = if !groups.iter().any(carries) {
            (groups, None)
        } else {
            let (mut sections, plain): (Vec<acquire::Group>, Vec<acquire::Group>) =
                groups.into_iter().partition(carries);
            if plain.is_empty() {
                (sections, None)
            } else {
                let deferred = sections.pop();
                (plain, deferred)
            }
        };
        self.calls.clear();
        let out = first
            .into_iter()
            .filter_map(|g| self.send_acquire(at, g))
            .collect();
        self.phase = Phase::Acquiring {
            deadline_ms: at.call_deadline(),
            deferred,
        };
        Move::Dispatch(out)
    }

    pub(super) fn send_acquire(&mut self, at: &Pcx<'_>, mut g: acquire::Group) -> Option<Outgoing> {
        let tag = Pending::acquire(&mut g);
        self.calls
            .push_and_send(tag, ScriptId::Acquire, g.call, at.now_ms)
    }

    /// All acquire calls answered: rate-limit verdict first, then the record, then the lease.
    pub(super) fn decide(&mut self, at: &Pcx<'_>) -> Move {
        let verdict = match self.admission.decide(at) {
            Ok(v) => v,
            Err(e) => return self.fail(at, &e),
        };
        let limit_headers = match verdict {
            Verdict::Reject(response) => {
                // Another slot may have acquired the record, the lease or a concurrency slot:
                // give them back.
                self.release_record(at);
                self.release_lease(at);
                self.release_slots(at);
                return self.answer(response);
            }
            Verdict::Allow(headers) if at.rt.config.response_headers => headers,
            Verdict::Allow(_) => Vec::new(),
        };
        self.slots_taken(at);
        self.guards_decide(at, limit_headers)
    }

    /// Once the rate limits admitted the request: the record's answer, then the lease's.
    pub(super) fn guards_decide(
        &mut self,
        at: &Pcx<'_>,
        limit_headers: Vec<(String, String)>,
    ) -> Move {
        let grpc = self.kind.grpc;
        let decision = match self.record.as_mut() {
            Some(record) => record.decide(at, &limit_headers, grpc),
            None => IdempotencyDecision::NotAsked,
        };
        match decision {
            IdempotencyDecision::Answer(response) => self.answer(response),
            IdempotencyDecision::PollAt(poll_at_ms) => {
                self.phase = Phase::RecordWaiting { poll_at_ms };
                self.limit_headers = limit_headers;
                Move::Wait
            }
            IdempotencyDecision::Skipped => self.forward(limit_headers),
            IdempotencyDecision::Acquired(fingerprint) => {
                self.upstream_headers
                    .push((FINGERPRINT_HEADER.into(), fingerprint));
                self.lease_decide(at, limit_headers)
            }
            IdempotencyDecision::NotAsked => self.lease_decide(at, limit_headers),
        }
    }

    /// The lease answer of the acquire, once rate limits and the record let the request go.
    pub(super) fn lease_decide(&mut self, at: &Pcx<'_>, headers: Vec<(String, String)>) -> Move {
        let answer = self.lease.as_mut().and_then(|l| l.answer.take());
        self.on_lease_answer(at, answer.unwrap_or(LeaseAnswer::Skipped), headers)
    }

    pub(super) fn on_lease_answer(
        &mut self,
        at: &Pcx<'_>,
        answer: LeaseAnswer,
        headers: Vec<(String, String)>,
    ) -> Move {
        let Some(lease) = self.lease.as_mut() else {
            return self.forward(headers);
        };
        match lease.decide(at, answer) {
            LeaseDecision::Forward(fencing) => {
                self.upstream_headers.extend(fencing);
                self.forward(headers)
            }
            LeaseDecision::PollAt(poll_at_ms) => {
                self.phase = Phase::LeaseWaiting { poll_at_ms };
                self.limit_headers = headers;
                Move::Wait
            }
            LeaseDecision::Busy(response) => {
                // The idempotency record this request acquired is not going to be used.
                self.release_record(at);
                self.answer(local_reply::with_limit_headers(response, &headers))
            }
        }
    }

    /// Polls a busy lease again (`on_busy: wait`).
    pub(super) fn poll_lease(&mut self, at: &Pcx<'_>) -> Move {
        let Some(lease) = self.lease.as_ref() else {
            return Move::Continue;
        };
        let call = lease.poll_call(&self.nonce);
        let mut tag = Pending::of(Purpose::LeaseRetry);
        tag.lease = true;
        tag.lease_unsettled = true;
        self.poll(at, tag, call)
    }

    /// Sends a poll (a lease or record-only acquire) alone; the stream waits for it.
    fn poll(&mut self, at: &Pcx<'_>, tag: Pending, call: ScriptCall) -> Move {
        self.calls.clear();
        let out = self
            .calls
            .push_and_send(tag, ScriptId::Acquire, call, at.now_ms);
        self.phase = Phase::Acquiring {
            deadline_ms: at.call_deadline(),
            deferred: None,
        };
        Move::Dispatch(out.into_iter().collect())
    }

    /// Polls a record still in progress again (`in_progress: wait`); with the lease, which
    /// a request that gets the record then needs.
    pub(super) fn poll_record(&mut self, at: &Pcx<'_>) -> Move {
        let Some(record) = self.record.as_ref() else {
            return Move::Continue;
        };
        let lease = self.lease.as_ref().map(|l| &l.acquire);
        let call = record.poll_call(lease, &self.nonce);
        let mut tag = Pending::of(Purpose::RecordRetry);
        tag.record = true;
        tag.record_unsettled = true;
        tag.lease = lease.is_some_and(|l| l.tag == record.acquire.tag);
        tag.lease_unsettled = tag.lease;
        self.poll(at, tag, call)
    }

    /// Gives the record back from the root, if this request holds it or an acquire that may
    /// still run may have created it (handed over once: the stream's end does not send it
    /// again).
    pub(super) fn release_record(&mut self, at: &Pcx<'_>) {
        self.hand_back(
            at,
            |t| &mut t.record_unsettled,
            |f, in_flight, ttl| Background::give_back(at.index, f.record.as_mut()?, in_flight, ttl),
        );
    }

    /// Gives the lease back from the root, the same way.
    pub(super) fn release_lease(&mut self, at: &Pcx<'_>) {
        self.hand_back(
            at,
            |t| &mut t.lease_unsettled,
            |f, in_flight, ttl| Background::give_back(at.index, f.lease.as_mut()?, in_flight, ttl),
        );
    }

    /// Hands the release `release` makes to the root; `unsettled` names the calls' flag that
    /// says an acquire may have taken what it gives back (cleared once it is handed over).
    pub(super) fn hand_back(
        &mut self,
        at: &Pcx<'_>,
        unsettled: fn(&mut Pending) -> &mut bool,
        release: impl FnOnce(&mut Flow, bool, u64) -> Option<Background>,
    ) {
        let in_flight = self.calls.iter_mut().any(|c| *unsettled(&mut c.tag));
        let marker_ttl = self.marker_ttl_ms(at);
        let Some(bg) = release(self, in_flight, marker_ttl) else {
            return;
        };
        self.calls
            .iter_mut()
            .for_each(|c| *unsettled(&mut c.tag) = false);
        self.out.background.push(bg);
    }

    /// The TTL of this request's cancellation marker: it must outlive any acquire of this
    /// request that can still run after the filter gave up on it (see README, "Redis keys").
    pub(super) fn marker_ttl_ms(&self, at: &Pcx<'_>) -> u64 {
        let processing = at
            .policy
            .idempotency
            .as_ref()
            .map_or(0, |i| i.processing_ttl_ms);
        let lease = at.policy.lease.as_ref().map_or(0, |l| l.ttl_ms);
        processing.max(lease).max(MARKER_MIN_TTL_MS)
    }

    /// The one place a failed acquire becomes the policy's answer. An answer the worker could
    /// not hold is no Redis failure: whatever the failure mode, the request is refused (a
    /// replay it may have been must not run the operation again), with what it took given back.
    pub(super) fn fail(&mut self, at: &Pcx<'_>, err: &CallError) -> Move {
        if *err == CallError::OverBudget {
            self.release_record(at);
            self.release_lease(at);
            self.release_slots(at);
            return self.overloaded(at, "the coordination store's answer");
        }
        self.failed = true;
        let policy = at.policy;
        at.rt
            .warnings
            .warn(WarnKind::AcquireFailed, at.index, at.now_ms, || {
                format!(
                    "redis call for policy {} failed ({}); {}",
                    policy.name,
                    err.describe(),
                    match policy.failure_mode {
                        FailureMode::Open => "failing open",
                        FailureMode::Closed => "failing closed",
                    }
                )
            });
        // A waiter that already saw the record in progress or the lease busy knows another
        // request is running the operation: it answers what it saw, whatever the failure mode
        // (forwarding it would run the operation beside the first request).
        let seen = self.seen_busy(at);
        // A record, lease or slot acquired by a call that did answer is given back either way.
        self.release_record(at);
        self.release_lease(at);
        self.release_slots(at);
        if let Some(response) = seen {
            at.m.increment(at.pm.failed_closed);
            let headers = std::mem::take(&mut self.limit_headers);
            return self.answer(local_reply::with_limit_headers(response, &headers));
        }
        match policy.failure_mode {
            FailureMode::Open => {
                at.m.increment(at.pm.failed_open);
                self.forward(Vec::new())
            }
            FailureMode::Closed => {
                at.m.increment(at.pm.failed_closed);
                self.answer(local_reply::problem(
                    &at.rt.config.problem_type_base,
                    Problem::GuardUnavailable,
                    &err.client_detail(at.rt.config.redis.timeout_ms),
                    &[],
                    vec![("retry-after".into(), "1".into())],
                ))
            }
        }
    }

    /// The answer of a waiter whose poll failed: the in-progress answer if it waited for the
    /// record, else the busy answer if it waited for the lease; `None` for a request that never
    /// waited (its failure mode applies).
    fn seen_busy(&self, at: &Pcx<'_>) -> Option<local_reply::LocalResponse> {
        let grpc = self.kind.grpc;
        self.record
            .as_ref()
            .and_then(|i| i.waiting_answer(at, grpc))
            .or_else(|| self.lease.as_ref().and_then(|l| l.waiting_answer(at)))
    }

    /// The worker's memory budget cannot hold `what` the request needs now: `503
    /// guard_overloaded`, counted and warned about (the request took nothing it keeps).
    pub(super) fn overloaded(&mut self, at: &Pcx<'_>, what: &str) -> Move {
        at.m.increment(at.rt.metrics.memory.refused);
        let memory = &at.rt.memory;
        at.rt
            .warnings
            .warn(WarnKind::MemoryBudget, at.index, at.now_ms, || {
                format!(
                    "policy {}: {what} does not fit this worker's memory budget ({} of {} bytes \
                     held); answering 503 guard_overloaded",
                    at.policy.name,
                    memory.held(),
                    memory.limit()
                )
            });
        self.answer(local_reply::problem(
            &at.rt.config.problem_type_base,
            Problem::GuardOverloaded,
            &format!("this proxy cannot hold {what} now; retry shortly"),
            &[],
            vec![("retry-after".into(), "1".into())],
        ))
    }
}
