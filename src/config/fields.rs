//! Field readers shared by the sections: names, header names, durations, sizes, one-of
//! choices, method lists and values from the VM's environment, each with its one error message.

use crate::config::reader::{index, kind, Obj, Result};
use crate::config::{units, ConfigError, Env, FailureMode, PathParam, Selector};
use crate::support::template::is_variable_name;
use serde_json::Value;

/// The value of the Wasm VM's environment variable `name` (set and not empty), for the field
/// at `path` that names it. Errors name the variable, never its value.
pub fn env_value(name: &str, path: &str, env: Env<'_>) -> Result<String> {
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
        Some(v) => Ok(v),
    }
}

/// A list of lower-case header (or trailer) names; `default` when absent.
pub fn header_list(o: &mut Obj<'_>, field: &'static str, default: &[&str]) -> Result<Vec<String>> {
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

pub fn size(o: &mut Obj<'_>, field: &'static str, max: u64) -> Result<Option<u64>> {
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
            format!("expected a size such as \"64KiB\", found {}", kind(other)),
        )),
    }
}

pub fn is_header_name(h: &str) -> bool {
    !h.is_empty()
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

pub fn header_name(o: &mut Obj<'_>, field: &'static str) -> Result<Option<String>> {
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
pub fn name(o: &mut Obj<'_>, field: &'static str) -> Result<String> {
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

pub fn duration(o: &mut Obj<'_>, field: &'static str) -> Result<Option<u64>> {
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

/// `max_wait` (`field`), at most [`crate::config::MAX_WAIT_MS`].
pub fn max_wait(o: &mut Obj<'_>, field: &'static str) -> Result<Option<u64>> {
    let path = o.field_path(field);
    match duration(o, field)? {
        Some(ms) if ms > crate::config::MAX_WAIT_MS => Err(ConfigError::new(
            path,
            format!(
                "{ms}ms is longer than the maximum of {}s (a waiting request polls Redis \
                 several times a second and holds its connection meanwhile)",
                crate::config::MAX_WAIT_MS / 1000
            ),
        )),
        other => Ok(other),
    }
}

pub fn failure_mode(o: &mut Obj<'_>, field: &'static str) -> Result<Option<FailureMode>> {
    one_of(
        o,
        field,
        &[
            ("fail_open", FailureMode::Open),
            ("fail_closed", FailureMode::Closed),
        ],
    )
}

/// A string field that names one of `choices`; the error lists them, quoted, in order.
pub fn one_of<T: Copy>(
    o: &mut Obj<'_>,
    field: &'static str,
    choices: &[(&str, T)],
) -> Result<Option<T>> {
    let Some(given) = o.opt_str(field)? else {
        return Ok(None);
    };
    if let Some((_, value)) = choices.iter().find(|(name, _)| *name == given) {
        return Ok(Some(*value));
    }
    let names: Vec<String> = choices.iter().map(|(n, _)| format!("{n:?}")).collect();
    Err(ConfigError::new(
        o.field_path(field),
        format!("{given:?} is not one of {}", names.join(", ")),
    ))
}

/// A list of HTTP methods, upper-cased; `None` when absent.
pub fn methods(o: &mut Obj<'_>, field: &'static str) -> Result<Option<Vec<String>>> {
    let path = o.field_path(field);
    let Some(list) = o.opt_str_list(field)? else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        if m.is_empty() || !m.bytes().all(|b| b.is_ascii_alphabetic()) {
            return Err(ConfigError::new(
                index(&path, i),
                format!("{m:?} is not an HTTP method"),
            ));
        }
        out.push(m.to_ascii_uppercase());
    }
    Ok(Some(out))
}

pub fn selectors(o: &mut Obj<'_>, field: &'static str) -> Result<Vec<Selector>> {
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

const SELECTORS: &str = "tenant, principal, client_ip, method, path, header:<name>, \
     path_segment:<n>, query:<name>, path_param:<name>";

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
            if let Some(name) = s.strip_prefix("path_param:") {
                // Bound to the policy's template once the policy is read.
                return is_variable_name(name).then(|| {
                    Selector::PathParam(PathParam {
                        name: name.to_string(),
                        bound: None,
                    })
                });
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
