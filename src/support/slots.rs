//! One bounded table of slots, the memory of every per-worker cache (the over-limit cache,
//! leased quota, the rate-limit key memo).
//!
//! Bounded by construction: a fixed number of slots indexed by a hash; an entry that lands in
//! a taken slot replaces it. Every user stores enough in the entry to recognise its own (a
//! full 64-bit hash, or the inputs themselves), so a collision costs work, never a wrong
//! answer. The slots are allocated on the first write: a VM that serves no requests (Envoy's
//! main-thread VM) never pays for them.

use std::cell::RefCell;
use std::hash::{DefaultHasher, Hash, Hasher};

/// Hash of a key's text, the same in every worker (SipHash with fixed keys); never 0.
pub(crate) fn text_hash(text: &str) -> u64 {
    let mut h = DefaultHasher::new();
    text.hash(&mut h);
    h.finish().max(1)
}

/// A fixed number of slots of `T`, indexed by a hash.
pub(crate) struct SlotTable<T> {
    capacity: usize,
    slots: RefCell<Vec<Option<T>>>,
}

impl<T> SlotTable<T> {
    /// `capacity` slots (0: a table that never stores anything).
    pub(crate) fn new(capacity: usize) -> SlotTable<T> {
        SlotTable {
            capacity,
            slots: RefCell::new(Vec::new()),
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    #[cfg(test)]
    /// Whether the slots have been allocated (on the first write).
    pub(crate) fn allocated(&self) -> bool {
        self.slots.try_borrow().is_ok_and(|s| !s.is_empty())
    }

    /// The slot of `hash`, unless the table has no slots.
    pub(crate) fn slot_of(&self, hash: u64) -> Option<usize> {
        (self.capacity > 0).then(|| (hash % self.capacity as u64) as usize)
    }

    /// Reads the entry in `hash`'s slot, if there is one; allocates nothing.
    pub(crate) fn read<R>(&self, hash: u64, f: impl FnOnce(&T) -> Option<R>) -> Option<R> {
        let slot = self.slot_of(hash)?;
        let slots = self.slots.try_borrow().ok()?;
        f(slots.get(slot)?.as_ref()?)
    }

    /// Gives `f` `hash`'s slot to read or write (allocating the table first). `None` when the
    /// table has no slots (or is in use further up the stack).
    pub(crate) fn update<R>(&self, hash: u64, f: impl FnOnce(&mut Option<T>) -> R) -> Option<R> {
        let slot = self.slot_of(hash)?;
        let mut slots = self.slots.try_borrow_mut().ok()?;
        if slots.is_empty() {
            slots.resize_with(self.capacity, || None);
        }
        Some(f(slots.get_mut(slot)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn bounded_lazy_and_replacing() {
        let t: SlotTable<(u64, &str)> = SlotTable::new(4);
        assert!(!t.allocated());
        assert_eq!(t.read(1, |e| Some(e.1)), None);
        assert!(!t.allocated(), "a read allocates nothing");
        t.update(1, |s| *s = Some((1, "a")));
        assert!(t.allocated());
        assert_eq!(t.read(1, |e| Some(e.1)), Some("a"));
        t.update(5, |s| *s = Some((5, "b")));
        assert_eq!(
            t.read(1, |e| (e.0 == 1).then_some(e.1)),
            None,
            "5 took 1's slot"
        );
        assert_eq!(t.slot_of(5), Some(1));
    }

    #[test]
    fn no_slots_store_nothing() {
        let t: SlotTable<u64> = SlotTable::new(0);
        assert_eq!(t.update(1, |s| *s = Some(1)), None);
        assert_eq!(t.read(1, |e| Some(*e)), None);
        assert!(!t.allocated());
    }

    #[test]
    fn text_hashes_are_stable_and_never_zero() {
        assert_eq!(text_hash("k"), text_hash("k"));
        assert_ne!(text_hash("k"), text_hash("l"));
        assert_ne!(text_hash(""), 0);
    }
}
