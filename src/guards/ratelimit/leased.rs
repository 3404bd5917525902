//! Leased quota (`mode: leased`): slices of a fixed window's quota that this worker took from
//! Redis and admits from locally, without a Redis call.
//!
//! Memory is a fixed table of slots indexed by a hash of the Redis key; a key that collides
//! with another loses its slice (those units go unused until the window ends: under-admission,
//! never over-admission).

use crate::config::Quota;
use crate::support::slots::SlotTable;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slice {
    hash: u64,
    tokens: u64,
    expires_ms: u64,
    /// The tenant's own quota the slice was cut from (an override); `None`: the
    /// configuration's. What the requests it admits show in `RateLimit-Policy`.
    quota: Option<Quota>,
}

/// Keys are given by their hash ([`crate::redis::keys::LimitKey::hash`]), computed once per request.
pub(crate) struct LeasedQuota {
    slots: SlotTable<Slice>,
}

/// Slots of the local slice table.
pub(crate) const QUOTA_SLOTS: usize = 4096;

impl LeasedQuota {
    pub(crate) fn new(capacity: usize) -> LeasedQuota {
        LeasedQuota {
            slots: SlotTable::new(capacity),
        }
    }

    /// Takes one unit of the key's local slice: `(units left, expiry, its quota)` if there was
    /// one.
    pub(crate) fn take(&self, hash: u64, now_ms: u64) -> Option<(u64, u64, Option<Quota>)> {
        self.slots
            .update(hash, |slot| {
                let s = slot
                    .as_mut()
                    .filter(|s| s.hash == hash && s.tokens > 0 && now_ms < s.expires_ms)?;
                s.tokens -= 1;
                Some((s.tokens, s.expires_ms, s.quota))
            })
            .flatten()
    }

    /// Gives back a unit taken for a request that was then rejected.
    pub(crate) fn refund(&self, hash: u64) {
        self.slots.update(hash, |slot| {
            if let Some(s) = slot.as_mut().filter(|s| s.hash == hash) {
                s.tokens += 1;
            }
        });
    }

    /// Adds `tokens` granted by Redis, valid until the window ends at `expires_ms`, cut from
    /// `quota` (`None`: the configuration's). The latest grant's quota is the one shown.
    pub(crate) fn add(
        &self,
        hash: u64,
        tokens: u64,
        expires_ms: u64,
        now_ms: u64,
        quota: Option<Quota>,
    ) {
        self.slots.update(hash, |slot| match slot {
            Some(s) if s.hash == hash && now_ms < s.expires_ms => {
                s.tokens += tokens;
                s.expires_ms = s.expires_ms.min(expires_ms);
                s.quota = quota;
            }
            _ => {
                *slot = Some(Slice {
                    hash,
                    tokens,
                    expires_ms,
                    quota,
                })
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::support::slots::text_hash;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn slices_are_spent_then_expire() {
        let q = LeasedQuota::new(16);
        assert_eq!(q.take(text_hash("k"), 0), None, "nothing granted yet");
        q.add(text_hash("k"), 2, 1_000, 0, None);
        assert_eq!(q.take(text_hash("k"), 10), Some((1, 1_000, None)));
        q.refund(text_hash("k"));
        assert_eq!(q.take(text_hash("k"), 20), Some((1, 1_000, None)));
        assert_eq!(q.take(text_hash("k"), 30), Some((0, 1_000, None)));
        assert_eq!(q.take(text_hash("k"), 40), None, "spent");
        q.add(text_hash("k"), 5, 1_000, 50, None);
        assert_eq!(q.take(text_hash("k"), 1_000), None, "the window ended");
        assert_eq!(q.take(text_hash("other"), 60), None);
    }

    #[test]
    fn a_colliding_key_loses_its_slice_but_never_gains_one() {
        let q = LeasedQuota::new(1);
        q.add(text_hash("a"), 5, 1_000, 0, None);
        q.add(text_hash("b"), 1, 1_000, 0, None);
        assert_eq!(q.take(text_hash("a"), 1), None);
        assert_eq!(q.take(text_hash("b"), 1), Some((0, 1_000, None)));
    }

    #[test]
    fn a_slice_keeps_the_quota_it_was_cut_from() {
        let q = LeasedQuota::new(16);
        let own = Quota {
            limit: 5,
            window_ms: 1_000,
        };
        q.add(text_hash("k"), 2, 1_000, 0, Some(own));
        assert_eq!(q.take(text_hash("k"), 10), Some((1, 1_000, Some(own))));
        q.add(text_hash("k"), 2, 1_000, 20, None);
        assert_eq!(
            q.take(text_hash("k"), 30),
            Some((2, 1_000, None)),
            "the latest grant's"
        );
    }
}
