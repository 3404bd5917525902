//! The guards, each a state machine that decides and never calls back: rate limits (with cost
//! charges, the over-limit cache and leased slices), the idempotency record, the lease; and
//! the backoff they share while waiting for something another request holds.

pub mod background;
pub mod backoff;
pub mod context;
pub mod idempotency;
pub mod lease;
pub mod ratelimit;
