//! How the tool writes what it found for a person: aligned label/value rows, spans of time
//! and the configuration's own words for a limit.

use crate::config::{Algorithm, RateLimit, Selector};
use std::fmt::Write;

/// Rows of `label  value`, the values aligned, each line indented by `indent` spaces. A value
/// of several lines keeps its later lines under its first.
pub(crate) fn rows(out: &mut String, indent: usize, rows: &[(&str, String)]) {
    let width = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    for (label, value) in rows {
        let mut lines = value.lines();
        let first = lines.next().unwrap_or_default();
        let _ = writeln!(out, "{:indent$}{label:<width$}  {first}", "");
        for more in lines {
            let _ = writeln!(out, "{:indent$}{:width$}  {more}", "", "");
        }
    }
}

/// A span of milliseconds for a person: `850 ms`, `12.3 s`, `4m 05s`, `3h 20m`, `2d 04h`.
pub(crate) fn span(ms: i64) -> String {
    if ms < 0 {
        return format!("{ms} ms");
    }
    let s = ms / 1000;
    match ms {
        0..=999 => format!("{ms} ms"),
        1_000..=59_999 => format!("{}.{} s", s, ms % 1000 / 100),
        60_000..=3_599_999 => format!("{}m {:02}s", s / 60, s % 60),
        3_600_000..=86_399_999 => format!("{}h {:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {:02}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// A configured duration as the configuration writes it: `1m`, `10s`, `250ms`.
pub(crate) fn duration(ms: u64) -> String {
    match ms {
        0 => "0ms".into(),
        ms if ms % 86_400_000 == 0 => format!("{}d", ms / 86_400_000),
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
        ms => format!("{ms}ms"),
    }
}

/// A limit's quota: `500 per 1m`, `500 per 1m, burst 50`.
pub(crate) fn quota(limit: u64, window_ms: u64, burst: Option<u64>) -> String {
    match burst {
        Some(b) => format!("{limit} per {}, burst {b}", duration(window_ms)),
        None => format!("{limit} per {}", duration(window_ms)),
    }
}

/// The algorithm's name as the configuration spells it.
pub(crate) fn algorithm(l: &RateLimit) -> &'static str {
    match l.algorithm {
        Algorithm::FixedWindow => "fixed_window",
        Algorithm::SlidingWindow => "sliding_window",
        Algorithm::SlidingLog => "sliding_log",
        Algorithm::TokenBucket => "token_bucket",
        Algorithm::Concurrency => "concurrency",
    }
}

/// One line of what a limit is: `sliding_window, 100 per 1m, by tenant`.
pub(crate) fn limit_line(l: &RateLimit) -> String {
    let mut line = if l.concurrency() {
        format!(
            "{}, {} at once (a slot lives {})",
            algorithm(l),
            l.limit,
            duration(l.window_ms)
        )
    } else if let Some(c) = &l.calendar {
        format!("{}, {} per {}", algorithm(l), l.limit, c.describe())
    } else {
        format!(
            "{}, {} per {}",
            algorithm(l),
            l.limit,
            duration(l.window_ms)
        )
    };
    if l.algorithm == Algorithm::TokenBucket {
        let _ = write!(line, ", burst {}", l.burst);
    }
    if l.leased {
        line.push_str(", leased slices");
    }
    let _ = write!(line, ", by {}", Selector::describe_all(&l.by));
    if l.shadow {
        line.push_str(" (shadow: counted, never rejects)");
    }
    line
}

/// What a limit's `used` counts (its capacity less what remains).
pub(crate) fn used_means(l: &RateLimit) -> String {
    match (l.algorithm, l.leased) {
        (Algorithm::FixedWindow, true) => {
            "units handed out as slices in this window (requests admitted from them may be fewer)"
                .into()
        }
        (Algorithm::FixedWindow, false) if l.calendar.is_some() => {
            "requests counted in this calendar period".into()
        }
        (Algorithm::FixedWindow, false) => "requests counted in this window".into(),
        (Algorithm::SlidingWindow, _) => {
            "this window's count plus the last one's share still inside the sliding window".into()
        }
        (Algorithm::SlidingLog, _) => format!("requests in the last {}", duration(l.window_ms)),
        (Algorithm::TokenBucket, _) => "tokens spent and not yet refilled".into(),
        (Algorithm::Concurrency, _) => "requests in flight, each holding a slot".into(),
    }
}

/// The most a limit holds: the burst of a token bucket, else the limit.
pub(crate) fn capacity(l: &RateLimit) -> u64 {
    if l.algorithm == Algorithm::TokenBucket {
        l.burst
    } else {
        l.limit
    }
}

/// The first 12 hex digits of a `sha256:` fingerprint, marked as cut.
pub(crate) fn fingerprint_prefix(f: &str) -> String {
    match f.strip_prefix("sha256:") {
        Some(hex) if hex.len() > 12 => format!("sha256:{}…", &hex[..12]),
        _ => f.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_read_at_a_glance() {
        assert_eq!(span(850), "850 ms");
        assert_eq!(span(12_345), "12.3 s");
        assert_eq!(span(245_000), "4m 05s");
        assert_eq!(span(12_000_000), "3h 20m");
        assert_eq!(span(187_200_000), "2d 04h");
        assert_eq!(duration(60_000), "1m");
        assert_eq!(duration(1500), "1500ms");
        assert_eq!(
            fingerprint_prefix(&format!("sha256:{}", "ab".repeat(32))),
            "sha256:abababababab…"
        );
    }

    #[test]
    fn rows_are_aligned() {
        let mut out = String::new();
        rows(
            &mut out,
            2,
            &[("key", "k".into()), ("remaining", "1\n2".into())],
        );
        assert_eq!(out, "  key        k\n  remaining  1\n             2\n");
    }
}
