//! The operator's tool (`cg-admin`, in `src/bin/cg-admin/`): what the filter keeps in Redis
//! for one tenant, one record or one lease, read and changed by exact key, the keys derived by
//! the filter's own code ([`crate::redis::keys`], [`crate::guards`]) from the plugin
//! configuration the filter runs. Host tools only: it talks RESP over TCP ([`client`]).
//!
//! Every command answers a [`Report`] (text for a person, JSON for `--json`); every change it
//! makes is written to stderr by [`Context::log_change`] (who, what, when) and is idempotent:
//! run twice, the second run finds nothing to change and says so.

pub mod client;

use crate::config::Config;
use client::{Client, ClientError};
use std::time::{SystemTime, UNIX_EPOCH};

/// What every command works with.
pub struct Context {
    /// The plugin configuration, as the filter reads it.
    pub config: Config,
    /// Redis, as the admin.
    pub client: Client,
    /// Who runs the tool, for the change log (`CG_ADMIN_ACTOR`, else `$USER`).
    pub actor: String,
}

impl Context {
    /// Writes one line to stderr for a change the tool made: when (UTC, RFC 3339), who, what
    /// (the command and the exact key), and what it found before.
    pub fn log_change(&self, what: &str, key: &str, before: &str) {
        eprintln!(
            "{} cg-admin change by {}: {what} {key} (before: {before})",
            rfc3339_now(),
            self.actor
        );
    }
}

/// A command's answer: `text` for a person, `json` for `--json`.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub text: String,
    pub json: serde_json::Value,
}

/// Why a command failed: the exit status and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminError {
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

/// Now as `2026-12-07T15:04:05Z`.
pub fn rfc3339_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    rfc3339(secs)
}

/// Seconds since the epoch as `YYYY-MM-DDThh:mm:ssZ` (UTC; days to a civil date by Howard
/// Hinnant's algorithm).
pub fn rfc3339(secs: u64) -> String {
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
