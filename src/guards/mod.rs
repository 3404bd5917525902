//! The guards, each a state machine that decides and never calls back: rate limits (with cost
//! charges, the over-limit cache and leased slices), the idempotency record, the lease; and
//! the backoff they share while waiting for something another request holds.

pub(crate) mod background;
pub(crate) mod backoff;
pub(crate) mod context;
pub mod idempotency;
pub(crate) mod lease;
pub mod ratelimit;
