//! Text building blocks shared by keys, headers and bodies: decimal numbers and hex, written
//! into an existing buffer (no intermediate strings on the request path).

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;

/// Appends `text`. Not inlined: a request writes its keys, arguments and headers in dozens
/// of places, and inlined each would be a copy of the growth and the copy (what a request
/// costs in Envoy follows the distinct code it runs, not the calls).
#[inline(never)]
pub(crate) fn push(out: &mut String, text: &str) {
    out.push_str(text);
}

/// `s` split around its first `sep` (an ASCII byte, which never stands inside a longer
/// character); `None` when `s` has none. Not inlined, as [`push`]: `str::split_once` with a
/// `char` brings its own searcher to every place it is called, and a request splits its path,
/// its authority and its query in several.
#[inline(never)]
pub(crate) fn split_once_byte(s: &str, sep: u8) -> Option<(&str, &str)> {
    debug_assert!(sep.is_ascii());
    let at = s.bytes().position(|b| b == sep)?;
    Some((s.get(..at)?, s.get(at + 1..)?))
}

/// [`split_once_byte`] around the last `sep`.
#[inline(never)]
pub(crate) fn rsplit_once_byte(s: &str, sep: u8) -> Option<(&str, &str)> {
    debug_assert!(sep.is_ascii());
    let at = s.bytes().rposition(|b| b == sep)?;
    Some((s.get(..at)?, s.get(at + 1..)?))
}

/// The media type of a `Content-Type` value: the text before its first `;` (its parameters
/// dropped), trimmed, its case kept.
pub(crate) fn media_type(content_type: &str) -> &str {
    split_once_byte(content_type, b';')
        .map_or(content_type, |(media, _)| media)
        .trim()
}

/// Appends `n` in decimal. Not inlined, as [`push`]: one copy for every number a request
/// writes.
#[inline(never)]
pub(crate) fn push_u64(out: &mut String, n: u64) {
    let mut digits = [0u8; 20];
    push(out, ascii(decimal(n, &mut digits)));
}

/// [`push_u64`] onto bytes.
pub(crate) fn push_u64_bytes(out: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    out.extend_from_slice(decimal(n, &mut digits));
}

/// The decimal digits of `n`, written at the end of `digits`, two at a time: half the
/// divisions of one at a time (numbers are written on every request: keys, arguments,
/// headers).
pub(crate) fn decimal(mut n: u64, digits: &mut [u8; 20]) -> &[u8] {
    let mut at = digits.len();
    while n >= 100 {
        let pair = 2 * (n % 100) as usize;
        n /= 100;
        at -= 2;
        digits[at..at + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    }
    if n >= 10 {
        let pair = 2 * n as usize;
        at -= 2;
        digits[at..at + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    } else {
        at -= 1;
        digits[at] = b'0' + n as u8;
    }
    &digits[at..]
}

/// "00" to "99", each pair of digits at twice its value.
const PAIRS: &[u8; 200] = b"\
    0001020304050607080910111213141516171819\
    2021222324252627282930313233343536373839\
    4041424344454647484950515253545556575859\
    6061626364656667686970717273747576777879\
    8081828384858687888990919293949596979899";

/// ASCII bytes as text: one `push_str` where pushing each byte as a `char` checks the
/// capacity and the encoding every time. Never empty for ASCII (anything else is a bug, and
/// is left out rather than panicking).
fn ascii(bytes: &[u8]) -> &str {
    std::str::from_utf8(bytes).unwrap_or_default()
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

/// Appends the lower-case hex of `bytes` (const-hex, 32 bytes of hex at a time).
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    let mut text = [0u8; 64];
    for chunk in bytes.chunks(text.len() / 2) {
        let Some(dst) = text.get_mut(..2 * chunk.len()) else {
            return;
        };
        if const_hex::encode_to_slice(chunk, dst).is_ok() {
            out.push_str(ascii(dst));
        }
    }
}

/// The character a JSON string's escape `\<b>` stands for, for every escape but `\u` (which
/// the caller reads on: four hex digits follow); `None` for `u` and for a byte no escape has.
pub(crate) fn json_escape(b: u8) -> Option<char> {
    Some(match b {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        _ => return None,
    })
}

/// Standard base64 with padding (the `base64` crate's standard engine).
pub(crate) fn base64_encode(data: &[u8]) -> String {
    STANDARD.encode(data)
}

/// Standard base64 with padding, canonical (`=` only at the end, no stray bits); `None` for
/// anything else.
pub(crate) fn base64_decode(text: &str) -> Option<Vec<u8>> {
    STANDARD.decode(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn byte_splits_are_str_splits() {
        // Beside std's char splits on the same text: none, first, last, at either end,
        // repeated, and multi-byte characters around the separator.
        let texts = [
            "",
            "?",
            "a",
            "a?b",
            "?a",
            "a?",
            "a??b",
            "a?b?c",
            "é?ü",
            "日本?語?",
            "a:b:c",
            "::",
        ];
        for text in texts {
            for (sep, ch) in [(b'?', '?'), (b':', ':')] {
                assert_eq!(split_once_byte(text, sep), text.split_once(ch), "{text:?}");
                assert_eq!(
                    rsplit_once_byte(text, sep),
                    text.rsplit_once(ch),
                    "{text:?}"
                );
            }
        }
    }

    #[test]
    fn media_type_drops_parameters() {
        for (value, want) in [
            ("application/json", "application/json"),
            (" Text/Event-Stream ; charset=utf-8", "Text/Event-Stream"),
            ("application/json;", "application/json"),
            (";charset=utf-8", ""),
            ("", ""),
            ("a; b; c", "a"),
        ] {
            assert_eq!(media_type(value), want, "{value:?}");
        }
    }

    #[test]
    fn push_u64_writes_decimal() {
        // Every number up to five digits (odd and even digit counts, each pair), then each
        // power of ten and its neighbours up to the largest.
        let powers = (1..20).map(|e| 10u64.pow(e));
        let edges = powers.flat_map(|p| [p - 1, p, p + 1]);
        for n in (0..100_000).chain(edges).chain([u64::MAX - 1, u64::MAX]) {
            let mut out = String::from("x");
            push_u64(&mut out, n);
            assert_eq!(out, format!("x{n}"));
        }
    }

    #[test]
    fn push_u64_bytes_writes_decimal() {
        for n in [0, 7, 10, 429, u64::MAX] {
            let mut out = b"x".to_vec();
            push_u64_bytes(&mut out, n);
            assert_eq!(out, format!("x{n}").into_bytes());
        }
    }

    #[test]
    fn hex_encoding() {
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(hex(&[]), "");
        // Every byte, and lengths around the 32 bytes written at a time.
        let all: Vec<u8> = (0..=255).collect();
        for len in [1, 31, 32, 33, 64, 65, 256] {
            let mut out = String::from("x");
            push_hex(&mut out, &all[..len]);
            let want: String = all[..len].iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(out, format!("x{want}"), "{len} bytes");
        }
    }
}
