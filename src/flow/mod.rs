//! The per-request state machine. Host callbacks feed it events; it never does I/O and
//! answers with the next [`Step`] for the adapter to carry out.
//!
//! Order of the guards of one policy: rate limits, then the idempotency acquire (in the same
//! script call where they share a hash slot). A request that owns an idempotency record
//! completes or releases it when the upstream's response arrives.

mod background;

pub use background::{take_due, Background, Next};

use crate::config::{
    Completion, Config, FailureMode, FingerprintPart, IdSource, Idempotency, Lease, OnBusy, Policy,
    Replay,
};
use crate::grpc;
use crate::idempotency::fingerprint::{canonical_body, is_json, Fingerprint};
use crate::idempotency::header::{parse_key, KeyError};
use crate::idempotency::record::{Record, StoredResponse};
use crate::keys;
use crate::keys::LimitKey;
use crate::local::overlimit::{OverLimitCache, SharedStore};
use crate::local::quota::{LeasedQuota, QUOTA_SLOTS};
use crate::lograte::{WarnKind, Warnings};
use crate::lua::acquire::{self, IdemAcquire, IdemAnswer, LeaseAcquire, LeaseAnswer};
use crate::lua::{lease, record, ScriptId, Scripts};
use crate::metrics::{IdemMetrics, LeaseMetrics, MetricSink, Metrics, PolicyMetrics};
use crate::ratelimit::{self, KeyMemo, LimitState, Verdict, KEY_MEMO_SLOTS};
use crate::redis::{resend_by_eval, resp::Reply, CallError, ScriptCall};
use crate::request::{
    identify, policy_index, repeated_input, selector_value, Caller, Request, Selected, TenantError,
};
use crate::respond::{self, LocalResponse, Member, Problem};

/// Everything a VM keeps after `on_configure`.
pub struct Runtime {
    pub config: Config,
    pub scripts: Scripts,
    pub metrics: Metrics,
    pub over_limit: OverLimitCache,
    pub quota: LeasedQuota,
    pub keys: KeyMemo,
    /// Request headers only the filter may set (the fingerprint, every lease's fencing
    /// header): removed from every request the filter sees, guarded or not, so a client can
    /// never hand the service a value of its own.
    pub reserved_headers: Vec<String>,
    /// This worker's rate limiter of repeated warnings.
    pub warnings: Warnings,
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
        Runtime {
            reserved_headers,
            config,
            scripts: Scripts::load(),
            metrics,
            over_limit,
            quota: LeasedQuota::new(QUOTA_SLOTS),
            keys: KeyMemo::new(KEY_MEMO_SLOTS),
            warnings: Warnings::default(),
        }
    }
}

/// The header that carries the request fingerprint to the upstream.
pub const FINGERPRINT_HEADER: &str = "x-idempotency-fingerprint";
/// Marks a replayed response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// One gateway request to send: `slot` comes back with the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub slot: usize,
    pub script: ScriptId,
    pub call: ScriptCall,
    /// `EVALSHA` (else `EVAL` with the source, after `NOSCRIPT`).
    pub by_sha: bool,
}

impl Outgoing {
    /// The gateway request body.
    pub fn encode(&self, scripts: &Scripts) -> Vec<u8> {
        self.call.encode(scripts.get(self.script), self.by_sha)
    }
}

/// What the adapter does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Let the stream go on (resume it if it is paused).
    Continue,
    /// Send these calls and keep the stream paused.
    Dispatch(Vec<Outgoing>),
    /// Keep the stream paused.
    Wait,
    /// Answer the client locally.
    Respond(LocalResponse),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing to do (no policy, or the request went on).
    Idle,
    /// Buffering the request body to fingerprint it.
    Buffering,
    /// Acquire calls are outstanding; the request is paused.
    Acquiring,
    /// The lease is busy and `on_busy: wait`: polling again at the deadline.
    LeaseWaiting,
    /// The request went on to the upstream.
    Forwarded,
    /// Buffering the response body to store it (sync completion).
    BufferingResponse,
    /// Copying the response body as it passes (async completion).
    CopyingResponse,
    /// The response body is larger than `max_response_body`: it passes untouched and a
    /// reference record is stored once its end of stream is seen.
    StreamingResponse,
    /// The complete/release call is outstanding; the response is paused.
    Completing,
    /// Decided; later answers are ignored.
    Done,
}

/// Why a call was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Acquire,
    /// A lease-only acquire while waiting for a busy lease.
    LeaseRetry,
    Complete,
    Release,
    LeaseRelease,
    LeaseExtend,
}

impl Purpose {
    /// The script a call of this purpose runs.
    pub fn script(self) -> ScriptId {
        match self {
            Purpose::Acquire | Purpose::LeaseRetry => ScriptId::Acquire,
            Purpose::Complete => ScriptId::Complete,
            Purpose::Release => ScriptId::Release,
            Purpose::LeaseRelease => ScriptId::LeaseRelease,
            Purpose::LeaseExtend => ScriptId::LeaseExtend,
        }
    }
}

#[derive(Debug)]
struct Pending {
    purpose: Purpose,
    script: ScriptId,
    call: ScriptCall,
    /// Rate limits (indices into the policy's) this call answers for.
    limits: Vec<usize>,
    idem: bool,
    lease: bool,
    by_sha: bool,
    sent_ms: u64,
    done: bool,
    /// An acquire that may have written a record (`record_unsettled`) or a lease
    /// (`lease_unsettled`) this request does not know of: not answered yet, or failed in a
    /// way that may have run in Redis. Its release then carries the owner's cancellation
    /// marker; once that release is handed to the root, the flag is cleared.
    record_unsettled: bool,
    lease_unsettled: bool,
}

/// The idempotency state of a request that uses a key.
#[derive(Debug)]
struct Idem {
    acquire: IdemAcquire,
    /// Hash of the client's key, for logs.
    key_hash: String,
    /// We hold the `PROCESSING` record.
    owned: bool,
    /// The stored response being assembled.
    status: u32,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// The body is not stored (larger than `max_response_body`): a reference record.
    too_large: bool,
    /// The response's `content-length`, if it declared one.
    declared: Option<u64>,
    /// Bytes of the response body let through so far while it streams.
    passed: u64,
    /// The trailers stored with the response (gRPC status, `replay_trailers`).
    trailers: Vec<(String, String)>,
}

/// The lease state of a request on a policy with `lease`.
#[derive(Debug)]
struct LeaseState {
    acquire: LeaseAcquire,
    /// We hold the lease (and must release it).
    held: bool,
    /// While waiting for a busy lease: give up at this time.
    wait_until_ms: u64,
    backoff_ms: u64,
    /// The jitter's state, seeded from the owner token: waiters that met the same busy lease
    /// poll at different times instead of in lockstep.
    jitter: u64,
    waited: bool,
    /// When to extend the lease next (`extend: true`).
    next_extend_ms: Option<u64>,
}

/// The request parts kept while the body is buffered.
#[derive(Debug)]
struct Held {
    caller: Caller,
    req: Request,
    nonce: String,
}

#[derive(Debug)]
pub struct Flow {
    policy: usize,
    phase: Phase,
    pending: Vec<Pending>,
    states: Vec<Option<LimitState>>,
    idem_answer: Option<IdemAnswer>,
    idem: Option<Idem>,
    lease: Option<LeaseState>,
    lease_answer: Option<LeaseAnswer>,
    held: Option<Held>,
    nonce: String,
    /// The Redis key of each rate limit (policy order), for the over-limit cache.
    limit_keys: Vec<LimitKey>,
    /// Leased limits admitted from this worker's slice (no Redis call for them).
    local: Vec<bool>,
    /// Slices Redis granted to leased limits in this request's acquire (0: none).
    granted: Vec<u64>,
    /// The record/lease call, sent once the rate limits of the other slots admitted.
    deferred: Option<acquire::Group>,
    deadline_ms: u64,
    forwarded: bool,
    /// The request asks to switch protocols (`Upgrade`, e.g. WebSocket) or is a `CONNECT`.
    upgrade: bool,
    connect: bool,
    /// The response is a stream that need not end (an accepted upgrade or tunnel, an event
    /// stream): never buffered, and a held lease stays held (and extended) until it ends.
    open_ended: bool,
    response_seen: bool,
    /// The request is gRPC (Envoy answers it with gRPC local replies).
    grpc: bool,
    response_headers: Vec<(String, String)>,
    upstream_headers: Vec<(String, String)>,
    background: Vec<Background>,
    /// The lease key this request gave back, until the adapter wakes its waiters.
    freed_lease: Option<String>,
}

impl Default for Flow {
    fn default() -> Self {
        Flow {
            policy: 0,
            phase: Phase::Idle,
            pending: Vec::new(),
            states: Vec::new(),
            idem_answer: None,
            idem: None,
            lease: None,
            lease_answer: None,
            held: None,
            nonce: String::new(),
            limit_keys: Vec::new(),
            local: Vec::new(),
            granted: Vec::new(),
            deferred: None,
            deadline_ms: 0,
            forwarded: false,
            upgrade: false,
            connect: false,
            open_ended: false,
            response_seen: false,
            grpc: false,
            response_headers: Vec::new(),
            upstream_headers: Vec::new(),
            background: Vec::new(),
            freed_lease: None,
        }
    }
}

/// The least TTL of a cancellation marker (see [`Flow::marker_ttl_ms`]): longer than the
/// whole retry window of a release, so every retry finds the marker of the ones before.
pub const MARKER_MIN_TTL_MS: u64 = 60_000;

/// First and largest pause between polls of a busy lease (`on_busy: wait`).
pub const LEASE_POLL_FIRST_MS: u64 = 25;
pub const LEASE_POLL_MAX_MS: u64 = 100;

/// The pause before the next poll of a busy lease: between half the backoff and all of it
/// ("equal jitter"), from a xorshift step of `state`.
fn jittered(backoff_ms: u64, state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    let half = backoff_ms / 2;
    half + x % (backoff_ms - half + 1)
}

/// A non-zero jitter seed from a token (FNV-1a).
fn seed(token: &str) -> u64 {
    let h = token.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    h.max(1)
}

/// How long the filter waits for the next piece of a request body it must fingerprint.
pub const BODY_IDLE_TIMEOUT_MS: u64 = 10_000;

/// Envoy's `response.code_details` for local replies where the request never reached an
/// upstream, so a retry cannot repeat a side effect: the record is released.
const NEVER_SENT: &[&str] = &[
    "no_healthy_upstream",
    "cluster_not_found",
    "route_not_found",
    "connection_failure",
    "upstream_reset_before_response_started{connection_failure",
    "overflow",
    "maintenance_mode",
    "request_payload_too_large",
    "direct_response",
];

impl Flow {
    fn policy<'a>(&self, rt: &'a Runtime) -> Option<(&'a Policy, &'a PolicyMetrics)> {
        Some((
            rt.config.policies.get(self.policy)?,
            rt.metrics.policies.get(self.policy)?,
        ))
    }

    fn idem_metrics<'a>(&self, rt: &'a Runtime) -> Option<&'a IdemMetrics> {
        rt.metrics.policies.get(self.policy)?.idem.as_ref()
    }

    fn idem_config<'a>(&self, rt: &'a Runtime) -> Option<&'a Idempotency> {
        rt.config.policies.get(self.policy)?.idempotency.as_ref()
    }

    /// The policy's name and the client key's hash, as logs show them.
    fn policy_name<'a>(&self, rt: &'a Runtime) -> &'a str {
        rt.config
            .policies
            .get(self.policy)
            .map_or("", |p| p.name.as_str())
    }

    fn key_hash(&self) -> &str {
        self.idem.as_ref().map_or("", |i| i.key_hash.as_str())
    }

    fn lease_config<'a>(&self, rt: &'a Runtime) -> Option<&'a Lease> {
        rt.config.policies.get(self.policy)?.lease.as_ref()
    }

    fn lease_metrics<'a>(&self, rt: &'a Runtime) -> Option<&'a LeaseMetrics> {
        rt.metrics.policies.get(self.policy)?.lease.as_ref()
    }

    /// Names the lease's resource for this request; `Err` names the missing selector.
    fn prepare_lease(
        &mut self,
        rt: &Runtime,
        caller: &Caller,
        req: &Request,
        owner: &str,
    ) -> Result<(), String> {
        let Some((policy, _)) = self.policy(rt) else {
            return Ok(());
        };
        let Some(lease) = policy.lease.as_ref() else {
            return Ok(());
        };
        let mut parts = Vec::with_capacity(lease.resource.len());
        for sel in &lease.resource {
            match selector_value(sel, caller, req) {
                Some(v) => parts.push((sel, Some(v))),
                None => return Err(sel.spelling()),
            }
        }
        let tag = keys::tenant_tag(&caller.tenant);
        let cancel_key = keys::cancel_key(&rt.config.redis.key_prefix, &tag, &policy.name, owner);
        let (key, fence_key) = keys::lease_keys(
            &rt.config.redis.key_prefix,
            &tag,
            &policy.name,
            &keys::scope_hash(parts),
        );
        self.lease = Some(LeaseState {
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
            wait_until_ms: 0,
            backoff_ms: LEASE_POLL_FIRST_MS,
            jitter: seed(owner),
            waited: false,
            next_extend_ms: None,
        });
        Ok(())
    }

    /// Request headers arrived. `owner` is a fresh random token for an idempotency record.
    #[allow(clippy::too_many_arguments)]
    pub fn on_request(
        &mut self,
        rt: &Runtime,
        req: Request,
        nonce: &str,
        owner: &str,
        end_of_stream: bool,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        match policy_index(&rt.config.policies, &mut &req) {
            Some(Selected::AmbiguousPath(index)) => {
                self.set_grpc(req.header("content-type"));
                self.on_ambiguous_path(rt, index, m)
            }
            Some(Selected::Policy(index)) => {
                self.on_policy_request(rt, index, req, nonce, owner, end_of_stream, now_ms, m)
            }
            None => Step::Continue,
        }
    }

    /// Whether the request is gRPC (`content-type: application/grpc…`), for a caller that
    /// answers it before [`Flow::on_policy_request`] (an ambiguous path).
    pub fn set_grpc(&mut self, content_type: Option<&str>) {
        self.grpc = grpc::is_grpc_content_type(content_type);
    }

    /// A request whose path reads more than one way, one of them guarded by policy `index`:
    /// refused, since the service may read it the way the guard did not.
    pub fn on_ambiguous_path(&mut self, rt: &Runtime, index: usize, m: &dyn MetricSink) -> Step {
        self.policy = index;
        if let Some((_, pm)) = self.policy(rt) {
            m.increment(pm.ambiguous_input);
        }
        self.answer(respond::problem(
            Problem::AmbiguousPath,
            "the request path has more than one reading (an encoded '/', a '\\', a NUL, a \
             broken or double escape, ';' parameters or '..' after '//'); send it in its \
             plain form",
            &[],
            Vec::new(),
        ))
    }

    /// [`Flow::on_request`] for a request the caller already matched to policy `index`.
    #[allow(clippy::too_many_arguments)]
    pub fn on_policy_request(
        &mut self,
        rt: &Runtime,
        index: usize,
        req: Request,
        nonce: &str,
        owner: &str,
        end_of_stream: bool,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        self.policy = index;
        self.grpc = grpc::is_grpc_content_type(req.header("content-type"));
        let Some((policy, pm)) = self.policy(rt) else {
            return Step::Continue;
        };
        let caller = match identify(&rt.config.identity, &req) {
            Ok(c) => c,
            Err(TenantError::Missing) => {
                m.increment(pm.missing_tenant);
                let source = &rt.config.identity.tenant;
                let detail = format!("this operation requires {}", source.describe());
                // A 401 carries a challenge (RFC 9110): the scheme names what is missing.
                let challenge = match source {
                    IdSource::Header(header) => format!("Tenant header=\"{header}\""),
                    IdSource::Metadata(_) => "Bearer".to_string(),
                };
                return self.answer(respond::problem(
                    Problem::MissingTenant,
                    &detail,
                    &[],
                    vec![("www-authenticate".into(), challenge)],
                ));
            }
            Err(TenantError::Repeated) => {
                m.increment(pm.missing_tenant);
                let detail = format!("{} must appear once", rt.config.identity.tenant.describe());
                return self.answer(respond::problem(
                    Problem::AmbiguousTenant,
                    &detail,
                    &[],
                    Vec::new(),
                ));
            }
            Err(TenantError::PrincipalRepeated) => {
                m.increment(pm.ambiguous_input);
                let detail = format!(
                    "{} must appear once",
                    rt.config.identity.principal.describe()
                );
                return self.answer(respond::problem(
                    Problem::AmbiguousPrincipal,
                    &detail,
                    &[],
                    Vec::new(),
                ));
            }
        };
        let selectors = policy
            .rate_limits
            .iter()
            .flat_map(|l| &l.by)
            .chain(policy.lease.iter().flat_map(|l| &l.resource));
        if let Some(sel) = repeated_input(selectors, &req) {
            m.increment(pm.ambiguous_input);
            let spelling = sel.spelling();
            return self.answer(respond::problem(
                Problem::AmbiguousSelector,
                &format!("{spelling} must appear at most once in the request"),
                &[("selector", Member::Str(&spelling))],
                Vec::new(),
            ));
        }
        self.connect = req.method == "CONNECT";
        self.upgrade = self.connect || req.header("upgrade").is_some();
        if let Err(missing) = self.prepare_lease(rt, &caller, &req, owner) {
            if let Some(lm) = pm.lease.as_ref() {
                m.increment(lm.missing_resource);
            }
            let detail = format!(
                "this operation needs the lease resource {missing}, which the request does not carry"
            );
            return self.answer(respond::problem(
                Problem::LeaseResourceMissing,
                &detail,
                &[("missing-selector", Member::Str(&missing))],
                Vec::new(),
            ));
        }
        if let Some(idem) = policy
            .idempotency
            .as_ref()
            .filter(|i| i.applies_to(&req.method))
        {
            let values: Vec<&str> = req
                .headers
                .iter()
                .filter(|(n, _)| *n == idem.header)
                .map(|(_, v)| v.as_str())
                .collect();
            let client_key = match parse_key(&values) {
                Ok(k) => Some(k),
                Err(KeyError::Missing) if !idem.required => None,
                Err(e) => {
                    let (metric, problem) = match e {
                        KeyError::Missing => (
                            pm.idem.as_ref().map(|i| i.missing_key),
                            Problem::IdempotencyKeyMissing,
                        ),
                        _ => (
                            pm.idem.as_ref().map(|i| i.invalid_key),
                            Problem::IdempotencyKeyInvalid,
                        ),
                    };
                    if let Some(id) = metric {
                        m.increment(id);
                    }
                    return self.answer(respond::problem(
                        problem,
                        &e.detail(&idem.header),
                        &[],
                        Vec::new(),
                    ));
                }
            };
            if let Some(client_key) = client_key {
                let declared = req
                    .header("content-length")
                    .and_then(|v| v.trim().parse::<u64>().ok());
                if idem.needs_body() && declared.is_some_and(|n| n > idem.max_request_body) {
                    return self.body_too_large(rt, m);
                }
                let key_hash = keys::client_key_hash(&client_key);
                let tag = keys::tenant_tag(&caller.tenant);
                let cancel_key =
                    keys::cancel_key(&rt.config.redis.key_prefix, &tag, &policy.name, owner);
                self.idem = Some(Idem {
                    acquire: IdemAcquire {
                        key: keys::idempotency_key(
                            &rt.config.redis.key_prefix,
                            &tag,
                            &policy.name,
                            &key_hash,
                        ),
                        tag,
                        fingerprint: String::new(),
                        owner: owner.to_string(),
                        processing_ttl_ms: idem.processing_ttl_ms,
                        cancel_key,
                    },
                    key_hash,
                    owned: false,
                    status: 0,
                    headers: Vec::new(),
                    body: Vec::new(),
                    too_large: false,
                    declared: None,
                    passed: 0,
                    trailers: Vec::new(),
                });
                let held = Held {
                    caller,
                    req,
                    nonce: nonce.to_string(),
                };
                // An upgrade's request "body" is the new protocol, which starts only after the
                // answer: it is never waited for (the fingerprint's body is empty).
                if idem.needs_body() && !end_of_stream && !self.upgrade {
                    self.held = Some(held);
                    self.phase = Phase::Buffering;
                    self.deadline_ms = now_ms.saturating_add(BODY_IDLE_TIMEOUT_MS);
                    return Step::Wait;
                }
                return self.start_acquire(rt, held, &[], now_ms, m);
            }
        }
        if policy.rate_limits.is_empty() && self.lease.is_none() {
            self.phase = Phase::Forwarded;
            self.forwarded = true;
            return Step::Continue;
        }
        let held = Held {
            caller,
            req,
            nonce: nonce.to_string(),
        };
        self.start_acquire(rt, held, &[], now_ms, m)
    }

    /// A piece of the request body arrived; `body_size` is all that is buffered so far.
    pub fn on_request_body(
        &mut self,
        rt: &Runtime,
        body_size: usize,
        end_of_stream: bool,
        read: impl FnOnce() -> Vec<u8>,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        match self.phase {
            Phase::Buffering => {
                let max = self.idem_config(rt).map_or(0, |i| i.max_request_body);
                if body_size as u64 > max {
                    return self.body_too_large(rt, m);
                }
                if !end_of_stream {
                    self.deadline_ms = now_ms.saturating_add(BODY_IDLE_TIMEOUT_MS);
                    return Step::Wait;
                }
                self.request_complete(rt, read, now_ms, m)
            }
            _ => self.request_part(),
        }
    }

    /// The request ended without a body callback with end_of_stream (e.g. trailers).
    pub fn on_request_trailers(
        &mut self,
        rt: &Runtime,
        read: impl FnOnce() -> Vec<u8>,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        match self.phase {
            Phase::Buffering => self.request_complete(rt, read, now_ms, m),
            _ => self.request_part(),
        }
    }

    /// The whole body is here: fingerprint it and acquire.
    fn request_complete(
        &mut self,
        rt: &Runtime,
        read: impl FnOnce() -> Vec<u8>,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        let body = read();
        match self.held.take() {
            Some(held) => self.start_acquire(rt, held, &body, now_ms, m),
            None => Step::Continue,
        }
    }

    /// A later part of a request that is not being buffered.
    fn request_part(&self) -> Step {
        match self.phase {
            // Still deciding (or waiting for a lease): the body stays held with the headers.
            Phase::Acquiring | Phase::LeaseWaiting => Step::Wait,
            _ => Step::Continue,
        }
    }

    fn body_too_large(&mut self, rt: &Runtime, m: &dyn MetricSink) -> Step {
        let Some(idem) = self.idem_config(rt) else {
            return Step::Continue;
        };
        if let Some(im) = self.idem_metrics(rt) {
            m.increment(im.body_too_large);
        }
        let detail = format!(
            "the request body is larger than the {} bytes this operation fingerprints",
            idem.max_request_body
        );
        self.answer(respond::problem(
            Problem::RequestBodyTooLarge,
            &detail,
            &[],
            Vec::new(),
        ))
    }

    fn fingerprint(idem: &Idempotency, held: &Held, body: &[u8]) -> String {
        let mut f = Fingerprint::default();
        for part in &idem.fingerprint {
            match part {
                FingerprintPart::Method => f.part("method", held.req.method.as_bytes()),
                FingerprintPart::Path => f.part("path", held.req.path.as_bytes()),
                FingerprintPart::Query => f.part("query", held.req.query.as_bytes()),
                FingerprintPart::Principal => f.part("principal", held.caller.principal.as_bytes()),
                FingerprintPart::Body => {
                    let json = is_json(held.req.header("content-type"));
                    f.part("body", &canonical_body(body, json));
                }
                FingerprintPart::Header(h) => match held.req.header(h) {
                    Some(v) => f.part(&format!("header:{h}"), v.as_bytes()),
                    None => f.part(&format!("header:{h}!"), b""),
                },
            }
        }
        f.finish()
    }

    fn start_acquire(
        &mut self,
        rt: &Runtime,
        held: Held,
        body: &[u8],
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        let Some((policy, _)) = self.policy(rt) else {
            return Step::Continue;
        };
        if let (Some(idem), Some(cfg)) = (self.idem.as_mut(), policy.idempotency.as_ref()) {
            idem.acquire.fingerprint = Self::fingerprint(cfg, &held, body);
        }
        let n = policy.rate_limits.len();
        self.nonce = held.nonce.clone();
        self.limit_keys = policy
            .rate_limits
            .iter()
            .enumerate()
            .map(|l| {
                rt.keys.key(
                    &rt.config.redis.key_prefix,
                    (self.policy, policy),
                    l,
                    &held.caller,
                    &held.req,
                )
            })
            .collect();
        self.states = vec![None; n];
        self.granted = vec![0; n];
        self.local = vec![false; n];
        // Leased limits admit from this worker's slice while it lasts.
        for (i, limit) in policy.rate_limits.iter().enumerate() {
            if !limit.leased {
                continue;
            }
            if let Some((left, expires)) = rt.quota.take(self.limit_keys[i].hash(), now_ms) {
                self.states[i] = Some(LimitState {
                    allowed: true,
                    remaining: left,
                    reset_ms: expires.saturating_sub(now_ms),
                    retry_after_ms: 0,
                });
                self.local[i] = true;
            }
        }
        if let Some(step) = self.cached_rejection(rt, now_ms, m) {
            self.refund_local(rt);
            return step;
        }
        let keys: Vec<Option<&LimitKey>> = self
            .limit_keys
            .iter()
            .zip(&self.local)
            .map(|(k, &local)| (!local).then_some(k))
            .collect();
        let groups = acquire::plan(
            policy,
            &keys,
            &held.nonce,
            self.idem.as_ref().map(|i| &i.acquire),
            self.lease.as_ref().map(|l| &l.acquire),
        );
        if groups.is_empty() {
            // Every limit answered locally, nothing else to acquire: no Redis call.
            return self.decide(rt, now_ms, m);
        }
        // Rate limits first: when the record or the lease rides in one slot and other slots
        // hold rate limits, those go first and the record/lease call only once they admit,
        // so a rate-limited request never takes a lease or a record (a second round trip).
        let (mut sections, plain): (Vec<acquire::Group>, Vec<acquire::Group>) =
            groups.into_iter().partition(|g| g.idem || g.lease);
        let first = if plain.is_empty() {
            sections
        } else {
            self.deferred = sections.pop();
            plain
        };
        self.pending = first
            .into_iter()
            .map(|g| acquire_pending(g, now_ms))
            .collect();
        self.phase = Phase::Acquiring;
        self.deadline_ms = now_ms.saturating_add(rt.config.redis.timeout_ms);
        let out = (0..self.pending.len())
            .map(|slot| self.outgoing(slot, now_ms))
            .collect();
        Step::Dispatch(out)
    }

    fn outgoing(&mut self, slot: usize, now_ms: u64) -> Outgoing {
        let p = &mut self.pending[slot];
        p.sent_ms = now_ms;
        Outgoing {
            slot,
            script: p.script,
            call: p.call.clone(),
            by_sha: p.by_sha,
        }
    }

    /// A gateway answer (or a failure to send) for `slot`.
    pub fn on_reply(
        &mut self,
        rt: &Runtime,
        slot: usize,
        answer: Result<Reply, CallError>,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        if !matches!(
            self.phase,
            Phase::Acquiring
                | Phase::Completing
                | Phase::BufferingResponse
                | Phase::StreamingResponse
        ) {
            return Step::Wait;
        }
        let Some(p) = self.pending.get_mut(slot).filter(|p| !p.done) else {
            return Step::Wait;
        };
        m.record(
            rt.metrics.redis.latency_ms,
            now_ms.saturating_sub(p.sent_ms),
        );
        if resend_by_eval(&mut p.by_sha, &answer, &rt.metrics.redis, m) {
            return Step::Dispatch(vec![self.outgoing(slot, now_ms)]);
        }
        let reply = match answer {
            Ok(reply) => reply,
            Err(e) => {
                m.increment(if e == CallError::Timeout {
                    rt.metrics.redis.timeouts
                } else {
                    rt.metrics.redis.errors
                });
                if !e.may_have_run() {
                    // Provably not run (never sent, or refused by the gateway): nothing was
                    // written, so nothing is to be given back for this call.
                    p.done = true;
                    p.record_unsettled = false;
                    p.lease_unsettled = false;
                }
                return self.call_failed(rt, slot, &e, now_ms, m);
            }
        };
        p.done = true;
        match p.purpose {
            Purpose::LeaseRetry => {
                let read = match acquire::read_reply(&reply, 0, false, true) {
                    Ok(r) => r,
                    Err(e) => {
                        m.increment(rt.metrics.redis.errors);
                        return self.call_failed(rt, slot, &e, now_ms, m);
                    }
                };
                p.record_unsettled = false;
                p.lease_unsettled = false;
                let answer = read.lease.unwrap_or(LeaseAnswer::Skipped);
                let headers = std::mem::take(&mut self.response_headers);
                self.on_lease_answer(rt, answer, headers, now_ms, m)
            }
            Purpose::Acquire => {
                let (n, idem, lease) = (p.limits.len(), p.idem, p.lease);
                let read = match acquire::read_reply(&reply, n, idem, lease) {
                    Ok(r) => r,
                    Err(e) => {
                        m.increment(rt.metrics.redis.errors);
                        return self.call_failed(rt, slot, &e, now_ms, m);
                    }
                };
                p.record_unsettled = false;
                p.lease_unsettled = false;
                let policy = rt.config.policies.get(self.policy);
                for (&i, state) in p.limits.iter().zip(read.states) {
                    // A leased limit's "remaining" is the slice granted when its call admitted.
                    let leased = policy
                        .and_then(|pol| pol.rate_limits.get(i))
                        .is_some_and(|l| l.leased);
                    if leased && read.admitted && state.allowed {
                        if let Some(g) = self.granted.get_mut(i) {
                            *g = state.remaining;
                        }
                    }
                    if let Some(s) = self.states.get_mut(i) {
                        *s = Some(state);
                    }
                }
                if let Some(answer) = read.idem {
                    if answer == IdemAnswer::Acquired {
                        if let Some(i) = self.idem.as_mut() {
                            i.owned = true;
                        }
                    }
                    self.idem_answer = Some(answer);
                }
                if let Some(answer) = read.lease {
                    if let (LeaseAnswer::Acquired { .. }, Some(l)) = (answer, self.lease.as_mut()) {
                        l.held = true;
                    }
                    self.lease_answer = Some(answer);
                }
                if self.pending.iter().any(|p| !p.done) {
                    return Step::Wait;
                }
                if let Some(group) = self.deferred.take() {
                    let rejected = self.policy(rt).is_some_and(|(pol, _)| {
                        pol.rate_limits
                            .iter()
                            .zip(&self.states)
                            .any(|(l, s)| !l.shadow && s.is_some_and(|s| !s.allowed))
                    });
                    if !rejected {
                        self.pending.push(acquire_pending(group, now_ms));
                        self.deadline_ms = now_ms.saturating_add(rt.config.redis.timeout_ms);
                        return Step::Dispatch(vec![self.outgoing(self.pending.len() - 1, now_ms)]);
                    }
                    // Rejected by the first round: the deferred limits are not asked.
                }
                self.decide(rt, now_ms, m)
            }
            Purpose::LeaseRelease => {
                let name = self.policy_name(rt);
                if let Some(lm) = self.lease_metrics(rt) {
                    background::count_lease(lm, Purpose::LeaseRelease, &reply, name, m);
                }
                if reply.as_int() == Some(1) {
                    self.freed_lease = self.lease.as_ref().map(|l| l.acquire.key.clone());
                }
                self.response_calls_done()
            }
            Purpose::LeaseExtend => Step::Wait,
            Purpose::Complete | Purpose::Release => {
                let purpose = p.purpose;
                self.settle(rt, purpose, &reply, m);
                self.response_calls_done()
            }
        }
    }

    /// Counts the result of a complete or release call (ours or in the background).
    fn settle(&mut self, rt: &Runtime, purpose: Purpose, reply: &Reply, m: &dyn MetricSink) {
        let key_hash = self.key_hash();
        let name = self.policy_name(rt);
        if let Some(im) = self.idem_metrics(rt) {
            background::count_settlement(im, purpose, reply, name, key_hash, m);
        }
        if let Some(i) = self.idem.as_mut() {
            i.owned = false;
        }
    }

    /// All acquire calls answered: rate-limit verdict first, then the idempotency answer.
    fn decide(&mut self, rt: &Runtime, now_ms: u64, m: &dyn MetricSink) -> Step {
        let Some((policy, pm)) = self.policy(rt) else {
            return Step::Continue;
        };
        // A limit without a state was not asked (its round was skipped after a rejection);
        // any other gap is a broken reply.
        let states = self.states.clone();
        let rejected_early = states.iter().flatten().any(|s| !s.allowed);
        if !rejected_early && states.iter().any(Option::is_none) {
            return self.fail(
                rt,
                &CallError::UnexpectedReply("missing limit state".into()),
                now_ms,
                m,
            );
        }
        // Slices granted by Redis: this request uses one unit if it is admitted; the rest (or
        // all of it) is admitted locally later. Local units of a rejected request go back.
        let admitted = policy
            .rate_limits
            .iter()
            .zip(&states)
            .all(|(l, s)| l.shadow || s.is_some_and(|s| s.allowed));
        for (i, &g) in self.granted.iter().enumerate() {
            if g == 0 {
                continue;
            }
            let left = if admitted { g - 1 } else { g };
            let reset = states.get(i).copied().flatten().map_or(0, |s| s.reset_ms);
            if let Some(key) = self.limit_keys.get(i) {
                rt.quota
                    .add(key.hash(), left, now_ms.saturating_add(reset), now_ms);
            }
            if let Some(Some(s)) = self.states.get_mut(i) {
                s.remaining = left;
            }
        }
        if !admitted {
            self.refund_local(rt);
        }
        // Remember counters that reject, until the script says they could admit again.
        for ((limit, state), key) in policy.rate_limits.iter().zip(&states).zip(&self.limit_keys) {
            let Some(state) = state else {
                continue;
            };
            if !state.allowed && !limit.shadow && state.retry_after_ms > 0 {
                rt.over_limit
                    .mark(key.hash(), now_ms.saturating_add(state.retry_after_ms));
            }
        }
        let verdict = ratelimit::decide(policy, &self.states);
        let admitted = matches!(verdict, Verdict::Allow(_));
        // A limit counts `allowed` only for admitted requests, `rejected` when it is one the
        // request violated, `shadow_rejected` when a shadow limit would have rejected.
        for ((limit, state), lm) in policy.rate_limits.iter().zip(&states).zip(&pm.limits) {
            let Some(state) = state else {
                continue;
            };
            let metric = match (state.allowed, limit.shadow) {
                (true, _) if admitted => Some(lm.allowed),
                (true, _) => None,
                (false, true) => Some(lm.shadow_rejected),
                (false, false) => Some(lm.rejected),
            };
            if let Some(id) = metric {
                m.increment(id);
            }
        }
        let limit_headers = match verdict {
            Verdict::Reject(response) => {
                // Another slot may have acquired the record or the lease: give them back.
                self.release_in_background(rt);
                self.release_lease(rt);
                return self.answer(response);
            }
            Verdict::Allow(headers) if rt.config.response_headers => headers,
            Verdict::Allow(_) => Vec::new(),
        };
        let answer = self.idem_answer.take();
        let (Some(answer), Some(cfg), Some(im)) =
            (answer, self.idem_config(rt), self.idem_metrics(rt))
        else {
            let lease = self.lease_answer.take().unwrap_or(LeaseAnswer::Skipped);
            return self.on_lease_answer(rt, lease, limit_headers, now_ms, m);
        };
        match answer {
            IdemAnswer::Acquired => {
                m.increment(im.acquired);
                // Only a request that holds its record tells the service its fingerprint.
                if let Some(i) = self.idem.as_ref() {
                    self.upstream_headers
                        .push((FINGERPRINT_HEADER.into(), i.acquire.fingerprint.clone()));
                }
                let lease = self.lease_answer.take().unwrap_or(LeaseAnswer::Skipped);
                self.on_lease_answer(rt, lease, limit_headers, now_ms, m)
            }
            IdemAnswer::Skipped => self.forward(limit_headers),
            IdemAnswer::InProgress { .. } => {
                m.increment(im.in_progress);
                let mut headers = vec![("retry-after".to_string(), "1".to_string())];
                headers.extend(limit_headers);
                self.answer(respond::problem(
                    Problem::IdempotencyKeyInUse,
                    "a request with this Idempotency-Key is still being processed; retry later",
                    &[],
                    headers,
                ))
            }
            IdemAnswer::Conflict => {
                m.increment(im.conflict);
                self.conflict(cfg.conflict_status, limit_headers)
            }
            IdemAnswer::Unreadable => {
                m.increment(im.unreadable);
                m.increment(im.conflict);
                log::warn!(
                    "idempotency record of policy {} key {} is unreadable; answering as a conflict",
                    policy.name,
                    self.key_hash()
                );
                self.conflict(cfg.conflict_status, limit_headers)
            }
            IdemAnswer::Completed(record) => {
                match replay(&record, limit_headers.clone(), self.grpc) {
                    Some(response) => {
                        m.increment(im.replayed);
                        self.answer(response)
                    }
                    None => {
                        m.increment(im.unreadable);
                        m.increment(im.conflict);
                        self.conflict(cfg.conflict_status, limit_headers)
                    }
                }
            }
        }
    }

    /// Gives back the units this request took from local slices (it was rejected).
    fn refund_local(&mut self, rt: &Runtime) {
        for (i, taken) in self.local.iter_mut().enumerate() {
            if std::mem::take(taken) {
                if let Some(key) = self.limit_keys.get(i) {
                    rt.quota.refund(key.hash());
                }
            }
        }
    }

    /// A 429 from the over-limit cache, when one of the request's enforced counters is known
    /// to reject: no Redis call, nothing acquired, nothing consumed.
    fn cached_rejection(&mut self, rt: &Runtime, now_ms: u64, m: &dyn MetricSink) -> Option<Step> {
        if !rt.over_limit.enabled() {
            return None;
        }
        let (policy, pm) = self.policy(rt)?;
        let mut states: Vec<Option<LimitState>> = vec![None; policy.rate_limits.len()];
        let mut hit = false;
        for (i, (limit, key)) in policy.rate_limits.iter().zip(&self.limit_keys).enumerate() {
            // A unit from this worker's slice was counted in Redis when the slice was taken:
            // it admits whatever the counter says now.
            if limit.shadow || self.local.get(i).copied().unwrap_or(false) {
                continue;
            }
            if let Some(until) = rt.over_limit.rejecting_until(key.hash(), now_ms) {
                let wait = until - now_ms;
                states[i] = Some(LimitState {
                    allowed: false,
                    remaining: 0,
                    reset_ms: wait,
                    retry_after_ms: wait,
                });
                if let Some(lm) = pm.limits.get(i) {
                    m.increment(lm.rejected);
                }
                hit = true;
            }
        }
        if !hit {
            return None;
        }
        m.increment(rt.metrics.over_limit_cache_hits);
        match ratelimit::decide(policy, &states) {
            Verdict::Reject(response) => Some(self.answer(response)),
            Verdict::Allow(_) => None,
        }
    }

    /// The lease answer, once rate limits and idempotency let the request through.
    fn on_lease_answer(
        &mut self,
        rt: &Runtime,
        answer: LeaseAnswer,
        headers: Vec<(String, String)>,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        let (Some(cfg), Some(lm)) = (self.lease_config(rt), self.lease_metrics(rt)) else {
            return self.forward(headers);
        };
        let Some(lease) = self.lease.as_mut() else {
            return self.forward(headers);
        };
        match answer {
            LeaseAnswer::Skipped => self.forward(headers),
            LeaseAnswer::Acquired { token } => {
                m.increment(lm.acquired);
                if lease.waited {
                    m.increment(lm.waited);
                }
                lease.held = true;
                if cfg.extend {
                    lease.next_extend_ms = Some(now_ms.saturating_add(cfg.ttl_ms / 2));
                }
                self.upstream_headers
                    .push((cfg.fencing_header.clone(), token.to_string()));
                self.forward(headers)
            }
            LeaseAnswer::Busy { pttl_ms } => {
                if cfg.on_busy == OnBusy::Wait {
                    if !lease.waited {
                        lease.waited = true;
                        lease.wait_until_ms = now_ms.saturating_add(cfg.max_wait_ms);
                    }
                    // The last poll lands exactly at max_wait.
                    let next = now_ms
                        .saturating_add(jittered(lease.backoff_ms, &mut lease.jitter))
                        .min(lease.wait_until_ms);
                    if now_ms < lease.wait_until_ms {
                        lease.backoff_ms = (lease.backoff_ms * 2).min(LEASE_POLL_MAX_MS);
                        self.phase = Phase::LeaseWaiting;
                        self.deadline_ms = next;
                        self.response_headers = headers;
                        return Step::Wait;
                    }
                }
                m.increment(lm.busy);
                // The idempotency record this request acquired is not going to be used.
                self.release_in_background(rt);
                let retry = respond::retry_after_secs(u64::try_from(pttl_ms).unwrap_or(1000));
                let mut all = vec![("retry-after".to_string(), retry.to_string())];
                all.extend(headers);
                self.answer(respond::problem(
                    Problem::ResourceLocked,
                    &format!("another request holds this resource; retry after {retry} s"),
                    &[],
                    all,
                ))
            }
        }
    }

    /// Polls a busy lease again (`on_busy: wait`).
    fn poll_lease(&mut self, rt: &Runtime, now_ms: u64) -> Step {
        let Some(lease) = self.lease.as_ref() else {
            return Step::Continue;
        };
        let call = acquire::lease_poll(&lease.acquire, &self.nonce);
        self.pending = vec![Pending {
            purpose: Purpose::LeaseRetry,
            script: Purpose::LeaseRetry.script(),
            call,
            limits: Vec::new(),
            idem: false,
            lease: true,
            by_sha: true,
            sent_ms: now_ms,
            done: false,
            record_unsettled: false,
            lease_unsettled: true,
        }];
        self.phase = Phase::Acquiring;
        self.deadline_ms = now_ms.saturating_add(rt.config.redis.timeout_ms);
        Step::Dispatch(vec![self.outgoing(0, now_ms)])
    }

    /// Gives a held lease back, from the root (the call must outlive the stream).
    fn release_lease(&mut self, rt: &Runtime) {
        let policy = self.policy;
        let marker_ttl = self.marker_ttl_ms(rt);
        // An acquire that may still run (or may have run) may hold the lease: release by
        // owner anyway, with the cancellation marker, so a late acquire takes nothing.
        let in_flight = self.pending.iter().any(|p| p.lease_unsettled);
        let Some(l) = self.lease.as_mut().filter(|l| l.held || in_flight) else {
            return;
        };
        let certain = l.held;
        l.held = false;
        l.next_extend_ms = None;
        // Handed over once: the stream's end does not send it again.
        self.pending
            .iter_mut()
            .for_each(|p| p.lease_unsettled = false);
        let call = lease::release(&l.acquire, (!certain).then_some(marker_ttl));
        let call = Background::new(policy, Purpose::LeaseRelease, call, String::new());
        self.background
            .push(if certain { call } else { call.compensation() });
    }

    /// The TTL of this request's cancellation marker: it must outlive any acquire of this
    /// request that can still run after the filter gave up on it (see README, "Redis keys").
    fn marker_ttl_ms(&self, rt: &Runtime) -> u64 {
        let policy = rt.config.policies.get(self.policy);
        let processing = policy
            .and_then(|p| p.idempotency.as_ref())
            .map_or(0, |i| i.processing_ttl_ms);
        let lease = policy
            .and_then(|p| p.lease.as_ref())
            .map_or(0, |l| l.ttl_ms);
        processing.max(lease).max(MARKER_MIN_TTL_MS)
    }

    fn conflict(&mut self, status: u32, headers: Vec<(String, String)>) -> Step {
        self.answer(respond::problem(
            Problem::IdempotencyKeyConflict { status },
            "this Idempotency-Key was already used for a different request",
            &[],
            headers,
        ))
    }

    fn forward(&mut self, response_headers: Vec<(String, String)>) -> Step {
        self.response_headers = response_headers;
        self.phase = Phase::Forwarded;
        self.forwarded = true;
        Step::Continue
    }

    /// Answers locally; a gRPC client gets the problem as a gRPC status (see
    /// [`respond::for_grpc`]), anyone else the problem+json answer as it is.
    fn answer(&mut self, response: LocalResponse) -> Step {
        self.phase = Phase::Done;
        self.response_headers.clear();
        Step::Respond(if self.grpc {
            respond::for_grpc(response)
        } else {
            response
        })
    }

    fn call_failed(
        &mut self,
        rt: &Runtime,
        slot: usize,
        err: &CallError,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        let purpose = self.pending.get(slot).map(|p| p.purpose);
        match purpose {
            Some(Purpose::Complete | Purpose::Release) => {
                self.mark_done(slot);
                self.completion_failed(rt, err, now_ms, m);
                self.response_calls_done()
            }
            Some(Purpose::LeaseRelease) => {
                self.mark_done(slot);
                rt.warnings
                    .warn(WarnKind::LeaseNotSettled, self.policy, now_ms, || {
                        format!(
                            "lease of policy {} not released ({}); it expires at its TTL",
                            self.policy_name(rt),
                            err.describe()
                        )
                    });
                self.response_calls_done()
            }
            _ => self.fail(rt, err, now_ms, m),
        }
    }

    fn mark_done(&mut self, slot: usize) {
        if let Some(p) = self.pending.get_mut(slot) {
            p.done = true;
        }
    }

    /// The record could not be completed or released: the response goes out anyway and the
    /// record expires at its processing TTL.
    fn completion_failed(
        &mut self,
        rt: &Runtime,
        err: &CallError,
        now_ms: u64,
        m: &dyn MetricSink,
    ) {
        if let Some(im) = self.idem_metrics(rt) {
            m.increment(im.complete_failed);
        }
        rt.warnings.warn(WarnKind::RecordNotSettled, self.policy, now_ms, || {
            format!(
                "idempotency record of policy {} key {} not completed ({}); it expires at its processing TTL",
                self.policy_name(rt),
                self.key_hash(),
                err.describe()
            )
        });
        if let Some(i) = self.idem.as_mut() {
            i.owned = false;
        }
    }

    /// The one place a failed acquire becomes the policy's answer.
    fn fail(&mut self, rt: &Runtime, err: &CallError, now_ms: u64, m: &dyn MetricSink) -> Step {
        let Some((policy, pm)) = self.policy(rt) else {
            return Step::Continue;
        };
        rt.warnings
            .warn(WarnKind::AcquireFailed, self.policy, now_ms, || {
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
        // A record or lease acquired by a call that did answer is given back either way.
        self.release_in_background(rt);
        self.release_lease(rt);
        match policy.failure_mode {
            FailureMode::Open => {
                m.increment(pm.failed_open);
                self.forward(Vec::new())
            }
            FailureMode::Closed => {
                m.increment(pm.failed_closed);
                self.answer(respond::problem(
                    Problem::GuardUnavailable,
                    &err.client_detail(rt.config.redis.timeout_ms),
                    &[],
                    vec![("retry-after".into(), "1".into())],
                ))
            }
        }
    }

    /// When the stream is paused (on Redis, or waiting for the request body), the time by
    /// which it must go on.
    pub fn deadline_ms(&self) -> Option<u64> {
        let stream = matches!(
            self.phase,
            Phase::Buffering | Phase::Acquiring | Phase::LeaseWaiting | Phase::Completing
        )
        .then_some(self.deadline_ms);
        let extend = self.lease.as_ref().and_then(|l| l.next_extend_ms);
        match (stream, extend) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The request body is being held (buffering or deciding).
    pub fn holds_request(&self) -> bool {
        matches!(
            self.phase,
            Phase::Buffering | Phase::Acquiring | Phase::LeaseWaiting
        ) && !self.forwarded
    }

    /// The lease this request waits for (`on_busy: wait`), while it waits.
    pub fn waiting_for_lease(&self) -> Option<&str> {
        (self.phase == Phase::LeaseWaiting)
            .then(|| self.lease.as_ref().map(|l| l.acquire.key.as_str()))
            .flatten()
    }

    /// The lease this request waits for was just given back on this worker: poll it at the
    /// next tick instead of at the end of the backoff.
    pub fn wake(&mut self, now_ms: u64) {
        if self.phase == Phase::LeaseWaiting {
            self.deadline_ms = self.deadline_ms.min(now_ms);
        }
    }

    /// The lease this request gave back, once Redis said so (for [`Flow::wake`] of waiters).
    pub fn take_freed_lease(&mut self) -> Option<String> {
        self.freed_lease.take()
    }

    /// The watchdog: decides a stream whose calls outlived the timeout.
    pub fn on_tick(&mut self, rt: &Runtime, now_ms: u64, m: &dyn MetricSink) -> Step {
        self.extend_lease(now_ms);
        if self.phase == Phase::LeaseWaiting && now_ms >= self.deadline_ms {
            return self.poll_lease(rt, now_ms);
        }
        let stream_deadline = matches!(
            self.phase,
            Phase::Buffering | Phase::Acquiring | Phase::Completing
        )
        .then_some(self.deadline_ms);
        match stream_deadline {
            Some(deadline) if now_ms >= deadline && self.phase == Phase::Buffering => {
                log::warn!(
                    "policy {}: no request body data for {} s; if no body ever arrives, the host \
                     must set allow_on_headers_stop_iteration: true on the Wasm plugin",
                    self.policy_name(rt),
                    BODY_IDLE_TIMEOUT_MS / 1000
                );
                self.held = None;
                self.answer(respond::problem(
                    Problem::RequestBodyTimeout,
                    "the request body did not arrive in time",
                    &[],
                    Vec::new(),
                ))
            }
            Some(deadline) if now_ms >= deadline => {
                m.increment(rt.metrics.redis.timeouts);
                if self.phase == Phase::Completing {
                    // The response goes out; late answers are ignored.
                    let idem_pending = self.pending.iter().any(|p| {
                        !p.done && matches!(p.purpose, Purpose::Complete | Purpose::Release)
                    });
                    self.pending.iter_mut().for_each(|p| p.done = true);
                    if idem_pending {
                        self.completion_failed(rt, &CallError::Timeout, now_ms, m);
                    }
                    self.phase = Phase::Done;
                    return Step::Continue;
                }
                self.fail(rt, &CallError::Timeout, now_ms, m)
            }
            _ => Step::Wait,
        }
    }

    /// Extends a held lease at half its TTL while the request is in flight.
    fn extend_lease(&mut self, now_ms: u64) {
        let policy = self.policy;
        let Some(l) = self.lease.as_mut().filter(|l| l.held) else {
            return;
        };
        let Some(due) = l.next_extend_ms.filter(|d| now_ms >= *d) else {
            return;
        };
        let half = (l.acquire.ttl_ms / 2).max(1);
        l.next_extend_ms = Some(due.max(now_ms).saturating_add(half));
        self.background.push(Background::new(
            policy,
            Purpose::LeaseExtend,
            lease::extend(&l.acquire),
            String::new(),
        ));
    }

    /// Whether the response matters to this request (a record to complete, a lease to
    /// release); if not, the adapter skips reading the response.
    pub fn wants_response(&self) -> bool {
        self.idem.as_ref().is_some_and(|i| i.owned) || self.lease.as_ref().is_some_and(|l| l.held)
    }

    /// Whether the response's trailers matter (a record that settles on them).
    pub fn wants_response_trailers(&self) -> bool {
        matches!(
            self.phase,
            Phase::BufferingResponse | Phase::CopyingResponse | Phase::StreamingResponse
        )
    }

    /// Headers to add to the upstream's response (`RateLimit-Policy`, `RateLimit`).
    pub fn response_headers(&self) -> &[(String, String)] {
        &self.response_headers
    }

    /// The headers to set on the request before it goes upstream, once. (The client's own
    /// copies of them are removed from every request: see [`Runtime::reserved_headers`].)
    pub fn take_upstream_headers(&mut self) -> Vec<(String, String)> {
        if !self.forwarded {
            return Vec::new();
        }
        std::mem::take(&mut self.upstream_headers)
    }

    /// Headers to set on the request before it goes upstream (until taken).
    pub fn upstream_headers(&self) -> &[(String, String)] {
        if self.forwarded {
            &self.upstream_headers
        } else {
            &[]
        }
    }

    /// Calls for the root context to send: they must outlive this request.
    pub fn take_background(&mut self) -> Vec<Background> {
        std::mem::take(&mut self.background)
    }

    fn release_in_background(&mut self, rt: &Runtime) {
        let policy = self.policy;
        let marker_ttl = self.marker_ttl_ms(rt);
        // An acquire that may still run (or may have run) may have created the record:
        // release by owner anyway, with the cancellation marker, so a late acquire writes
        // nothing. One that provably did not run needs nothing.
        let in_flight = self.pending.iter().any(|p| p.record_unsettled);
        let Some(i) = self.idem.as_mut() else {
            return;
        };
        if !i.owned && !in_flight {
            return;
        }
        let certain = i.owned;
        i.owned = false;
        // Handed over once: the stream's end does not send it again.
        self.pending
            .iter_mut()
            .for_each(|p| p.record_unsettled = false);
        let call = record::release(&i.acquire, (!certain).then_some(marker_ttl));
        let call = Background::new(policy, Purpose::Release, call, i.key_hash.clone());
        self.background
            .push(if certain { call } else { call.compensation() });
    }

    fn completion_call(&self, rt: &Runtime) -> Option<(Purpose, ScriptCall)> {
        let idem = self.idem.as_ref()?;
        let cfg = self.idem_config(rt)?;
        let body = match cfg.replay {
            Replay::Full if !idem.too_large => Some(idem.body.as_slice()),
            _ => None,
        };
        let stored = StoredResponse::new(
            u16::try_from(idem.status).unwrap_or(500),
            idem.headers.clone(),
            body,
        )
        .with_trailers(idem.trailers.clone());
        Some((
            Purpose::Complete,
            record::complete(&idem.acquire, cfg.completed_ttl_ms, stored.to_json()),
        ))
    }

    fn release_call(&self) -> Option<(Purpose, ScriptCall)> {
        let idem = self.idem.as_ref()?;
        Some((Purpose::Release, record::release(&idem.acquire, None)))
    }

    /// Sends a complete/release now (sync: the response waits) or hands it to the root.
    fn settle_record(
        &mut self,
        rt: &Runtime,
        call: Option<(Purpose, ScriptCall)>,
        now_ms: u64,
    ) -> Step {
        let Some((purpose, call)) = call else {
            return Step::Continue;
        };
        let sync = self
            .idem_config(rt)
            .is_some_and(|c| c.complete == Completion::Sync);
        if !sync {
            let key_hash = self
                .idem
                .as_ref()
                .map_or(String::new(), |i| i.key_hash.clone());
            if let Some(i) = self.idem.as_mut() {
                i.owned = false;
            }
            self.background
                .push(Background::new(self.policy, purpose, call, key_hash));
            self.phase = Phase::Done;
            return Step::Continue;
        }
        let out = self.push_pending(purpose, call, now_ms);
        self.phase = Phase::Completing;
        self.deadline_ms = now_ms.saturating_add(rt.config.redis.timeout_ms);
        Step::Dispatch(vec![out])
    }

    /// Adds a call the response waits for and returns it to send.
    fn push_pending(&mut self, purpose: Purpose, call: ScriptCall, now_ms: u64) -> Outgoing {
        self.pending.push(Pending {
            purpose,
            script: purpose.script(),
            call,
            limits: Vec::new(),
            idem: false,
            lease: false,
            by_sha: true,
            sent_ms: now_ms,
            done: false,
            record_unsettled: false,
            lease_unsettled: false,
        });
        self.outgoing(self.pending.len() - 1, now_ms)
    }

    /// The lease release the response waits for, so the client's next request finds the
    /// resource free.
    fn lease_release_now(&mut self, now_ms: u64) -> Option<Outgoing> {
        let l = self.lease.as_mut().filter(|l| l.held)?;
        l.held = false;
        l.next_extend_ms = None;
        let call = lease::release(&l.acquire, None);
        Some(self.push_pending(Purpose::LeaseRelease, call, now_ms))
    }

    /// After a response-side call answered: go on once none is outstanding.
    fn response_calls_done(&mut self) -> Step {
        if self.pending.iter().any(|p| !p.done) {
            return Step::Wait;
        }
        if self.phase == Phase::Completing {
            self.phase = Phase::Done;
            return Step::Continue;
        }
        Step::Wait
    }

    /// The response's headers. `via_upstream` is false for Envoy's own local replies, with
    /// `details` its `response.code_details`.
    #[allow(clippy::too_many_arguments)]
    pub fn on_response_headers(
        &mut self,
        rt: &Runtime,
        status: u32,
        via_upstream: bool,
        details: &str,
        headers: &[(String, String)],
        end_of_stream: bool,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        self.response_seen = true;
        let shape = response_shape(status, via_upstream, self.connect, headers, end_of_stream);
        // An accepted upgrade or tunnel, or an event stream: the operation goes on for as long
        // as the stream is open, so a held lease stays held (the watchdog extends it) and is
        // released when the stream ends (`on_done`).
        self.open_ended = shape != Shape::Plain;
        // Otherwise the upstream answered: the protected operation is over. The response waits
        // for the release (one round trip), except with async idempotency completion, whose
        // body copying must not be paused: there the root releases it.
        // So is a response whose body is known to stream (its content-length is over
        // max_response_body, or `replay: reference`): pausing its headers would make Envoy
        // buffer its body.
        let owned = self.idem.as_ref().is_some_and(|i| i.owned);
        let async_idem = owned
            && self.idem_config(rt).is_some_and(|c| {
                c.complete == Completion::Async
                    || (via_upstream && streams_body(c, headers, end_of_stream))
            });
        let release = if self.open_ended {
            None
        } else if async_idem {
            self.release_lease(rt);
            None
        } else {
            self.lease_release_now(now_ms)
        };
        let head = ResponseHead {
            status,
            via_upstream,
            details,
            headers,
            end_of_stream,
            shape,
        };
        let step = self.idem_response_headers(rt, &head, now_ms, m);
        match (release, step) {
            (None, step) => step,
            (Some(out), Step::Continue) => {
                self.phase = Phase::Completing;
                self.deadline_ms = now_ms.saturating_add(rt.config.redis.timeout_ms);
                Step::Dispatch(vec![out])
            }
            (Some(out), Step::Wait) => Step::Dispatch(vec![out]),
            (Some(out), Step::Dispatch(mut calls)) => {
                calls.push(out);
                Step::Dispatch(calls)
            }
            (Some(_), step) => step,
        }
    }

    /// The idempotency side of the response headers: complete, release, or buffer first.
    fn idem_response_headers(
        &mut self,
        rt: &Runtime,
        head: &ResponseHead<'_>,
        now_ms: u64,
        m: &dyn MetricSink,
    ) -> Step {
        let ResponseHead {
            status,
            via_upstream,
            details,
            headers,
            end_of_stream,
            shape,
        } = *head;
        let owned = self.idem.as_ref().is_some_and(|i| i.owned);
        if !owned || self.phase != Phase::Forwarded {
            return Step::Continue;
        }
        let Some(cfg) = self.idem_config(rt) else {
            return Step::Continue;
        };
        if !via_upstream {
            if NEVER_SENT.iter().any(|d| details.contains(d)) {
                let call = self.release_call();
                return self.settle_record(rt, call, now_ms);
            }
            // Timed out or reset after it was sent: the outcome is unknown, keep PROCESSING.
            self.outcome_unknown(rt, details, m);
            return Step::Continue;
        }
        // A gRPC call's outcome is its grpc-status: in the headers of a trailers-only answer,
        // else in the trailers, so the decision waits for them.
        let trailers_only = if self.grpc {
            grpc::status_of(headers)
        } else {
            None
        };
        let awaits_trailers = self.grpc && trailers_only.is_none() && !end_of_stream;
        let retry = match trailers_only {
            Some(code) => cfg.retryable_grpc(code),
            None => cfg.retryable(status),
        };
        if retry {
            let call = self.release_call();
            return self.settle_record(rt, call, now_ms);
        }
        if shape == Shape::Tunnel {
            // A switched protocol or a tunnel is a session, not a response that could be
            // replayed: the record is released (counted `released`) and the 101 goes on.
            let call = self.release_call();
            return self.settle_record(rt, call, now_ms);
        }
        let replay_headers: Vec<(String, String)> = headers
            .iter()
            .filter(|(n, _)| cfg.replay_headers.iter().any(|h| h == n))
            .cloned()
            .collect();
        let stored_trailers = if trailers_only.is_some() {
            kept_trailers(cfg, headers)
        } else {
            Vec::new()
        };
        let needs_body = cfg.replay == Replay::Full && !end_of_stream;
        let sync = cfg.complete == Completion::Sync;
        let too_large = streams_body(cfg, headers, end_of_stream);
        if let Some(i) = self.idem.as_mut() {
            i.status = status;
            i.headers = replay_headers;
            i.trailers = stored_trailers;
            i.too_large = too_large;
            // A gRPC response is decided at its trailers, never at its last declared byte.
            i.declared = if awaits_trailers {
                None
            } else {
                content_length(headers)
            };
        }
        if awaits_trailers && !needs_body {
            // No body to store (`replay: reference`): it passes, the record waits for the
            // status in the trailers.
            if let Some(i) = self.idem.as_mut() {
                i.too_large = true;
            }
            self.phase = Phase::StreamingResponse;
            return Step::Continue;
        }
        if too_large || shape == Shape::EventStream {
            // Never buffered: the body streams and the reference is stored at its end, never
            // before (a response that does not end is never stored as completed). An event
            // stream's events are not stored: they pass as they are produced.
            if let Some(i) = self.idem.as_mut() {
                i.too_large = true;
            }
            self.phase = Phase::StreamingResponse;
            return Step::Continue;
        }
        if needs_body {
            self.phase = if sync {
                Phase::BufferingResponse
            } else {
                Phase::CopyingResponse
            };
            return if sync { Step::Wait } else { Step::Continue };
        }
        let call = self.completion_call(rt);
        self.settle_record(rt, call, now_ms)
    }

    /// A piece of the response body. Sync completion buffers (`body_size` is the total so
    /// far, `read` returns it all); async completion copies each chunk as it passes. A body
    /// over `max_response_body` is not buffered any further: it streams, and a reference
    /// record is stored when its end of stream is seen (sync: the final chunk waits for it).
    pub fn on_response_body(
        &mut self,
        rt: &Runtime,
        body_size: usize,
        end_of_stream: bool,
        read: impl FnOnce() -> Vec<u8>,
        now_ms: u64,
    ) -> Step {
        let max = self.idem_config(rt).map_or(0, |c| c.max_response_body);
        match self.phase {
            Phase::BufferingResponse => {
                if body_size as u64 > max {
                    // Too large to store: let what is buffered and the rest pass, and store a
                    // reference once the body has ended.
                    if let Some(i) = self.idem.as_mut() {
                        i.too_large = true;
                    }
                    self.phase = Phase::StreamingResponse;
                    return self.stream_response(rt, body_size, end_of_stream, now_ms);
                } else if !end_of_stream {
                    return Step::Wait;
                } else if let Some(i) = self.idem.as_mut() {
                    i.body = read();
                }
                let call = self.completion_call(rt);
                self.settle_record(rt, call, now_ms)
            }
            Phase::CopyingResponse => {
                if let Some(i) = self.idem.as_mut() {
                    if (i.body.len() + body_size) as u64 > max {
                        i.too_large = true;
                        i.body = Vec::new();
                        self.phase = Phase::StreamingResponse;
                    } else {
                        i.body.extend(read());
                    }
                }
                if end_of_stream {
                    let call = self.completion_call(rt);
                    return self.settle_record(rt, call, now_ms);
                }
                Step::Continue
            }
            Phase::StreamingResponse => self.stream_response(rt, body_size, end_of_stream, now_ms),
            Phase::Completing => Step::Wait,
            _ => Step::Continue,
        }
    }

    /// A response body that is not stored passes (`body_size` bytes more). Its reference is
    /// stored at its end: the end of stream, or the last byte its `content-length` declared
    /// (with sync completion that piece waits for the record, so the client cannot see the
    /// whole response before it is written; the host's empty end of stream may come later).
    fn stream_response(
        &mut self,
        rt: &Runtime,
        body_size: usize,
        end_of_stream: bool,
        now_ms: u64,
    ) -> Step {
        let sync = self
            .idem_config(rt)
            .is_some_and(|c| c.complete == Completion::Sync);
        let Some(i) = self.idem.as_mut() else {
            return Step::Continue;
        };
        i.passed = i.passed.saturating_add(body_size as u64);
        let complete = i.declared.is_some_and(|n| i.passed >= n);
        if end_of_stream || (sync && complete) {
            let call = self.completion_call(rt);
            return self.settle_record(rt, call, now_ms);
        }
        Step::Continue
    }

    /// The response's trailers (`trailers`): its body has ended (without a body callback that
    /// said so). The record is settled now: a gRPC call by the `grpc-status` in them (released
    /// when it is in `retryable_grpc_codes`), and the trailers that matter are stored.
    pub fn on_response_trailers(
        &mut self,
        rt: &Runtime,
        trailers: &[(String, String)],
        read: impl FnOnce() -> Vec<u8>,
        now_ms: u64,
    ) -> Step {
        if !matches!(
            self.phase,
            Phase::BufferingResponse | Phase::CopyingResponse | Phase::StreamingResponse
        ) {
            return match self.phase {
                Phase::Completing => Step::Wait,
                _ => Step::Continue,
            };
        }
        let Some(cfg) = self.idem_config(rt) else {
            return Step::Continue;
        };
        let code = if self.grpc {
            grpc::status_of(trailers)
        } else {
            None
        };
        if code.is_some_and(|c| cfg.retryable_grpc(c)) {
            if let Some(i) = self.idem.as_mut() {
                i.body = Vec::new();
            }
            let call = self.release_call();
            return self.settle_record(rt, call, now_ms);
        }
        let kept = kept_trailers(cfg, trailers);
        let max = cfg.max_response_body;
        let buffering = self.phase == Phase::BufferingResponse;
        if let Some(i) = self.idem.as_mut() {
            i.trailers = kept;
        }
        if buffering {
            let body = read();
            if let Some(i) = self.idem.as_mut() {
                if body.len() as u64 > max {
                    i.too_large = true;
                } else {
                    i.body = body;
                }
            }
        }
        let call = self.completion_call(rt);
        self.settle_record(rt, call, now_ms)
    }

    fn outcome_unknown(&mut self, rt: &Runtime, details: &str, m: &dyn MetricSink) {
        if let Some(im) = self.idem_metrics(rt) {
            m.increment(im.outcome_unknown);
        }
        log::warn!(
            "policy {} key {}: the upstream's outcome is unknown ({}); the record stays PROCESSING until its TTL",
            self.policy_name(rt),
            self.key_hash(),
            if details.is_empty() { "stream ended" } else { details }
        );
        if let Some(i) = self.idem.as_mut() {
            i.owned = false;
        }
        self.phase = Phase::Done;
    }

    /// The stream is gone. A record we still own is released if the request never left
    /// Envoy, and kept `PROCESSING` (outcome unknown) otherwise.
    pub fn on_done(&mut self, rt: &Runtime, m: &dyn MetricSink) {
        self.release_lease(rt);
        // Response-side calls still outstanding may be cancelled with the stream: the root
        // sends them again (an answer that arrives twice is counted twice, nothing worse).
        let key_hash = self
            .idem
            .as_ref()
            .map_or(String::new(), |i| i.key_hash.clone());
        let unfinished: Vec<(Purpose, ScriptCall)> = self
            .pending
            .iter()
            .filter(|p| !p.done)
            .filter(|p| {
                matches!(
                    p.purpose,
                    Purpose::Complete | Purpose::Release | Purpose::LeaseRelease
                )
            })
            .map(|p| (p.purpose, p.call.clone()))
            .collect();
        for (purpose, call) in unfinished {
            // The first call may have done it already: "not ours" is then expected.
            self.background
                .push(Background::new(self.policy, purpose, call, key_hash.clone()).uncertain());
        }
        let owned = self.idem.as_ref().is_some_and(|i| i.owned);
        match self.phase {
            Phase::Acquiring => self.release_in_background(rt),
            _ if !owned => {}
            Phase::Completing => {}
            _ if !self.forwarded => self.release_in_background(rt),
            _ if !self.response_seen => self.outcome_unknown(rt, "", m),
            // Never stored as completed: the client did not get the whole response either.
            Phase::BufferingResponse | Phase::CopyingResponse | Phase::StreamingResponse => {
                self.outcome_unknown(rt, "the response ended before its end of stream", m)
            }
            _ => {}
        }
        self.phase = Phase::Done;
    }
}

/// What the response's headers say, as the idempotency decision needs it.
#[derive(Clone, Copy)]
struct ResponseHead<'a> {
    status: u32,
    via_upstream: bool,
    details: &'a str,
    headers: &'a [(String, String)],
    end_of_stream: bool,
    shape: Shape,
}

/// What kind of stream a response is, as far as the guards care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// A response that ends (its body, however large, has an end the filter waits for).
    Plain,
    /// An accepted upgrade (`101 Switching Protocols`, e.g. WebSocket) or a `CONNECT` tunnel
    /// (`2xx`): a session in another protocol, open until either side closes it.
    Tunnel,
    /// A response whose body is a stream of events that may never end (`text/event-stream`,
    /// `multipart/x-mixed-replace`).
    EventStream,
}

/// Media types of responses that stream for as long as the producer likes.
const EVENT_STREAM_TYPES: &[&str] = &["text/event-stream", "multipart/x-mixed-replace"];

fn response_shape(
    status: u32,
    via_upstream: bool,
    connect: bool,
    headers: &[(String, String)],
    end_of_stream: bool,
) -> Shape {
    if !via_upstream {
        return Shape::Plain;
    }
    if status == 101 || (connect && (200..300).contains(&status)) {
        return Shape::Tunnel;
    }
    let event_stream = headers
        .iter()
        .filter(|(n, _)| n == "content-type")
        .any(|(_, v)| {
            let media = v.split(';').next().unwrap_or("").trim();
            EVENT_STREAM_TYPES
                .iter()
                .any(|t| media.eq_ignore_ascii_case(t))
        });
    if event_stream && !end_of_stream {
        Shape::EventStream
    } else {
        Shape::Plain
    }
}

/// The response has a body the filter does not store, so it streams untouched and a reference
/// record is written at its end: `replay: reference`, or `content-length` says the body is
/// larger than `max_response_body`.
fn streams_body(cfg: &Idempotency, headers: &[(String, String)], end_of_stream: bool) -> bool {
    (cfg.replay == Replay::Reference && !end_of_stream)
        || declared_too_large(cfg, headers, end_of_stream)
}

/// The response says (`content-length`) that its body is larger than `max_response_body`:
/// it is never buffered. Only with `replay: full` (a reference record needs no body).
fn declared_too_large(
    cfg: &Idempotency,
    headers: &[(String, String)],
    end_of_stream: bool,
) -> bool {
    cfg.replay == Replay::Full
        && !end_of_stream
        && content_length(headers).is_some_and(|n| n > cfg.max_response_body)
}

/// The `content-length` of a response, when it has exactly one readable value.
fn content_length(headers: &[(String, String)]) -> Option<u64> {
    let mut values = headers.iter().filter(|(n, _)| n == "content-length");
    let (_, v) = values.next()?;
    if values.next().is_some() {
        return None;
    }
    v.trim().parse().ok()
}

fn acquire_pending(g: acquire::Group, now_ms: u64) -> Pending {
    Pending {
        purpose: Purpose::Acquire,
        script: Purpose::Acquire.script(),
        call: g.call,
        limits: g.limits,
        idem: g.idem,
        lease: g.lease,
        by_sha: true,
        sent_ms: now_ms,
        done: false,
        // Only a call that carries the record or the lease can leave one behind.
        record_unsettled: g.idem,
        lease_unsettled: g.lease,
    }
}

/// The trailers of a response the record keeps: `grpc-status`, `grpc-message` and the
/// configured `replay_trailers`, in the order received.
fn kept_trailers(cfg: &Idempotency, trailers: &[(String, String)]) -> Vec<(String, String)> {
    trailers
        .iter()
        .filter(|(n, _)| {
            n == grpc::STATUS || n == grpc::MESSAGE || cfg.replay_trailers.iter().any(|t| t == n)
        })
        .cloned()
        .collect()
}

/// The stored response as a local reply, with `Idempotent-Replayed: true`. For a gRPC
/// request whose record holds a gRPC status, see [`grpc_replay`].
fn replay(record: &Record, extra: Vec<(String, String)>, grpc: bool) -> Option<LocalResponse> {
    let stored = record.response.as_ref()?;
    let body = stored.body_bytes()?;
    if grpc {
        if let Some(code) = stored
            .trailer(grpc::STATUS)
            .and_then(|v| v.trim().parse().ok())
        {
            return Some(grpc_replay(stored, code, body.is_empty(), extra));
        }
    }
    let mut headers = stored.headers.clone();
    headers.push((REPLAYED_HEADER.into(), "true".into()));
    headers.extend(extra);
    Some(LocalResponse {
        status: u32::from(stored.status),
        headers,
        body,
        problem: None,
        grpc_status: None,
    })
}

/// A gRPC replay. The host answers every local reply to a gRPC request trailers-only (HTTP
/// 200, the status in the headers, no body): the stored `grpc-status`, `grpc-message` and
/// replay trailers go in its headers, which a gRPC client reads exactly as the original
/// trailers-only answer, or the original trailers after an empty body. The response messages
/// themselves cannot be carried: a call that ended `OK` after sending messages (every
/// successful unary call), or whose body was not stored, is answered `ALREADY_EXISTS`, saying
/// so, rather than an `OK` without its message (which clients fail as a protocol error). A
/// failed call is replayed with its status and message (the messages sent before it are not).
fn grpc_replay(
    stored: &StoredResponse,
    code: u32,
    empty_body: bool,
    extra: Vec<(String, String)>,
) -> LocalResponse {
    let mut headers: Vec<(String, String)> = stored
        .headers
        .iter()
        .filter(|(n, _)| n != "content-length" && n != grpc::STATUS && n != grpc::MESSAGE)
        .cloned()
        .collect();
    let replayable = code != grpc::OK || (empty_body && !stored.reference);
    let code = if replayable {
        headers.extend(stored.trailers.iter().cloned());
        code
    } else {
        headers.push((grpc::STATUS.into(), grpc::ALREADY_EXISTS.to_string()));
        headers.push((
            grpc::MESSAGE.into(),
            grpc::encode_message(
                "the call with this idempotency key already completed with OK; its response \
                 message cannot be replayed to a gRPC client",
            ),
        ));
        grpc::ALREADY_EXISTS
    };
    headers.push((REPLAYED_HEADER.into(), "true".into()));
    headers.extend(extra);
    LocalResponse {
        status: u32::from(stored.status),
        headers,
        body: Vec::new(),
        problem: None,
        grpc_status: Some(code),
    }
}

#[cfg(test)]
mod tests;
