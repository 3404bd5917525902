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

use std::alloc::{GlobalAlloc, Layout};
use std::cell::UnsafeCell;
use std::ptr;

/// The largest block served by class.
pub const MAX_CLASS_SIZE: usize = 1024;

/// The alignment of every class block: enough for any type the filter allocates.
const CLASS_ALIGN: usize = 16;

/// Class sizes: every 16 bytes up to 256, then coarser steps up to [`MAX_CLASS_SIZE`].
const SIZES: [usize; 20] = [
    16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256, 384, 512, 768, 1024,
];

/// The most idle bytes one class keeps for reuse.
pub const MAX_FREE_BYTES: usize = 64 * 1024;

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

/// Size classes over `A`, the general allocator.
pub struct Classes<A> {
    general: A,
    lists: UnsafeCell<[FreeList; SIZES.len()]>,
}

impl<A> Classes<A> {
    pub const fn new(general: A) -> Classes<A> {
        Classes {
            general,
            lists: UnsafeCell::new([EMPTY; SIZES.len()]),
        }
    }
}

// SAFETY: the VM runs the filter on one thread (wasm32 without atomics has no other), so the
// lists are never touched by two threads at once.
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
unsafe impl<A: Sync> Sync for Classes<A> {}

impl<A: GlobalAlloc> Classes<A> {
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
                Some(layout) => unsafe { self.general.alloc(layout) },
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
            unsafe { self.general.dealloc(block, layout) };
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
            None => unsafe { self.general.alloc(layout) },
        }
    }

    #[inline(never)]
    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        match class_of(layout) {
            // SAFETY: allocated with this layout, so from `take(c)`.
            Some(c) => unsafe { self.give(c, block) },
            // SAFETY: the caller's contract, passed on.
            None => unsafe { self.general.dealloc(block, layout) },
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
            (None, None) => unsafe { self.general.realloc(block, layout, new_size) },
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
