//! The plugin configuration: the public JSON contract, validated once at `on_configure` into
//! the runtime [`Config`]. Validation never half-applies: either every field is valid and a
//! complete `Config` comes out, or the first problem comes back as a [`ConfigError`] naming the
//! field path.
//!
//! Each section's types live beside its reader (`redis.rs`, `policy.rs` for the identity and
//! the match, `rate_limit.rs`, `cost.rs`, `idempotency.rs`, `lease.rs`); this module holds the
//! whole [`Config`], the [`Policy`] and what several sections share, and names every type
//! here, so users write `config::RateLimit` whichever file it is in.

mod calendar;
mod cost;
mod fields;
mod idempotency;
mod keyring;
mod lease;
/// The plugin configurations in what a user deploys (WasmPlugin, Envoy YAML): host tools only.
#[cfg(not(target_arch = "wasm32"))]
pub mod manifest;
mod metrics;
mod policy;
mod rate_limit;
mod reader;
mod redis;
pub mod units;

pub use calendar::{posix_rule, Calendar, Change, Dst, Period, RuleDay, Zone};
pub use cost::{Charge, ChargeSource, Cost, Fallback, CHARGE_MAX_BODY};
pub use fields::selector;
pub use idempotency::{
    Completion, FingerprintPart, Idempotency, InProgress, Replay, StatusMatch, MAX_REQUEST_BODY,
    MAX_RESPONSE_BODY,
};
pub use keyring::{KeyProblem, Keyring, RecordKey, KEY_LEN};
pub use lease::{Lease, OnBusy, MAX_FENCE_TTL_MS};
pub use policy::{HeaderMatch, HeaderTest, IdSource, Identity, Match, MissingTenant};
pub use rate_limit::{
    policy_item, push_policy_item, Algorithm, Quota, RateLimit, UNIT_CONCURRENT, UNIT_REQUESTS,
};
pub use reader::ConfigError;
use reader::{index, Obj, Result};
pub use redis::{Batch, RedisConfig};

pub(crate) use crate::support::jsonscan::Pointer;
pub use crate::support::template::PathTemplate;
use serde_json::Value;
use std::sync::Arc;

/// What a policy does when Redis cannot answer (unreachable, error, or too slow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureMode {
    /// Forward the request and count `failed_open`.
    Open,
    /// Answer `503` problem+json with `Retry-After: 1` and count `failed_closed`.
    Closed,
}

/// A value taken from the request that scopes a counter (rate limits) or names a resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    Tenant,
    Principal,
    ClientIp,
    Method,
    Path,
    /// A request header, lower-cased name.
    Header(String),
    /// The N-th `/`-separated segment of the path (`/orders/123/activate`: 2 is `123`).
    PathSegment(usize),
    /// A query parameter's raw value.
    Query(String),
    /// A variable of the policy's `match.path_template` (`path_param:id`).
    PathParam(PathParam),
}

/// `path_param:<name>`: the text a variable of the policy's path template matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathParam {
    pub name: String,
    /// The policy's template and the variable's index in it: bound once the whole policy is
    /// read (its selectors are read before it is complete), so that a request reads the
    /// variable without looking its name up. `None` only until then.
    pub(crate) bound: Option<(Arc<PathTemplate>, usize)>,
}

impl PathParam {
    /// The variable's value in `path` (a canonical path): `None` when the path does not fit
    /// the template.
    pub(crate) fn value<'p>(&self, path: &'p str) -> Option<&'p str> {
        let (template, index) = self.bound.as_ref()?;
        template.capture(path, *index)
    }
}

impl Selector {
    /// Selectors as the host tools show them: `tenant + principal`, or `the whole policy` for
    /// none.
    pub fn describe_all(sels: &[Selector]) -> String {
        if sels.is_empty() {
            return "the whole policy".into();
        }
        sels.iter()
            .map(Selector::spelling)
            .collect::<Vec<_>>()
            .join(" + ")
    }

    /// The canonical spelling, as in the configuration.
    pub fn spelling(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = self.write_spelling(&mut out);
        out
    }

    /// Writes [`Selector::spelling`] without building a string.
    pub fn write_spelling(&self, w: &mut impl std::fmt::Write) -> std::fmt::Result {
        match self {
            Selector::Tenant => w.write_str("tenant"),
            Selector::Principal => w.write_str("principal"),
            Selector::ClientIp => w.write_str("client_ip"),
            Selector::Method => w.write_str("method"),
            Selector::Path => w.write_str("path"),
            Selector::Header(h) => write!(w, "header:{h}"),
            Selector::PathSegment(n) => write!(w, "path_segment:{n}"),
            Selector::Query(q) => write!(w, "query:{q}"),
            Selector::PathParam(p) => write!(w, "path_param:{}", p.name),
        }
    }
}

/// The longest `max_wait` (idempotency and lease): every waiting request polls Redis several
/// times a second (up to 5 for a record, 10 for a lease), and holds its connection, for this
/// long at most.
pub const MAX_WAIT_MS: u64 = 30_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub name: String,
    pub matcher: Match,
    pub failure_mode: FailureMode,
    pub rate_limits: Vec<RateLimit>,
    pub idempotency: Option<Idempotency>,
    pub lease: Option<Lease>,
    /// A limit or the lease selects the client address: read from the host only then.
    /// Derived once here, never per request (a scan of every policy per request cost a
    /// thousand-policy config a third of its throughput).
    pub uses_client_ip: bool,
    /// Requests need random tokens: a nonce for sliding logs, an owner for records and leases.
    pub needs_tokens: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub redis: RedisConfig,
    pub identity: Identity,
    pub failure_mode: FailureMode,
    pub response_headers: bool,
    pub policies: Vec<Policy>,
    /// Slots of the over-limit cache (0 disables it).
    pub over_limit_cache_entries: usize,
    /// Envoy's `per_connection_buffer_limit_bytes` (listener and upstream cluster), as the
    /// operator declares it: the filter cannot read it, and never buffers that much.
    pub envoy_buffer_limit: u64,
    /// The most heap a worker's VM holds (`memory_budget`): a copy that would take it past
    /// this is not made (see [`crate::support::memory`]).
    pub memory_budget: u64,
    /// Where the `type` URIs of the filter's own problems point (`problem_type_base`): the
    /// problem's name is appended to it. A `429` uses the registered quota-exceeded type
    /// instead.
    pub problem_type_base: String,
}

/// The default `problem_type_base`: the project's page of problem types, one anchor per
/// problem (`docs/problems.md`), so that every `type` URI dereferences to its documentation.
pub const DEFAULT_PROBLEM_TYPE_BASE: &str =
    "https://github.com/coordination-guard/coordination-guard/blob/main/docs/problems.md#";

/// The problem type draft-ietf-httpapi-ratelimit-headers registers for requests that exceed
/// one or more quota policies, with the `violated-policies` member: the `type` of a `429`,
/// whatever `problem_type_base` says.
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// The longest `problem_type_base` accepted.
pub const MAX_PROBLEM_TYPE_BASE: usize = 512;

/// The fields of the configuration's top level.
const ROOT_FIELDS: &[&str] = &[
    "redis",
    "identity",
    "failure_mode",
    "response_headers",
    "envoy_buffer_limit",
    "memory_budget",
    "policies",
    "over_limit_cache",
    "problem_type_base",
];

/// Envoy's default `per_connection_buffer_limit_bytes`.
pub const DEFAULT_ENVOY_BUFFER_LIMIT: u64 = 1 << 20;
/// The largest `envoy_buffer_limit` accepted.
pub const MAX_ENVOY_BUFFER_LIMIT: u64 = 1 << 30;

/// The default `memory_budget` of a worker.
pub const DEFAULT_MEMORY_BUDGET: u64 = 64 << 20;
/// The smallest `memory_budget` accepted.
pub const MIN_MEMORY_BUDGET: u64 = 4 << 20;
/// The largest `memory_budget` accepted: a quarter of the 1 GiB a V8 Wasm VM in Envoy can grow
/// to. The budget's copies may grow the VM's memory to twice the budget (the allocator's spare
/// room and fragments); what the budget does not see (small allocations, the copies that are
/// always made) must still fit in the rest.
pub const MAX_MEMORY_BUDGET: u64 = 256 << 20;
/// A body limit (`max_request_body`, `max_response_body`) may be at most this fraction of
/// `memory_budget`: fingerprinting or storing one such body takes several copies of it.
pub const BODY_SHARE_OF_BUDGET: u64 = 8;

/// Default size of the over-limit cache: 16 bytes a slot, per worker.
pub const DEFAULT_OVER_LIMIT_CACHE_ENTRIES: usize = 10_000;

pub const DEFAULT_TIMEOUT_MS: u64 = 50;

/// A lookup of the Wasm VM's environment variables: the value of a name, `None` if unset.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

impl Config {
    /// Parses and validates the plugin configuration bytes, with an empty environment (a
    /// `redis.authorization_env` is then refused as unset).
    pub fn parse(bytes: &[u8]) -> std::result::Result<Config, ConfigError> {
        Config::parse_with_env(bytes, &|_| None)
    }

    /// Parses and validates the plugin configuration bytes; `env` looks up the Wasm VM's
    /// environment variables (for `redis.authorization_env` and the record keys of
    /// `idempotency.encryption`). The adapter passes the VM's real environment, tests a table.
    pub fn parse_with_env(bytes: &[u8], env: Env<'_>) -> std::result::Result<Config, ConfigError> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| ConfigError::new("", format!("configuration is not valid JSON: {e}")))?;
        Config::from_value_with_env(&value, env)
    }

    pub fn from_value(value: &Value) -> Result<Config> {
        Config::from_value_with_env(value, &|_| None)
    }

    pub fn from_value_with_env(value: &Value, env: Env<'_>) -> Result<Config> {
        let mut root = Obj::new(value, "", ROOT_FIELDS)?;
        let redis = redis::redis_config(root.required("redis")?, "redis", env)?;
        let identity = match root.get("identity") {
            Some(v) => policy::identity(v, "identity")?,
            None => Identity {
                tenant: IdSource::Header("x-tenant-id".into()),
                principal: IdSource::Header("x-user-id".into()),
                missing_tenant: MissingTenant::Reject,
            },
        };
        let failure_mode =
            fields::failure_mode(&mut root, "failure_mode")?.unwrap_or(FailureMode::Closed);
        let response_headers = root.opt_bool("response_headers")?.unwrap_or(true);
        let envoy_buffer_limit =
            fields::size(&mut root, "envoy_buffer_limit", MAX_ENVOY_BUFFER_LIMIT)?
                .unwrap_or(DEFAULT_ENVOY_BUFFER_LIMIT);
        let memory_budget = memory_budget(&mut root)?;
        let limits = Limits {
            envoy_buffer: envoy_buffer_limit,
            memory_budget,
        };
        let policies = policies(&mut root, failure_mode, limits, env)?;
        let over_limit_cache_entries = match root.get("over_limit_cache") {
            None => DEFAULT_OVER_LIMIT_CACHE_ENTRIES,
            Some(v) => over_limit_cache(v, "over_limit_cache")?,
        };
        let problem_type_base = problem_type_base(&mut root)?;
        Ok(Config {
            redis,
            identity,
            failure_mode,
            response_headers,
            policies,
            over_limit_cache_entries,
            envoy_buffer_limit,
            memory_budget,
            problem_type_base,
        })
    }

    /// The root context's tick: the watchdog's resolution (half the Redis timeout), fine
    /// enough to extend the shortest lease at half its TTL in time (a quarter of it), and,
    /// when `batch_by_tick` (the host gave no queue to wake the root with), the batching
    /// delay. Within 1 ms .. 1 s, and at least 5 ms unless batching by tick asks for less: a
    /// finer tick wakes every worker that often, also when it is idle.
    pub fn tick_ms(&self, batch_by_tick: bool) -> u64 {
        let mut tick = (self.redis.timeout_ms / 2).clamp(5, 1_000);
        for lease in self.policies.iter().filter_map(|p| p.lease.as_ref()) {
            if lease.extend {
                tick = tick.min((lease.ttl_ms / 4).max(5));
            }
        }
        // A concurrency slot is extended at half its window: the tick must come well before.
        for limit in self.policies.iter().flat_map(|p| &p.rate_limits) {
            if limit.concurrency() {
                tick = tick.min((limit.window_ms / 4).max(5));
            }
        }
        if let (Some(batch), true) = (self.redis.batch, batch_by_tick) {
            tick = tick.min(batch.max_delay_ms.max(1));
        }
        tick
    }
}

/// What bounds the bodies a policy copies: Envoy's buffer limit and the worker's memory budget.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub envoy_buffer: u64,
    pub memory_budget: u64,
}

/// `memory_budget`: a size from [`MIN_MEMORY_BUDGET`] to [`MAX_MEMORY_BUDGET`].
fn memory_budget(root: &mut Obj<'_>) -> Result<u64> {
    let path = root.field_path("memory_budget");
    match fields::size(root, "memory_budget", MAX_MEMORY_BUDGET)? {
        None => Ok(DEFAULT_MEMORY_BUDGET),
        Some(n) if n < MIN_MEMORY_BUDGET => Err(ConfigError::new(
            path,
            format!("{n} bytes is less than the smallest budget, {MIN_MEMORY_BUDGET} bytes (4MiB)"),
        )),
        Some(n) => Ok(n),
    }
}

/// `problem_type_base`: an absolute `https://` (or `http://`) URI prefix, at most
/// [`MAX_PROBLEM_TYPE_BASE`] bytes of URI characters (RFC 3986: unreserved, reserved and `%`),
/// so that a `type` needs no escaping in JSON nor in a `Link` header; it ends in `/`, `#` or
/// `=`, since the problem's name is appended to it.
fn problem_type_base(root: &mut Obj<'_>) -> Result<String> {
    let path = root.field_path("problem_type_base");
    let Some(base) = root.opt_str("problem_type_base")? else {
        return Ok(DEFAULT_PROBLEM_TYPE_BASE.to_string());
    };
    let uri_char = |b: u8| b.is_ascii_alphanumeric() || b"-._~:/?#[]@!$&'()*+,;=%".contains(&b);
    let rest = base
        .strip_prefix("https://")
        .or_else(|| base.strip_prefix("http://"));
    let problem = match rest {
        _ if base.len() > MAX_PROBLEM_TYPE_BASE => {
            format!("is longer than {MAX_PROBLEM_TYPE_BASE} bytes")
        }
        None => format!("{base:?} is not an absolute https:// or http:// URI"),
        Some(rest) if rest.is_empty() || rest.starts_with(['/', '#', '?']) => {
            format!("{base:?} names no host")
        }
        Some(_) if !base.bytes().all(uri_char) => format!(
            "{base:?} holds a character a URI cannot (a space, a quote, '<', '>', '\\', a \
             control or non-ASCII character): percent-encode it"
        ),
        Some(_) if !base.ends_with(['/', '#', '=']) => format!(
            "{base:?} must end with '/', '#' or '=': the problem's name (e.g. \
             guard_unavailable) is appended to it"
        ),
        Some(_) => return Ok(base.to_string()),
    };
    Err(ConfigError::new(path, problem))
}

/// `policies`: each one read, names unique.
fn policies(
    root: &mut Obj<'_>,
    failure_mode: FailureMode,
    limits: Limits,
    env: Env<'_>,
) -> Result<Vec<Policy>> {
    let mut policies: Vec<Policy> = Vec::new();
    let policies_path = root.field_path("policies");
    let Some(items) = root.opt_array("policies")? else {
        return Ok(policies);
    };
    for (i, item) in items.iter().enumerate() {
        let path = index(&policies_path, i);
        let p = policy::policy(item, &path, failure_mode, limits, env)?;
        if policies.iter().any(|q| q.name == p.name) {
            return Err(ConfigError::new(
                format!("{path}.name"),
                format!("duplicate policy name {:?}", p.name),
            ));
        }
        policies.push(p);
    }
    Ok(policies)
}

/// `over_limit_cache`: its number of entries (0 turns it off).
fn over_limit_cache(v: &Value, path: &str) -> Result<usize> {
    let mut o = Obj::new(v, path, &["entries"])?;
    let path = o.field_path("entries");
    let entries = match o.get("entries") {
        None => DEFAULT_OVER_LIMIT_CACHE_ENTRIES,
        Some(n) => n
            .as_u64()
            .filter(|n| *n <= 1_000_000)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| {
                ConfigError::new(
                    path,
                    format!("{n} is not a number of entries from 0 to 1000000"),
                )
            })?,
    };
    Ok(entries)
}

#[cfg(test)]
mod tests;
