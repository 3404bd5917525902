//! The plugin configuration: the public JSON contract, validated once at `on_configure` into
//! the runtime [`Config`]. Validation never half-applies: either every field is valid and a
//! complete `Config` comes out, or the first problem comes back as a [`ConfigError`] naming the
//! field path.

mod cost;
mod fields;
mod idempotency;
mod lease;
/// The plugin configurations in what a user deploys (WasmPlugin, Envoy YAML): host tools only.
#[cfg(not(target_arch = "wasm32"))]
pub mod manifest;
mod policy;
mod reader;
mod redis;
pub mod units;

pub use cost::CHARGE_MAX_BODY;
pub use fields::selector;
pub use idempotency::{MAX_REQUEST_BODY, MAX_RESPONSE_BODY};
pub use reader::ConfigError;
use reader::{index, Obj, Result};

use crate::guards::idempotency::seal::Keyring;
pub use crate::support::jsonscan::Pointer;
use serde_json::Value;

/// What a policy does when Redis cannot answer (unreachable, error, or too slow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureMode {
    /// Forward the request and count `failed_open`.
    Open,
    /// Answer `503` problem+json with `Retry-After: 1` and count `failed_closed`.
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingTenant {
    /// `401` problem+json.
    Reject,
    /// The request is treated as tenant `anonymous`.
    Anonymous,
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
}

impl Selector {
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
        }
    }
}

/// `idempotency.in_progress`: a duplicate of a request still running is answered at once, or
/// waits for the first one's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InProgress {
    Reject,
    Wait,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    FixedWindow,
    SlidingWindow,
    SlidingLog,
    TokenBucket,
    /// At most `limit` requests in flight; `window` is a holder's lifetime unless extended.
    Concurrency,
}

impl Algorithm {
    /// The short code used in Redis keys and script arguments.
    pub fn code(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fw",
            Algorithm::SlidingWindow => "sw",
            Algorithm::SlidingLog => "sl",
            Algorithm::TokenBucket => "tb",
            Algorithm::Concurrency => "cc",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    pub cluster: String,
    pub authority: String,
    pub timeout_ms: u64,
    pub authorization: Option<String>,
    pub key_prefix: String,
    pub batch: Option<Batch>,
}

/// Callout coalescing: acquire calls of one worker sent together from the root context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    /// How long a call may wait for others (the root's tick).
    pub max_delay_ms: u64,
    pub max_requests: usize,
    /// Batch calls of different hash slots together once a probe shows that Redis runs such a
    /// batch (a single Redis; a Redis Cluster refuses it with `CROSSSLOT`).
    pub cross_slot: bool,
}

impl Default for Batch {
    /// On unless `redis.batch` is `false`: every decision is the one the call would get alone.
    fn default() -> Batch {
        Batch {
            max_delay_ms: 1,
            max_requests: 32,
            cross_slot: true,
        }
    }
}

/// Where a role of the caller (tenant, principal) comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdSource {
    /// A request header (lower case), which something the operator trusts sets.
    Header(String),
    /// A leaf of the request's dynamic metadata, e.g. a claim of the payload Envoy's
    /// `jwt_authn` verified: `[filter, key, claim...]`. The header of the same role is then
    /// ignored entirely.
    Metadata(Vec<String>),
}

impl IdSource {
    /// How a message to the client names it: "the x-tenant-id header", "the tid claim".
    pub fn describe(&self) -> String {
        match self {
            IdSource::Header(h) => format!("the {h} header"),
            IdSource::Metadata(path) => format!(
                "the {} claim of a verified token",
                path.last().map_or("", String::as_str)
            ),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub tenant: IdSource,
    pub principal: IdSource,
    pub missing_tenant: MissingTenant,
}

impl Identity {
    /// The metadata paths the request must be read at (the adapter reads them only then).
    pub fn uses_metadata(&self) -> bool {
        matches!(self.tenant, IdSource::Metadata(_))
            || matches!(self.principal, IdSource::Metadata(_))
    }
}

/// A condition on a request header of `match.headers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderMatch {
    /// Lower case.
    pub name: String,
    pub test: HeaderTest,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderTest {
    Exact(String),
    Prefix(String),
    /// `true`: the header is there (once or more); `false`: it is not.
    Present(bool),
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Match {
    /// Upper-case methods; empty = any.
    pub methods: Vec<String>,
    pub path_prefix: Option<String>,
    pub path_exact: Option<String>,
    /// Lower-case host without port.
    pub host: Option<String>,
    /// Conditions on request headers, all of which must hold.
    pub headers: Vec<HeaderMatch>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    pub name: String,
    pub by: Vec<Selector>,
    pub algorithm: Algorithm,
    pub limit: u64,
    pub window_ms: u64,
    /// Token bucket capacity; equals `limit` for the other algorithms.
    pub burst: u64,
    pub shadow: bool,
    /// `mode: leased`: a worker takes slices of the window's quota and admits from them
    /// locally (fixed windows only).
    pub leased: bool,
    /// Units a request consumes at admission, read from a request header (1 when absent).
    pub cost: Option<Cost>,
    /// The real amount, read from the response once it is known.
    pub charge: Option<Charge>,
    /// Its `RateLimit-Policy` item ([`crate::http::local_reply::policy_item`] of its name, limit and
    /// window), written here once rather than on every response.
    pub policy_item: String,
}

/// `cost`: the units a request consumes at admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cost {
    /// The request header holding a non-negative integer.
    pub header: String,
    /// Units of a request without the header.
    pub default: u64,
    /// The smallest cost accepted (a client must not make its requests free).
    pub min: u64,
    /// The largest cost accepted (a larger one is refused with `400`).
    pub max: u64,
}

/// `charge`: where the response says what the request really cost, and what a response
/// whose charge cannot be read is charged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    pub source: ChargeSource,
    pub unreadable: Fallback,
}

/// Where the response says what the request really cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeSource {
    /// A response header.
    Header(String),
    /// A response trailer.
    Trailer(String),
    /// A JSON pointer (RFC 6901) into an `application/json` response body of at most
    /// `max_body` bytes, read as it passes.
    Json { pointer: Pointer, max_body: u64 },
}

/// `charge.unreadable`: the charge of a response whose own cannot be read (no header, a body
/// that is not plain JSON, too large, cut short, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// The cost the request was admitted at.
    Cost,
    /// The most a request can be admitted at: the limit's `cost.max` (without `cost`, its
    /// capacity), resolved at load.
    Max(u64),
    /// A fixed number of units.
    Units(u64),
}

impl Fallback {
    /// What a request admitted at `admitted` is charged.
    pub fn units(self, admitted: u64) -> u64 {
        match self {
            Fallback::Cost => admitted,
            Fallback::Max(n) | Fallback::Units(n) => n,
        }
    }
}

impl RateLimit {
    /// The script's algorithm code, also part of the key: `lq` for a leased fixed window, so
    /// it never shares a counter with an exact one.
    pub fn code(&self) -> &'static str {
        if self.leased {
            "lq"
        } else {
            self.algorithm.code()
        }
    }

    /// True for a limit on requests in flight (a slot held until the response ends).
    pub fn concurrency(&self) -> bool {
        self.algorithm == Algorithm::Concurrency
    }

    /// True when the counter is scoped by tenant, so its key is hash-tagged by the tenant.
    pub fn tenant_scoped(&self) -> bool {
        self.by.contains(&Selector::Tenant)
    }
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnBusy {
    /// `409 resource_locked` at once.
    Reject,
    /// Poll (with backoff) until the lease is free or `max_wait` passes.
    Wait,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// What is serialized; leases are always scoped by tenant too.
    pub resource: Vec<Selector>,
    pub ttl_ms: u64,
    pub on_busy: OnBusy,
    pub max_wait_ms: u64,
    /// Lower-case header that carries the fencing token to the upstream.
    pub fencing_header: String,
    pub extend: bool,
    /// TTL of the resource's fence key (`fence_ttl`), set again at every acquire.
    pub fence_ttl_ms: u64,
}

/// The longest `max_wait` (idempotency and lease): every waiting request polls Redis several
/// times a second (up to 5 for a record, 10 for a lease), and holds its connection, for this
/// long at most.
pub const MAX_WAIT_MS: u64 = 30_000;

/// The longest `lease.fence_ttl`: a year (the script does arithmetic on it in Lua doubles,
/// and a fence key costs memory per resource name for this long after its last lease).
pub const MAX_FENCE_TTL_MS: u64 = 365 * 86_400_000;

impl Lease {
    /// The default TTL of the fencing counter: far beyond any lease (100 x `ttl`, at least 7
    /// days). Tokens stay increasing even if the counter is lost (they never fall below Redis
    /// time in microseconds).
    pub fn default_fence_ttl_ms(ttl_ms: u64) -> u64 {
        ttl_ms.saturating_mul(100).max(7 * 86_400_000)
    }
}

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
}

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
        Ok(Config {
            redis,
            identity,
            failure_mode,
            response_headers,
            policies,
            over_limit_cache_entries,
            envoy_buffer_limit,
            memory_budget,
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
pub(crate) struct Limits {
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
