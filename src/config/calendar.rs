//! `align: "calendar"`: a fixed window whose periods are calendar days, ISO weeks or months in
//! a time zone, and that zone. Read here once, at configuration; the scripts compute the
//! period that holds Redis TIME themselves (`piece_calendar.lua`), from the spec this module
//! writes ([`Calendar::spec`]), so every sidecar agrees on when a period ends.
//!
//! A zone is a fixed UTC offset (`"+02:00"`, `"-05:30"`, `"UTC"`) or a name with its POSIX TZ
//! rule (`{"name": "Europe/Berlin", "rule": "CET-1CEST,M3.5.0,M10.5.0/3"}`): the rule is the
//! last line of the zone's tzdata file and describes the zone's current offsets and daylight
//! saving changes completely, so the filter needs no time-zone database (it has none: Wasm
//! cannot read `/usr/share/zoneinfo`). `cg-check --zone NAME` prints the object for a name from
//! the machine's tzdata.

use crate::config::reader::{kind, Obj, Result};
use crate::config::ConfigError;
use serde_json::Value;
use std::fmt::Write;

/// A calendar period: what `window` says with `align: "calendar"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Period {
    /// From one local midnight to the next (`"1d"`).
    Day,
    /// From Monday's local midnight to the next Monday's (`"1w"`, ISO 8601 weeks).
    Week,
    /// From the local midnight that starts the 1st of a month to the next month's (`"1mo"`).
    Month,
}

impl Period {
    /// Its spelling in the configuration, the scripts' spec and the counter's key.
    pub fn spelling(self) -> &'static str {
        match self {
            Period::Day => "1d",
            Period::Week => "1w",
            Period::Month => "1mo",
        }
    }

    /// Its nominal length in milliseconds (a month counts 31 days): the limit's `window_ms`,
    /// which nothing counts with; the scripts compute each period's real bounds.
    pub fn nominal_ms(self) -> u64 {
        const DAY: u64 = 86_400_000;
        match self {
            Period::Day => DAY,
            Period::Week => 7 * DAY,
            Period::Month => 31 * DAY,
        }
    }

    /// When a period starts, in words: `each local midnight`, ...
    pub fn start_words(self) -> &'static str {
        match self {
            Period::Day => "each local midnight",
            Period::Week => "each Monday's local midnight",
            Period::Month => "the local midnight that starts each month",
        }
    }

    /// In words: `day`, `week (from Monday)`, `month`.
    pub fn describe(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Week => "week (from Monday)",
            Period::Month => "month",
        }
    }
}

/// A day of the year that a POSIX TZ rule changes offsets on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleDay {
    /// `Mm.w.d`: weekday `d` (0 is Sunday) of week `w` (1-5, 5 the last) of month `m`.
    Month { month: u8, week: u8, weekday: u8 },
    /// `Jn`: day `n` of 1-365, February 29 never counted.
    Julian(u16),
    /// `n`: day `n` of 0-365, February 29 counted in leap years.
    Day(u16),
}

/// A change to or from daylight saving time: its day, and the local time of day it happens at
/// (in the offset in effect before it), in seconds (-167 h to 167 h, RFC 8536's extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub day: RuleDay,
    pub time_s: i32,
}

/// A zone's daylight saving time: its offset and the two changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dst {
    /// Seconds east of UTC.
    pub offset_s: i32,
    /// Standard to daylight time.
    pub start: Change,
    /// Daylight back to standard time.
    pub end: Change,
}

/// A time zone as the configuration gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Zone {
    /// How summaries name it: `UTC`, the offset as written, or the name given with a rule.
    pub name: String,
    /// The POSIX TZ rule as written; `None` for a fixed offset.
    pub rule: Option<String>,
    /// Standard time, seconds east of UTC.
    pub std_offset_s: i32,
    pub dst: Option<Dst>,
}

/// A calendar-aligned window: its period and zone, and the spec the scripts are called with
/// in place of the window in milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Calendar {
    pub period: Period,
    pub zone: Zone,
    /// `<period>@<std>` or `<period>@<std>,<dst>,<start>,<end>`: the offsets in seconds east
    /// of UTC, each change `M<m>.<w>.<d>/<s>`, `J<n>/<s>` or `<n>/<s>` (`s`: seconds after
    /// local midnight). Written once here; also the counter key's window part, so a changed
    /// zone or period starts a fresh counter.
    pub spec: String,
}

impl Calendar {
    pub fn new(period: Period, zone: Zone) -> Calendar {
        let spec = spec(period, &zone);
        Calendar { period, zone, spec }
    }

    /// `calendar month, Europe/Berlin (CET-1CEST,M3.5.0,M10.5.0/3)`, or `calendar day, +05:30`.
    pub fn describe(&self) -> String {
        let mut s = format!("calendar {}, {}", self.period.describe(), self.zone.name);
        if let Some(rule) = &self.zone.rule {
            let _ = write!(s, " ({rule})");
        }
        s
    }
}

fn spec(period: Period, zone: &Zone) -> String {
    let mut s = format!("{}@{}", period.spelling(), zone.std_offset_s);
    if let Some(dst) = &zone.dst {
        let _ = write!(s, ",{}", dst.offset_s);
        for change in [dst.start, dst.end] {
            s.push(',');
            match change.day {
                RuleDay::Month {
                    month,
                    week,
                    weekday,
                } => {
                    let _ = write!(s, "M{month}.{week}.{weekday}");
                }
                RuleDay::Julian(n) => {
                    let _ = write!(s, "J{n}");
                }
                RuleDay::Day(n) => {
                    let _ = write!(s, "{n}");
                }
            }
            let _ = write!(s, "/{}", change.time_s);
        }
    }
    s
}

/// `window` of a calendar-aligned limit: `"1d"`, `"1w"` or `"1mo"`.
pub fn period(o: &mut Obj<'_>, field: &'static str) -> Result<Period> {
    let path = o.field_path(field);
    let given = o.req_str(field)?;
    match given {
        "1d" => Ok(Period::Day),
        "1w" => Ok(Period::Week),
        "1mo" => Ok(Period::Month),
        other => Err(ConfigError::new(
            path,
            format!(
                "{other:?} is not a calendar period: with align \"calendar\" the window is \
                 \"1d\" (a day), \"1w\" (a week from Monday) or \"1mo\" (a month)"
            ),
        )),
    }
}

/// The fixed offsets accepted, in minutes: every zone in use lies within -12:00 and +14:00.
const FIXED_MINUTES: std::ops::RangeInclusive<i32> = -12 * 60..=14 * 60;

/// `zone`: a fixed offset (`"+02:00"`, `"UTC"`) or `{"name": ..., "rule": ...}`.
pub fn zone(v: &Value, path: &str) -> Result<Zone> {
    match v {
        Value::String(s) => fixed(s).ok_or_else(|| ConfigError::new(path, not_a_zone(s))),
        Value::Object(_) => {
            let mut o = Obj::new(v, path, &["name", "rule"])?;
            let name_path = o.field_path("name");
            let name = o.req_str("name")?;
            if name.is_empty()
                || name.len() > 64
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"/_+-".contains(&b))
            {
                return Err(ConfigError::new(
                    name_path,
                    format!("{name:?} must be 1-64 characters of [A-Za-z0-9/_+-]"),
                ));
            }
            let rule_path = o.field_path("rule");
            let rule = o.req_str("rule")?;
            let (std_offset_s, dst) = posix_rule(rule).map_err(|why| {
                ConfigError::new(
                    rule_path,
                    format!("{rule:?} is not a POSIX TZ rule ({why})"),
                )
            })?;
            Ok(Zone {
                name: name.to_string(),
                rule: Some(rule.to_string()),
                std_offset_s,
                dst,
            })
        }
        other => Err(ConfigError::new(
            path,
            format!(
                "expected a UTC offset such as \"+02:00\" or an object {{\"name\", \"rule\"}}, \
                 found {}",
                kind(other)
            ),
        )),
    }
}

/// The error for a string that is not a fixed offset: a zone name needs its rule.
fn not_a_zone(s: &str) -> String {
    let looks_like_name = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/_+-".contains(&b))
        && s.bytes().any(|b| b.is_ascii_alphabetic());
    if looks_like_name {
        format!(
            "{s:?} is a time-zone name, and the filter carries no time-zone database: give it \
             with its POSIX TZ rule, {{\"name\": {s:?}, \"rule\": \"<rule>\"}} (`cg-check --zone \
             {s}` or `make zone ZONE={s}` prints it from this machine's tzdata)"
        )
    } else {
        format!(
            "{s:?} is not \"UTC\", a UTC offset from \"-12:00\" to \"+14:00\" (\"+02:00\", \
             \"-05:30\") or a zone given by {{\"name\", \"rule\"}}"
        )
    }
}

/// `"UTC"` or `±hh:mm` within -12:00 and +14:00.
fn fixed(s: &str) -> Option<Zone> {
    let offset = if s == "UTC" {
        0
    } else {
        let b = s.as_bytes();
        if b.len() != 6 || b[3] != b':' {
            return None;
        }
        let sign = match b[0] {
            b'+' => 1,
            b'-' => -1,
            _ => return None,
        };
        let two = |at: usize| -> Option<i32> {
            let (h, l) = (b[at], b[at + 1]);
            (h.is_ascii_digit() && l.is_ascii_digit())
                .then(|| i32::from(h - b'0') * 10 + i32::from(l - b'0'))
        };
        let (hours, minutes) = (two(1)?, two(4)?);
        if minutes > 59 || !FIXED_MINUTES.contains(&(sign * (hours * 60 + minutes))) {
            return None;
        }
        sign * (hours * 3600 + minutes * 60)
    };
    Some(Zone {
        name: s.to_string(),
        rule: None,
        std_offset_s: offset,
        dst: None,
    })
}

/// Reads a POSIX TZ rule (POSIX.1 `TZ`, with RFC 8536's extension of change times to
/// -167..167 hours): `std offset [dst [offset] ,start[/time],end[/time]]`. Offsets are written
/// west-positive (`CET-1` is one hour east); the result is east-positive. A zone with daylight
/// time must give its changes (POSIX leaves the default to each system).
pub fn posix_rule(rule: &str) -> std::result::Result<(i32, Option<Dst>), String> {
    let mut p = Cursor {
        b: rule.as_bytes(),
        at: 0,
    };
    p.name("the standard time's name")?;
    let std_offset_s = -p.offset(24, "the standard offset")?;
    if p.done() {
        return Ok((std_offset_s, None));
    }
    p.name("the daylight time's name")?;
    let offset_s = if p.done() || p.peek() == Some(b',') {
        std_offset_s + 3600
    } else {
        -p.offset(24, "the daylight offset")?
    };
    if p.done() {
        return Err(
            "a zone with daylight time needs its changes, e.g. \",M3.5.0,M10.5.0/3\"".into(),
        );
    }
    p.expect(b',', "',' before the change to daylight time")?;
    let start = p.change("the change to daylight time")?;
    p.expect(b',', "',' before the change back to standard time")?;
    let end = p.change("the change back to standard time")?;
    if !p.done() {
        return Err(format!("unexpected text at byte {}", p.at));
    }
    Ok((
        std_offset_s,
        Some(Dst {
            offset_s,
            start,
            end,
        }),
    ))
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.at).copied()
    }

    fn done(&self) -> bool {
        self.at == self.b.len()
    }

    fn expect(&mut self, c: u8, what: &str) -> std::result::Result<(), String> {
        if self.peek() == Some(c) {
            self.at += 1;
            Ok(())
        } else {
            Err(format!("expected {what} at byte {}", self.at))
        }
    }

    /// A zone abbreviation: 3 or more letters, or `<...>` of 3 or more of `[A-Za-z0-9+-]`.
    fn name(&mut self, what: &str) -> std::result::Result<(), String> {
        let start = self.at;
        let ok = if self.peek() == Some(b'<') {
            self.at += 1;
            let inner = self.at;
            while self
                .peek()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'+' || c == b'-')
            {
                self.at += 1;
            }
            let long_enough = self.at - inner >= 3;
            long_enough && self.peek() == Some(b'>') && {
                self.at += 1;
                true
            }
        } else {
            while self.peek().is_some_and(|c| c.is_ascii_alphabetic()) {
                self.at += 1;
            }
            self.at - start >= 3
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "{what} at byte {start} is not 3 or more letters or <...>"
            ))
        }
    }

    /// Up to `max_digits` digits.
    fn number(&mut self, max_digits: usize) -> Option<i32> {
        let start = self.at;
        while self.at - start < max_digits && self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.at += 1;
        }
        if self.at == start {
            return None;
        }
        std::str::from_utf8(&self.b[start..self.at])
            .ok()?
            .parse()
            .ok()
    }

    /// `[+-]h[h[h]][:mm[:ss]]`, hours at most `max_hours`: seconds, the sign as written.
    fn offset(&mut self, max_hours: i32, what: &str) -> std::result::Result<i32, String> {
        let start = self.at;
        let sign = match self.peek() {
            Some(b'-') => {
                self.at += 1;
                -1
            }
            Some(b'+') => {
                self.at += 1;
                1
            }
            _ => 1,
        };
        let digits = if max_hours > 99 { 3 } else { 2 };
        let bad =
            || format!("{what} at byte {start} is not [+-]hh[:mm[:ss]] within {max_hours} hours");
        let hours = self.number(digits).ok_or_else(bad)?;
        let mut seconds = hours * 3600;
        for unit in [60, 1] {
            if self.peek() != Some(b':') {
                break;
            }
            self.at += 1;
            let at = self.at;
            let n = self.number(2).filter(|n| *n <= 59 && self.at - at == 2);
            seconds += n.ok_or_else(bad)? * unit;
        }
        if hours > max_hours || seconds > max_hours * 3600 {
            return Err(bad());
        }
        Ok(sign * seconds)
    }

    /// `Mm.w.d`, `Jn` or `n`, then an optional `/time` (02:00:00 when absent).
    fn change(&mut self, what: &str) -> std::result::Result<Change, String> {
        let start = self.at;
        let bad = || {
            format!(
                "{what} at byte {start} is not Mm.w.d (month 1-12, week 1-5, weekday 0-6), \
                 Jn (1-365) or n (0-365)"
            )
        };
        let day = match self.peek() {
            Some(b'M') => {
                self.at += 1;
                let month = self
                    .number(2)
                    .filter(|m| (1..=12).contains(m))
                    .ok_or_else(bad)?;
                self.expect(b'.', "'.' after the month")?;
                let week = self
                    .number(1)
                    .filter(|w| (1..=5).contains(w))
                    .ok_or_else(bad)?;
                self.expect(b'.', "'.' after the week")?;
                let weekday = self
                    .number(1)
                    .filter(|d| (0..=6).contains(d))
                    .ok_or_else(bad)?;
                RuleDay::Month {
                    month: u8::try_from(month).map_err(|_| bad())?,
                    week: u8::try_from(week).map_err(|_| bad())?,
                    weekday: u8::try_from(weekday).map_err(|_| bad())?,
                }
            }
            Some(b'J') => {
                self.at += 1;
                let n = self
                    .number(3)
                    .filter(|n| (1..=365).contains(n))
                    .ok_or_else(bad)?;
                RuleDay::Julian(u16::try_from(n).map_err(|_| bad())?)
            }
            _ => {
                let n = self
                    .number(3)
                    .filter(|n| (0..=365).contains(n))
                    .ok_or_else(bad)?;
                RuleDay::Day(u16::try_from(n).map_err(|_| bad())?)
            }
        };
        let time_s = if self.peek() == Some(b'/') {
            self.at += 1;
            self.offset(167, &format!("the time of {what}"))?
        } else {
            7200
        };
        Ok(Change { day, time_s })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn zone_of(v: Value) -> std::result::Result<Zone, String> {
        zone(&v, "z").map_err(|e| e.to_string())
    }

    #[test]
    fn fixed_offsets() {
        let cases = [
            ("UTC", Some(0)),
            ("+00:00", Some(0)),
            ("+02:00", Some(7200)),
            ("-05:30", Some(-19800)),
            ("+05:45", Some(20700)),
            ("+14:00", Some(50400)),
            ("-12:00", Some(-43200)),
            ("-12:01", None),
            ("-14:00", None),
            ("+14:01", None),
            ("+02:60", None),
            ("+2:00", None),
            ("02:00", None),
            ("+0200", None),
            ("+02:00 ", None),
            ("utc", None),
            ("Z", None),
            ("", None),
        ];
        for (given, want) in cases {
            assert_eq!(fixed(given).map(|z| z.std_offset_s), want, "{given:?}");
        }
    }

    #[test]
    fn posix_rules_as_tzdata_writes_them() {
        let berlin = posix_rule("CET-1CEST,M3.5.0,M10.5.0/3").expect("valid");
        assert_eq!(
            berlin,
            (
                3600,
                Some(Dst {
                    offset_s: 7200,
                    start: Change {
                        day: RuleDay::Month {
                            month: 3,
                            week: 5,
                            weekday: 0
                        },
                        time_s: 7200
                    },
                    end: Change {
                        day: RuleDay::Month {
                            month: 10,
                            week: 5,
                            weekday: 0
                        },
                        time_s: 10800
                    },
                })
            )
        );
        let cases: &[(&str, &str)] = &[
            (
                "CET-1CEST,M3.5.0,M10.5.0/3",
                "1mo@3600,7200,M3.5.0/7200,M10.5.0/10800",
            ),
            (
                "EST5EDT,M3.2.0,M11.1.0",
                "1mo@-18000,-14400,M3.2.0/7200,M11.1.0/7200",
            ),
            ("<+0545>-5:45", "1mo@20700"),
            ("IST-5:30", "1mo@19800"),
            ("<-03>3", "1mo@-10800"),
            // Southern hemisphere; Dublin's negative daylight saving; Chile's 24:00 changes.
            (
                "AEST-10AEDT,M10.1.0,M4.1.0/3",
                "1mo@36000,39600,M10.1.0/7200,M4.1.0/10800",
            ),
            (
                "IST-1GMT0,M10.5.0,M3.5.0/1",
                "1mo@3600,0,M10.5.0/7200,M3.5.0/3600",
            ),
            (
                "<-04>4<-03>,M9.1.6/24,M4.1.6/24",
                "1mo@-14400,-10800,M9.1.6/86400,M4.1.6/86400",
            ),
            (
                "<-02>2<-01>,M3.5.0/-1,M10.5.0/0",
                "1mo@-7200,-3600,M3.5.0/-3600,M10.5.0/0",
            ),
            (
                "IST-2IDT,M3.4.4/26,M10.5.0",
                "1mo@7200,10800,M3.4.4/93600,M10.5.0/7200",
            ),
            (
                "<+1245>-12:45<+1345>,M9.5.0/2:45,M4.1.0/3:45",
                "1mo@45900,49500,M9.5.0/9900,M4.1.0/13500",
            ),
            (
                "<+1030>-10:30<+11>-11,M10.1.0,M4.1.0",
                "1mo@37800,39600,M10.1.0/7200,M4.1.0/7200",
            ),
            ("EST5EDT4,0/0,J365/25", "1mo@-18000,-14400,0/0,J365/90000"),
            ("XXX3:00:30", "1mo@-10830"),
        ];
        for (rule, want) in cases {
            let (std_offset_s, dst) = posix_rule(rule).unwrap_or_else(|e| panic!("{rule}: {e}"));
            let z = Zone {
                name: "z".into(),
                rule: Some((*rule).into()),
                std_offset_s,
                dst,
            };
            assert_eq!(Calendar::new(Period::Month, z).spec, *want, "{rule}");
        }
    }

    #[test]
    fn bad_posix_rules_say_what_is_wrong() {
        let cases: &[(&str, &str)] = &[
            ("", "the standard time's name at byte 0 is not 3 or more letters or <...>"),
            ("CE-1", "the standard time's name at byte 0 is not 3 or more letters or <...>"),
            ("CET", "the standard offset at byte 3 is not [+-]hh[:mm[:ss]] within 24 hours"),
            ("CET-25", "the standard offset at byte 3 is not [+-]hh[:mm[:ss]] within 24 hours"),
            ("CET-1:5", "the standard offset at byte 3 is not [+-]hh[:mm[:ss]] within 24 hours"),
            ("CET-1CEST", "a zone with daylight time needs its changes, e.g. \",M3.5.0,M10.5.0/3\""),
            ("CET-1CEST,M3.5.0", "expected ',' before the change back to standard time at byte 16"),
            ("CET-1CEST,M13.5.0,M10.5.0",
             "the change to daylight time at byte 10 is not Mm.w.d (month 1-12, week 1-5, \
              weekday 0-6), Jn (1-365) or n (0-365)"),
            ("CET-1CEST,M3.6.0,M10.5.0",
             "the change to daylight time at byte 10 is not Mm.w.d (month 1-12, week 1-5, \
              weekday 0-6), Jn (1-365) or n (0-365)"),
            ("CET-1CEST,J0,M10.5.0",
             "the change to daylight time at byte 10 is not Mm.w.d (month 1-12, week 1-5, \
              weekday 0-6), Jn (1-365) or n (0-365)"),
            ("CET-1CEST,M3.5.0/168,M10.5.0",
             "the time of the change to daylight time at byte 17 is not [+-]hh[:mm[:ss]] within \
              167 hours"),
            ("CET-1CEST,M3.5.0,M10.5.0/3,x", "unexpected text at byte 26"),
            ("<+01-1", "the standard time's name at byte 0 is not 3 or more letters or <...>"),
        ];
        for (rule, want) in cases {
            assert_eq!(posix_rule(rule).err().as_deref(), Some(*want), "{rule:?}");
        }
    }

    #[test]
    fn zone_objects_and_names() {
        let z = zone_of(json!({"name": "Europe/Berlin", "rule": "CET-1CEST,M3.5.0,M10.5.0/3"}))
            .expect("valid");
        assert_eq!(z.name, "Europe/Berlin");
        assert_eq!(
            Calendar::new(Period::Month, z.clone()).describe(),
            "calendar month, Europe/Berlin (CET-1CEST,M3.5.0,M10.5.0/3)"
        );
        assert_eq!(
            Calendar::new(Period::Week, zone_of(json!("+05:30")).expect("valid")).describe(),
            "calendar week (from Monday), +05:30"
        );
        let errors: &[(Value, &str)] = &[
            (json!("Europe/Berlin"),
             "z: \"Europe/Berlin\" is a time-zone name, and the filter carries no time-zone \
              database: give it with its POSIX TZ rule, {\"name\": \"Europe/Berlin\", \"rule\": \
              \"<rule>\"} (`cg-check --zone Europe/Berlin` or `make zone ZONE=Europe/Berlin` \
              prints it from this machine's tzdata)"),
            (json!("+2"),
             "z: \"+2\" is not \"UTC\", a UTC offset from \"-12:00\" to \"+14:00\" (\"+02:00\", \
              \"-05:30\") or a zone given by {\"name\", \"rule\"}"),
            (json!(2),
             "z: expected a UTC offset such as \"+02:00\" or an object {\"name\", \"rule\"}, \
              found a number"),
            (json!({"name": "Europe/Berlin"}), "z.rule: is required"),
            (json!({"rule": "UTC0"}), "z.name: is required"),
            (json!({"name": "", "rule": "UTC0"}),
             "z.name: \"\" must be 1-64 characters of [A-Za-z0-9/_+-]"),
            (json!({"name": "a b", "rule": "UTC0"}),
             "z.name: \"a b\" must be 1-64 characters of [A-Za-z0-9/_+-]"),
            (json!({"name": "Europe/Berlin", "rule": "CET-1CEST"}),
             "z.rule: \"CET-1CEST\" is not a POSIX TZ rule (a zone with daylight time needs its \
              changes, e.g. \",M3.5.0,M10.5.0/3\")"),
            (json!({"name": "x", "rule": "UTC0", "offset": 1}),
             "z.offset: unknown field (known here: name, rule)"),
        ];
        for (given, want) in errors {
            assert_eq!(
                zone_of(given.clone()).err().as_deref(),
                Some(*want),
                "{given}"
            );
        }
    }
}
