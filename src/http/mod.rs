//! The HTTP side: the request as the filter reads it, which policy guards it and who is
//! calling, what its selectors read, its normalised path and query, its headers and claims,
//! gRPC, and the answers the filter gives by itself.

pub(crate) mod arrival;
pub(crate) mod claims;
pub(crate) mod grpc;
pub mod headers;
pub mod identity;
pub(crate) mod local_reply;
pub mod matching;
pub mod request;
pub(crate) mod selectors;

/// The path and query normalisation the request reads: it lives in `support` because the
/// configuration checks its paths with it too.
pub(crate) use crate::support::normalize;
