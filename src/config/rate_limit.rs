//! `rate_limits`: a policy's limits, each a counter of one algorithm scoped by selectors, and
//! what a request costs it.

use crate::config::calendar::{self, Calendar, Zone};
use crate::config::fields::{duration, name, one_of, selectors};
use crate::config::reader::{index, Obj, Result};
use crate::config::units::whole_secs;
use crate::config::{cost, Charge, ConfigError, Cost, Limits, Selector};
use crate::support::text::push_u64;
use serde_json::Value;

/// How a limit counts (`algorithm`). Its code in Redis keys and script arguments is the key
/// contract's (`redis::keys::algorithm_code`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    FixedWindow,
    SlidingWindow,
    SlidingLog,
    TokenBucket,
    /// At most `limit` requests in flight; `window` is a holder's lifetime unless extended.
    Concurrency,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    pub name: String,
    pub by: Vec<Selector>,
    pub algorithm: Algorithm,
    pub limit: u64,
    /// The window; for a calendar-aligned limit its period's nominal length (a month counts
    /// 31 days), which nothing counts with: the scripts compute each period's bounds.
    pub window_ms: u64,
    /// `align: "calendar"`: the window is a calendar day, week or month in a zone, from its
    /// start to its end, instead of opening at the first hit (fixed windows only).
    pub calendar: Option<Calendar>,
    /// Token bucket capacity; equals `limit` for the other algorithms.
    pub burst: u64,
    pub shadow: bool,
    /// `mode: leased`: a worker takes slices of the window's quota and admits from them
    /// locally (fixed windows only).
    pub leased: bool,
    /// Units a request consumes at admission, read from a request header (1 when absent).
    pub cost: Option<Cost>,
    /// The real amount, read from the response once it is known.
    pub charge: Option<Charge>,
    /// Its `RateLimit-Policy` item ([`policy_item`] of its name, limit and window), written
    /// here once rather than on every response.
    pub policy_item: String,
    /// `overrides: true`: a tenant's or a principal's own limit, window and burst, stored in
    /// Redis beside the counter (`cg-admin override`), replace the configuration's for their
    /// requests. Only on limits counted per tenant, so the override keys share the
    /// counter's hash slot.
    pub overrides: bool,
    /// What one unit of the limit is (`unit`): the `qu` of its `RateLimit-Policy` item.
    /// [`UNIT_REQUESTS`] (the draft's default, written without `qu`) unless configured;
    /// [`UNIT_CONCURRENT`] for a concurrency limit.
    pub unit: String,
}

/// The quota unit of a limit that counts requests: the draft's default, so its items carry no
/// `qu`.
pub const UNIT_REQUESTS: &str = "requests";
/// The quota unit of a concurrency limit (requests in flight).
pub const UNIT_CONCURRENT: &str = "concurrent-requests";

/// How much a limit admits and over how long: the configuration's, or a tenant's own (an
/// override), as the script counted with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub limit: u64,
    pub window_ms: u64,
}

impl RateLimit {
    /// True for a limit on requests in flight (a slot held until the response ends).
    pub fn concurrency(&self) -> bool {
        self.algorithm == Algorithm::Concurrency
    }

    /// True when the counter is scoped by tenant, so its key is hash-tagged by the tenant.
    pub fn tenant_scoped(&self) -> bool {
        self.by.contains(&Selector::Tenant)
    }

    /// True when each principal of a tenant has a counter of its own: only then can one
    /// principal have its own limit (a principal's override).
    pub fn per_principal(&self) -> bool {
        self.by.contains(&Selector::Principal)
    }

    /// The configuration's limit and window.
    pub fn quota(&self) -> Quota {
        Quota {
            limit: self.limit,
            window_ms: self.window_ms,
        }
    }

    /// The `q` its `RateLimit-Policy` item shows, with the tenant's own quota (`own`, an
    /// override) if it has one: what `r` never exceeds (see [`push_policy_item`]).
    pub fn shown_quota(&self, own: Option<Quota>) -> u64 {
        match own {
            Some(q) => q.limit,
            None if self.algorithm == Algorithm::TokenBucket => self.burst,
            None => self.limit,
        }
    }
}

/// A limit's `RateLimit-Policy` item (draft-ietf-httpapi-ratelimit-headers-10): its name,
/// `q` (the quota), `qu` (the unit, when it is not requests) and `w` (the window in whole
/// seconds, rounded up), with the tenant's own quota (`own`, an override) if it has one.
///
/// - A token bucket shows its capacity: `q` is `burst` and `w` the time the bucket takes to
///   fill from empty (`burst` x `window` / `limit`), so that `r` (at most `burst`) never
///   exceeds `q`, `q` / `w` is the refill rate, and `q` units within any `w` are admitted.
///   A tenant's own bucket shows its limit and window (its burst is not in the script's
///   reply); `r` is then shown at most `q`.
/// - A concurrency limit shows `q` slots with `qu="concurrent-requests"` and no `w`: a slot
///   frees when a request ends, which no window says.
/// - A calendar-aligned limit shows no `w`: its window is a calendar period, not a number
///   of seconds (a month lasts 28 to 31 days, a day 23 to 25 hours where clocks change); `t`
///   in `RateLimit` says when the period ends.
/// - The others show `limit` per `window`.
///
/// The same on every response, so the configuration writes it once per limit
/// ([`RateLimit::policy_item`]) and a response copies it; a tenant's own quota is written per
/// response, into the header itself.
pub fn push_policy_item(out: &mut String, l: &RateLimit, own: Option<Quota>) {
    out.push('"');
    out.push_str(&l.name);
    out.push_str("\";q=");
    push_u64(out, l.shown_quota(own));
    if l.unit != UNIT_REQUESTS {
        out.push_str(";qu=\"");
        out.push_str(&l.unit);
        out.push('"');
    }
    if l.concurrency() || l.calendar.is_some() {
        return;
    }
    let window_ms = match own {
        Some(q) => q.window_ms,
        None if l.algorithm == Algorithm::TokenBucket => bucket_window_ms(l),
        None => l.window_ms,
    };
    out.push_str(";w=");
    push_u64(out, whole_secs(window_ms));
}

/// A token bucket's `w`: how long it takes to fill from empty, `burst` tokens at `limit` per
/// `window`, in ms rounded up.
fn bucket_window_ms(l: &RateLimit) -> u64 {
    let ms = (u128::from(l.burst) * u128::from(l.window_ms)).div_ceil(u128::from(l.limit.max(1)));
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// [`push_policy_item`] of `l` with its configured quota, as a string.
pub fn policy_item(l: &RateLimit) -> String {
    let mut item = String::with_capacity(l.name.len() + 48);
    push_policy_item(&mut item, l, None);
    item
}

const RATE_LIMIT_FIELDS: &[&str] = &[
    "name",
    "by",
    "algorithm",
    "limit",
    "window",
    "burst",
    "shadow",
    "mode",
    "cost",
    "charge",
    "overrides",
    "align",
    "zone",
    "unit",
];

/// A policy's `rate_limits`, names unique within it.
pub fn rate_limits(o: &mut Obj<'_>, field: &'static str, limits: Limits) -> Result<Vec<RateLimit>> {
    let mut rate_limits: Vec<RateLimit> = Vec::new();
    let limits_path = o.field_path(field);
    if let Some(items) = o.opt_array(field)? {
        for (i, item) in items.iter().enumerate() {
            let lpath = index(&limits_path, i);
            let limit = rate_limit(item, &lpath, limits)?;
            if rate_limits.iter().any(|l| l.name == limit.name) {
                return Err(ConfigError::new(
                    format!("{lpath}.name"),
                    format!("duplicate rate limit name {:?} in this policy", limit.name),
                ));
            }
            rate_limits.push(limit);
        }
    }
    Ok(rate_limits)
}

fn rate_limit(v: &Value, path: &str, limits: Limits) -> Result<RateLimit> {
    let mut o = Obj::new(v, path, RATE_LIMIT_FIELDS)?;
    let name = name(&mut o, "name")?;
    let by = selectors(&mut o, "by")?;
    let algorithm = algorithm(&mut o, "algorithm")?;
    let limit = limit_value(&mut o, "limit")?
        .ok_or_else(|| ConfigError::new(o.field_path("limit"), "is required"))?;
    let align_path = o.field_path("align");
    let aligned = one_of(&mut o, "align", &[("first_hit", false), ("calendar", true)])?;
    if aligned == Some(true) && algorithm != Algorithm::FixedWindow {
        // A quota is a count per period: only a fixed window has periods to align.
        return Err(ConfigError::new(
            align_path,
            "\"calendar\" needs algorithm fixed_window (a quota per calendar day, week or \
             month); a sliding window, a log, a bucket or an in-flight cap has no period to align",
        ));
    }
    let period = if aligned == Some(true) {
        Some(calendar::period(&mut o, "window")?)
    } else {
        None
    };
    let window_ms = match period {
        Some(p) => p.nominal_ms(),
        None => window(&mut o, "window")?,
    };
    let zone_path = o.field_path("zone");
    let calendar = match (period, o.get("zone")) {
        (Some(p), zone) => {
            let zone = match zone {
                Some(v) => calendar::zone(v, &zone_path)?,
                None => Zone {
                    name: "UTC".into(),
                    rule: None,
                    std_offset_s: 0,
                    dst: None,
                },
            };
            Some(Calendar::new(p, zone))
        }
        (None, Some(_)) => {
            return Err(ConfigError::new(
                zone_path,
                "only applies with \"align\": \"calendar\"",
            ))
        }
        (None, None) => None,
    };
    let burst = match limit_value(&mut o, "burst")? {
        Some(_) if algorithm != Algorithm::TokenBucket => {
            return Err(ConfigError::new(
                o.field_path("burst"),
                "only applies to algorithm token_bucket",
            ))
        }
        Some(b) => b,
        None => limit,
    };
    if algorithm == Algorithm::TokenBucket && window_ms < limit {
        // One token per less than a millisecond cannot be represented by the script.
        return Err(ConfigError::new(
            o.field_path("window"),
            format!("token_bucket needs window >= limit milliseconds ({limit}ms)"),
        ));
    }
    let shadow = o.opt_bool("shadow")?.unwrap_or(false);
    let mode_path = o.field_path("mode");
    let leased = one_of(&mut o, "mode", &[("exact", false), ("leased", true)])?.unwrap_or(false);
    if leased && (algorithm != Algorithm::FixedWindow || shadow) {
        return Err(ConfigError::new(
            mode_path,
            "\"leased\" needs algorithm fixed_window and no shadow",
        ));
    }
    let (cost, charge) = cost_and_charge(&mut o, algorithm, burst, leased, limits)?;
    let overrides_path = o.field_path("overrides");
    let overrides = o.opt_bool("overrides")?.unwrap_or(false);
    if overrides && calendar.is_some() {
        // An override holds a window in milliseconds, which would replace the calendar's.
        return Err(ConfigError::new(
            overrides_path,
            "is not supported with align \"calendar\": a tenant's own quota holds a window in \
             milliseconds, not a calendar period",
        ));
    }
    if overrides && !by.contains(&Selector::Tenant) {
        // The override keys are tagged by tenant: with another tag they would sit in another
        // slot than the counter, out of reach of the script that counts it.
        return Err(ConfigError::new(
            overrides_path,
            "needs a limit counted per tenant (\"tenant\" in by): a tenant's overrides are \
             stored in its hash slot",
        ));
    }
    let unit = unit(&mut o, "unit", algorithm)?;
    let mut l = RateLimit {
        policy_item: String::new(),
        name,
        by,
        algorithm,
        limit,
        window_ms,
        calendar,
        burst,
        shadow,
        leased,
        cost,
        charge,
        overrides,
        unit,
    };
    l.policy_item = policy_item(&l);
    Ok(l)
}

/// `unit`: what one unit of the limit is, shown as the `qu` of its `RateLimit-Policy` item. A
/// registered unit (`requests`, `content-bytes`; `concurrent-requests` is a concurrency
/// limit's, and only its), or a name of the service's own (`tokens`): 1-32 of `[a-z0-9-]`,
/// starting with a letter, so that it is an sf-string with nothing to escape.
fn unit(o: &mut Obj<'_>, field: &'static str, algorithm: Algorithm) -> Result<String> {
    let path = o.field_path(field);
    let concurrency = algorithm == Algorithm::Concurrency;
    let Some(unit) = o.opt_str(field)? else {
        let default = if concurrency {
            UNIT_CONCURRENT
        } else {
            UNIT_REQUESTS
        };
        return Ok(default.to_string());
    };
    let well_formed = (1..=32).contains(&unit.len())
        && unit.starts_with(|c: char| c.is_ascii_lowercase())
        && unit
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !well_formed {
        return Err(ConfigError::new(
            path,
            format!(
                "{unit:?} is not a quota unit: 1-32 of [a-z0-9-], starting with a letter \
                 (e.g. \"requests\", \"content-bytes\", \"tokens\")"
            ),
        ));
    }
    match (concurrency, unit == UNIT_CONCURRENT) {
        (true, false) => Err(ConfigError::new(
            path,
            format!("{unit:?}: a concurrency limit counts \"concurrent-requests\""),
        )),
        (false, true) => Err(ConfigError::new(
            path,
            "\"concurrent-requests\" is the unit of algorithm concurrency",
        )),
        _ => Ok(unit.to_string()),
    }
}

/// `cost` and `charge`, on the counting algorithms that can take any amount: not on
/// sliding_log (one entry per unit), concurrency (a slot per request) or a leased limit.
fn cost_and_charge(
    o: &mut Obj<'_>,
    algorithm: Algorithm,
    capacity: u64,
    leased: bool,
    limits: Limits,
) -> Result<(Option<Cost>, Option<Charge>)> {
    let cost = match o.get("cost") {
        Some(v) => Some(cost::cost(v, &o.field_path("cost"), capacity)?),
        None => None,
    };
    // The most a request of this limit is ever admitted at: what `unreadable: max` charges.
    let max_cost = cost.as_ref().map_or(capacity, |c| c.max);
    let charge = match o.get("charge") {
        Some(v) => Some(cost::charge(
            v,
            &o.field_path("charge"),
            max_cost,
            limits.envoy_buffer,
        )?),
        None => None,
    };
    let refused = match algorithm {
        _ if leased => Some("mode \"leased\""),
        Algorithm::SlidingLog => Some("algorithm sliding_log"),
        Algorithm::Concurrency => Some("algorithm concurrency"),
        _ => None,
    };
    if let Some(what) = refused {
        for (field, given) in [("cost", cost.is_some()), ("charge", charge.is_some())] {
            if given {
                return Err(ConfigError::new(
                    o.field_path(field),
                    format!(
                        "is not supported with {what}: use fixed_window, sliding_window or \
                         token_bucket"
                    ),
                ));
            }
        }
    }
    Ok((cost, charge))
}

/// `window` of a limit that is not calendar-aligned: a duration. A calendar period spelt
/// there (`"1w"`, `"1mo"`) is refused with what makes it one.
fn window(o: &mut Obj<'_>, field: &'static str) -> Result<u64> {
    let path = o.field_path(field);
    if let Some(Value::String(s)) = o.get(field) {
        if s == "1w" || s == "1mo" {
            return Err(ConfigError::new(
                path,
                format!(
                    "{s:?} is a calendar period: add \"align\": \"calendar\" (a fixed window \
                     from the start of each week or month in a zone), or give a duration"
                ),
            ));
        }
    }
    duration(o, field)?.ok_or_else(|| ConfigError::new(path, "is required"))
}

fn algorithm(o: &mut Obj<'_>, field: &'static str) -> Result<Algorithm> {
    Ok(match o.req_str(field)? {
        "fixed_window" => Algorithm::FixedWindow,
        "sliding_window" => Algorithm::SlidingWindow,
        "sliding_log" => Algorithm::SlidingLog,
        "token_bucket" => Algorithm::TokenBucket,
        "concurrency" => Algorithm::Concurrency,
        other => {
            return Err(ConfigError::new(
                o.field_path(field),
                format!(
                    "{other:?} is not one of fixed_window, sliding_window, sliding_log, \
                     token_bucket, concurrency"
                ),
            ))
        }
    })
}

/// Limits and bursts: integers in 1..=1_000_000_000 (the scripts count in Lua doubles).
fn limit_value(o: &mut Obj<'_>, field: &'static str) -> Result<Option<u64>> {
    let path = o.field_path(field);
    match o.opt_positive(field)? {
        Some(n) if n > 1_000_000_000 => Err(ConfigError::new(
            path,
            format!("{n} is too large (at most 1000000000)"),
        )),
        n => Ok(n),
    }
}
