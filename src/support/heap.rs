//! The filter's heap in the VM: small blocks by size class in front of a general allocator.
//!
//! A request allocates a few dozen small blocks (keys, the call's words, its body, the
//! answer's parts, the `RateLimit` values) and frees them before the next request's. A general
//! allocator searches its bins, splits and coalesces for each; here a block of up to
//! [`MAX_CLASS_SIZE`] bytes comes from its class's list of freed blocks when there is one,
//! last freed first (the block most likely still in the CPU's caches), and goes back onto it:
//! no search, no split, no coalescing. Larger or more aligned blocks, and the lists' first
//! blocks, come from the general allocator (Talc in the VM).
//!
//! A list keeps at most [`MAX_FREE_BYTES`] of its class (the rest goes back to the general
//! allocator), so a burst of one size leaves at most that much idle per class.
//!
//! The heap counts what it holds: the bytes the general allocator gave it and it did not give
//! back (class blocks idle in their lists included). [`held`] reads it; the worker's memory
//! budget ([`crate::support::memory`]) is checked against it before any large copy. An allocation the
//! general allocator cannot make (the VM's memory cannot grow) is reported through the hook
//! set with [`on_failure`] before the null goes back, unless it was asked for in [`fallibly`]
//! (a `try_reserve` whose caller handles the refusal): otherwise Rust aborts the VM next, and
//! the log must say why.
//!
//! The VM's memory (what Talc takes from `memory.grow`, [`Growing`]) grows for an allocation
//! asked in [`fallibly`] only up to [`Classes::cap_growth`]'s cap: past it that allocation
//! fails (its caller handles it: a record stored by reference, a body not read), so a
//! fragmented heap does not grow without end for the big copies the budget already checks. An
//! allocation asked otherwise always may grow it (failing it would abort the VM).

use std::alloc::{GlobalAlloc, Layout};
use std::cell::{Cell, UnsafeCell};
use std::ptr;

/// The largest block served by class.
pub(crate) const MAX_CLASS_SIZE: usize = 1024;

/// The alignment of every class block: enough for any type the filter allocates.
const CLASS_ALIGN: usize = 16;

/// Class sizes: every 16 bytes up to 256, then coarser steps up to [`MAX_CLASS_SIZE`].
const SIZES: [usize; 20] = [
    16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256, 384, 512, 768, 1024,
];

/// The most idle bytes one class keeps for reuse.
pub(crate) const MAX_FREE_BYTES: usize = 64 * 1024;

/// The class of a block of `layout`, if it is served by class.
fn class_of(layout: Layout) -> Option<usize> {
    if layout.align() > CLASS_ALIGN || layout.size() > MAX_CLASS_SIZE {
        return None;
    }
    let size = layout.size();
    if size <= 256 {
        return Some(size.saturating_sub(1) / 16);
    }
    SIZES.iter().position(|&s| size <= s)
}

/// A class's idle blocks: a list threaded through the blocks themselves.
#[derive(Clone, Copy)]
struct FreeList {
    head: *mut u8,
    len: usize,
}

const EMPTY: FreeList = FreeList {
    head: ptr::null_mut(),
    len: 0,
};

/// What is told of an allocation that failed outside [`fallibly`]: its size and what the heap
/// held then.
pub(crate) type FailureHook = fn(size: usize, held: usize);

/// Size classes over `A`, the general allocator.
pub(crate) struct Classes<A> {
    general: A,
    lists: UnsafeCell<[FreeList; SIZES.len()]>,
    /// Bytes taken from the general allocator and not given back.
    held: Cell<usize>,
    /// Inside [`fallibly`]: a failure is the caller's to handle.
    fallible: Cell<bool>,
    hook: Cell<Option<FailureHook>>,
    /// The VM memory's size past which a fallible allocation may not grow it (0: no cap).
    growth_cap: Cell<usize>,
}

impl<A> Classes<A> {
    pub(crate) const fn new(general: A) -> Classes<A> {
        Classes {
            general,
            lists: UnsafeCell::new([EMPTY; SIZES.len()]),
            held: Cell::new(0),
            fallible: Cell::new(false),
            hook: Cell::new(None),
            growth_cap: Cell::new(0),
        }
    }

    /// Whether a fallible allocation may grow the VM's memory from `size` bytes by `more`.
    pub(crate) fn may_grow(&self, size: usize, more: usize) -> bool {
        let cap = self.growth_cap.get();
        !self.fallible.get() || cap == 0 || size.saturating_add(more) <= cap
    }

    /// From now on a fallible allocation does not grow the VM's memory past `bytes` (0: no
    /// cap).
    pub(crate) fn cap_growth(&self, bytes: usize) {
        self.growth_cap.set(bytes);
    }

    /// Bytes the general allocator gave this heap and did not get back.
    pub(crate) fn held(&self) -> usize {
        self.held.get()
    }

    /// `f`'s result; an allocation that fails inside it is not reported (the caller asked
    /// with `try_reserve` and handles the refusal).
    pub(crate) fn fallibly<T>(&self, f: impl FnOnce() -> T) -> T {
        let was = self.fallible.replace(true);
        let out = f();
        self.fallible.set(was);
        out
    }

    /// Reports a failed allocation to `hook` from now on.
    pub(crate) fn on_failure(&self, hook: FailureHook) {
        self.hook.set(Some(hook));
    }
}

// SAFETY: the VM runs the filter on one thread (wasm32 without atomics has no other), so the
// lists are never touched by two threads at once.
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
unsafe impl<A: Sync> Sync for Classes<A> {}

impl<A: GlobalAlloc> Classes<A> {
    /// A block of the general allocator, counted (a failure reported).
    ///
    /// # Safety
    /// `layout` has a non-zero size.
    unsafe fn general_alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let block = unsafe { self.general.alloc(layout) };
        self.counted(block, 0, layout.size())
    }

    /// # Safety
    /// `block` came from [`Classes::general_alloc`] (or `general_realloc`) with `layout`.
    unsafe fn general_dealloc(&self, block: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.general.dealloc(block, layout) };
        self.held.set(self.held.get().saturating_sub(layout.size()));
    }

    /// # Safety
    /// `block` came from the general allocator with `layout`; `new_size` is non-zero.
    unsafe fn general_realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let moved = unsafe { self.general.realloc(block, layout, new_size) };
        self.counted(moved, layout.size(), new_size)
    }

    /// After the general allocator answered a request that turns `old` held bytes into `new`:
    /// the count follows a success; a failure (null) is reported unless it was asked for
    /// fallibly.
    fn counted(&self, block: *mut u8, old: usize, new: usize) -> *mut u8 {
        if block.is_null() {
            if let (false, Some(hook)) = (self.fallible.get(), self.hook.get()) {
                hook(new, self.held.get());
            }
        } else {
            self.held
                .set(self.held.get().saturating_sub(old).saturating_add(new));
        }
        block
    }

    /// The layout the general allocator gives a block of class `c`.
    fn class_layout(c: usize) -> Option<Layout> {
        Layout::from_size_align(*SIZES.get(c)?, CLASS_ALIGN).ok()
    }

    /// # Safety
    /// `c` is a class index; no other reference to the lists is live.
    unsafe fn take(&self, c: usize) -> *mut u8 {
        // SAFETY: the caller's; `c` indexes the lists.
        let list = unsafe { &mut (*self.lists.get())[c] };
        if list.head.is_null() {
            return match Self::class_layout(c) {
                // SAFETY: a non-zero size.
                Some(layout) => unsafe { self.general_alloc(layout) },
                None => ptr::null_mut(),
            };
        }
        let block = list.head;
        // SAFETY: an idle block of the list holds the next one's address in its first bytes
        // (written by `give`), and is at least 16 bytes, aligned to 16.
        list.head = unsafe { block.cast::<*mut u8>().read() };
        list.len -= 1;
        block
    }

    /// # Safety
    /// `block` came from `take(c)` and is not used after this; no other reference to the
    /// lists is live.
    unsafe fn give(&self, c: usize, block: *mut u8) {
        // SAFETY: the caller's; `c` indexes the lists.
        let list = unsafe { &mut (*self.lists.get())[c] };
        let Some(layout) = Self::class_layout(c) else {
            return;
        };
        if list.len * layout.size() >= MAX_FREE_BYTES {
            // SAFETY: the block came from the general allocator with this layout.
            unsafe { self.general_dealloc(block, layout) };
            return;
        }
        // SAFETY: the block is ours, at least 16 bytes, aligned to 16.
        unsafe { block.cast::<*mut u8>().write(list.head) };
        list.head = block;
        list.len += 1;
    }
}

// SAFETY: a block of a class is a block of at least the class's size and alignment 16, taken
// from the general allocator with that layout and handed to one owner at a time; every other
// layout is passed on to the general allocator unchanged.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Classes<A> {
    #[inline(never)]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match class_of(layout) {
            // SAFETY: a class index; the lists are not borrowed elsewhere.
            Some(c) => unsafe { self.take(c) },
            // SAFETY: the caller's contract, passed on.
            None => unsafe { self.general_alloc(layout) },
        }
    }

    #[inline(never)]
    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        match class_of(layout) {
            // SAFETY: allocated with this layout, so from `take(c)`.
            Some(c) => unsafe { self.give(c, block) },
            // SAFETY: the caller's contract, passed on.
            None => unsafe { self.general_dealloc(block, layout) },
        }
    }

    #[inline(never)]
    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
            return ptr::null_mut();
        };
        match (class_of(layout), class_of(new_layout)) {
            (Some(a), Some(b)) if a == b => block,
            // SAFETY: the caller's contract, passed on (neither block is a class's).
            (None, None) => unsafe { self.general_realloc(block, layout, new_size) },
            _ => {
                // SAFETY: `new_layout` is valid and non-zero (the caller's contract).
                let moved = unsafe { self.alloc(new_layout) };
                if !moved.is_null() {
                    // SAFETY: both blocks hold at least the smaller size; they are distinct.
                    unsafe {
                        ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
                        self.dealloc(block, layout);
                    }
                }
                moved
            }
        }
    }
}

/// What this VM's heap holds (see [`Classes::held`]). Off the VM (tests, host tools) there is
/// no such heap: what [`pretend_held`] last set on this thread.
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test)))]
pub(crate) fn held() -> usize {
    crate::ALLOCATOR.held()
}

/// `f`'s result, an allocation failure inside it left to the caller (see [`Classes::fallibly`]).
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test)))]
pub(crate) fn fallibly<T>(f: impl FnOnce() -> T) -> T {
    crate::ALLOCATOR.fallibly(f)
}

/// Reports this VM's failed allocations to `hook` (see [`Classes::on_failure`]).
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test)))]
pub(crate) fn on_failure(hook: FailureHook) {
    crate::ALLOCATOR.on_failure(hook);
}

/// Caps the VM memory's growth for fallible allocations (see [`Classes::cap_growth`]).
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test)))]
pub(crate) fn cap_growth(bytes: usize) {
    crate::ALLOCATOR.cap_growth(bytes);
}

/// The Wasm memory as Talc's source of heap: grown by whole pages when Talc runs out, the new
/// pages added to the end of the heap (or claimed as a heap of their own if they do not
/// follow it), unless [`Classes::may_grow`] says no for the allocation asking.
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test)))]
#[derive(Debug, Default)]
pub(crate) struct Growing {
    end: Option<ptr::NonNull<u8>>,
}

#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test)))]
impl Growing {
    pub(crate) const fn new() -> Growing {
        Growing { end: None }
    }
}

/// A Wasm page.
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test)))]
const PAGE: usize = 64 << 10;

// SAFETY: it allocates nothing (no Rust allocator, no container); the memory it hands Talc is
// fresh Wasm memory, claimed once, never touched by anything else.
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test)))]
unsafe impl talc::source::Source for Growing {
    fn acquire<B: talc::base::binning::Binning>(
        talc: &mut talc::base::Talc<Self, B>,
        layout: Layout,
    ) -> Result<(), ()> {
        // Room for the block, its alignment and Talc's bookkeeping around it, in pages.
        let bytes = layout
            .size()
            .saturating_add(layout.align())
            .saturating_add(4096);
        let pages = bytes.div_ceil(PAGE);
        let size = core::arch::wasm32::memory_size(0).saturating_mul(PAGE);
        if !crate::ALLOCATOR.may_grow(size, pages.saturating_mul(PAGE)) {
            return Err(());
        }
        let old_pages = core::arch::wasm32::memory_grow(0, pages);
        if old_pages == usize::MAX {
            return Err(());
        }
        let base = (old_pages * PAGE) as *mut u8;
        let end = base.wrapping_add(pages * PAGE);
        match talc.source.end.take() {
            // SAFETY: the heap ends where the new pages begin: they extend it.
            Some(old) if old.as_ptr() == base => {
                talc.source.end = Some(unsafe { talc.extend(old, end) });
            }
            // SAFETY: fresh pages of the VM's memory, Talc's alone from now on.
            _ => talc.source.end = unsafe { talc.claim(base, pages * PAGE) },
        }
        Ok(())
    }
}

#[cfg(not(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test))))]
thread_local! {
    static PRETEND_HELD: Cell<usize> = const { Cell::new(0) };
}

/// Off the VM: what [`pretend_held`] last set on this thread (0 by default).
#[cfg(not(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test))))]
pub(crate) fn held() -> usize {
    PRETEND_HELD.with(Cell::get)
}

/// Off the VM: what [`held`] says on this thread from now on (a test's heap).
#[cfg(not(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test))))]
pub(crate) fn pretend_held(bytes: usize) {
    PRETEND_HELD.with(|h| h.set(bytes));
}

/// Off the VM: `f`'s result.
#[cfg(not(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test))))]
pub(crate) fn fallibly<T>(f: impl FnOnce() -> T) -> T {
    f()
}

/// Off the VM: nothing to report to.
#[cfg(not(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test))))]
pub(crate) fn on_failure(_hook: FailureHook) {}

/// Off the VM: no memory to cap.
#[cfg(not(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test))))]
pub(crate) fn cap_growth(_bytes: usize) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::System;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).expect("a valid layout")
    }

    #[test]
    fn every_small_size_has_a_class_that_holds_it() {
        for size in 1..=MAX_CLASS_SIZE {
            for align in [1, 2, 4, 8, 16] {
                let c = class_of(layout(size, align)).expect("a class");
                assert!(SIZES[c] >= size, "size {size} in class {}", SIZES[c]);
                assert!(
                    c == 0 || SIZES[c - 1] < size,
                    "size {size}: the smallest class"
                );
            }
        }
        assert_eq!(class_of(layout(MAX_CLASS_SIZE + 1, 8)), None);
        assert_eq!(class_of(layout(64, 32)), None, "more aligned than a class");
    }

    #[test]
    fn a_freed_block_is_the_next_one_of_its_class_and_only_of_its_class() {
        let heap = Classes::new(System);
        unsafe {
            let a = heap.alloc(layout(40, 8));
            let b = heap.alloc(layout(40, 8));
            assert_ne!(a, b);
            assert_eq!(a as usize % CLASS_ALIGN, 0);
            heap.dealloc(a, layout(40, 8));
            let other = heap.alloc(layout(100, 8));
            assert_ne!(other, a, "another class");
            assert_eq!(
                heap.alloc(layout(33, 1)),
                a,
                "the last freed block of the class"
            );
            for (p, l) in [
                (a, layout(33, 1)),
                (b, layout(40, 8)),
                (other, layout(100, 8)),
            ] {
                heap.dealloc(p, l);
            }
        }
    }

    #[test]
    fn blocks_are_distinct_and_keep_what_was_written() {
        let heap = Classes::new(System);
        let sizes = [1, 15, 16, 17, 100, 256, 257, 700, 1024, 1025, 5000];
        unsafe {
            for round in 0..3u8 {
                let blocks: Vec<(*mut u8, Layout)> = sizes
                    .iter()
                    .map(|&s| (heap.alloc(layout(s, 8)), layout(s, 8)))
                    .collect();
                for (i, (p, l)) in blocks.iter().enumerate() {
                    assert!(!p.is_null());
                    ptr::write_bytes(*p, round.wrapping_add(i as u8), l.size());
                }
                for (i, (p, l)) in blocks.iter().enumerate() {
                    let bytes = std::slice::from_raw_parts(*p, l.size());
                    assert!(bytes.iter().all(|&b| b == round.wrapping_add(i as u8)));
                }
                for (p, l) in blocks {
                    heap.dealloc(p, l);
                }
            }
        }
    }

    #[test]
    fn realloc_keeps_the_contents_across_classes_and_to_the_general_allocator() {
        let heap = Classes::new(System);
        unsafe {
            let mut l = layout(10, 1);
            let mut p = heap.alloc(l);
            ptr::copy_nonoverlapping(b"0123456789".as_ptr(), p, 10);
            let same = heap.realloc(p, l, 16);
            assert_eq!(same, p, "the same class: the same block");
            l = layout(16, 1);
            for size in [300, 2000, 9000, 600, 12] {
                p = heap.realloc(p, l, size);
                assert!(!p.is_null());
                l = layout(size, 1);
                assert_eq!(std::slice::from_raw_parts(p, 10), b"0123456789");
            }
            heap.dealloc(p, l);
        }
    }

    #[test]
    fn the_heap_counts_what_the_general_allocator_gave_it() {
        let heap = Classes::new(System);
        unsafe {
            let small = heap.alloc(layout(40, 8));
            assert_eq!(heap.held(), 48, "a class block: its class's size");
            heap.dealloc(small, layout(40, 8));
            assert_eq!(heap.held(), 48, "idle in its list, still held");
            let big = heap.alloc(layout(5000, 8));
            assert_eq!(heap.held(), 5048);
            let bigger = heap.realloc(big, layout(5000, 8), 9000);
            assert_eq!(heap.held(), 9048);
            let small_again = heap.realloc(bigger, layout(9000, 8), 100);
            assert_eq!(heap.held(), 48 + 112, "moved into a class");
            heap.dealloc(small_again, layout(100, 8));
        }
    }

    /// A general allocator that refuses everything.
    struct Full;

    unsafe impl GlobalAlloc for Full {
        unsafe fn alloc(&self, _: Layout) -> *mut u8 {
            ptr::null_mut()
        }
        unsafe fn dealloc(&self, _: *mut u8, _: Layout) {}
    }

    thread_local! {
        static REPORTED: Cell<Option<(usize, usize)>> = const { Cell::new(None) };
    }

    #[test]
    fn a_failure_is_reported_unless_asked_for_fallibly() {
        fn hook(size: usize, held: usize) {
            REPORTED.with(|r| r.set(Some((size, held))));
        }
        let heap = Classes::new(Full);
        heap.on_failure(hook);
        unsafe {
            assert!(heap.fallibly(|| heap.alloc(layout(4096, 8))).is_null());
            assert_eq!(REPORTED.with(Cell::get), None, "the caller handles it");
            assert!(heap.alloc(layout(4096, 8)).is_null());
        }
        assert_eq!(REPORTED.with(Cell::get), Some((4096, 0)));
        assert_eq!(heap.held(), 0);
    }

    #[test]
    fn only_a_fallible_allocation_is_kept_under_the_growth_cap() {
        let heap = Classes::new(System);
        assert!(
            heap.fallibly(|| heap.may_grow(usize::MAX / 2, 1)),
            "no cap set"
        );
        heap.cap_growth(100);
        assert!(
            heap.may_grow(50, 60),
            "an allocation that cannot fail may always grow it"
        );
        assert!(heap.fallibly(|| heap.may_grow(50, 50)));
        assert!(!heap.fallibly(|| heap.may_grow(50, 51)));
        assert!(
            !heap.fallibly(|| heap.may_grow(usize::MAX, 1)),
            "no overflow"
        );
    }

    #[test]
    fn a_class_keeps_at_most_its_bound_idle() {
        let heap = Classes::new(System);
        let l = layout(1024, 8);
        let n = MAX_FREE_BYTES / 1024 + 10;
        unsafe {
            let blocks: Vec<*mut u8> = (0..n).map(|_| heap.alloc(l)).collect();
            for p in blocks {
                heap.dealloc(p, l);
            }
            let c = class_of(l).expect("a class");
            assert_eq!((*heap.lists.get())[c].len, MAX_FREE_BYTES / 1024);
        }
    }
}
