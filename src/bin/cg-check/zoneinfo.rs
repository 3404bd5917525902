//! A zone's POSIX TZ rule from the machine's tzdata: what `zone: {"name", "rule"}` of a
//! calendar-aligned limit carries, since the filter has no time-zone database of its own.
//!
//! A tzdata file of version 2 or later (RFC 8536) ends with a footer, a newline, the zone's
//! POSIX TZ rule and a newline: the rule that gives its offsets after the last change the file
//! lists, i.e. its current rules. `cg-check --zone NAME` prints the object to paste; `check`
//! warns when a configured rule is not the one this machine's tzdata gives for its name.

use serde_json::Value;
use std::path::PathBuf;

/// Where the zone files are: `$TZDIR`, else `/usr/share/zoneinfo`.
fn tzdir() -> PathBuf {
    std::env::var_os("TZDIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from("/usr/share/zoneinfo"), PathBuf::from)
}

/// True for a name that can only be a file under the zone directory: segments of
/// `[A-Za-z0-9_+-]`, none empty, none starting with `-` or `.`.
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.split('/').all(|seg| {
            !seg.is_empty()
                && !seg.starts_with('-')
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_+-".contains(&b))
        })
}

/// The POSIX TZ rule at the end of `name`'s tzdata file, or why there is none.
pub fn rule(name: &str) -> Result<String, String> {
    if !plain_name(name) {
        return Err(format!(
            "{name:?} is not a time-zone name such as Europe/Berlin"
        ));
    }
    let path = tzdir().join(name);
    let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    footer(&bytes).ok_or_else(|| {
        format!(
            "{}: not a tzdata file of version 2 or later with a POSIX TZ rule at its end",
            path.display()
        )
    })
}

/// The footer of a TZif file of version 2 or later: the text between its last two newlines.
pub fn footer(bytes: &[u8]) -> Option<String> {
    if bytes.len() < 44 || &bytes[..4] != b"TZif" || bytes[4] < b'2' {
        return None;
    }
    let body = bytes.strip_suffix(b"\n")?;
    let start = body.iter().rposition(|b| *b == b'\n')? + 1;
    let rule = std::str::from_utf8(&body[start..]).ok()?;
    (!rule.is_empty() && rule.bytes().all(|b| b.is_ascii_graphic())).then(|| rule.to_string())
}

/// `{"name": NAME, "rule": RULE}`, as a limit's `zone` takes it.
pub fn zone_json(name: &str, rule: &str) -> String {
    let text = |s: &str| Value::String(s.to_string()).to_string();
    format!("{{\"name\": {}, \"rule\": {}}}", text(name), text(rule))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn tzif(version: u8, footer: &str) -> Vec<u8> {
        let mut b = b"TZif".to_vec();
        b.push(version);
        b.extend([0u8; 39]);
        b.extend(format!("\n{footer}\n").bytes());
        b
    }

    #[test]
    fn the_footer_is_the_rule() {
        let berlin = tzif(b'2', "CET-1CEST,M3.5.0,M10.5.0/3");
        assert_eq!(
            footer(&berlin).as_deref(),
            Some("CET-1CEST,M3.5.0,M10.5.0/3")
        );
        assert_eq!(
            footer(&tzif(b'4', "<+0545>-5:45")).as_deref(),
            Some("<+0545>-5:45")
        );
        assert_eq!(footer(&tzif(0, "CET-1")), None, "version 1 has no footer");
        assert_eq!(footer(&tzif(b'2', "")), None, "an empty footer");
        assert_eq!(footer(b"TZif2"), None);
        assert_eq!(
            footer(&berlin[..berlin.len() - 1]),
            None,
            "no final newline"
        );
    }

    #[test]
    fn only_plain_names_are_read() {
        for good in [
            "Europe/Berlin",
            "UTC",
            "America/Argentina/Buenos_Aires",
            "Etc/GMT+5",
        ] {
            assert!(plain_name(good), "{good}");
        }
        for bad in [
            "",
            "../etc/passwd",
            "/etc/passwd",
            "Europe//Berlin",
            "Europe/.",
            "-x",
            "a b",
        ] {
            assert!(!plain_name(bad), "{bad}");
        }
    }
}
