//! The request's decision as Envoy's own tooling reads it: one line, written once per request
//! a policy guards, when its verdict is known (it is answered locally, or it goes on to the
//! upstream), and handed to the adapter with that step, which sets it as the stream's
//! property [`PROPERTY`] (Envoy's filter state `wasm.coordination_guard`, which access logs
//! print with `%FILTER_STATE(wasm.coordination_guard:PLAIN)%`).
//!
//! The line is logfmt with a fixed key order and no spaces inside a value:
//!
//! ```text
//! policy=<name> verdict=<verdict> limit=<name or -> remaining=<n or -> tenant=<t.hash or -> status=<n or ->
//! ```
//!
//! The verdicts and every field are listed in docs/design.md, "Decisions in access logs".
//! `tenant` is the tenant's hash tag as the Redis keys carry it (`t.<16 hex>`), never the raw
//! id; `status` is the status of the filter's own answer (`-` for a request it forwarded).

use crate::engine::flow::{Flow, Pcx};
use crate::http::local_reply::{LocalResponse, Problem};
use crate::redis::keys;
use crate::support::text::push_u64;

/// The property the decision is set under (Envoy keeps it as `wasm.coordination_guard`).
pub const PROPERTY: &str = "coordination_guard";

/// What the filter decided for a request, one word each in the line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Forwarded: every limit admitted it, and the record and the lease let it go.
    Allowed,
    /// `429`: a rate limit or a concurrency limit rejected it.
    Rejected,
    /// Forwarded, but a shadow limit would have rejected it.
    ShadowRejected,
    /// Answered from a completed idempotency record.
    Replayed,
    /// `409` (or the configured status): the same request is still in progress.
    InProgress,
    /// `422` (or the configured status): the key was used for a different request.
    Conflict,
    /// `409`: another request holds the lease.
    Locked,
    /// Redis did not answer and the policy fails open: forwarded.
    FailedOpen,
    /// Redis did not answer and the policy fails closed (`503`), or a request that waited saw
    /// the record in progress or the lease busy before its poll failed (that answer).
    FailedClosed,
    /// The filter's own answer to input it does not take (`400`, `401`, `408`, `413`).
    Refused,
    /// `503 guard_overloaded`: the worker's memory budget cannot hold what the request needs.
    Overloaded,
}

impl Verdict {
    pub(crate) fn word(self) -> &'static str {
        match self {
            Verdict::Allowed => "allowed",
            Verdict::Rejected => "rejected",
            Verdict::ShadowRejected => "shadow_rejected",
            Verdict::Replayed => "replayed",
            Verdict::InProgress => "in_progress",
            Verdict::Conflict => "conflict",
            Verdict::Locked => "locked",
            Verdict::FailedOpen => "failed_open",
            Verdict::FailedClosed => "failed_closed",
            Verdict::Refused => "refused",
            Verdict::Overloaded => "overloaded",
        }
    }

    /// The verdict of a local answer, by the problem it reports (a replay reports none).
    pub(crate) fn of_answer(response: &LocalResponse) -> Verdict {
        let Some(problem) = response.problem else {
            return Verdict::Replayed;
        };
        match problem {
            Problem::RateLimited | Problem::ConcurrencyLimited => Verdict::Rejected,
            Problem::GuardUnavailable => Verdict::FailedClosed,
            Problem::GuardOverloaded => Verdict::Overloaded,
            Problem::IdempotencyKeyInUse { .. } => Verdict::InProgress,
            Problem::IdempotencyKeyConflict { .. } => Verdict::Conflict,
            Problem::ResourceLocked => Verdict::Locked,
            Problem::InvalidCost
            | Problem::MissingTenant
            | Problem::AmbiguousTenant
            | Problem::AmbiguousPrincipal
            | Problem::AmbiguousPath
            | Problem::AmbiguousSelector
            | Problem::IdempotencyKeyMissing
            | Problem::IdempotencyKeyInvalid
            | Problem::RequestBodyTooLarge
            | Problem::RequestBodyTimeout
            | Problem::LeaseResourceMissing => Verdict::Refused,
        }
    }
}

/// A verdict reached during an event, with the status of the filter's answer (`None`: the
/// request was forwarded); written into the line when the event's step is handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Decided {
    pub(crate) verdict: Verdict,
    pub(crate) status: Option<u32>,
}

impl Flow {
    /// The decision line of the verdict `decided`, for this request's policy.
    pub(super) fn decision_line(&self, at: &Pcx<'_>, mut decided: Decided) -> String {
        if decided.verdict == Verdict::Allowed && self.shadow_rejected(at) {
            decided.verdict = Verdict::ShadowRejected;
        }
        let policy = &at.policy.name;
        let limit = self.deciding_limit(at, decided.verdict);
        let limit_name = limit.map_or("-", |(i, _)| {
            at.policy
                .rate_limits
                .get(i)
                .map_or("-", |l| l.name.as_str())
        });
        let mut line = String::with_capacity(112 + policy.len() + limit_name.len());
        line.push_str("policy=");
        line.push_str(policy);
        line.push_str(" verdict=");
        line.push_str(decided.verdict.word());
        line.push_str(" limit=");
        line.push_str(limit_name);
        line.push_str(" remaining=");
        match limit {
            Some((_, remaining)) => push_u64(&mut line, remaining),
            None => line.push('-'),
        }
        line.push_str(" tenant=");
        self.push_tenant_tag(&mut line);
        line.push_str(" status=");
        match decided.status {
            Some(status) => push_u64(&mut line, u64::from(status)),
            None => line.push('-'),
        }
        line
    }

    /// The rate limit the line names, and what it has remaining: for a rejection the enforced
    /// limit that rejected (the one the over-limit cache knew to reject, with nothing
    /// remaining), for a shadow rejection the shadow limit that would have, else the enforced
    /// limit with the least remaining. `None` when no limit was answered.
    fn deciding_limit(&self, at: &Pcx<'_>, verdict: Verdict) -> Option<(usize, u64)> {
        if let Some(i) = self.admission.cached_rejection_limit() {
            return Some((i, 0));
        }
        let answered = || {
            at.policy
                .rate_limits
                .iter()
                .zip(self.admission.all())
                .enumerate()
                .filter_map(|(i, (l, s))| Some((i, l.shadow, s.state?)))
        };
        let over = |shadow: bool| {
            answered()
                .find(|&(_, sh, s)| sh == shadow && !s.allowed)
                .map(|(i, _, s)| (i, s.remaining))
        };
        match verdict {
            Verdict::Rejected => over(false),
            Verdict::ShadowRejected => over(true),
            _ => answered()
                .filter(|&(_, shadow, _)| !shadow)
                .min_by_key(|&(_, _, s)| s.remaining)
                .map(|(i, _, s)| (i, s.remaining)),
        }
    }

    /// Whether a shadow limit would have rejected the request.
    fn shadow_rejected(&self, at: &Pcx<'_>) -> bool {
        at.policy
            .rate_limits
            .iter()
            .zip(self.admission.all())
            .any(|(l, s)| l.shadow && s.state.is_some_and(|s| !s.allowed))
    }

    /// The tenant's hash tag, `-` when the request was answered before its tenant was known.
    /// A tenant-scoped limit's key already carries the tag: it is copied from there rather
    /// than hashed again.
    fn push_tenant_tag(&self, out: &mut String) {
        let from_key = self
            .admission
            .all()
            .iter()
            .map(|s| s.key.tag())
            .find(|tag| tag.starts_with("t."));
        match (from_key, &self.caller) {
            (Some(tag), _) => out.push_str(tag),
            (None, Some(caller)) => keys::push_tenant_tag(out, &caller.tenant),
            (None, None) => out.push('-'),
        }
    }
}
