//! `cg-admin lease`: a lease, found by its policy, tenant and resource as the filter keys it:
//! its holder's owner token, the fencing token, the time left; `--release` frees it. The
//! fencing counter is never reset: the next holder's token is above every token before.

use crate::admin::args::Args;
use crate::admin::request::{identity_json, shown_identity, Described, Filter, REQUEST_OPTIONS};
use crate::admin::show::{self, rows};
use crate::admin::{AdminError, Context, Report};
use crate::config::{Lease, Selector};
use crate::guards::lease::{resource_keys, resource_parts};
use crate::http::identity::Caller;
use crate::http::request::Request;
use crate::redis::keys::tenant_tag;
use crate::redis::resp::Reply;
use serde_json::json;
use std::fmt::Write;

/// Deletes the lease only while the owner that was read holds it.
const RELEASE_IF_HELD: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

pub(crate) fn run(ctx: &mut Context, args: &[String]) -> Result<Report, AdminError> {
    let mut valued = REQUEST_OPTIONS.to_vec();
    valued.push("--resource");
    let a = Args::parse(args, &valued, &["--release"])?;
    let d = Described::new(&ctx.config, &a, |_| None)?;
    let (index, policy) = d.guarded(&ctx.config)?;
    let Some(lease) = policy.lease.clone() else {
        return Err(AdminError::Usage(format!(
            "policy {:?} takes no lease",
            policy.name
        )));
    };
    let filter = Filter::new(&ctx.config);
    let caller = d.caller(&filter, index)?.clone();
    let given: Vec<&str> = a.values("--resource").collect();
    let parts = parts(&lease, &caller, &d.req, &given)?;
    let prefix = ctx.config.redis.key_prefix.clone();
    let policy_name = policy.name.clone();
    let (key, fence_key) = resource_keys(
        &prefix,
        &tenant_tag(&caller.tenant),
        &policy_name,
        parts.iter().map(|(s, v)| (s, Some(v.as_str()))),
    );

    let owner = bulk(ctx.client.call(&[b"GET", key.as_bytes()])?);
    let ttl = int(ctx.client.call(&[b"PTTL", key.as_bytes()])?);
    let fence = bulk(ctx.client.call(&[b"GET", fence_key.as_bytes()])?);
    let fence_ttl = int(ctx.client.call(&[b"PTTL", fence_key.as_bytes()])?);

    let resource: Vec<String> = parts
        .iter()
        .map(|(s, v)| format!("{}={v}", s.spelling()))
        .collect();
    let mut text = format!(
        "policy {policy_name}, tenant {}, resource {}\n",
        shown_identity(&caller.tenant),
        resource.join(" ")
    );
    let mut r = vec![("key", key.clone())];
    match (&owner, ttl) {
        (Some(o), t) => {
            r.push(("holder", format!("owner token {o}")));
            r.push(("time left", ttl_text(t, lease.ttl_ms)));
        }
        (None, _) => r.push(("holder", "none: the lease is free".into())),
    }
    r.push(("fence key", fence_key.clone()));
    r.push((
        "fencing token",
        match &fence {
            Some(t) if owner.is_some() => format!("{t} (the last issued: the holder's)"),
            Some(t) => format!("{t} (the last issued; the next holder's is above it)"),
            None => {
                "none issued (or the counter expired: tokens stay above Redis time in µs)".into()
            }
        },
    ));
    if fence.is_some() {
        r.push(("fence ttl", ttl_text(fence_ttl, lease.fence_ttl_ms)));
    }
    rows(&mut text, 2, &r);
    let mut json = json!({
        "policy": policy_name,
        "tenant": identity_json(&caller.tenant),
        "resource": parts.iter().map(|(s, v)| json!({"selector": s.spelling(), "value": v})).collect::<Vec<_>>(),
        "key": key,
        "fence_key": fence_key,
        "held": owner.is_some(),
        "owner": owner,
        "ttl_ms": owner.as_ref().map(|_| ttl),
        "fencing_token": fence,
        "fence_ttl_ms": fence.as_ref().map(|_| fence_ttl),
    });
    if a.flag("--release") {
        let held = owner.map(|o| Held {
            before: format!(
                "owner token {o}, {} left, fencing token {}",
                show::span(ttl),
                fence.as_deref().unwrap_or("none")
            ),
            owner: o,
        });
        let released = release(ctx, &key, held)?;
        json["released"] = json!(released);
        if released {
            let _ = writeln!(
                text,
                "released {key}\nthe fence counter {fence_key} is kept, never reset: the next \
                 holder's fencing token is above {}",
                json["fencing_token"]
                    .as_str()
                    .unwrap_or("every token issued before")
            );
        } else {
            text.push_str("nothing to release: the lease is free\n");
        }
    }
    Ok(Report { text, json })
}

/// The resource's parts: each of the lease's selectors with its value, from `--resource` (one
/// value per selector other than `tenant` and `principal`, which name the caller, in the
/// configuration's order) or, without it, from the described request as the filter reads it.
fn parts(
    lease: &Lease,
    caller: &Caller,
    req: &Request,
    given: &[&str],
) -> Result<Vec<(Selector, String)>, AdminError> {
    let spelled = Selector::describe_all(&lease.resource);
    if given.is_empty() {
        return resource_parts(lease, caller, req)
            .map(|parts| {
                parts
                    .into_iter()
                    .map(|(s, v)| (s.clone(), v.unwrap_or_default().to_string()))
                    .collect()
            })
            .map_err(|missing| {
                AdminError::Usage(format!(
                    "the lease's resource is {spelled}, and the request does not carry \
                     {missing}: describe the request (--path, --header, ...) or give \
                     --resource"
                ))
            });
    }
    let wanted: Vec<&Selector> = lease
        .resource
        .iter()
        .filter(|s| !matches!(s, Selector::Tenant | Selector::Principal))
        .collect();
    if wanted.len() != given.len() {
        let names: Vec<String> = wanted.iter().map(|s| s.spelling()).collect();
        return Err(AdminError::Usage(format!(
            "the lease's resource is {spelled}: give one --resource for each of {} (in that \
             order; tenant and principal come from --tenant and --principal)",
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        )));
    }
    let mut values = given.iter();
    Ok(lease
        .resource
        .iter()
        .map(|s| {
            let v = match s {
                Selector::Tenant => caller.tenant.clone(),
                Selector::Principal => caller.principal.to_string(),
                _ => values.next().map(|v| v.to_string()).unwrap_or_default(),
            };
            (s.clone(), v)
        })
        .collect())
}

fn bulk(r: Reply) -> Option<String> {
    match r {
        Reply::Bulk(Some(b)) => Some(String::from_utf8_lossy(&b).into_owned()),
        _ => None,
    }
}

fn int(r: Reply) -> i64 {
    r.as_int().unwrap_or(-2)
}

fn ttl_text(ttl: i64, of: u64) -> String {
    match ttl {
        -1 => "none (the key has no TTL)".into(),
        t if t < 0 => "gone".into(),
        t => format!("{} of {}", show::span(t), show::duration(of)),
    }
}

/// The holder read, and how the change log describes it.
struct Held {
    owner: String,
    before: String,
}

/// `--release`: deletes the lease while the owner read holds it (the fence key stays);
/// `false` when it was free.
fn release(ctx: &mut Context, key: &str, held: Option<Held>) -> Result<bool, AdminError> {
    let Some(held) = held else {
        return Ok(false);
    };
    let done = ctx.client.call(&[
        b"EVAL",
        RELEASE_IF_HELD.as_bytes(),
        b"1",
        key.as_bytes(),
        held.owner.as_bytes(),
    ])?;
    if !matches!(done, Reply::Int(1)) {
        return Err(AdminError::Refused(format!(
            "the lease {key} changed hands while it was read; nothing released: run the \
             command again"
        )));
    }
    ctx.log_change("release", key, &held.before);
    Ok(true)
}
