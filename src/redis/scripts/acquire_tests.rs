//! The acquire contract's tests: planned calls and replies read.

use super::*;
use crate::guards::ratelimit::{self, tests::config};
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
        .map(|k| {
            k.as_ref().map(|key| Ask {
                key,
                cost: 1,
                overrides: None,
            })
        })
        .collect()
}

fn asker(nonce: &str) -> Asker<'_> {
    Asker {
        nonce,
        prefix: "cg:demo",
        owner: "o1",
    }
}

fn record() -> RecordAcquire {
    RecordAcquire {
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
    assert!(
        g.keys[0].starts_with("cg:demo:rl:{t.d2e79529ba2c46b2}:create-order:tenant:sw:100/60000:")
    );
    assert!(g.keys[1]
        .starts_with("cg:demo:rl:{t.d2e79529ba2c46b2}:create-order:user-burst:tb:10/1000/20:"));
    assert_eq!(
        g.args,
        vec![
            "2", "n1", "sw", "100", "60000", "100", "0", "1", "tb", "10", "1000", "20", "0", "1",
            "0", "0"
        ]
    );
    assert_eq!(
        &groups[1].call.keys[1],
        "cg:demo:rl:{p.create-order}:create-order:global:sl:5/250:_"
    );
    assert_eq!(
        &groups[1].call.args.words_from(2)[..6],
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

/// A calendar-aligned limit's window goes to the script as its spec, in the key and the
/// arguments alike; the script computes the period from Redis TIME.
#[test]
fn a_calendar_window_is_passed_as_its_spec() {
    let c = crate::config::Config::parse(
        br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "p", "rate_limits": [
          {"name": "monthly", "by": ["tenant"], "algorithm": "fixed_window", "limit": 10000,
           "window": "1mo", "align": "calendar", "zone": "+05:30"}]}]}"#,
    )
    .expect("valid");
    let (caller, req) = request();
    let policy = &c.policies[0];
    let groups = plan(
        policy,
        &refs(&keys("cg", policy, &caller, &req, &[])),
        &asker("n1"),
        None,
        None,
    );
    assert_eq!(
        groups[0].call.args,
        vec![
            "1",
            "n1",
            "fw",
            "10000",
            "1mo@19800",
            "10000",
            "0",
            "1",
            "0",
            "0"
        ]
    );
    assert!(groups[0].call.keys[0].contains(":monthly:fw:10000/1mo@19800:"));
}

#[test]
fn idempotency_rides_with_the_tenant_group() {
    let c = config();
    let (caller, req) = request();
    let groups = plan(
        &c.policies[0],
        &refs(&keys("cg:demo", &c.policies[0], &caller, &req, &[])),
        &asker("n1"),
        Some(&record()),
        None,
    );
    assert_eq!(groups.len(), 2);
    assert!(groups[0].record && !groups[1].record);
    assert_eq!(groups[0].call.keys.len(), 4);
    assert_eq!(groups[0].call.keys[2], record().key);
    assert_eq!(groups[0].call.keys[3], record().cancel_key);
    assert_eq!(
        groups[1].call.keys.len(),
        2,
        "no marker without a record or lease"
    );
    let args = &groups[0].call.args;
    assert_eq!(
        &args.words_from(args.len() - 5)[..],
        &["1", "sha256:ff", "o1", "120000", "0"]
    );
    assert_eq!(
        &groups[1]
            .call
            .args
            .words_from(groups[1].call.args.len() - 2)[..],
        &["0", "0"]
    );
    // No tenant-scoped limit: the record gets a group of its own.
    let alone = plan(
        &c.policies[1],
        &refs(&keys("cg:demo", &c.policies[1], &caller, &req, &[])),
        &asker("n1"),
        Some(&record()),
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
        Some(&record()),
        Some(&lease),
    );
    assert!(groups[0].record && groups[0].lease);
    // The record's marker (the same as the lease's: one owner token per request) last.
    assert_eq!(
        &groups[0].call.keys.words_from(2)[..],
        &[
            record().key,
            lease.key.clone(),
            lease.fence_key.clone(),
            record().cancel_key
        ]
    );
    let args = &groups[0].call.args;
    assert_eq!(
        &args.words_from(args.len() - 8)[..],
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
            retry_after_ms: 250,
            quota: None,
            override_unreadable: false,
        }
    );
    assert_eq!(got.record, None);
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
    let cases: Vec<(i64, &[u8], RecordAnswer)> = vec![
        (0, b"", RecordAnswer::Skipped),
        (1, b"", RecordAnswer::Acquired),
        (2, b"", RecordAnswer::InProgress { pttl_ms: 5000 }),
        (4, b"", RecordAnswer::Conflict),
        (5, b"", RecordAnswer::Unreadable),
        (3, b"garbage", RecordAnswer::Unreadable),
    ];
    for (code, record, want) in cases {
        let got = read_reply(&idem_reply(code, record), 0, true, false).expect("valid");
        assert_eq!(got.record, Some(want), "code {code}");
    }
    let got = read_reply(&idem_reply(3, completed), 0, true, false).expect("valid");
    let Some(RecordAnswer::Completed(r)) = got.record else {
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

/// A policy whose tenant limit and per-principal limit read overrides, beside one that does
/// not (the fixture's other limits).
fn with_overrides() -> crate::config::Config {
    crate::config::Config::parse(
        br#"{"redis": {"cluster": "gw", "key_prefix": "cg:demo"}, "policies": [
        {"name": "create-order", "rate_limits": [
          {"name": "tenant", "by": ["tenant"], "algorithm": "sliding_window", "limit": 100, "window": "1m", "overrides": true},
          {"name": "plain", "by": ["tenant"], "algorithm": "fixed_window", "limit": 50, "window": "1m"},
          {"name": "user", "by": ["tenant", "principal"], "algorithm": "token_bucket", "limit": 10, "window": "1s", "burst": 20, "overrides": true}
        ]}]}"#,
    )
    .expect("valid")
}

/// Limits with `overrides` pass their override keys (the principal's first, when the limit
/// counts per principal) after the sections' keys and before the owner's marker, and are
/// listed after the lease section: position and key count each.
#[test]
fn overrides_ride_after_the_sections() {
    let c = with_overrides();
    let policy = &c.policies[0];
    let (caller, req) = request();
    let keys = keys("cg:demo", policy, &caller, &req, &[]);
    let overrides: Vec<Option<OverrideKeys>> = policy
        .rate_limits
        .iter()
        .zip(&keys)
        .map(|(l, k)| {
            let k = k.as_ref().expect("asked");
            l.overrides
                .then(|| OverrideKeys::new("cg:demo", k.tag(), policy, l, Some("alice")))
        })
        .collect();
    assert_eq!(
        overrides[0],
        Some(OverrideKeys {
            principal: None,
            tenant: "cg:demo:ovr:{t.d2e79529ba2c46b2}:create-order:tenant:t".into(),
        }),
        "a limit counted per tenant reads no principal's override"
    );
    let asks: Vec<Option<Ask<'_>>> = keys
        .iter()
        .zip(&overrides)
        .map(|(k, o)| {
            k.as_ref().map(|key| Ask {
                key,
                cost: 1,
                overrides: o.as_ref(),
            })
        })
        .collect();
    let groups = plan(policy, &asks, &asker("n1"), Some(&record()), None);
    assert_eq!(groups.len(), 1);
    let call = &groups[0].call;
    assert_eq!(
        &call.keys.words_from(3)[..],
        &[
            record().key.as_str(),
            "cg:demo:ovr:{t.d2e79529ba2c46b2}:create-order:tenant:t",
            &format!(
                "cg:demo:ovr:{{t.d2e79529ba2c46b2}}:create-order:user:p.{}",
                keys::principal_hash("alice")
            ),
            "cg:demo:ovr:{t.d2e79529ba2c46b2}:create-order:user:t",
            record().cancel_key.as_str(),
        ]
    );
    assert_eq!(
        &call.args.words_from(20)[..],
        &[
            "1",
            "sha256:ff",
            "o1",
            "120000",
            "0",
            "2",
            "1",
            "1",
            "3",
            "2"
        ]
    );
    // Without override keys the call is what it was.
    let plain = plan(policy, &refs(&keys), &asker("n1"), Some(&record()), None);
    assert_eq!(plain[0].call.keys.len(), 5);
    assert_eq!(plain[0].call.args.last(), Some("0"));
}

/// Four values per limit with override keys follow the sections: its position, the limit and
/// window it was counted with, and how many of its values were unreadable.
#[test]
fn reads_the_quota_each_override_counted_with() {
    let got = read_reply(
        &reply(&[1, 1, 99, 60000, 0, 0, 0, 400, 250, 2, 40, 120_000, 1]),
        2,
        false,
        false,
    )
    .expect("valid");
    assert_eq!(got.states[0].quota, None);
    assert_eq!(
        got.states[1].quota,
        Some(Quota {
            limit: 40,
            window_ms: 120_000
        })
    );
    assert!(got.states[1].override_unreadable && !got.states[0].override_unreadable);
    // With the record's values between the limits' and the overrides'.
    let got = read_reply(
        &Reply::Array(Some(vec![
            Reply::Int(1),
            Reply::Int(1),
            Reply::Int(4),
            Reply::Int(60000),
            Reply::Int(0),
            Reply::Int(1),
            Reply::Int(120_000),
            Reply::Bulk(Some(vec![])),
            Reply::Int(1),
            Reply::Bulk(Some(b"5".to_vec())),
            Reply::Bulk(Some(b"60000".to_vec())),
            Reply::Int(0),
        ])),
        1,
        true,
        false,
    )
    .expect("valid: webdis sends the integers as strings");
    assert_eq!(got.record, Some(RecordAnswer::Acquired));
    assert_eq!(got.states[0].quota.map(|q| q.limit), Some(5));
    for bad in [
        vec![1, 1, 99, 60000, 0, 3, 40, 1000, 0],
        vec![1, 1, 99, 60000, 0, 0, 40, 1000, 0],
        vec![1, 1, 99, 60000, 0, 1, 0, 1000, 0],
        vec![1, 1, 99, 60000, 0, 1, 40, 1000],
        vec![1, 1, 99, 60000, 0, 1, 40, 1000, 0, 1, 40, 1000, 0],
    ] {
        assert!(
            read_reply(&reply(&bad), 1, false, false).is_err(),
            "{bad:?}"
        );
    }
}

/// What an override key holds is read as acquire.lua reads it (tests/test_scripts_overrides.py
/// holds the script to the same values).
#[test]
fn override_values() {
    let o = Override {
        limit: 500,
        window_ms: 60_000,
        burst: None,
    };
    assert_eq!(o.text(), "500/60000");
    assert_eq!(Override::read(b"500/60000", false), Some(o));
    assert_eq!(Override::read(b"500/60000", true), Some(o));
    let tb = Override::read(b"6/60000/3", true).expect("a token bucket's burst");
    assert_eq!((tb.burst, tb.text().as_str()), (Some(3), "6/60000/3"));
    assert_eq!(Override::read(b"007/1000", false).map(|o| o.limit), Some(7));
    let max = format!("{OVERRIDE_MAX_LIMIT}/{OVERRIDE_MAX_WINDOW_MS}");
    assert!(Override::read(max.as_bytes(), false).is_some());
    for bad in [
        "",
        "abc",
        "0/1000",
        "5/0",
        "5",
        "5/1000/",
        "-5/1000",
        "5.5/1000",
        "5/1000/2",
        "2000000000/1000",
        "5/8640000001",
        " 5/1000",
        "5/1000\n",
        "5/1000/2/1",
        "99999999999999999999999/1000",
    ] {
        assert_eq!(Override::read(bad.as_bytes(), false), None, "{bad:?}");
    }
    assert_eq!(
        Override::read(b"5/1", true),
        None,
        "a token bucket needs window >= limit ms"
    );
    assert_eq!(Override::read(b"5/1000/0", true), None);
}
