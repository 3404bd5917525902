//! The idempotency record stored under the key: compact JSON with `schema_version`.
//!
//! The acquire script writes the `PROCESSING` record; the complete script writes the
//! `COMPLETED` record around the `response` object this module serialises. Readers ignore
//! unknown fields and tolerate missing optional ones, so records written by an older or newer
//! version stay readable during a rolling deployment.
//!
//! ```json
//! {"schema_version":1,"state":"PROCESSING","fingerprint":"sha256:…","owner":"…","created_ms":1,"updated_ms":1}
//! {"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:…","created_ms":1,"updated_ms":2,
//!  "response":{"status":201,"headers":[["content-type","application/json"]],"body":"{…}"}}
//! {"schema_version":1,"state":"COMPLETED",…,"response":{"status":200,"headers":[["content-type","application/grpc"]],
//!  "body_base64":"AAAAAAVoZWxsbw==","trailers":[["grpc-status","0"]]}}
//! ```
//!
//! `trailers` (a gRPC response's `grpc-status` / `grpc-message` and the configured
//! `replay_trailers`) is optional and left out when empty: a record without it (written before
//! it existed, or of a response without trailers) reads as no trailers, and an older reader
//! ignores it.
//!
//! With `idempotency.encryption` the `response` object is sealed (see [`crate::guards::idempotency::seal`]): the
//! JSON above, encrypted, in its place; everything else stays as it is.
//!
//! ```json
//! {"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:…","created_ms":1,"updated_ms":2,
//!  "response":{"sealed":{"alg":"A256GCM","kid":"3f…","nonce":"…","ct":"…"}}}
//! ```
//!
//! A reader without the keys (or an older version) finds no `status` in it: the record is
//! unreadable to it, never replayed as something else.

use crate::guards::idempotency::seal::{Keyring, OpenError, Sealed, NONCE_LEN};
use crate::support::text::{base64_decode, base64_encode};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

#[cfg(test)]
pub(crate) const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum State {
    #[serde(rename = "PROCESSING")]
    Processing,
    #[serde(rename = "COMPLETED")]
    Completed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    #[serde(default = "v1")]
    pub(crate) schema_version: u32,
    pub(crate) state: State,
    pub(crate) fingerprint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) owner: Option<String>,
    #[serde(default)]
    pub(crate) created_ms: u64,
    #[serde(default)]
    pub(crate) updated_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<RecordResponse>,
}

/// A completed record's `response`: in the clear, or sealed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum RecordResponse {
    /// `{"sealed": {...}}`: an object with `"sealed"` is a sealed response, or unreadable; it
    /// never reads as a plain one.
    Sealed {
        sealed: Sealed,
    },
    Plain(StoredResponse),
}

/// Read in one pass, without buffering the object to try each variant in turn (an untagged
/// enum copies every key and value of a replayed response once more): the fields of both.
impl<'de> Deserialize<'de> for RecordResponse {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<RecordResponse, D::Error> {
        #[derive(Deserialize)]
        struct Either {
            #[serde(default)]
            sealed: Option<Sealed>,
            #[serde(default)]
            status: Option<u16>,
            #[serde(default)]
            headers: Vec<(String, String)>,
            #[serde(default)]
            body: Option<String>,
            #[serde(default)]
            body_base64: Option<String>,
            #[serde(default)]
            reference: bool,
            #[serde(default)]
            trailers: Vec<(String, String)>,
        }
        let e = Either::deserialize(d)?;
        match (e.sealed, e.status) {
            (Some(sealed), _) => Ok(RecordResponse::Sealed { sealed }),
            (None, Some(status)) => Ok(RecordResponse::Plain(StoredResponse {
                status,
                headers: e.headers,
                body: e.body,
                body_base64: e.body_base64,
                reference: e.reference,
                trailers: e.trailers,
            })),
            (None, None) => Err(D::Error::missing_field("status")),
        }
    }
}

impl RecordResponse {
    /// The stored response: a plain one as it is (whatever the keys, so that turning
    /// encryption on replays the records written before), a sealed one opened with `keys`
    /// under the record's additional data `aad`.
    pub fn open(self, keys: Option<&Keyring>, aad: &[u8]) -> Result<StoredResponse, OpenError> {
        let sealed = match self {
            RecordResponse::Plain(stored) => return Ok(stored),
            RecordResponse::Sealed { sealed } => sealed,
        };
        let plaintext = keys.ok_or(OpenError::NoKeys)?.open(aad, &sealed)?;
        serde_json::from_slice(&plaintext).map_err(|_| OpenError::Malformed)
    }

    #[cfg(test)]
    /// The response when it is stored in the clear.
    pub(crate) fn plain(&self) -> Option<&StoredResponse> {
        match self {
            RecordResponse::Plain(stored) => Some(stored),
            RecordResponse::Sealed { .. } => None,
        }
    }

    /// The JSON that goes into the record.
    pub fn to_json(&self) -> String {
        match self {
            RecordResponse::Plain(stored) => stored.to_json(),
            RecordResponse::Sealed { .. } => serde_json::to_string(self).unwrap_or_default(),
        }
    }
}

fn v1() -> u32 {
    1
}

/// What a replay sends back. A reference record has no body: only the status and the
/// `location` (and other replay headers) of the original response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    pub status: u16,
    #[serde(default)]
    pub(crate) headers: Vec<(String, String)>,
    /// The body when it is UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// The body, base64, when it is not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) body_base64: Option<String>,
    /// True when the body was not stored (too large, or `replay: "reference"`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub(crate) reference: bool,
    /// The trailers stored (for a gRPC response, its status: `grpc-status`, `grpc-message`),
    /// or for a trailers-only gRPC response the same fields found in its headers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) trailers: Vec<(String, String)>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl StoredResponse {
    /// Stores `body` when given (as text if UTF-8, else base64), else a reference.
    pub fn new(status: u16, headers: Vec<(String, String)>, body: Option<&[u8]>) -> StoredResponse {
        let (text, b64) = match body {
            None => (None, None),
            Some(b) => match std::str::from_utf8(b) {
                Ok(s) => (Some(s.to_string()), None),
                Err(_) => (None, Some(base64_encode(b))),
            },
        };
        StoredResponse {
            status,
            headers,
            body: text,
            body_base64: b64,
            reference: body.is_none(),
            trailers: Vec::new(),
        }
    }

    /// The same, with stored trailers.
    pub(crate) fn with_trailers(mut self, trailers: Vec<(String, String)>) -> StoredResponse {
        self.trailers = trailers;
        self
    }

    /// A stored trailer.
    pub(crate) fn trailer(&self, name: &str) -> Option<&str> {
        self.trailers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| format!("{{\"status\":{}}}", self.status))
    }

    /// This response sealed with `keys`' current key under `nonce` (fresh: never used before
    /// with that key), for the record whose additional data is `aad`.
    pub fn seal(
        &self,
        keys: &Keyring,
        aad: &[u8],
        nonce: [u8; NONCE_LEN],
    ) -> Option<RecordResponse> {
        let sealed = keys.seal(aad, self.to_json().as_bytes(), nonce)?;
        Some(RecordResponse::Sealed { sealed })
    }

    /// The body to replay (empty for a reference record), taken out of the response (a text
    /// body is not copied); `None` if the stored base64 is bad.
    pub(crate) fn take_body(&mut self) -> Option<Vec<u8>> {
        match (self.body.take(), &self.body_base64) {
            (Some(text), _) => Some(text.into_bytes()),
            (None, Some(b64)) => base64_decode(b64),
            (None, None) => Some(Vec::new()),
        }
    }
}

impl Record {
    /// Reads a stored record; `None` when it is not a record we can act on.
    pub fn parse(bytes: &[u8]) -> Option<Record> {
        let r: Record = serde_json::from_slice(bytes).ok()?;
        if !r.fingerprint.starts_with("sha256:") {
            return None;
        }
        if r.state == State::Completed && r.response.is_none() {
            return None;
        }
        Some(r)
    }
}

/// What writing a completed record whose body is `body` takes at its peak, at most: the body
/// copied into the stored response, its JSON, the script call's copy of that, and the call as
/// the gateway gets it (every byte but a letter, a digit, `-` and `_` percent-encoded); sealed,
/// the plaintext, the ciphertext and its base64 besides. Exact for the body's own part (a text
/// body's JSON escapes, counted byte by byte), plus room for the status and headers.
pub(crate) fn completion_need(body: &[u8], sealed: bool) -> usize {
    const HEAD: usize = 16 << 10;
    let (json, encoded) = match std::str::from_utf8(body) {
        Ok(_) => body.iter().fold((0usize, 0usize), |(j, e), &b| {
            let (dj, de) = match b {
                b'"' | b'\\' => (2, 6),
                b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => (2, 4),
                0x00..=0x1f => (6, 8),
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' => (1, 1),
                _ => (1, 3),
            };
            (j + dj, e + de)
        }),
        Err(_) => {
            let b64 = body.len().div_ceil(3) * 4;
            (b64, 3 * b64)
        }
    };
    let plain = body.len() + 2 * json + encoded + HEAD;
    if !sealed {
        return plain;
    }
    let b64 = (json + 16).div_ceil(3) * 4;
    body.len() + 2 * json + 16 + 2 * b64 + 3 * b64 + HEAD
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The estimate covers what writing the record really takes: the body's copy, its JSON
    /// twice (the stored response's, the call's) and the call as the gateway gets it.
    #[test]
    fn completion_need_covers_the_copies_made() {
        let mut quotes = br#"{"a":"\"x\""}"#.repeat(2000);
        quotes.extend_from_slice(b"\x01\x02\n\t");
        let bodies: [Vec<u8>; 5] = [
            br#"{"id":"order-1","items":[1,2,3],"note":"a b c"}"#.repeat(3000),
            quotes,
            "é€😀 text".repeat(3000).into_bytes(),
            (0..=255u8).cycle().take(50_000).collect(),
            b"\x00\x1f".repeat(10_000),
        ];
        for body in &bodies {
            let headers = vec![("content-type".to_string(), "application/json".to_string())];
            let json = StoredResponse::new(200, headers, Some(body)).to_json();
            let encoded = crate::redis::webdis::encode([json.as_bytes()]);
            let real = body.len() + 2 * json.len() + encoded.len();
            let need = completion_need(body, false);
            assert!(need >= real, "{need} < {real}");
            assert!(
                need <= 2 * real + (64 << 10),
                "not far above: {need} for {real}"
            );
            assert!(completion_need(body, true) > need);
        }
    }

    #[test]
    fn base64_round_trip() {
        for (raw, enc) in [
            (&b""[..], ""),
            (b"f", "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"\xff\x00\xfe\x10", "/wD+EA=="),
        ] {
            assert_eq!(base64_encode(raw), enc);
            assert_eq!(base64_decode(enc).as_deref(), Some(raw));
        }
        let all: Vec<u8> = (0..=255).collect();
        for len in 0..=all.len() {
            let data = &all[all.len() - len..];
            let text = base64_encode(data);
            assert_eq!(text.len(), len.div_ceil(3) * 4);
            assert_eq!(base64_decode(&text).as_deref(), Some(data), "{len} bytes");
        }
        for bad in ["Zg=", "Z===", "Zm9v!", "=Zg=", "Zg==Zm9v", "Zm9v\n", "Zm=v"] {
            assert_eq!(base64_decode(bad), None, "{bad}");
        }
    }

    #[test]
    fn reads_processing_and_completed() {
        let p = Record::parse(
            br#"{"schema_version":1,"state":"PROCESSING","fingerprint":"sha256:ab","owner":"o1","created_ms":5,"updated_ms":5}"#,
        )
        .expect("readable");
        assert_eq!(p.state, State::Processing);
        assert_eq!(p.owner.as_deref(), Some("o1"));
        let c = Record::parse(
            br#"{"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:ab","created_ms":5,"updated_ms":9,
                 "response":{"status":201,"headers":[["content-type","application/json"]],"body":"{\"id\":1}"}}"#,
        )
        .expect("readable");
        let r = c
            .response
            .as_ref()
            .and_then(RecordResponse::plain)
            .expect("response");
        assert_eq!(r.status, 201);
        assert_eq!(r.clone().take_body().as_deref(), Some(&b"{\"id\":1}"[..]));
    }

    #[test]
    fn tolerates_other_versions() {
        // An older writer: no schema_version, no timestamps; a newer one: extra fields.
        let old = Record::parse(
            br#"{"state":"COMPLETED","fingerprint":"sha256:ab","response":{"status":200}}"#,
        )
        .expect("old record readable");
        assert_eq!(old.schema_version, 1);
        assert_eq!(
            old.response
                .as_ref()
                .and_then(RecordResponse::plain)
                .and_then(|s| s.clone().take_body()),
            Some(vec![])
        );
        let newer = Record::parse(
            br#"{"schema_version":2,"state":"PROCESSING","fingerprint":"sha256:ab","owner":"x","lease":{"n":1},"trace":"t"}"#,
        )
        .expect("newer record readable");
        assert_eq!(newer.schema_version, 2);
    }

    #[test]
    fn refuses_unreadable() {
        for bad in [
            &b"not json"[..],
            br#"{"state":"DONE","fingerprint":"sha256:ab"}"#,
            br#"{"state":"PROCESSING"}"#,
            br#"{"state":"PROCESSING","fingerprint":"md5:ab"}"#,
            br#"{"state":"COMPLETED","fingerprint":"sha256:ab"}"#,
            br#"{"state":"COMPLETED","fingerprint":"sha256:ab","response":{"status":"x"}}"#,
            br#"{"state":"COMPLETED","fingerprint":"sha256:ab","response":{"headers":[]}}"#,
            // A sealed response that does not read as one is not read as a plain one either.
            br#"{"state":"COMPLETED","fingerprint":"sha256:ab","response":{"sealed":{"alg":"A256GCM"},"status":200,"body":"x"}}"#,
            br#"{"state":"COMPLETED","fingerprint":"sha256:ab","response":{"sealed":"x","status":200}}"#,
            // A repeated field is ambiguous.
            br#"{"state":"COMPLETED","fingerprint":"sha256:ab","response":{"status":200,"status":201}}"#,
        ] {
            assert_eq!(Record::parse(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    /// Every field of a response in the clear, and a sealed one (beside a `status` it does not
    /// read), come back as they were written.
    #[test]
    fn responses_read_back_as_written() {
        let mut grpc = StoredResponse::new(200, vec![("content-type".into(), "a/b".into())], None);
        grpc.reference = true;
        grpc.trailers = vec![("grpc-status".into(), "5".into())];
        let sealed = RecordResponse::Sealed {
            sealed: Sealed {
                alg: "A256GCM".into(),
                kid: "k1".into(),
                nonce: "bm9uY2U=".into(),
                ct: "Y3Q=".into(),
            },
        };
        let responses = [
            RecordResponse::Plain(StoredResponse::new(201, vec![], Some(b"ok"))),
            RecordResponse::Plain(StoredResponse::new(200, vec![], Some(b"\xff\x00"))),
            RecordResponse::Plain(grpc),
            sealed.clone(),
        ];
        let record = |json: &str| {
            format!(r#"{{"state":"COMPLETED","fingerprint":"sha256:ab","response":{json}}}"#)
        };
        for r in responses {
            let read = Record::parse(record(&r.to_json()).as_bytes()).and_then(|c| c.response);
            assert_eq!(read.as_ref(), Some(&r), "{}", r.to_json());
        }
        let with_status = sealed.to_json().replacen('{', r#"{"status":200,"#, 1);
        let read = Record::parse(record(&with_status).as_bytes()).and_then(|c| c.response);
        assert_eq!(read, Some(sealed));
    }

    #[test]
    fn stored_response_json() {
        let r = StoredResponse::new(
            201,
            vec![("location".into(), "/orders/1".into())],
            Some(b"ok"),
        );
        assert_eq!(
            r.to_json(),
            r#"{"status":201,"headers":[["location","/orders/1"]],"body":"ok"}"#
        );
        let bin = StoredResponse::new(200, vec![], Some(b"\xff\x00"));
        assert_eq!(
            bin.to_json(),
            r#"{"status":200,"headers":[],"body_base64":"/wA="}"#
        );
        assert_eq!(bin.clone().take_body(), Some(vec![0xff, 0x00]));
        let reference = StoredResponse::new(201, vec![], None);
        assert_eq!(
            reference.to_json(),
            r#"{"status":201,"headers":[],"reference":true}"#
        );
    }

    #[test]
    fn trailers_round_trip() {
        let r = StoredResponse::new(
            200,
            vec![("content-type".into(), "application/grpc".into())],
            Some(b"\x00\x00\x00\x00\x02hi"),
        )
        .with_trailers(vec![
            ("grpc-status".into(), "5".into()),
            ("grpc-message".into(), "no%20such%20order".into()),
        ]);
        let json = r.to_json();
        assert_eq!(
            json,
            r#"{"status":200,"headers":[["content-type","application/grpc"]],"body":"\u0000\u0000\u0000\u0000\u0002hi","trailers":[["grpc-status","5"],["grpc-message","no%20such%20order"]]}"#
        );
        let record = format!(
            r#"{{"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:ab","response":{json}}}"#
        );
        let back = Record::parse(record.as_bytes())
            .and_then(|r| r.response?.plain().cloned())
            .expect("readable");
        assert_eq!(back, r);
        assert_eq!(back.trailer("grpc-status"), Some("5"));
        assert_eq!(back.trailer("grpc-message"), Some("no%20such%20order"));
        assert_eq!(back.trailer("x"), None);
        // A record without trailers (older writer) reads as none; trailers of another shape
        // make the record unreadable rather than half-read.
        let old = Record::parse(
            br#"{"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:ab","response":{"status":201,"headers":[],"body":"ok"}}"#,
        )
        .and_then(|r| r.response?.plain().cloned())
        .expect("readable");
        assert!(old.trailers.is_empty());
        assert_eq!(old.trailer("grpc-status"), None);
        assert_eq!(
            Record::parse(
                br#"{"state":"COMPLETED","fingerprint":"sha256:ab","response":{"status":200,"trailers":"grpc-status: 0"}}"#
            ),
            None
        );
    }
}
