//! `lease`: the resource a request holds alone, and how it waits for it.

use crate::config::fields::selectors;
use crate::config::fields::{duration, header_name, max_wait, one_of};
use crate::config::reader::{Obj, Result};
use crate::config::{ConfigError, Lease, OnBusy, MAX_FENCE_TTL_MS};
use serde_json::Value;

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
