//! Identities read from the request's dynamic metadata (a verified token's claims), with their
//! type.
//!
//! Envoy hands a metadata leaf over as its bare bytes: a string as its text, a number as the
//! 8 bytes of a double, a boolean as one byte. The bytes do not say which: the double
//! 5419773080977729 is the 8 bytes `AAAAAA3C`. So the filter reads the whole `metadata`
//! property instead, which Envoy serializes as the protobuf `envoy.config.core.v3.Metadata`
//! (`filter_metadata`: a map of filter name to `google.protobuf.Struct`), where every value
//! carries its kind, and walks it to the claim.
//!
//! A JSON number reaches the metadata as a double (jwt_authn parses the payload into a
//! `Struct`), so an integer is an identity only while a double holds it exactly: from
//! -(2^53 - 1) to 2^53 - 1 (2^53 and 2^53 + 1 arrive as the same double, a 64-bit snowflake id
//! loses its last digits). Anything else (a fraction, a larger number, a boolean, a map, a list,
//! null, a string with a control character) names no one identity and is [`Claim::Unusable`].

/// A claim as an identity.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) enum Claim {
    /// No value at the path (no token, or a token without the claim).
    #[default]
    Absent,
    /// A string, or an integer within ±(2^53 - 1) as its decimal text.
    Text(String),
    /// A value that names no one identity (see the module's documentation).
    Unusable,
}

/// The largest integer a double holds exactly, with every integer below it.
pub(crate) const MAX_EXACT_INTEGER: f64 = 9_007_199_254_740_991.0;

/// The claim at `path` (`[filter, key, ...]`) of `metadata`, the host's serialized
/// `envoy.config.core.v3.Metadata` (empty when the request has none).
pub(crate) fn metadata_claim(metadata: &[u8], path: &[String]) -> Claim {
    find(metadata, path).unwrap_or(Claim::Unusable)
}

/// Bytes that are not the protobuf they should be (never from Envoy; refused, not guessed).
#[derive(Debug)]
struct Malformed;

/// `Metadata.filter_metadata`, and `Struct.fields`: each a map's field number.
const FILTER_METADATA: u64 = 1;
const STRUCT_FIELDS: u64 = 1;

fn find(metadata: &[u8], path: &[String]) -> Result<Claim, Malformed> {
    let Some((filter, keys)) = path.split_first() else {
        return Ok(Claim::Absent);
    };
    let Some((leaf, inner)) = keys.split_last() else {
        return Ok(Claim::Absent);
    };
    // filter_metadata: map<string, Struct>.
    let Some(mut fields) = map_value(metadata, FILTER_METADATA, filter)? else {
        return Ok(Claim::Absent);
    };
    for key in inner {
        // Struct.fields: map<string, Value>; a step of the path must be a struct.
        let Some(value) = map_value(fields, STRUCT_FIELDS, key)? else {
            return Ok(Claim::Absent);
        };
        match kind(value)? {
            Kind::Struct(s) => fields = s,
            _ => return Ok(Claim::Absent),
        }
    }
    match map_value(fields, STRUCT_FIELDS, leaf)? {
        None => Ok(Claim::Absent),
        Some(value) => Ok(leaf_claim(kind(value)?)),
    }
}

/// The kind of a `google.protobuf.Value`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind<'a> {
    Unset,
    Null,
    Number(f64),
    Str(&'a [u8]),
    Bool,
    Struct(&'a [u8]),
    List,
}

fn leaf_claim(kind: Kind<'_>) -> Claim {
    match kind {
        Kind::Str(bytes) => match std::str::from_utf8(bytes) {
            Ok(text) if !text.chars().any(char::is_control) => Claim::Text(text.to_string()),
            _ => Claim::Unusable,
        },
        Kind::Number(n) if n.is_finite() && n.fract() == 0.0 && n.abs() <= MAX_EXACT_INTEGER => {
            // Exact: |n| <= 2^53 - 1 fits an i64 without rounding (-0 is 0).
            Claim::Text(format!("{}", n as i64))
        }
        Kind::Number(_) | Kind::Unset | Kind::Null | Kind::Bool | Kind::Struct(_) | Kind::List => {
            Claim::Unusable
        }
    }
}

/// A `google.protobuf.Value`'s kind (a oneof: the last on the wire counts).
fn kind(value: &[u8]) -> Result<Kind<'_>, Malformed> {
    let mut kind = Kind::Unset;
    for field in Fields(value) {
        kind = match field? {
            (1, Wire::Varint) => Kind::Null,
            (2, Wire::Fixed64(bits)) => Kind::Number(f64::from_le_bytes(bits)),
            (3, Wire::Bytes(s)) => Kind::Str(s),
            (4, Wire::Varint) => Kind::Bool,
            (5, Wire::Bytes(s)) => Kind::Struct(s),
            (6, Wire::Bytes(_)) => Kind::List,
            (1..=6, _) => return Err(Malformed),
            _ => kind,
        };
    }
    Ok(kind)
}

/// The value of `key` in the map that is field `number` of `message` (entries: key 1, value
/// 2; the last entry of a key counts, as protobuf merges maps); `None` when absent.
fn map_value<'a>(message: &'a [u8], number: u64, key: &str) -> Result<Option<&'a [u8]>, Malformed> {
    let mut found = None;
    for field in Fields(message) {
        let entry = match field? {
            (n, Wire::Bytes(entry)) if n == number => entry,
            (n, _) if n == number => return Err(Malformed),
            _ => continue,
        };
        let (mut k, mut v): (&[u8], &[u8]) = (b"", b"");
        for part in Fields(entry) {
            match part? {
                (1, Wire::Bytes(b)) => k = b,
                (2, Wire::Bytes(b)) => v = b,
                (1 | 2, _) => return Err(Malformed),
                _ => {}
            }
        }
        if k == key.as_bytes() {
            found = Some(v);
        }
    }
    Ok(found)
}

/// A field's payload by wire type.
#[derive(Debug, Clone, Copy)]
enum Wire<'a> {
    Varint,
    Fixed64([u8; 8]),
    Bytes(&'a [u8]),
    Fixed32,
}

/// The fields of a protobuf message, in wire order; stops after the first malformed one.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u64, Wire<'a>), Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let field = self.field();
        if field.is_err() {
            self.0 = &[];
        }
        Some(field)
    }
}

impl<'a> Fields<'a> {
    fn field(&mut self) -> Result<(u64, Wire<'a>), Malformed> {
        let tag = self.varint()?;
        let wire = match tag & 7 {
            0 => {
                self.varint()?;
                Wire::Varint
            }
            1 => {
                let (bits, rest) = self.0.split_first_chunk::<8>().ok_or(Malformed)?;
                self.0 = rest;
                Wire::Fixed64(*bits)
            }
            2 => {
                let len = usize::try_from(self.varint()?).map_err(|_| Malformed)?;
                if len > self.0.len() {
                    return Err(Malformed);
                }
                let (bytes, rest) = self.0.split_at(len);
                self.0 = rest;
                Wire::Bytes(bytes)
            }
            5 => {
                let (_, rest) = self.0.split_first_chunk::<4>().ok_or(Malformed)?;
                self.0 = rest;
                Wire::Fixed32
            }
            // Groups (3, 4) are not in these messages; 6 and 7 are no wire type.
            _ => return Err(Malformed),
        };
        match tag >> 3 {
            0 => Err(Malformed),
            number => Ok((number, wire)),
        }
    }

    fn varint(&mut self) -> Result<u64, Malformed> {
        let mut value = 0u64;
        for (i, &b) in self.0.iter().enumerate().take(10) {
            value |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                self.0 = &self.0[i + 1..];
                return Ok(value);
            }
        }
        Err(Malformed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn path(p: &[&str]) -> Vec<String> {
        p.iter().map(|s| s.to_string()).collect()
    }

    const JWT: &str = "envoy.filters.http.jwt_authn";

    /// Hex of what Envoy 1.40 handed the filter for `metadata` with jwt_authn's payload
    /// (`payload_in_metadata: payload`), read with a probe build from real tokens.
    fn envoy(hex: &str) -> Vec<u8> {
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
            .collect()
    }

    /// `{"tid": 5419773080977729, "sub": "u", "iss": ..., "iat": ..., "exp": ...}`: the
    /// double's bytes spell "AAAAAA3C".
    const NUMERIC_TID: &str = "0a8f010a1c656e766f792e66696c746572732e687474702e6a77745f617574686e126f0a6d0a077061796c6f616412622a600a0a0a0373756212031a01750a100a03657870120911000000d8a9c5da410a1c0a0369737312151a1368747470733a2f2f6973737565722e746573740a100a0369617412091100000042a9c5da410a100a037469641209114141414141413343";
    /// `{"tid": 9007199254740993, ...}` (2^53 + 1): the double 2^53.
    const BEYOND_TID: &str = "0a8f010a1c656e766f792e66696c746572732e687474702e6a77745f617574686e126f0a6d0a077061796c6f616412622a600a100a0369617412091100000042a9c5da410a100a03657870120911000000d8a9c5da410a100a0374696412091100000000000040430a1c0a0369737312151a1368747470733a2f2f6973737565722e746573740a0a0a0373756212031a0175";
    /// `{"tid": "AAAAAA3C", ...}`.
    const STRING_TID: &str = "0a90010a1c656e766f792e66696c746572732e687474702e6a77745f617574686e12700a6e0a077061796c6f616412632a610a110a03746964120a1a0841414141414133430a100a036961741209110000c0c2a8c5da410a1c0a0369737312151a1368747470733a2f2f6973737565722e746573740a0a0a0373756212031a01750a100a036578701209110000c058a9c5da41";
    /// `{"tid": true, ...}`.
    const BOOL_TID: &str = "0a88010a1c656e766f792e66696c746572732e687474702e6a77745f617574686e12680a660a077061796c6f6164125b2a590a1c0a0369737312151a1368747470733a2f2f6973737565722e746573740a100a036578701209110000c058a9c5da410a0a0a0373756212031a01750a090a03746964120220010a100a036961741209110000c0c2a8c5da41";
    /// `{"tid": [1, "a"], ...}`.
    const LIST_TID: &str = "0a98010a1c656e766f792e66696c746572732e687474702e6a77745f617574686e12780a760a077061796c6f6164126b2a690a100a036961741209110000c0c2a8c5da410a1c0a0369737312151a1368747470733a2f2f6973737565722e746573740a0a0a0373756212031a01750a100a036578701209110000c058a9c5da410a190a03746964121232100a0911000000000000f03f0a031a0161";
    /// `{"tid": null, ...}`.
    const NULL_TID: &str = "0a88010a1c656e766f792e66696c746572732e687474702e6a77745f617574686e12680a660a077061796c6f6164125b2a590a090a03746964120208000a0a0a0373756212031a01750a1c0a0369737312151a1368747470733a2f2f6973737565722e746573740a100a036961741209110000c0c2a8c5da410a100a036578701209110000c058a9c5da41";

    fn tid(hex: &str) -> Claim {
        metadata_claim(&envoy(hex), &path(&[JWT, "payload", "tid"]))
    }

    #[test]
    fn claims_as_envoy_serializes_them() {
        assert_eq!(tid(NUMERIC_TID), Claim::Text("5419773080977729".into()));
        assert_eq!(tid(STRING_TID), Claim::Text("AAAAAA3C".into()));
        assert_eq!(tid(BEYOND_TID), Claim::Unusable);
        assert_eq!(tid(BOOL_TID), Claim::Unusable);
        assert_eq!(tid(LIST_TID), Claim::Unusable);
        assert_eq!(tid(NULL_TID), Claim::Unusable);
        let sub = metadata_claim(&envoy(STRING_TID), &path(&[JWT, "payload", "sub"]));
        assert_eq!(sub, Claim::Text("u".into()));
        // Absent: the claim, the key, the filter, or every metadata.
        for p in [
            &[JWT, "payload", "org"][..],
            &[JWT, "claims", "tid"],
            &["other.filter", "payload", "tid"],
            &[JWT, "payload", "sub", "x"],
        ] {
            assert_eq!(
                metadata_claim(&envoy(STRING_TID), &path(p)),
                Claim::Absent,
                "{p:?}"
            );
        }
        assert_eq!(
            metadata_claim(b"", &path(&[JWT, "payload", "tid"])),
            Claim::Absent
        );
    }

    /// Builds `filter_metadata {key: "f", value: {fields {key: "k", value: <value>}}}`.
    fn with_value(value: &[u8]) -> Vec<u8> {
        fn bytes(field: u8, payload: &[u8]) -> Vec<u8> {
            let mut out = vec![field << 3 | 2];
            let mut n = payload.len();
            loop {
                let b = (n & 0x7f) as u8;
                n >>= 7;
                if n == 0 {
                    out.push(b);
                    break;
                }
                out.push(b | 0x80);
            }
            out.extend_from_slice(payload);
            out
        }
        let entry = [bytes(1, b"k"), bytes(2, value)].concat();
        let structure = bytes(1, &entry);
        let filter = [bytes(1, b"f"), bytes(2, &structure)].concat();
        bytes(1, &filter)
    }

    fn number(n: f64) -> Claim {
        let value = [&[0x11][..], &n.to_le_bytes()].concat();
        metadata_claim(&with_value(&value), &path(&["f", "k"]))
    }

    #[test]
    fn numbers_are_identities_only_while_a_double_holds_them_exactly() {
        assert_eq!(number(42.0), Claim::Text("42".into()));
        assert_eq!(number(-7.0), Claim::Text("-7".into()));
        assert_eq!(number(-0.0), Claim::Text("0".into()));
        assert_eq!(
            number(MAX_EXACT_INTEGER),
            Claim::Text("9007199254740991".into())
        );
        assert_eq!(
            number(-MAX_EXACT_INTEGER),
            Claim::Text("-9007199254740991".into())
        );
        for n in [
            9_007_199_254_740_992.0, // 2^53, and 2^53 + 1 read as a double
            -9_007_199_254_740_992.0,
            1.234_567_890_123_456_7e18,
            1.5,
            1e300,
            f64::NAN,
            f64::INFINITY,
        ] {
            assert_eq!(number(n), Claim::Unusable, "{n}");
        }
    }

    #[test]
    fn strings_with_control_characters_and_broken_bytes_are_refused() {
        let string = |s: &[u8]| {
            let value = [&[0x1a, s.len() as u8][..], s].concat();
            metadata_claim(&with_value(&value), &path(&["f", "k"]))
        };
        assert_eq!(string(b"acme"), Claim::Text("acme".into()));
        assert_eq!(
            string(b""),
            Claim::Text(String::new()),
            "empty: missing later"
        );
        assert_eq!(string(b"ac\x01me"), Claim::Unusable);
        assert_eq!(string(b"\0anonymous"), Claim::Unusable);
        assert_eq!(string(b"ac\xffme"), Claim::Unusable);
        // A Value with no kind, and the last kind on the wire wins (a oneof).
        assert_eq!(
            metadata_claim(&with_value(b""), &path(&["f", "k"])),
            Claim::Unusable
        );
        let both = [&[0x1a, 1, b'x'][..], &[0x20, 1]].concat();
        assert_eq!(
            metadata_claim(&with_value(&both), &path(&["f", "k"])),
            Claim::Unusable
        );
    }

    #[test]
    fn malformed_bytes_are_refused_never_read() {
        let good = envoy(STRING_TID);
        let p = path(&[JWT, "payload", "tid"]);
        // Every truncation of a real message: a claim that is there, absent, or refused,
        // never another one, and never a panic.
        for cut in 0..good.len() {
            match metadata_claim(&good[..cut], &p) {
                Claim::Text(t) => assert_eq!(t, "AAAAAA3C", "cut at {cut}"),
                Claim::Absent | Claim::Unusable => {}
            }
        }
        for bad in [
            &[0x0a][..],                     // a length missing
            &[0x0a, 0x05, 0x01],             // longer than the message
            &[0x0b, 0x00],                   // a group
            &[0x0f],                         // wire type 7
            &[0x02, 0x00],                   // field 0
            &[0x0d, 0x00, 0x00, 0x00, 0x00], // filter_metadata as fixed32
            &[0xff; 11],                     // a varint of 11 bytes
        ] {
            assert_eq!(metadata_claim(bad, &p), Claim::Unusable, "{bad:?}");
        }
    }
}
