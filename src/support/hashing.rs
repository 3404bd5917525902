//! The short, domain-separated SHA-256 hashes every key and key id is named by: the bottom of
//! the house (it imports nothing of the crate but text helpers), so the configuration, the
//! keys and the record seal can all use it without importing one another.

use crate::support::text::push_hex;
use sha2::{Digest, Sha256};

/// A 64-bit (16 hex digit) SHA-256 digest of `value`, separated by `domain` so that a tenant
/// and a header with the same text do not hash alike.
pub(crate) fn short_hash(domain: &str, value: &[u8]) -> String {
    let mut out = String::with_capacity(16);
    push_short_hash(&mut out, domain, value);
    out
}

/// Appends [`short_hash`] to `out`.
pub(crate) fn push_short_hash(out: &mut String, domain: &str, value: &[u8]) {
    let mut h = domain_hasher(domain);
    h.update(value);
    push_short_digest(out, h);
}

/// A hasher fed with `domain` and a 0 byte: what every short hash starts from.
pub(crate) fn domain_hasher(domain: &str) -> Sha256 {
    let mut h = Sha256::new();
    h.update(domain.as_bytes());
    h.update([0u8]);
    h
}

/// Appends the first 64 bits of `h`'s digest in hex.
pub(crate) fn push_short_digest(out: &mut String, h: Sha256) {
    push_hex(out, &h.finalize()[..8]);
}
