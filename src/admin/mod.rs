//! The operator's tool (`cg-admin`, in `src/bin/cg-admin/`): what the filter keeps in Redis
//! for one tenant, one record or one lease, read and changed by exact key, the keys derived by
//! the filter's own code ([`crate::redis::keys`], [`crate::guards`]) from the plugin
//! configuration the filter runs. Host tools only: it talks RESP over TCP ([`client`]).
//!
//! Every command answers a [`Report`] (text for a person, JSON for `--json`); every change it
//! makes is written to stderr by [`Context::log_change`] (who, what, when) and is idempotent:
//! run twice, the second run finds nothing to change and says so.

pub(crate) mod args;
pub(crate) mod client;
pub(crate) mod explain;
pub(crate) mod lease;
pub(crate) mod limits;
pub(crate) mod overrides;
pub(crate) mod record;
pub(crate) mod request;
pub(crate) mod show;

use crate::config::manifest::{self, Configuration, EnvValue};
use crate::config::Config;
use args::Args;
use client::{Client, ClientError, Target};
use std::time::{SystemTime, UNIX_EPOCH};

/// The command line's help.
pub(crate) const USAGE: &str = "\
usage: cg-admin [--config FILE] [--plugin N] [--redis URL] [--json] COMMAND [OPTIONS] [--json]

  --config FILE  the plugin configuration the filter runs: its JSON, a WasmPlugin YAML or an
                 Envoy config (env CG_ADMIN_CONFIG)
  --plugin N     which plugin of the file, when it holds several (0 first)
  --redis URL    redis://[user[:password]@]host[:port], the admin's credentials
                 (env CG_ADMIN_REDIS_URL)
  --json         answer in JSON

commands:
  limits    each limit of a described request: key, algorithm, used, remaining, reset [--reset]
  record    an idempotency record: state, age, TTL, fingerprint, status [--delete [--force]]
  lease     a lease: holder, fencing token, time left [--release]
  explain   which policy, limits, keys, record and lease a described request would use, and why
  override  set|clear|list a tenant's or a principal's own limit

the request (limits, record, lease, explain), as the client sends it:
  --policy NAME --method M --path P --host H --header 'name: value' (repeats)
  --tenant T --principal P --client-ip IP --idempotency-key K --resource V (lease; repeats)
  --limit NAME (limits: only this limit; repeats)

exit status: 0 done, 1 refused, 2 usage, 3 Redis. The reference: docs/admin.md
";

/// Runs the command line; the exit status: 0 done, 1 refused, 2 usage, 3 Redis.
pub fn main(argv: &[String]) -> u8 {
    let (global, command, rest) = split_command(argv);
    let Some(command) = command else {
        eprint!("{USAGE}");
        return 2;
    };
    if command == "help" || command == "--help" || command == "-h" {
        print!("{USAGE}");
        return 0;
    }
    // `--json` is taken after the command too: every command answers in JSON with it.
    let late_json = rest.iter().any(|a| a == "--json");
    let rest: Vec<String> = rest.iter().filter(|a| *a != "--json").cloned().collect();
    let outcome =
        Args::parse(&global, &["--config", "--plugin", "--redis"], &["--json"]).and_then(|g| {
            let mut ctx = context(&g)?;
            run(&mut ctx, command, &rest).map(|r| (r, g.flag("--json") || late_json))
        });
    match outcome {
        Ok((report, json)) => {
            if json {
                println!("{}", report.json);
            } else {
                print!("{}", report.text);
            }
            0
        }
        Err(e) => {
            eprintln!("cg-admin {command}: {e}");
            match e {
                AdminError::Refused(_) => 1,
                AdminError::Usage(_) => 2,
                AdminError::Redis(_) => 3,
            }
        }
    }
}

/// The global options before the command, the command, and its own options.
fn split_command(argv: &[String]) -> (Vec<String>, Option<&str>, &[String]) {
    let mut i = 0;
    while let Some(arg) = argv.get(i) {
        if !arg.starts_with("--") || arg == "--help" {
            break;
        }
        // A global option with a value takes the next word unless written `--x=v`.
        let valued = ["--config", "--plugin", "--redis"].contains(&arg.as_str());
        i += if valued { 2 } else { 1 };
    }
    let global = argv.get(..i.min(argv.len())).unwrap_or_default().to_vec();
    let command = argv.get(i).map(String::as_str);
    let rest = argv.get(i + 1..).unwrap_or_default();
    (global, command, rest)
}

/// Runs one command.
pub(crate) fn run(ctx: &mut Context, command: &str, args: &[String]) -> Result<Report, AdminError> {
    match command {
        "limits" => limits::run(ctx, args),
        "record" => record::run(ctx, args),
        "lease" => lease::run(ctx, args),
        "explain" => explain::run(ctx, args),
        "override" => overrides::run(ctx, args),
        other => Err(AdminError::Usage(format!(
            "unknown command {other:?}; the commands are limits, record, lease, explain, override"
        ))),
    }
}

/// The configuration and the Redis client the global options (or their variables) name.
fn context(g: &Args) -> Result<Context, AdminError> {
    let path = match g.value("--config")? {
        Some(p) => p.to_string(),
        None => std::env::var("CG_ADMIN_CONFIG").map_err(|_| {
            AdminError::Usage("no configuration: give --config FILE or set CG_ADMIN_CONFIG".into())
        })?,
    };
    let plugin = match g.value("--plugin")? {
        None => None,
        Some(n) => Some(n.parse::<usize>().map_err(|_| {
            AdminError::Usage(format!(
                "--plugin takes a number (0 for the first), got {n:?}"
            ))
        })?),
    };
    let config = load_config(&path, plugin)?;
    let url = match g.value("--redis")? {
        Some(u) => u.to_string(),
        None => std::env::var("CG_ADMIN_REDIS_URL").map_err(|_| {
            AdminError::Usage(
                "no Redis: give --redis redis://user:password@host:port or set \
                 CG_ADMIN_REDIS_URL"
                    .into(),
            )
        })?,
    };
    let target = Target::from_url(&url).map_err(AdminError::Usage)?;
    let actor = std::env::var("CG_ADMIN_ACTOR")
        .or_else(|_| std::env::var("USER"))
        .unwrap_or_else(|_| "unknown".into());
    Ok(Context {
        config,
        client: Client::new(target),
        actor,
    })
}

/// The plugin configuration in `path`, read as `make check` reads it. A variable the
/// configuration names (a credential, a record key) is taken from the file's VM environment
/// when it gives the value, else from this process's environment, else a stand-in: the tool
/// needs the keys the configuration derives, not the secrets.
pub(crate) fn load_config(path: &str, plugin: Option<usize>) -> Result<Config, AdminError> {
    let bytes =
        std::fs::read(path).map_err(|e| AdminError::Usage(format!("cannot read {path}: {e}")))?;
    let found = manifest::read(&bytes).map_err(|e| AdminError::Usage(format!("{path}: {e}")))?;
    let chosen = match (plugin, found.plugins.len()) {
        (Some(n), _) => found.plugins.get(n).ok_or_else(|| {
            AdminError::Usage(format!(
                "{path} holds {} plugin(s); --plugin {n} is not one",
                found.plugins.len()
            ))
        })?,
        (None, 1) => &found.plugins[0],
        (None, n) => {
            return Err(AdminError::Usage(format!(
                "{path} holds {n} plugins: choose one with --plugin N (0 for the first)"
            )))
        }
    };
    let bytes = match &chosen.configuration {
        Configuration::Bytes(b) => b,
        Configuration::Unreadable(why) => return Err(AdminError::Usage(format!("{path}: {why}"))),
        Configuration::Placeholder(name) => {
            return Err(AdminError::Usage(format!(
                "{path}: its configuration is the template placeholder {name}; give the \
                 rendered file (make demo-config writes build/demo.yaml) or the plugin JSON"
            )))
        }
    };
    let env = |name: &str| -> Option<String> {
        match chosen.env.as_ref().and_then(|e| e.vars.get(name)) {
            Some(EnvValue::Inline(v)) => Some(v.clone()),
            _ => Some(std::env::var(name).unwrap_or_else(|_| STAND_IN.to_string())),
        }
    };
    Config::parse_with_env(bytes, &env)
        .map_err(|e| AdminError::Usage(format!("{path}: invalid plugin configuration: {e}")))
}

/// What a variable the tool does not have stands for: valid as a credential and as a record
/// key (base64 of 32 bytes). It never reaches Redis: the tool uses its own credentials.
const STAND_IN: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

/// What every command works with.
pub(crate) struct Context {
    /// The plugin configuration, as the filter reads it.
    pub(crate) config: Config,
    /// Redis, as the admin.
    pub(crate) client: Client,
    /// Who runs the tool, for the change log (`CG_ADMIN_ACTOR`, else `$USER`).
    pub(crate) actor: String,
}

impl Context {
    /// Writes one line to stderr for a change the tool made: when (UTC, RFC 3339), who, what
    /// (the command and the exact key), and what it found before.
    pub(crate) fn log_change(&self, what: &str, key: &str, before: &str) {
        eprintln!(
            "{} cg-admin change by {}: {what} {key} (before: {before})",
            rfc3339_now(),
            self.actor
        );
    }
}

/// A command's answer: `text` for a person, `json` for `--json`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Report {
    pub(crate) text: String,
    pub(crate) json: serde_json::Value,
}

/// Why a command failed: the exit status and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AdminError {
    /// The command line or the described request is wrong (exit 2).
    Usage(String),
    /// Redis could not be reached or refused (exit 3).
    Redis(ClientError),
    /// The change was refused (a PROCESSING record without `--force`) (exit 1).
    Refused(String),
}

impl From<ClientError> for AdminError {
    fn from(e: ClientError) -> AdminError {
        AdminError::Redis(e)
    }
}

impl std::fmt::Display for AdminError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AdminError::Usage(m) | AdminError::Refused(m) => f.write_str(m),
            AdminError::Redis(e) => write!(f, "{e}"),
        }
    }
}

/// Redis's clock in ms (`TIME`): the clock the scripts stamp records with.
pub(crate) fn redis_time_ms(client: &mut Client) -> Result<i64, AdminError> {
    let reply = client.call(&[b"TIME"])?;
    let part = |i: usize| {
        reply
            .as_array()
            .and_then(|a| a.get(i))
            .and_then(|r| r.as_int())
    };
    match (part(0), part(1)) {
        (Some(s), Some(us)) => Ok(s * 1000 + us / 1000),
        _ => Err(AdminError::Redis(ClientError::Protocol(
            "TIME did not answer two numbers".into(),
        ))),
    }
}

/// Now as `2026-12-07T15:04:05Z`.
pub(crate) fn rfc3339_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    rfc3339(secs)
}

/// Seconds since the epoch as `YYYY-MM-DDThh:mm:ssZ` (UTC; days to a civil date by Howard
/// Hinnant's algorithm).
pub(crate) fn rfc3339(secs: u64) -> String {
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_utc_civil_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_656_245), "2026-12-07T15:10:45Z");
    }
}
