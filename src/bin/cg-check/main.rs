//! `cg-check FILE`: checks a plugin configuration with the filter's own validation, without
//! Envoy, in any of the shapes a user deploys it in ([`coordination_guard::config::manifest`]): the
//! plugin JSON, an Istio `WasmPlugin` (its `spec.pluginConfig`), or an Envoy config (every Wasm
//! filter of this module in it, an `EnvoyFilter`'s patches too), YAML or JSON, one document or
//! several. Each plugin found is checked and summarised under a header naming where it is.
//!
//! Exit 0 with a one-screen summary per plugin; 1 when one is invalid, with the error the
//! filter would log (the field path and the problem); 2 when the file cannot be read, holds no
//! plugin of this module, or holds only a template's placeholder.
//!
//! The VM's environment: a variable the file declares with its value (`vmConfig.env` `value`,
//! `key_values`) is checked with it; one taken from the proxy's environment (`valueFrom:
//! HOST`, `host_env_keys`), or any with the plugin JSON, is taken as set and well formed, and
//! the summary says so. A variable that `redis.authorization_env` or an `encryption` key names
//! but a WasmPlugin or Envoy config does not declare is warned about: the VM will not have it.
//!
//! The file around the configuration is warned about too ([`Plugin::warnings`]): a WasmPlugin
//! that would also guard the workload's outbound calls (no `match` with a direction), one aimed
//! at a gateway that would never run there, and a module digest that is the placeholder of
//! zeros. Warnings go to stderr and leave the exit status as it is.
//!
//! A calendar-aligned limit's zone names its POSIX TZ rule, which the filter computes periods
//! with (it has no time-zone database): `cg-check --zone NAME` prints `{"name", "rule"}` for a
//! zone of the machine's tzdata, a check warns when a configured rule is not the one the
//! machine's tzdata gives for its name, and an error for a bare zone name shows the object.
//!
//! [`Plugin::warnings`]: coordination_guard::config::manifest::Plugin::warnings

// cargo builds every binary for the filter's target too: there this one only says where it runs.
#![cfg_attr(target_arch = "wasm32", allow(dead_code, unused_imports))]

use coordination_guard::config::{
    Algorithm, ChargeSource, Completion, Config, FailureMode, Fallback, FingerprintPart,
    MissingTenant, OnBusy, RateLimit, Replay, Selector, QUOTA_EXCEEDED,
};
use coordination_guard::redis::keys;
use serde_json::Value;
use std::fmt::Write;
use std::process::ExitCode;

#[cfg(target_arch = "wasm32")]
fn main() -> ExitCode {
    eprintln!("cg-check runs on the host: cargo run --bin cg-check -- FILE");
    ExitCode::from(2)
}

#[cfg(not(target_arch = "wasm32"))]
fn main() -> ExitCode {
    use coordination_guard::config::manifest::{self, Configuration};

    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, name] = args.as_slice() {
        if flag == "--zone" {
            return zone(name);
        }
    }
    let [path] = args.as_slice() else {
        eprintln!(
            "usage: cg-check FILE   (the plugin JSON, a WasmPlugin YAML, or an Envoy config YAML)\n       \
             cg-check --zone NAME   (a calendar limit's zone, from this machine's tzdata)"
        );
        return ExitCode::from(2);
    };
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("cg-check: cannot read {path}: {e}");
            return ExitCode::from(2);
        }
    };
    let found = match manifest::read(&bytes) {
        Ok(found) => found,
        // Neither JSON nor YAML, or no plugin of this module: the message says which.
        Err(e) => {
            eprintln!("cg-check: {path}: {e}");
            return ExitCode::from(2);
        }
    };
    for skipped in &found.skipped {
        eprintln!("{path}: skipped {skipped}: not {}", manifest::ROOT_ID);
    }
    let (mut invalid, mut unchecked) = (false, false);
    for (i, plugin) in found.plugins.iter().enumerate() {
        let at = if plugin.location.is_empty() {
            path.clone()
        } else {
            format!("{path}: {}", plugin.location)
        };
        if i > 0 {
            println!();
        }
        let env = Environment(plugin.env.as_ref());
        match &plugin.configuration {
            Configuration::Bytes(bytes) => match check(bytes, &env) {
                Ok((summary, warnings)) => {
                    print!("{at}: valid\n{summary}");
                    for w in warnings {
                        eprintln!("{at}: warning: {w}");
                    }
                }
                Err(error) => {
                    eprintln!("{at}: invalid plugin configuration: {error}");
                    invalid = true;
                }
            },
            Configuration::Unreadable(why) => {
                eprintln!("{at}: invalid plugin configuration: {why}");
                invalid = true;
            }
            Configuration::Placeholder(name) => {
                eprintln!(
                    "{at}: not checked: its configuration is the template placeholder {name}; \
                     check the rendered file (make demo-config writes build/demo.yaml) or the \
                     plugin JSON"
                );
                unchecked = true;
            }
        }
        for w in &plugin.warnings {
            eprintln!("{at}: warning: {w}");
        }
    }
    match (invalid, unchecked) {
        (true, _) => ExitCode::from(1),
        (false, true) => ExitCode::from(2),
        (false, false) => ExitCode::SUCCESS,
    }
}

/// `cg-check --zone NAME`: the zone object for a calendar-aligned limit, `{"name", "rule"}`,
/// from this machine's tzdata. Exit 0; 1 when the filter would refuse the rule; 2 when the
/// machine has no such zone.
#[cfg(not(target_arch = "wasm32"))]
fn zone(name: &str) -> ExitCode {
    match zoneinfo::rule(name) {
        Err(why) => {
            eprintln!("cg-check: no zone {name}: {why}");
            ExitCode::from(2)
        }
        Ok(rule) => match coordination_guard::config::posix_rule(&rule) {
            Err(why) => {
                eprintln!("cg-check: {name}: the rule {rule:?} is not one the filter reads: {why}");
                ExitCode::from(1)
            }
            Ok(_) => {
                println!("{}", zoneinfo::zone_json(name, &rule));
                ExitCode::SUCCESS
            }
        },
    }
}

/// What every variable the file does not give a value of is taken to hold: valid as a
/// credential and as a record key (base64 of 32 bytes).
const STAND_IN: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

/// The Wasm VM's environment as the file declares it; `None`: the file says nothing of it
/// (the plugin JSON).
#[cfg(not(target_arch = "wasm32"))]
struct Environment<'a>(Option<&'a coordination_guard::config::manifest::VmEnv>);

#[cfg(not(target_arch = "wasm32"))]
impl Environment<'_> {
    /// What the filter would find in the variable (the stand-in when it is not in the file).
    fn value(&self, name: &str) -> String {
        use coordination_guard::config::manifest::EnvValue;
        match self.0.and_then(|env| env.vars.get(name)) {
            Some(EnvValue::Inline(v)) => v.clone(),
            _ => STAND_IN.to_string(),
        }
    }

    /// How the summary qualifies the variable.
    fn origin(&self, name: &str) -> String {
        use coordination_guard::config::manifest::EnvValue;
        match self.0 {
            None => "(not checked here)".into(),
            Some(env) => match env.vars.get(name) {
                Some(EnvValue::Host) => "(from the proxy's environment, not checked here)".into(),
                Some(EnvValue::Inline(_)) => format!(
                    "(its value inline in {}, checked; a secret there is visible in the config)",
                    env.declared_in
                ),
                None => format!("(not declared in {})", env.declared_in),
            },
        }
    }

    /// Warnings for the variables `raw` names that the file does not declare.
    fn warnings(&self, raw: &Value) -> Vec<String> {
        let Some(env) = self.0 else {
            return Vec::new();
        };
        coordination_guard::config::manifest::env_references(raw)
            .into_iter()
            .filter(|(_, name)| !env.vars.contains_key(name))
            .map(|(field, name)| {
                format!(
                    "{field} names {name}, which {} does not declare: the Wasm VM will not \
                     have it, and the filter will refuse its configuration",
                    env.declared_in
                )
            })
            .collect()
    }
}

/// The summary of a valid configuration and its warnings, or the filter's error line.
#[cfg(not(target_arch = "wasm32"))]
fn check(bytes: &[u8], env: &Environment<'_>) -> Result<(String, Vec<String>), String> {
    // Valid JSON, or the filter would refuse it: the variables' and zones' names are read there.
    let raw: Value = serde_json::from_slice(bytes).unwrap_or_default();
    let config = Config::parse_with_env(bytes, &|name| Some(env.value(name)))
        .map_err(|e| with_zone_hint(e, &raw))?;
    let env_name = |pointer: &str| raw.pointer(pointer).and_then(Value::as_str);
    let credential = match (
        env_name("/redis/authorization_env"),
        &config.redis.authorization,
    ) {
        (Some(name), _) => format!("from ${name} in the VM's environment {}", env.origin(name)),
        (None, Some(_)) => "inline (shown in /config_dump: prefer authorization_env)".into(),
        (None, None) => "none (webdis must allow anonymous EVAL: do not)".into(),
    };
    let sealing: Vec<Option<String>> = (0..config.policies.len())
        .map(|i| {
            let at = format!("/policies/{i}/idempotency/encryption");
            let current = env_name(&format!("{at}/key_env"))?;
            let origin = env.origin(current);
            let keys = match env_name(&format!("{at}/previous_key_env")) {
                None => format!("${current} {origin}"),
                Some(p) if env.origin(p) == origin => {
                    format!("${current}, opened also with ${p} {origin}")
                }
                Some(p) => format!(
                    "${current} {origin}, opened also with ${p} {}",
                    env.origin(p)
                ),
            };
            Some(format!(
                "responses sealed (AES-256-GCM) with the key in {keys}"
            ))
        })
        .collect();
    let mut warnings = env.warnings(&raw);
    warnings.extend(self_declared_costs(&config));
    warnings.extend(streams_cut_for_less(&config));
    warnings.extend(zone_rules(&config));
    Ok((describe(&config, &credential, &sealing), warnings))
}

/// The filter's error, and for a zone given by its bare name the object to write instead when
/// this machine's tzdata has the zone.
fn with_zone_hint(e: coordination_guard::config::ConfigError, raw: &Value) -> String {
    let mut text = e.to_string();
    if e.path.ends_with(".zone") {
        // policies[1].rate_limits[0].zone -> /policies/1/rate_limits/0/zone
        let pointer = format!(
            "/{}",
            e.path
                .replace('[', "/")
                .replace("].", "/")
                .replace('.', "/")
        );
        if let Some(name) = raw.pointer(&pointer).and_then(Value::as_str) {
            if let Ok(rule) = zoneinfo::rule(name) {
                let _ = write!(
                    text,
                    "\n  this machine's tzdata gives: \"zone\": {}",
                    zoneinfo::zone_json(name, &rule)
                );
            }
        }
    }
    text
}

/// A calendar limit whose zone's rule is not the one this machine's tzdata gives for its name:
/// the periods follow the configuration's rule, which may be out of date (or the machine's).
fn zone_rules(c: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for (i, p) in c.policies.iter().enumerate() {
        for (j, l) in p.rate_limits.iter().enumerate() {
            let Some(zone) = l.calendar.as_ref().map(|c| &c.zone) else {
                continue;
            };
            let (Some(rule), Ok(here)) = (&zone.rule, zoneinfo::rule(&zone.name)) else {
                continue;
            };
            if *rule != here {
                out.push(format!(
                    "policies[{i}].rate_limits[{j}].zone ({}/{}): the rule {rule:?} is not the \
                     one this machine's tzdata gives for {}, {here:?}: the periods follow the \
                     configuration's; if the zone's rules changed, write \"zone\": {}",
                    p.name,
                    l.name,
                    zone.name,
                    zoneinfo::zone_json(&zone.name, &here)
                ));
            }
        }
    }
    out
}

/// A limit whose cost the client declares (`cost`) and nothing corrects (no `charge`): the
/// client pays what it says, so it can always say `min`.
fn self_declared_costs(c: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for (i, p) in c.policies.iter().enumerate() {
        for (j, l) in p.rate_limits.iter().enumerate() {
            if let (Some(cost), None) = (&l.cost, &l.charge) {
                out.push(format!(
                    "policies[{i}].rate_limits[{j}] ({}/{}): the client declares its own cost in \
                     {} and no charge corrects it, so a client pays what it says (at least min, \
                     {}): add a charge read from the response, or let a layer the client cannot \
                     bypass set {}",
                    p.name, l.name, cost.header, cost.min, cost.header
                ));
            }
        }
    }
    out
}

/// A limit charged from an event stream whose stream without usage is charged the admitted
/// cost (`missing: cost`, the default): a client that leaves before the usage event pays only
/// that, which it declares itself (`cost`) or which is 1 unit (no `cost`).
fn streams_cut_for_less(c: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for (i, p) in c.policies.iter().enumerate() {
        for (j, l) in p.rate_limits.iter().enumerate() {
            let Some(ChargeSource::SseJson {
                missing: Fallback::Cost,
                ..
            }) = l.charge.as_ref().map(|c| &c.source)
            else {
                continue;
            };
            let admitted = match &l.cost {
                Some(cost) => format!(
                    "which the client declares in {} (at least min, {})",
                    cost.header, cost.min
                ),
                None => "1 unit (no cost is set)".to_string(),
            };
            out.push(format!(
                "policies[{i}].rate_limits[{j}] ({}/{}): an event stream that ends before its \
                 usage (the client left) is charged the admitted cost, {admitted}: set \
                 charge.missing to \"max\" or a number of units if a client could leave early \
                 to pay less",
                p.name, l.name
            ));
        }
    }
    out
}

fn mode(m: FailureMode) -> &'static str {
    match m {
        FailureMode::Open => "fail_open (forward when Redis cannot answer)",
        FailureMode::Closed => "fail_closed (503 when Redis cannot answer)",
    }
}

fn duration(ms: u64) -> String {
    match ms {
        ms if ms % 86_400_000 == 0 => format!("{}d", ms / 86_400_000),
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
        ms => format!("{ms}ms"),
    }
}

/// What a charge's fallback (`unreadable`, `missing`) charges, in words.
fn fallback(f: Fallback) -> String {
    match f {
        Fallback::Cost => "the admitted cost".to_string(),
        Fallback::Max(n) => format!("{n} (max)"),
        Fallback::Units(n) => n.to_string(),
    }
}

fn limit_line(prefix: &str, policy: &str, l: &RateLimit) -> String {
    let algo = match l.algorithm {
        Algorithm::FixedWindow => "fixed window",
        Algorithm::SlidingWindow => "sliding window",
        Algorithm::SlidingLog => "sliding log",
        Algorithm::TokenBucket => "token bucket",
        Algorithm::Concurrency => "in flight",
    };
    let mut line = if l.concurrency() {
        format!(
            "{} at once by {} ({algo}, a slot lives {} unless extended",
            l.limit,
            Selector::describe_all(&l.by),
            duration(l.window_ms)
        )
    } else if let Some(c) = &l.calendar {
        format!(
            "{} per {} by {} ({algo} from {}",
            l.limit,
            c.describe(),
            Selector::describe_all(&l.by),
            c.period.start_words()
        )
    } else {
        format!(
            "{} per {} by {} ({algo}",
            l.limit,
            duration(l.window_ms),
            Selector::describe_all(&l.by)
        )
    };
    if let Some(c) = &l.cost {
        let _ = write!(
            line,
            ", cost from header {} (default {}, max {})",
            c.header, c.default, c.max
        );
    }
    if let Some(c) = &l.charge {
        match &c.source {
            ChargeSource::Header(h) => {
                let _ = write!(line, ", charged from response header {h}");
            }
            ChargeSource::Trailer(t) => {
                let _ = write!(line, ", charged from trailer {t}");
            }
            ChargeSource::Json { pointer, max_body } => {
                let _ = write!(
                    line,
                    ", charged from the JSON body at {} (up to {max_body} bytes)",
                    pointer.as_str()
                );
            }
            ChargeSource::SseJson {
                pointer,
                max_body,
                missing,
            } => {
                let _ = write!(
                    line,
                    ", charged from the last event of an event stream with a number at {} \
                     (or a JSON answer's, up to {max_body} bytes), a stream without it: {}",
                    pointer.as_str(),
                    fallback(*missing)
                );
            }
        }
        let _ = write!(line, ", unreadable: {}", fallback(c.unreadable));
    }
    if l.algorithm == Algorithm::TokenBucket {
        let _ = write!(line, ", burst {}", l.burst);
    }
    if l.leased {
        line.push_str(", leased slices");
    }
    line.push(')');
    if l.shadow {
        line.push_str(", shadow: counted, never rejects");
    } else {
        // As the RateLimit-Policy header shows it (a token bucket: its burst per the time it
        // takes to fill; a concurrency limit: its slots, no window; a unit in `qu`).
        let _ = write!(line, ", shown as {}", l.policy_item);
    }
    let tag = if l.tenant_scoped() {
        "{t.<tenant>}".to_string()
    } else {
        format!("{{p.{policy}}}")
    };
    let _ = write!(
        line,
        "\n        key {prefix}:rl:{tag}:{policy}:{}:{}:…",
        l.name,
        keys::limit_code(l)
    );
    if l.overrides {
        let principal = if l.per_principal() {
            " (a principal's: …:p.<principal>, first)"
        } else {
            ""
        };
        let _ = write!(
            line,
            "\n        overrides: a tenant's own limit from {prefix}:ovr:{tag}:{policy}:{}:t{principal}, \
             set with cg-admin override",
            l.name
        );
    }
    line
}

/// What the configuration does, on one screen; `sealing` says, per policy, how its stored
/// responses are sealed.
fn describe(c: &Config, credential: &str, sealing: &[Option<String>]) -> String {
    let mut s = String::new();
    let r = &c.redis;
    let _ = writeln!(
        s,
        "redis: cluster {} (authority {}), timeout {}, key prefix {}, credential {}",
        r.cluster,
        r.authority,
        duration(r.timeout_ms),
        r.key_prefix,
        credential
    );
    if let Some(b) = r.batch {
        let _ = writeln!(
            s,
            "  batching: up to {} calls, {} delay, {}",
            b.max_requests,
            duration(b.max_delay_ms),
            if b.cross_slot {
                "across hash slots once a probe shows Redis runs them (not a Redis Cluster)"
            } else {
                "per hash slot"
            }
        );
    } else {
        let _ = writeln!(s, "  batching: off");
    }
    let id = &c.identity;
    let _ = writeln!(
        s,
        "identity: tenant from {}, principal from {}; no tenant: {}",
        id.tenant.describe(),
        id.principal.describe(),
        match id.missing_tenant {
            MissingTenant::Reject => "401",
            MissingTenant::Anonymous => "the anonymous bucket",
        }
    );
    let _ = writeln!(
        s,
        "default: {}; over-limit cache {} slots; RateLimit headers on allowed responses: {}",
        mode(c.failure_mode),
        c.over_limit_cache_entries,
        if c.response_headers { "yes" } else { "no" }
    );
    let _ = writeln!(
        s,
        "memory: {} bytes per worker (memory_budget); Envoy's buffer limit {} bytes",
        c.memory_budget, c.envoy_buffer_limit
    );
    let _ = writeln!(
        s,
        "problems: type {}<name> (problem_type_base), a 429 {}",
        c.problem_type_base, QUOTA_EXCEEDED
    );
    if c.policies.is_empty() {
        s.push_str("no policies: every request passes untouched\n");
    }
    for (i, p) in c.policies.iter().enumerate() {
        let _ = writeln!(s, "policy {} {}: {}", i + 1, p.name, p.matcher.describe());
        let _ = writeln!(s, "    {}", mode(p.failure_mode));
        for l in &p.rate_limits {
            let _ = writeln!(
                s,
                "    limit {}: {}",
                l.name,
                limit_line(&r.key_prefix, &p.name, l)
            );
        }
        if let Some(record) = &p.idempotency {
            let parts: Vec<String> = record
                .fingerprint
                .iter()
                .map(FingerprintPart::spelling)
                .collect();
            let _ = writeln!(
                s,
                "    idempotency: {} on {} ({}), fingerprint {}, processing {}, replayed for {} ({}, {})\n        key {}:idem:{{t.<tenant>}}:{}:<key hash>",
                record.header,
                record.methods.join("|"),
                if record.required { "required" } else { "optional" },
                parts.join(" + "),
                duration(record.processing_ttl_ms),
                duration(record.completed_ttl_ms),
                match record.replay {
                    Replay::Full => "full responses",
                    Replay::Reference => "status and headers",
                },
                match record.complete {
                    Completion::Sync => "written before the response goes out",
                    Completion::Async => "written after the response",
                },
                r.key_prefix,
                p.name
            );
            if let Some(Some(line)) = sealing.get(i) {
                let _ = writeln!(s, "        {line}");
            }
        }
        if let Some(lease) = &p.lease {
            let _ = writeln!(
                s,
                "    lease on {} (per tenant) for {}, {}, fencing token in {}{}\n        key {}:lease:{{t.<tenant>}}:{}:<resource hash>",
                Selector::describe_all(&lease.resource),
                duration(lease.ttl_ms),
                match lease.on_busy {
                    OnBusy::Reject => "busy: 409".to_string(),
                    OnBusy::Wait => format!("busy: wait up to {}", duration(lease.max_wait_ms)),
                },
                lease.fencing_header,
                if lease.extend { ", extended while running" } else { "" },
                r.key_prefix,
                p.name
            );
        }
        if p.rate_limits.is_empty() && p.idempotency.is_none() && p.lease.is_none() {
            s.push_str("    nothing to enforce: matched requests pass untouched\n");
        }
    }
    s
}

mod zoneinfo;

#[cfg(test)]
mod environment_tests;
#[cfg(test)]
mod tests;
