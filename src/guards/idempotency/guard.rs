//! The idempotency guard of one request: its record (acquire, ownership), what the acquire
//! answer means, and the calls that complete or release the record. The response it stores
//! is assembled in [`crate::guards::idempotency::capture`].

use crate::config::{Completion, FingerprintPart, Idempotency, InProgress, Replay};
use crate::guards::background::{Background, Holder};
use crate::guards::backoff::Backoff;
use crate::guards::context::{Pcx, Purpose};
use crate::guards::idempotency::capture::Assembly;
use crate::guards::idempotency::fingerprint::{
    canonical_body, canonical_need, is_json, Fingerprint,
};
use crate::guards::idempotency::header::{parse_key, KeyError};
use crate::guards::idempotency::record::{Record, StoredResponse};
use crate::guards::idempotency::seal::{fresh_nonce, record_aad, OpenError};
use crate::http::grpc;
use crate::http::identity::Caller;
use crate::http::local_reply::{self, LocalResponse, Problem};
use crate::http::request::Request;
use crate::redis::keys;
use crate::redis::scripts::acquire::{self, LeaseAcquire, RecordAcquire, RecordAnswer};
use crate::redis::scripts::record::{self, outcome, Outcome};
use crate::redis::{resp::Reply, CallError, ScriptCall};
use crate::support::lograte::WarnKind;
use crate::support::metrics::{IdempotencyMetrics, MetricSink};

/// Marks a replayed response.
pub(crate) const REPLAYED_HEADER: &str = "idempotent-replayed";

#[derive(Debug)]
pub(crate) struct IdempotencyGuard {
    pub(crate) acquire: RecordAcquire,
    /// Hash of the client's key, for logs.
    pub(crate) key_hash: String,
    /// We hold the `PROCESSING` record.
    pub(crate) owned: bool,
    /// The acquire's answer, until the rate limits are decided.
    pub(crate) answer: Option<RecordAnswer>,
    /// The response being stored.
    pub(crate) stored: Assembly,
    /// Waiting for a duplicate still in progress (`in_progress: wait`).
    wait: Backoff,
}

/// The record key of a client's Idempotency-Key (as [`parse_key`] reads it) in the hash tag
/// `tenant_tag` of policy `policy`, and the key's hash (the key's last part, and what logs
/// name a record by).
pub fn record_key(
    prefix: &str,
    tenant_tag: &str,
    policy: &str,
    client_key: &str,
) -> (String, String) {
    let key_hash = keys::client_key_hash(client_key);
    (
        keys::idempotency_key(prefix, tenant_tag, policy, &key_hash),
        key_hash,
    )
}

/// First and largest pause between polls of a record still in progress (`in_progress: wait`).
pub(crate) const RECORD_POLL_FIRST_MS: u64 = 50;
pub(crate) const RECORD_POLL_MAX_MS: u64 = 200;

/// What the acquire answer means for the request.
#[derive(Debug)]
pub(crate) enum IdempotencyDecision {
    /// The record is ours: go on, telling the service the fingerprint.
    Acquired(String),
    /// The acquire skipped the record: go on (without the lease).
    Skipped,
    /// No record answer (no key, or none asked): the lease decides.
    NotAsked,
    /// Answer locally (in progress, conflict, replay); rate-limit headers already added.
    Answer(LocalResponse),
    /// The same request is still in progress and this one waits for it: poll at this time.
    PollAt(u64),
}

impl IdempotencyGuard {
    /// The request's key, if it carries one (`Ok(None)`: not required and absent); `Err` is
    /// the problem to answer with.
    pub(crate) fn prepare(
        at: &Pcx<'_>,
        cfg: &Idempotency,
        caller: &Caller,
        req: &Request,
        owner: &str,
    ) -> Result<Option<IdempotencyGuard>, LocalResponse> {
        let values: Vec<&str> = req.headers.values(&cfg.header).collect();
        let client_key = match parse_key(&values) {
            Ok(k) => k,
            Err(KeyError::Missing) if !cfg.required => return Ok(None),
            Err(e) => return Err(key_problem(at, cfg, &e)),
        };
        let declared = req
            .header("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        if cfg.needs_body() && declared.is_some_and(|n| n > cfg.max_request_body) {
            return Err(body_too_large(at, cfg));
        }
        let prefix = &at.rt.config.redis.key_prefix;
        let tag = keys::tenant_tag(&caller.tenant);
        let (key, key_hash) = record_key(prefix, &tag, &at.policy.name, &client_key);
        let cancel_key = keys::cancel_key(prefix, &tag, &at.policy.name, owner);
        Ok(Some(IdempotencyGuard {
            acquire: RecordAcquire {
                key,
                tag,
                fingerprint: String::new(),
                owner: owner.to_string(),
                processing_ttl_ms: cfg.processing_ttl_ms,
                cancel_key,
            },
            key_hash,
            owned: false,
            answer: None,
            stored: Assembly::default(),
            wait: Backoff::new(RECORD_POLL_FIRST_MS, RECORD_POLL_MAX_MS, owner),
        }))
    }

    /// What fingerprinting `body` takes besides the body itself (its canonical JSON's copies,
    /// when it is JSON and the fingerprint covers it).
    pub(crate) fn fingerprint_need(cfg: &Idempotency, req: &Request, body: &[u8]) -> usize {
        if cfg.needs_body() {
            canonical_need(body, is_json(req.header("content-type")))
        } else {
            0
        }
    }

    /// The response body could not be held within the worker's memory budget: the record is
    /// stored by reference (warned about, rate-limited).
    pub(crate) fn over_budget(&self, at: &Pcx<'_>) {
        let memory = &at.rt.memory;
        at.rt
            .warnings
            .warn(WarnKind::MemoryBudget, at.index, at.now_ms, || {
                format!(
                    "idempotency record of policy {} key {}: the response body does not fit \
                     this worker's memory budget ({} of {} bytes held); storing it by reference",
                    at.policy.name,
                    self.key_hash,
                    memory.held(),
                    memory.limit()
                )
            });
    }

    /// Fingerprints the request (with its whole body, if the fingerprint covers it).
    pub(crate) fn fingerprint(
        &mut self,
        cfg: &Idempotency,
        caller: &Caller,
        req: &Request,
        body: &[u8],
    ) {
        let mut f = Fingerprint::default();
        for part in &cfg.fingerprint {
            match part {
                FingerprintPart::Method => f.part("method", req.method.as_bytes()),
                FingerprintPart::Path => f.part("path", req.path().as_bytes()),
                FingerprintPart::Query => f.part("query", req.query.as_bytes()),
                FingerprintPart::Principal => f.part("principal", caller.principal.as_bytes()),
                FingerprintPart::Body => {
                    let json = is_json(req.header("content-type"));
                    f.part("body", &canonical_body(body, json));
                }
                FingerprintPart::Header(h) => match req.header(h) {
                    Some(v) => f.part(&format!("header:{h}"), v.as_bytes()),
                    None => f.part(&format!("header:{h}!"), b""),
                },
            }
        }
        self.acquire.fingerprint = f.finish();
    }

    /// The acquire answered for the record.
    pub(crate) fn answered(&mut self, answer: RecordAnswer) {
        if answer == RecordAnswer::Acquired {
            self.owned = true;
        }
        self.answer = Some(answer);
    }

    /// The acquire answer, once the rate limits admitted the request (`limit_headers` go on
    /// any local answer).
    pub(crate) fn decide(
        &mut self,
        at: &Pcx<'_>,
        limit_headers: &[(String, String)],
        grpc: bool,
    ) -> IdempotencyDecision {
        let (Some(answer), Some(cfg), Some(im)) = (
            self.answer.take(),
            at.policy.idempotency.as_ref(),
            at.pm.record.as_ref(),
        ) else {
            return IdempotencyDecision::NotAsked;
        };
        let waited = self.wait.waited();
        if waited && !matches!(answer, RecordAnswer::InProgress { .. }) {
            at.m.increment(im.waited);
        }
        match answer {
            RecordAnswer::Acquired => {
                at.m.increment(im.acquired);
                // Only a request that holds its record tells the service its fingerprint.
                IdempotencyDecision::Acquired(self.acquire.fingerprint.clone())
            }
            RecordAnswer::Skipped => IdempotencyDecision::Skipped,
            RecordAnswer::InProgress { .. } if cfg.in_progress == InProgress::Wait => {
                match self.wait.next_poll(at.now_ms, cfg.max_wait_ms) {
                    Some(poll_at) => IdempotencyDecision::PollAt(poll_at),
                    None => {
                        let response = self.local_answer(at, cfg, im, answer, grpc);
                        IdempotencyDecision::Answer(local_reply::with_limit_headers(
                            response,
                            limit_headers,
                        ))
                    }
                }
            }
            answer => {
                let response = self.local_answer(at, cfg, im, answer, grpc);
                IdempotencyDecision::Answer(local_reply::with_limit_headers(
                    response,
                    limit_headers,
                ))
            }
        }
    }

    /// The answer of a duplicate that waited for the record (found it in progress) and does
    /// not hold it, when its poll failed: the in-progress answer it would give at `max_wait`.
    pub(crate) fn waiting_answer(&self, at: &Pcx<'_>, grpc: bool) -> Option<LocalResponse> {
        if !self.wait.waited() || self.owned {
            return None;
        }
        let (cfg, im) = (at.policy.idempotency.as_ref()?, at.pm.record.as_ref()?);
        Some(self.local_answer(at, cfg, im, RecordAnswer::InProgress { pttl_ms: 0 }, grpc))
    }

    /// The local answer for a record this request cannot take: in progress, a conflict, an
    /// unreadable record (answered as a conflict), or a replay of the stored response.
    fn local_answer(
        &self,
        at: &Pcx<'_>,
        cfg: &Idempotency,
        im: &IdempotencyMetrics,
        answer: RecordAnswer,
        grpc: bool,
    ) -> LocalResponse {
        let conflict = || {
            local_reply::problem(
                &at.rt.config.problem_type_base,
                Problem::IdempotencyKeyConflict {
                    status: cfg.conflict_status,
                },
                "this Idempotency-Key was already used for a different request",
                &[],
                Vec::new(),
            )
        };
        match answer {
            RecordAnswer::InProgress { .. } => {
                at.m.increment(im.in_progress);
                local_reply::problem(
                    &at.rt.config.problem_type_base,
                    Problem::IdempotencyKeyInUse {
                        status: cfg.in_progress_status,
                    },
                    "a request with this Idempotency-Key is still being processed; retry later",
                    &[],
                    vec![("retry-after".to_string(), "1".to_string())],
                )
            }
            RecordAnswer::Completed(record) => match self.open(cfg, *record) {
                Ok(stored) => match replay(stored, grpc) {
                    Some(response) => {
                        at.m.increment(im.replayed);
                        response
                    }
                    None => {
                        at.m.increment(im.unreadable);
                        at.m.increment(im.conflict);
                        conflict()
                    }
                },
                Err(e) => {
                    at.m.increment(im.unreadable);
                    at.m.increment(im.sealed_unreadable);
                    at.m.increment(im.conflict);
                    at.rt.warnings.warn(WarnKind::RecordUnopened, at.index, at.now_ms, || {
                        format!(
                            "idempotency record of policy {} key {} cannot be opened: {e}; answering as a conflict",
                            at.policy.name, self.key_hash
                        )
                    });
                    conflict()
                }
            },
            RecordAnswer::Unreadable => {
                at.m.increment(im.unreadable);
                at.m.increment(im.conflict);
                log::warn!(
                    "idempotency record of policy {} key {} is unreadable; answering as a conflict",
                    at.policy.name,
                    self.key_hash
                );
                conflict()
            }
            // (Acquired and Skipped never come here: they are not local answers.)
            RecordAnswer::Conflict | RecordAnswer::Acquired | RecordAnswer::Skipped => {
                at.m.increment(im.conflict);
                conflict()
            }
        }
    }

    /// The call that stores the assembled response as `COMPLETED`.
    pub(crate) fn completion_call(&self, cfg: &Idempotency) -> (Purpose, ScriptCall) {
        let s = &self.stored;
        let body = match cfg.replay {
            Replay::Full if !s.too_large => Some(s.body.as_slice()),
            _ => None,
        };
        let stored = StoredResponse::new(
            u16::try_from(s.status).unwrap_or(500),
            s.headers.clone(),
            body,
        )
        .with_trailers(s.trailers.clone());
        let response = match &cfg.encryption {
            None => stored.to_json(),
            Some(keys) => {
                let sealed = fresh_nonce().and_then(|nonce| stored.seal(keys, &self.aad(), nonce));
                match sealed {
                    Some(sealed) => sealed.to_json(),
                    None => {
                        // Never stored in the clear: the record is given up instead.
                        log::error!(
                            "idempotency record key {}: the host gave no random bytes to seal the response with; releasing the record instead of storing it in the clear",
                            self.key_hash
                        );
                        return self.release_call();
                    }
                }
            }
        };
        let call = record::complete(&self.acquire, cfg.completed_ttl_ms, response);
        (Purpose::Complete, call)
    }

    /// The additional data that binds a sealed response to this record and this request.
    fn aad(&self) -> Vec<u8> {
        record_aad(&self.acquire.key, &self.acquire.fingerprint)
    }

    /// The response a completed record holds, opened with the policy's keys when sealed. A
    /// plain one opens whatever the keys: records written before encryption was turned on
    /// still replay.
    fn open(&self, cfg: &Idempotency, record: Record) -> Result<StoredResponse, OpenError> {
        // (A completed record always has a response: `Record::parse` sees to it.)
        let response = record.response.ok_or(OpenError::Malformed)?;
        response.open(cfg.encryption.as_ref(), &self.aad())
    }

    /// The call that releases the record (a retry may run the operation again).
    pub(crate) fn release_call(&self) -> (Purpose, ScriptCall) {
        (Purpose::Release, record::release(&self.acquire, None))
    }

    /// Hands a complete/release to the root (async completion): the record is no longer
    /// the request's to settle.
    pub(crate) fn settle_later(
        &mut self,
        policy: usize,
        (purpose, call): (Purpose, ScriptCall),
    ) -> Background {
        self.owned = false;
        Background::new(policy, purpose, call, self.key_hash.clone())
    }

    /// Counts the answer of our complete or release call. The record's key when it settled
    /// the record, for the requests of this worker that wait for it.
    pub(crate) fn settled(
        &mut self,
        at: &Pcx<'_>,
        purpose: Purpose,
        reply: &Reply,
    ) -> Option<String> {
        if let Some(im) = at.pm.record.as_ref() {
            count_settlement(im, purpose, reply, &at.policy.name, &self.key_hash, at.m);
        }
        self.owned = false;
        (reply.as_int() == Some(1)).then(|| self.acquire.key.clone())
    }

    /// The record-only acquire that polls a record still in progress (with the lease, when
    /// the policy has one, so a request that gets the record also tries the lease).
    pub(crate) fn poll_call(&self, lease: Option<&LeaseAcquire>, nonce: &str) -> ScriptCall {
        acquire::record_poll(&self.acquire, lease, nonce)
    }

    /// The record could not be completed or released: the response goes out anyway and the
    /// record expires at its processing TTL.
    pub(crate) fn settle_failed(&mut self, at: &Pcx<'_>, err: &CallError) {
        if let Some(im) = at.pm.record.as_ref() {
            at.m.increment(im.complete_failed);
        }
        at.rt.warnings.warn(WarnKind::RecordNotSettled, at.index, at.now_ms, || {
            format!(
                "idempotency record of policy {} key {} not completed ({}); it expires at its processing TTL",
                at.policy.name,
                self.key_hash,
                err.describe()
            )
        });
        self.owned = false;
    }

    /// The upstream's outcome is unknown: the record stays `PROCESSING` until its TTL.
    pub(crate) fn outcome_unknown(&mut self, at: &Pcx<'_>, details: &str) {
        if let Some(im) = at.pm.record.as_ref() {
            at.m.increment(im.outcome_unknown);
        }
        log::warn!(
            "policy {} key {}: the upstream's outcome is unknown ({}); the record stays PROCESSING until its TTL",
            at.policy.name,
            self.key_hash,
            if details.is_empty() { "stream ended" } else { details }
        );
        self.owned = false;
    }

    /// Whether completion waits for Redis before the response goes on.
    pub(crate) fn sync(cfg: &Idempotency) -> bool {
        cfg.complete == Completion::Sync
    }
}

/// The record, given back from the root: ours, or one an acquire that may still run (or may
/// have run) may have created.
impl Holder for IdempotencyGuard {
    fn held(&mut self) -> &mut bool {
        &mut self.owned
    }

    fn release(&mut self, marker_ttl_ms: Option<u64>) -> (Purpose, ScriptCall, String) {
        let call = record::release(&self.acquire, marker_ttl_ms);
        (Purpose::Release, call, self.key_hash.clone())
    }
}

/// The problem for a missing or invalid key, counted.
fn key_problem(at: &Pcx<'_>, cfg: &Idempotency, e: &KeyError) -> LocalResponse {
    let im = at.pm.record.as_ref();
    let (metric, problem) = match e {
        KeyError::Missing => (im.map(|i| i.missing_key), Problem::IdempotencyKeyMissing),
        _ => (im.map(|i| i.invalid_key), Problem::IdempotencyKeyInvalid),
    };
    if let Some(id) = metric {
        at.m.increment(id);
    }
    let types = &at.rt.config.problem_type_base;
    local_reply::problem(types, problem, &e.detail(&cfg.header), &[], Vec::new())
}

/// The `413` for a body larger than the fingerprint may read, counted.
pub(crate) fn body_too_large(at: &Pcx<'_>, cfg: &Idempotency) -> LocalResponse {
    if let Some(im) = at.pm.record.as_ref() {
        at.m.increment(im.body_too_large);
    }
    let detail = format!(
        "the request body is larger than the {} bytes this operation fingerprints",
        cfg.max_request_body
    );
    let types = &at.rt.config.problem_type_base;
    local_reply::problem(
        types,
        Problem::RequestBodyTooLarge,
        &detail,
        &[],
        Vec::new(),
    )
}

/// The stored response as a local reply, with `Idempotent-Replayed: true`. For a gRPC
/// request whose record holds a gRPC status, see [`grpc_replay`].
fn replay(mut stored: StoredResponse, grpc: bool) -> Option<LocalResponse> {
    let body = stored.take_body()?;
    if grpc {
        if let Some(code) = stored
            .trailer(grpc::STATUS)
            .and_then(|v| v.trim().parse().ok())
        {
            return Some(grpc_replay(&stored, code, body.is_empty()));
        }
    }
    let mut headers = stored.headers;
    headers.push((REPLAYED_HEADER.into(), "true".into()));
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
fn grpc_replay(stored: &StoredResponse, code: u32, empty_body: bool) -> LocalResponse {
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
    LocalResponse {
        status: u32::from(stored.status),
        headers,
        body: Vec::new(),
        problem: None,
        grpc_status: Some(code),
    }
}

/// Counts what a complete (`1` written, `0` missing, `-1` not owner) or release (`1`
/// released, `0` missing, `-1` not owner) call found.
pub(crate) fn count_settlement(
    im: &IdempotencyMetrics,
    purpose: Purpose,
    reply: &Reply,
    policy: &str,
    key_hash: &str,
    m: &dyn MetricSink,
) {
    match (purpose, outcome(reply)) {
        (Purpose::Complete, Outcome::Done) => m.increment(im.completed),
        (Purpose::Release, Outcome::Done) => m.increment(im.released),
        (_, Outcome::NotOurs) => {
            m.increment(im.stale_owner);
            log::warn!(
                "policy {policy} key {key_hash}: the record is no longer ours (its processing TTL expired); not overwritten"
            );
        }
        _ => {
            m.increment(im.complete_failed);
            log::warn!(
                "policy {policy} key {key_hash}: unexpected answer to a record update: {reply:?}"
            );
        }
    }
}
