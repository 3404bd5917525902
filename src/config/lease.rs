//! `lease`: the resource a request holds alone, and how it waits for it.

use crate::config::fields::selectors;
use crate::config::fields::{duration, header_name, max_wait, one_of};
use crate::config::reader::{Obj, Result};
use crate::config::{ConfigError, Selector};
use serde_json::Value;

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

const LEASE_FIELDS: &[&str] = &[
    "resource",
    "ttl",
    "on_busy",
    "max_wait",
    "fencing_header",
    "extend",
    "fence_ttl",
];

pub fn lease(v: &Value, path: &str) -> Result<Lease> {
    let mut o = Obj::new(v, path, LEASE_FIELDS)?;
    let resource = selectors(&mut o, "resource")?;
    if resource.is_empty() {
        return Err(ConfigError::new(
            o.field_path("resource"),
            "must name at least one selector",
        ));
    }
    let ttl_ms = duration(&mut o, "ttl")?.unwrap_or(10_000);
    let on_busy = one_of(
        &mut o,
        "on_busy",
        &[("reject", OnBusy::Reject), ("wait", OnBusy::Wait)],
    )?
    .unwrap_or(OnBusy::Reject);
    let max_wait_ms = max_wait(&mut o, "max_wait")?.unwrap_or(2_000);
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
