//! The canonical request fingerprint: SHA-256 over the selected parts of the request.
//! A JSON body is canonicalised first (object keys sorted recursively, no insignificant
//! whitespace, strings re-escaped one way, numbers exactly as sent: see [`crate::guards::idempotency::canonical`]),
//! so `{"a":1,"b":2}` and `{ "b": 2, "a": 1 }` are the same request; any other body, and JSON
//! that repeats a member name, counts byte for byte.

use crate::support::text::{media_type, push_hex};
use sha2::{Digest, Sha256};
use std::borrow::Cow;

/// True for `application/json` and `application/*+json` (parameters ignored).
pub(crate) fn is_json(content_type: Option<&str>) -> bool {
    let Some(ct) = content_type else {
        return false;
    };
    let essence = media_type(ct).to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// The body as it enters the fingerprint: canonical JSON when it is JSON and parses, else
/// the raw bytes (not copied).
pub fn canonical_body(body: &[u8], json: bool) -> Cow<'_, [u8]> {
    if json {
        if let Some(canonical) = crate::guards::idempotency::canonical::canonicalize(body) {
            return Cow::Owned(canonical);
        }
    }
    Cow::Borrowed(body)
}

/// The most [`canonical_body`] allocates for `body` at once (see
/// [`crate::guards::idempotency::canonical::peak_need`]); nothing when it is not JSON.
pub(crate) fn canonical_need(body: &[u8], json: bool) -> usize {
    if json {
        crate::guards::idempotency::canonical::peak_need(body)
    } else {
        0
    }
}

/// Accumulates named parts; each is length-prefixed so no two part lists collide.
pub struct Fingerprint {
    hasher: Sha256,
}

impl Default for Fingerprint {
    fn default() -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"cg-fingerprint-v1");
        Fingerprint { hasher }
    }
}

impl Fingerprint {
    pub fn part(&mut self, name: &str, value: &[u8]) {
        for bytes in [name.as_bytes(), value] {
            self.hasher.update((bytes.len() as u64).to_be_bytes());
            self.hasher.update(bytes);
        }
    }

    /// `sha256:<64 hex digits>`.
    pub fn finish(self) -> String {
        let mut out = String::with_capacity(71);
        out.push_str("sha256:");
        push_hex(&mut out, &self.hasher.finalize());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn fp(body: &[u8], json: bool) -> String {
        let mut f = Fingerprint::default();
        f.part("method", b"POST");
        f.part("body", &canonical_body(body, json));
        f.finish()
    }

    #[test]
    fn json_detection() {
        for (ct, want) in [
            (Some("application/json"), true),
            (Some("Application/JSON; charset=utf-8"), true),
            (Some("application/merge-patch+json"), true),
            (Some("text/plain"), false),
            (Some("application/jsonx"), false),
            (None, false),
        ] {
            assert_eq!(is_json(ct), want, "{ct:?}");
        }
    }

    #[test]
    fn canonical_json() {
        let cases: &[(&[u8], &str)] = &[
            (br#"{ "b": 2, "a": 1 }"#, r#"{"a":1,"b":2}"#),
            (
                br#"{"z":{"y":[3,{"b":1,"a":0}],"x":null}}"#,
                r#"{"z":{"x":null,"y":[3,{"a":0,"b":1}]}}"#,
            ),
            (b"  [1, 2.50, \"\\u0041\"]  ", r#"[1,2.50,"A"]"#),
            (br#"{"a":1e2}"#, r#"{"a":1e2}"#),
        ];
        for (input, want) in cases {
            assert_eq!(
                String::from_utf8(canonical_body(input, true).into_owned()).expect("utf8"),
                *want
            );
        }
        // Not JSON, or not declared JSON: bytes as they are.
        assert_eq!(&*canonical_body(b"{ \"b\": 2 }", false), b"{ \"b\": 2 }");
        assert_eq!(&*canonical_body(b"{oops", true), b"{oops");
    }

    #[test]
    fn same_request_same_fingerprint() {
        assert_eq!(
            fp(br#"{"a":1,"b":2}"#, true),
            fp(br#"{ "b": 2, "a": 1 }"#, true)
        );
        assert_ne!(fp(br#"{"a":1,"b":2}"#, true), fp(br#"{"a":1,"b":3}"#, true));
        assert_ne!(
            fp(br#"{"a":1,"b":2}"#, false),
            fp(br#"{ "b": 2, "a": 1 }"#, false)
        );
        let f = fp(b"x", false);
        assert!(f.starts_with("sha256:") && f.len() == 7 + 64, "{f}");
        // Length prefixes: moving bytes between parts changes the fingerprint.
        let mut a = Fingerprint::default();
        a.part("p", b"ab");
        a.part("q", b"c");
        let mut b = Fingerprint::default();
        b.part("p", b"a");
        b.part("q", b"bc");
        assert_ne!(a.finish(), b.finish());
    }
}
