//! Building blocks with no knowledge of requests or guards: text and hashing, ids, the heap and
//! the memory budget, bounded slot tables, rate-limited logs, metric ids, the streaming JSON
//! scan, URL paths and queries as services read them, and gRPC's status codes.

#[cfg(test)]
pub mod alloc_count;
pub mod grpc_status;
pub mod hashing;
pub mod heap;
pub mod ids;
pub mod jsonscan;
pub mod lograte;
pub mod memory;
pub mod metrics;
pub mod normalize;
pub mod slots;
pub mod text;
