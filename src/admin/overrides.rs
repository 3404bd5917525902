//! `cg-admin override set|clear|list`: a tenant's or a principal's own limit.
//!
//! An override is a string key in the tenant's hash tag, beside the counters it applies to
//! (`<prefix>:ovr:{t.<tenant hash>}:<policy>:<limit>:t`, or `…:p.<principal hash>` for one
//! principal), holding `<limit>/<window_ms>[/<burst>]`, with an optional expiry as its own
//! TTL. The filter reads it in the script call that counts the limit, for limits with
//! `overrides: true`. The tool also keeps the set of override keys it wrote for a tenant's
//! policy (`…:<policy>:index`), so `list` names them without scanning; a member whose key
//! expired is shown as expired and taken out of the set.

use crate::admin::args::Args;
use crate::admin::client::{Client, ClientError};
use crate::admin::request::policy_named;
use crate::admin::show;
use crate::admin::{AdminError, Context, Report};
use crate::config::units::parse_duration_ms;
use crate::config::{Algorithm, Config, Policy, RateLimit};
use crate::redis::keys;
use crate::redis::resp::Reply;
use crate::redis::scripts::acquire::{Override, OVERRIDE_MAX_LIMIT, OVERRIDE_MAX_WINDOW_MS};
use serde_json::{json, Value};
use std::fmt::Write;

const USAGE: &str = "\
usage: cg-admin override set --policy P --limit L --tenant T [--principal U] --quota N
                             [--window W] [--burst B] [--ttl D]
       cg-admin override clear --policy P --limit L --tenant T [--principal U]
       cg-admin override list --policy P --tenant T [--principal U ...]";

/// Runs `override` with its own arguments.
pub(crate) fn run(ctx: &mut Context, args: &[String]) -> Result<Report, AdminError> {
    let (action, rest) = args
        .split_first()
        .ok_or_else(|| AdminError::Usage(USAGE.into()))?;
    match action.as_str() {
        "set" => set(ctx, rest),
        "clear" => clear(ctx, rest),
        "list" => list(ctx, rest),
        other => Err(AdminError::Usage(format!(
            "override {other:?}: the actions are set, clear, list\n{USAGE}"
        ))),
    }
}

/// The override `set` and `clear` name: a limit of a policy, a tenant, perhaps a principal.
struct Target<'c> {
    policy: &'c Policy,
    limit: &'c RateLimit,
    tenant: String,
    principal: Option<String>,
    key: String,
    index: String,
}

impl<'c> Target<'c> {
    fn read(config: &'c Config, a: &Args) -> Result<Target<'c>, AdminError> {
        let (pi, policy) = policy_named(config, a.required("--policy")?)?;
        let name = a.required("--limit")?;
        let Some((li, limit)) = policy
            .rate_limits
            .iter()
            .enumerate()
            .find(|(_, l)| l.name == name)
        else {
            let names: Vec<&str> = policy.rate_limits.iter().map(|l| l.name.as_str()).collect();
            return Err(AdminError::Usage(format!(
                "policy {:?} has no limit {name:?}; its limits: {}",
                policy.name,
                listed(&names)
            )));
        };
        let field = format!("policies[{pi}].rate_limits[{li}]");
        if !limit.overrides {
            return Err(AdminError::Refused(format!(
                "limit {name:?} of policy {:?} does not read overrides: set {field}.overrides \
                 to true in the plugin configuration and roll it out first",
                policy.name
            )));
        }
        let tenant = a.required("--tenant")?.to_string();
        let principal = a.value("--principal")?.map(str::to_string);
        if principal.is_some() && !limit.per_principal() {
            return Err(AdminError::Refused(format!(
                "limit {name:?} of policy {:?} counts per tenant, not per principal: a \
                 principal's own limit needs \"principal\" in {field}.by",
                policy.name
            )));
        }
        let prefix = &config.redis.key_prefix;
        let tag = keys::tenant_tag(&tenant);
        Ok(Target {
            policy,
            limit,
            key: keys::override_key(
                prefix,
                &tag,
                &policy.name,
                &limit.name,
                principal.as_deref(),
            ),
            index: keys::override_index_key(prefix, &tag, &policy.name),
            tenant,
            principal,
        })
    }

    /// `policy create-order, limit tenant, tenant "acme" (principal "alice")`
    fn describe(&self) -> String {
        let mut s = format!(
            "policy {}, limit {}, tenant {:?}",
            self.policy.name, self.limit.name, self.tenant
        );
        if let Some(p) = &self.principal {
            let _ = write!(s, ", principal {p:?}");
        }
        s
    }

    fn json(&self) -> Value {
        json!({
            "policy": self.policy.name,
            "limit": self.limit.name,
            "tenant": self.tenant,
            "principal": self.principal,
            "key": self.key,
            "configured": quota_json(self.limit.limit, self.limit.window_ms, self.config_burst()),
        })
    }

    fn config_burst(&self) -> Option<u64> {
        (self.limit.algorithm == Algorithm::TokenBucket).then_some(self.limit.burst)
    }
}

fn set(ctx: &mut Context, rest: &[String]) -> Result<Report, AdminError> {
    let a = Args::parse(
        rest,
        &[
            "--policy",
            "--limit",
            "--tenant",
            "--principal",
            "--quota",
            "--window",
            "--burst",
            "--ttl",
        ],
        &[],
    )?;
    let t = Target::read(&ctx.config, &a)?;
    let wanted = wanted(&t, &a)?;
    let ttl_ms = match a.value("--ttl")? {
        Some(d) => Some(parse_duration_ms(d).ok_or_else(|| {
            AdminError::Usage(format!(
                "--ttl {d:?} is not a duration (e.g. \"30m\", \"1d\")"
            ))
        })?),
        None => None,
    };
    let value = wanted.text();
    let before = get(&mut ctx.client, &t.key)?;
    let pttl = int(&mut ctx.client, &[b"PTTL", t.key.as_bytes()])?;
    // The same value without an expiry, where none was asked for: nothing to change. With
    // --ttl, the expiry is set anew from now.
    let same = before.as_deref() == Some(value.as_str()) && ttl_ms.is_none() && pttl == -1;
    if !same {
        let ttl = ttl_ms.map(|t| t.to_string());
        let mut words: Vec<&[u8]> = vec![b"SET", t.key.as_bytes(), value.as_bytes()];
        if let Some(ttl) = &ttl {
            words.extend([b"PX".as_slice(), ttl.as_bytes()]);
        }
        expect_ok(ctx.client.call(&words)?)?;
        ctx.log_change(
            "override set",
            &t.key,
            before.as_deref().unwrap_or("absent"),
        );
    }
    let indexed = int(
        &mut ctx.client,
        &[b"SADD", t.index.as_bytes(), t.key.as_bytes()],
    )? == 1;
    if indexed && same {
        ctx.log_change("override index", &t.key, "not in the index");
    }
    let changed = !same || indexed;
    let mut text = format!("override set: {}\n", t.describe());
    let _ = writeln!(text, "  key        {}", t.key);
    let _ = writeln!(
        text,
        "  quota      {}{}",
        show::quota(wanted.limit, wanted.window_ms, wanted.burst),
        ttl_ms.map_or(String::new(), |t| format!(
            ", expires in {}",
            show::duration(t)
        ))
    );
    let _ = writeln!(
        text,
        "  configured {}",
        show::quota(t.limit.limit, t.limit.window_ms, t.config_burst())
    );
    let _ = writeln!(text, "  before     {}", before.as_deref().unwrap_or("none"));
    if !changed {
        text.push_str("  nothing to change: the override is already this\n");
    }
    let mut json = t.json();
    json["action"] = json!("set");
    json["value"] = json!(value);
    json["quota"] = quota_json(wanted.limit, wanted.window_ms, wanted.burst);
    json["ttl_ms"] = json!(ttl_ms);
    json["before"] = json!(before);
    json["changed"] = json!(changed);
    Ok(Report { text, json })
}

/// The override `set` asks for, checked as the script will read it.
fn wanted(t: &Target<'_>, a: &Args) -> Result<Override, AdminError> {
    let number = |name: &str, v: &str| -> Result<u64, AdminError> {
        v.parse::<u64>()
            .ok()
            .filter(|n| (1..=OVERRIDE_MAX_LIMIT).contains(n))
            .ok_or_else(|| {
                AdminError::Usage(format!(
                    "{name} {v:?} is not a whole number from 1 to {OVERRIDE_MAX_LIMIT}"
                ))
            })
    };
    let limit = number("--quota", a.required("--quota")?)?;
    let window_ms = match a.value("--window")? {
        None => t.limit.window_ms,
        Some(w) => parse_duration_ms(w).ok_or_else(|| {
            AdminError::Usage(format!(
                "--window {w:?} is not a duration (e.g. \"250ms\", \"1m\", \"1h\")"
            ))
        })?,
    };
    if window_ms > OVERRIDE_MAX_WINDOW_MS {
        return Err(AdminError::Usage(format!(
            "--window {} is longer than an override may be ({})",
            show::duration(window_ms),
            show::duration(OVERRIDE_MAX_WINDOW_MS)
        )));
    }
    let token_bucket = t.limit.algorithm == Algorithm::TokenBucket;
    let burst = match a.value("--burst")? {
        Some(_) if !token_bucket => {
            return Err(AdminError::Usage(format!(
                "--burst only applies to a token_bucket limit; {} is not one",
                t.limit.name
            )))
        }
        Some(b) => Some(number("--burst", b)?),
        None => None,
    };
    if token_bucket && window_ms < limit {
        return Err(AdminError::Usage(format!(
            "a token bucket needs --window of at least --quota milliseconds ({limit}ms)"
        )));
    }
    let wanted = Override {
        limit,
        window_ms,
        burst,
    };
    // What the script reads back is what was asked for.
    match Override::read(wanted.text().as_bytes(), token_bucket) {
        Some(read) if read == wanted => Ok(wanted),
        _ => Err(AdminError::Usage(format!(
            "{} is not an override the filter reads",
            wanted.text()
        ))),
    }
}

fn clear(ctx: &mut Context, rest: &[String]) -> Result<Report, AdminError> {
    let a = Args::parse(
        rest,
        &["--policy", "--limit", "--tenant", "--principal"],
        &[],
    )?;
    let t = Target::read(&ctx.config, &a)?;
    let before = get(&mut ctx.client, &t.key)?;
    let deleted = int(&mut ctx.client, &[b"DEL", t.key.as_bytes()])? == 1;
    if deleted {
        ctx.log_change(
            "override clear",
            &t.key,
            before.as_deref().unwrap_or("absent"),
        );
    }
    let unindexed = int(
        &mut ctx.client,
        &[b"SREM", t.index.as_bytes(), t.key.as_bytes()],
    )? == 1;
    if unindexed && !deleted {
        ctx.log_change("override unindex", &t.key, "in the index, expired");
    }
    let changed = deleted || unindexed;
    let mut text = format!("override clear: {}\n", t.describe());
    let _ = writeln!(text, "  key        {}", t.key);
    let _ = writeln!(text, "  before     {}", before.as_deref().unwrap_or("none"));
    let _ = writeln!(
        text,
        "  now        the configuration's: {}",
        show::quota(t.limit.limit, t.limit.window_ms, t.config_burst())
    );
    if !changed {
        text.push_str("  nothing to change: there is no override\n");
    }
    let mut json = t.json();
    json["action"] = json!("clear");
    json["before"] = json!(before);
    json["changed"] = json!(changed);
    Ok(Report { text, json })
}

fn list(ctx: &mut Context, rest: &[String]) -> Result<Report, AdminError> {
    let a = Args::parse(rest, &["--policy", "--tenant", "--principal"], &[])?;
    let (_, policy) = policy_named(&ctx.config, a.required("--policy")?)?;
    let tenant = a.required("--tenant")?.to_string();
    // Principals the caller names, to show by name rather than by hash.
    let named: Vec<(String, &str)> = a
        .values("--principal")
        .map(|p| (format!("p.{}", keys::principal_hash(p)), p))
        .collect();
    let prefix = ctx.config.redis.key_prefix.clone();
    let tag = keys::tenant_tag(&tenant);
    let index = keys::override_index_key(&prefix, &tag, &policy.name);
    // Every override key of this tenant's policy starts so: `<limit>:<who>` follows.
    let stem = keys::override_key(&prefix, &tag, &policy.name, "", None);
    let stem = stem.strip_suffix(":t").unwrap_or(&stem).to_string();
    let members = match ctx.client.call(&[b"SMEMBERS", index.as_bytes()])? {
        Reply::Array(Some(items)) => items,
        other => return Err(unexpected("SMEMBERS", &other)),
    };
    let mut members: Vec<String> = members
        .iter()
        .filter_map(|m| m.as_bytes())
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    members.sort();

    let mut text = format!(
        "overrides: policy {}, tenant {tenant:?}\n  index {index}\n",
        policy.name
    );
    let mut entries = Vec::new();
    for member in &members {
        let (limit_name, who) = member
            .strip_prefix(&stem)
            .and_then(|rest| rest.rsplit_once(':'))
            .unwrap_or(("?", "?"));
        let limit = policy.rate_limits.iter().find(|l| l.name == limit_name);
        let who_text = match who {
            "t" => "the tenant".to_string(),
            p => match named.iter().find(|(h, _)| h == p) {
                Some((_, name)) => format!("principal {name:?}"),
                None => format!("principal {p}"),
            },
        };
        let value = get(&mut ctx.client, member)?;
        let pttl = int(&mut ctx.client, &[b"PTTL", member.as_bytes()])?;
        let mut entry = json!({
            "key": member,
            "limit": limit_name,
            "who": who,
            "value": value,
        });
        let state = match &value {
            None => {
                // Expired (or deleted by hand): no longer an override; out of the index.
                if int(
                    &mut ctx.client,
                    &[b"SREM", index.as_bytes(), member.as_bytes()],
                )? == 1
                {
                    ctx.log_change("override unindex", member, "in the index, expired");
                }
                entry["state"] = json!("expired");
                "expired (taken out of the index)".to_string()
            }
            Some(v) => {
                let token_bucket = limit.is_some_and(|l| l.algorithm == Algorithm::TokenBucket);
                let read = Override::read(v.as_bytes(), token_bucket);
                entry["ttl_ms"] = json!((pttl >= 0).then_some(pttl));
                match (read, limit) {
                    (_, None) => {
                        entry["state"] = json!("no such limit");
                        format!("{v}: the configuration has no limit {limit_name:?}")
                    }
                    (_, Some(l)) if !l.overrides => {
                        entry["state"] = json!("not read");
                        format!("{v}: not read (the limit's overrides are off)")
                    }
                    (None, Some(_)) => {
                        entry["state"] = json!("unreadable");
                        format!("{v:?}: unreadable, ignored (the configuration's applies)")
                    }
                    (Some(o), Some(_)) => {
                        entry["state"] = json!("active");
                        entry["quota"] = quota_json(o.limit, o.window_ms, o.burst);
                        format!(
                            "{}{}",
                            show::quota(o.limit, o.window_ms, o.burst),
                            if pttl >= 0 {
                                format!(", expires in {}", show::duration(pttl.unsigned_abs()))
                            } else {
                                String::new()
                            }
                        )
                    }
                }
            }
        };
        let _ = writeln!(
            text,
            "  limit {limit_name}, for {who_text}: {state}\n    key {member}"
        );
        entries.push(entry);
    }
    if members.is_empty() {
        text.push_str("  no overrides\n");
    }
    let configured: Vec<Value> = policy
        .rate_limits
        .iter()
        .filter(|l| l.overrides)
        .map(|l| {
            let burst = (l.algorithm == Algorithm::TokenBucket).then_some(l.burst);
            let _ = writeln!(
                text,
                "  limit {}, configured: {}",
                l.name,
                show::quota(l.limit, l.window_ms, burst)
            );
            json!({"limit": l.name, "quota": quota_json(l.limit, l.window_ms, burst)})
        })
        .collect();
    if configured.is_empty() {
        text.push_str("  no limit of this policy reads overrides (overrides: true)\n");
    }
    let json = json!({
        "action": "list",
        "policy": policy.name,
        "tenant": tenant,
        "index": index,
        "overrides": entries,
        "configured": configured,
    });
    Ok(Report { text, json })
}

fn listed(names: &[&str]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// A string key's value (`None`: absent), as text.
fn get(client: &mut Client, key: &str) -> Result<Option<String>, AdminError> {
    match client.call(&[b"GET", key.as_bytes()])? {
        Reply::Bulk(None) => Ok(None),
        Reply::Bulk(Some(b)) => Ok(Some(String::from_utf8_lossy(&b).into_owned())),
        other => Err(unexpected("GET", &other)),
    }
}

fn int(client: &mut Client, words: &[&[u8]]) -> Result<i64, AdminError> {
    match client.call(words)? {
        Reply::Int(n) => Ok(n),
        other => Err(unexpected(&String::from_utf8_lossy(words[0]), &other)),
    }
}

fn expect_ok(reply: Reply) -> Result<(), AdminError> {
    match reply {
        Reply::Status(s) if s == "OK" => Ok(()),
        other => Err(unexpected("SET", &other)),
    }
}

fn unexpected(command: &str, reply: &Reply) -> AdminError {
    AdminError::Redis(ClientError::Protocol(format!(
        "an unexpected answer to {command}: {reply:?}"
    )))
}

fn quota_json(limit: u64, window_ms: u64, burst: Option<u64>) -> Value {
    json!({"limit": limit, "window_ms": window_ms, "burst": burst})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::client::Target as RedisTarget;

    /// A context whose client is never reached: what is checked before any Redis call.
    fn context() -> Context {
        let config = Config::parse(
            br#"{"redis": {"cluster": "gw", "key_prefix": "cg:demo"}, "policies": [
            {"name": "create-order", "rate_limits": [
              {"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100, "window": "1m", "overrides": true},
              {"name": "user", "by": ["tenant", "principal"], "algorithm": "token_bucket", "limit": 10, "window": "1s", "burst": 20, "overrides": true},
              {"name": "plain", "by": ["tenant"], "algorithm": "sliding_window", "limit": 5, "window": "1s"}
            ]}]}"#,
        )
        .expect("valid");
        Context {
            config,
            client: Client::new(RedisTarget::from_url("redis://127.0.0.1:1").expect("url")),
            actor: "test".into(),
        }
    }

    fn run_words(ctx: &mut Context, words: &[&str]) -> Result<Report, AdminError> {
        let args: Vec<String> = words.iter().map(|w| w.to_string()).collect();
        run(ctx, &args)
    }

    fn refused(words: &[&str]) -> AdminError {
        run_words(&mut context(), words).expect_err("refused before Redis")
    }

    #[test]
    fn what_is_refused_names_the_field_to_set() {
        let e = refused(&[
            "set",
            "--policy",
            "create-order",
            "--limit",
            "plain",
            "--tenant",
            "acme",
            "--quota",
            "5",
        ]);
        assert_eq!(
            e,
            AdminError::Refused(
                "limit \"plain\" of policy \"create-order\" does not read overrides: set \
                 policies[0].rate_limits[2].overrides to true in the plugin configuration and \
                 roll it out first"
                    .into()
            )
        );
        let e = refused(&[
            "clear",
            "--policy",
            "create-order",
            "--limit",
            "tenant",
            "--tenant",
            "acme",
            "--principal",
            "alice",
        ]);
        assert!(
            matches!(&e, AdminError::Refused(m) if m.contains("policies[0].rate_limits[0].by")),
            "{e}"
        );
    }

    #[test]
    fn bad_quotas_are_usage_errors() {
        let base = [
            "set",
            "--policy",
            "create-order",
            "--tenant",
            "acme",
            "--limit",
        ];
        let cases: [(&[&str], &str); 9] = [
            (
                &["tenant", "--quota", "0"],
                "--quota \"0\" is not a whole number",
            ),
            (
                &["tenant", "--quota", "2000000000"],
                "--quota \"2000000000\"",
            ),
            (
                &["tenant", "--quota", "5", "--window", "5x"],
                "--window \"5x\"",
            ),
            (
                &["tenant", "--quota", "5", "--window", "101d"],
                "longer than an override",
            ),
            (
                &["tenant", "--quota", "5", "--burst", "9"],
                "--burst only applies",
            ),
            (
                &["user", "--quota", "5000", "--window", "1s"],
                "at least --quota",
            ),
            (
                &["tenant", "--quota", "5", "--ttl", "soon"],
                "--ttl \"soon\"",
            ),
            (
                &["nope", "--quota", "5"],
                "has no limit \"nope\"; its limits: tenant, user, plain",
            ),
            (&["tenant"], "--quota is required"),
        ];
        for (more, want) in cases {
            let words: Vec<&str> = base.iter().chain(more).copied().collect();
            let e = refused(&words);
            assert!(
                matches!(&e, AdminError::Usage(m) if m.contains(want)),
                "{words:?}: {e}"
            );
        }
        let e = refused(&["list", "--policy", "nope", "--tenant", "acme"]);
        assert!(
            e.to_string().contains("the policies are create-order"),
            "{e}"
        );
        assert!(matches!(refused(&["sett"]), AdminError::Usage(_)));
        assert!(matches!(refused(&[]), AdminError::Usage(_)));
    }

    #[test]
    fn durations_read_back() {
        assert_eq!(show::duration(86_400_000), "1d");
        assert_eq!(show::duration(90_000), "90s");
        assert_eq!(show::duration(250), "250ms");
        assert_eq!(show::quota(6, 60_000, Some(3)), "6 per 1m, burst 3");
    }
}
