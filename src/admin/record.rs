//! `cg-admin record`: an idempotency record, found by its policy, tenant and Idempotency-Key
//! as the filter keys it; `--delete` removes it, a `PROCESSING` one only with `--force`.

use crate::admin::args::Args;
use crate::admin::request::{identity_json, shown_identity, Described, Filter, REQUEST_OPTIONS};
use crate::admin::show::{self, rows};
use crate::admin::{redis_time_ms, AdminError, Context, Report};
use crate::config::Idempotency;
use crate::guards::idempotency::guard::record_key;
use crate::guards::idempotency::header::parse_key;
use crate::guards::idempotency::record::{Record, RecordResponse, State};
use crate::guards::idempotency::seal::record_aad;
use crate::redis::keys::tenant_tag;
use crate::redis::resp::Reply;
use serde_json::{json, Value};
use std::fmt::Write;

/// Deletes the record only if it still holds what was read: a record that changed in between
/// (completed, or taken again) is left alone.
const DELETE_IF_UNCHANGED: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

pub(crate) fn run(ctx: &mut Context, args: &[String]) -> Result<Report, AdminError> {
    let a = Args::parse(args, &REQUEST_OPTIONS, &["--delete", "--force"])?;
    if a.flag("--force") && !a.flag("--delete") {
        return Err(AdminError::Usage("--force goes with --delete".into()));
    }
    a.required("--idempotency-key")?;
    // The request's method defaults to one the record is kept for.
    let d = Described::new(&ctx.config, &a, |p| {
        p.idempotency
            .as_ref()
            .and_then(|i| i.methods.first().cloned())
    })?;
    let (index, policy) = d.guarded(&ctx.config)?;
    let Some(cfg) = policy.idempotency.clone() else {
        return Err(AdminError::Usage(format!(
            "policy {:?} keeps no idempotency records",
            policy.name
        )));
    };
    if !cfg.applies_to(&d.req.method) {
        return Err(AdminError::Usage(format!(
            "policy {:?} keeps records for {} only, not {}",
            policy.name,
            cfg.methods.join(", "),
            d.req.method
        )));
    }
    let filter = Filter::new(&ctx.config);
    let caller = d.caller(&filter, index)?.clone();
    let values: Vec<&str> = d.req.headers.values(&cfg.header).collect();
    let client_key = parse_key(&values)
        .map_err(|e| AdminError::Usage(format!("--idempotency-key: {}", e.detail(&cfg.header))))?;
    let prefix = ctx.config.redis.key_prefix.clone();
    let policy_name = policy.name.clone();
    let (key, key_hash) = record_key(
        &prefix,
        &tenant_tag(&caller.tenant),
        &policy_name,
        &client_key,
    );

    let found = read(ctx, &key)?;
    let now_ms = redis_time_ms(&mut ctx.client)?;
    let facts = Facts::of(&found, &key, &cfg, now_ms);
    let mut text = format!(
        "policy {policy_name}, tenant {}, key hash {key_hash}\n",
        shown_identity(&caller.tenant)
    );
    rows(&mut text, 2, &facts.rows(&key));
    let mut json = json!({
        "policy": policy_name,
        "tenant": identity_json(&caller.tenant),
        "key": key,
        "key_hash": key_hash,
    });
    facts.add_json(&mut json);
    if a.flag("--delete") {
        delete(
            ctx,
            &key,
            &found,
            &facts,
            a.flag("--force"),
            &mut text,
            &mut json,
        )?;
    }
    Ok(Report { text, json })
}

/// What the key holds.
enum Found {
    Absent,
    /// A string value, and its PTTL.
    Value(Vec<u8>, i64),
    /// Another type (the filter reads it as an unreadable record), and its PTTL.
    Other(String, i64),
}

fn read(ctx: &mut Context, key: &str) -> Result<Found, AdminError> {
    let kind = ctx.client.call(&[b"TYPE", key.as_bytes()])?;
    let kind = kind
        .as_bytes()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_default();
    if kind == "none" {
        return Ok(Found::Absent);
    }
    let pttl = ctx
        .client
        .call(&[b"PTTL", key.as_bytes()])?
        .as_int()
        .unwrap_or(-2);
    if kind != "string" {
        return Ok(Found::Other(kind, pttl));
    }
    match ctx.client.call(&[b"GET", key.as_bytes()])? {
        Reply::Bulk(Some(v)) => Ok(Found::Value(v, pttl)),
        _ => Ok(Found::Absent),
    }
}

/// What the record says, as the tool shows it.
#[derive(Default)]
struct Facts {
    exists: bool,
    state: Option<&'static str>,
    record: Option<Record>,
    ttl_ms: Option<i64>,
    state_ttl_ms: Option<u64>,
    age_ms: Option<i64>,
    updated_ms: Option<i64>,
    status: Option<u16>,
    sealed: bool,
    opened: Option<bool>,
    reference: bool,
    unreadable: Option<String>,
}

impl Facts {
    fn of(found: &Found, key: &str, cfg: &Idempotency, now_ms: i64) -> Facts {
        let mut f = Facts::default();
        let (bytes, pttl) = match found {
            Found::Absent => return f,
            Found::Other(kind, pttl) => {
                f.exists = true;
                f.ttl_ms = Some(*pttl);
                f.state = Some("UNREADABLE");
                f.unreadable = Some(format!("a Redis {kind}, not a string"));
                return f;
            }
            Found::Value(bytes, pttl) => (bytes, *pttl),
        };
        f.exists = true;
        f.ttl_ms = Some(pttl);
        let Some(record) = Record::parse(bytes) else {
            f.state = Some("UNREADABLE");
            f.unreadable = Some("not a record the filter can read".into());
            return f;
        };
        let age = |at: u64| now_ms.saturating_sub(i64::try_from(at).unwrap_or(i64::MAX));
        f.age_ms = Some(age(record.created_ms));
        f.updated_ms = Some(age(record.updated_ms));
        match record.state {
            State::Processing => {
                f.state = Some("PROCESSING");
                f.state_ttl_ms = Some(cfg.processing_ttl_ms);
            }
            State::Completed => {
                f.state = Some("COMPLETED");
                f.state_ttl_ms = Some(cfg.completed_ttl_ms);
            }
        }
        match &record.response {
            Some(RecordResponse::Plain(stored)) => {
                f.status = Some(stored.status);
                f.reference = stored.reference;
            }
            Some(sealed @ RecordResponse::Sealed { .. }) => {
                f.sealed = true;
                let aad = record_aad(key, &record.fingerprint);
                match sealed.clone().open(cfg.encryption.as_ref(), &aad) {
                    Ok(stored) => {
                        f.opened = Some(true);
                        f.status = Some(stored.status);
                        f.reference = stored.reference;
                    }
                    Err(_) => f.opened = Some(false),
                }
            }
            None => {}
        }
        f.record = Some(record);
        f
    }

    fn rows(&self, key: &str) -> Vec<(&'static str, String)> {
        let mut out = vec![("key", key.to_string())];
        if !self.exists {
            out.push(("state", "none: no record under this key".into()));
            return out;
        }
        out.push(("state", self.state.unwrap_or_default().to_string()));
        if let Some(why) = &self.unreadable {
            out.push(("unreadable", why.clone()));
        }
        if let Some(age) = self.age_ms {
            let updated = self.updated_ms.unwrap_or(age);
            let mut line = format!("{} (created)", show::span(age));
            if updated != age {
                let _ = write!(line, ", updated {} ago", show::span(updated));
            }
            out.push(("age", line));
        }
        if let Some(ttl) = self.ttl_ms {
            let mut line = match ttl {
                -1 => "none (the key has no TTL)".to_string(),
                t => format!("{} left", show::span(t)),
            };
            if let Some(of) = self.state_ttl_ms {
                let _ = write!(line, " of {}", show::duration(of));
            }
            out.push(("ttl", line));
        }
        if let Some(r) = &self.record {
            out.push(("fingerprint", show::fingerprint_prefix(&r.fingerprint)));
            if let Some(owner) = &r.owner {
                out.push(("owner", owner.clone()));
            }
        }
        if self.state == Some("COMPLETED") {
            let status = match (self.status, self.opened) {
                (Some(s), _) => s.to_string(),
                (None, Some(false)) => "unknown: sealed, and the record key to open it is not \
                                        this tool's (set the variable the configuration names)"
                    .to_string(),
                (None, _) => "unknown".to_string(),
            };
            out.push(("status", status));
            out.push(("sealed", if self.sealed { "yes" } else { "no" }.to_string()));
            if self.reference {
                out.push((
                    "stored",
                    "by reference: the body was not kept (replayed as a problem)".to_string(),
                ));
            }
        }
        out
    }

    fn add_json(&self, json: &mut Value) {
        json["exists"] = json!(self.exists);
        json["state"] = json!(self.state);
        json["ttl_ms"] = json!(self.ttl_ms);
        json["state_ttl_ms"] = json!(self.state_ttl_ms);
        json["age_ms"] = json!(self.age_ms);
        json["updated_ago_ms"] = json!(self.updated_ms);
        json["fingerprint"] = json!(self
            .record
            .as_ref()
            .map(|r| show::fingerprint_prefix(&r.fingerprint)));
        json["owner"] = json!(self.record.as_ref().and_then(|r| r.owner.clone()));
        json["status"] = json!(self.status);
        json["sealed"] = json!(self.sealed);
        json["by_reference"] = json!(self.reference);
        json["unreadable"] = json!(self.unreadable);
    }
}

/// `--delete`: removes the record it read, unless it is `PROCESSING` (then only with
/// `--force`) or changed since.
fn delete(
    ctx: &mut Context,
    key: &str,
    found: &Found,
    facts: &Facts,
    force: bool,
    text: &mut String,
    json: &mut Value,
) -> Result<(), AdminError> {
    let before = match facts.state {
        None => {
            text.push_str("nothing to delete: no record under this key\n");
            json["deleted"] = json!(false);
            return Ok(());
        }
        Some(state) => {
            let mut b = state.to_string();
            if let Some(age) = facts.age_ms {
                let _ = write!(b, ", created {} ago", show::span(age));
            }
            if let Some(r) = &facts.record {
                let _ = write!(
                    b,
                    ", fingerprint {}",
                    show::fingerprint_prefix(&r.fingerprint)
                );
            }
            if let Some(ttl) = facts.ttl_ms {
                let _ = write!(b, ", ttl {}", show::span(ttl));
            }
            b
        }
    };
    if facts.state == Some("PROCESSING") && !force {
        return Err(AdminError::Refused(format!(
            "the record {key} is PROCESSING: the request that holds it may still be running, and \
             deleting it lets a retry run the operation again beside it; give --force to \
             delete it anyway"
        )));
    }
    let deleted = match found {
        Found::Value(bytes, _) => ctx.client.call(&[
            b"EVAL",
            DELETE_IF_UNCHANGED.as_bytes(),
            b"1",
            key.as_bytes(),
            bytes,
        ])?,
        _ => ctx.client.call(&[b"DEL", key.as_bytes()])?,
    };
    if !matches!(deleted, Reply::Int(1)) {
        return Err(AdminError::Refused(format!(
            "the record {key} changed while it was read; nothing deleted: run the command again"
        )));
    }
    ctx.log_change("delete", key, &before);
    let _ = writeln!(text, "deleted {key}");
    json["deleted"] = json!(true);
    Ok(())
}
