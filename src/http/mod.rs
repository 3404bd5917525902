//! The HTTP side: the request as the filter reads it, its normalised path and query, its
//! headers and claims, gRPC, and the answers the filter gives by itself.

pub mod claims;
pub mod grpc;
pub mod headers;
pub mod local_reply;
pub mod normalize;
pub mod request;
