//! `idempotency`: the Idempotency-Key record of a policy, its fingerprint and its replay.

use crate::config::fields::{
    duration, env_value, header_list, header_name, is_header_name, max_wait, methods, one_of, size,
};
use crate::config::reader::{index, Obj, Result};
use crate::config::{ConfigError, Env, Keyring, Limits, RecordKey, BODY_SHARE_OF_BUDGET};
use crate::support::grpc_status as grpc;
use serde_json::Value;

/// `idempotency.in_progress`: a duplicate of a request still running is answered at once, or
/// waits for the first one's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InProgress {
    Reject,
    Wait,
}

/// A part of the request that enters the idempotency fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FingerprintPart {
    Method,
    Path,
    Query,
    Principal,
    Body,
    Header(String),
}

impl FingerprintPart {
    /// The part as the configuration spells it (`method`, `header:<name>`), for the host tools.
    pub fn spelling(&self) -> String {
        match self {
            FingerprintPart::Method => "method".into(),
            FingerprintPart::Path => "path".into(),
            FingerprintPart::Query => "query".into(),
            FingerprintPart::Principal => "principal".into(),
            FingerprintPart::Body => "body".into(),
            FingerprintPart::Header(h) => format!("header:{h}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay {
    /// Store status, replay headers and body (when it fits `max_response_body`).
    Full,
    /// Store status and replay headers only (a reference record).
    Reference,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// The client gets the response once the record is written.
    Sync,
    /// The response goes out at once; the record is written right after.
    Async,
}

/// A status or a class of statuses (`"5xx"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusMatch {
    Exact(u32),
    Class(u32),
}

impl StatusMatch {
    pub fn matches(self, status: u32) -> bool {
        match self {
            StatusMatch::Exact(s) => s == status,
            StatusMatch::Class(c) => status / 100 == c,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Idempotency {
    /// Lower-case header name.
    pub header: String,
    pub required: bool,
    /// Upper-case methods the key applies to.
    pub methods: Vec<String>,
    pub processing_ttl_ms: u64,
    pub completed_ttl_ms: u64,
    pub fingerprint: Vec<FingerprintPart>,
    pub max_request_body: u64,
    pub replay: Replay,
    pub max_response_body: u64,
    /// Lower-case names of the response headers stored and replayed.
    pub replay_headers: Vec<String>,
    /// Lower-case names of the response trailers stored and replayed besides `grpc-status`
    /// and `grpc-message`, which a gRPC response always stores.
    pub replay_trailers: Vec<String>,
    pub conflict_status: u32,
    /// What a duplicate of a request still in progress gets.
    pub in_progress: InProgress,
    /// How long a duplicate waits (`in_progress: wait`) before the reject answer.
    pub max_wait_ms: u64,
    /// The status of that answer: 409 or 425.
    pub in_progress_status: u32,
    pub retryable_statuses: Vec<StatusMatch>,
    /// gRPC status codes after which the record of a gRPC call is released.
    pub retryable_grpc_codes: Vec<u32>,
    pub complete: Completion,
    /// `encryption`: completed records' responses are sealed with these keys.
    pub encryption: Option<Keyring>,
}

impl Idempotency {
    pub fn applies_to(&self, method: &str) -> bool {
        self.methods.iter().any(|m| m == method)
    }

    pub fn retryable(&self, status: u32) -> bool {
        self.retryable_statuses.iter().any(|s| s.matches(status))
    }

    /// A gRPC call that ended with `code` is released (its retry runs again).
    pub fn retryable_grpc(&self, code: u32) -> bool {
        self.retryable_grpc_codes.contains(&code)
    }

    pub fn needs_body(&self) -> bool {
        self.fingerprint.contains(&FingerprintPart::Body)
    }
}

/// The largest request body the filter buffers to fingerprint.
pub const MAX_REQUEST_BODY: u64 = 64 << 20;
/// The largest response body stored for replay (it travels through the gateway as an argument).
pub const MAX_RESPONSE_BODY: u64 = 4 << 20;

/// What the filter buffers must stay below Envoy's buffer limit, else Envoy answers itself
/// (`413` for a request body, `500` for a response body) before the filter can. Half of it by
/// default, so that the piece of body that crosses the filter's limit cannot also cross Envoy's.
/// And a worker must be able to hold what copying one such body takes: at most an eighth of
/// `memory_budget` (see [`BODY_SHARE_OF_BUDGET`]).
fn below_envoy_limit(
    o: &mut Obj<'_>,
    field: &'static str,
    max: u64,
    default: u64,
    limits: Limits,
) -> Result<u64> {
    let path = o.field_path(field);
    let envoy_buffer_limit = limits.envoy_buffer;
    let budget = limits.memory_budget;
    match size(o, field, max)? {
        None => Ok(default
            .min(envoy_buffer_limit / 2)
            .min(budget / BODY_SHARE_OF_BUDGET)
            .max(1)),
        Some(n) if n < envoy_buffer_limit && n.saturating_mul(BODY_SHARE_OF_BUDGET) <= budget => {
            Ok(n)
        }
        Some(n) if n < envoy_buffer_limit => {
            let (what, refused) = if field == "max_request_body" {
                ("fingerprinting", "answers 503 guard_overloaded")
            } else {
                ("storing", "stores it by reference")
            };
            Err(ConfigError::new(
                path,
                format!(
                    "{n} bytes is more than an eighth of memory_budget ({budget} bytes): \
                     {what} one such body takes several copies of it, and a worker that cannot \
                     hold them {refused}; lower it, or raise memory_budget to at least \
                     {} bytes",
                    n.saturating_mul(BODY_SHARE_OF_BUDGET)
                ),
            ))
        }
        Some(n) => {
            let (what, answer, setting) = if field == "max_request_body" {
                ("request", "413", "the listener's")
            } else {
                ("response", "500", "the upstream cluster's")
            };
            Err(ConfigError::new(
                path,
                format!(
                    "{n} bytes is not below envoy_buffer_limit ({envoy_buffer_limit} bytes): Envoy \
                     answers {answer} itself once a filter buffers more of a {what} body than \
                     {setting} per_connection_buffer_limit_bytes; lower it, or raise that Envoy \
                     setting and envoy_buffer_limit together"
                ),
            ))
        }
    }
}

const IDEMPOTENCY_FIELDS: &[&str] = &[
    "header",
    "required",
    "methods",
    "processing_ttl",
    "completed_ttl",
    "fingerprint",
    "max_request_body",
    "replay",
    "max_response_body",
    "replay_headers",
    "replay_trailers",
    "conflict_status",
    "in_progress",
    "max_wait",
    "in_progress_status",
    "retryable_statuses",
    "retryable_grpc_codes",
    "complete",
    "encryption",
];

pub fn idempotency(v: &Value, path: &str, limits: Limits, env: Env<'_>) -> Result<Idempotency> {
    let mut o = Obj::new(v, path, IDEMPOTENCY_FIELDS)?;
    let header = header_name(&mut o, "header")?.unwrap_or("idempotency-key".into());
    let required = o.opt_bool("required")?.unwrap_or(true);
    let methods = idem_methods(&mut o, "methods")?;
    let processing_ttl_ms = duration(&mut o, "processing_ttl")?.unwrap_or(120_000);
    let completed_ttl_ms = duration(&mut o, "completed_ttl")?.unwrap_or(86_400_000);
    let fingerprint = fingerprint(&mut o, "fingerprint")?;
    let limit = limits;
    let max_request_body =
        below_envoy_limit(&mut o, "max_request_body", MAX_REQUEST_BODY, 1 << 20, limit)?;
    let replay = one_of(&mut o, "replay", REPLAY)?.unwrap_or(Replay::Full);
    let max_response_body = below_envoy_limit(
        &mut o,
        "max_response_body",
        MAX_RESPONSE_BODY,
        64 << 10,
        limit,
    )?;
    let replay_headers = header_list(
        &mut o,
        "replay_headers",
        &["content-type", "location", "etag"],
    )?;
    let replay_trailers = header_list(&mut o, "replay_trailers", &[])?;
    let conflict_status = status_of(&mut o, "conflict_status", [422, 409])?;
    let (in_progress, max_wait_ms) = in_progress(&mut o)?;
    let in_progress_status = status_of(&mut o, "in_progress_status", [409, 425])?;
    let retryable_statuses = list(&mut o, "retryable_statuses", retryable_status)?
        .unwrap_or_else(|| DEFAULT_RETRYABLE_STATUSES.to_vec());
    let retryable_grpc_codes = retryable_grpc_codes(&mut o, "retryable_grpc_codes")?;
    let complete = one_of(&mut o, "complete", COMPLETE)?.unwrap_or(Completion::Sync);
    let encryption = match o.get("encryption") {
        Some(v) => Some(encryption(v, &o.field_path("encryption"), env)?),
        None => None,
    };
    Ok(Idempotency {
        header,
        required,
        methods,
        processing_ttl_ms,
        completed_ttl_ms,
        fingerprint,
        max_request_body,
        replay,
        max_response_body,
        replay_headers,
        replay_trailers,
        conflict_status,
        in_progress,
        max_wait_ms,
        in_progress_status,
        retryable_statuses,
        retryable_grpc_codes,
        complete,
        encryption,
    })
}

/// `encryption`: the keys that seal stored responses, read from the VM's environment.
fn encryption(v: &Value, path: &str, env: Env<'_>) -> Result<Keyring> {
    let mut o = Obj::new(v, path, &["key_env", "previous_key_env"])?;
    let current_path = o.field_path("key_env");
    let current = record_key(o.req_str("key_env")?, &current_path, env)?;
    let previous_path = o.field_path("previous_key_env");
    let previous = match o.opt_str("previous_key_env")? {
        Some(name) => Some(record_key(name, &previous_path, env)?),
        None => None,
    };
    Ok(Keyring::new(current, previous))
}

/// The key in the VM's environment variable `name`, which the field at `path` names.
fn record_key(name: &str, path: &str, env: Env<'_>) -> Result<RecordKey> {
    let text = env_value(name, path, env)?;
    RecordKey::from_base64(&text).map_err(|problem| {
        ConfigError::new(
            path,
            format!(
                "environment variable {name} {problem}: it must hold a base64 32-byte AES-256 key (e.g. `openssl rand -base64 32`)"
            ),
        )
    })
}

const REPLAY: &[(&str, Replay)] = &[("full", Replay::Full), ("reference", Replay::Reference)];
const COMPLETE: &[(&str, Completion)] = &[("sync", Completion::Sync), ("async", Completion::Async)];
const DEFAULT_RETRYABLE_STATUSES: &[StatusMatch] = &[
    StatusMatch::Class(5),
    StatusMatch::Exact(408),
    StatusMatch::Exact(425),
    StatusMatch::Exact(429),
];

/// The methods a record guards: `POST` and `PATCH` unless listed, never none.
fn idem_methods(o: &mut Obj<'_>, field: &'static str) -> Result<Vec<String>> {
    let path = o.field_path(field);
    match methods(o, field)? {
        None => Ok(vec!["POST".to_string(), "PATCH".to_string()]),
        Some(list) if list.is_empty() => {
            Err(ConfigError::new(path, "must list at least one method"))
        }
        Some(list) => Ok(list),
    }
}

/// An optional array whose items `item` reads, each with its path; `None` when absent.
fn list<T>(
    o: &mut Obj<'_>,
    field: &'static str,
    item: impl Fn(&Value, &str) -> Result<T>,
) -> Result<Option<Vec<T>>> {
    let path = o.field_path(field);
    let Some(items) = o.opt_array(field)? else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, v) in items.iter().enumerate() {
        out.push(item(v, &index(&path, i))?);
    }
    Ok(Some(out))
}

/// The parts the fingerprint covers, in order, each once.
fn fingerprint(o: &mut Obj<'_>, field: &'static str) -> Result<Vec<FingerprintPart>> {
    let path = o.field_path(field);
    let Some(list) = o.opt_str_list(field)? else {
        return Ok(vec![
            FingerprintPart::Method,
            FingerprintPart::Path,
            FingerprintPart::Principal,
            FingerprintPart::Body,
        ]);
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, part) in list.iter().enumerate() {
        let p = fingerprint_part(part).ok_or_else(|| {
            ConfigError::new(
                index(&path, i),
                format!(
                    "{part:?} is not one of method, path, query, principal, body, header:<name>"
                ),
            )
        })?;
        if out.contains(&p) {
            return Err(ConfigError::new(
                index(&path, i),
                format!("{part:?} is listed twice"),
            ));
        }
        out.push(p);
    }
    Ok(out)
}

fn fingerprint_part(part: &str) -> Option<FingerprintPart> {
    Some(match part {
        "method" => FingerprintPart::Method,
        "path" => FingerprintPart::Path,
        "query" => FingerprintPart::Query,
        "principal" => FingerprintPart::Principal,
        "body" => FingerprintPart::Body,
        other => {
            let h = other
                .strip_prefix("header:")
                .filter(|h| is_header_name(h))?;
            FingerprintPart::Header(h.to_ascii_lowercase())
        }
    })
}

/// One of two statuses, the first by default.
fn status_of(o: &mut Obj<'_>, field: &'static str, [first, second]: [u64; 2]) -> Result<u32> {
    let path = o.field_path(field);
    let (low, high) = (first.min(second), first.max(second));
    match o.get(field) {
        None => Ok(u32::try_from(first).unwrap_or(409)),
        Some(v) => match v.as_u64() {
            Some(s) if s == first || s == second => Ok(u32::try_from(s).unwrap_or(409)),
            _ => Err(ConfigError::new(
                path,
                format!("{v} is not {low} or {high}"),
            )),
        },
    }
}

/// `in_progress` (`reject` / `wait`) and, with `wait`, `max_wait` (default 5 s).
fn in_progress(o: &mut Obj<'_>) -> Result<(InProgress, u64)> {
    let mode = one_of(
        o,
        "in_progress",
        &[("reject", InProgress::Reject), ("wait", InProgress::Wait)],
    )?
    .unwrap_or(InProgress::Reject);
    let path = o.field_path("max_wait");
    match (mode, max_wait(o, "max_wait")?) {
        (InProgress::Reject, Some(_)) => Err(ConfigError::new(
            path,
            "only applies to in_progress: \"wait\"",
        )),
        (_, max_wait) => Ok((mode, max_wait.unwrap_or(5_000))),
    }
}

/// A failure status (`4xx`/`5xx`) or status class (`"5xx"`) whose record is released.
fn retryable_status(item: &Value, path: &str) -> Result<StatusMatch> {
    let parsed = match item {
        Value::Number(n) => n
            .as_u64()
            .filter(|s| (100..=599).contains(s))
            .and_then(|s| u32::try_from(s).ok())
            .map(StatusMatch::Exact),
        Value::String(s) => match s.as_bytes() {
            [d @ b'1'..=b'5', b'x', b'x'] => Some(StatusMatch::Class(u32::from(d - b'0'))),
            _ => None,
        },
        _ => None,
    };
    let Some(m) = parsed else {
        return Err(ConfigError::new(
            path,
            format!("{item} is not a status (100-599) or a class like \"5xx\""),
        ));
    };
    let failure = match m {
        StatusMatch::Exact(s) => s >= 400,
        StatusMatch::Class(c) => c >= 4,
    };
    if !failure {
        return Err(ConfigError::new(
            path,
            format!("{item} is not a 4xx or 5xx status; only failures can be retryable"),
        ));
    }
    Ok(m)
}

/// The gRPC codes whose record is released, each a failure, each once.
fn retryable_grpc_codes(o: &mut Obj<'_>, field: &'static str) -> Result<Vec<u32>> {
    let path = o.field_path(field);
    let Some(items) = o.opt_array(field)? else {
        return Ok(vec![
            grpc::UNAVAILABLE,
            grpc::DEADLINE_EXCEEDED,
            grpc::RESOURCE_EXHAUSTED,
            grpc::ABORTED,
        ]);
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let code = grpc_code(item).ok_or_else(|| {
            ConfigError::new(
                index(&path, i),
                format!(
                    "{item} is not a gRPC status code (a name like \"UNAVAILABLE\" or a number 1-16)"
                ),
            )
        })?;
        let problem = if code == grpc::OK {
            "is OK; only failures can be retryable"
        } else if out.contains(&code) {
            "is listed twice"
        } else {
            out.push(code);
            continue;
        };
        return Err(ConfigError::new(
            index(&path, i),
            format!("{item} {problem}"),
        ));
    }
    Ok(out)
}

fn grpc_code(item: &Value) -> Option<u32> {
    match item {
        Value::Number(n) => n
            .as_u64()
            .and_then(|c| u32::try_from(c).ok())
            .filter(|&c| grpc::code_name(c).is_some()),
        Value::String(s) => grpc::parse_code(s),
        _ => None,
    }
}
