//! Building blocks with no knowledge of requests or guards: text and hashing, ids, the heap and
//! the memory budget, bounded slot tables, rate-limited logs, metric ids and the streaming
//! JSON scan.

#[cfg(test)]
pub mod alloc_count;
pub mod hashing;
pub mod heap;
pub mod ids;
pub mod jsonscan;
pub mod lograte;
pub mod memory;
pub mod metrics;
pub mod slots;
pub mod text;
