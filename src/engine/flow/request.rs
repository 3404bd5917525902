//! The request's own events: its headers (matched to a policy, the caller identified, its
//! own problems answered, the guards prepared), and, when the record fingerprints it, its
//! body, buffered until it is whole; then the first acquire (see `decide.rs`).

use crate::engine::flow::{
    checks, token, Cx, Flow, Held, Move, Pcx, Phase, Step, BODY_IDLE_TIMEOUT_MS,
};
use crate::guards::idempotency::guard::IdempotencyGuard;
use crate::guards::lease::LeaseGuard;
use crate::http::grpc;
use crate::http::identity::identify;
use crate::http::matching::{parsed_policy_index, Selected};
use crate::http::request::Request;

impl Flow {
    /// Request headers arrived. `owner` is a fresh random token for an idempotency record.
    pub fn on_request(
        &mut self,
        cx: &Cx<'_>,
        req: Request,
        nonce: &str,
        owner: &str,
        end_of_stream: bool,
    ) -> Step {
        self.step(cx, |f| {
            match parsed_policy_index(&cx.rt.config.policies, &req) {
                Some(Selected::AmbiguousPath(index)) => {
                    f.set_grpc(req.header("content-type"));
                    f.ambiguous_path(cx, index)
                }
                Some(Selected::Policy(index)) => {
                    f.policy_request(cx, index, req, nonce, owner, end_of_stream)
                }
                None => Move::Continue,
            }
        })
    }

    /// Whether the request is gRPC (`content-type: application/grpc…`), for a caller that
    /// answers it before [`Flow::on_policy_request`] (an ambiguous path).
    pub(crate) fn set_grpc(&mut self, content_type: Option<&str>) {
        self.kind.grpc = grpc::is_grpc_content_type(content_type);
    }

    /// A request whose path reads more than one way, one of them guarded by policy `index`.
    pub(crate) fn on_ambiguous_path(&mut self, cx: &Cx<'_>, index: usize) -> Step {
        self.step(cx, |f| f.ambiguous_path(cx, index))
    }

    fn ambiguous_path(&mut self, cx: &Cx<'_>, index: usize) -> Move {
        self.policy = index;
        if let Some(at) = self.at(cx) {
            at.m.increment(at.pm.ambiguous_input);
        }
        self.answer(checks::ambiguous_path(&cx.rt.config.problem_type_base))
    }

    /// [`Flow::on_request`] for a request the caller already matched to policy `index`.
    pub(crate) fn on_policy_request(
        &mut self,
        cx: &Cx<'_>,
        index: usize,
        req: Request,
        nonce: &str,
        owner: &str,
        end_of_stream: bool,
    ) -> Step {
        self.step(cx, |f| {
            f.policy_request(cx, index, req, nonce, owner, end_of_stream)
        })
    }

    fn policy_request(
        &mut self,
        cx: &Cx<'_>,
        index: usize,
        req: Request,
        nonce: &str,
        owner: &str,
        end_of_stream: bool,
    ) -> Move {
        self.policy = index;
        self.kind.grpc = grpc::is_grpc_content_type(req.header("content-type"));
        let Some(at) = self.at(cx) else {
            return Move::Continue;
        };
        let caller = match identify(&at.rt.config.identity, &req) {
            Ok(c) => self.caller.insert(c),
            Err(e) => return self.answer(checks::tenant_problem(&at, e)),
        };
        if let Some(problem) = checks::repeated_selector(&at, &req) {
            return self.answer(problem);
        }
        let costs = match checks::costs(&at, &req) {
            Ok(costs) => costs,
            Err(problem) => return self.answer(problem),
        };
        self.owner = token(owner);
        self.kind.connect = req.method == "CONNECT";
        self.kind.upgrade = self.kind.connect || req.header("upgrade").is_some();
        match LeaseGuard::prepare(&at, caller, &req, owner) {
            Ok(lease) => self.lease = lease,
            Err(missing) => return self.answer(checks::lease_resource_missing(&at, &missing)),
        }
        let held = Held {
            req,
            nonce: token(nonce),
            costs,
        };
        if let Some(cfg) = at.policy.idempotency.as_ref() {
            if cfg.applies_to(&held.req.method) {
                match IdempotencyGuard::prepare(&at, cfg, caller, &held.req, owner) {
                    Err(problem) => return self.answer(problem),
                    Ok(None) => {}
                    Ok(Some(guard)) => {
                        self.record = Some(guard);
                        // An upgrade's request "body" is the new protocol, which starts only
                        // after the answer: it is never waited for (the fingerprint's body is
                        // empty).
                        if cfg.needs_body() && !end_of_stream && !self.kind.upgrade {
                            let until_ms = at.now_ms.saturating_add(BODY_IDLE_TIMEOUT_MS);
                            self.phase = Phase::Buffering {
                                held: Box::new(held),
                                until_ms,
                                size: 0,
                            };
                            return Move::Wait;
                        }
                        return self.start_acquire(&at, held, &[]);
                    }
                }
            }
        }
        if at.policy.rate_limits.is_empty() && self.lease.is_none() {
            return self.forward(Vec::new());
        }
        self.start_acquire(&at, held, &[])
    }

    /// A piece of the request body arrived; `body_size` is all that is buffered so far.
    pub(crate) fn on_request_body(
        &mut self,
        cx: &Cx<'_>,
        body_size: usize,
        end_of_stream: bool,
        read: impl FnOnce() -> Vec<u8>,
    ) -> Step {
        self.step(cx, |f| f.request_body(cx, body_size, end_of_stream, read))
    }

    fn request_body(
        &mut self,
        cx: &Cx<'_>,
        body_size: usize,
        end_of_stream: bool,
        read: impl FnOnce() -> Vec<u8>,
    ) -> Move {
        if !matches!(self.phase, Phase::Buffering { .. }) {
            return self.request_part();
        }
        let Some(at) = self.at(cx) else {
            return Move::Continue;
        };
        let Some(cfg) = at.policy.idempotency.as_ref() else {
            return Move::Continue;
        };
        if body_size as u64 > cfg.max_request_body {
            return self.answer(crate::guards::idempotency::guard::body_too_large(&at, cfg));
        }
        if let Phase::Buffering { until_ms, size, .. } = &mut self.phase {
            *size = body_size;
            if !end_of_stream {
                *until_ms = at.now_ms.saturating_add(BODY_IDLE_TIMEOUT_MS);
                return Move::Wait;
            }
        }
        self.request_complete(&at, read)
    }

    /// The request ended without a body callback with end_of_stream (e.g. trailers).
    pub(crate) fn on_request_trailers(
        &mut self,
        cx: &Cx<'_>,
        read: impl FnOnce() -> Vec<u8>,
    ) -> Step {
        self.step(cx, |f| f.request_trailers(cx, read))
    }

    fn request_trailers(&mut self, cx: &Cx<'_>, read: impl FnOnce() -> Vec<u8>) -> Move {
        if !matches!(self.phase, Phase::Buffering { .. }) {
            return self.request_part();
        }
        match self.at(cx) {
            Some(at) => self.request_complete(&at, read),
            None => Move::Continue,
        }
    }

    /// The whole body is here: fingerprint it and acquire. The body is read, and its
    /// canonical form made, only within the worker's memory budget: otherwise the request is
    /// refused (`503 guard_overloaded`) before anything is asked of Redis.
    fn request_complete(&mut self, at: &Pcx<'_>, read: impl FnOnce() -> Vec<u8>) -> Move {
        let size = match &self.phase {
            Phase::Buffering { size, .. } => *size,
            _ => return Move::Continue,
        };
        if !at.rt.memory.admits_brief(size) {
            return self.overloaded(at, "the request body to fingerprint");
        }
        let body = read();
        if body.len() < size {
            // The host could not hand it over (the VM's memory could not take it).
            return self.overloaded(at, "the request body to fingerprint");
        }
        let need = match (&self.phase, at.policy.idempotency.as_ref()) {
            (Phase::Buffering { held, .. }, Some(cfg)) => {
                IdempotencyGuard::fingerprint_need(cfg, &held.req, &body)
            }
            _ => 0,
        };
        if !at.rt.memory.admits_brief(need) {
            return self.overloaded(at, "the request body to fingerprint");
        }
        match std::mem::take(&mut self.phase) {
            Phase::Buffering { held, .. } => self.start_acquire(at, *held, &body),
            _ => Move::Continue,
        }
    }

    /// A later part of a request that is not being buffered.
    fn request_part(&self) -> Move {
        match self.phase {
            // Still deciding (or waiting for a lease): the body stays held with the headers.
            Phase::Acquiring { .. } | Phase::LeaseWaiting { .. } | Phase::RecordWaiting { .. } => {
                Move::Wait
            }
            _ => Move::Continue,
        }
    }
}
