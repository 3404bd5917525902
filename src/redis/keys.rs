//! Redis key names: a public, stable contract.
//!
//! Every key starts with the configured `key_prefix` and carries a Redis Cluster hash tag
//! (`{...}`) so that all keys one script call touches live in one slot:
//!
//! ```text
//! rate limit:  <prefix>:rl:{<tag>}:<policy>:<limit>:<algo>:<limit>/<window>[/<burst>]:<scope>
//! idempotency: <prefix>:idem:{t.<tenant hash>}:<policy>:<key hash>
//! lease:       <prefix>:lease:{t.<tenant hash>}:<policy>:<resource hash>
//! fence:       <prefix>:fence:{t.<tenant hash>}:<policy>:<resource hash>
//! cancel:      <prefix>:cancel:{<tag>}:<policy>:<owner token>
//! override:    <prefix>:ovr:{t.<tenant hash>}:<policy>:<limit>:t                  (the tenant's)
//!              <prefix>:ovr:{t.<tenant hash>}:<policy>:<limit>:p.<principal hash> (a principal's)
//! their index: <prefix>:ovr:{t.<tenant hash>}:<policy>:index
//! ```
//!
//! `<key hash>` is 32 hex digits (128 bits) of SHA-256 of the client's Idempotency-Key.
//! An override holds `<limit>/<window_ms>[/<burst>]`, a tenant's or a principal's own quota
//! for a limit with `overrides: true` (written by `cg-admin override`, read by `acquire.lua`);
//! the index is the set of override keys the tool wrote, so it lists them without a scan.
//! docs/design.md ("Redis keys") gives every part's derivation, to compute a key by hand.
//!
//! * `<tag>` is `t.<tenant hash>` for limits scoped by tenant, else `p.<policy>`; a
//!   cancellation marker's is the tag of the call it stops (the tenant's for a record or a
//!   lease, a concurrency limit's own in another slot).
//! * `<scope>` is a short hash of the selected request values (`_` for `by: []`).
//! * `<window>` is the window in milliseconds, or for a calendar-aligned limit its spec
//!   (`1mo@3600,7200,M3.5.0/7200,M10.5.0/10800`: [`crate::config::Calendar::spec`]).
//! * The algorithm's parameters are part of the key, so a config change starts a fresh counter.
//! * `<algo>` is the limit's code ([`algorithm_code`], [`limit_code`]), which the scripts are
//!   also called with: it picks the algorithm `acquire.lua` and `charge.lua` count with.
//! * Tenants, principals, client addresses and header values only appear hashed.

use crate::config::{Algorithm, Policy, RateLimit, Selector};
use crate::support::hashing::{domain_hasher, push_short_digest, push_short_hash, short_hash};
use crate::support::slots::text_hash;
use crate::support::text::{hex, push, push_u64, split_once_byte};
use sha2::{Digest, Sha256};
use std::ops::Range;
use std::rc::Rc;

/// The hash tag of everything a tenant owns.
pub fn tenant_tag(tenant: &str) -> String {
    let mut out = String::with_capacity(18);
    push_tenant_tag(&mut out, tenant);
    out
}

/// Appends [`tenant_tag`] to `out`.
pub fn push_tenant_tag(out: &mut String, tenant: &str) {
    out.push_str("t.");
    push_short_hash(out, "tenant", tenant.as_bytes());
}

/// The short hash a principal is named by in its override key (`p.<principal hash>`).
pub fn principal_hash(principal: &str) -> String {
    short_hash("principal", principal.as_bytes())
}

/// A limit's override key in the tenant's hash tag `tenant_tag`: the tenant's own
/// (`principal` `None`) or one principal's, named by [`principal_hash`].
pub fn override_key(
    prefix: &str,
    tenant_tag: &str,
    policy: &str,
    limit: &str,
    principal: Option<&str>,
) -> String {
    let mut k = String::with_capacity(prefix.len() + policy.len() + limit.len() + 48);
    for part in [prefix, ":ovr:{", tenant_tag, "}:", policy, ":", limit, ":"] {
        k.push_str(part);
    }
    match principal {
        Some(p) => {
            k.push_str("p.");
            push_short_hash(&mut k, "principal", p.as_bytes());
        }
        None => k.push('t'),
    }
    k
}

/// The set of override keys the tool wrote for a tenant's limits of one policy.
pub fn override_index_key(prefix: &str, tenant_tag: &str, policy: &str) -> String {
    tagged_key(prefix, "ovr", tenant_tag, policy, "index")
}

/// Appends the hash tag of counters that are not scoped by tenant: `p.<policy>`.
pub fn push_policy_tag(out: &mut String, policy: &str) {
    out.push_str("p.");
    out.push_str(policy);
}

/// The hash tag of a key: what Redis Cluster hashes, the text between the first `{` and the
/// next `}` when it is not empty, else the whole key (a key prefix has neither brace).
pub fn hash_tag(key: &str) -> &str {
    split_once_byte(key, b'{')
        .and_then(|(_, rest)| split_once_byte(rest, b'}'))
        .filter(|(tag, _)| !tag.is_empty())
        .map_or(key, |(tag, _)| tag)
}

/// A rate-limit counter's key, built once per limit per request: its text, where its hash tag
/// stands in it (known while writing it, never parsed back), and its worker-independent hash
/// (the over-limit cache's and the leased quota's slot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitKey {
    /// Shared: the key memo hands each request of a tenant the same key without a copy.
    text: Rc<str>,
    tag: Range<usize>,
    hash: u64,
}

impl LimitKey {
    /// The Redis key.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The hash tag: keys with one tag share a slot, so one script call.
    pub fn tag(&self) -> &str {
        self.text.get(self.tag.clone()).unwrap_or(&self.text)
    }

    /// [`text_hash`] of the key, computed once.
    pub fn hash(&self) -> u64 {
        self.hash
    }
}

/// Hash of the selected values of a counter's scope; `_` when nothing is selected.
/// Absent values hash differently from empty ones.
pub fn scope_hash<'v, 's>(
    parts: impl IntoIterator<Item = (&'s Selector, Option<&'v str>)>,
) -> String {
    let mut out = String::with_capacity(16);
    push_scope_hash(&mut out, parts);
    out
}

/// Appends [`scope_hash`] to `out`. The hashed text is, per part, the selector's spelling,
/// then `=` and the value or `!` when absent, then 0x1f.
pub fn push_scope_hash<'v, 's>(
    out: &mut String,
    parts: impl IntoIterator<Item = (&'s Selector, Option<&'v str>)>,
) {
    let mut parts = parts.into_iter().peekable();
    if parts.peek().is_none() {
        out.push('_');
        return;
    }
    let mut h = HashText(domain_hasher("scope"));
    for (selector, value) in parts {
        // Writing into a hasher cannot fail.
        let _ = selector.write_spelling(&mut h);
        match value {
            Some(v) => {
                h.0.update(b"=");
                h.0.update(v.as_bytes());
            }
            None => h.0.update(b"!"),
        }
        h.0.update([0x1f]);
    }
    push_short_digest(out, h.0);
}

/// A hasher that text can be written into.
struct HashText(Sha256);

impl std::fmt::Write for HashText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.update(s.as_bytes());
        Ok(())
    }
}

/// The short code of an algorithm, in Redis keys and script arguments.
pub fn algorithm_code(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::FixedWindow => "fw",
        Algorithm::SlidingWindow => "sw",
        Algorithm::SlidingLog => "sl",
        Algorithm::TokenBucket => "tb",
        Algorithm::Concurrency => "cc",
    }
}

/// The code a limit's scripts are called with, also part of its key: `lq` for a leased fixed
/// window, so it never shares a counter with an exact one.
pub fn limit_code(limit: &RateLimit) -> &'static str {
    if limit.leased {
        "lq"
    } else {
        algorithm_code(limit.algorithm)
    }
}

/// A rate-limit key with a known tag and scope (see [`write_rate_limit_key`]).
pub fn rate_limit_key(
    prefix: &str,
    tag: &str,
    policy: &Policy,
    limit: &RateLimit,
    scope: &str,
) -> LimitKey {
    write_rate_limit_key(
        prefix,
        policy,
        limit,
        |k| k.push_str(tag),
        |k| k.push_str(scope),
    )
}

/// `<prefix>:rl:{<tag>}:<policy>:<limit>:<algo>:<limit>/<window>[/<burst>]:<scope>`, with
/// the tag and the scope appended by `tag` and `scope`: one buffer, no intermediate strings.
pub fn write_rate_limit_key(
    prefix: &str,
    policy: &Policy,
    limit: &RateLimit,
    tag: impl FnOnce(&mut String),
    scope: impl FnOnce(&mut String),
) -> LimitKey {
    let mut k = String::with_capacity(prefix.len() + policy.name.len() + limit.name.len() + 80);
    push(&mut k, prefix);
    push(&mut k, ":rl:{");
    let tag_start = k.len();
    tag(&mut k);
    let tag_range = tag_start..k.len();
    push(&mut k, "}:");
    push(&mut k, &policy.name);
    push(&mut k, ":");
    push(&mut k, &limit.name);
    push(&mut k, ":");
    // A token bucket keeps its own code (`lq` is for leased fixed windows only).
    push(
        &mut k,
        match limit.algorithm {
            Algorithm::TokenBucket => algorithm_code(limit.algorithm),
            _ => limit_code(limit),
        },
    );
    push(&mut k, ":");
    push_u64(&mut k, limit.limit);
    push(&mut k, "/");
    // A calendar-aligned window is its spec: its period and zone, as the scripts read it.
    match &limit.calendar {
        Some(c) => push(&mut k, &c.spec),
        None => push_u64(&mut k, limit.window_ms),
    }
    if limit.algorithm == Algorithm::TokenBucket {
        push(&mut k, "/");
        push_u64(&mut k, limit.burst);
    }
    push(&mut k, ":");
    scope(&mut k);
    // An empty tag is no tag to Redis Cluster: the whole key is hashed.
    let tag = if tag_range.is_empty() {
        0..k.len()
    } else {
        tag_range
    };
    LimitKey {
        hash: text_hash(&k),
        tag,
        text: k.into(),
    }
}

/// The hash of a client's Idempotency-Key as it appears in the record's key and in logs.
pub fn client_key_hash(client_key: &str) -> String {
    let digest = Sha256::digest(client_key.as_bytes());
    hex(&digest[..16])
}

pub fn idempotency_key(prefix: &str, tenant_tag: &str, policy: &str, key_hash: &str) -> String {
    tagged_key(prefix, "idem", tenant_tag, policy, key_hash)
}

/// The lease key and the fencing counter key of a resource.
pub fn lease_keys(
    prefix: &str,
    tenant_tag: &str,
    policy: &str,
    resource_hash: &str,
) -> (String, String) {
    (
        tagged_key(prefix, "lease", tenant_tag, policy, resource_hash),
        tagged_key(prefix, "fence", tenant_tag, policy, resource_hash),
    )
}

/// The cancellation marker of a request's owner token: written by a release of an acquire the
/// filter gave up on, so that the acquire, if it still runs, writes nothing. Same hash tag as
/// the request's record and lease.
pub fn cancel_key(prefix: &str, tenant_tag: &str, policy: &str, owner: &str) -> String {
    tagged_key(prefix, "cancel", tenant_tag, policy, owner)
}

/// `<prefix>:<kind>:{<tenant_tag>}:<policy>:<last>`, in one buffer of its size.
fn tagged_key(prefix: &str, kind: &str, tenant_tag: &str, policy: &str, last: &str) -> String {
    let mut k = String::with_capacity(
        prefix.len() + kind.len() + tenant_tag.len() + policy.len() + last.len() + 6,
    );
    for part in [prefix, ":", kind, ":{", tenant_tag, "}:", policy, ":", last] {
        k.push_str(part);
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{FailureMode, Match, Selector};
    use crate::support::hashing::short_hash;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn policy() -> Policy {
        Policy {
            name: "create-order".into(),
            matcher: Match::default(),
            failure_mode: FailureMode::Closed,
            rate_limits: vec![],
            idempotency: None,
            lease: None,
            uses_client_ip: false,
            needs_tokens: false,
        }
    }

    fn limit(algorithm: Algorithm, burst: u64) -> RateLimit {
        RateLimit {
            name: "tenant".into(),
            by: vec![Selector::Tenant],
            algorithm,
            limit: 100,
            window_ms: 60_000,
            calendar: None,
            burst,
            shadow: false,
            leased: false,
            cost: None,
            charge: None,
            policy_item: "\"tenant\";q=100;w=60".into(),
            overrides: false,
            unit: "requests".into(),
        }
    }

    #[test]
    fn hashes_are_stable() {
        // Exact strings: changing them orphans every counter in production.
        assert_eq!(tenant_tag("acme"), "t.d2e79529ba2c46b2");
        assert_eq!(short_hash("tenant", b"acme"), "d2e79529ba2c46b2");
        assert_ne!(short_hash("scope", b"acme"), short_hash("tenant", b"acme"));
        assert_eq!(scope_hash([]), "_");
        assert_eq!(
            scope_hash([(&Selector::Tenant, Some("acme"))]),
            "50f9cf87ff31ac8e"
        );
        let header = Selector::Header("x".into());
        assert_ne!(
            scope_hash([(&header, Some(""))]),
            scope_hash([(&header, None)])
        );
        // The hashed text: spelling, `=`, value or `!`, 0x1f per part.
        let path = Selector::PathSegment(2);
        assert_eq!(
            scope_hash([(&header, Some("v")), (&path, None)]),
            short_hash("scope", b"header:x=v\x1fpath_segment:2!\x1f")
        );
    }

    #[test]
    fn rate_limit_keys() {
        let p = policy();
        let cases = [
            (
                limit(Algorithm::SlidingWindow, 100),
                "cg:demo:rl:{t.d2e79529ba2c46b2}:create-order:tenant:sw:100/60000:abc",
            ),
            (
                limit(Algorithm::FixedWindow, 100),
                "cg:demo:rl:{t.d2e79529ba2c46b2}:create-order:tenant:fw:100/60000:abc",
            ),
            (
                limit(Algorithm::SlidingLog, 100),
                "cg:demo:rl:{t.d2e79529ba2c46b2}:create-order:tenant:sl:100/60000:abc",
            ),
            (
                limit(Algorithm::TokenBucket, 250),
                "cg:demo:rl:{t.d2e79529ba2c46b2}:create-order:tenant:tb:100/60000/250:abc",
            ),
        ];
        for (l, want) in cases {
            assert_eq!(
                rate_limit_key("cg:demo", &tenant_tag("acme"), &p, &l, "abc").text(),
                want
            );
        }
        assert_eq!(
            rate_limit_key(
                "cg",
                "p.create-order",
                &p,
                &limit(Algorithm::FixedWindow, 100),
                "_"
            )
            .text(),
            "cg:rl:{p.create-order}:create-order:tenant:fw:100/60000:_"
        );
        // A calendar window is its spec, leased or not: a new zone or period, a new counter.
        let mut monthly = limit(Algorithm::FixedWindow, 100);
        let (std_offset_s, dst) =
            crate::config::posix_rule("CET-1CEST,M3.5.0,M10.5.0/3").expect("a rule");
        let zone = crate::config::Zone {
            name: "Europe/Berlin".into(),
            rule: Some("CET-1CEST,M3.5.0,M10.5.0/3".into()),
            std_offset_s,
            dst,
        };
        monthly.calendar = Some(crate::config::Calendar::new(
            crate::config::Period::Month,
            zone,
        ));
        assert_eq!(
            rate_limit_key("cg", "p.create-order", &p, &monthly, "_").text(),
            "cg:rl:{p.create-order}:create-order:tenant:fw:100/1mo@3600,7200,M3.5.0/7200,\
             M10.5.0/10800:_"
        );
        monthly.leased = true;
        assert_eq!(
            rate_limit_key("cg", "p.create-order", &p, &monthly, "_").text(),
            "cg:rl:{p.create-order}:create-order:tenant:lq:100/1mo@3600,7200,M3.5.0/7200,\
             M10.5.0/10800:_"
        );
    }

    #[test]
    fn idempotency_keys() {
        assert_eq!(
            client_key_hash("8e03978e-40d5-43e8"),
            "532dd433aeb15fea4386d9366377e969"
        );
        assert_eq!(
            idempotency_key(
                "cg:demo",
                &tenant_tag("acme"),
                "create-order",
                &client_key_hash("8e03978e-40d5-43e8")
            ),
            "cg:demo:idem:{t.d2e79529ba2c46b2}:create-order:532dd433aeb15fea4386d9366377e969"
        );
    }

    #[test]
    fn lease_key_shapes() {
        let (lease, fence) = lease_keys("cg", &tenant_tag("acme"), "activate", "abcd");
        assert_eq!(lease, "cg:lease:{t.d2e79529ba2c46b2}:activate:abcd");
        assert_eq!(fence, "cg:fence:{t.d2e79529ba2c46b2}:activate:abcd");
        assert_eq!(
            cancel_key("cg", &tenant_tag("acme"), "activate", "0f1e"),
            "cg:cancel:{t.d2e79529ba2c46b2}:activate:0f1e"
        );
    }

    #[test]
    fn override_keys() {
        let tag = tenant_tag("acme");
        assert_eq!(principal_hash("alice"), "58fd98b9b74d0691");
        assert_ne!(principal_hash("acme"), short_hash("tenant", b"acme"));
        assert_eq!(
            override_key("cg:demo", &tag, "create-order", "tenant", None),
            "cg:demo:ovr:{t.d2e79529ba2c46b2}:create-order:tenant:t"
        );
        assert_eq!(
            override_key("cg:demo", &tag, "create-order", "user", Some("alice")),
            "cg:demo:ovr:{t.d2e79529ba2c46b2}:create-order:user:p.58fd98b9b74d0691"
        );
        assert_eq!(
            override_index_key("cg:demo", &tag, "create-order"),
            "cg:demo:ovr:{t.d2e79529ba2c46b2}:create-order:index"
        );
        // The counter's slot: the same hash tag.
        let key = rate_limit_key(
            "cg:demo",
            &tag,
            &policy(),
            &limit(Algorithm::FixedWindow, 1),
            "_",
        );
        assert_eq!(
            hash_tag(&override_key(
                "cg:demo",
                &tag,
                "create-order",
                "tenant",
                None
            )),
            key.tag()
        );
    }

    #[test]
    fn hash_tags() {
        for (key, tag) in [
            ("cg:rl:{t.abc}:p", "t.abc"),
            ("cg:rl:{p.orders}:x:{y}", "p.orders"),
            ("cg:plain", "cg:plain"),
            ("cg:{}:x", "cg:{}:x"),
        ] {
            assert_eq!(hash_tag(key), tag, "{key}");
        }
    }

    #[test]
    fn a_limit_key_knows_its_tag_and_hash() {
        let p = policy();
        let l = limit(Algorithm::FixedWindow, 100);
        let key = rate_limit_key("cg", &tenant_tag("acme"), &p, &l, "abc");
        assert_eq!(key.tag(), "t.d2e79529ba2c46b2");
        assert_eq!(key.tag(), hash_tag(key.text()));
        assert_eq!(key.hash(), text_hash(key.text()));
        let untagged = rate_limit_key("cg", "", &p, &l, "abc");
        assert_eq!(untagged.tag(), untagged.text(), "an empty tag is no tag");
    }
}
