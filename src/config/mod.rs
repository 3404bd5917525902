//! The plugin configuration: the public JSON contract, validated once at `on_configure` into
//! the runtime [`Config`]. Validation never half-applies: either every field is valid and a
//! complete `Config` comes out, or the first problem comes back as a [`ConfigError`] naming the
//! field path.

mod reader;
pub mod units;

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
}

impl Selector {
    /// The canonical spelling, as in the configuration.
    pub fn spelling(&self) -> String {
        match self {
            Selector::Tenant => "tenant".into(),
            Selector::Principal => "principal".into(),
            Selector::ClientIp => "client_ip".into(),
            Selector::Method => "method".into(),
            Selector::Path => "path".into(),
            Selector::Header(h) => format!("header:{h}"),
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
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub tenant_header: String,
    pub principal_header: String,
    pub missing_tenant: MissingTenant,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Match {
    /// Upper-case methods; empty = any.
    pub methods: Vec<String>,
    pub path_prefix: Option<String>,
    pub path_exact: Option<String>,
    /// Lower-case host without port.
    pub host: Option<String>,
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
}

impl RateLimit {
    /// True when the counter is scoped by tenant, so its key is hash-tagged by the tenant.
    pub fn tenant_scoped(&self) -> bool {
        self.by.contains(&Selector::Tenant)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub name: String,
    pub matcher: Match,
    pub failure_mode: FailureMode,
    pub rate_limits: Vec<RateLimit>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub redis: RedisConfig,
    pub identity: Identity,
    pub failure_mode: FailureMode,
    pub response_headers: bool,
    pub policies: Vec<Policy>,
}

pub const DEFAULT_TIMEOUT_MS: u64 = 50;

impl Config {
    /// Parses and validates the plugin configuration bytes.
    pub fn parse(bytes: &[u8]) -> std::result::Result<Config, ConfigError> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| ConfigError::new("", format!("configuration is not valid JSON: {e}")))?;
        Config::from_value(&value)
    }

    pub fn from_value(value: &Value) -> Result<Config> {
        let mut root = Obj::new(value, "")?;
        let redis = redis_config(root.required("redis")?, "redis")?;
        let identity = match root.get("identity") {
            Some(v) => identity(v, "identity")?,
            None => Identity {
                tenant_header: "x-tenant-id".into(),
                principal_header: "x-user-id".into(),
                missing_tenant: MissingTenant::Reject,
            },
        };
        let failure_mode = failure_mode(&mut root, "failure_mode")?.unwrap_or(FailureMode::Closed);
        let response_headers = root.opt_bool("response_headers")?.unwrap_or(true);
        let mut policies = Vec::new();
        let policies_path = root.field_path("policies");
        if let Some(items) = root.opt_array("policies")? {
            for (i, item) in items.iter().enumerate() {
                let path = index(&policies_path, i);
                let p = policy(item, &path, failure_mode)?;
                if policies.iter().any(|q: &Policy| q.name == p.name) {
                    return Err(ConfigError::new(
                        format!("{path}.name"),
                        format!("duplicate policy name {:?}", p.name),
                    ));
                }
                policies.push(p);
            }
        }
        root.finish()?;
        Ok(Config {
            redis,
            identity,
            failure_mode,
            response_headers,
            policies,
        })
    }

    /// The smallest Redis timeout, which sets the watchdog's tick.
    pub fn timeout_ms(&self) -> u64 {
        self.redis.timeout_ms
    }
}

fn redis_config(v: &Value, path: &str) -> Result<RedisConfig> {
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
        Some(a) if a.is_empty() || !a.bytes().all(|b| (0x20..0x7f).contains(&b)) => {
            return Err(ConfigError::new(
                o.field_path("authorization"),
                "must be a non-empty printable ASCII header value",
            ))
        }
        a => a.map(str::to_string),
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
    o.finish()?;
    Ok(RedisConfig {
        cluster: cluster.to_string(),
        authority,
        timeout_ms,
        authorization,
        key_prefix: key_prefix.to_string(),
    })
}

fn identity(v: &Value, path: &str) -> Result<Identity> {
    let mut o = Obj::new(v, path)?;
    let tenant_header = header_name(&mut o, "tenant_header")?.unwrap_or("x-tenant-id".into());
    let principal_header = header_name(&mut o, "principal_header")?.unwrap_or("x-user-id".into());
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
        tenant_header,
        principal_header,
        missing_tenant,
    })
}

fn policy(v: &Value, path: &str, default_failure: FailureMode) -> Result<Policy> {
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
    o.finish()?;
    Ok(Policy {
        name,
        matcher,
        failure_mode,
        rate_limits,
    })
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
    o.finish()?;
    Ok(Match {
        methods,
        path_prefix,
        path_exact,
        host,
    })
}

fn request_path(o: &mut Obj<'_>, field: &'static str) -> Result<Option<String>> {
    match o.opt_str(field)? {
        Some(p) if !p.starts_with('/') => Err(ConfigError::new(
            o.field_path(field),
            format!("{p:?} must start with '/'"),
        )),
        p => Ok(p.map(str::to_string)),
    }
}

fn rate_limit(v: &Value, path: &str) -> Result<RateLimit> {
    let mut o = Obj::new(v, path)?;
    let name = name(&mut o, "name")?;
    let by_path = o.field_path("by");
    let mut by = Vec::new();
    for (i, s) in o.opt_str_list("by")?.unwrap_or_default().iter().enumerate() {
        let sel_path = index(&by_path, i);
        let sel = selector(s).ok_or_else(|| {
            ConfigError::new(
                &sel_path,
                format!("{s:?} is not a selector (tenant, principal, client_ip, method, path, header:<name>)"),
            )
        })?;
        if by.contains(&sel) {
            return Err(ConfigError::new(sel_path, format!("{s:?} is listed twice")));
        }
        by.push(sel);
    }
    let algorithm = match o.req_str("algorithm")? {
        "fixed_window" => Algorithm::FixedWindow,
        "sliding_window" => Algorithm::SlidingWindow,
        "sliding_log" => Algorithm::SlidingLog,
        "token_bucket" => Algorithm::TokenBucket,
        other => return Err(ConfigError::new(
            o.field_path("algorithm"),
            format!(
                "{other:?} is not one of fixed_window, sliding_window, sliding_log, token_bucket"
            ),
        )),
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
    o.finish()?;
    Ok(RateLimit {
        name,
        by,
        algorithm,
        limit,
        window_ms,
        burst,
        shadow,
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

/// Parses a selector of `by` (and, for leases, a resource part).
pub fn selector(s: &str) -> Option<Selector> {
    Some(match s {
        "tenant" => Selector::Tenant,
        "principal" => Selector::Principal,
        "client_ip" => Selector::ClientIp,
        "method" => Selector::Method,
        "path" => Selector::Path,
        _ => {
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
