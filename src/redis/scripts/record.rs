//! The contracts of `complete.lua` and `release.lua`, the two ways a request settles its
//! idempotency record: their arguments and what their replies mean.

use crate::redis::scripts::acquire::RecordAcquire;
use crate::redis::{resp::Reply, ScriptCall, Words};

/// `complete.lua`: `PROCESSING` -> `COMPLETED` with `response` (the stored response's JSON),
/// only by the owner with the same fingerprint.
pub(crate) fn complete(
    acquire: &RecordAcquire,
    completed_ttl_ms: u64,
    response: String,
) -> ScriptCall {
    let size = acquire.owner.len() + acquire.fingerprint.len() + 20 + response.len();
    let mut args = Words::with_capacity(4, size);
    args.push(&acquire.owner);
    args.push(&acquire.fingerprint);
    args.push_u64(completed_ttl_ms);
    args.push(&response);
    ScriptCall::new([acquire.key.as_str()], args)
}

/// `release.lua`: deletes the owner's `PROCESSING` record. With `marker_ttl_ms`, the owner's
/// cancellation marker is set first, so that an acquire still in flight writes nothing.
pub(crate) fn release(acquire: &RecordAcquire, marker_ttl_ms: Option<u64>) -> ScriptCall {
    by_owner(
        &acquire.key,
        &acquire.cancel_key,
        &acquire.owner,
        marker_ttl_ms,
    )
}

/// The arguments `release.lua` and `lease_release.lua` share: `KEYS = key [marker]`,
/// `ARGV = owner [marker_ttl_ms]`.
pub(crate) fn by_owner(
    key: &str,
    cancel_key: &str,
    owner: &str,
    marker_ttl_ms: Option<u64>,
) -> ScriptCall {
    match marker_ttl_ms {
        None => ScriptCall::new([key], [owner]),
        Some(ttl) => {
            let mut args = Words::from([owner]);
            args.push_u64(ttl);
            ScriptCall::new([key, cancel_key], args)
        }
    }
}

/// What a settling script (`complete.lua`, `release.lua`, `lease_release.lua`,
/// `lease_extend.lua`: they share the reply) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// `1`: done (completed, released, extended).
    Done,
    /// `0` (missing) or `-1` (another owner): it was not this request's any more.
    NotOurs,
    /// Anything else.
    Unexpected,
}

/// Reads the reply of a settling script.
pub(crate) fn outcome(reply: &Reply) -> Outcome {
    match reply.as_int() {
        Some(1) => Outcome::Done,
        Some(0 | -1) => Outcome::NotOurs,
        _ => Outcome::Unexpected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn acquire() -> RecordAcquire {
        RecordAcquire {
            key: "cg:idem:{t.x}:p:k".into(),
            tag: "t.x".into(),
            fingerprint: "sha256:ff".into(),
            owner: "o1".into(),
            processing_ttl_ms: 1000,
            cancel_key: "cg:cancel:{t.x}:p:o1".into(),
        }
    }

    #[test]
    fn arguments() {
        let c = complete(&acquire(), 86_400_000, "{}".into());
        assert_eq!(c.keys, vec!["cg:idem:{t.x}:p:k"]);
        assert_eq!(c.args, vec!["o1", "sha256:ff", "86400000", "{}"]);
        let r = release(&acquire(), None);
        assert_eq!((r.keys.len(), r.args.clone()), (1, Words::from(["o1"])));
        let r = release(&acquire(), Some(60_000));
        assert_eq!(r.keys, vec!["cg:idem:{t.x}:p:k", "cg:cancel:{t.x}:p:o1"]);
        assert_eq!(r.args, vec!["o1", "60000"]);
    }

    #[test]
    fn outcomes() {
        assert_eq!(outcome(&Reply::Int(1)), Outcome::Done);
        assert_eq!(outcome(&Reply::Int(0)), Outcome::NotOurs);
        assert_eq!(outcome(&Reply::Int(-1)), Outcome::NotOurs);
        assert_eq!(outcome(&Reply::Int(2)), Outcome::Unexpected);
        assert_eq!(outcome(&Reply::Status("OK".into())), Outcome::Unexpected);
    }
}
