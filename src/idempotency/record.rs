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

use serde::{Deserialize, Serialize};

pub const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum State {
    #[serde(rename = "PROCESSING")]
    Processing,
    #[serde(rename = "COMPLETED")]
    Completed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    #[serde(default = "v1")]
    pub schema_version: u32,
    pub state: State,
    pub fingerprint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(default)]
    pub created_ms: u64,
    #[serde(default)]
    pub updated_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<StoredResponse>,
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
    pub headers: Vec<(String, String)>,
    /// The body when it is UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// The body, base64, when it is not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_base64: Option<String>,
    /// True when the body was not stored (too large, or `replay: "reference"`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub reference: bool,
    /// The trailers stored (for a gRPC response, its status: `grpc-status`, `grpc-message`),
    /// or for a trailers-only gRPC response the same fields found in its headers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trailers: Vec<(String, String)>,
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
    pub fn with_trailers(mut self, trailers: Vec<(String, String)>) -> StoredResponse {
        self.trailers = trailers;
        self
    }

    /// A stored trailer.
    pub fn trailer(&self, name: &str) -> Option<&str> {
        self.trailers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| format!("{{\"status\":{}}}", self.status))
    }

    /// The body to replay (empty for a reference record); `None` if the stored base64 is bad.
    pub fn body_bytes(&self) -> Option<Vec<u8>> {
        match (&self.body, &self.body_base64) {
            (Some(text), _) => Some(text.as_bytes().to_vec()),
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

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

pub fn base64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(B64[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

pub fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        let mut pad = 0;
        for (i, &c) in chunk.iter().enumerate() {
            let v = match c {
                b'A'..=b'Z' => c - b'A',
                b'a'..=b'z' => c - b'a' + 26,
                b'0'..=b'9' => c - b'0' + 52,
                b'+' => 62,
                b'/' => 63,
                b'=' if i >= 2 => {
                    pad += 1;
                    0
                }
                _ => return None,
            };
            if pad > 0 && c != b'=' {
                return None;
            }
            n = (n << 6) | u32::from(v);
        }
        let decoded = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&decoded[..3 - pad]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        for bad in ["Zg=", "Z===", "Zm9v!", "=Zg="] {
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
        let r = c.response.expect("response");
        assert_eq!(r.status, 201);
        assert_eq!(r.body_bytes().as_deref(), Some(&b"{\"id\":1}"[..]));
    }

    #[test]
    fn tolerates_other_versions() {
        // An older writer: no schema_version, no timestamps; a newer one: extra fields.
        let old = Record::parse(
            br#"{"state":"COMPLETED","fingerprint":"sha256:ab","response":{"status":200}}"#,
        )
        .expect("old record readable");
        assert_eq!(old.schema_version, 1);
        assert_eq!(old.response.and_then(|r| r.body_bytes()), Some(vec![]));
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
        ] {
            assert_eq!(Record::parse(bad), None, "{}", String::from_utf8_lossy(bad));
        }
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
        assert_eq!(bin.body_bytes(), Some(vec![0xff, 0x00]));
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
            .and_then(|r| r.response)
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
        .and_then(|r| r.response)
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
