//! The worker's memory budget (`memory_budget`). A worker's Wasm VM serves all its streams, its
//! memory never shrinks, and an allocation it cannot make aborts it: every later request on
//! that worker, guarded or not, then gets Envoy's answer for a failed filter (`503` with
//! `failure_policy: FAIL_CLOSED`). So every large copy the filter makes is checked first
//! against what the heap holds now ([`crate::support::heap::held`]) plus what the copy takes, and a copy
//! the budget cannot hold is not made:
//!
//! - a response body for a record stops being copied: the record is stored by reference;
//! - a request body to fingerprint, or a gateway answer (a stored response to replay), is not
//!   read: the request gets `503 guard_overloaded`;
//! - a charge holds nothing of the body ([`crate::support::jsonscan`]); a body piece it cannot read is
//!   charged the limit's `unreadable` fallback.
//!
//! Small allocations (a request's keys, headers, calls) are not checked, nor is a short-lived
//! copy of up to [`SMALL`] bytes (a small answer, a small body read to be hashed or scanned):
//! the budget sits well below what the VM can grow to (at most a quarter of it), and they fit in
//! the rest. What accumulates while streams run (a body copied for its record) is always
//! checked.

/// A short-lived copy this small is made whatever the budget says (see the module's
/// documentation).
pub(crate) const SMALL: usize = 64 << 10;

/// The budget and where to read what the heap holds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    limit: usize,
    held: fn() -> usize,
}

impl Budget {
    /// A budget of `limit` bytes over this VM's heap.
    pub(crate) fn new(limit: u64) -> Budget {
        Budget::over(limit, crate::support::heap::held)
    }

    /// A budget of `limit` bytes over the heap `held` reads.
    pub(crate) fn over(limit: u64, held: fn() -> usize) -> Budget {
        Budget {
            limit: usize::try_from(limit).unwrap_or(usize::MAX),
            held,
        }
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// What the heap holds now.
    pub(crate) fn held(&self) -> usize {
        (self.held)()
    }

    /// Whether the heap can take `more` bytes within the budget.
    pub(crate) fn admits(&self, more: usize) -> bool {
        self.held().saturating_add(more) <= self.limit
    }

    /// Whether a short-lived copy of `more` bytes (freed before the event ends) may be made:
    /// always when it is [`SMALL`], else within the budget.
    pub(crate) fn admits_brief(&self, more: usize) -> bool {
        more <= SMALL || self.admits(more)
    }

    /// Appends `piece` to `buf`, growing it (doubling, at most to `cap` bytes, and never less
    /// than it needs) only within the budget and only if the heap can give the room; `false`
    /// (`buf` untouched) otherwise.
    pub(crate) fn append(&self, buf: &mut Vec<u8>, piece: &[u8], cap: usize) -> bool {
        let room = growth(buf, piece.len(), cap);
        if room > 0 && !self.reserve(buf, room) {
            return false;
        }
        buf.extend_from_slice(piece);
        true
    }

    /// Gives `buf` room for `total` bytes in all, if the budget and the heap allow.
    pub(crate) fn reserve(&self, buf: &mut Vec<u8>, total: usize) -> bool {
        let more = total.saturating_sub(buf.len());
        if total <= buf.capacity() {
            return true;
        }
        self.admits(total) && crate::support::heap::fallibly(|| buf.try_reserve_exact(more)).is_ok()
    }
}

/// The room [`Budget::append`] gives `buf` to take `more` bytes (doubling, at most to `cap`,
/// never less than it needs), or 0 when it has room already.
pub(crate) fn growth(buf: &Vec<u8>, more: usize, cap: usize) -> usize {
    let need = buf.len().saturating_add(more);
    if need <= buf.capacity() {
        0
    } else {
        buf.capacity().saturating_mul(2).min(cap).max(need)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    thread_local! {
        static HELD: Cell<usize> = const { Cell::new(0) };
    }

    fn held() -> usize {
        HELD.with(Cell::get)
    }

    #[test]
    fn admits_what_fits_with_what_is_held() {
        let b = Budget::over(1000, held);
        HELD.with(|h| h.set(600));
        assert!(b.admits(400));
        assert!(!b.admits(401));
        HELD.with(|h| h.set(usize::MAX));
        assert!(!b.admits(1), "no overflow");
    }

    #[test]
    fn a_small_brief_copy_is_always_made() {
        let b = Budget::over(1000, held);
        HELD.with(|h| h.set(5000));
        assert!(!b.admits(1));
        assert!(b.admits_brief(SMALL));
        assert!(!b.admits_brief(SMALL + 1));
    }

    #[test]
    fn append_grows_within_the_budget_or_not_at_all() {
        let b = Budget::over(100, held);
        HELD.with(|h| h.set(0));
        let mut buf = Vec::new();
        assert!(b.append(&mut buf, &[1; 30], 80));
        assert_eq!((buf.len(), buf.capacity()), (30, 30));
        assert!(b.append(&mut buf, &[2; 10], 80));
        assert_eq!(buf.capacity(), 60, "doubled");
        HELD.with(|h| h.set(50));
        assert!(
            b.append(&mut buf, &[3; 20], 80),
            "room left: no growth needed"
        );
        assert!(
            !b.append(&mut buf, &[4; 10], 80),
            "doubling to 80 would pass the budget"
        );
        assert_eq!(buf.len(), 60, "untouched");
        HELD.with(|h| h.set(0));
        assert!(b.append(&mut buf, &[4; 10], 80));
        assert_eq!(buf.capacity(), 80, "doubling stops at the cap");
        assert!(b.append(&mut buf, &[5; 30], 80));
        assert_eq!(buf.len(), 100, "past the cap when it must");
    }
}
