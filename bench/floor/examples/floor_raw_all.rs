//! `wasm_floor_raw_all`: `wasm_floor_raw` (floor_raw.rs) exporting every stream callback as
//! the Rust SDK does, each returning at once: Envoy enters the VM for each of them, as it does
//! for `wasm_floor`, but without the SDK's dispatch. Between `wasm_floor`, this and
//! `wasm_floor_raw`: what the SDK's dispatch costs, and what the callbacks a filter does not
//! use cost.

#![allow(clippy::missing_safety_doc)]

#[path = "floor_raw.rs"]
mod raw;

use raw::CONTINUE;

#[no_mangle]
pub extern "C" fn proxy_on_request_body(_context: u32, _size: usize, _eos: u32) -> u32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(_context: u32, _trailers: usize) -> u32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(_context: u32, _headers: usize, _eos: u32) -> u32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(_context: u32, _size: usize, _eos: u32) -> u32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_response_trailers(_context: u32, _trailers: usize) -> u32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_log(_context: u32) {}
