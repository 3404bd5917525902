//! `redis`: the gateway the filter reaches Redis through, and its credential.

use crate::config::fields::{duration, env_value};
use crate::config::reader::{Obj, Result};
use crate::config::{ConfigError, Env, DEFAULT_TIMEOUT_MS};
use serde_json::Value;

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

const REDIS_FIELDS: &[&str] = &[
    "protocol",
    "cluster",
    "authority",
    "timeout",
    "authorization",
    "authorization_env",
    "key_prefix",
    "batch",
];

pub fn redis_config(v: &Value, path: &str, env: Env<'_>) -> Result<RedisConfig> {
    let mut o = Obj::new(v, path, REDIS_FIELDS)?;
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
    let authorization = authorization(&mut o, env)?;
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
        None | Some(Value::Bool(true)) => Some(Batch::default()),
        Some(Value::Bool(false)) => None,
        Some(v) => Some(batch(v, &o.field_path("batch"))?),
    };
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
    let value = env_value(name, path, env)?;
    if !is_header_value(&value) {
        return Err(ConfigError::new(
            path,
            format!("environment variable {name} is not a printable ASCII header value"),
        ));
    }
    Ok(value)
}

/// `redis.batch`: how acquire calls of one worker are coalesced (`true`, the default, with
/// [`Batch::default`]; `false` never).
fn batch(v: &Value, path: &str) -> Result<Batch> {
    let defaults = Batch::default();
    if !v.is_object() {
        return Err(ConfigError::new(path, "expected true, false or an object"));
    }
    let mut b = Obj::new(v, path, &["max_delay", "max_requests", "cross_slot"])?;
    let max_delay_ms = duration(&mut b, "max_delay")?.unwrap_or(defaults.max_delay_ms);
    if max_delay_ms > 100 {
        return Err(ConfigError::new(
            b.field_path("max_delay"),
            "must be at most 100ms: every batched request waits for it",
        ));
    }
    let max_requests = match b.opt_positive("max_requests")? {
        None => defaults.max_requests,
        Some(n) if n <= 1000 => n as usize,
        Some(n) => {
            return Err(ConfigError::new(
                b.field_path("max_requests"),
                format!("{n} is too large (at most 1000)"),
            ))
        }
    };
    let cross_slot = b.opt_bool("cross_slot")?.unwrap_or(defaults.cross_slot);
    Ok(Batch {
        max_delay_ms,
        max_requests,
        cross_slot,
    })
}

/// `authorization` or `authorization_env` (one of them at most): the gateway's credential.
fn authorization(o: &mut Obj<'_>, env: Env<'_>) -> Result<Option<String>> {
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
    Ok(authorization)
}
