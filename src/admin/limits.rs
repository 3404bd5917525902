//! `cg-admin limits`: each rate limit of a described request as the filter would see it now,
//! read by the `peek` script (acquire.lua read-only, one call per hash tag, a request of cost
//! 1); `--reset` deletes the counters.

use crate::admin::args::Args;
use crate::admin::client::ClientError;
use crate::admin::request::{
    identity_json, refused, shown_identity, Described, Filter, OWNER, REQUEST_OPTIONS,
};
use crate::admin::show::{self, rows};
use crate::admin::{AdminError, Context, Report};
use crate::config::{Algorithm, Policy, Quota, RateLimit, Selector};
use crate::guards::ratelimit;
use crate::http::local_reply::{ratelimit_headers, QuotaView};
use crate::redis::keys::{limit_code, LimitKey};
use crate::redis::resp::Reply;
use crate::redis::scripts::acquire::{self, Ask, Asker, LimitState, Override, OverrideKeys};
use crate::redis::scripts::peek;
use crate::redis::tag::{untag, CallTags};
use crate::redis::CallError;
use serde_json::{json, Value};
use std::fmt::Write;

pub(crate) fn run(ctx: &mut Context, args: &[String]) -> Result<Report, AdminError> {
    let mut valued = REQUEST_OPTIONS.to_vec();
    valued.push("--limit");
    let a = Args::parse(args, &valued, &["--reset"])?;
    let d = Described::new(&ctx.config, &a, |_| None)?;
    let (index, policy) = d.guarded(&ctx.config)?;
    let filter = Filter::new(&ctx.config);
    let caller = d.caller(&filter, index)?.clone();
    if let Some(problem) = filter.repeated_selector(index, &d.req) {
        return Err(refused("the request", &problem));
    }
    // `--limit NAME` (repeats): only those limits; by default every one.
    let chosen: Vec<&str> = a.values("--limit").collect();
    if let Some(unknown) = chosen
        .iter()
        .find(|n| !policy.rate_limits.iter().any(|l| l.name == **n))
    {
        let names: Vec<&str> = policy.rate_limits.iter().map(|l| l.name.as_str()).collect();
        return Err(AdminError::Usage(format!(
            "policy {:?} has no limit {unknown:?}; its limits are {}",
            policy.name,
            names.join(", ")
        )));
    }
    let prefix = ctx.config.redis.key_prefix.clone();
    let policy = policy.clone();
    let keys: Vec<Option<LimitKey>> = policy
        .rate_limits
        .iter()
        .map(|l| {
            (chosen.is_empty() || chosen.contains(&l.name.as_str()))
                .then(|| ratelimit::key(&prefix, &policy, l, &caller, &d.req))
        })
        .collect();
    // The override keys the filter would pass, so a limit shows the caller's own quota.
    let overrides: Vec<Option<OverrideKeys>> = policy
        .rate_limits
        .iter()
        .zip(&keys)
        .map(|(l, key)| {
            let key = key.as_ref()?;
            ratelimit::override_keys(&prefix, &policy, l, key, &caller)
        })
        .collect();
    let states = peek_states(ctx, &policy, &prefix, &keys, &overrides)?;
    let head = json!({
        "policy": policy.name,
        "tenant": identity_json(&caller.tenant),
        "principal": identity_json(&caller.principal),
    });
    let mut text = format!(
        "policy {}, tenant {}, principal {}\n",
        policy.name,
        shown_identity(&caller.tenant),
        shown_identity(&caller.principal)
    );
    if policy.rate_limits.is_empty() {
        text.push_str("no rate limits\n");
    }
    if a.flag("--reset") {
        return reset(ctx, &policy, &keys, &states, head, text);
    }
    let mut limits = Vec::new();
    for (i, (l, (key, state))) in policy
        .rate_limits
        .iter()
        .zip(chosen_states(&keys, &states))
        .enumerate()
    {
        let Some((key, state)) = key.zip(state) else {
            continue;
        };
        let _ = writeln!(text, "limit {}: {}", l.name, show::limit_line(l));
        // As the filter reads it: a quota that says what the configuration says is none.
        let own = match state.quota.filter(|q| *q != l.quota()) {
            Some(q) => Some((q, own_burst(ctx, l, q, overrides.get(i))?)),
            None => None,
        };
        let capacity = match own {
            Some((q, burst)) => burst.unwrap_or(q.limit),
            None => show::capacity(l),
        };
        let used = capacity.saturating_sub(state.remaining);
        let header = header_item(l, state);
        let reset = format!("{} (RateLimit: {header})", show::span(ms(state.reset_ms)));
        let next = if state.allowed {
            "a request of cost 1 would be admitted".to_string()
        } else if l.shadow {
            "over the limit (shadow: the request would still be admitted)".to_string()
        } else {
            format!(
                "a request of cost 1 would be rejected; retry after {}",
                show::span(ms(state.retry_after_ms))
            )
        };
        let mut r = vec![("key", key.text().to_string())];
        if !l.tenant_scoped() {
            r.push(("counts", shared_by(l)));
        }
        if let Some((q, burst)) = own {
            r.push((
                "quota",
                format!(
                    "{} (the caller's own, an override)",
                    show::quota(q.limit, q.window_ms, burst)
                ),
            ));
        }
        if state.override_unreadable {
            r.push((
                "override",
                "unreadable, ignored: counted with the configuration's quota".into(),
            ));
        }
        r.extend([
            (
                "used",
                format!("{used} of {capacity} ({})", show::used_means(l)),
            ),
            ("remaining", state.remaining.to_string()),
            ("reset", reset),
            ("next", next),
        ]);
        rows(&mut text, 2, &r);
        limits.push(json!({
            "name": l.name,
            "key": key.text(),
            "hash_tag": key.tag(),
            "algorithm": show::algorithm(l),
            "code": limit_code(l),
            "limit": l.limit,
            "window_ms": l.window_ms,
            "calendar": l.calendar.as_ref().map(|c| json!({
                "window": c.period.spelling(),
                "zone": c.zone.name,
                "spec": c.spec,
            })),
            "burst": l.burst,
            "capacity": capacity,
            "override": own.map(|(q, burst)| json!({
                "limit": q.limit,
                "window_ms": q.window_ms,
                "burst": burst,
            })),
            "override_unreadable": state.override_unreadable,
            "shadow": l.shadow,
            "tenant_scoped": l.tenant_scoped(),
            "used": used,
            "used_means": show::used_means(l),
            "remaining": state.remaining,
            "reset_ms": state.reset_ms,
            "retry_after_ms": state.retry_after_ms,
            "allowed": state.allowed,
            "ratelimit": header,
        }));
    }
    let mut json = head;
    json["limits"] = Value::Array(limits);
    Ok(Report { text, json })
}

/// The limit's chosen keys and their states, in the policy's order.
fn chosen_states<'a>(
    keys: &'a [Option<LimitKey>],
    states: &'a [Option<LimitState>],
) -> impl Iterator<Item = (Option<&'a LimitKey>, Option<&'a LimitState>)> {
    keys.iter()
        .zip(states)
        .map(|(k, s)| (k.as_ref(), s.as_ref()))
}

/// Whose requests a counter that is not the tenant's own counts.
fn shared_by(l: &RateLimit) -> String {
    if l.by.is_empty() {
        "every request of the policy, whichever tenant sends it".into()
    } else {
        format!(
            "the requests of every tenant with the same {}",
            Selector::describe_all(&l.by)
        )
    }
}

/// The `RateLimit` item the filter would send for this state on an admitted request
/// (`"name";r=..;t=..`; a concurrency limit's has no `t`).
fn header_item(l: &RateLimit, s: &LimitState) -> String {
    let view = QuotaView {
        limit: l,
        quota: s.quota.filter(|q| *q != l.quota()),
        remaining: s.remaining,
        reset_ms: s.reset_ms,
    };
    ratelimit_headers(&[view], None).1
}

/// A token bucket's own burst, which the script's reply does not carry: read from the first
/// of the limit's override keys that holds the quota the counter was counted with. `None` for
/// another algorithm (its capacity is its limit).
fn own_burst(
    ctx: &mut Context,
    l: &RateLimit,
    quota: Quota,
    keys: Option<&Option<OverrideKeys>>,
) -> Result<Option<u64>, AdminError> {
    let Some(Some(keys)) = keys.filter(|_| l.algorithm == Algorithm::TokenBucket) else {
        return Ok(None);
    };
    for key in keys.principal.iter().chain([&keys.tenant]) {
        if let Reply::Bulk(Some(value)) = ctx.client.call(&[b"GET", key.as_bytes()])? {
            if let Some(o) = Override::read(&value, true) {
                if o.limit == quota.limit && o.window_ms == quota.window_ms {
                    return Ok(Some(o.burst.unwrap_or(o.limit)));
                }
            }
        }
    }
    // Changed since the peek: a bucket's burst is its limit unless given.
    Ok(Some(quota.limit))
}

fn ms(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The chosen limits' states now (`None` for a limit not chosen): the peek script, one `EVAL`
/// per hash tag, with the calls the filter would plan for a request of cost 1 (no record, no
/// lease).
fn peek_states(
    ctx: &mut Context,
    policy: &Policy,
    prefix: &str,
    keys: &[Option<LimitKey>],
    overrides: &[Option<OverrideKeys>],
) -> Result<Vec<Option<LimitState>>, AdminError> {
    let asks: Vec<Option<Ask<'_>>> = keys
        .iter()
        .zip(overrides)
        .map(|(key, overrides)| {
            key.as_ref().map(|key| Ask {
                key,
                cost: 1,
                overrides: overrides.as_ref(),
            })
        })
        .collect();
    let asker = Asker {
        nonce: OWNER,
        prefix,
        owner: OWNER,
    };
    let script = peek();
    let tags = CallTags::from_entropy();
    let mut states = vec![None; keys.len()];
    for group in acquire::plan(policy, &asks, &asker, None, None) {
        let n = group.call.keys.len().to_string();
        // As the filter sends a call: the call's tag first among the arguments, and its reply
        // read only when it carries the tag back.
        let tag = tags.next();
        let mut words: Vec<&[u8]> = vec![b"EVAL", script.source.as_bytes(), n.as_bytes()];
        words.extend(group.call.keys.iter_bytes());
        words.push(tag.as_bytes());
        words.extend(group.call.args.iter_bytes());
        let reply = untag(Ok(ctx.client.call(&words)?), &tag).map_err(unexpected)?;
        let read =
            acquire::read_reply(&reply, group.limits.len(), false, false).map_err(unexpected)?;
        for (&i, state) in group.limits.iter().zip(read.states) {
            if let Some(slot) = states.get_mut(i) {
                *slot = Some(state);
            }
        }
    }
    if keys
        .iter()
        .zip(&states)
        .any(|(k, s)| k.is_some() != s.is_some())
    {
        return Err(unexpected(CallError::UnexpectedReply(
            "a limit without an answer".into(),
        )));
    }
    Ok(states)
}

fn unexpected(e: CallError) -> AdminError {
    AdminError::Redis(ClientError::Protocol(format!("{e:?}")))
}

/// `--reset`: deletes every counter of the request (a counter that does not exist is left as
/// it is, so a second run finds nothing to do).
fn reset(
    ctx: &mut Context,
    policy: &Policy,
    keys: &[Option<LimitKey>],
    states: &[Option<LimitState>],
    mut json: Value,
    mut text: String,
) -> Result<Report, AdminError> {
    let mut done = Vec::new();
    let mut changed = false;
    for (l, (key, state)) in policy.rate_limits.iter().zip(chosen_states(keys, states)) {
        let Some((key, state)) = key.zip(state) else {
            continue;
        };
        let deleted = matches!(
            ctx.client.call(&[b"DEL", key.text().as_bytes()])?,
            Reply::Int(1)
        );
        if deleted {
            changed = true;
            let before = format!(
                "limit {}, {} used of {}, {} remaining, reset in {}",
                l.name,
                show::capacity(l).saturating_sub(state.remaining),
                show::capacity(l),
                state.remaining,
                show::span(ms(state.reset_ms))
            );
            ctx.log_change("reset", key.text(), &before);
            let _ = writeln!(text, "reset {}: deleted {}", l.name, key.text());
        } else {
            let _ = writeln!(
                text,
                "reset {}: no counter at {} (nothing to reset)",
                l.name,
                key.text()
            );
        }
        done.push(json!({"name": l.name, "key": key.text(), "deleted": deleted}));
    }
    if !changed && !done.is_empty() {
        text.push_str("nothing to reset: every counter is already fresh\n");
    }
    json["reset"] = Value::Array(done);
    json["changed"] = Value::Bool(changed);
    Ok(Report { text, json })
}
