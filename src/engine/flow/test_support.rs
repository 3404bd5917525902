//! What the flow's tests share: replies as the gateway gives them, and steps read back.

use crate::engine::flow::{Move, Outgoing, Step};
use crate::http::local_reply::LocalResponse;
use crate::redis::resp::Reply;

/// An array reply of integers.
pub fn ints(v: &[i64]) -> Reply {
    Reply::Array(Some(v.iter().map(|n| Reply::Int(*n)).collect()))
}

/// The calls of a `Dispatch` step (any other step fails the test).
pub fn dispatched(step: Step) -> Vec<Outgoing> {
    match step.next {
        Move::Dispatch(out) => out,
        other => panic!("expected Dispatch, got {other:?}"),
    }
}

/// The local answer of a `Respond` step (any other step fails the test).
pub fn respond_with(step: Step) -> LocalResponse {
    match step.next {
        Move::Respond(r) => std::rc::Rc::unwrap_or_clone(r),
        other => panic!("expected Respond, got {other:?}"),
    }
}

/// A header of a local answer.
pub fn header<'a>(r: &'a LocalResponse, name: &str) -> Option<&'a str> {
    r.headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// Owned header pairs.
pub fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}
