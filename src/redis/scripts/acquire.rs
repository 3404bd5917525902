//! The acquire calls of one request: one `acquire.lua` call per hash tag.
//!
//! Rate limits are grouped by their key's hash tag; the idempotency record, hash-tagged by
//! tenant, rides in the tenant group (or makes one). Within a call the script checks every
//! limit first and consumes only if all allow, then acquires the record. Calls for different
//! tags run in parallel and are independent: a request admitted by one group and rejected by
//! another has consumed from the first (and the filter releases a record it acquired).

use crate::config::{Policy, RateLimit};
use crate::guards::idempotency::record::Record;
use crate::guards::ratelimit::{self, LimitState};
use crate::redis::keys::{self, LimitKey};
use crate::redis::{resp::Reply, CallError, ScriptCall, Words};

/// The idempotency part of an acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdemAcquire {
    /// The record's Redis key (tenant hash tag).
    pub key: String,
    pub tag: String,
    pub fingerprint: String,
    pub owner: String,
    pub processing_ttl_ms: u64,
    /// The owner's cancellation marker (same hash tag), passed as the call's last key.
    pub cancel_key: String,
}

/// The lease part of an acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseAcquire {
    pub key: String,
    pub fence_key: String,
    pub tag: String,
    pub owner: String,
    pub ttl_ms: u64,
    pub fence_ttl_ms: u64,
    /// The owner's cancellation marker (same hash tag), passed as the call's last key.
    pub cancel_key: String,
}

/// One script call: the limits (indices into `policy.rate_limits`) whose keys share `tag`,
/// and whether it carries the idempotency acquire, the lease, a concurrency limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub tag: String,
    pub limits: Vec<usize>,
    pub idem: bool,
    pub lease: bool,
    /// A concurrency limit is among `limits`: the call may take a slot.
    pub slots: bool,
    pub call: ScriptCall,
}

/// One limit Redis is asked about: its counter's key and this request's cost to it.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub key: &'a LimitKey,
    pub cost: u64,
}

/// Who is asking: the request's nonce (a concurrency slot's member) and what names the owner's
/// cancellation marker in any hash tag (`prefix`, the owner token).
#[derive(Debug, Clone, Copy)]
pub struct Asker<'a> {
    pub nonce: &'a str,
    pub prefix: &'a str,
    pub owner: &'a str,
}

impl Asker<'_> {
    /// The owner's cancellation marker in hash tag `tag`.
    pub fn marker(&self, policy: &Policy, tag: &str) -> String {
        keys::cancel_key(self.prefix, tag, &policy.name, self.owner)
    }
}

/// Plans the calls: tenant-tagged group first. `asks[i]` is limit `i`'s key and cost, or
/// `None` for a limit that needs no call (answered from a local slice).
pub fn plan(
    policy: &Policy,
    asks: &[Option<Ask<'_>>],
    asker: &Asker<'_>,
    idem: Option<&IdemAcquire>,
    lease: Option<&LeaseAcquire>,
) -> Vec<Group> {
    // First the groups with their counters' keys (in `call.keys`), then each group's call.
    let group = |tag: String, limits: Vec<usize>, keys: Words| Group {
        tag,
        limits,
        idem: false,
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
    for tag in idem
        .map(|i| &i.tag)
        .into_iter()
        .chain(lease.map(|l| &l.tag))
    {
        if !groups.iter().any(|g| g.tag == *tag) {
            groups.push(group(tag.clone(), Vec::new(), Words::with_capacity(4, 256)));
        }
    }
    for g in &mut groups {
        let with_idem = idem.filter(|d| d.tag == g.tag);
        let with_lease = lease.filter(|l| l.tag == g.tag);
        let slots = g
            .limits
            .iter()
            .any(|&i| policy.rate_limits[i].concurrency());
        let limit_args = g.limits.iter().map(|&i| {
            let cost = asks[i].map_or(1, |a| a.cost);
            (&policy.rate_limits[i], cost)
        });
        // The owner's cancellation marker, last: a late acquire of a cancelled owner writes
        // nothing (the record's and the lease's marker is the one of their tag).
        let marker = (with_idem.is_some() || with_lease.is_some() || slots)
            .then(|| asker.marker(policy, &g.tag));
        let sections = Sections {
            idem: with_idem,
            lease: with_lease,
            marker,
        };
        let keys = std::mem::take(&mut g.call.keys);
        g.call = group_call(keys, g.limits.len(), limit_args, asker.nonce, sections);
        g.idem = with_idem.is_some();
        g.lease = with_lease.is_some();
        g.slots = slots;
    }
    groups.sort_by_key(|g| !g.tag.starts_with("t."));
    groups
}

/// What rides in a call beside the limits.
struct Sections<'a> {
    idem: Option<&'a IdemAcquire>,
    lease: Option<&'a LeaseAcquire>,
    marker: Option<String>,
}

/// One `acquire.lua` call: the counters `keys` (`n` limits, their arguments `limit_args`), then
/// the record's and the lease's sections when given, and the owner's cancellation marker last.
fn group_call<'p>(
    mut keys: Words,
    n: usize,
    limit_args: impl Iterator<Item = (&'p RateLimit, u64)>,
    nonce: &str,
    sections: Sections<'_>,
) -> ScriptCall {
    // A limit's six arguments take about 40 bytes; a record's and a lease's about 100.
    let mut args = Words::with_capacity(4 + 6 * n + 7, 24 + 48 * n + 2 * 100);
    args.push_u64(n as u64);
    args.push(nonce);
    for (limit, cost) in limit_args {
        ratelimit::push_limit_args(&mut args, limit, cost);
    }
    match sections.idem {
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
    if let Some(marker) = &sections.marker {
        keys.push(marker);
    }
    ScriptCall { keys, args }
}

/// A lease-only acquire: polls a busy lease again (`on_busy: wait`). Its reply is read by
/// [`read_reply`] with no limits, no record and the lease.
pub fn lease_poll(lease: &LeaseAcquire, nonce: &str) -> ScriptCall {
    let sections = Sections {
        idem: None,
        lease: Some(lease),
        marker: Some(lease.cancel_key.clone()),
    };
    group_call(
        Words::with_capacity(4, 256),
        0,
        std::iter::empty(),
        nonce,
        sections,
    )
}

/// A record-only acquire (with the lease, if given and in the record's hash tag): polls a
/// record still in progress (`in_progress: wait`). Its reply is read by [`read_reply`] with no
/// limits, the record, and the lease when it rides along.
pub fn record_poll(idem: &IdemAcquire, lease: Option<&LeaseAcquire>, nonce: &str) -> ScriptCall {
    let sections = Sections {
        idem: Some(idem),
        lease: lease.filter(|l| l.tag == idem.tag),
        marker: Some(idem.cancel_key.clone()),
    };
    group_call(
        Words::with_capacity(4, 256),
        0,
        std::iter::empty(),
        nonce,
        sections,
    )
}

/// What the idempotency section of an acquire found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdemAnswer {
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
pub enum LeaseAnswer {
    /// Not attempted: the rate limits rejected, or the idempotency answer was not "acquired".
    Skipped,
    /// We hold the lease; the fencing token.
    Acquired { token: i64 },
    /// Someone else holds it for `pttl_ms` more.
    Busy { pttl_ms: i64 },
}

/// A group's reply: admitted, each limit's state in group order, the section answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupReply {
    pub admitted: bool,
    pub states: Vec<LimitState>,
    pub idem: Option<IdemAnswer>,
    pub lease: Option<LeaseAnswer>,
}

/// Reads `acquire.lua`'s reply for a group of `n` limits and the sections it carries.
pub fn read_reply(
    reply: &Reply,
    n: usize,
    idem: bool,
    lease: bool,
) -> Result<GroupReply, CallError> {
    let bad = |why: &str| CallError::UnexpectedReply(format!("acquire reply: {why}"));
    if let Reply::Error(e) = reply {
        return Err(CallError::Redis(e.clone()));
    }
    let items = reply.as_array().ok_or_else(|| bad("not an array"))?;
    let want = 1 + 4 * n + if idem { 3 } else { 0 } + if lease { 2 } else { 0 };
    if items.len() != want {
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
        });
    }
    let idem = if idem {
        let at = 1 + 4 * n;
        let pttl_ms = int(at + 1)?;
        Some(match int(at)? {
            0 => IdemAnswer::Skipped,
            1 => IdemAnswer::Acquired,
            2 => IdemAnswer::InProgress { pttl_ms },
            3 => {
                let bytes = items[at + 2].as_bytes().unwrap_or_default();
                match Record::parse(bytes) {
                    Some(r) => IdemAnswer::Completed(Box::new(r)),
                    None => IdemAnswer::Unreadable,
                }
            }
            4 => IdemAnswer::Conflict,
            5 => IdemAnswer::Unreadable,
            // Only an acquire the filter already gave up on finds its marker.
            6 => return Err(bad("cancelled")),
            _ => return Err(bad("unknown idempotency code")),
        })
    } else {
        None
    };
    let lease = if lease {
        let at = 1 + 4 * n + if idem.is_some() { 3 } else { 0 };
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
        idem,
        lease,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guards::ratelimit::tests::config;
    use crate::http::identity::Caller;
    use crate::http::request::Request;
    use crate::redis::keys;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn request() -> (Caller, Request) {
        let req = Request::from_headers(
            vec![
                (":method".into(), "POST".into()),
                (":path".into(), "/orders".into()),
            ],
            Some("10.0.0.9:1234"),
        );
        let caller = Caller {
            tenant: "acme".into(),
            principal: "alice".into(),
        };
        (caller, req)
    }

    /// Every limit's key, or `None` where `skip` says so.
    fn keys(
        prefix: &str,
        policy: &Policy,
        caller: &Caller,
        req: &Request,
        skip: &[bool],
    ) -> Vec<Option<LimitKey>> {
        policy
            .rate_limits
            .iter()
            .enumerate()
            .map(|(i, l)| {
                (!skip.get(i).copied().unwrap_or(false))
                    .then(|| ratelimit::key(prefix, policy, l, caller, req))
            })
            .collect()
    }

    fn refs(keys: &[Option<LimitKey>]) -> Vec<Option<Ask<'_>>> {
        keys.iter()
            .map(|k| k.as_ref().map(|key| Ask { key, cost: 1 }))
            .collect()
    }

    fn asker(nonce: &str) -> Asker<'_> {
        Asker {
            nonce,
            prefix: "cg:demo",
            owner: "o1",
        }
    }

    fn idem() -> IdemAcquire {
        IdemAcquire {
            key: "cg:demo:idem:{t.d2e79529ba2c46b2}:create-order:k".into(),
            tag: keys::tenant_tag("acme"),
            fingerprint: "sha256:ff".into(),
            owner: "o1".into(),
            processing_ttl_ms: 120_000,
            cancel_key: "cg:demo:cancel:{t.d2e79529ba2c46b2}:create-order:o1".into(),
        }
    }

    #[test]
    fn groups_by_hash_tag() {
        let c = config();
        let (caller, req) = request();
        let groups = plan(
            &c.policies[0],
            &refs(&keys("cg:demo", &c.policies[0], &caller, &req, &[])),
            &asker("n1"),
            None,
            None,
        );
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].tag, "t.d2e79529ba2c46b2");
        assert_eq!(groups[0].limits, vec![0, 1]);
        assert_eq!(groups[1].tag, "p.create-order");
        assert_eq!(groups[1].limits, vec![2, 3]);
        let g = &groups[0].call;
        assert!(g.keys[0]
            .starts_with("cg:demo:rl:{t.d2e79529ba2c46b2}:create-order:tenant:sw:100/60000:"));
        assert!(g.keys[1]
            .starts_with("cg:demo:rl:{t.d2e79529ba2c46b2}:create-order:user-burst:tb:10/1000/20:"));
        assert_eq!(
            g.args,
            vec![
                "2", "n1", "sw", "100", "60000", "100", "0", "1", "tb", "10", "1000", "20", "0",
                "1", "0", "0"
            ]
        );
        assert_eq!(
            &groups[1].call.keys[1],
            "cg:demo:rl:{p.create-order}:create-order:global:sl:5/250:_"
        );
        assert_eq!(
            &groups[1].call.args.from_index(2)[..6],
            &["fw", "1000", "3600000", "1000", "1", "1"]
        );
        for g in &groups {
            for k in g.call.keys.iter() {
                assert!(
                    !k.contains("acme") && !k.contains("alice") && !k.contains("10.0.0.9"),
                    "{k}"
                );
            }
        }
    }

    #[test]
    fn idempotency_rides_with_the_tenant_group() {
        let c = config();
        let (caller, req) = request();
        let groups = plan(
            &c.policies[0],
            &refs(&keys("cg:demo", &c.policies[0], &caller, &req, &[])),
            &asker("n1"),
            Some(&idem()),
            None,
        );
        assert_eq!(groups.len(), 2);
        assert!(groups[0].idem && !groups[1].idem);
        assert_eq!(groups[0].call.keys.len(), 4);
        assert_eq!(groups[0].call.keys[2], idem().key);
        assert_eq!(groups[0].call.keys[3], idem().cancel_key);
        assert_eq!(
            groups[1].call.keys.len(),
            2,
            "no marker without a record or lease"
        );
        let args = &groups[0].call.args;
        assert_eq!(
            &args.from_index(args.len() - 5)[..],
            &["1", "sha256:ff", "o1", "120000", "0"]
        );
        assert_eq!(
            &groups[1]
                .call
                .args
                .from_index(groups[1].call.args.len() - 2)[..],
            &["0", "0"]
        );
        // No tenant-scoped limit: the record gets a group of its own.
        let alone = plan(
            &c.policies[1],
            &refs(&keys("cg:demo", &c.policies[1], &caller, &req, &[])),
            &asker("n1"),
            Some(&idem()),
            None,
        );
        assert_eq!(alone.len(), 2);
        assert_eq!(alone[0].tag, "t.d2e79529ba2c46b2");
        assert_eq!(alone[0].limits, Vec::<usize>::new());
        assert_eq!(
            alone[0].call.args,
            vec!["0", "n1", "1", "sha256:ff", "o1", "120000", "0"]
        );
    }

    #[test]
    fn lease_rides_with_the_tenant_group() {
        let c = config();
        let (caller, req) = request();
        let lease = LeaseAcquire {
            key: "cg:lease:{t.d2e79529ba2c46b2}:create-order:r".into(),
            fence_key: "cg:fence:{t.d2e79529ba2c46b2}:create-order:r".into(),
            tag: keys::tenant_tag("acme"),
            owner: "o2".into(),
            ttl_ms: 10_000,
            fence_ttl_ms: 604_800_000,
            cancel_key: "cg:cancel:{t.d2e79529ba2c46b2}:create-order:o1".into(),
        };
        let groups = plan(
            &c.policies[0],
            &refs(&keys("cg", &c.policies[0], &caller, &req, &[])),
            &asker("n1"),
            Some(&idem()),
            Some(&lease),
        );
        assert!(groups[0].idem && groups[0].lease);
        // The record's marker (the same as the lease's: one owner token per request) last.
        assert_eq!(
            &groups[0].call.keys.from_index(2)[..],
            &[
                idem().key,
                lease.key.clone(),
                lease.fence_key.clone(),
                idem().cancel_key
            ]
        );
        let args = &groups[0].call.args;
        assert_eq!(
            &args.from_index(args.len() - 8)[..],
            &[
                "1",
                "sha256:ff",
                "o1",
                "120000",
                "1",
                "o2",
                "10000",
                "604800000"
            ]
        );
        let reply = Reply::Array(Some(vec![
            Reply::Int(1),
            Reply::Int(1),
            Reply::Int(0),
            Reply::Bulk(Some(vec![])),
            Reply::Int(1),
            Reply::Bulk(Some(b"1795987737970123".to_vec())),
        ]));
        let got = read_reply(&reply, 0, true, true).expect("valid");
        assert_eq!(
            got.lease,
            Some(LeaseAnswer::Acquired {
                token: 1_795_987_737_970_123
            })
        );
        let busy = Reply::Array(Some(vec![Reply::Int(1), Reply::Int(2), Reply::Int(4200)]));
        assert_eq!(
            read_reply(&busy, 0, false, true).expect("valid").lease,
            Some(LeaseAnswer::Busy { pttl_ms: 4200 })
        );
        let bad = Reply::Array(Some(vec![Reply::Int(1), Reply::Int(1), Reply::Int(0)]));
        assert!(
            read_reply(&bad, 0, false, true).is_err(),
            "an acquired lease needs a token"
        );
        // A cancelled acquire (its owner's marker exists) is never an answer to act on.
        let cancelled = Reply::Array(Some(vec![Reply::Int(1), Reply::Int(3), Reply::Int(0)]));
        assert!(read_reply(&cancelled, 0, false, true).is_err());
        let cancelled = Reply::Array(Some(vec![
            Reply::Int(1),
            Reply::Int(6),
            Reply::Int(-2),
            Reply::Bulk(Some(vec![])),
        ]));
        assert!(read_reply(&cancelled, 0, true, false).is_err());
    }

    #[test]
    fn a_lease_poll_is_a_lease_only_acquire() {
        let lease = LeaseAcquire {
            key: "cg:lease:{t.x}:p:r".into(),
            fence_key: "cg:fence:{t.x}:p:r".into(),
            tag: "t.x".into(),
            owner: "o2".into(),
            ttl_ms: 10_000,
            fence_ttl_ms: 604_800_000,
            cancel_key: "cg:cancel:{t.x}:p:o2".into(),
        };
        let call = lease_poll(&lease, "n1");
        assert_eq!(
            call.keys,
            vec![
                lease.key.clone(),
                lease.fence_key.clone(),
                lease.cancel_key.clone()
            ]
        );
        assert_eq!(
            call.args,
            vec!["0", "n1", "0", "1", "o2", "10000", "604800000"]
        );
    }

    #[test]
    fn skipped_limits_are_left_out() {
        let c = config();
        let (caller, req) = request();
        let groups = plan(
            &c.policies[0],
            &refs(&keys("cg", &c.policies[0], &caller, &req, &[true, true])),
            &asker("n"),
            None,
            None,
        );
        assert_eq!(groups.len(), 1, "the tenant group has nothing left to ask");
        assert_eq!(groups[0].limits, vec![2, 3]);
        let none = plan(
            &c.policies[0],
            &refs(&keys("cg", &c.policies[0], &caller, &req, &[true; 4])),
            &asker("n"),
            None,
            None,
        );
        assert!(none.is_empty());
    }

    #[test]
    fn scopes_separate_callers() {
        let c = config();
        let (caller, req) = request();
        let other = Caller {
            tenant: "globex".into(),
            principal: "alice".into(),
        };
        let a = plan(
            &c.policies[0],
            &refs(&keys("cg", &c.policies[0], &caller, &req, &[])),
            &asker("n"),
            None,
            None,
        );
        let b = plan(
            &c.policies[0],
            &refs(&keys("cg", &c.policies[0], &other, &req, &[])),
            &asker("n"),
            None,
            None,
        );
        assert_ne!(a[0].call.keys, b[0].call.keys, "tenant-scoped keys differ");
        assert_eq!(
            a[1].call.keys, b[1].call.keys,
            "ip and global keys are shared"
        );
    }

    fn reply(values: &[i64]) -> Reply {
        Reply::Array(Some(values.iter().map(|v| Reply::Int(*v)).collect()))
    }

    #[test]
    fn reads_replies() {
        let got = read_reply(
            &reply(&[1, 1, 99, 60000, 0, 0, 0, 400, 250]),
            2,
            false,
            false,
        )
        .expect("valid");
        assert!(got.admitted);
        assert_eq!(
            got.states[1],
            LimitState {
                allowed: false,
                remaining: 0,
                reset_ms: 400,
                retry_after_ms: 250
            }
        );
        assert_eq!(got.idem, None);
        let bad = [
            (reply(&[1, 1, 2, 3]), 1usize),
            (reply(&[2, 1, 2, 3, 4]), 1),
            (reply(&[1, 1, -2, 3, 4]), 1),
            (Reply::Int(1), 1),
            (Reply::Array(Some(vec![Reply::Status("OK".into())])), 0),
        ];
        for (r, n) in bad {
            assert!(
                matches!(
                    read_reply(&r, n, false, false),
                    Err(CallError::UnexpectedReply(_))
                ),
                "{r:?}"
            );
        }
        assert_eq!(
            read_reply(&Reply::Error("ERR boom".into()), 1, false, false),
            Err(CallError::Redis("ERR boom".into()))
        );
    }

    fn idem_reply(code: i64, record: &[u8]) -> Reply {
        Reply::Array(Some(vec![
            Reply::Int(1),
            Reply::Int(code),
            Reply::Int(5000),
            Reply::Bulk(Some(record.to_vec())),
        ]))
    }

    #[test]
    fn reads_idempotency_answers() {
        let completed = br#"{"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:ff","created_ms":1,"updated_ms":2,"response":{"status":201,"headers":[],"body":"x"}}"#;
        let cases: Vec<(i64, &[u8], IdemAnswer)> = vec![
            (0, b"", IdemAnswer::Skipped),
            (1, b"", IdemAnswer::Acquired),
            (2, b"", IdemAnswer::InProgress { pttl_ms: 5000 }),
            (4, b"", IdemAnswer::Conflict),
            (5, b"", IdemAnswer::Unreadable),
            (3, b"garbage", IdemAnswer::Unreadable),
        ];
        for (code, record, want) in cases {
            let got = read_reply(&idem_reply(code, record), 0, true, false).expect("valid");
            assert_eq!(got.idem, Some(want), "code {code}");
        }
        let got = read_reply(&idem_reply(3, completed), 0, true, false).expect("valid");
        let Some(IdemAnswer::Completed(r)) = got.idem else {
            panic!("expected a completed record");
        };
        assert_eq!(
            r.response
                .as_ref()
                .and_then(|r| r.plain())
                .map(|r| r.status),
            Some(201)
        );
        assert!(matches!(
            read_reply(&idem_reply(9, b""), 0, true, false),
            Err(CallError::UnexpectedReply(_))
        ));
    }
}
