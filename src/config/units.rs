//! Durations (`"250ms"`, `"2s"`, `"1m"`, `"24h"`) and byte sizes (`"64KiB"`, `"1MiB"`), and a
//! duration in the whole seconds the headers show.

/// Parses a duration string into milliseconds. Whole numbers only, one unit, > 0.
pub fn parse_duration_ms(s: &str) -> Option<u64> {
    let split = s.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = s.split_at(split);
    if digits.is_empty() || digits.len() > 12 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    let factor = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    let ms = n.checked_mul(factor)?;
    (ms > 0).then_some(ms)
}

/// Parses a byte size: a whole number with an optional unit `B`, `KiB`, `MiB` (or `KB`/`MB`,
/// read as binary units too). `0` is refused.
pub fn parse_size(s: &str) -> Option<u64> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    if digits.is_empty() || digits.len() > 12 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    let factor = match unit {
        "" | "B" => 1,
        "KiB" | "KB" | "K" => 1024,
        "MiB" | "MB" | "M" => 1024 * 1024,
        _ => return None,
    };
    let bytes = n.checked_mul(factor)?;
    (bytes > 0).then_some(bytes)
}

/// `ms` in whole seconds, rounded up, at least 1: `Retry-After`'s delta-seconds, a window's
/// `w=` and the over-limit cache's memo of a rejection (a wait is never shown as 0 s).
pub fn whole_secs(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn durations() {
        let cases = [
            ("250ms", Some(250)),
            ("2s", Some(2_000)),
            ("1m", Some(60_000)),
            ("24h", Some(86_400_000)),
            ("1d", Some(86_400_000)),
            ("0s", None),
            ("5x", None),
            ("s", None),
            ("1.5s", None),
            ("-1s", None),
            ("", None),
            ("10", None),
            (" 1s", None),
            ("1 s", None),
            ("9999999999999s", None),
        ];
        for (input, want) in cases {
            assert_eq!(parse_duration_ms(input), want, "{input:?}");
        }
    }

    #[test]
    fn sizes() {
        let cases = [
            ("1MiB", Some(1 << 20)),
            ("64KiB", Some(64 << 10)),
            ("512B", Some(512)),
            ("4096", Some(4096)),
            ("0", None),
            ("1GiB", None),
            ("KiB", None),
            ("1.5MiB", None),
        ];
        for (input, want) in cases {
            assert_eq!(parse_size(input), want, "{input:?}");
        }
    }

    #[test]
    fn whole_secs_rounds_up_to_at_least_one() {
        for (ms, want) in [(0, 1), (1, 1), (999, 1), (1000, 1), (1001, 2), (16_200, 17)] {
            assert_eq!(whole_secs(ms), want, "{ms}");
        }
    }
}
