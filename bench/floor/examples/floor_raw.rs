//! `wasm_floor_raw`: `wasm_floor` (read `:path`, bump `floor.requests`) written on the
//! proxy-wasm ABI itself, without the Rust SDK: no dispatcher (its table of contexts, the
//! trait objects, the `RefCell`s), and only the exports the floor needs, so Envoy enters the
//! VM for a stream's creation, its request headers, its end and its deletion, and for nothing
//! else (the host skips a callback the module does not export). Beside `wasm_floor` it prices
//! what a filter pays for the SDK's dispatch and for the callbacks it does not use;
//! `wasm_floor_raw_all` (floor_raw_all.rs) is this one exporting every stream callback, so the
//! two are told apart.
//!
//! It ignores every host error and never panics.

#![allow(clippy::missing_safety_doc)]

use std::cell::Cell;

extern "C" {
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: u32,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
}

const REQUEST_HEADERS: u32 = 0;
const COUNTER: u32 = 0;
/// The callbacks' `Action::Continue`.
pub const CONTINUE: u32 = 0;
const OK: u32 = 0;

thread_local! {
    static REQUESTS: Cell<Option<u32>> = const { Cell::new(None) };
}

#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// The host's allocations of what it hands over: a `Vec<u8>`'s buffer of exactly `size`, freed
/// by [`take`].
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let mut buf = Vec::<u8>::with_capacity(size);
    let ptr = buf.as_mut_ptr();
    std::mem::forget(buf);
    ptr
}

/// Frees a buffer the host filled through [`proxy_on_memory_allocate`].
fn take(ptr: *mut u8, size: usize) {
    if !ptr.is_null() {
        // SAFETY: the host allocated `ptr` through proxy_on_memory_allocate(size), a Vec's
        // buffer of capacity `size`, and filled `size` bytes of it.
        drop(unsafe { Vec::from_raw_parts(ptr, size, size) });
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root: u32, _size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(_root: u32, _size: usize) -> u32 {
    let name = "floor.requests";
    let mut id = 0u32;
    // SAFETY: the name and the id's slot outlive the call.
    if unsafe { proxy_define_metric(COUNTER, name.as_ptr(), name.len(), &mut id) } == OK {
        REQUESTS.with(|r| r.set(Some(id)));
    }
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(_context: u32, _parent: u32) {}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(_context: u32, _headers: usize, _eos: u32) -> u32 {
    let key = ":path";
    let (mut ptr, mut size) = (std::ptr::null_mut(), 0usize);
    // SAFETY: the key and the two return slots outlive the call.
    let status = unsafe {
        proxy_get_header_map_value(
            REQUEST_HEADERS,
            key.as_ptr(),
            key.len(),
            &mut ptr,
            &mut size,
        )
    };
    if status == OK {
        take(ptr, size);
    }
    if let Some(id) = REQUESTS.with(Cell::get) {
        // SAFETY: no pointers.
        let _ = unsafe { proxy_increment_metric(id, 1) };
    }
    CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_done(_context: u32) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(_context: u32) {}
