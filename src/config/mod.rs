//! The plugin configuration: the public JSON contract, validated once at `on_configure` into
//! the runtime [`Config`]. Validation never half-applies: either every field is valid and a
//! complete `Config` comes out, or the first problem comes back as a [`ConfigError`] naming the
//! field path.

mod reader;
pub mod units;

use crate::grpc;
pub use reader::ConfigError;
use reader::{index, Obj, Result};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    FixedWindow,
    SlidingWindow,
    SlidingLog,
    TokenBucket,
}

impl Algorithm {
    /// The short code used in Redis keys and script arguments.
    pub fn code(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fw",
            Algorithm::SlidingWindow => "sw",
            Algorithm::SlidingLog => "sl",
            Algorithm::TokenBucket => "tb",
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
    /// Batch calls of different hash slots together (only without Redis Cluster).
    pub cross_slot: bool,
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
    pub retryable_statuses: Vec<StatusMatch>,
    /// gRPC status codes after which the record of a gRPC call is released.
    pub retryable_grpc_codes: Vec<u32>,
    pub complete: Completion,
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
}

/// Envoy's default `per_connection_buffer_limit_bytes`.
pub const DEFAULT_ENVOY_BUFFER_LIMIT: u64 = 1 << 20;
/// The largest `envoy_buffer_limit` accepted.
pub const MAX_ENVOY_BUFFER_LIMIT: u64 = 1 << 30;

/// Default size of the over-limit cache: 16 bytes a slot, per worker and in shared data.
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
    /// environment variables (for `redis.authorization_env`). The adapter passes the VM's
    /// real environment, tests a table.
    pub fn parse_with_env(bytes: &[u8], env: Env<'_>) -> std::result::Result<Config, ConfigError> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| ConfigError::new("", format!("configuration is not valid JSON: {e}")))?;
        Config::from_value_with_env(&value, env)
    }

    pub fn from_value(value: &Value) -> Result<Config> {
        Config::from_value_with_env(value, &|_| None)
    }

    pub fn from_value_with_env(value: &Value, env: Env<'_>) -> Result<Config> {
        let mut root = Obj::new(value, "")?;
        let redis = redis_config(root.required("redis")?, "redis", env)?;
        let identity = match root.get("identity") {
            Some(v) => identity(v, "identity")?,
            None => Identity {
                tenant: IdSource::Header("x-tenant-id".into()),
                principal: IdSource::Header("x-user-id".into()),
                missing_tenant: MissingTenant::Reject,
            },
        };
        let failure_mode = failure_mode(&mut root, "failure_mode")?.unwrap_or(FailureMode::Closed);
        let response_headers = root.opt_bool("response_headers")?.unwrap_or(true);
        let envoy_buffer_limit = size(&mut root, "envoy_buffer_limit", MAX_ENVOY_BUFFER_LIMIT)?
            .unwrap_or(DEFAULT_ENVOY_BUFFER_LIMIT);
        let mut policies = Vec::new();
        let policies_path = root.field_path("policies");
        if let Some(items) = root.opt_array("policies")? {
            for (i, item) in items.iter().enumerate() {
                let path = index(&policies_path, i);
                let p = policy(item, &path, failure_mode, envoy_buffer_limit)?;
                if policies.iter().any(|q: &Policy| q.name == p.name) {
                    return Err(ConfigError::new(
                        format!("{path}.name"),
                        format!("duplicate policy name {:?}", p.name),
                    ));
                }
                policies.push(p);
            }
        }
        let over_limit_cache_entries = match root.get("over_limit_cache") {
            None => DEFAULT_OVER_LIMIT_CACHE_ENTRIES,
            Some(v) => {
                let mut o = Obj::new(v, "over_limit_cache")?;
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
                o.finish()?;
                entries
            }
        };
        root.finish()?;
        Ok(Config {
            redis,
            identity,
            failure_mode,
            response_headers,
            policies,
            over_limit_cache_entries,
            envoy_buffer_limit,
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
        if let (Some(batch), true) = (self.redis.batch, batch_by_tick) {
            tick = tick.min(batch.max_delay_ms.max(1));
        }
        tick
    }
}

fn redis_config(v: &Value, path: &str, env: Env<'_>) -> Result<RedisConfig> {
    let mut o = Obj::new(v, path)?;
    let protocol = o.opt_str("protocol")?.unwrap_or("webdis");
    if protocol != "webdis" {
        return Err(ConfigError::new(
            o.field_path("protocol"),
            format!("{protocol:?} is not supported (supported: \"webdis\")"),
        ));
    }
    let cluster = o.req_str("cluster")?;
    if cluster.is_empty() {
        return Err(ConfigError::new(
            o.field_path("cluster"),
            "must not be empty",
        ));
    }
    let authority = match o.opt_str("authority")? {
        Some("") => {
            return Err(ConfigError::new(
                o.field_path("authority"),
                "must not be empty",
            ))
        }
        Some(a) => a.to_string(),
        None => cluster.to_string(),
    };
    let timeout_ms = duration(&mut o, "timeout")?.unwrap_or(DEFAULT_TIMEOUT_MS);
    let authorization = match o.opt_str("authorization")? {
        Some(a) if !is_header_value(a) => {
            return Err(ConfigError::new(
                o.field_path("authorization"),
                "must be a non-empty printable ASCII header value",
            ))
        }
        a => a.map(str::to_string),
    };
    let env_path = o.field_path("authorization_env");
    let authorization = match o.opt_str("authorization_env")? {
        None => authorization,
        Some(_) if authorization.is_some() => {
            return Err(ConfigError::new(
                env_path,
                format!(
                    "cannot be combined with {}: give the credential one way",
                    o.field_path("authorization")
                ),
            ))
        }
        Some(name) => Some(env_authorization(name, &env_path, env)?),
    };
    let key_prefix = o.opt_str("key_prefix")?.unwrap_or("cg");
    let prefix_ok = !key_prefix.is_empty()
        && key_prefix.len() <= 64
        && key_prefix
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}');
    if !prefix_ok {
        return Err(ConfigError::new(
            o.field_path("key_prefix"),
            format!("{key_prefix:?} must be 1-64 printable ASCII characters without spaces, '{{' or '}}'"),
        ));
    }
    let batch = match o.get("batch") {
        None => None,
        Some(v) => {
            let mut b = Obj::new(v, &o.field_path("batch"))?;
            let max_delay_ms = duration(&mut b, "max_delay")?.unwrap_or(1);
            if max_delay_ms > 100 {
                return Err(ConfigError::new(
                    b.field_path("max_delay"),
                    "must be at most 100ms: every batched request waits for it",
                ));
            }
            let max_requests = match b.opt_positive("max_requests")? {
                None => 32,
                Some(n) if n <= 1000 => n as usize,
                Some(n) => {
                    return Err(ConfigError::new(
                        b.field_path("max_requests"),
                        format!("{n} is too large (at most 1000)"),
                    ))
                }
            };
            let cross_slot = b.opt_bool("cross_slot")?.unwrap_or(false);
            b.finish()?;
            Some(Batch {
                max_delay_ms,
                max_requests,
                cross_slot,
            })
        }
    };
    o.finish()?;
    Ok(RedisConfig {
        cluster: cluster.to_string(),
        authority,
        timeout_ms,
        authorization,
        key_prefix: key_prefix.to_string(),
        batch,
    })
}

fn is_header_value(v: &str) -> bool {
    !v.is_empty() && v.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// The `Authorization` value read from the VM's environment variable `name`. Errors name the
/// variable, never its value.
fn env_authorization(name: &str, path: &str, env: Env<'_>) -> Result<String> {
    let name_ok = name.len() <= 128
        && name
            .bytes()
            .enumerate()
            .all(|(i, b)| b == b'_' || b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()));
    if name.is_empty() || !name_ok {
        return Err(ConfigError::new(
            path,
            format!("{name:?} is not an environment variable name (1-128 of [A-Za-z0-9_], not starting with a digit)"),
        ));
    }
    match env(name) {
        None => Err(ConfigError::new(
            path,
            format!(
                "environment variable {name} is not set in the Wasm VM (Envoy: vm_config.environment_variables; Istio: vmConfig.env)"
            ),
        )),
        Some(v) if v.is_empty() => Err(ConfigError::new(
            path,
            format!("environment variable {name} is empty"),
        )),
        Some(v) if !is_header_value(&v) => Err(ConfigError::new(
            path,
            format!("environment variable {name} is not a printable ASCII header value"),
        )),
        Some(v) => Ok(v),
    }
}

fn identity(v: &Value, path: &str) -> Result<Identity> {
    let mut o = Obj::new(v, path)?;
    let tenant = id_source(&mut o, "tenant", "tenant_header", "x-tenant-id")?;
    let principal = id_source(&mut o, "principal", "principal_header", "x-user-id")?;
    let missing_tenant = match o.opt_str("missing_tenant")? {
        None | Some("reject") => MissingTenant::Reject,
        Some("anonymous") => MissingTenant::Anonymous,
        Some(other) => {
            return Err(ConfigError::new(
                o.field_path("missing_tenant"),
                format!("{other:?} is not one of \"reject\", \"anonymous\""),
            ))
        }
    };
    o.finish()?;
    Ok(Identity {
        tenant,
        principal,
        missing_tenant,
    })
}

/// A role's source: `<role>: {"header": ...}` or `{"metadata": [...]}`, or the short form
/// `<short>: "<header>"`; not both.
fn id_source(
    o: &mut Obj<'_>,
    role: &'static str,
    short: &'static str,
    default: &str,
) -> Result<IdSource> {
    let header = header_name(o, short)?;
    let Some(v) = o.get(role) else {
        return Ok(IdSource::Header(header.unwrap_or_else(|| default.into())));
    };
    let path = o.field_path(role);
    if header.is_some() {
        return Err(ConfigError::new(
            path,
            format!("give either {role} or {short}, not both"),
        ));
    }
    let mut src = Obj::new(v, &path)?;
    let header = header_name(&mut src, "header")?;
    let meta_path = src.field_path("metadata");
    let metadata = src.opt_str_list("metadata")?;
    src.finish()?;
    match (header, metadata) {
        (Some(h), None) => Ok(IdSource::Header(h)),
        (None, Some(m)) => {
            if m.len() < 2 || m.len() > 8 || m.iter().any(|p| p.is_empty()) {
                return Err(ConfigError::new(
                    meta_path,
                    "must be 2 to 8 non-empty names: [filter, key, ...], e.g. \
                     [\"envoy.filters.http.jwt_authn\", \"payload\", \"sub\"]",
                ));
            }
            Ok(IdSource::Metadata(
                m.iter().map(|p| p.to_string()).collect(),
            ))
        }
        _ => Err(ConfigError::new(
            path,
            "must be {\"header\": \"<name>\"} or {\"metadata\": [path...]}",
        )),
    }
}

fn policy(
    v: &Value,
    path: &str,
    default_failure: FailureMode,
    envoy_buffer_limit: u64,
) -> Result<Policy> {
    let mut o = Obj::new(v, path)?;
    let name = name(&mut o, "name")?;
    let matcher = match o.get("match") {
        Some(m) => matcher(m, &o.field_path("match"))?,
        None => Match::default(),
    };
    let failure_mode = failure_mode(&mut o, "failure_mode")?.unwrap_or(default_failure);
    let mut rate_limits: Vec<RateLimit> = Vec::new();
    let limits_path = o.field_path("rate_limits");
    if let Some(items) = o.opt_array("rate_limits")? {
        for (i, item) in items.iter().enumerate() {
            let lpath = index(&limits_path, i);
            let limit = rate_limit(item, &lpath)?;
            if rate_limits.iter().any(|l| l.name == limit.name) {
                return Err(ConfigError::new(
                    format!("{lpath}.name"),
                    format!("duplicate rate limit name {:?} in this policy", limit.name),
                ));
            }
            rate_limits.push(limit);
        }
    }
    let idempotency = match o.get("idempotency") {
        Some(v) => Some(idempotency(
            v,
            &o.field_path("idempotency"),
            envoy_buffer_limit,
        )?),
        None => None,
    };
    let lease = match o.get("lease") {
        Some(v) => Some(lease(v, &o.field_path("lease"))?),
        None => None,
    };
    o.finish()?;
    let uses_client_ip = rate_limits
        .iter()
        .flat_map(|l| &l.by)
        .chain(lease.iter().flat_map(|l| &l.resource))
        .any(|s| *s == Selector::ClientIp);
    let needs_tokens = idempotency.is_some()
        || lease.is_some()
        || rate_limits
            .iter()
            .any(|l| l.algorithm == Algorithm::SlidingLog);
    Ok(Policy {
        uses_client_ip,
        needs_tokens,
        name,
        matcher,
        failure_mode,
        rate_limits,
        idempotency,
        lease,
    })
}

fn selectors(o: &mut Obj<'_>, field: &'static str) -> Result<Vec<Selector>> {
    let path = o.field_path(field);
    let mut out = Vec::new();
    for (i, s) in o
        .opt_str_list(field)?
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let sel_path = index(&path, i);
        let sel = selector(s).ok_or_else(|| {
            ConfigError::new(&sel_path, format!("{s:?} is not a selector ({SELECTORS})"))
        })?;
        if out.contains(&sel) {
            return Err(ConfigError::new(sel_path, format!("{s:?} is listed twice")));
        }
        out.push(sel);
    }
    Ok(out)
}

fn lease(v: &Value, path: &str) -> Result<Lease> {
    let mut o = Obj::new(v, path)?;
    let resource = selectors(&mut o, "resource")?;
    if resource.is_empty() {
        return Err(ConfigError::new(
            o.field_path("resource"),
            "must name at least one selector",
        ));
    }
    let ttl_ms = duration(&mut o, "ttl")?.unwrap_or(10_000);
    let on_busy = match o.opt_str("on_busy")? {
        None | Some("reject") => OnBusy::Reject,
        Some("wait") => OnBusy::Wait,
        Some(other) => {
            return Err(ConfigError::new(
                o.field_path("on_busy"),
                format!("{other:?} is not one of \"reject\", \"wait\""),
            ))
        }
    };
    let max_wait_ms = duration(&mut o, "max_wait")?.unwrap_or(2_000);
    let fencing_header = header_name(&mut o, "fencing_header")?.unwrap_or("x-fencing-token".into());
    let extend = o.opt_bool("extend")?.unwrap_or(true);
    let fence_ttl_ms = match duration(&mut o, "fence_ttl")? {
        None => Lease::default_fence_ttl_ms(ttl_ms),
        Some(f) if f < ttl_ms => {
            return Err(ConfigError::new(
                o.field_path("fence_ttl"),
                format!(
                    "{f}ms is shorter than the lease ttl ({ttl_ms}ms): the fence key must outlive the lease"
                ),
            ))
        }
        Some(f) if f > MAX_FENCE_TTL_MS => {
            return Err(ConfigError::new(
                o.field_path("fence_ttl"),
                format!("{f}ms is longer than the maximum of 365d"),
            ))
        }
        Some(f) => f,
    };
    o.finish()?;
    Ok(Lease {
        resource,
        ttl_ms,
        on_busy,
        max_wait_ms,
        fencing_header,
        extend,
        fence_ttl_ms,
    })
}

/// The largest request body the filter buffers to fingerprint.
pub const MAX_REQUEST_BODY: u64 = 64 << 20;
/// The largest response body stored for replay (it travels through the gateway as an argument).
pub const MAX_RESPONSE_BODY: u64 = 4 << 20;

/// What the filter buffers must stay below Envoy's buffer limit, else Envoy answers itself
/// (`413` for a request body, `500` for a response body) before the filter can. Half of it by
/// default, so that the piece of body that crosses the filter's limit cannot also cross Envoy's.
fn below_envoy_limit(
    o: &mut Obj<'_>,
    field: &'static str,
    max: u64,
    default: u64,
    envoy_buffer_limit: u64,
) -> Result<u64> {
    let path = o.field_path(field);
    match size(o, field, max)? {
        None => Ok(default.min(envoy_buffer_limit / 2).max(1)),
        Some(n) if n < envoy_buffer_limit => Ok(n),
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

fn idempotency(v: &Value, path: &str, envoy_buffer_limit: u64) -> Result<Idempotency> {
    let mut o = Obj::new(v, path)?;
    let header = header_name(&mut o, "header")?.unwrap_or("idempotency-key".into());
    let required = o.opt_bool("required")?.unwrap_or(true);
    let methods_path = o.field_path("methods");
    let methods = match o.opt_str_list("methods")? {
        None => vec!["POST".to_string(), "PATCH".to_string()],
        Some(list) if list.is_empty() => {
            return Err(ConfigError::new(
                methods_path,
                "must list at least one method",
            ))
        }
        Some(list) => {
            let mut out = Vec::new();
            for (i, m) in list.iter().enumerate() {
                if m.is_empty() || !m.bytes().all(|b| b.is_ascii_alphabetic()) {
                    return Err(ConfigError::new(
                        index(&methods_path, i),
                        format!("{m:?} is not an HTTP method"),
                    ));
                }
                out.push(m.to_ascii_uppercase());
            }
            out
        }
    };
    let processing_ttl_ms = duration(&mut o, "processing_ttl")?.unwrap_or(120_000);
    let completed_ttl_ms = duration(&mut o, "completed_ttl")?.unwrap_or(86_400_000);
    let fp_path = o.field_path("fingerprint");
    let fingerprint = match o.opt_str_list("fingerprint")? {
        None => vec![
            FingerprintPart::Method,
            FingerprintPart::Path,
            FingerprintPart::Principal,
            FingerprintPart::Body,
        ],
        Some(list) => {
            let mut out = Vec::new();
            for (i, part) in list.iter().enumerate() {
                let p = match *part {
                    "method" => FingerprintPart::Method,
                    "path" => FingerprintPart::Path,
                    "query" => FingerprintPart::Query,
                    "principal" => FingerprintPart::Principal,
                    "body" => FingerprintPart::Body,
                    other => match other.strip_prefix("header:").filter(|h| is_header_name(h)) {
                        Some(h) => FingerprintPart::Header(h.to_ascii_lowercase()),
                        None => {
                            return Err(ConfigError::new(
                                index(&fp_path, i),
                                format!("{other:?} is not one of method, path, query, principal, body, header:<name>"),
                            ))
                        }
                    },
                };
                if out.contains(&p) {
                    return Err(ConfigError::new(
                        index(&fp_path, i),
                        format!("{part:?} is listed twice"),
                    ));
                }
                out.push(p);
            }
            out
        }
    };
    let max_request_body = below_envoy_limit(
        &mut o,
        "max_request_body",
        MAX_REQUEST_BODY,
        1 << 20,
        envoy_buffer_limit,
    )?;
    let replay = match o.opt_str("replay")? {
        None | Some("full") => Replay::Full,
        Some("reference") => Replay::Reference,
        Some(other) => {
            return Err(ConfigError::new(
                o.field_path("replay"),
                format!("{other:?} is not one of \"full\", \"reference\""),
            ))
        }
    };
    let max_response_body = below_envoy_limit(
        &mut o,
        "max_response_body",
        MAX_RESPONSE_BODY,
        64 << 10,
        envoy_buffer_limit,
    )?;
    let replay_headers = header_list(
        &mut o,
        "replay_headers",
        &["content-type", "location", "etag"],
    )?;
    let replay_trailers = header_list(&mut o, "replay_trailers", &[])?;
    let conflict_path = o.field_path("conflict_status");
    let conflict_status = match o.get("conflict_status") {
        None => 422,
        Some(v) => match v.as_u64() {
            Some(409) => 409,
            Some(422) => 422,
            _ => {
                return Err(ConfigError::new(
                    conflict_path,
                    format!("{v} is not 409 or 422"),
                ))
            }
        },
    };
    let rs_path = o.field_path("retryable_statuses");
    let retryable_statuses = match o.opt_array("retryable_statuses")? {
        None => vec![
            StatusMatch::Class(5),
            StatusMatch::Exact(408),
            StatusMatch::Exact(425),
            StatusMatch::Exact(429),
        ],
        Some(items) => {
            let mut out = Vec::new();
            for (i, item) in items.iter().enumerate() {
                let parsed = match item {
                    Value::Number(n) => n
                        .as_u64()
                        .filter(|s| (100..=599).contains(s))
                        .and_then(|s| u32::try_from(s).ok())
                        .map(StatusMatch::Exact),
                    Value::String(s) => match s.as_bytes() {
                        [d @ b'1'..=b'5', b'x', b'x'] => {
                            Some(StatusMatch::Class(u32::from(d - b'0')))
                        }
                        _ => None,
                    },
                    _ => None,
                };
                let Some(m) = parsed else {
                    return Err(ConfigError::new(
                        index(&rs_path, i),
                        format!("{item} is not a status (100-599) or a class like \"5xx\""),
                    ));
                };
                let failure = match m {
                    StatusMatch::Exact(s) => s >= 400,
                    StatusMatch::Class(c) => c >= 4,
                };
                if !failure {
                    return Err(ConfigError::new(
                        index(&rs_path, i),
                        format!(
                            "{item} is not a 4xx or 5xx status; only failures can be retryable"
                        ),
                    ));
                }
                out.push(m);
            }
            out
        }
    };
    let rg_path = o.field_path("retryable_grpc_codes");
    let retryable_grpc_codes = match o.opt_array("retryable_grpc_codes")? {
        None => vec![
            grpc::UNAVAILABLE,
            grpc::DEADLINE_EXCEEDED,
            grpc::RESOURCE_EXHAUSTED,
            grpc::ABORTED,
        ],
        Some(items) => {
            let mut out = Vec::new();
            for (i, item) in items.iter().enumerate() {
                let code = match item {
                    Value::Number(n) => n
                        .as_u64()
                        .and_then(|c| u32::try_from(c).ok())
                        .filter(|&c| grpc::code_name(c).is_some()),
                    Value::String(s) => grpc::parse_code(s),
                    _ => None,
                };
                let Some(code) = code else {
                    return Err(ConfigError::new(
                        index(&rg_path, i),
                        format!(
                            "{item} is not a gRPC status code (a name like \"UNAVAILABLE\" or a number 1-16)"
                        ),
                    ));
                };
                if code == grpc::OK {
                    return Err(ConfigError::new(
                        index(&rg_path, i),
                        format!("{item} is OK; only failures can be retryable"),
                    ));
                }
                if out.contains(&code) {
                    return Err(ConfigError::new(
                        index(&rg_path, i),
                        format!("{item} is listed twice"),
                    ));
                }
                out.push(code);
            }
            out
        }
    };
    let complete = match o.opt_str("complete")? {
        None | Some("sync") => Completion::Sync,
        Some("async") => Completion::Async,
        Some(other) => {
            return Err(ConfigError::new(
                o.field_path("complete"),
                format!("{other:?} is not one of \"sync\", \"async\""),
            ))
        }
    };
    o.finish()?;
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
        retryable_statuses,
        retryable_grpc_codes,
        complete,
    })
}

/// A list of lower-case header (or trailer) names; `default` when absent.
fn header_list(o: &mut Obj<'_>, field: &'static str, default: &[&str]) -> Result<Vec<String>> {
    let path = o.field_path(field);
    match o.opt_str_list(field)? {
        None => Ok(default.iter().map(|h| (*h).to_string()).collect()),
        Some(list) => {
            let mut out = Vec::new();
            for (i, h) in list.iter().enumerate() {
                if !is_header_name(h) || h.starts_with(':') {
                    return Err(ConfigError::new(
                        index(&path, i),
                        format!("{h:?} is not an HTTP header name"),
                    ));
                }
                out.push(h.to_ascii_lowercase());
            }
            Ok(out)
        }
    }
}

fn size(o: &mut Obj<'_>, field: &'static str, max: u64) -> Result<Option<u64>> {
    let path = o.field_path(field);
    match o.get(field) {
        None => Ok(None),
        Some(Value::String(s)) => match units::parse_size(s) {
            Some(n) if n <= max => Ok(Some(n)),
            Some(_) => Err(ConfigError::new(
                path,
                format!("{s:?} is larger than the maximum of {max} bytes"),
            )),
            None => Err(ConfigError::new(
                path,
                format!("{s:?} is not a size (use e.g. \"64KiB\", \"1MiB\")"),
            )),
        },
        Some(Value::Number(n)) => match n.as_u64() {
            Some(b) if b > 0 && b <= max => Ok(Some(b)),
            _ => Err(ConfigError::new(
                path,
                format!("{n} is not a size between 1 and {max} bytes"),
            )),
        },
        Some(other) => Err(ConfigError::new(
            path,
            format!(
                "expected a size such as \"64KiB\", found {}",
                reader::kind(other)
            ),
        )),
    }
}

fn matcher(v: &Value, path: &str) -> Result<Match> {
    let mut o = Obj::new(v, path)?;
    let mut methods = Vec::new();
    let methods_path = o.field_path("methods");
    if let Some(list) = o.opt_str_list("methods")? {
        for (i, m) in list.iter().enumerate() {
            if m.is_empty() || !m.bytes().all(|b| b.is_ascii_alphabetic()) {
                return Err(ConfigError::new(
                    index(&methods_path, i),
                    format!("{m:?} is not an HTTP method"),
                ));
            }
            methods.push(m.to_ascii_uppercase());
        }
    }
    let path_prefix = request_path(&mut o, "path_prefix")?;
    let path_exact = request_path(&mut o, "path_exact")?;
    let host = match o.opt_str("host")? {
        Some(h) if h.is_empty() || h.contains(char::is_whitespace) => {
            return Err(ConfigError::new(
                o.field_path("host"),
                format!("{h:?} is not a host name"),
            ))
        }
        h => h.map(str::to_ascii_lowercase),
    };
    let mut headers = Vec::new();
    let headers_path = o.field_path("headers");
    if let Some(items) = o.opt_array("headers")? {
        for (i, item) in items.iter().enumerate() {
            headers.push(header_match(item, &index(&headers_path, i))?);
        }
    }
    o.finish()?;
    Ok(Match {
        methods,
        path_prefix,
        path_exact,
        host,
        headers,
    })
}

/// `{"name": ..., "exact" | "prefix": "...", "present": true|false}`: one test per entry.
fn header_match(v: &Value, path: &str) -> Result<HeaderMatch> {
    let mut o = Obj::new(v, path)?;
    let name = header_name(&mut o, "name")?
        .ok_or_else(|| ConfigError::new(o.field_path("name"), "is required"))?;
    let exact = o
        .opt_str("exact")?
        .map(|v| HeaderTest::Exact(v.to_string()));
    let prefix = o
        .opt_str("prefix")?
        .map(|v| HeaderTest::Prefix(v.to_string()));
    let present = o.opt_bool("present")?.map(HeaderTest::Present);
    o.finish()?;
    let mut tests = [exact, prefix, present].into_iter().flatten();
    match (tests.next(), tests.next()) {
        (Some(test), None) => Ok(HeaderMatch { name, test }),
        _ => Err(ConfigError::new(
            path,
            "must have exactly one of exact, prefix, present",
        )),
    }
}

/// A path of a match: requests are matched in their canonical form, so the path must be
/// written in it too (else it could never match).
fn request_path(o: &mut Obj<'_>, field: &'static str) -> Result<Option<String>> {
    match o.opt_str(field)? {
        Some(p) if !p.starts_with('/') => Err(ConfigError::new(
            o.field_path(field),
            format!("{p:?} must start with '/'"),
        )),
        Some(p) => {
            let form = crate::normalize::normalize_path(p);
            if form.ambiguous || form.canonical != p {
                let hint = if form.ambiguous {
                    "spell it without encoded '/', '\\', NUL, ';' or '..'".to_string()
                } else {
                    format!("write {:?}", form.canonical)
                };
                return Err(ConfigError::new(
                    o.field_path(field),
                    format!(
                        "{p:?} is not a normalised path (requests are matched decoded, with \
                         slashes merged and dot segments removed): {hint}"
                    ),
                ));
            }
            Ok(Some(p.to_string()))
        }
        None => Ok(None),
    }
}

fn rate_limit(v: &Value, path: &str) -> Result<RateLimit> {
    let mut o = Obj::new(v, path)?;
    let name = name(&mut o, "name")?;
    let by = selectors(&mut o, "by")?;
    let algorithm = match o.req_str("algorithm")? {
        "fixed_window" => Algorithm::FixedWindow,
        "sliding_window" => Algorithm::SlidingWindow,
        "sliding_log" => Algorithm::SlidingLog,
        "token_bucket" => Algorithm::TokenBucket,
        other => {
            return Err(ConfigError::new(
                o.field_path("algorithm"),
                format!(
                "{other:?} is not one of fixed_window, sliding_window, sliding_log, token_bucket"
            ),
            ))
        }
    };
    let limit = limit_value(&mut o, "limit")?
        .ok_or_else(|| ConfigError::new(o.field_path("limit"), "is required"))?;
    let window_ms = duration(&mut o, "window")?
        .ok_or_else(|| ConfigError::new(o.field_path("window"), "is required"))?;
    let burst = match limit_value(&mut o, "burst")? {
        Some(_) if algorithm != Algorithm::TokenBucket => {
            return Err(ConfigError::new(
                o.field_path("burst"),
                "only applies to algorithm token_bucket",
            ))
        }
        Some(b) => b,
        None => limit,
    };
    if algorithm == Algorithm::TokenBucket && window_ms < limit {
        // One token per less than a millisecond cannot be represented by the script.
        return Err(ConfigError::new(
            o.field_path("window"),
            format!("token_bucket needs window >= limit milliseconds ({limit}ms)"),
        ));
    }
    let shadow = o.opt_bool("shadow")?.unwrap_or(false);
    let leased = match o.opt_str("mode")? {
        None | Some("exact") => false,
        Some("leased") if algorithm == Algorithm::FixedWindow && !shadow => true,
        Some("leased") => {
            return Err(ConfigError::new(
                o.field_path("mode"),
                "\"leased\" needs algorithm fixed_window and no shadow",
            ))
        }
        Some(other) => {
            return Err(ConfigError::new(
                o.field_path("mode"),
                format!("{other:?} is not one of \"exact\", \"leased\""),
            ))
        }
    };
    o.finish()?;
    Ok(RateLimit {
        name,
        by,
        algorithm,
        limit,
        window_ms,
        burst,
        shadow,
        leased,
    })
}

/// Limits and bursts: integers in 1..=1_000_000_000 (the scripts count in Lua doubles).
fn limit_value(o: &mut Obj<'_>, field: &'static str) -> Result<Option<u64>> {
    let path = o.field_path(field);
    match o.opt_positive(field)? {
        Some(n) if n > 1_000_000_000 => Err(ConfigError::new(
            path,
            format!("{n} is too large (at most 1000000000)"),
        )),
        n => Ok(n),
    }
}

const SELECTORS: &str =
    "tenant, principal, client_ip, method, path, header:<name>, path_segment:<n>, query:<name>";

/// Parses a selector of `by` or of a lease's `resource`.
pub fn selector(s: &str) -> Option<Selector> {
    Some(match s {
        "tenant" => Selector::Tenant,
        "principal" => Selector::Principal,
        "client_ip" => Selector::ClientIp,
        "method" => Selector::Method,
        "path" => Selector::Path,
        _ => {
            if let Some(n) = s.strip_prefix("path_segment:") {
                let n: usize = n.parse().ok().filter(|n| (1..=64).contains(n))?;
                return Some(Selector::PathSegment(n));
            }
            if let Some(q) = s.strip_prefix("query:") {
                let ok = !q.is_empty()
                    && q.bytes()
                        .all(|b| b.is_ascii_graphic() && !b"&=#?%+".contains(&b));
                return ok.then(|| Selector::Query(q.to_string()));
            }
            let h = s.strip_prefix("header:")?;
            if !is_header_name(h) {
                return None;
            }
            Selector::Header(h.to_ascii_lowercase())
        }
    })
}

fn is_header_name(h: &str) -> bool {
    !h.is_empty()
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn header_name(o: &mut Obj<'_>, field: &'static str) -> Result<Option<String>> {
    match o.opt_str(field)? {
        Some(h) if !is_header_name(h) => Err(ConfigError::new(
            o.field_path(field),
            format!("{h:?} is not an HTTP header name"),
        )),
        h => Ok(h.map(str::to_ascii_lowercase)),
    }
}

/// Policy and limit names appear in Redis keys, metric names and `RateLimit` headers, so they
/// are restricted to `[A-Za-z0-9_-]{1,64}`.
fn name(o: &mut Obj<'_>, field: &'static str) -> Result<String> {
    let n = o.req_str(field)?;
    if n.is_empty() {
        return Err(ConfigError::new(o.field_path(field), "must not be empty"));
    }
    if n.len() > 64
        || !n
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(ConfigError::new(
            o.field_path(field),
            format!("{n:?} must be 1-64 characters of [A-Za-z0-9_-]"),
        ));
    }
    Ok(n.to_string())
}

fn duration(o: &mut Obj<'_>, field: &'static str) -> Result<Option<u64>> {
    let path = o.field_path(field);
    match o.get(field) {
        None => Ok(None),
        Some(Value::String(s)) => units::parse_duration_ms(s).map(Some).ok_or_else(|| {
            ConfigError::new(
                path,
                format!("{s:?} is not a duration (use e.g. \"250ms\", \"2s\", \"1m\", \"24h\")"),
            )
        }),
        Some(other) => Err(ConfigError::new(
            path,
            format!("{other} is not a duration (a string such as \"2s\")"),
        )),
    }
}

fn failure_mode(o: &mut Obj<'_>, field: &'static str) -> Result<Option<FailureMode>> {
    match o.opt_str(field)? {
        None => Ok(None),
        Some("fail_open") => Ok(Some(FailureMode::Open)),
        Some("fail_closed") => Ok(Some(FailureMode::Closed)),
        Some(other) => Err(ConfigError::new(
            o.field_path(field),
            format!("{other:?} is not one of \"fail_open\", \"fail_closed\""),
        )),
    }
}

#[cfg(test)]
mod tests;
