//! Redis key names: a public, stable contract.
//!
//! Every key starts with the configured `key_prefix` and carries a Redis Cluster hash tag
//! (`{...}`) so that all keys one script call touches live in one slot:
//!
//! ```text
//! rate limit:  <prefix>:rl:{<tag>}:<policy>:<limit>:<algo>:<limit>/<window_ms>[/<burst>]:<scope>
//! idempotency: <prefix>:idem:{t.<tenant hash>}:<policy>:<key hash>
//! lease:       <prefix>:lease:{t.<tenant hash>}:<policy>:<resource hash>
//! fence:       <prefix>:fence:{t.<tenant hash>}:<policy>:<resource hash>
//! ```
//!
//! `<key hash>` is 32 hex digits (128 bits) of SHA-256 of the client's Idempotency-Key.
//!
//! * `<tag>` is `t.<tenant hash>` for limits scoped by tenant, else `p.<policy>`.
//! * `<scope>` is a short hash of the selected request values (`_` for `by: []`).
//! * The algorithm's parameters are part of the key, so a config change starts a fresh counter.
//! * Tenants, principals, client addresses and header values only appear hashed.

use crate::config::{Algorithm, Policy, RateLimit};
use sha2::{Digest, Sha256};

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0x0f)] as char);
    }
    out
}

/// A 64-bit (16 hex digit) SHA-256 digest of `value`, separated by `domain` so that a tenant
/// and a header with the same text do not hash alike.
pub fn short_hash(domain: &str, value: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(domain.as_bytes());
    h.update([0u8]);
    h.update(value);
    hex(&h.finalize()[..8])
}

/// The hash tag of everything a tenant owns.
pub fn tenant_tag(tenant: &str) -> String {
    format!("t.{}", short_hash("tenant", tenant.as_bytes()))
}

/// The hash tag of counters that are not scoped by tenant.
pub fn policy_tag(policy: &str) -> String {
    format!("p.{policy}")
}

/// Hash of the selected values of a counter's scope; `_` when nothing is selected.
/// Absent values hash differently from empty ones.
pub fn scope_hash(parts: &[(String, Option<&str>)]) -> String {
    if parts.is_empty() {
        return "_".into();
    }
    let mut joined = Vec::new();
    for (name, value) in parts {
        joined.extend_from_slice(name.as_bytes());
        match value {
            Some(v) => {
                joined.push(b'=');
                joined.extend_from_slice(v.as_bytes());
            }
            None => joined.push(b'!'),
        }
        joined.push(0x1f);
    }
    short_hash("scope", &joined)
}

/// The parameter segment of a rate-limit key: `<algo>:<limit>/<window_ms>[/<burst>]`.
pub fn limit_params(limit: &RateLimit) -> String {
    match limit.algorithm {
        Algorithm::TokenBucket => format!(
            "{}:{}/{}/{}",
            limit.algorithm.code(),
            limit.limit,
            limit.window_ms,
            limit.burst
        ),
        _ => format!("{}:{}/{}", limit.code(), limit.limit, limit.window_ms),
    }
}

pub fn rate_limit_key(
    prefix: &str,
    tag: &str,
    policy: &Policy,
    limit: &RateLimit,
    scope: &str,
) -> String {
    format!(
        "{prefix}:rl:{{{tag}}}:{}:{}:{}:{scope}",
        policy.name,
        limit.name,
        limit_params(limit)
    )
}

/// The hash of a client's Idempotency-Key as it appears in the record's key and in logs.
pub fn client_key_hash(client_key: &str) -> String {
    let digest = Sha256::digest(client_key.as_bytes());
    hex(&digest[..16])
}

pub fn idempotency_key(prefix: &str, tenant_tag: &str, policy: &str, key_hash: &str) -> String {
    format!("{prefix}:idem:{{{tenant_tag}}}:{policy}:{key_hash}")
}

/// The lease key and the fencing counter key of a resource.
pub fn lease_keys(
    prefix: &str,
    tenant_tag: &str,
    policy: &str,
    resource_hash: &str,
) -> (String, String) {
    (
        format!("{prefix}:lease:{{{tenant_tag}}}:{policy}:{resource_hash}"),
        format!("{prefix}:fence:{{{tenant_tag}}}:{policy}:{resource_hash}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{FailureMode, Match, Selector};

    fn policy() -> Policy {
        Policy {
            name: "create-order".into(),
            matcher: Match::default(),
            failure_mode: FailureMode::Closed,
            rate_limits: vec![],
            idempotency: None,
            lease: None,
        }
    }

    fn limit(algorithm: Algorithm, burst: u64) -> RateLimit {
        RateLimit {
            name: "tenant".into(),
            by: vec![Selector::Tenant],
            algorithm,
            limit: 100,
            window_ms: 60_000,
            burst,
            shadow: false,
            leased: false,
        }
    }

    #[test]
    fn hashes_are_stable() {
        // Exact strings: changing them orphans every counter in production.
        assert_eq!(tenant_tag("acme"), "t.d2e79529ba2c46b2");
        assert_eq!(short_hash("tenant", b"acme"), "d2e79529ba2c46b2");
        assert_ne!(short_hash("scope", b"acme"), short_hash("tenant", b"acme"));
        assert_eq!(scope_hash(&[]), "_");
        assert_eq!(
            scope_hash(&[("tenant".into(), Some("acme"))]),
            "50f9cf87ff31ac8e"
        );
        assert_ne!(
            scope_hash(&[("header:x".into(), Some(""))]),
            scope_hash(&[("header:x".into(), None)])
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
                rate_limit_key("cg:demo", &tenant_tag("acme"), &p, &l, "abc"),
                want
            );
        }
        assert_eq!(
            rate_limit_key(
                "cg",
                &policy_tag("create-order"),
                &p,
                &limit(Algorithm::FixedWindow, 100),
                "_"
            ),
            "cg:rl:{p.create-order}:create-order:tenant:fw:100/60000:_"
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
    }

    #[test]
    fn hex_encoding() {
        assert_eq!(hex(&[0x00, 0x0f, 0xab, 0xff]), "000fabff");
    }
}
