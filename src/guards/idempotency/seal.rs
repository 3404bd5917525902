//! Stored responses sealed at rest with AES-256-GCM (`idempotency.encryption`).
//!
//! A completed record's response (status, headers, body, trailers) is sealed with the policy's
//! current key; the record keeps its state machine fields in the clear. The sealed form names
//! the key by its id (a short hash of the key, never the key), so a record sealed with the
//! previous key still opens after a rotation:
//!
//! ```json
//! "response":{"sealed":{"alg":"A256GCM","kid":"<16 hex>","nonce":"<base64 of 12 bytes>","ct":"<base64>"}}
//! ```
//!
//! * `nonce`: 96 random bits from the host (WASI `random_get`) per seal, never a counter or a
//!   constant; a key should seal fewer than 2^32 responses (NIST SP 800-38D's bound for random
//!   nonces): rotate it before that.
//! * `ct`: the ciphertext of the response's JSON followed by the 16-byte tag.
//! * The additional data binds the seal to its record ([`record_aad`]: the record's Redis key
//!   and the request fingerprint), so a sealed response copied into another record, or into
//!   a record of another request, does not open.
//!
//! Opening never panics: an unknown key id, a tag that does not match (tampered, moved, or
//! another key), bad base64 or another algorithm are each an [`OpenError`].

// The key material is the configuration's, read once at load; named here too, beside the seal
// that uses it.
pub use crate::config::{KeyProblem, Keyring, RecordKey, KEY_LEN};
use crate::support::text::{base64_decode, base64_encode};
use aes_gcm::aead::generic_array::GenericArray;
use aes_gcm::aead::{Aead, Payload};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The only algorithm: AES-256-GCM, 96-bit nonce, 128-bit tag.
pub(crate) const ALG: &str = "A256GCM";
/// Bytes of a nonce.
pub(crate) const NONCE_LEN: usize = 12;
/// Hex digits of a key id.
const KID_LEN: usize = 16;
/// What the additional data starts with: a new layout gets a new label.
const AAD_LABEL: &[u8] = b"coordination-guard record response v1";

/// A sealed response as it is stored (the value of `"sealed"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sealed {
    pub(crate) alg: String,
    pub(crate) kid: String,
    pub(crate) nonce: String,
    pub(crate) ct: String,
}

/// Why a sealed response does not open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenError {
    /// The record is sealed, the policy has no `encryption`.
    NoKeys,
    /// Another algorithm than [`ALG`].
    Algorithm,
    /// A well-formed key id that is neither the current nor the previous key's.
    UnknownKey(String),
    /// The key id, nonce or ciphertext is not what a seal writes (bad base64, lengths).
    Malformed,
    /// The tag does not verify: tampered, moved from another record, or sealed with another
    /// key of the same id.
    Rejected,
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpenError::NoKeys => {
                f.write_str("it is sealed and this policy has no idempotency.encryption")
            }
            OpenError::Algorithm => f.write_str("it is sealed with an unknown algorithm"),
            OpenError::UnknownKey(kid) => write!(
                f,
                "it is sealed with key id {kid}, neither key_env's nor previous_key_env's key"
            ),
            OpenError::Malformed => f.write_str("its sealed fields are malformed"),
            OpenError::Rejected => f.write_str(
                "its authentication tag does not verify (altered, or moved from another record)",
            ),
        }
    }
}

/// 96 fresh random bits from the host (WASI `random_get` in the VM, the OS natively);
/// `None` if the host has none to give (then nothing may be sealed).
pub fn fresh_nonce() -> Option<[u8; NONCE_LEN]> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).ok()?;
    Some(nonce)
}

/// The additional data of a record's sealed response: its Redis key (prefix, tenant,
/// policy, client key hash) and the request fingerprint, each unambiguous (neither holds a
/// NUL byte).
pub fn record_aad(record_key: &str, fingerprint: &str) -> Vec<u8> {
    let mut aad = Vec::with_capacity(AAD_LABEL.len() + record_key.len() + fingerprint.len() + 2);
    aad.extend_from_slice(AAD_LABEL);
    aad.push(0);
    aad.extend_from_slice(record_key.as_bytes());
    aad.push(0);
    aad.extend_from_slice(fingerprint.as_bytes());
    aad
}

/// Sealing and opening with the configuration's keys (the key material is read and held by
/// `config::keyring`; what a seal writes and how it opens is this module's).
impl Keyring {
    /// Seals `plaintext` with the current key and `nonce`, which must never have been used
    /// with this key before ([`fresh_nonce`]). `None` only for a plaintext over 64 GiB.
    pub(crate) fn seal(
        &self,
        aad: &[u8],
        plaintext: &[u8],
        nonce: [u8; NONCE_LEN],
    ) -> Option<Sealed> {
        let ct = self
            .current()
            .cipher()
            .encrypt(
                &GenericArray::from(nonce),
                Payload {
                    msg: plaintext,
                    aad,
                },
            )
            .ok()?;
        Some(Sealed {
            alg: ALG.to_string(),
            kid: self.current_kid().to_string(),
            nonce: base64_encode(&nonce),
            ct: base64_encode(&ct),
        })
    }

    /// Opens a sealed response with the key its id names.
    pub(crate) fn open(&self, aad: &[u8], sealed: &Sealed) -> Result<Vec<u8>, OpenError> {
        if sealed.alg != ALG {
            return Err(OpenError::Algorithm);
        }
        let kid_ok = sealed.kid.len() == KID_LEN
            && sealed
                .kid
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !kid_ok {
            return Err(OpenError::Malformed);
        }
        let key = self
            .keys()
            .find(|k| k.kid() == sealed.kid)
            .ok_or_else(|| OpenError::UnknownKey(sealed.kid.clone()))?;
        let nonce: [u8; NONCE_LEN] = base64_decode(&sealed.nonce)
            .and_then(|n| n.try_into().ok())
            .ok_or(OpenError::Malformed)?;
        let ct = base64_decode(&sealed.ct).ok_or(OpenError::Malformed)?;
        key.cipher()
            .decrypt(&GenericArray::from(nonce), Payload { msg: &ct, aad })
            .map_err(|_| OpenError::Rejected)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const A: [u8; KEY_LEN] = [0x11; KEY_LEN];
    const B: [u8; KEY_LEN] = [0x22; KEY_LEN];
    const NONCE: [u8; NONCE_LEN] = [7; NONCE_LEN];

    fn key(bytes: [u8; KEY_LEN]) -> RecordKey {
        RecordKey::from_bytes(&bytes).expect("32 bytes")
    }

    fn ring(current: [u8; KEY_LEN], previous: Option<[u8; KEY_LEN]>) -> Keyring {
        Keyring::new(key(current), previous.map(key))
    }

    fn aad() -> Vec<u8> {
        record_aad("cg:idem:{t.0011}:create-order:aa", "sha256:ff")
    }

    #[test]
    fn round_trip() {
        let keys = ring(A, None);
        for plaintext in [&b""[..], b"{\"status\":201}", &[0xffu8; 70_000][..]] {
            let sealed = keys.seal(&aad(), plaintext, NONCE).expect("sealed");
            assert_eq!(sealed.alg, "A256GCM");
            assert_eq!(sealed.kid, keys.current_kid());
            assert_eq!(base64_decode(&sealed.nonce), Some(NONCE.to_vec()));
            let ct = base64_decode(&sealed.ct).expect("base64");
            assert_eq!(ct.len(), plaintext.len() + 16, "ciphertext and tag");
            assert_eq!(keys.open(&aad(), &sealed).as_deref(), Ok(plaintext));
        }
    }

    #[test]
    fn the_ciphertext_shows_nothing_of_the_plaintext() {
        let plaintext = b"MARKER-visible-in-the-clear MARKER-visible-in-the-clear";
        let sealed = ring(A, None)
            .seal(&aad(), plaintext, NONCE)
            .expect("sealed");
        let ct = base64_decode(&sealed.ct).expect("base64");
        assert!(!ct.windows(6).any(|w| w == b"MARKER"));
        assert!(!sealed.ct.contains("MARKER"));
        // The same plaintext under another nonce is another ciphertext.
        let other = ring(A, None)
            .seal(&aad(), plaintext, [8; NONCE_LEN])
            .expect("sealed");
        assert_ne!(other.ct, sealed.ct);
    }

    #[test]
    fn rotation_opens_the_previous_key_and_seals_with_the_current() {
        let old = ring(A, None).seal(&aad(), b"old", NONCE).expect("sealed");
        let rotated = ring(B, Some(A));
        assert_eq!(rotated.open(&aad(), &old).as_deref(), Ok(&b"old"[..]));
        let new = rotated.seal(&aad(), b"new", NONCE).expect("sealed");
        assert_eq!(new.kid, key(B).kid());
        // Once A is dropped, its records no longer open; B's still do.
        let dropped = ring(B, None);
        assert_eq!(
            dropped.open(&aad(), &old),
            Err(OpenError::UnknownKey(key(A).kid().to_string()))
        );
        assert_eq!(dropped.open(&aad(), &new).as_deref(), Ok(&b"new"[..]));
    }

    #[test]
    fn what_does_not_open() {
        let keys = ring(A, None);
        let good = keys
            .seal(&aad(), b"{\"status\":201}", NONCE)
            .expect("sealed");
        let flip = |text: &str, at: usize| {
            let mut bytes = base64_decode(text).expect("base64");
            bytes[at] ^= 1;
            base64_encode(&bytes)
        };
        let edit = |f: &dyn Fn(&mut Sealed)| {
            let mut s = good.clone();
            f(&mut s);
            s
        };
        let b_kid = key(B).kid().to_string();
        let cases: Vec<(&str, Sealed, Vec<u8>, OpenError)> = vec![
            (
                "ct_flipped",
                edit(&|s| s.ct = flip(&s.ct, 0)),
                aad(),
                OpenError::Rejected,
            ),
            (
                "tag_flipped",
                edit(&|s| s.ct = flip(&s.ct, 20)),
                aad(),
                OpenError::Rejected,
            ),
            (
                "nonce_flipped",
                edit(&|s| s.nonce = flip(&s.nonce, 11)),
                aad(),
                OpenError::Rejected,
            ),
            (
                "ct_truncated",
                edit(&|s| s.ct = base64_encode(b"short")),
                aad(),
                OpenError::Rejected,
            ),
            (
                "ct_empty",
                edit(&|s| s.ct = String::new()),
                aad(),
                OpenError::Rejected,
            ),
            (
                "other_kid",
                edit(&|s| s.kid = b_kid.clone()),
                aad(),
                OpenError::UnknownKey(b_kid.clone()),
            ),
            (
                "kid_not_hex",
                edit(&|s| s.kid = "zzzzzzzzzzzzzzzz".into()),
                aad(),
                OpenError::Malformed,
            ),
            (
                "kid_too_long",
                edit(&|s| s.kid.push('0')),
                aad(),
                OpenError::Malformed,
            ),
            (
                "nonce_not_base64",
                edit(&|s| s.nonce = "!!!!".into()),
                aad(),
                OpenError::Malformed,
            ),
            (
                "nonce_short",
                edit(&|s| s.nonce = base64_encode(&[7; 8])),
                aad(),
                OpenError::Malformed,
            ),
            (
                "ct_not_base64",
                edit(&|s| s.ct = "not base64".into()),
                aad(),
                OpenError::Malformed,
            ),
            (
                "other_alg",
                edit(&|s| s.alg = "A128GCM".into()),
                aad(),
                OpenError::Algorithm,
            ),
            (
                "other_record",
                good.clone(),
                record_aad("cg:idem:{t.0011}:create-order:bb", "sha256:ff"),
                OpenError::Rejected,
            ),
            (
                "other_fingerprint",
                good.clone(),
                record_aad("cg:idem:{t.0011}:create-order:aa", "sha256:fe"),
                OpenError::Rejected,
            ),
        ];
        for (name, sealed, aad, want) in cases {
            assert_eq!(keys.open(&aad, &sealed), Err(want), "case {name}");
        }
        // A key with the same id cannot be made up; another key under the right id fails
        // the tag all the same.
        let wrong_key = Keyring::new(key(B).named(keys.current_kid()), None);
        assert_eq!(wrong_key.open(&aad(), &good), Err(OpenError::Rejected));
    }

    #[test]
    fn fresh_nonces_differ() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            let n = fresh_nonce().expect("random");
            assert!(seen.insert(n), "a nonce came twice");
        }
        assert!(!seen.contains(&[0u8; NONCE_LEN]));
    }
}
