//! The over-limit cache: once Redis says a counter rejects until time T, requests for that
//! counter are rejected locally until T, without a Redis call (the idea of envoyproxy/
//! ratelimit's local cache). It is exact, not approximate: `T` is the script's own
//! `retry_after`, the earliest time that counter could admit a request of this cost, and
//! counters only move towards "more rejected" until then.
//!
//! Memory is bounded by construction: a fixed table of slots indexed by a hash of the Redis
//! key (a colliding key simply overwrites the slot, which costs a Redis call, never a wrong
//! answer because the slot also stores the key's full 64-bit hash). The same table is
//! mirrored in the host's shared data, so every worker of the proxy learns what one worker
//! learnt.

use super::slots::SlotTable;

/// The host's shared data (proxy-wasm `get_shared_data` / `set_shared_data`), or a fake.
pub trait SharedStore {
    fn get(&self, slot: &str) -> Option<Vec<u8>>;
    fn set(&self, slot: &str, value: &[u8]);
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Entry {
    hash: u64,
    until_ms: u64,
}

/// Keys are given by their hash ([`crate::keys::LimitKey::hash`]), computed once per request.
pub struct OverLimitCache {
    slots: SlotTable<Entry>,
    shared: Option<Box<dyn SharedStore>>,
}

impl OverLimitCache {
    /// `capacity` slots (0 disables the cache).
    pub fn new(capacity: usize, shared: Option<Box<dyn SharedStore>>) -> OverLimitCache {
        OverLimitCache {
            slots: SlotTable::new(capacity),
            shared,
        }
    }

    pub fn enabled(&self) -> bool {
        self.slots.capacity() > 0
    }

    /// Whether this worker's table has been allocated (it is on the first `mark`).
    pub fn allocated(&self) -> bool {
        self.slots.allocated()
    }

    fn shared_name(slot: usize) -> String {
        format!("cg.olc.{slot}")
    }

    /// Until when the key of `hash` is known to reject, if it still does at `now_ms`.
    pub fn rejecting_until(&self, hash: u64, now_ms: u64) -> Option<u64> {
        let live = |e: &Entry| (e.hash == hash && e.until_ms > now_ms).then_some(e.until_ms);
        if let Some(until) = self.slots.read(hash, live) {
            return Some(until);
        }
        let slot = self.slots.slot_of(hash)?;
        let entry = decode(&self.shared.as_ref()?.get(&Self::shared_name(slot))?)?;
        let until = live(&entry)?;
        self.slots.update(hash, |s| *s = Some(entry));
        Some(until)
    }

    /// Records that the key of `hash` rejects until `until_ms`.
    pub fn mark(&self, hash: u64, until_ms: u64) {
        let Some(slot) = self.slots.slot_of(hash) else {
            return;
        };
        let entry = Entry { hash, until_ms };
        self.slots.update(hash, |s| *s = Some(entry));
        if let Some(shared) = &self.shared {
            shared.set(&Self::shared_name(slot), &encode(entry));
        }
    }
}

fn encode(e: Entry) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&e.hash.to_le_bytes());
    out[8..].copy_from_slice(&e.until_ms.to_le_bytes());
    out
}

fn decode(bytes: &[u8]) -> Option<Entry> {
    let hash = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let until_ms = u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
    Some(Entry { hash, until_ms })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::slots::text_hash;
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::rc::Rc;

    #[derive(Default, Clone)]
    struct FakeShared(Rc<RefCell<HashMap<String, Vec<u8>>>>);

    impl SharedStore for FakeShared {
        fn get(&self, slot: &str) -> Option<Vec<u8>> {
            self.0.borrow().get(slot).cloned()
        }
        fn set(&self, slot: &str, value: &[u8]) {
            self.0.borrow_mut().insert(slot.to_string(), value.to_vec());
        }
    }

    #[test]
    fn remembers_until_the_deadline() {
        let c = OverLimitCache::new(64, None);
        assert_eq!(c.rejecting_until(text_hash("k"), 0), None);
        c.mark(text_hash("k"), 1_000);
        assert_eq!(c.rejecting_until(text_hash("k"), 999), Some(1_000));
        assert_eq!(
            c.rejecting_until(text_hash("k"), 1_000),
            None,
            "expired at the deadline"
        );
        assert_eq!(c.rejecting_until(text_hash("other"), 10), None);
    }

    #[test]
    fn collisions_never_answer_for_another_key() {
        let c = OverLimitCache::new(1, None);
        c.mark(text_hash("a"), 1_000);
        c.mark(text_hash("b"), 2_000);
        assert_eq!(
            c.rejecting_until(text_hash("a"), 10),
            None,
            "a was evicted by b"
        );
        assert_eq!(c.rejecting_until(text_hash("b"), 10), Some(2_000));
    }

    #[test]
    fn workers_share_what_they_learn() {
        let shared = FakeShared::default();
        let w1 = OverLimitCache::new(64, Some(Box::new(shared.clone())));
        let w2 = OverLimitCache::new(64, Some(Box::new(shared.clone())));
        w1.mark(text_hash("k"), 5_000);
        assert_eq!(w2.rejecting_until(text_hash("k"), 10), Some(5_000));
        assert_eq!(shared.0.borrow().len(), 1, "one slot, bounded");
    }

    #[test]
    fn the_table_is_allocated_on_first_use_only() {
        // Large enough to matter, small enough for `make unit-wasm`: Node's V8 may crash on
        // exit after a Wasm memory of tens of MiB.
        let shared = FakeShared::default();
        let idle = OverLimitCache::new(10_000, Some(Box::new(shared.clone())));
        let worker = OverLimitCache::new(10_000, Some(Box::new(shared.clone())));
        assert!(!idle.allocated() && !worker.allocated());
        assert_eq!(worker.rejecting_until(text_hash("k"), 0), None);
        assert!(
            !worker.allocated(),
            "a lookup that finds nothing allocates nothing"
        );
        worker.mark(text_hash("k"), 5_000);
        assert!(worker.allocated());
        assert!(
            !idle.allocated(),
            "a VM that serves no requests never allocates"
        );
        let reader = OverLimitCache::new(10_000, Some(Box::new(shared)));
        assert_eq!(reader.rejecting_until(text_hash("k"), 10), Some(5_000));
        assert!(
            reader.allocated(),
            "what another worker learnt is kept locally"
        );
    }

    #[test]
    fn disabled() {
        let c = OverLimitCache::new(0, None);
        c.mark(text_hash("k"), 5_000);
        assert!(!c.enabled());
        assert_eq!(c.rejecting_until(text_hash("k"), 10), None);
    }
}
