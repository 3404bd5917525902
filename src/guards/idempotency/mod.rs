//! Idempotency-Key semantics: header parsing, the canonical fingerprint, the stored record
//! and its sealed response.

pub mod canonical;
pub mod capture;
pub mod fingerprint;
pub mod guard;
pub mod header;
pub mod record;
pub mod seal;
