//! The contracts of `slot_release.lua` and `slot_extend.lua`: a concurrency slot (taken by
//! `acquire.lua`, its member the request's nonce) given back or kept alive. Both reply `1`
//! (done) or `0` (no such slot).

use crate::redis::{ScriptCall, Words};

/// `slot_release.lua`: removes the request's slot from `key`. With `marker` (the owner's
/// cancellation marker and its TTL) the marker is set first, so that an acquire still in
/// flight takes no slot.
pub(crate) fn release(key: &str, nonce: &str, marker: Option<(String, u64)>) -> ScriptCall {
    match marker {
        None => ScriptCall::new([key], [nonce]),
        Some((marker, ttl)) => {
            let mut args = Words::from([nonce]);
            args.push_u64(ttl);
            ScriptCall::new([key, marker.as_str()], args)
        }
    }
}

/// `slot_extend.lua`: the request's slot lives `window_ms` more.
pub(crate) fn extend(key: &str, nonce: &str, window_ms: u64) -> ScriptCall {
    let mut args = Words::from([nonce]);
    args.push_u64(window_ms);
    ScriptCall::new([key], args)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn arguments() {
        let r = release("cg:rl:{t.x}:p:l:cc:2/1000:_", "n1", None);
        assert_eq!((r.keys.len(), r.args), (1, Words::from(["n1"])));
        let m = release("k", "n1", Some(("cg:cancel:{t.x}:p:o".into(), 60_000)));
        assert_eq!(m.keys, vec!["k", "cg:cancel:{t.x}:p:o"]);
        assert_eq!(m.args, vec!["n1", "60000"]);
        let e = extend("k", "n1", 30_000);
        assert_eq!((e.keys, e.args), (["k"].into(), ["n1", "30000"].into()));
    }
}
