//! The per-request state machine. Host callbacks feed it events, each with its [`Cx`]; it
//! never does I/O and answers with the next [`Step`] for the adapter to carry out.
//!
//! The flow orders its guards, each a sub-machine with its own state that decides and never
//! calls back: rate-limit admission ([`admit`]), the idempotency record ([`idem`], its
//! response side in [`response`]), the lease ([`lease`]). Rate limits go first, then the
//! record (in the same script call where they share a hash slot), then the lease. The calls
//! they make are kept in one table ([`calls`]); those that must outlive the request go to the
//! root's [`Outbox`].

mod answers;
pub(crate) mod checks;
mod concurrency;
mod decide;
mod gone;
mod upstream;

pub use crate::engine::context::{
    Cx, Outgoing, Pcx, Purpose, Runtime, Step, BODY_IDLE_TIMEOUT_MS, FINGERPRINT_HEADER,
    MARKER_MIN_TTL_MS,
};
pub use crate::engine::outbox::{
    Background, Outbox, Settled, MAX_SENDS, RETRY_BUDGET, RETRY_BUDGET_PER_S, RETRY_WINDOW_MS,
};
pub use crate::guards::idempotency::guard::REPLAYED_HEADER;
pub use crate::guards::lease::{LEASE_POLL_FIRST_MS, LEASE_POLL_MAX_MS};

use crate::engine::calls::Calls;
use crate::guards::idempotency::capture::Intake;
use crate::guards::idempotency::guard::IdemGuard;
use crate::guards::lease::LeaseGuard;
use crate::guards::ratelimit::admission::Admission;
use crate::guards::ratelimit::charge::Meter;
use crate::http::grpc;
use crate::http::identity::{identify, Caller};
use crate::http::local_reply::{self, LocalResponse};
use crate::http::matching::{parsed_policy_index, Selected};
use crate::http::request::Request;
use crate::redis::scripts::acquire;
use std::borrow::Cow;
use std::rc::Rc;

#[derive(Debug, Default)]
enum Phase {
    /// Nothing to do (no policy, or not decided yet).
    #[default]
    Idle,
    /// Buffering the request body to fingerprint it; answered `408` if it stalls. `size`:
    /// what Envoy holds of it so far.
    Buffering {
        held: Box<Held>,
        until_ms: u64,
        size: usize,
    },
    /// Acquire calls are outstanding; the request is paused. `deferred` is the record/lease
    /// call, sent once the rate limits of the other slots admitted.
    Acquiring {
        deadline_ms: u64,
        deferred: Option<acquire::Group>,
    },
    /// The lease is busy and `on_busy: wait`: polling again at `poll_at_ms`.
    LeaseWaiting { poll_at_ms: u64 },
    /// The same request is in progress and `in_progress: wait`: polling its record again at
    /// `poll_at_ms`.
    RecordWaiting { poll_at_ms: u64 },
    /// Answered locally; later answers are ignored.
    Answered,
    /// The request went on to the upstream; no response yet.
    Forwarded,
    /// The response's headers passed; nothing left to take in.
    Responded,
    /// The response body is taken in for the record.
    Response(Intake),
    /// The complete/release (or lease release) the response waits for is outstanding.
    Completing { deadline_ms: u64 },
    /// Forwarded and settled; later answers are ignored.
    Done,
}

/// What the flow keeps with each of its calls.
#[derive(Debug, Clone)]
struct Pending {
    purpose: Purpose,
    /// Rate limits (indices into the policy's) this call answers for.
    limits: Vec<usize>,
    idem: bool,
    lease: bool,
    /// An acquire that may have written a record (`record_unsettled`) or a lease
    /// (`lease_unsettled`) this request does not know of: not answered yet, or failed in a
    /// way that may have run in Redis. Its release then carries the owner's cancellation
    /// marker; once that release is handed to the root, the flag is cleared.
    record_unsettled: bool,
    lease_unsettled: bool,
    /// The same for a call that carries a concurrency limit (it may have taken a slot).
    slots_unsettled: bool,
}

impl Pending {
    fn of(purpose: Purpose) -> Pending {
        Pending {
            purpose,
            limits: Vec::new(),
            idem: false,
            lease: false,
            record_unsettled: false,
            lease_unsettled: false,
            slots_unsettled: false,
        }
    }

    /// Only a call that carries the record, the lease or a concurrency limit can leave one
    /// behind.
    fn acquire(g: &mut acquire::Group) -> Pending {
        Pending {
            purpose: Purpose::Acquire,
            limits: std::mem::take(&mut g.limits),
            idem: g.idem,
            lease: g.lease,
            record_unsettled: g.idem,
            lease_unsettled: g.lease,
            slots_unsettled: g.slots,
        }
    }
}

/// A token the worker drew for a request (its nonce, its owner), or `-` for a policy that
/// needs none, which is not allocated.
type Token = Cow<'static, str>;

fn token(text: &str) -> Token {
    if text == "-" {
        Cow::Borrowed("-")
    } else {
        Cow::Owned(text.to_string())
    }
}

/// The request parts kept while the body is buffered.
#[derive(Debug)]
struct Held {
    caller: Caller,
    req: Request,
    nonce: Token,
    /// The request's cost to each rate limit (none listed: 1 to each).
    costs: Vec<u64>,
}

/// What kind of request and response stream this is.
#[derive(Debug, Default)]
struct StreamKind {
    /// The request is gRPC (Envoy answers it with gRPC local replies).
    grpc: bool,
    /// The request asks to switch protocols (`Upgrade`, e.g. WebSocket) or is a `CONNECT`.
    upgrade: bool,
    connect: bool,
    /// The response is a stream that need not end (an accepted upgrade or tunnel, an event
    /// stream): never buffered, and a held lease stays held (and extended) until it ends.
    open_ended: bool,
}

#[derive(Debug, Default)]
pub struct Flow {
    policy: usize,
    phase: Phase,
    calls: Calls<Pending>,
    admission: Admission,
    idem: Option<IdemGuard>,
    lease: Option<LeaseGuard>,
    nonce: Token,
    /// The owner token (names the cancellation marker).
    owner: Token,
    /// When the concurrency slots held are to be extended next.
    slots_extend_ms: Option<u64>,
    /// What the response says the request cost (limits with `charge`).
    meter: Meter,
    kind: StreamKind,
    /// Headers to add to the upstream's response (`RateLimit-Policy`, `RateLimit`).
    response_headers: Vec<(String, String)>,
    /// Headers to set on the request before it goes upstream (the fingerprint, the fencing
    /// token), once it is forwarded.
    upstream_headers: Vec<(String, String)>,
    /// Calls for the root to send, until taken.
    background: Vec<Background>,
    /// The client left while the acquire was in flight, and the flow stays to read its answer
    /// (see `gone.rs`): it never forwards, answers or sends again.
    gone: bool,
}

impl Phase {
    /// How the record takes the response body in, while it does.
    fn intake(&self) -> Option<Intake> {
        match self {
            Phase::Response(intake) => Some(*intake),
            _ => None,
        }
    }
}

impl Flow {
    /// The context of an event for this request's policy.
    fn at<'a>(&self, cx: &Cx<'a>) -> Option<Pcx<'a>> {
        Some(Pcx {
            rt: cx.rt,
            now_ms: cx.now_ms,
            m: cx.m,
            index: self.policy,
            policy: cx.rt.config.policies.get(self.policy)?,
            pm: cx.rt.metrics.policies.get(self.policy)?,
        })
    }

    /// Request headers arrived. `owner` is a fresh random token for an idempotency record.
    pub fn on_request(
        &mut self,
        cx: &Cx<'_>,
        req: Request,
        nonce: &str,
        owner: &str,
        end_of_stream: bool,
    ) -> Step {
        match parsed_policy_index(&cx.rt.config.policies, &req) {
            Some(Selected::AmbiguousPath(index)) => {
                self.set_grpc(req.header("content-type"));
                self.on_ambiguous_path(cx, index)
            }
            Some(Selected::Policy(index)) => {
                self.on_policy_request(cx, index, req, nonce, owner, end_of_stream)
            }
            None => Step::Continue,
        }
    }

    /// Whether the request is gRPC (`content-type: application/grpc…`), for a caller that
    /// answers it before [`Flow::on_policy_request`] (an ambiguous path).
    pub fn set_grpc(&mut self, content_type: Option<&str>) {
        self.kind.grpc = grpc::is_grpc_content_type(content_type);
    }

    /// A request whose path reads more than one way, one of them guarded by policy `index`.
    pub fn on_ambiguous_path(&mut self, cx: &Cx<'_>, index: usize) -> Step {
        self.policy = index;
        if let Some(at) = self.at(cx) {
            at.m.increment(at.pm.ambiguous_input);
        }
        self.answer(checks::ambiguous_path())
    }

    /// [`Flow::on_request`] for a request the caller already matched to policy `index`.
    pub fn on_policy_request(
        &mut self,
        cx: &Cx<'_>,
        index: usize,
        req: Request,
        nonce: &str,
        owner: &str,
        end_of_stream: bool,
    ) -> Step {
        self.policy = index;
        self.kind.grpc = grpc::is_grpc_content_type(req.header("content-type"));
        let Some(at) = self.at(cx) else {
            return Step::Continue;
        };
        let caller = match identify(&at.rt.config.identity, &req) {
            Ok(c) => c,
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
        match LeaseGuard::prepare(&at, &caller, &req, owner) {
            Ok(lease) => self.lease = lease,
            Err(missing) => return self.answer(checks::lease_resource_missing(&at, &missing)),
        }
        let held = Held {
            caller,
            req,
            nonce: token(nonce),
            costs,
        };
        if let Some(cfg) = at.policy.idempotency.as_ref() {
            if cfg.applies_to(&held.req.method) {
                match IdemGuard::prepare(&at, cfg, &held.caller, &held.req, owner) {
                    Err(problem) => return self.answer(problem),
                    Ok(None) => {}
                    Ok(Some(guard)) => {
                        self.idem = Some(guard);
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
                            return Step::Wait;
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
    pub fn on_request_body(
        &mut self,
        cx: &Cx<'_>,
        body_size: usize,
        end_of_stream: bool,
        read: impl FnOnce() -> Vec<u8>,
    ) -> Step {
        if !matches!(self.phase, Phase::Buffering { .. }) {
            return self.request_part();
        }
        let Some(at) = self.at(cx) else {
            return Step::Continue;
        };
        let Some(cfg) = at.policy.idempotency.as_ref() else {
            return Step::Continue;
        };
        if body_size as u64 > cfg.max_request_body {
            return self.answer(crate::guards::idempotency::guard::body_too_large(&at, cfg));
        }
        if let Phase::Buffering { until_ms, size, .. } = &mut self.phase {
            *size = body_size;
            if !end_of_stream {
                *until_ms = at.now_ms.saturating_add(BODY_IDLE_TIMEOUT_MS);
                return Step::Wait;
            }
        }
        self.request_complete(&at, read)
    }

    /// The request ended without a body callback with end_of_stream (e.g. trailers).
    pub fn on_request_trailers(&mut self, cx: &Cx<'_>, read: impl FnOnce() -> Vec<u8>) -> Step {
        if !matches!(self.phase, Phase::Buffering { .. }) {
            return self.request_part();
        }
        match self.at(cx) {
            Some(at) => self.request_complete(&at, read),
            None => Step::Continue,
        }
    }

    /// The whole body is here: fingerprint it and acquire. The body is read, and its
    /// canonical form made, only within the worker's memory budget: otherwise the request is
    /// refused (`503 guard_overloaded`) before anything is asked of Redis.
    fn request_complete(&mut self, at: &Pcx<'_>, read: impl FnOnce() -> Vec<u8>) -> Step {
        let size = match &self.phase {
            Phase::Buffering { size, .. } => *size,
            _ => return Step::Continue,
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
                IdemGuard::fingerprint_need(cfg, &held.req, &body)
            }
            _ => 0,
        };
        if !at.rt.memory.admits_brief(need) {
            return self.overloaded(at, "the request body to fingerprint");
        }
        match std::mem::take(&mut self.phase) {
            Phase::Buffering { held, .. } => self.start_acquire(at, *held, &body),
            _ => Step::Continue,
        }
    }

    /// A later part of a request that is not being buffered.
    fn request_part(&self) -> Step {
        match self.phase {
            // Still deciding (or waiting for a lease): the body stays held with the headers.
            Phase::Acquiring { .. } | Phase::LeaseWaiting { .. } | Phase::RecordWaiting { .. } => {
                Step::Wait
            }
            _ => Step::Continue,
        }
    }

    fn forward(&mut self, response_headers: Vec<(String, String)>) -> Step {
        self.response_headers = response_headers;
        self.phase = Phase::Forwarded;
        Step::Continue
    }

    /// Answers locally; a gRPC client gets the problem as a gRPC status (see
    /// [`local_reply::for_grpc`]), anyone else the problem+json answer as it is.
    fn answer(&mut self, response: impl Into<Rc<LocalResponse>>) -> Step {
        self.phase = Phase::Answered;
        self.response_headers.clear();
        let response = response.into();
        Step::Respond(if self.kind.grpc {
            local_reply::for_grpc(response)
        } else {
            response
        })
    }

    /// Whether the request went on to the upstream.
    fn forwarded(&self) -> bool {
        matches!(
            self.phase,
            Phase::Forwarded
                | Phase::Responded
                | Phase::Response(_)
                | Phase::Completing { .. }
                | Phase::Done
        )
    }

    /// When the stream is paused (on Redis, or waiting for the request body or a lease), the
    /// time by which it must go on; or when a held lease is to be extended.
    pub fn deadline_ms(&self) -> Option<u64> {
        let stream = match self.phase {
            Phase::Buffering { until_ms, .. } => Some(until_ms),
            Phase::Acquiring { deadline_ms, .. } | Phase::Completing { deadline_ms } => {
                Some(deadline_ms)
            }
            Phase::LeaseWaiting { poll_at_ms } | Phase::RecordWaiting { poll_at_ms } => {
                Some(poll_at_ms)
            }
            _ => None,
        };
        let extend = self.lease.as_ref().and_then(LeaseGuard::next_extend_ms);
        [stream, extend, self.slots_extend_ms]
            .into_iter()
            .flatten()
            .min()
    }

    /// The response body is taken in (a record copying it, a completion it waits for, a
    /// charge read from it).
    pub fn wants_response_body(&self) -> bool {
        matches!(self.phase, Phase::Response(_) | Phase::Completing { .. }) || self.meter.scanning()
    }

    /// This flow as a fresh one for the next stream, but for the room of its limits' and
    /// calls' lists, kept emptied: a reused stream box allocates neither again.
    pub fn recycle(&mut self) {
        let admission = std::mem::take(&mut self.admission).emptied();
        let calls = std::mem::take(&mut self.calls).emptied();
        *self = Flow::default();
        self.admission = admission;
        self.calls = calls;
    }

    /// Answered locally before any Redis call (an over-limit cache or leased-quota
    /// rejection, a refused input): nothing was taken, so the stream's end owes nothing and
    /// its later events need not reach the flow.
    pub fn answered_without_calls(&self) -> bool {
        matches!(self.phase, Phase::Answered)
            && self.calls.none_made()
            && self.background.is_empty()
    }

    /// Forwarded with nothing to settle at its end: no record, lease or concurrency limit, no
    /// charge, no call in flight and none for the root. Once its response headers have their
    /// rate-limit headers, the stream's later events need not reach the flow.
    pub fn owes_nothing_at_end(&self, cx: &Cx<'_>) -> bool {
        matches!(self.phase, Phase::Forwarded)
            && self.idem.is_none()
            && self.lease.is_none()
            && self.calls.open().next().is_none()
            && self.background.is_empty()
            && self.at(cx).is_some_and(|at| {
                !Meter::wanted(at.policy) && !at.policy.rate_limits.iter().any(|l| l.concurrency())
            })
    }

    /// The request body is being held (buffering or deciding).
    pub fn holds_request(&self) -> bool {
        matches!(
            self.phase,
            Phase::Buffering { .. }
                | Phase::Acquiring { .. }
                | Phase::LeaseWaiting { .. }
                | Phase::RecordWaiting { .. }
        )
    }

    /// The lease (`on_busy: wait`) or record (`in_progress: wait`) this request waits for,
    /// while it waits.
    pub fn waiting_for(&self) -> Option<&str> {
        match self.phase {
            Phase::LeaseWaiting { .. } => self.lease.as_ref().map(|l| l.acquire.key.as_str()),
            Phase::RecordWaiting { .. } => self.idem.as_ref().map(|i| i.acquire.key.as_str()),
            _ => None,
        }
    }

    /// What this request waits for was just given back (or settled) on this worker: poll it
    /// at the next tick instead of at the end of the backoff.
    pub fn wake(&mut self, now_ms: u64) {
        if let Phase::LeaseWaiting { poll_at_ms } | Phase::RecordWaiting { poll_at_ms } =
            &mut self.phase
        {
            *poll_at_ms = (*poll_at_ms).min(now_ms);
        }
    }

    /// The lease this request gave back or the record it settled, once Redis said so (for
    /// [`Flow::wake`] of waiters).
    pub fn take_freed(&mut self) -> Option<String> {
        self.lease
            .as_mut()
            .and_then(LeaseGuard::take_freed)
            .or_else(|| self.idem.as_mut().and_then(IdemGuard::take_freed))
    }

    /// Whether the response matters to this request (a record to complete, a lease to
    /// release, a charge to read); if not, the adapter skips reading the response.
    pub fn wants_response(&self, cx: &Cx<'_>) -> bool {
        self.idem.as_ref().is_some_and(|i| i.owned)
            || self.lease.as_ref().is_some_and(|l| l.held)
            || self.at(cx).is_some_and(|at| {
                (self.forwarded() && Meter::wanted(at.policy)) || self.holds_slots(&at)
            })
    }

    /// Whether the response's trailers matter (a record that settles on them, a charge).
    pub fn wants_response_trailers(&self, cx: &Cx<'_>) -> bool {
        matches!(self.phase, Phase::Response(_))
            || (self.forwarded()
                && self
                    .at(cx)
                    .is_some_and(|at| Meter::wants_trailers(at.policy)))
    }

    /// Headers to add to the upstream's response (`RateLimit-Policy`, `RateLimit`).
    pub fn response_headers(&self) -> &[(String, String)] {
        &self.response_headers
    }

    /// [`Flow::response_headers`], taken for the response they go on.
    pub fn take_response_headers(&mut self) -> Vec<(String, String)> {
        std::mem::take(&mut self.response_headers)
    }

    /// The headers to set on the request before it goes upstream, once. (The client's own
    /// copies of them are removed from every request: see [`Runtime::reserved_headers`].)
    pub fn take_upstream_headers(&mut self) -> Vec<(String, String)> {
        if !self.forwarded() {
            return Vec::new();
        }
        std::mem::take(&mut self.upstream_headers)
    }

    /// Headers to set on the request before it goes upstream (until taken).
    pub fn upstream_headers(&self) -> &[(String, String)] {
        if self.forwarded() {
            &self.upstream_headers
        } else {
            &[]
        }
    }

    /// Calls for the root context to send: they must outlive this request.
    pub fn take_background(&mut self) -> Vec<Background> {
        std::mem::take(&mut self.background)
    }
}

#[cfg(test)]
mod idem_tests;
#[cfg(test)]
mod lease_tests;
#[cfg(test)]
mod memory_tests;
#[cfg(test)]
mod outbox_tests;
#[cfg(test)]
mod quota_tests;
#[cfg(test)]
mod response_tests;
#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod wait_tests;
