//! coordination-guard: a proxy-wasm HTTP filter that guards a service's unsafe operations
//! with Redis-backed coordination (rate limits today; idempotency and leases build on it).
//!
//! Everything here but [`wasm`] is plain Rust that `cargo test` runs natively; the `wasm`
//! module is the only code that talks to the proxy-wasm host.

#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]
// Crate-private by default: what the binaries (cg-check) and the benchmark use is `pub`, the
// rest `pub(crate)`. Whether an item is dead is the filter's build's to say: only there does
// the proxy-wasm adapter (mod host) use the core; the host build serves the tests and tools.
#![cfg_attr(not(all(target_arch = "wasm32", target_os = "wasi")), allow(dead_code))]

/// The operator's tool: host only.
#[cfg(not(target_arch = "wasm32"))]
pub mod admin;
pub mod config;
pub mod engine;
pub mod guards;
pub mod http;
pub mod redis;
pub mod support;

#[cfg(test)]
mod robustness_tests;

// The proxy-wasm adapter, in the filter's build (wasm32-wasip1) only: the core's tests also
// build for wasm32-unknown-unknown (`make unit-wasm`), where there is no proxy host.
#[cfg(all(target_arch = "wasm32", target_os = "wasi"))]
mod host;

// The filter's heap in the VM: every request allocates a few dozen small blocks, which size
// classes serve from the blocks the requests before it freed; the rest comes from Talc, whose
// allocations and frees cost less than wasi-libc's malloc (docs/performance.md), over the
// Wasm memory (`support::heap::Growing`: grown as Talc needs, capped for the big copies the memory
// budget checks). The test build counts allocations instead (alloc_count).
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test)))]
#[global_allocator]
pub(crate) static ALLOCATOR: support::heap::Classes<
    talc::cell::TalcSyncCell<support::heap::Growing, talc::wasm::WasmBinning>,
> = support::heap::Classes::new(talc::cell::TalcSyncCell::new_wasm(
    support::heap::Growing::new(),
));
