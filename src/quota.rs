//! Leased quota (`mode: leased`): slices of a fixed window's quota that this worker took from
//! Redis and admits from locally, without a Redis call.
//!
//! Memory is a fixed table of slots indexed by a hash of the Redis key; a key that collides
//! with another loses its slice (those units go unused until the window ends: under-admission,
//! never over-admission).

use crate::overlimit::key_hash;
use std::cell::RefCell;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Slice {
    hash: u64,
    tokens: u64,
    expires_ms: u64,
}

pub struct LeasedQuota {
    slots: RefCell<Vec<Slice>>,
}

/// Slots of the local slice table.
pub const QUOTA_SLOTS: usize = 4096;

impl LeasedQuota {
    pub fn new(capacity: usize) -> LeasedQuota {
        LeasedQuota {
            slots: RefCell::new(vec![Slice::default(); capacity]),
        }
    }

    fn with_slot<T>(&self, key: &str, f: impl FnOnce(u64, &mut Slice) -> T) -> Option<T> {
        let hash = key_hash(key);
        let mut slots = self.slots.try_borrow_mut().ok()?;
        let n = slots.len() as u64;
        if n == 0 {
            return None;
        }
        let slot = slots.get_mut((hash % n) as usize)?;
        Some(f(hash, slot))
    }

    /// Takes one unit of `key`'s local slice: `(units left, expiry)` if there was one.
    pub fn take(&self, key: &str, now_ms: u64) -> Option<(u64, u64)> {
        self.with_slot(key, |hash, s| {
            (s.hash == hash && s.tokens > 0 && now_ms < s.expires_ms).then(|| {
                s.tokens -= 1;
                (s.tokens, s.expires_ms)
            })
        })
        .flatten()
    }

    /// Gives back a unit taken for a request that was then rejected.
    pub fn refund(&self, key: &str) {
        self.with_slot(key, |hash, s| {
            if s.hash == hash {
                s.tokens += 1;
            }
        });
    }

    /// Adds `tokens` granted by Redis, valid until the window ends at `expires_ms`.
    pub fn add(&self, key: &str, tokens: u64, expires_ms: u64, now_ms: u64) {
        self.with_slot(key, |hash, s| {
            if s.hash == hash && now_ms < s.expires_ms {
                s.tokens += tokens;
                s.expires_ms = s.expires_ms.min(expires_ms);
            } else {
                *s = Slice {
                    hash,
                    tokens,
                    expires_ms,
                };
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_are_spent_then_expire() {
        let q = LeasedQuota::new(16);
        assert_eq!(q.take("k", 0), None, "nothing granted yet");
        q.add("k", 2, 1_000, 0);
        assert_eq!(q.take("k", 10), Some((1, 1_000)));
        q.refund("k");
        assert_eq!(q.take("k", 20), Some((1, 1_000)));
        assert_eq!(q.take("k", 30), Some((0, 1_000)));
        assert_eq!(q.take("k", 40), None, "spent");
        q.add("k", 5, 1_000, 50);
        assert_eq!(q.take("k", 1_000), None, "the window ended");
        assert_eq!(q.take("other", 60), None);
    }

    #[test]
    fn a_colliding_key_loses_its_slice_but_never_gains_one() {
        let q = LeasedQuota::new(1);
        q.add("a", 5, 1_000, 0);
        q.add("b", 1, 1_000, 0);
        assert_eq!(q.take("a", 1), None);
        assert_eq!(q.take("b", 1), Some((0, 1_000)));
    }
}
