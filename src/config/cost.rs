//! A rate limit's `cost` (units a request consumes at admission, from a request header) and
//! `charge` (the real amount, from the response once it is known).

use crate::config::fields::{header_name, size};
use crate::config::reader::{kind, Obj, Result};
use crate::config::{ConfigError, Pointer};
use serde_json::Value;

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
    /// A JSON pointer into the data of each event of a `text/event-stream` response (the last
    /// event carrying it wins), read as the stream passes; an `application/json` answer is
    /// read as [`ChargeSource::Json`] reads it. A stream that ends (or is cut) before any event
    /// carried it is charged `missing`.
    SseJson {
        pointer: Pointer,
        max_body: u64,
        missing: Fallback,
    },
}

impl ChargeSource {
    /// The JSON pointer a `response_json` or `response_sse_json` charge reads.
    pub fn pointer(&self) -> Option<&Pointer> {
        match self {
            ChargeSource::Json { pointer, .. } | ChargeSource::SseJson { pointer, .. } => {
                Some(pointer)
            }
            ChargeSource::Header(_) | ChargeSource::Trailer(_) => None,
        }
    }
}

/// `charge.unreadable`: the charge of a response whose own cannot be read (no header, a body
/// that is not plain JSON, too large, cut short, ...); `charge.missing`: the charge of an event
/// stream that ended before any event carried its usage.
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

/// The body a `response_json` charge reads at most, unless `max_body` says otherwise (or
/// `envoy_buffer_limit` is smaller).
pub const CHARGE_MAX_BODY: u64 = 1024 * 1024;
/// The largest `max_body` of a `response_json` charge.
const CHARGE_MAX_BODY_LIMIT: u64 = 16 * 1024 * 1024;
/// The largest number of units anything is charged (the scripts count in Lua doubles).
const MAX_UNITS: u64 = 1_000_000_000;

/// `{"header": "<name>", "default": n, "min": n, "max": n}`; `capacity` is the most the limit can ever
/// admit at once (a larger cost could never be admitted). `min` is 1 unless given (0 when
/// `default` is 0): a client must not make its requests free by declaring them so.
pub fn cost(v: &Value, path: &str, capacity: u64) -> Result<Cost> {
    let mut o = Obj::new(v, path, &["header", "default", "min", "max"])?;
    let header = header_name(&mut o, "header")?
        .ok_or_else(|| ConfigError::new(o.field_path("header"), "is required"))?;
    let default = units(&mut o, "default")?.unwrap_or(1);
    let min = units(&mut o, "min")?.unwrap_or(default.min(1));
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
/// `{"response_json": "/json/pointer", "max_body": "1MiB"}`,
/// `{"response_sse_json": "/json/pointer", "max_body": "1MiB", "missing": "cost"}`, with
/// `"unreadable"`: `"cost"`, `"max"` (the default: `max_cost`, the most a request of the limit
/// is admitted at) or a number of units. `max_body` is at most `envoy_buffer_limit`;
/// `missing` (an event stream without its usage) takes the same values, `"cost"` by default.
pub fn charge(v: &Value, path: &str, max_cost: u64, envoy_buffer_limit: u64) -> Result<Charge> {
    let known = &[
        "response_header",
        "trailer",
        "response_json",
        "response_sse_json",
        "max_body",
        "unreadable",
        "missing",
    ];
    let mut o = Obj::new(v, path, known)?;
    let header = header_name(&mut o, "response_header")?;
    let trailer = header_name(&mut o, "trailer")?;
    let json = pointer(&mut o, "response_json")?;
    let sse = pointer(&mut o, "response_sse_json")?;
    let max_body_path = o.field_path("max_body");
    let max_body = size(&mut o, "max_body", CHARGE_MAX_BODY_LIMIT)?;
    let unreadable = fallback(&mut o, "unreadable", max_cost, Fallback::Max(max_cost))?;
    let missing_path = o.field_path("missing");
    let missing = match o.get("missing") {
        Some(_) if sse.is_none() => {
            return Err(ConfigError::new(
                missing_path,
                "only applies to response_sse_json",
            ))
        }
        _ => fallback(&mut o, "missing", max_cost, Fallback::Cost)?,
    };
    if let Some(n) = max_body.filter(|&n| n > envoy_buffer_limit) {
        return Err(ConfigError::new(
            max_body_path,
            format!(
                "{n} bytes is above envoy_buffer_limit ({envoy_buffer_limit} bytes): lower it, \
                 or raise Envoy's per_connection_buffer_limit_bytes and envoy_buffer_limit \
                 together"
            ),
        ));
    }
    if max_body.is_some() && json.is_none() && sse.is_none() {
        return Err(ConfigError::new(
            max_body_path,
            "only applies to response_json and response_sse_json",
        ));
    }
    let max_body = max_body.unwrap_or(CHARGE_MAX_BODY.min(envoy_buffer_limit));
    let json = json.map(|pointer| ChargeSource::Json { pointer, max_body });
    let sse = sse.map(|pointer| ChargeSource::SseJson {
        pointer,
        max_body,
        missing,
    });
    let mut sources = [
        header.map(ChargeSource::Header),
        trailer.map(ChargeSource::Trailer),
        json,
        sse,
    ]
    .into_iter()
    .flatten();
    match (sources.next(), sources.next()) {
        (Some(source), None) => Ok(Charge { source, unreadable }),
        _ => Err(ConfigError::new(
            path,
            "must have exactly one of response_header, trailer, response_json, \
             response_sse_json",
        )),
    }
}

/// A JSON pointer (RFC 6901) in `field`, if given.
fn pointer(o: &mut Obj<'_>, field: &'static str) -> Result<Option<Pointer>> {
    let path = o.field_path(field);
    match o.opt_str(field)? {
        Some(p) if !p.starts_with('/') => Err(ConfigError::new(
            path,
            format!("{p:?} is not a JSON pointer (RFC 6901), e.g. \"/usage/total_tokens\""),
        )),
        Some(p) => Pointer::parse(p).map(Some).map_err(|why| {
            ConfigError::new(
                path,
                format!("{p:?} is not a JSON pointer (RFC 6901): {why}"),
            )
        }),
        None => Ok(None),
    }
}

/// `unreadable` or `missing`: `"cost"`, `"max"` (`max_cost`) or a number of units; `default`
/// when not given.
fn fallback(
    o: &mut Obj<'_>,
    field: &'static str,
    max_cost: u64,
    default: Fallback,
) -> Result<Fallback> {
    let path = o.field_path(field);
    let refused = |shown: String| {
        ConfigError::new(
            path.clone(),
            format!(
                "{shown} is not \"cost\", \"max\" or a whole number of units from 0 to {MAX_UNITS}"
            ),
        )
    };
    match o.get(field) {
        None => Ok(default),
        Some(Value::String(s)) if s == "cost" => Ok(Fallback::Cost),
        Some(Value::String(s)) if s == "max" => Ok(Fallback::Max(max_cost)),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(u) if u <= MAX_UNITS => Ok(Fallback::Units(u)),
            _ => Err(refused(n.to_string())),
        },
        Some(other) => Err(refused(other.to_string())),
    }
}

/// A non-negative integer of units, at most 1000000000 (the scripts count in Lua doubles).
fn units(o: &mut Obj<'_>, field: &'static str) -> Result<Option<u64>> {
    let path = o.field_path(field);
    match o.get(field) {
        None => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(u) if u <= MAX_UNITS => Ok(Some(u)),
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
