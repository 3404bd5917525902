//! Idempotency-Key semantics: header parsing, the canonical fingerprint, the stored record.

pub mod canonical;
pub mod fingerprint;
pub mod header;
pub mod record;
