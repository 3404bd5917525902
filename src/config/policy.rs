//! A policy: its match, its rate limits and their selectors, and the caller's identity.

use super::fields::{duration, failure_mode, header_name, methods, name, one_of, selectors};
use super::reader::{index, Obj, Result};
use super::{
    idempotency::idempotency, lease::lease, Algorithm, ConfigError, FailureMode, Identity, Match,
    MissingTenant, Policy, RateLimit, Selector,
};
use serde_json::Value;

pub fn identity(v: &Value, path: &str) -> Result<Identity> {
    let mut o = Obj::new(v, path)?;
    let tenant_header = header_name(&mut o, "tenant_header")?.unwrap_or("x-tenant-id".into());
    let principal_header = header_name(&mut o, "principal_header")?.unwrap_or("x-user-id".into());
    let missing_tenant = one_of(
        &mut o,
        "missing_tenant",
        &[
            ("reject", MissingTenant::Reject),
            ("anonymous", MissingTenant::Anonymous),
        ],
    )?
    .unwrap_or(MissingTenant::Reject);
    o.finish()?;
    Ok(Identity {
        tenant_header,
        principal_header,
        missing_tenant,
    })
}

pub fn policy(
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
    let rate_limits = rate_limits(&mut o, "rate_limits")?;
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

/// A policy's `rate_limits`, names unique within it.
fn rate_limits(o: &mut Obj<'_>, field: &'static str) -> Result<Vec<RateLimit>> {
    let mut rate_limits: Vec<RateLimit> = Vec::new();
    let limits_path = o.field_path(field);
    if let Some(items) = o.opt_array(field)? {
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
    Ok(rate_limits)
}

fn matcher(v: &Value, path: &str) -> Result<Match> {
    let mut o = Obj::new(v, path)?;
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
    o.finish()?;
    Ok(Match {
        methods,
        path_prefix,
        path_exact,
        host,
    })
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

fn algorithm(o: &mut Obj<'_>, field: &'static str) -> Result<Algorithm> {
    Ok(match o.req_str(field)? {
        "fixed_window" => Algorithm::FixedWindow,
        "sliding_window" => Algorithm::SlidingWindow,
        "sliding_log" => Algorithm::SlidingLog,
        "token_bucket" => Algorithm::TokenBucket,
        other => {
            return Err(ConfigError::new(
                o.field_path(field),
                format!(
                "{other:?} is not one of fixed_window, sliding_window, sliding_log, token_bucket"
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
