//! The contracts of `lease_release.lua` and `lease_extend.lua`: a held lease given back or
//! kept alive, only by its owner. (Both reply like the record scripts:
//! [`crate::redis::scripts::record::outcome`].)

use crate::redis::scripts::acquire::LeaseAcquire;
use crate::redis::scripts::record::by_owner;
use crate::redis::{ScriptCall, Words};

/// `lease_release.lua`: deletes the owner's lease. With `marker_ttl_ms`, the owner's
/// cancellation marker is set first, so that an acquire still in flight takes nothing.
pub(crate) fn release(acquire: &LeaseAcquire, marker_ttl_ms: Option<u64>) -> ScriptCall {
    by_owner(
        &acquire.key,
        &acquire.cancel_key,
        &acquire.owner,
        marker_ttl_ms,
    )
}

/// `lease_extend.lua`: the owner's lease lives `ttl_ms` more.
pub(crate) fn extend(acquire: &LeaseAcquire) -> ScriptCall {
    let mut args = Words::from([acquire.owner.as_str()]);
    args.push_u64(acquire.ttl_ms);
    ScriptCall::new([acquire.key.as_str()], args)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn arguments() {
        let l = LeaseAcquire {
            key: "cg:lease:{t.x}:p:r".into(),
            fence_key: "cg:fence:{t.x}:p:r".into(),
            tag: "t.x".into(),
            owner: "o2".into(),
            ttl_ms: 10_000,
            fence_ttl_ms: 1,
            cancel_key: "cg:cancel:{t.x}:p:o2".into(),
        };
        assert_eq!(release(&l, None).args, vec!["o2"]);
        let marked = release(&l, Some(60_000));
        assert_eq!(
            marked.keys,
            vec!["cg:lease:{t.x}:p:r", "cg:cancel:{t.x}:p:o2"]
        );
        assert_eq!(marked.args, vec!["o2", "60000"]);
        let e = extend(&l);
        assert_eq!(
            (e.keys, e.args),
            ([l.key.as_str()].into(), ["o2", "10000"].into())
        );
    }
}
