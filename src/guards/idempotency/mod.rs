//! Idempotency-Key semantics: header parsing, the canonical fingerprint, the stored record
//! and its sealed response.

pub(crate) mod canonical;
pub(crate) mod capture;
pub mod fingerprint;
pub(crate) mod guard;
pub(crate) mod header;
pub mod record;
pub mod seal;
