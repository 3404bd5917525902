//! The record keys of `idempotency.encryption`: each AES-256 key read from the VM's
//! environment once, at load, as a ready cipher and its id. The configuration holds them; the
//! record's seal (`guards::idempotency::seal`) seals and opens responses with them.

use crate::support::hashing::short_hash;
use crate::support::text::base64_decode;
use aes_gcm::aead::KeyInit;
use aes_gcm::Aes256Gcm;
use std::fmt;

/// Bytes of a key.
pub const KEY_LEN: usize = 32;

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

    /// The key's cipher, for the seal.
    pub fn cipher(&self) -> &Aes256Gcm {
        &self.cipher
    }

    /// This key's cipher under another id: a key that claims to be another (the seal's tests).
    #[cfg(test)]
    pub fn named(&self, kid: &str) -> RecordKey {
        RecordKey {
            kid: kid.to_string(),
            cipher: self.cipher.clone(),
        }
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

impl Keyring {
    pub fn new(current: RecordKey, previous: Option<RecordKey>) -> Keyring {
        Keyring { current, previous }
    }

    /// The key new records are sealed with.
    pub fn current(&self) -> &RecordKey {
        &self.current
    }

    /// The keys a sealed record may name: the current one, then the previous one if any.
    pub fn keys(&self) -> impl Iterator<Item = &RecordKey> {
        [Some(&self.current), self.previous.as_ref()]
            .into_iter()
            .flatten()
    }

    /// The id new records are sealed with.
    pub fn current_kid(&self) -> &str {
        self.current.kid()
    }

    /// The previous key's id, if there is one.
    pub fn previous_kid(&self) -> Option<&str> {
        self.previous.as_ref().map(RecordKey::kid)
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
    use crate::support::text::base64_encode;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const A: [u8; KEY_LEN] = [0x11; KEY_LEN];
    const B: [u8; KEY_LEN] = [0x22; KEY_LEN];

    fn key(bytes: [u8; KEY_LEN]) -> RecordKey {
        RecordKey::from_bytes(&bytes).expect("32 bytes")
    }

    #[test]
    fn key_ids_name_keys_not_their_bytes() {
        let (a, b) = (key(A), key(B));
        assert_eq!(a.kid().len(), 16);
        assert!(a.kid().bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a.kid(), b.kid());
        assert_eq!(a.kid(), key(A).kid(), "stable across VMs");
        assert!(!a.kid().contains("1111"), "not the key's bytes");
        let debug = format!("{:?}", Keyring::new(key(A), Some(key(B))));
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
}
