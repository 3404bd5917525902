//! The per-request state machine. Host callbacks feed it events, each with its [`Cx`]; it
//! never does I/O and answers each event with a [`Step`]: what the stream does next, and
//! everything the event produced beside it (headers to set, calls for the root, a lease or
//! record given back), handed out once.
//!
//! The flow orders its guards, each a sub-machine with its own state that decides and never
//! calls back: rate-limit admission ([`crate::guards::ratelimit::admission`]), the
//! idempotency record ([`crate::guards::idempotency::guard`], its response side in
//! [`crate::guards::idempotency::capture`]), the lease ([`crate::guards::lease`]). Rate limits
//! go first, then the record (in the same script call where they share a hash slot), then
//! the lease. The calls they make are kept in one table ([`crate::engine::calls`]); those
//! that must outlive the request go to the root's [`Outbox`].
//!
//! Where to read each concern:
//!
//! - this file: the flow's state ([`Phase`], the calls' tags), how an event becomes a
//!   [`Step`], and what the worker asks of a flow between events;
//! - `step.rs`: what a step carries;
//! - `decision.rs`: the request's decision as Envoy's access log reads it (handed out once,
//!   with the step that reached its verdict);
//! - `request.rs`: the request's events (headers, body, trailers) up to the first acquire;
//! - `checks.rs`: the request's own problems, answered before any guard runs;
//! - `decide.rs`: the decision round (limits, then the record, then the lease; waits and
//!   polls; the failure mode; giving back what the request will not use);
//! - `answers.rs`: Redis's answers to the stream's calls;
//! - `watchdog.rs`: the tick (deadlines of bodies, calls and waits; lease extension);
//! - `upstream.rs`: the upstream's response (headers, body, trailers) and the record it
//!   settles;
//! - `gone.rs`: the stream's end, and a client that hangs up;
//! - `concurrency.rs`: the concurrency slots the request holds.

mod answers;
pub(crate) mod checks;
mod concurrency;
mod decide;
mod decision;
mod gone;
mod request;
mod step;
mod upstream;
mod watchdog;

pub(crate) use crate::engine::outbox::Outbox;
pub(crate) use crate::guards::background::Background;
pub use crate::guards::context::{
    Cx, Outgoing, Pcx, Purpose, Runtime, BODY_IDLE_TIMEOUT_MS, FINGERPRINT_HEADER,
    MARKER_MIN_TTL_MS,
};
pub use decision::PROPERTY;
pub use step::{Move, Output, Step};

use crate::engine::calls::Calls;
use crate::guards::idempotency::capture::BodyIntake;
use crate::guards::idempotency::guard::IdempotencyGuard;
use crate::guards::lease::LeaseGuard;
use crate::guards::ratelimit::admission::Admission;
use crate::guards::ratelimit::charge::Meter;
use crate::http::identity::Caller;
use crate::http::local_reply::{self, LocalResponse};
use crate::http::request::Request;
use crate::redis::scripts::acquire;
use decision::{Decided, Verdict};
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
    Response(BodyIntake),
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
    record: bool,
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
            record: false,
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
            record: g.record,
            lease: g.lease,
            record_unsettled: g.record,
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
    record: Option<IdempotencyGuard>,
    lease: Option<LeaseGuard>,
    nonce: Token,
    /// The owner token (names the cancellation marker).
    owner: Token,
    /// When the concurrency slots held are to be extended next.
    slots_extend_ms: Option<u64>,
    /// What the response says the request cost (limits with `charge`).
    meter: Meter,
    kind: StreamKind,
    /// Who is calling, once identified (kept for the decision's tenant tag).
    caller: Option<Caller>,
    /// The request's verdict, once reached; `decision_out`: its line was handed out (with
    /// the step of the event that reached it, see `decision.rs`).
    decided: Option<Decided>,
    decision_out: bool,
    /// Redis did not answer the acquire and the failure mode decided.
    failed: bool,
    /// The rate-limit headers (`RateLimit-Policy`, `RateLimit`) of a request that waits for
    /// a lease or a record: the response gets them once the request goes on.
    limit_headers: Vec<(String, String)>,
    /// Headers to set on the request before it goes upstream (the fingerprint, the fencing
    /// token), gathered as the guards decide: they leave with the step that forwards it.
    upstream_headers: Vec<(String, String)>,
    /// What the event being handled produced so far, handed out with its step
    /// ([`Flow::step`]); empty between events.
    out: Output,
    /// The client left while the acquire was in flight, and the flow stays to read its answer
    /// (see `gone.rs`): it never forwards, answers or sends again.
    gone: bool,
}

impl Phase {
    /// How the record takes the response body in, while it does.
    fn intake(&self) -> Option<BodyIntake> {
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

    /// Runs one event: `event` moves the flow and says what the stream does next; the step
    /// hands that out with everything the event produced on the way. Every public event goes
    /// through here once (an event never calls another public one: its output would leave
    /// with the inner step).
    /// The verdict an event reached leaves with its step as the decision line.
    fn step(&mut self, cx: &Cx<'_>, event: impl FnOnce(&mut Flow) -> Move) -> Step {
        let next = event(self);
        if let Some(decided) = self.decided.filter(|_| !self.decision_out) {
            self.decision_out = true;
            self.out.decision = self.at(cx).map(|at| self.decision_line(&at, decided));
        }
        Step {
            next,
            out: std::mem::take(&mut self.out),
        }
    }

    /// The request goes on to the upstream, with the headers the guards gathered for it and
    /// `response_headers` for its response.
    fn forward(&mut self, response_headers: Vec<(String, String)>) -> Move {
        self.decide_once(Verdict::Allowed, None);
        self.out.upstream_headers = std::mem::take(&mut self.upstream_headers);
        self.out.response_headers = response_headers;
        self.phase = Phase::Forwarded;
        Move::Continue
    }

    /// Answers locally; a gRPC client gets the problem as a gRPC status (see
    /// [`local_reply::for_grpc`]), anyone else the problem+json answer as it is.
    fn answer(&mut self, response: impl Into<Rc<LocalResponse>>) -> Move {
        self.phase = Phase::Answered;
        self.limit_headers.clear();
        let response = response.into();
        self.decide_once(Verdict::of_answer(&response), Some(response.status));
        Move::Respond(if self.kind.grpc {
            local_reply::for_grpc(response)
        } else {
            response
        })
    }

    /// Notes the request's verdict (`status`: of the filter's own answer), the first time
    /// only: a request is decided once. After a failed acquire the failure mode names it.
    fn decide_once(&mut self, verdict: Verdict, status: Option<u32>) {
        if self.decided.is_some() || self.gone {
            return;
        }
        let verdict = match (self.failed, verdict, status) {
            (true, Verdict::Overloaded, _) => Verdict::Overloaded,
            (true, _, None) => Verdict::FailedOpen,
            (true, _, Some(_)) => Verdict::FailedClosed,
            (false, v, _) => v,
        };
        self.decided = Some(Decided { verdict, status });
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

    /// This flow as a fresh one for the next stream, but for the room of its limits' and
    /// calls' lists, kept emptied: a reused stream box allocates neither again.
    pub(crate) fn recycle(&mut self) {
        let admission = std::mem::take(&mut self.admission).emptied();
        let calls = std::mem::take(&mut self.calls).emptied();
        *self = Flow::default();
        self.admission = admission;
        self.calls = calls;
    }

    /// Answered locally before any Redis call (an over-limit cache or leased-quota
    /// rejection, a refused input): nothing was taken, so the stream's end owes nothing and
    /// its later events need not reach the flow (when the step that answered handed nothing
    /// to the root either).
    pub(crate) fn answered_without_calls(&self) -> bool {
        matches!(self.phase, Phase::Answered) && self.calls.none_made()
    }

    /// Forwarded with nothing to settle at its end: no record, lease or concurrency limit, no
    /// charge, no call in flight. Once its response headers have their rate-limit headers,
    /// the stream's later events need not reach the flow.
    pub(crate) fn owes_nothing_at_end(&self, cx: &Cx<'_>) -> bool {
        matches!(self.phase, Phase::Forwarded)
            && self.record.is_none()
            && self.lease.is_none()
            && self.calls.open().next().is_none()
            && self.at(cx).is_some_and(|at| {
                !Meter::wanted(at.policy) && !at.policy.rate_limits.iter().any(|l| l.concurrency())
            })
    }

    /// The request body is being held (buffering or deciding).
    pub(crate) fn holds_request(&self) -> bool {
        matches!(
            self.phase,
            Phase::Buffering { .. }
                | Phase::Acquiring { .. }
                | Phase::LeaseWaiting { .. }
                | Phase::RecordWaiting { .. }
        )
    }
}

#[cfg(test)]
mod idempotency_tests;
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
mod sse_tests;
#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod wait_tests;
