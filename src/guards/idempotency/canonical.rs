//! Canonical JSON for the request fingerprint: object members sorted by key (recursively), no
//! insignificant whitespace, strings re-escaped one way (`"\u0041"` is `"A"`), and numbers
//! kept exactly as sent. Numbers are not normalised on purpose: `123456789012345678901` and
//! `123456789012345678902` are different requests to the service even though they are the
//! same `f64`, and folding them would replay one request's response for another. An object
//! that repeats a member name is refused (the service may read either value), and the caller
//! then fingerprints the raw bytes.

use std::borrow::Cow;

/// Nesting deeper than this is refused rather than recursed into.
const MAX_DEPTH: usize = 128;

/// The most [`canonicalize`] holds on the heap at once for `input`, at most: its output (no
/// longer than the input: whitespace goes, escapes only shrink), one object's values moved
/// aside (no more than the output), member names it had to unescape (no more than the input),
/// and the member lists of the objects open at once, each at most twice as large as its
/// members need, three times while it grows (the old list and the new one): every member
/// takes a `:` of the input, so no more than `:` bytes are in them.
pub(crate) fn peak_need(input: &[u8]) -> usize {
    let colons = input.iter().filter(|&&b| b == b':').count();
    let member = std::mem::size_of::<(Cow<'_, str>, std::ops::Range<usize>)>();
    3 * input.len() + 3 * member * colons + 256
}

/// The canonical form of `input`, or `None` if it is not JSON (or repeats a member name).
pub(crate) fn canonicalize(input: &[u8]) -> Option<Vec<u8>> {
    let mut p = Parser { s: input, i: 0 };
    let mut out = Vec::with_capacity(input.len());
    p.ws();
    p.value(&mut out, 0)?;
    p.ws();
    (p.i == p.s.len()).then_some(out)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        (self.peek() == Some(b)).then(|| self.i += 1)
    }

    fn value(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'{' => self.object(out, depth),
            b'[' => self.array(out, depth),
            b'"' => {
                let s = self.string()?;
                write_string(out, &s);
                Some(())
            }
            b't' => self.literal(out, b"true"),
            b'f' => self.literal(out, b"false"),
            b'n' => self.literal(out, b"null"),
            _ => self.number(out),
        }
    }

    fn literal(&mut self, out: &mut Vec<u8>, word: &[u8]) -> Option<()> {
        let end = self.i.checked_add(word.len())?;
        (self.s.get(self.i..end)? == word).then(|| {
            self.i = end;
            out.extend_from_slice(word);
        })
    }

    fn object(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        self.eat(b'{')?;
        // Each member's value is written after `start` as it is read, its range kept; once
        // the object is read they are moved aside and written back in key order (one copy per
        // object instead of a buffer per member).
        let start = out.len();
        let mut members: Vec<(Cow<'a, str>, std::ops::Range<usize>)> = Vec::new();
        self.ws();
        if self.eat(b'}').is_none() {
            loop {
                self.ws();
                let key = self.string()?;
                self.ws();
                self.eat(b':')?;
                self.ws();
                let from = out.len() - start;
                self.value(out, depth + 1)?;
                members.push((key, from..out.len() - start));
                self.ws();
                if self.eat(b',').is_some() {
                    continue;
                }
                self.eat(b'}')?;
                break;
            }
        }
        members.sort_by(|a, b| a.0.cmp(&b.0));
        if members.windows(2).any(|w| w[0].0 == w[1].0) {
            return None;
        }
        let values = out.split_off(start);
        out.push(b'{');
        for (n, (key, range)) in members.iter().enumerate() {
            if n > 0 {
                out.push(b',');
            }
            write_string(out, key);
            out.push(b':');
            out.extend_from_slice(values.get(range.clone())?);
        }
        out.push(b'}');
        Some(())
    }

    fn array(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        self.eat(b'[')?;
        out.push(b'[');
        self.ws();
        if self.eat(b']').is_none() {
            let mut first = true;
            loop {
                if !first {
                    out.push(b',');
                }
                first = false;
                self.ws();
                self.value(out, depth + 1)?;
                self.ws();
                if self.eat(b',').is_some() {
                    continue;
                }
                self.eat(b']')?;
                break;
            }
        }
        out.push(b']');
        Some(())
    }

    /// A number, validated against the JSON grammar and copied as written.
    fn number(&mut self, out: &mut Vec<u8>) -> Option<()> {
        let start = self.i;
        self.eat(b'-');
        match self.peek()? {
            b'0' => self.i += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.eat(b'.').is_some() {
            self.peek().filter(u8::is_ascii_digit)?;
            self.digits();
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            self.peek().filter(u8::is_ascii_digit)?;
            self.digits();
        }
        out.extend_from_slice(&self.s[start..self.i]);
        Some(())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.i += 1;
        }
    }

    /// A string literal, unescaped: borrowed from the input when it has no escape, as most
    /// keys and values do.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        self.eat(b'"')?;
        let s = self.s;
        let start = self.i;
        let plain = s.get(start..)?.iter().position(|&b| escaped(b))?;
        let end = start + plain;
        if s.get(end) == Some(&b'"') {
            self.i = end + 1;
            return std::str::from_utf8(s.get(start..end)?)
                .ok()
                .map(Cow::Borrowed);
        }
        let mut out: Vec<u8> = s.get(start..end)?.to_vec();
        self.i = end;
        loop {
            let b = self.peek()?;
            self.i += 1;
            match b {
                b'"' => return String::from_utf8(out).ok().map(Cow::Owned),
                b'\\' => {
                    let e = self.peek()?;
                    self.i += 1;
                    let c = match e {
                        b'u' => self.unicode_escape()?,
                        _ => crate::support::text::json_escape(e)?,
                    };
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
                0x00..=0x1f => return None,
                _ => out.push(b),
            }
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let end = self.i.checked_add(4)?;
        let text = std::str::from_utf8(self.s.get(self.i..end)?).ok()?;
        let v = u32::from_str_radix(text, 16).ok()?;
        self.i = end;
        Some(v)
    }

    fn unicode_escape(&mut self) -> Option<char> {
        let hi = self.hex4()?;
        if (0xd800..0xdc00).contains(&hi) {
            self.eat(b'\\')?;
            self.eat(b'u')?;
            let lo = self.hex4()?;
            if !(0xdc00..0xe000).contains(&lo) {
                return None;
            }
            return char::from_u32(0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00));
        }
        char::from_u32(hi)
    }
}

/// A byte a JSON string cannot hold as itself: a quote, a backslash or a control character
/// (read only through an escape, written only as one).
fn escaped(b: u8) -> bool {
    b == b'"' || b == b'\\' || b < 0x20
}

/// Writes a string the one canonical way (serde_json's escaping). One with nothing to escape
/// (no quote, backslash or control character), as most are, is copied between its quotes.
fn write_string(out: &mut Vec<u8>, s: &str) {
    if !s.bytes().any(escaped) {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
        return;
    }
    let at = out.len();
    if serde_json::to_writer(&mut *out, s).is_err() {
        out.truncate(at);
        out.extend_from_slice(b"\"\"");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn canon(s: &str) -> Option<String> {
        canonicalize(s.as_bytes()).map(|b| String::from_utf8(b).expect("utf8"))
    }

    /// The memory bound the worker checks before fingerprinting holds for the shapes that
    /// cost the most per byte: many tiny members in one object, deep nesting, escaped names,
    /// objects in arrays, long strings.
    #[test]
    fn what_canonicalize_holds_at_once_is_within_peak_need() {
        let flat = format!(
            "{{{}\"z\":0}}",
            (0..20_000)
                .map(|i| format!("\"{i:x}\":0,"))
                .collect::<String>()
        );
        let deep = format!("{}1{}", r#"{"a":"#.repeat(120), "}".repeat(120));
        let escaped = format!(
            "{{{}\"z\":0}}",
            (0..5_000)
                .map(|i| format!("\"\\u00{:02x}{i}\":1,", 0x41 + i % 20))
                .collect::<String>()
        );
        let in_arrays = format!(
            "[{}{{}}]",
            r#"{"b":[1,2],"a":{"d":0,"c":"x"}},"#.repeat(5_000)
        );
        let strings = format!(
            r#"{{"s":"{}","t":["{}"]}}"#,
            "x".repeat(100_000),
            "\\n".repeat(20_000)
        );
        let spaced = format!(
            "{{ {} \"z\" : 0 }}",
            (0..5_000)
                .map(|i| format!("\"k{i}\" :  [ 1 , 2 ] , "))
                .collect::<String>()
        );
        for (name, doc) in [
            ("flat", flat),
            ("deep", deep),
            ("escaped", escaped),
            ("in arrays", in_arrays),
            ("strings", strings),
            ("spaced", spaced),
        ] {
            let (out, peak) =
                crate::support::alloc_count::peak_bytes(|| canonicalize(doc.as_bytes()));
            assert!(out.is_some(), "{name} is JSON");
            let need = peak_need(doc.as_bytes());
            assert!(
                peak <= need,
                "{name}: {peak} bytes held at once, more than {need}"
            );
        }
    }

    #[test]
    fn objects_within_arrays_within_objects_sort_each_level_on_its_own() {
        let cases = [
            (
                r#"{"b":{"d":[{"f":1,"e":"x\"y"},{"h":{"j":[],"i":{}}}],"c":"\u0041"},"a":[]}"#,
                r#"{"a":[],"b":{"c":"A","d":[{"e":"x\"y","f":1},{"h":{"i":{},"j":[]}}]}}"#,
            ),
            // keys sort by their text, escapes read: "\n" (0x0a) before " " (0x20)
            (r#"{" ":2,"\n":1}"#, r#"{"\n":1," ":2}"#),
            (
                r#"{"z":[1,{"b":[{"d":0,"c":0}],"a":0}],"y":""}"#,
                r#"{"y":"","z":[1,{"a":0,"b":[{"c":0,"d":0}]}]}"#,
            ),
        ];
        for (input, want) in cases {
            assert_eq!(canon(input).as_deref(), Some(want), "{input}");
        }
        // A repeated name at any depth is refused.
        assert_eq!(canon(r#"{"a":[{"b":1,"b":2}]}"#), None);
        assert_eq!(canon(r#"{"a":{"x":1},"a":{"x":1}}"#), None);
    }

    #[test]
    fn sorts_and_strips() {
        let cases = [
            (r#"{ "b": 2, "a": 1 }"#, r#"{"a":1,"b":2}"#),
            (
                r#"{"z":{"y":[3,{"b":1,"a":0}],"x":null}}"#,
                r#"{"z":{"x":null,"y":[3,{"a":0,"b":1}]}}"#,
            ),
            (
                "  [1, 2.50, \"\\u0041\", true, false]  ",
                r#"[1,2.50,"A",true,false]"#,
            ),
            (r#""\ud83d\ude00\/\n""#, "\"\u{1F600}/\\n\""),
            ("{}", "{}"),
            ("[ ]", "[]"),
            ("-0.5e+10", "-0.5e+10"),
        ];
        for (input, want) in cases {
            assert_eq!(canon(input).as_deref(), Some(want), "{input}");
        }
    }

    #[test]
    fn numbers_stay_exactly_as_sent() {
        assert_ne!(
            canon(r#"{"n":123456789012345678901}"#),
            canon(r#"{"n":123456789012345678902}"#)
        );
        assert_ne!(canon(r#"{"n":0.1}"#), canon(r#"{"n":0.10000000000000001}"#));
        assert_eq!(canon(r#"{"n":1e2}"#).as_deref(), Some(r#"{"n":1e2}"#));
    }

    #[test]
    fn refuses_what_is_not_json_or_ambiguous() {
        for bad in [
            r#"{"to":"alice","to":"bob"}"#,
            "{oops",
            r#"{"a":1,}"#,
            "[1,]",
            "01",
            "1.",
            "-",
            ".5",
            "1e",
            r#""\x""#,
            "\"a\u{1}b\"",
            r#""\ud800""#,
            "tru",
            "[1] [2]",
            "",
        ] {
            assert_eq!(canon(bad), None, "{bad:?}");
        }
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert_eq!(canon(&deep), None, "too deep");
    }

    /// A string read as it stands (no escape) and one that must be unescaped read alike, and
    /// what the first may not contain is refused either way.
    #[test]
    fn strings_with_and_without_escapes() {
        let same = [
            (r#"{"ab":"xy"}"#, r#"{"\u0061b":"x\u0079"}"#),
            (r#"{"a":"é"}"#, r#"{"a":"\u00e9"}"#),
            (
                r#"{"k":"then \" a quote"}"#,
                r#"{"k":"then \u0022 a quote"}"#,
            ),
            (r#"["", "a"]"#, r#"["","\u0061"]"#),
        ];
        for (plain, escaped) in same {
            assert_eq!(canon(plain), canon(escaped), "{plain} / {escaped}");
            assert!(canon(plain).is_some(), "{plain}");
        }
        assert_eq!(
            canon(r#"{"b":"x","a\"":"y"}"#).as_deref(),
            Some(r#"{"a\"":"y","b":"x"}"#)
        );
        for bad in [r#""abc"#, "\"ab\ncd\"", r#""ab\""#, r#"{"a":"b"#] {
            assert_eq!(canon(bad), None, "{bad:?}");
        }
        let not_utf8 = b"{\"a\":\"\xff\"}";
        assert_eq!(canonicalize(not_utf8), None);
    }
}
