//! A policy: its match, its rate limits and their selectors, and the caller's identity.

use crate::config::fields::{
    duration, failure_mode, header_name, methods, name, one_of, selectors,
};
use crate::config::reader::{index, Obj, Result};
use crate::config::{
    cost, idempotency::idempotency, lease::lease, Algorithm, Charge, ConfigError, Cost, Env,
    FailureMode, HeaderMatch, HeaderTest, IdSource, Identity, Limits, Match, MissingTenant, Policy,
    RateLimit, Selector,
};
use serde_json::Value;

const IDENTITY_FIELDS: &[&str] = &[
    "tenant",
    "tenant_header",
    "principal",
    "principal_header",
    "missing_tenant",
];

const POLICY_FIELDS: &[&str] = &[
    "name",
    "match",
    "failure_mode",
    "rate_limits",
    "idempotency",
    "lease",
];

const RATE_LIMIT_FIELDS: &[&str] = &[
    "name",
    "by",
    "algorithm",
    "limit",
    "window",
    "burst",
    "shadow",
    "mode",
    "cost",
    "charge",
];

pub fn identity(v: &Value, path: &str) -> Result<Identity> {
    let mut o = Obj::new(v, path, IDENTITY_FIELDS)?;
    let tenant = id_source(&mut o, "tenant", "tenant_header", "x-tenant-id")?;
    let principal = id_source(&mut o, "principal", "principal_header", "x-user-id")?;
    let missing_tenant = one_of(
        &mut o,
        "missing_tenant",
        &[
            ("reject", MissingTenant::Reject),
            ("anonymous", MissingTenant::Anonymous),
        ],
    )?
    .unwrap_or(MissingTenant::Reject);
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
    let mut src = Obj::new(v, &path, &["header", "metadata"])?;
    let header = header_name(&mut src, "header")?;
    let meta_path = src.field_path("metadata");
    let metadata = src.opt_str_list("metadata")?;
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

pub fn policy(
    v: &Value,
    path: &str,
    default_failure: FailureMode,
    limits: Limits,
    env: Env<'_>,
) -> Result<Policy> {
    let mut o = Obj::new(v, path, POLICY_FIELDS)?;
    let name = name(&mut o, "name")?;
    let matcher = match o.get("match") {
        Some(m) => matcher(m, &o.field_path("match"))?,
        None => Match::default(),
    };
    let failure_mode = failure_mode(&mut o, "failure_mode")?.unwrap_or(default_failure);
    let rate_limits = rate_limits(&mut o, "rate_limits", limits)?;
    let idempotency = match o.get("idempotency") {
        Some(v) => Some(idempotency(v, &o.field_path("idempotency"), limits, env)?),
        None => None,
    };
    let lease = match o.get("lease") {
        Some(v) => Some(lease(v, &o.field_path("lease"))?),
        None => None,
    };
    let uses_client_ip = rate_limits
        .iter()
        .flat_map(|l| &l.by)
        .chain(lease.iter().flat_map(|l| &l.resource))
        .any(|s| *s == Selector::ClientIp);
    let needs_tokens = idempotency.is_some()
        || lease.is_some()
        || rate_limits
            .iter()
            .any(|l| matches!(l.algorithm, Algorithm::SlidingLog | Algorithm::Concurrency));
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

/// A policy's `rate_limits`, names unique within it.
fn rate_limits(o: &mut Obj<'_>, field: &'static str, limits: Limits) -> Result<Vec<RateLimit>> {
    let mut rate_limits: Vec<RateLimit> = Vec::new();
    let limits_path = o.field_path(field);
    if let Some(items) = o.opt_array(field)? {
        for (i, item) in items.iter().enumerate() {
            let lpath = index(&limits_path, i);
            let limit = rate_limit(item, &lpath, limits)?;
            if rate_limits.iter().any(|l| l.name == limit.name) {
                return Err(ConfigError::new(
                    format!("{lpath}.name"),
                    format!("duplicate rate limit name {:?} in this policy", limit.name),
                ));
            }
            rate_limits.push(limit);
        }
    }
    Ok(rate_limits)
}

fn matcher(v: &Value, path: &str) -> Result<Match> {
    let known = &["methods", "path_prefix", "path_exact", "host", "headers"];
    let mut o = Obj::new(v, path, known)?;
    let methods = methods(&mut o, "methods")?.unwrap_or_default();
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
    let mut o = Obj::new(v, path, &["name", "exact", "prefix", "present"])?;
    let name = header_name(&mut o, "name")?
        .ok_or_else(|| ConfigError::new(o.field_path("name"), "is required"))?;
    let exact = o
        .opt_str("exact")?
        .map(|v| HeaderTest::Exact(v.to_string()));
    let prefix = o
        .opt_str("prefix")?
        .map(|v| HeaderTest::Prefix(v.to_string()));
    let present = o.opt_bool("present")?.map(HeaderTest::Present);
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
            let form = crate::http::normalize::normalize_path(p);
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

fn rate_limit(v: &Value, path: &str, limits: Limits) -> Result<RateLimit> {
    let mut o = Obj::new(v, path, RATE_LIMIT_FIELDS)?;
    let name = name(&mut o, "name")?;
    let by = selectors(&mut o, "by")?;
    let algorithm = algorithm(&mut o, "algorithm")?;
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
    let mode_path = o.field_path("mode");
    let leased = one_of(&mut o, "mode", &[("exact", false), ("leased", true)])?.unwrap_or(false);
    if leased && (algorithm != Algorithm::FixedWindow || shadow) {
        return Err(ConfigError::new(
            mode_path,
            "\"leased\" needs algorithm fixed_window and no shadow",
        ));
    }
    let (cost, charge) = cost_and_charge(&mut o, algorithm, burst, leased, limits)?;
    Ok(RateLimit {
        policy_item: crate::http::local_reply::policy_item(&name, limit, window_ms),
        name,
        by,
        algorithm,
        limit,
        window_ms,
        burst,
        shadow,
        leased,
        cost,
        charge,
    })
}

/// `cost` and `charge`, on the counting algorithms that can take any amount: not on
/// sliding_log (one entry per unit), concurrency (a slot per request) or a leased limit.
fn cost_and_charge(
    o: &mut Obj<'_>,
    algorithm: Algorithm,
    capacity: u64,
    leased: bool,
    limits: Limits,
) -> Result<(Option<Cost>, Option<Charge>)> {
    let cost = match o.get("cost") {
        Some(v) => Some(cost::cost(v, &o.field_path("cost"), capacity)?),
        None => None,
    };
    // The most a request of this limit is ever admitted at: what `unreadable: max` charges.
    let max_cost = cost.as_ref().map_or(capacity, |c| c.max);
    let charge = match o.get("charge") {
        Some(v) => Some(cost::charge(
            v,
            &o.field_path("charge"),
            max_cost,
            limits.envoy_buffer,
        )?),
        None => None,
    };
    let refused = match algorithm {
        _ if leased => Some("mode \"leased\""),
        Algorithm::SlidingLog => Some("algorithm sliding_log"),
        Algorithm::Concurrency => Some("algorithm concurrency"),
        _ => None,
    };
    if let Some(what) = refused {
        for (field, given) in [("cost", cost.is_some()), ("charge", charge.is_some())] {
            if given {
                return Err(ConfigError::new(
                    o.field_path(field),
                    format!(
                        "is not supported with {what}: use fixed_window, sliding_window or \
                         token_bucket"
                    ),
                ));
            }
        }
    }
    Ok((cost, charge))
}

fn algorithm(o: &mut Obj<'_>, field: &'static str) -> Result<Algorithm> {
    Ok(match o.req_str(field)? {
        "fixed_window" => Algorithm::FixedWindow,
        "sliding_window" => Algorithm::SlidingWindow,
        "sliding_log" => Algorithm::SlidingLog,
        "token_bucket" => Algorithm::TokenBucket,
        "concurrency" => Algorithm::Concurrency,
        other => {
            return Err(ConfigError::new(
                o.field_path(field),
                format!(
                    "{other:?} is not one of fixed_window, sliding_window, sliding_log, \
                     token_bucket, concurrency"
                ),
            ))
        }
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
