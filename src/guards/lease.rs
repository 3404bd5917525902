//! The lease guard of one request: the resource it names, whether it holds the lease, how it
//! waits for a busy one (jittered, doubling polls up to `max_wait`), when it extends it, and
//! how it gives it back. It decides; the flow sends.

use crate::config::{Lease, OnBusy, Selector};
use crate::guards::background::{Background, Holder};
use crate::guards::backoff::Backoff;
use crate::guards::context::{Pcx, Purpose};
use crate::http::identity::Caller;
use crate::http::local_reply::{self, LocalResponse, Problem};
use crate::http::request::Request;
use crate::http::selectors::selector_value;
use crate::redis::keys;
use crate::redis::resp::Reply;
use crate::redis::scripts::acquire::{self, LeaseAcquire, LeaseAnswer};
use crate::redis::scripts::lease;
use crate::redis::scripts::record::{outcome, Outcome};
use crate::redis::ScriptCall;
use crate::support::metrics::{LeaseMetrics, MetricSink};

/// First and largest pause between polls of a busy lease (`on_busy: wait`).
pub(crate) const LEASE_POLL_FIRST_MS: u64 = 25;
pub(crate) const LEASE_POLL_MAX_MS: u64 = 100;

/// What names a lease's resource for this caller and request: each of the lease's `resource`
/// selectors with its value; `Err` spells the first one the request does not carry.
pub fn resource_parts<'a>(
    lease: &'a Lease,
    caller: &'a Caller,
    req: &'a Request,
) -> Result<Vec<(&'a Selector, Option<&'a str>)>, String> {
    let mut parts = Vec::with_capacity(lease.resource.len());
    for sel in &lease.resource {
        match selector_value(sel, caller, req) {
            Some(v) => parts.push((sel, Some(v))),
            None => return Err(sel.spelling()),
        }
    }
    Ok(parts)
}

/// The lease key and the fencing counter key of the resource `parts` names, in the hash tag
/// `tenant_tag` of policy `policy`: the resource hash is the scope hash of its parts.
pub fn resource_keys<'v, 's>(
    prefix: &str,
    tenant_tag: &str,
    policy: &str,
    parts: impl IntoIterator<Item = (&'s Selector, Option<&'v str>)>,
) -> (String, String) {
    keys::lease_keys(prefix, tenant_tag, policy, &keys::scope_hash(parts))
}

#[derive(Debug)]
pub(crate) struct LeaseGuard {
    pub(crate) acquire: LeaseAcquire,
    /// We hold the lease (and must release it).
    pub(crate) held: bool,
    /// The answer of an acquire that rode with the rate limits, until they are decided.
    pub(crate) answer: Option<LeaseAnswer>,
    wait: Backoff,
    /// The busy lease's remaining time at the last busy answer, and when that answer came
    /// (for the answer of a waiter whose next poll fails: the time since is taken off).
    busy_pttl_ms: i64,
    busy_seen_ms: u64,
    /// When to extend the lease next (`extend: true`).
    next_extend_ms: Option<u64>,
}

/// What the lease answer means for the request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum LeaseDecision {
    /// Go on; with the fencing header to set on the request, if acquired.
    Forward(Option<(String, String)>),
    /// Busy, and waiting: poll again at this time.
    PollAt(u64),
    /// Busy: answer `423` (the rate-limit headers still to be added).
    Busy(LocalResponse),
}

impl LeaseGuard {
    /// Names the lease's resource for this request; `Err` names the missing selector.
    pub(crate) fn prepare(
        at: &Pcx<'_>,
        caller: &Caller,
        req: &Request,
        owner: &str,
    ) -> Result<Option<LeaseGuard>, String> {
        let Some(lease) = at.policy.lease.as_ref() else {
            return Ok(None);
        };
        let parts = resource_parts(lease, caller, req)?;
        let prefix = &at.rt.config.redis.key_prefix;
        let tag = keys::tenant_tag(&caller.tenant);
        let cancel_key = keys::cancel_key(prefix, &tag, &at.policy.name, owner);
        let (key, fence_key) = resource_keys(prefix, &tag, &at.policy.name, parts);
        Ok(Some(LeaseGuard {
            acquire: LeaseAcquire {
                key,
                fence_key,
                tag,
                owner: owner.to_string(),
                ttl_ms: lease.ttl_ms,
                fence_ttl_ms: lease.fence_ttl_ms,
                cancel_key,
            },
            held: false,
            answer: None,
            wait: Backoff::new(LEASE_POLL_FIRST_MS, LEASE_POLL_MAX_MS, owner),
            busy_pttl_ms: 0,
            busy_seen_ms: 0,
            next_extend_ms: None,
        }))
    }

    /// The lease answer, once rate limits and idempotency let the request through.
    pub(crate) fn decide(&mut self, at: &Pcx<'_>, answer: LeaseAnswer) -> LeaseDecision {
        let (Some(cfg), Some(lm)) = (at.policy.lease.as_ref(), at.pm.lease.as_ref()) else {
            return LeaseDecision::Forward(None);
        };
        match answer {
            LeaseAnswer::Skipped => LeaseDecision::Forward(None),
            LeaseAnswer::Acquired { token } => {
                at.m.increment(lm.acquired);
                if self.wait.waited() {
                    at.m.increment(lm.waited);
                }
                self.held = true;
                if cfg.extend {
                    self.next_extend_ms = Some(at.now_ms.saturating_add(cfg.ttl_ms / 2));
                }
                LeaseDecision::Forward(Some((cfg.fencing_header.clone(), token.to_string())))
            }
            LeaseAnswer::Busy { pttl_ms } => match self.next_poll(cfg, at.now_ms) {
                Some(at_ms) => {
                    self.busy_pttl_ms = pttl_ms;
                    self.busy_seen_ms = at.now_ms;
                    LeaseDecision::PollAt(at_ms)
                }
                None => LeaseDecision::Busy(busy(lm, pttl_ms, at)),
            },
        }
    }

    /// The answer of a request that waited for the lease (found it busy) and does not hold
    /// it, when its poll failed: the busy answer it would give at `max_wait`.
    pub(crate) fn waiting_answer(&self, at: &Pcx<'_>) -> Option<LocalResponse> {
        if !self.wait.waited() || self.held {
            return None;
        }
        let lm = at.pm.lease.as_ref()?;
        let since = at.now_ms.saturating_sub(self.busy_seen_ms);
        let left = self
            .busy_pttl_ms
            .saturating_sub(i64::try_from(since).unwrap_or(i64::MAX));
        Some(busy(lm, left.max(1), at))
    }

    /// With `on_busy: wait` and time left: when to poll again (the last poll lands exactly
    /// at `max_wait`).
    fn next_poll(&mut self, cfg: &Lease, now_ms: u64) -> Option<u64> {
        if cfg.on_busy != OnBusy::Wait {
            return None;
        }
        self.wait.next_poll(now_ms, cfg.max_wait_ms)
    }

    /// The acquire answered for the lease (kept until the rate limits are decided).
    pub(crate) fn answered(&mut self, answer: LeaseAnswer) {
        if let LeaseAnswer::Acquired { .. } = answer {
            self.held = true;
        }
        self.answer = Some(answer);
    }

    /// The lease-only acquire that polls a busy lease again.
    pub(crate) fn poll_call(&self, nonce: &str) -> ScriptCall {
        acquire::lease_poll(&self.acquire, nonce)
    }

    /// The release the response waits for, so the client's next request finds the resource
    /// free.
    pub(crate) fn release_now(&mut self) -> Option<ScriptCall> {
        if !self.held {
            return None;
        }
        self.held = false;
        self.next_extend_ms = None;
        Some(lease::release(&self.acquire, None))
    }

    /// The client left while the service may still be working: the lease is left to expire
    /// after its TTL, no longer extended (see `gone.rs`). Whether the request held it.
    pub(crate) fn orphan(&mut self) -> bool {
        self.next_extend_ms = None;
        std::mem::take(&mut self.held)
    }

    /// Redis answered our release: `1` gave the lease back (counted either way). The lease's
    /// key when it did, for the requests of this worker that wait for it.
    pub(crate) fn released(
        &self,
        at: &Pcx<'_>,
        reply: &crate::redis::resp::Reply,
    ) -> Option<String> {
        if let Some(lm) = at.pm.lease.as_ref() {
            count_lease(lm, Purpose::LeaseRelease, reply, &at.policy.name, at.m);
        }
        (reply.as_int() == Some(1)).then(|| self.acquire.key.clone())
    }

    /// Extends a held lease at half its TTL while the request is in flight, when due.
    pub(crate) fn extend(&mut self, policy: usize, now_ms: u64) -> Option<Background> {
        if !self.held {
            return None;
        }
        let due = self.next_extend_ms.filter(|d| now_ms >= *d)?;
        let half = (self.acquire.ttl_ms / 2).max(1);
        self.next_extend_ms = Some(due.max(now_ms).saturating_add(half));
        let call = lease::extend(&self.acquire);
        Some(Background::new(
            policy,
            Purpose::LeaseExtend,
            call,
            String::new(),
        ))
    }

    /// When the lease is to be extended next.
    pub(crate) fn next_extend_ms(&self) -> Option<u64> {
        self.next_extend_ms
    }
}

/// A held lease, given back from the root (the call must outlive the stream); or one an
/// acquire that may still run (or may have run) may hold. It is no longer extended.
impl Holder for LeaseGuard {
    fn held(&mut self) -> &mut bool {
        &mut self.held
    }

    fn release(&mut self, marker_ttl_ms: Option<u64>) -> (Purpose, ScriptCall, String) {
        self.next_extend_ms = None;
        let call = lease::release(&self.acquire, marker_ttl_ms);
        (Purpose::LeaseRelease, call, String::new())
    }
}

/// The `409 resource_locked` for a busy lease, counted. Its `Retry-After` is the holder's
/// remaining time: the lease's PTTL as the script read it (`pttl_ms`), in whole seconds
/// rounded up, at least 1. The lease frees then at the latest, unless its holder extends it
/// (`extend: true`, while its request runs), or earlier when the holder gives it back.
fn busy(lm: &LeaseMetrics, pttl_ms: i64, at: &Pcx<'_>) -> LocalResponse {
    at.m.increment(lm.busy);
    let retry = local_reply::whole_secs(u64::try_from(pttl_ms).unwrap_or(1));
    local_reply::problem(
        &at.rt.config.problem_type_base,
        Problem::ResourceLocked,
        &format!("another request holds this resource; retry after {retry} s"),
        &[],
        vec![("retry-after".to_string(), retry.to_string())],
    )
}

/// Counts what a lease release (`1` released) or extension (`1` extended) found; `0` (expired)
/// and `-1` (another owner) mean the lease was lost.
pub(crate) fn count_lease(
    lm: &LeaseMetrics,
    purpose: Purpose,
    reply: &Reply,
    policy: &str,
    m: &dyn MetricSink,
) {
    match (purpose, outcome(reply)) {
        (Purpose::LeaseRelease, Outcome::Done) => m.increment(lm.released),
        (Purpose::LeaseExtend, Outcome::Done) => m.increment(lm.extended),
        (_, Outcome::NotOurs) => {
            m.increment(lm.lost);
            log::warn!(
                "policy {policy}: a lease was lost (it expired{}); the upstream's fencing check protects the data",
                if reply.as_int() == Some(-1) { " and another request holds it" } else { "" }
            );
        }
        _ => log::warn!("policy {policy}: unexpected answer to a lease update: {reply:?}"),
    }
}
