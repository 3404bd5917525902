//! A rate limit's `cost` (units a request consumes at admission, from a request header) and
//! `charge` (the real amount, from the response once it is known).

use super::fields::{header_name, size};
use super::reader::{kind, Obj, Result};
use super::{Charge, ConfigError, Cost};
use serde_json::Value;

/// The body a `response_json` charge reads at most, unless `max_body` says otherwise.
pub const CHARGE_MAX_BODY: u64 = 1024 * 1024;
/// The largest `max_body` of a `response_json` charge (it is copied as it passes).
const CHARGE_MAX_BODY_LIMIT: u64 = 16 * 1024 * 1024;

/// `{"header": "<name>", "default": n, "min": n, "max": n}`; `capacity` is the most the limit can ever
/// admit at once (a larger cost could never be admitted).
pub fn cost(v: &Value, path: &str, capacity: u64) -> Result<Cost> {
    let mut o = Obj::new(v, path, &["header", "default", "min", "max"])?;
    let header = header_name(&mut o, "header")?
        .ok_or_else(|| ConfigError::new(o.field_path("header"), "is required"))?;
    let default = units(&mut o, "default")?.unwrap_or(1);
    let min = units(&mut o, "min")?.unwrap_or(0);
    let max_path = o.field_path("max");
    let max = units(&mut o, "max")?.unwrap_or(capacity);
    if max > capacity {
        return Err(ConfigError::new(
            max_path,
            format!("{max} is more than the limit can ever admit ({capacity})"),
        ));
    }
    if default > max || default < min {
        return Err(ConfigError::new(
            format!("{path}.default"),
            format!("{default} is not between min ({min}) and max ({max})"),
        ));
    }
    Ok(Cost {
        header,
        default,
        min,
        max,
    })
}

/// Exactly one of `{"response_header": "<name>"}`, `{"trailer": "<name>"}`,
/// `{"response_json": "/json/pointer", "max_body": "1MiB"}`.
pub fn charge(v: &Value, path: &str) -> Result<Charge> {
    let known = &["response_header", "trailer", "response_json", "max_body"];
    let mut o = Obj::new(v, path, known)?;
    let header = header_name(&mut o, "response_header")?;
    let trailer = header_name(&mut o, "trailer")?;
    let pointer_path = o.field_path("response_json");
    let pointer = o.opt_str("response_json")?;
    let max_body_path = o.field_path("max_body");
    let max_body = size(&mut o, "max_body", CHARGE_MAX_BODY_LIMIT)?;
    if let Some(p) = pointer {
        if !p.starts_with('/') {
            return Err(ConfigError::new(
                pointer_path,
                format!("{p:?} is not a JSON pointer (RFC 6901), e.g. \"/usage/total_tokens\""),
            ));
        }
    } else if max_body.is_some() {
        return Err(ConfigError::new(
            max_body_path,
            "only applies to response_json",
        ));
    }
    let json = pointer.map(|p| Charge::Json {
        pointer: p.to_string(),
        max_body: max_body.unwrap_or(CHARGE_MAX_BODY),
    });
    let mut sources = [
        header.map(Charge::Header),
        trailer.map(Charge::Trailer),
        json,
    ]
    .into_iter()
    .flatten();
    match (sources.next(), sources.next()) {
        (Some(charge), None) => Ok(charge),
        _ => Err(ConfigError::new(
            path,
            "must have exactly one of response_header, trailer, response_json",
        )),
    }
}

/// A non-negative integer of units, at most 1000000000 (the scripts count in Lua doubles).
fn units(o: &mut Obj<'_>, field: &'static str) -> Result<Option<u64>> {
    let path = o.field_path(field);
    match o.get(field) {
        None => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(u) if u <= 1_000_000_000 => Ok(Some(u)),
            _ => Err(ConfigError::new(
                path,
                format!("{n} is not an integer between 0 and 1000000000"),
            )),
        },
        Some(other) => Err(ConfigError::new(
            path,
            format!("expected an integer, found {}", kind(other)),
        )),
    }
}
