//! Building blocks with no knowledge of requests or guards: text and hashing, ids, the heap and
//! the memory budget, bounded slot tables, rate-limited logs, metric ids, the streaming JSON
//! scan and the event-stream reader it is fed by, URL paths and queries as services read them,
//! path templates, and gRPC's status codes.

#[cfg(test)]
pub(crate) mod alloc_count;
pub(crate) mod grpc_status;
pub(crate) mod hashing;
pub(crate) mod heap;
pub mod ids;
pub(crate) mod jsonscan;
pub(crate) mod lograte;
pub(crate) mod memory;
pub mod metrics;
pub(crate) mod normalize;
pub(crate) mod slots;
pub(crate) mod sse;
pub mod template;
pub(crate) mod text;
