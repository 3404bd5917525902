//! The over-limit cache: once Redis says a counter rejects until time T, requests for that
//! counter are rejected locally until T, without a Redis call (the idea of envoyproxy/
//! ratelimit's local cache). It is exact, not approximate: `T` is the script's own
//! `retry_after`, the earliest time that counter could admit a request of this cost, and
//! counters only move towards "more rejected" until then.
//!
//! Memory is bounded by construction: a fixed table of slots indexed by a hash of the Redis
//! key (a colliding key simply overwrites the slot, which costs a Redis call, never a wrong
//! answer because the slot also stores the key's full 64-bit hash).
//!
//! The proxy's other workers learn what one worker learnt through a bounded log in the host's
//! shared data: the worker that marks a counter appends it, and every worker reads the log on
//! its tick, not per request. The host guards all shared data with one lock for the whole
//! proxy, so a read per request would make every worker's requests queue on it; per tick,
//! another worker learns a rejection within a tick, and until then its requests for that
//! counter ask Redis, which rejects them too.
//!
//! A counter of a limit with `overrides` (a tenant may have its own quota, set at any time) is
//! marked in a smaller table of this worker's only, with the quota it was counted with, and
//! answered from for at most [`OVERRIDE_REFRESH_MS`]: an override set meanwhile is read by
//! Redis within that, and the 429 the cache answers shows the quota and still the script's
//! own wait. The shared log has no room for the quota, so other workers learn such a counter
//! from Redis.

use crate::config::Quota;
use crate::support::slots::SlotTable;
use std::cell::Cell;

/// The host's shared data (proxy-wasm `get_shared_data` / `set_shared_data`), or a fake.
pub trait SharedStore {
    /// The value under `name` and its version; `None` when there is none (or the host cannot
    /// say).
    fn get(&self, name: &str) -> Option<(Vec<u8>, u32)>;
    /// Sets `name` to `value` if its version is still `version` (0: whatever it is); whether
    /// it was set.
    fn set(&self, name: &str, value: &[u8], version: u32) -> bool;
}

/// The shared log's name in the host's shared data.
const LOG: &str = "cg.olc.log";

/// Marks the shared log holds: the latest ones, in a ring. Marks beyond it within one tick
/// are learnt by the other workers from Redis instead.
pub(crate) const LOG_ENTRIES: usize = 64;

/// The log: the count of marks ever appended (u64), then [`LOG_ENTRIES`] entries.
const LOG_BYTES: usize = 8 + ENTRY_BYTES * LOG_ENTRIES;

const ENTRY_BYTES: usize = 16;

/// Attempts to append to the log while other workers append to it too.
const APPEND_ATTEMPTS: usize = 4;

/// The longest the cache answers for a counter of a limit with `overrides` before Redis is
/// asked again: a tenant's limit raised meanwhile admits its requests at most this long after.
pub(crate) const OVERRIDE_REFRESH_MS: u64 = 1_000;

/// Slots of the marks of limits with `overrides` (at most the cache's own slots).
pub(crate) const OWN_QUOTA_SLOTS: usize = 1024;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Entry {
    hash: u64,
    until_ms: u64,
}

/// A mark of a counter of a limit with `overrides`: until when it rejects, until when this
/// worker answers for it, and the tenant's own quota it was counted with (`None`: the
/// configuration's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OwnMark {
    hash: u64,
    until_ms: u64,
    fresh_until_ms: u64,
    quota: Option<Quota>,
}

/// Keys are given by their hash ([`crate::redis::keys::LimitKey::hash`]), computed once per request.
pub(crate) struct OverLimitCache {
    slots: SlotTable<Entry>,
    /// Marks of limits with `overrides`, this worker's only (allocated at the first).
    own: SlotTable<OwnMark>,
    shared: Option<Box<dyn SharedStore>>,
    /// The log's version this worker read last (0: never read one).
    seen: Cell<u32>,
}

impl OverLimitCache {
    /// `capacity` slots (0 disables the cache).
    pub(crate) fn new(capacity: usize, shared: Option<Box<dyn SharedStore>>) -> OverLimitCache {
        OverLimitCache {
            slots: SlotTable::new(capacity),
            own: SlotTable::new(capacity.min(OWN_QUOTA_SLOTS)),
            shared,
            seen: Cell::new(0),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.slots.capacity() > 0
    }

    #[cfg(test)]
    /// Whether this worker's table has been allocated (it is on the first mark it keeps).
    pub(crate) fn allocated(&self) -> bool {
        self.slots.allocated()
    }

    /// Until when the key of `hash` is known to reject, if it still does at `now_ms`, and the
    /// tenant's own quota it was counted with (`None`: the configuration's).
    pub(crate) fn rejecting_until(&self, hash: u64, now_ms: u64) -> Option<(u64, Option<Quota>)> {
        let own = self.own.read(hash, |m| {
            (m.hash == hash && m.fresh_until_ms > now_ms && m.until_ms > now_ms)
                .then_some((m.until_ms, m.quota))
        });
        own.or_else(|| {
            self.slots.read(hash, |e| {
                (e.hash == hash && e.until_ms > now_ms).then_some((e.until_ms, None))
            })
        })
    }

    /// Records that the key of `hash`, a counter of a limit with `overrides`, rejects until
    /// `until_ms`, counted with `quota` (a tenant's own; `None`: the configuration's): kept by
    /// this worker only, and answered from until [`OVERRIDE_REFRESH_MS`] after `now_ms` at
    /// most.
    pub(crate) fn mark_overridable(
        &self,
        hash: u64,
        until_ms: u64,
        now_ms: u64,
        quota: Option<Quota>,
    ) {
        if !self.enabled() {
            return;
        }
        let mark = OwnMark {
            hash,
            until_ms,
            fresh_until_ms: now_ms.saturating_add(OVERRIDE_REFRESH_MS),
            quota,
        };
        self.own.update(hash, |s| *s = Some(mark));
    }

    /// Records that the key of `hash` rejects until `until_ms`, here and in the shared log.
    pub(crate) fn mark(&self, hash: u64, until_ms: u64) {
        if !self.enabled() {
            return;
        }
        let entry = Entry { hash, until_ms };
        self.keep(entry);
        let Some(shared) = &self.shared else {
            return;
        };
        for _ in 0..APPEND_ATTEMPTS {
            let (mut log, version) = shared.get(LOG).unwrap_or_default();
            append(&mut log, entry);
            if shared.set(LOG, &log, version) {
                return;
            }
        }
    }

    /// Learns the marks other workers appended to the shared log since this worker last read
    /// it (the root's tick). Marks already past are skipped: an idle worker allocates nothing.
    pub(crate) fn sync(&self, now_ms: u64) {
        let (Some(shared), true) = (&self.shared, self.enabled()) else {
            return;
        };
        let Some((log, version)) = shared.get(LOG) else {
            return;
        };
        if version == self.seen.replace(version) && version != 0 {
            return;
        }
        for entry in entries(&log).filter(|e| e.until_ms > now_ms) {
            self.keep(entry);
        }
    }

    fn keep(&self, entry: Entry) {
        self.slots.update(entry.hash, |s| *s = Some(entry));
    }
}

/// Appends `entry` to the log `log` (an empty or unreadable one starts anew).
fn append(log: &mut Vec<u8>, entry: Entry) {
    let count = match log.get(..8).map(<[u8; 8]>::try_from) {
        Some(Ok(bytes)) if log.len() == LOG_BYTES => u64::from_le_bytes(bytes),
        _ => {
            log.clear();
            log.resize(LOG_BYTES, 0);
            0
        }
    };
    let at = 8 + ENTRY_BYTES * (count % LOG_ENTRIES as u64) as usize;
    if let Some(slot) = log.get_mut(at..at + ENTRY_BYTES) {
        slot.copy_from_slice(&encode(entry));
    }
    if let Some(head) = log.get_mut(..8) {
        head.copy_from_slice(&count.wrapping_add(1).to_le_bytes());
    }
}

/// The entries of the log `log` (none if it is not one).
fn entries(log: &[u8]) -> impl Iterator<Item = Entry> + '_ {
    let body = log
        .get(8..)
        .filter(|_| log.len() == LOG_BYTES)
        .unwrap_or_default();
    body.chunks_exact(ENTRY_BYTES)
        .filter_map(decode)
        .filter(|e| e.hash != 0)
}

fn encode(e: Entry) -> [u8; ENTRY_BYTES] {
    let mut out = [0u8; ENTRY_BYTES];
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
    use crate::support::slots::text_hash;
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::rc::Rc;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The host's shared data: values with versions, set only at the version given (0: any).
    /// `race` appends a mark of its own before the next set, once: another worker's append
    /// between a worker's read and its write.
    /// A value and its version.
    type Versioned = (Vec<u8>, u32);

    #[derive(Default, Clone)]
    struct FakeShared {
        data: Rc<RefCell<HashMap<String, Versioned>>>,
        versions: Rc<Cell<u32>>,
        race: Rc<Cell<Option<Entry>>>,
    }

    impl FakeShared {
        fn put(&self, name: &str, value: &[u8]) {
            self.versions.set(self.versions.get() + 1);
            let entry = (value.to_vec(), self.versions.get());
            self.data.borrow_mut().insert(name.to_string(), entry);
        }
    }

    impl SharedStore for FakeShared {
        fn get(&self, name: &str) -> Option<(Vec<u8>, u32)> {
            self.data.borrow().get(name).cloned()
        }
        fn set(&self, name: &str, value: &[u8], version: u32) -> bool {
            if let Some(other) = self.race.take() {
                let (mut log, _) = self.get(name).unwrap_or_default();
                append(&mut log, other);
                self.put(name, &log);
            }
            let current = self.data.borrow().get(name).map_or(0, |(_, v)| *v);
            if version != 0 && version != current {
                return false;
            }
            self.put(name, value);
            true
        }
    }

    fn cache(slots: usize, shared: &FakeShared) -> OverLimitCache {
        OverLimitCache::new(slots, Some(Box::new(shared.clone())))
    }

    /// Two workers' caches of `slots` slots over one shared data.
    fn workers(slots: usize) -> (FakeShared, OverLimitCache, OverLimitCache) {
        let shared = FakeShared::default();
        let (w1, w2) = (cache(slots, &shared), cache(slots, &shared));
        (shared, w1, w2)
    }

    #[test]
    fn remembers_until_the_deadline() {
        let c = OverLimitCache::new(64, None);
        assert_eq!(c.rejecting_until(text_hash("k"), 0), None);
        c.mark(text_hash("k"), 1_000);
        assert_eq!(c.rejecting_until(text_hash("k"), 999), Some((1_000, None)));
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
        assert_eq!(c.rejecting_until(text_hash("b"), 10), Some((2_000, None)));
    }

    #[test]
    fn workers_learn_what_another_learnt_on_their_tick() {
        let (shared, w1, w2) = workers(64);
        w1.mark(text_hash("k"), 5_000);
        assert_eq!(w1.rejecting_until(text_hash("k"), 10), Some((5_000, None)));
        assert_eq!(
            w2.rejecting_until(text_hash("k"), 10),
            None,
            "a request reads no shared data"
        );
        w2.sync(10);
        assert_eq!(w2.rejecting_until(text_hash("k"), 10), Some((5_000, None)));
        let data = shared.data.borrow();
        assert_eq!(data.len(), 1, "one log");
        assert_eq!(data.get(LOG).map(|(log, _)| log.len()), Some(LOG_BYTES));
    }

    #[test]
    fn the_log_holds_the_latest_marks() {
        let (_, w1, w2) = workers(4096);
        let extra = 36;
        for i in 0..LOG_ENTRIES + extra {
            w1.mark(text_hash(&format!("k{i}")), 5_000);
        }
        w2.sync(10);
        let hash = |i: usize| text_hash(&format!("k{i}"));
        let known = |i: usize| w2.rejecting_until(hash(i), 10).is_some();
        let latest = extra..LOG_ENTRIES + extra;
        assert!(
            (0..extra).all(|i| !known(i)),
            "the oldest marks were overwritten"
        );
        // Each of the latest is learnt, unless another of them took its slot.
        let slot = |i: usize| w2.slots.slot_of(hash(i));
        let collides = |i: usize| latest.clone().any(|j| j != i && slot(j) == slot(i));
        assert!(latest.clone().all(|i| known(i) || collides(i)));
        assert!(latest.clone().filter(|&i| known(i)).count() >= LOG_ENTRIES - 4);
    }

    #[test]
    fn a_mark_past_is_not_learnt_and_costs_nothing() {
        let (_, w1, idle) = workers(10_000);
        w1.mark(text_hash("k"), 5_000);
        idle.sync(5_000);
        assert_eq!(idle.rejecting_until(text_hash("k"), 10), None);
        assert!(!idle.allocated(), "nothing live to keep: no table");
    }

    #[test]
    fn an_append_that_races_another_keeps_both() {
        let (shared, w1, w2) = workers(64);
        w1.mark(text_hash("first"), 5_000);
        shared.race.set(Some(Entry {
            hash: text_hash("theirs"),
            until_ms: 5_000,
        }));
        w1.mark(text_hash("mine"), 5_000);
        w2.sync(10);
        for k in ["first", "theirs", "mine"] {
            assert_eq!(
                w2.rejecting_until(text_hash(k), 10),
                Some((5_000, None)),
                "{k}"
            );
        }
    }

    #[test]
    fn a_log_read_once_is_not_read_again_until_it_changes() {
        let (_, w1, w2) = workers(1);
        w1.mark(text_hash("a"), 5_000);
        w2.sync(10);
        assert_eq!(w2.rejecting_until(text_hash("a"), 10), Some((5_000, None)));
        // w2's one slot goes to a key of its own; the log did not change, so the tick keeps it.
        w2.slots.update(text_hash("b"), |s| {
            *s = Some(Entry {
                hash: text_hash("b"),
                until_ms: 5_000,
            })
        });
        w2.sync(10);
        assert_eq!(w2.rejecting_until(text_hash("b"), 10), Some((5_000, None)));
        assert_eq!(w2.rejecting_until(text_hash("a"), 10), None);
    }

    #[test]
    fn a_value_that_is_not_a_log_is_started_anew() {
        let shared = FakeShared::default();
        shared.put(LOG, b"not a log");
        let (w1, w2) = (cache(64, &shared), cache(64, &shared));
        w2.sync(10);
        assert!(!w2.allocated(), "nothing read from it");
        w1.mark(text_hash("k"), 5_000);
        w2.sync(10);
        assert_eq!(w2.rejecting_until(text_hash("k"), 10), Some((5_000, None)));
    }

    #[test]
    fn the_table_is_allocated_on_first_use_only() {
        // Large enough to matter, small enough for `make unit-wasm`: Node's V8 may crash on
        // exit after a Wasm memory of tens of MiB.
        let shared = FakeShared::default();
        let idle = cache(10_000, &shared);
        let worker = cache(10_000, &shared);
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
        let reader = cache(10_000, &shared);
        reader.sync(10);
        assert_eq!(
            reader.rejecting_until(text_hash("k"), 10),
            Some((5_000, None))
        );
        assert!(
            reader.allocated(),
            "what another worker learnt is kept locally"
        );
    }

    #[test]
    fn a_limit_with_overrides_is_marked_by_this_worker_for_a_refresh_with_its_quota() {
        let (shared, w1, w2) = workers(64);
        let own = Quota {
            limit: 5,
            window_ms: 60_000,
        };
        w1.mark_overridable(text_hash("k"), 50_000, 10, Some(own));
        assert_eq!(
            w1.rejecting_until(text_hash("k"), 20),
            Some((50_000, Some(own))),
            "the script's own wait, and the quota"
        );
        assert_eq!(
            w1.rejecting_until(text_hash("k"), 10 + OVERRIDE_REFRESH_MS),
            None,
            "Redis is asked again after a refresh"
        );
        assert!(!w1.allocated(), "the shared table is not touched");
        assert!(shared.data.borrow().is_empty(), "nothing in the log");
        w2.sync(20);
        assert_eq!(w2.rejecting_until(text_hash("k"), 20), None);
        // The configuration's quota: the same, without one.
        w1.mark_overridable(text_hash("k"), 500, 600, None);
        assert_eq!(w1.rejecting_until(text_hash("k"), 20), Some((500, None)));
        assert_eq!(w1.rejecting_until(text_hash("k"), 500), None, "expired");
        assert_eq!(w1.own.capacity(), 64, "at most the cache's slots");
        assert_eq!(
            OverLimitCache::new(10_000, None).own.capacity(),
            OWN_QUOTA_SLOTS
        );
        let off = OverLimitCache::new(0, None);
        off.mark_overridable(text_hash("k"), 50_000, 10, Some(own));
        assert_eq!(off.rejecting_until(text_hash("k"), 20), None);
    }

    #[test]
    fn disabled() {
        let shared = FakeShared::default();
        let c = cache(0, &shared);
        c.mark(text_hash("k"), 5_000);
        c.sync(10);
        assert!(!c.enabled());
        assert_eq!(c.rejecting_until(text_hash("k"), 10), None);
        assert!(
            shared.data.borrow().is_empty(),
            "a disabled cache shares nothing"
        );
    }
}
