//! What one worker remembers between requests, each in a bounded [`slots::SlotTable`]: the
//! over-limit cache and leased quota slices (the rate-limit key memo lives with the keys it
//! builds, in [`crate::ratelimit`]).

pub mod overlimit;
pub mod quota;
pub mod slots;
