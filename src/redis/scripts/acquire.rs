//! The acquire calls of one request: one `acquire.lua` call per hash tag.
//!
//! Rate limits are grouped by their key's hash tag; the idempotency record, hash-tagged by
//! tenant, rides in the tenant group (or makes one). Within a call the script checks every
//! limit first and consumes only if all allow, then acquires the record. Calls for different
//! tags run in parallel and are independent: a request admitted by one group and rejected by
//! another has consumed from the first (and the filter releases a record it acquired).
//!
//! A limit with `overrides: true` also passes its override keys ([`OverrideKeys`], in its
//! counter's hash tag); the script counts it with the caller's own quota when one is stored
//! ([`Override`]) and says which it counted with ([`LimitState::quota`]).

use crate::config::{Policy, Quota, RateLimit};
// The record's stored form belongs to the idempotency guard's domain, a layer below the
// scripts' contracts: acquire.lua answers a completed record, read here.
use crate::guards::idempotency::record::Record;
use crate::redis::keys::{self, LimitKey};
use crate::redis::{resp::Reply, CallError, ScriptCall, Words};

/// The idempotency part of an acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RecordAcquire {
    /// The record's Redis key (tenant hash tag).
    pub(crate) key: String,
    pub(crate) tag: String,
    pub(crate) fingerprint: String,
    pub(crate) owner: String,
    pub(crate) processing_ttl_ms: u64,
    /// The owner's cancellation marker (same hash tag), passed as the call's last key.
    pub(crate) cancel_key: String,
}

/// The lease part of an acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LeaseAcquire {
    pub(crate) key: String,
    pub(crate) fence_key: String,
    pub(crate) tag: String,
    pub(crate) owner: String,
    pub(crate) ttl_ms: u64,
    pub(crate) fence_ttl_ms: u64,
    /// The owner's cancellation marker (same hash tag), passed as the call's last key.
    pub(crate) cancel_key: String,
}

/// One script call: the limits (indices into `policy.rate_limits`) whose keys share `tag`,
/// and whether it carries the idempotency acquire, the lease, a concurrency limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Group {
    pub(crate) tag: String,
    pub(crate) limits: Vec<usize>,
    pub(crate) record: bool,
    pub(crate) lease: bool,
    /// A concurrency limit is among `limits`: the call may take a slot.
    pub(crate) slots: bool,
    pub(crate) call: ScriptCall,
}

/// One limit Redis is asked about: its counter's key, this request's cost to it, and its
/// override keys when it has `overrides: true`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ask<'a> {
    pub(crate) key: &'a LimitKey,
    pub(crate) cost: u64,
    pub(crate) overrides: Option<&'a OverrideKeys>,
}

/// The keys a limit with `overrides: true` reads its caller's own quota from, in the
/// counter's hash tag: the principal's (read first, when the limit counts per principal and
/// the request names one) and the tenant's ([`keys::override_key`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OverrideKeys {
    pub(crate) principal: Option<String>,
    pub(crate) tenant: String,
}

impl OverrideKeys {
    /// The override keys of `limit` of `policy` for a request of the tenant whose hash tag is
    /// `tenant_tag` (the counter's) and of `principal`, if it is one of its own.
    pub(crate) fn new(
        prefix: &str,
        tenant_tag: &str,
        policy: &Policy,
        limit: &RateLimit,
        principal: Option<&str>,
    ) -> OverrideKeys {
        let key = |p| keys::override_key(prefix, tenant_tag, &policy.name, &limit.name, p);
        OverrideKeys {
            principal: principal
                .filter(|_| limit.per_principal())
                .map(|p| key(Some(p))),
            tenant: key(None),
        }
    }

    /// How many keys the call passes for them (1 or 2).
    fn count(&self) -> u64 {
        if self.principal.is_some() {
            2
        } else {
            1
        }
    }
}

/// Who is asking: the request's nonce (a concurrency slot's member) and what names the owner's
/// cancellation marker in any hash tag (`prefix`, the owner token).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asker<'a> {
    pub(crate) nonce: &'a str,
    pub(crate) prefix: &'a str,
    pub(crate) owner: &'a str,
}

impl Asker<'_> {
    /// The owner's cancellation marker in hash tag `tag`.
    pub(crate) fn marker(&self, policy: &Policy, tag: &str) -> String {
        keys::cancel_key(self.prefix, tag, &policy.name, self.owner)
    }
}

/// The six per-limit arguments of `acquire.lua`: the limit's code (its key's, see
/// [`keys::limit_code`]), limit, window (in ms, or a calendar-aligned limit's spec), burst,
/// shadow flag, and `cost`, this request's units.
fn push_limit_args(args: &mut Words, limit: &RateLimit, cost: u64) {
    args.push(keys::limit_code(limit));
    args.push_u64(limit.limit);
    push_window(args, limit);
    args.push_u64(limit.burst);
    args.push(if limit.shadow { "1" } else { "0" });
    args.push_u64(cost);
}

/// A limit's window as the scripts take it: milliseconds, or for a calendar-aligned limit its
/// spec (`1mo@3600,...`), from which the script computes the period that holds Redis TIME.
pub(crate) fn push_window(args: &mut Words, limit: &RateLimit) {
    match &limit.calendar {
        Some(c) => args.push(&c.spec),
        None => args.push_u64(limit.window_ms),
    }
}

/// The largest limit or burst an override holds (the configuration's bound).
#[cfg_attr(target_os = "wasi", allow(dead_code))]
pub(crate) const OVERRIDE_MAX_LIMIT: u64 = 1_000_000_000;

/// The longest window an override holds, 100 days: the script answers the window it counted
/// with, and webdis 0.1.9 cannot carry an integer of more than 10 digits in a reply.
#[cfg_attr(target_os = "wasi", allow(dead_code))]
pub(crate) const OVERRIDE_MAX_WINDOW_MS: u64 = 8_640_000_000;

/// A tenant's or a principal's own quota for one limit, as an override key holds it:
/// `<limit>/<window_ms>[/<burst>]`. The script reads it itself; this reading of it is the
/// operator's tool's (the host tools only).
#[cfg_attr(target_os = "wasi", allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Override {
    pub(crate) limit: u64,
    pub(crate) window_ms: u64,
    /// A token bucket's capacity; the limit when not given (and never on another algorithm).
    pub(crate) burst: Option<u64>,
}

#[cfg_attr(target_os = "wasi", allow(dead_code))]
impl Override {
    /// The stored text.
    pub(crate) fn text(&self) -> String {
        match self.burst {
            Some(b) => format!("{}/{}/{b}", self.limit, self.window_ms),
            None => format!("{}/{}", self.limit, self.window_ms),
        }
    }

    /// A stored value read as `acquire.lua` reads it for a limit that is a token bucket or
    /// not: `None` for a value the script ignores (unreadable).
    pub(crate) fn read(stored: &[u8], token_bucket: bool) -> Option<Override> {
        let number = |part: &[u8]| -> Option<u64> {
            if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
                return None;
            }
            std::str::from_utf8(part).ok()?.parse().ok()
        };
        let mut parts = stored.split(|b| *b == b'/');
        let limit = number(parts.next()?)?;
        let window_ms = number(parts.next()?)?;
        let burst = match parts.next() {
            Some(b) => Some(number(b)?),
            None => None,
        };
        let fits = |n: u64| (1..=OVERRIDE_MAX_LIMIT).contains(&n);
        let ok = parts.next().is_none()
            && fits(limit)
            && (1..=OVERRIDE_MAX_WINDOW_MS).contains(&window_ms)
            && burst.is_none_or(fits)
            && if token_bucket {
                window_ms >= limit
            } else {
                burst.is_none()
            };
        ok.then_some(Override {
            limit,
            window_ms,
            burst,
        })
    }
}

/// One limit's answer for this request: four of the script's reply values, and for a limit
/// with override keys the quota it was counted with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LimitState {
    pub(crate) allowed: bool,
    pub(crate) remaining: u64,
    pub(crate) reset_ms: u64,
    pub(crate) retry_after_ms: u64,
    /// The limit and window the counter was counted with when they are a tenant's or a
    /// principal's own (an override); `None`: the configuration's.
    pub(crate) quota: Option<Quota>,
    /// A stored override of this limit was unreadable, and ignored.
    pub(crate) override_unreadable: bool,
}

/// Plans the calls: tenant-tagged group first. `asks[i]` is limit `i`'s key and cost, or
/// `None` for a limit that needs no call (answered from a local slice).
pub(crate) fn plan(
    policy: &Policy,
    asks: &[Option<Ask<'_>>],
    asker: &Asker<'_>,
    record: Option<&RecordAcquire>,
    lease: Option<&LeaseAcquire>,
) -> Vec<Group> {
    // First the groups with their counters' keys (in `call.keys`), then each group's call.
    let group = |tag: String, limits: Vec<usize>, keys: Words| Group {
        tag,
        limits,
        record: false,
        lease: false,
        slots: false,
        call: ScriptCall::new(keys, Words::default()),
    };
    let mut groups: Vec<Group> = Vec::new();
    for (i, ask) in asks.iter().enumerate().take(policy.rate_limits.len()) {
        let Some(ask) = ask else {
            continue;
        };
        // Keys with one hash tag share a slot, so one script call.
        let tag = ask.key.tag();
        let text = ask.key.text();
        match groups.iter_mut().find(|g| g.tag == tag) {
            Some(g) => {
                g.limits.push(i);
                g.call.keys.push(text);
            }
            None => {
                // Room for the limits' keys and the record's, lease's and marker's after them.
                let mut keys = Words::with_capacity(asks.len() + 4, 4 * text.len());
                keys.push(text);
                groups.push(group(tag.to_string(), vec![i], keys));
            }
        }
    }
    for tag in record
        .map(|i| &i.tag)
        .into_iter()
        .chain(lease.map(|l| &l.tag))
    {
        if !groups.iter().any(|g| g.tag == *tag) {
            groups.push(group(tag.clone(), Vec::new(), Words::with_capacity(4, 256)));
        }
    }
    for g in &mut groups {
        let with_record = record.filter(|d| d.tag == g.tag);
        let with_lease = lease.filter(|l| l.tag == g.tag);
        let slots = g
            .limits
            .iter()
            .any(|&i| policy.rate_limits[i].concurrency());
        let limit_args = g.limits.iter().map(|&i| {
            let (cost, overrides) = asks[i].map_or((1, None), |a| (a.cost, a.overrides));
            (&policy.rate_limits[i], cost, overrides)
        });
        // The owner's cancellation marker, last: a late acquire of a cancelled owner writes
        // nothing (the record's and the lease's marker is the one of their tag).
        let marker = (with_record.is_some() || with_lease.is_some() || slots)
            .then(|| asker.marker(policy, &g.tag));
        let sections = Sections {
            record: with_record,
            lease: with_lease,
            marker,
        };
        let keys = std::mem::take(&mut g.call.keys);
        g.call = group_call(keys, g.limits.len(), limit_args, asker.nonce, sections);
        g.record = with_record.is_some();
        g.lease = with_lease.is_some();
        g.slots = slots;
    }
    groups.sort_by_key(|g| !g.tag.starts_with("t."));
    groups
}

/// What rides in a call beside the limits.
struct Sections<'a> {
    record: Option<&'a RecordAcquire>,
    lease: Option<&'a LeaseAcquire>,
    marker: Option<String>,
}

/// One `acquire.lua` call: the counters `keys` (`n` limits, their arguments `limit_args`), then
/// the record's and the lease's sections when given, the limits' override keys, and the
/// owner's cancellation marker last.
fn group_call<'p, 'o>(
    mut keys: Words,
    n: usize,
    limit_args: impl Iterator<Item = (&'p RateLimit, u64, Option<&'o OverrideKeys>)>,
    nonce: &str,
    sections: Sections<'_>,
) -> ScriptCall {
    // A limit's six arguments take about 40 bytes; a record's and a lease's about 100.
    let mut args = Words::with_capacity(4 + 6 * n + 7, 24 + 48 * n + 2 * 100);
    args.push_u64(n as u64);
    args.push(nonce);
    // The limits with override keys, by position (from 1); none on most calls.
    let mut overridden: Vec<(u64, &OverrideKeys)> = Vec::new();
    for (i, (limit, cost, overrides)) in limit_args.enumerate() {
        push_limit_args(&mut args, limit, cost);
        if let Some(o) = overrides {
            overridden.push((i as u64 + 1, o));
        }
    }
    match sections.record {
        Some(d) => {
            keys.push(&d.key);
            args.push("1");
            args.push(&d.fingerprint);
            args.push(&d.owner);
            args.push_u64(d.processing_ttl_ms);
        }
        None => args.push("0"),
    }
    match sections.lease {
        Some(l) => {
            keys.push(&l.key);
            keys.push(&l.fence_key);
            args.push("1");
            args.push(&l.owner);
            args.push_u64(l.ttl_ms);
            args.push_u64(l.fence_ttl_ms);
        }
        None => args.push("0"),
    }
    // Overrides: only for limits that have them, so every other call is as it was.
    if !overridden.is_empty() {
        args.push_u64(overridden.len() as u64);
        for (position, o) in &overridden {
            args.push_u64(*position);
            args.push_u64(o.count());
            if let Some(p) = &o.principal {
                keys.push(p);
            }
            keys.push(&o.tenant);
        }
    }
    if let Some(marker) = &sections.marker {
        keys.push(marker);
    }
    ScriptCall { keys, args }
}

/// A lease-only acquire: polls a busy lease again (`on_busy: wait`). Its reply is read by
/// [`read_reply`] with no limits, no record and the lease.
pub(crate) fn lease_poll(lease: &LeaseAcquire, nonce: &str) -> ScriptCall {
    let sections = Sections {
        record: None,
        lease: Some(lease),
        marker: Some(lease.cancel_key.clone()),
    };
    group_call(
        Words::with_capacity(4, 256),
        0,
        std::iter::empty::<(&RateLimit, u64, Option<&OverrideKeys>)>(),
        nonce,
        sections,
    )
}

/// A record-only acquire (with the lease, if given and in the record's hash tag): polls a
/// record still in progress (`in_progress: wait`). Its reply is read by [`read_reply`] with no
/// limits, the record, and the lease when it rides along.
pub(crate) fn record_poll(
    record: &RecordAcquire,
    lease: Option<&LeaseAcquire>,
    nonce: &str,
) -> ScriptCall {
    let sections = Sections {
        record: Some(record),
        lease: lease.filter(|l| l.tag == record.tag),
        marker: Some(record.cancel_key.clone()),
    };
    group_call(
        Words::with_capacity(4, 256),
        0,
        std::iter::empty::<(&RateLimit, u64, Option<&OverrideKeys>)>(),
        nonce,
        sections,
    )
}

/// What the idempotency section of an acquire found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RecordAnswer {
    /// The rate limits did not admit the request; nothing was written.
    Skipped,
    /// We own a new `PROCESSING` record.
    Acquired,
    /// Same request, still running elsewhere.
    InProgress { pttl_ms: i64 },
    /// Same request, done: replay this record.
    Completed(Box<Record>),
    /// Another request used this key.
    Conflict,
    /// The stored value is not a record we can read (or a COMPLETED one we cannot replay).
    Unreadable,
}

/// What the lease section of an acquire found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseAnswer {
    /// Not attempted: the rate limits rejected, or the idempotency answer was not "acquired".
    Skipped,
    /// We hold the lease; the fencing token.
    Acquired { token: i64 },
    /// Someone else holds it for `pttl_ms` more.
    Busy { pttl_ms: i64 },
}

/// A group's reply: admitted, each limit's state in group order, the section answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GroupReply {
    pub(crate) admitted: bool,
    pub(crate) states: Vec<LimitState>,
    pub(crate) record: Option<RecordAnswer>,
    pub(crate) lease: Option<LeaseAnswer>,
}

/// Reads `acquire.lua`'s reply for a group of `n` limits and the sections it carries. The
/// values the script adds for limits with override keys name their limit, so the reply says
/// itself which limits had them (the caller need not).
pub(crate) fn read_reply(
    reply: &Reply,
    n: usize,
    record: bool,
    lease: bool,
) -> Result<GroupReply, CallError> {
    let bad = |why: &str| CallError::UnexpectedReply(format!("acquire reply: {why}"));
    if let Reply::Error(e) = reply {
        return Err(CallError::Redis(e.clone()));
    }
    let items = reply.as_array().ok_or_else(|| bad("not an array"))?;
    let want = 1 + 4 * n + if record { 3 } else { 0 } + if lease { 2 } else { 0 };
    // Past them, four values per limit with override keys (none unless the call listed some).
    let extra = items.len().checked_sub(want).unwrap_or(usize::MAX);
    if extra % 4 != 0 || extra / 4 > n {
        return Err(bad(&format!("{} values, expected {want}", items.len())));
    }
    let int = |i: usize| items[i].as_int().ok_or_else(|| bad("non-integer value"));
    let flag = |i: usize| match int(i)? {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(bad("flag is neither 0 nor 1")),
    };
    let count = |i: usize| u64::try_from(int(i)?).map_err(|_| bad("negative count"));
    let admitted = flag(0)?;
    let mut states = Vec::with_capacity(n);
    for l in 0..n {
        let at = 1 + 4 * l;
        states.push(LimitState {
            allowed: flag(at)?,
            remaining: count(at + 1)?,
            reset_ms: count(at + 2)?,
            retry_after_ms: count(at + 3)?,
            quota: None,
            override_unreadable: false,
        });
    }
    // Each limit with override keys: its position, the limit and window it was counted with,
    // and how many of its override values were unreadable. Positions increase.
    let mut last = 0;
    for at in (want..items.len()).step_by(4) {
        let position = count(at)?;
        let state = usize::try_from(position)
            .ok()
            .filter(|&p| p > last)
            .and_then(|p| {
                last = p;
                states.get_mut(p - 1)
            })
            .ok_or_else(|| bad("override position out of order"))?;
        let quota = Quota {
            limit: count(at + 1)?,
            window_ms: count(at + 2)?,
        };
        if quota.limit == 0 || quota.window_ms == 0 {
            return Err(bad("override quota of 0"));
        }
        state.quota = Some(quota);
        state.override_unreadable = count(at + 3)? > 0;
    }
    let record = if record {
        let at = 1 + 4 * n;
        let pttl_ms = int(at + 1)?;
        Some(match int(at)? {
            0 => RecordAnswer::Skipped,
            1 => RecordAnswer::Acquired,
            2 => RecordAnswer::InProgress { pttl_ms },
            3 => {
                let bytes = items[at + 2].as_bytes().unwrap_or_default();
                match Record::parse(bytes) {
                    Some(r) => RecordAnswer::Completed(Box::new(r)),
                    None => RecordAnswer::Unreadable,
                }
            }
            4 => RecordAnswer::Conflict,
            5 => RecordAnswer::Unreadable,
            // Only an acquire the filter already gave up on finds its marker.
            6 => return Err(bad("cancelled")),
            _ => return Err(bad("unknown idempotency code")),
        })
    } else {
        None
    };
    let lease = if lease {
        let at = 1 + 4 * n + if record.is_some() { 3 } else { 0 };
        let value = int(at + 1)?;
        Some(match int(at)? {
            0 => LeaseAnswer::Skipped,
            1 if value > 0 => LeaseAnswer::Acquired { token: value },
            2 => LeaseAnswer::Busy { pttl_ms: value },
            3 => return Err(bad("cancelled")),
            _ => return Err(bad("unknown lease code")),
        })
    } else {
        None
    };
    Ok(GroupReply {
        admitted,
        states,
        record,
        lease,
    })
}

#[cfg(test)]
#[path = "acquire_tests.rs"]
mod tests;
