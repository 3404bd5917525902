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

use crate::support::hashing::short_hash;
use crate::support::text::{base64_decode, base64_encode};
use aes_gcm::aead::generic_array::GenericArray;
use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::Aes256Gcm;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The only algorithm: AES-256-GCM, 96-bit nonce, 128-bit tag.
pub const ALG: &str = "A256GCM";
/// Bytes of a key.
pub const KEY_LEN: usize = 32;
/// Bytes of a nonce.
pub const NONCE_LEN: usize = 12;
/// Hex digits of a key id.
const KID_LEN: usize = 16;
/// What the additional data starts with: a new layout gets a new label.
const AAD_LABEL: &[u8] = b"coordination-guard record response v1";

/// A sealed response as it is stored (the value of `"sealed"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sealed {
    pub alg: String,
    pub kid: String,
    pub nonce: String,
    pub ct: String,
}

/// One AES-256 key and its id.
#[derive(Clone)]
pub struct RecordKey {
    kid: String,
    cipher: Aes256Gcm,
}

/// Why a key's text is not a key (the configuration names the variable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyProblem {
    NotBase64,
    /// It decodes to this many bytes, not [`KEY_LEN`].
    Length(usize),
}

impl fmt::Display for KeyProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyProblem::NotBase64 => f.write_str("is not base64 (standard alphabet, with padding)"),
            KeyProblem::Length(n) => write!(f, "holds {n} bytes, not {KEY_LEN}"),
        }
    }
}

impl RecordKey {
    /// A key from its base64 text (white space around it, e.g. a file's newline, is ignored).
    pub fn from_base64(text: &str) -> Result<RecordKey, KeyProblem> {
        let bytes = base64_decode(text.trim()).ok_or(KeyProblem::NotBase64)?;
        RecordKey::from_bytes(&bytes)
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<RecordKey, KeyProblem> {
        let cipher =
            Aes256Gcm::new_from_slice(bytes).map_err(|_| KeyProblem::Length(bytes.len()))?;
        Ok(RecordKey {
            kid: short_hash("cg.record-key.id", bytes),
            cipher,
        })
    }

    /// The key's id: 64 bits of a domain-separated SHA-256 of the key. It tells keys apart;
    /// it reveals nothing usable about a random 256-bit key.
    pub fn kid(&self) -> &str {
        &self.kid
    }
}

impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordKey({})", self.kid)
    }
}

/// The keys of a policy: responses are sealed with `current` and open with either key.
#[derive(Clone)]
pub struct Keyring {
    current: RecordKey,
    previous: Option<RecordKey>,
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

impl Keyring {
    pub fn new(current: RecordKey, previous: Option<RecordKey>) -> Keyring {
        Keyring { current, previous }
    }

    /// The id new records are sealed with.
    pub fn current_kid(&self) -> &str {
        self.current.kid()
    }

    /// The previous key's id, if there is one.
    pub fn previous_kid(&self) -> Option<&str> {
        self.previous.as_ref().map(RecordKey::kid)
    }

    /// Seals `plaintext` with the current key and `nonce`, which must never have been used
    /// with this key before ([`fresh_nonce`]). `None` only for a plaintext over 64 GiB.
    pub fn seal(&self, aad: &[u8], plaintext: &[u8], nonce: [u8; NONCE_LEN]) -> Option<Sealed> {
        let ct = self
            .current
            .cipher
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
            kid: self.current.kid.clone(),
            nonce: base64_encode(&nonce),
            ct: base64_encode(&ct),
        })
    }

    /// Opens a sealed response with the key its id names.
    pub fn open(&self, aad: &[u8], sealed: &Sealed) -> Result<Vec<u8>, OpenError> {
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
        let key = [Some(&self.current), self.previous.as_ref()]
            .into_iter()
            .flatten()
            .find(|k| k.kid == sealed.kid)
            .ok_or_else(|| OpenError::UnknownKey(sealed.kid.clone()))?;
        let nonce: [u8; NONCE_LEN] = base64_decode(&sealed.nonce)
            .and_then(|n| n.try_into().ok())
            .ok_or(OpenError::Malformed)?;
        let ct = base64_decode(&sealed.ct).ok_or(OpenError::Malformed)?;
        key.cipher
            .decrypt(&GenericArray::from(nonce), Payload { msg: &ct, aad })
            .map_err(|_| OpenError::Rejected)
    }
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyring")
            .field("current", &self.current.kid)
            .field("previous", &self.previous_kid())
            .finish()
    }
}

/// Two keyrings are equal when they hold the same keys (by id).
impl PartialEq for Keyring {
    fn eq(&self, other: &Keyring) -> bool {
        self.current_kid() == other.current_kid() && self.previous_kid() == other.previous_kid()
    }
}

impl Eq for Keyring {}

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
    fn key_ids_name_keys_not_their_bytes() {
        let (a, b) = (key(A), key(B));
        assert_eq!(a.kid().len(), 16);
        assert!(a.kid().bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a.kid(), b.kid());
        assert_eq!(a.kid(), key(A).kid(), "stable across VMs");
        assert!(!a.kid().contains("1111"), "not the key's bytes");
        let debug = format!("{:?}", ring(A, Some(B)));
        assert_eq!(
            debug,
            format!(
                "Keyring {{ current: {:?}, previous: Some({:?}) }}",
                a.kid(),
                b.kid()
            )
        );
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
        let wrong_key = Keyring::new(
            RecordKey {
                kid: keys.current_kid().to_string(),
                cipher: key(B).cipher,
            },
            None,
        );
        assert_eq!(wrong_key.open(&aad(), &good), Err(OpenError::Rejected));
    }

    #[test]
    fn key_text() {
        let b64 = base64_encode(&A);
        assert_eq!(b64.len(), 44);
        let cases: Vec<(&str, String, Result<String, KeyProblem>)> = vec![
            ("exact", b64.clone(), Ok(key(A).kid().to_string())),
            (
                "trailing_newline",
                format!("{b64}\n"),
                Ok(key(A).kid().to_string()),
            ),
            (
                "short",
                base64_encode(&[1; 16]),
                Err(KeyProblem::Length(16)),
            ),
            ("long", base64_encode(&[1; 33]), Err(KeyProblem::Length(33))),
            ("empty", String::new(), Err(KeyProblem::Length(0))),
            (
                "unpadded",
                b64.trim_end_matches('=').to_string(),
                Err(KeyProblem::NotBase64),
            ),
            (
                "url_alphabet",
                base64_encode(&[0xfb; 32])
                    .replace('+', "-")
                    .replace('/', "_"),
                Err(KeyProblem::NotBase64),
            ),
        ];
        for (name, text, want) in cases {
            let got = RecordKey::from_base64(&text).map(|k| k.kid().to_string());
            assert_eq!(got, want, "case {name}");
        }
        assert_eq!(KeyProblem::Length(16).to_string(), "holds 16 bytes, not 32");
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
