//! Counts this thread's heap allocations (a reallocation counts as one), so tests can hold
//! the request paths to an allocation budget: a count is exact on any machine, where a time is
//! not; and the bytes it holds, so tests can hold a computation to a memory bound (its peak).
//! The test build's global allocator, over the system's (the filter's own build uses Talc: see
//! lib.rs).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
    /// Bytes this thread holds (its frees of another thread's blocks can take it below zero),
    /// and the most since the last [`peak_bytes`] began.
    static HELD: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

fn count() {
    // A thread being torn down has no counter left; nothing to count then.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

fn hold(bytes: i64) {
    let _ = HELD.try_with(|h| {
        let now = h.get() + bytes;
        h.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

// SAFETY: every call is passed on to `System` unchanged; the counter allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        hold(layout.size() as i64);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        hold(layout.size() as i64);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        hold(-(layout.size() as i64));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // Both blocks may be held at once while the contents move.
        hold(new_size as i64);
        hold(-(layout.size() as i64));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// `f`'s result and the allocations this thread made while it ran.
pub(crate) fn allocations<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = ALLOCATIONS.with(Cell::get);
    let out = f();
    (out, ALLOCATIONS.with(Cell::get) - before)
}

/// `f`'s result and the most bytes this thread held at once while it ran, above what it held
/// when it began.
pub(crate) fn peak_bytes<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = HELD.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let out = f();
    let peak = PEAK.with(Cell::get) - start;
    (out, usize::try_from(peak).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::{allocations, peak_bytes};
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn the_peak_is_what_was_held_at_once() {
        let ((), peak) = peak_bytes(|| {
            let a = vec![0u8; 1000];
            let b = vec![0u8; 500];
            drop((a, b));
            let _c = vec![0u8; 1200];
        });
        assert_eq!(peak, 1500);
    }

    #[test]
    fn counts_what_runs_inside_and_nothing_else() {
        let kept = vec![1u8; 8];
        let ((), n) = allocations(|| ());
        assert_eq!(n, 0);
        let (v, n) = allocations(|| {
            let mut v: Vec<u64> = vec![1];
            v.extend([2, 3]); // grows: a reallocation
            (v, String::from("x"))
        });
        assert_eq!(n, 3);
        drop((v, kept));
    }
}
