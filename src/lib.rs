//! coordination-guard: a proxy-wasm HTTP filter that guards a service's unsafe operations
//! with Redis-backed coordination (rate limits today; idempotency and leases build on it).
//!
//! Everything here but [`wasm`] is plain Rust that `cargo test` runs natively; the `wasm`
//! module is the only code that talks to the proxy-wasm host.

#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod claims;
pub mod config;
pub mod flow;
pub mod grpc;
pub mod hashing;
pub mod headers;
pub mod heap;
pub mod idempotency;
pub mod ids;
pub mod jsonscan;
pub mod keys;
pub mod local;
pub mod lograte;
pub mod lua;
/// The plugin configurations in what a user deploys (WasmPlugin, Envoy YAML): host tools only.
#[cfg(not(target_arch = "wasm32"))]
pub mod manifest;
pub mod memory;
pub mod metrics;
pub mod normalize;
pub mod ratelimit;
pub mod redis;
pub mod request;
pub mod respond;
pub mod text;

#[cfg(test)]
mod alloc_count;
#[cfg(test)]
mod robustness_tests;

// The proxy-wasm adapter, in the filter's build (wasm32-wasip1) only: the core's tests also
// build for wasm32-unknown-unknown (`make unit-wasm`), where there is no proxy host.
#[cfg(all(target_arch = "wasm32", target_os = "wasi"))]
mod wasm;

// The filter's heap in the VM: every request allocates a few dozen small blocks, which size
// classes serve from the blocks the requests before it freed; the rest comes from Talc, whose
// allocations and frees cost less than wasi-libc's malloc (docs/performance.md), over the
// Wasm memory (`heap::Growing`: grown as Talc needs, capped for the big copies the memory
// budget checks). The test build counts allocations instead (alloc_count).
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics"), not(test)))]
#[global_allocator]
pub(crate) static ALLOCATOR: heap::Classes<
    talc::cell::TalcSyncCell<heap::Growing, talc::wasm::WasmBinning>,
> = heap::Classes::new(talc::cell::TalcSyncCell::new_wasm(heap::Growing::new()));
