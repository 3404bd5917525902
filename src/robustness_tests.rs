//! Bad input never panics: every parser that sees bytes from a client, the gateway or the
//! operator gets thousands of random and mutated inputs. (A panic would abort the VM.)

use crate::config::Config;
use crate::guards::idempotency::canonical::canonicalize;
use crate::guards::idempotency::header::parse_key;
use crate::guards::idempotency::record::{Record, StoredResponse};
use crate::guards::idempotency::seal::{record_aad, Keyring, RecordKey};
use crate::redis::resp;
use crate::support::ids::TokenSource;
use crate::support::text::base64_decode;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// Deterministic pseudo-random bytes.
struct Bytes(TokenSource);

impl Bytes {
    fn new(seed: u64) -> Bytes {
        Bytes(TokenSource::with_seed(seed, seed ^ 0x5555))
    }

    fn next(&mut self) -> u64 {
        u64::from_str_radix(&self.0.token()[..16], 16).unwrap_or(0)
    }

    fn vec(&mut self, max: usize, alphabet: &[u8]) -> Vec<u8> {
        let len = (self.next() % (max as u64 + 1)) as usize;
        (0..len)
            .map(|_| alphabet[(self.next() % alphabet.len() as u64) as usize])
            .collect()
    }

    /// `seed` with a few bytes replaced, inserted or removed.
    fn mutate(&mut self, seed: &[u8]) -> Vec<u8> {
        let mut v = seed.to_vec();
        for _ in 0..(1 + self.next() % 4) {
            let at = if v.is_empty() {
                0
            } else {
                (self.next() % v.len() as u64) as usize
            };
            let byte = (self.next() % 256) as u8;
            match self.next() % 3 {
                0 if !v.is_empty() => v[at] = byte,
                1 => v.insert(at, byte),
                _ if !v.is_empty() => {
                    v.remove(at);
                }
                _ => v.push(byte),
            }
        }
        v
    }
}

const ALL: &[u8] = &[
    b'{', b'}', b'[', b']', b'"', b'\\', b':', b',', b'0', b'1', b'9', b'-', b'.', b'e', b'a',
    b'n', b't', b'u', b' ', b'\r', b'\n', b'*', b'$', b'+', 0, 0xff, 0xc3, 0xa9,
];

#[test]
fn resp_parser_never_panics() {
    let mut r = Bytes::new(1);
    let seeds: &[&[u8]] = &[
        b"*3\r\n:1\r\n$2\r\nab\r\n*1\r\n:-2\r\n",
        b"$5\r\nhello\r\n",
        b"-NOSCRIPT x\r\n",
    ];
    for i in 0..20_000 {
        let input = if i % 2 == 0 {
            r.vec(64, ALL)
        } else {
            r.mutate(seeds[i % seeds.len()])
        };
        let _ = resp::parse(&input);
    }
}

#[test]
fn canonical_json_never_panics() {
    let mut r = Bytes::new(2);
    let seed = br#"{"b":[1,2.5e-3,{"z":"\u00e9\ud83d\ude00"}],"a":null,"c":true}"#;
    for i in 0..20_000 {
        let input = if i % 2 == 0 {
            r.vec(64, ALL)
        } else {
            r.mutate(seed)
        };
        if let Some(out) = canonicalize(&input) {
            // What comes out is JSON again, and canonical: a fixed point.
            assert_eq!(
                canonicalize(&out).as_deref(),
                Some(out.as_slice()),
                "{input:?}"
            );
        }
    }
}

#[test]
fn key_header_and_records_never_panic() {
    let mut r = Bytes::new(3);
    let record = br#"{"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:ab","response":{"status":201,"body_base64":"/wA="}}"#;
    for _ in 0..20_000 {
        let raw = r.vec(300, ALL);
        let text = String::from_utf8_lossy(&raw);
        let _ = parse_key(&[&text]);
        let _ = base64_decode(&text);
        if let Some(rec) = Record::parse(&r.mutate(record)) {
            let _ = rec.response.and_then(|s| s.plain()?.clone().take_body());
        }
    }
}

#[test]
fn mutated_sealed_records_never_panic_and_never_open() {
    let mut r = Bytes::new(4);
    let keys = Keyring::new(
        RecordKey::from_bytes(&[9; 32]).expect("key"),
        Some(RecordKey::from_bytes(&[8; 32]).expect("key")),
    );
    let aad = record_aad("cg:idem:{t.ab}:p:cd", "sha256:ab");
    let response = StoredResponse::new(201, vec![("etag".into(), "\"v1\"".into())], Some(b"ok"));
    let sealed = response.seal(&keys, &aad, [3; 12]).expect("sealed");
    let record = format!(
        r#"{{"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:ab","response":{}}}"#,
        sealed.to_json()
    );
    let original = Record::parse(record.as_bytes()).and_then(|rec| rec.response);
    assert_eq!(
        original.clone().map(|s| s.open(Some(&keys), &aad)),
        Some(Ok(response))
    );
    let mut opened = 0;
    for _ in 0..20_000 {
        let mutated = r.mutate(record.as_bytes());
        if let Some(rec) = Record::parse(&mutated) {
            if let Some(s) = rec.response.filter(|s| Some(s) != original.as_ref()) {
                opened += usize::from(s.open(Some(&keys), &aad).is_ok());
            }
        }
    }
    assert_eq!(opened, 0, "a mutated seal opened");
}

#[test]
fn config_parser_never_panics() {
    let mut r = Bytes::new(4);
    let seed = br#"{"redis":{"cluster":"gw","timeout":"50ms","batch":{"max_delay":"1ms"}},"over_limit_cache":{"entries":5},
      "policies":[{"name":"p","match":{"methods":["POST"],"path_prefix":"/o"},
      "rate_limits":[{"name":"l","by":["tenant","path_segment:2"],"algorithm":"token_bucket","limit":5,"window":"1s","burst":9}],
      "idempotency":{"max_request_body":"1KiB","retryable_statuses":["5xx",429]},
      "lease":{"resource":["query:id"],"ttl":"2s","on_busy":"wait"}}]}"#;
    assert!(Config::parse(seed).is_ok(), "the seed is valid");
    for _ in 0..5_000 {
        let _ = Config::parse(&r.mutate(seed));
    }
}
