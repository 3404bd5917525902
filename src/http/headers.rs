//! Header pairs kept as the proxy-wasm host hands them over: one text, each name and value a
//! range of it. Reading a request's headers then costs two allocations instead of two per
//! header, and a malformed map is an empty one, never a panic (the SDK's own reader panics on
//! a name that is not UTF-8).

use std::fmt;
use std::ops::Range;

/// The values of one header name, in arrival order: [`Headers::values`].
pub(crate) struct Values<'a, 'n> {
    headers: &'a Headers,
    name: &'n str,
    /// The pair the search resumes at.
    at: usize,
}

impl<'a> Iterator for Values<'a, '_> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let (i, value) = self.headers.find_from(self.name, self.at)?;
        self.at = i + 1;
        Some(value)
    }
}

/// Header pairs in arrival order, names in lower case.
#[derive(Clone, Default)]
pub struct Headers {
    text: String,
    pairs: Vec<(Range<usize>, Range<usize>)>,
}

fn read_u32(bytes: &[u8], at: usize) -> Option<usize> {
    let word: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(word)).ok()
}

impl Headers {
    /// Decodes the host's header-map encoding: a count, a (name length, value length) pair of
    /// little-endian `u32`s per header, then each name and value followed by a NUL. A value
    /// that is not UTF-8 is read lossily (U+FFFD), as is a name. `None` when the lengths do
    /// not fit the bytes (nothing Envoy sends).
    pub fn decode(mut bytes: Vec<u8>) -> Option<Headers> {
        if bytes.is_empty() {
            return Some(Headers::default());
        }
        let count = read_u32(&bytes, 0)?;
        let start = count.checked_mul(8)?.checked_add(4)?;
        let sizes = bytes.get(4..start)?;
        let mut pairs = Vec::with_capacity(count);
        let mut at = start;
        for size in sizes.chunks_exact(8) {
            let name = at..at.checked_add(read_u32(size, 0)?)?;
            let value_at = name.end.checked_add(1)?;
            let value = value_at..value_at.checked_add(read_u32(size, 4)?)?;
            at = value.end.checked_add(1)?;
            // Relative to the text, which begins after the lengths.
            pairs.push((
                name.start - start..name.end - start,
                value.start - start..value.end - start,
            ));
        }
        if at > bytes.len() {
            return None;
        }
        bytes.drain(..start);
        // Every range lies within the text: in ASCII text each is on character boundaries.
        let mut headers = match String::from_utf8(bytes) {
            Ok(text)
                if ascii(text.as_bytes())
                    || pairs
                        .iter()
                        .all(|(n, v)| on_boundaries(&text, n) && on_boundaries(&text, v)) =>
            {
                Headers { text, pairs }
            }
            Ok(text) => Headers::lossy(text.as_bytes(), &pairs),
            Err(e) => Headers::lossy(e.as_bytes(), &pairs),
        };
        headers.lower_names();
        Some(headers)
    }

    /// Rebuilds the text piece by piece, each piece made valid UTF-8 on its own.
    fn lossy(bytes: &[u8], pairs: &[(Range<usize>, Range<usize>)]) -> Headers {
        let mut out = Headers::default();
        for (name, value) in pairs {
            let piece = |r: &Range<usize>| {
                String::from_utf8_lossy(bytes.get(r.clone()).unwrap_or_default())
            };
            out.push(&piece(name), &piece(value));
        }
        out
    }

    /// Envoy hands names over in lower case already: a name is only rewritten when it is not.
    fn lower_names(&mut self) {
        let bytes = self.text.as_bytes();
        if !self.pairs.iter().any(|(name, _)| has_upper(bytes, name)) {
            return;
        }
        for (name, _) in &self.pairs {
            if let Some(n) = self.text.get_mut(name.clone()) {
                n.make_ascii_lowercase();
            }
        }
    }

    fn slice(&self, r: &Range<usize>) -> &str {
        self.text.get(r.clone()).unwrap_or_default()
    }

    /// Where `part`, a slice of a name or value this map handed out, lies in its text; `None`
    /// for any other text. The text is only ever added to: the range stays valid.
    pub(crate) fn range_of(&self, part: &str) -> Option<Range<usize>> {
        let start = (part.as_ptr() as usize).checked_sub(self.text.as_ptr() as usize)?;
        let end = start.checked_add(part.len())?;
        (end <= self.text.len()).then_some(start..end)
    }

    /// The text at `r`, a range [`Headers::range_of`] gave (empty for any other).
    pub(crate) fn text_at(&self, r: &Range<usize>) -> &str {
        self.slice(r)
    }

    /// Appends a header (its name lower-cased).
    pub(crate) fn push(&mut self, name: &str, value: &str) {
        let n = self.text.len()..self.text.len() + name.len();
        self.text.push_str(name);
        let v = self.text.len()..self.text.len() + value.len();
        self.text.push_str(value);
        if let Some(added) = self.text.get_mut(n.clone()) {
            added.make_ascii_lowercase();
        }
        self.pairs.push((n, v));
    }

    /// Keeps only the headers `keep(name, value)` accepts.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&str, &str) -> bool) {
        let text = &self.text;
        let part = |r: &Range<usize>| text.get(r.clone()).unwrap_or_default();
        self.pairs.retain(|(n, v)| keep(part(n), part(v)));
    }

    /// `(name, value)` of every header, in arrival order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        self.pairs
            .iter()
            .map(|(n, v)| (self.slice(n), self.slice(v)))
    }

    /// The values of `name` (lower case), in arrival order. A name of another length is
    /// passed over without being read, and only a match's value is sliced: every guarded
    /// request looks up several names in the whole map.
    pub(crate) fn values<'a, 'n>(&'a self, name: &'n str) -> Values<'a, 'n> {
        Values {
            headers: self,
            name,
            at: 0,
        }
    }

    /// The first header named `name` at or after pair `from`: its pair's index and its value.
    /// Not inlined: every lookup of a request runs this one copy of the search.
    #[inline(never)]
    fn find_from(&self, name: &str, from: usize) -> Option<(usize, &str)> {
        let text = self.text.as_bytes();
        let rest = self.pairs.get(from..)?;
        let i = rest.iter().position(|(n, _)| {
            n.len() == name.len() && text.get(n.clone()) == Some(name.as_bytes())
        })?;
        let (_, value) = rest.get(i)?;
        Some((from + i, self.slice(value)))
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.pairs.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Owned pairs, for code that keeps them past the request.
    pub(crate) fn to_pairs(&self) -> Vec<(String, String)> {
        self.iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }
}

fn on_boundaries(text: &str, r: &Range<usize>) -> bool {
    text.is_char_boundary(r.start) && text.is_char_boundary(r.end)
}

/// The low seven bits of each byte of a word.
const LOW: u64 = 0x7f7f_7f7f_7f7f_7f7f;

/// Whether every byte is ASCII, read eight at a time: every request's map is checked, and the
/// standard library's check goes a byte at a time in Wasm.
fn ascii(mut bytes: &[u8]) -> bool {
    let mut all = 0;
    while let Some((word, rest)) = bytes.split_first_chunk::<8>() {
        all |= u64::from_le_bytes(*word);
        bytes = rest;
    }
    all & !LOW == 0 && bytes.is_ascii()
}

/// Whether `text` holds an ASCII capital letter in `r`, read eight bytes at a time: a word
/// is read past the range's end where the text goes on, the bytes past it masked off, so a
/// name of up to eight bytes is one word. Only a byte's low seven bits are tested: a byte of
/// 0x80 or more may read as a capital, which costs a lowering that changes nothing.
fn has_upper(text: &[u8], r: &Range<usize>) -> bool {
    let mut found = 0;
    let mut at = r.start;
    while at < r.end {
        let Some(word) = text.get(at..).and_then(<[u8]>::first_chunk::<8>) else {
            let tail = text.get(at..r.end).unwrap_or_default();
            return found & !LOW != 0 || tail.iter().any(u8::is_ascii_uppercase);
        };
        let left = r.end - at;
        let mask = if left >= 8 {
            u64::MAX
        } else {
            u64::MAX >> (64 - 8 * left)
        };
        let x = u64::from_le_bytes(*word) & mask & LOW;
        // A byte's bit 7 is set in the first sum from 'A' up, in the second from past 'Z'.
        found |= (x + 0x3f3f_3f3f_3f3f_3f3f) & !(x + 0x2525_2525_2525_2525);
        at += 8;
    }
    found & !LOW != 0
}

impl<N: AsRef<str>, V: AsRef<str>> FromIterator<(N, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(pairs: I) -> Headers {
        let mut out = Headers::default();
        for (n, v) in pairs {
            out.push(n.as_ref(), v.as_ref());
        }
        out
    }
}

impl<N: AsRef<str>, V: AsRef<str>> Extend<(N, V)> for Headers {
    fn extend<I: IntoIterator<Item = (N, V)>>(&mut self, pairs: I) {
        for (n, v) in pairs {
            self.push(n.as_ref(), v.as_ref());
        }
    }
}

/// Equal when they hold the same pairs in the same order, however each was built.
impl PartialEq for Headers {
    fn eq(&self, other: &Headers) -> bool {
        self.iter().eq(other.iter())
    }
}

impl Eq for Headers {}

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// The host's encoding of `pairs` (what [`Headers::decode`] reads), raw bytes allowed: for
/// tests and benchmarks, which play the host.
pub fn encode(pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
    for (n, v) in pairs {
        out.extend_from_slice(&(n.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (n, v) in pairs {
        out.extend_from_slice(n);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A named case: the host's pairs, raw, and what they read as.
    type Case<'a> = (
        &'a str,
        &'a [(&'a [u8], &'a [u8])],
        &'a [(&'a str, &'a str)],
    );

    fn pairs(h: &Headers) -> Vec<(&str, &str)> {
        h.iter().collect()
    }

    /// A part of the map is found where it stands, and reads the same after the map grew and
    /// dropped headers; text from anywhere else is not the map's.
    #[test]
    fn a_range_of_the_map_stays_valid() {
        let mut h: Headers = [(":path", "/api/items?x=1"), (":authority", "Host:80")]
            .into_iter()
            .collect();
        let path = h.values(":path").next().expect("present");
        let part = path.split_once('?').expect("a query").0;
        let range = h.range_of(part).expect("in the map");
        let empty = h.range_of(&path[0..0]).expect("an empty part of the map");
        let elsewhere = String::from("/api/items");
        assert_eq!(h.range_of(&elsewhere), None);
        assert_eq!(h.range_of("/api/items"), None);
        h.retain(|n, _| n != ":path");
        for i in 0..64 {
            h.push("x-more", &format!("/api/{i}"));
        }
        assert_eq!((h.text_at(&range), h.text_at(&empty)), ("/api/items", ""));
        assert_eq!(h.clone().text_at(&range), "/api/items");
        assert_eq!(Headers::default().text_at(&range), "");
    }

    #[test]
    fn decodes_the_hosts_encoding() {
        let cases: &[Case<'_>] = &[
            ("empty map", &[], &[]),
            (
                "pseudo and plain headers, in order",
                &[
                    (b":path", b"/api?a=1"),
                    (b"x-tenant", b"acme"),
                    (b"x-tenant", b"globex"),
                ],
                &[
                    (":path", "/api?a=1"),
                    ("x-tenant", "acme"),
                    ("x-tenant", "globex"),
                ],
            ),
            ("an empty value", &[(b"x-a", b"")], &[("x-a", "")]),
            (
                "names lower-cased",
                &[(b"X-Tenant", b"Acme")],
                &[("x-tenant", "Acme")],
            ),
            (
                "an upper-case name after lower-case ones, its value kept",
                &[(b"x-a", b"1"), (b"x-B", b"Two")],
                &[("x-a", "1"), ("x-b", "Two")],
            ),
            (
                "a value that is not UTF-8 is read lossily, the others as they are",
                &[(b"x-a", b"caf\xe9"), (b"x-b", b"ok")],
                &[("x-a", "caf\u{fffd}"), ("x-b", "ok")],
            ),
            (
                "a name that is not UTF-8 (the SDK's reader panics on it)",
                &[(b"x-\xff", b"v")],
                &[("x-\u{fffd}", "v")],
            ),
            (
                "multi-byte UTF-8 kept",
                &[(b"x-a", "żółw".as_bytes())],
                &[("x-a", "żółw")],
            ),
        ];
        for (name, raw, want) in cases {
            let got = Headers::decode(encode(raw)).expect(name);
            assert_eq!(pairs(&got), *want, "{name}");
            assert_eq!(got.len(), want.len(), "{name}");
        }
        assert_eq!(Headers::decode(Vec::new()), Some(Headers::default()));
    }

    /// The word-at-a-time checks against the byte-at-a-time ones, for every name length up
    /// to 20, a capital at every place in it or none, the text going on after it or not, and
    /// bytes of 0x80 or more around it.
    #[test]
    fn word_checks_agree_with_byte_checks() {
        for len in 0..=20 {
            for capital in (0..len).map(Some).chain([None]) {
                for after in [&b""[..], b"\0v\0", b"\0value past one word\0"] {
                    for filler in [b'a', b'-', 0xc3] {
                        let mut name = vec![filler; len];
                        if let Some(i) = capital {
                            name[i] = b'A' + (i % 26) as u8;
                        }
                        let mut text = b"X\xffprefix".to_vec();
                        let r = text.len()..text.len() + len;
                        text.extend_from_slice(&name);
                        text.extend_from_slice(after);
                        let want = name.iter().any(u8::is_ascii_uppercase);
                        let got = has_upper(&text, &r);
                        // A byte of 0x80 or more may read as a capital; a capital never
                        // goes unseen.
                        assert!(got == want || (got && filler >= 0x80), "{name:?} {after:?}");
                        assert_eq!(ascii(&text), text.is_ascii(), "{text:?}");
                    }
                }
            }
        }
        for n in 0..40 {
            let mut bytes = vec![b'x'; n];
            assert!(ascii(&bytes));
            for i in 0..n {
                bytes[i] = 0x80;
                assert!(!ascii(&bytes), "{n} {i}");
                bytes[i] = b'x';
            }
        }
    }

    #[test]
    fn lengths_that_do_not_fit_are_refused_not_read() {
        let good = encode(&[(b"x-a", b"1"), (b"x-b", b"22")]);
        for cut in 1..good.len() {
            assert_eq!(Headers::decode(good[..cut].to_vec()), None, "cut at {cut}");
        }
        let mut huge = good.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Headers::decode(huge), None, "a count past the bytes");
        let mut long = good.clone();
        long[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Headers::decode(long), None, "a length past the bytes");
    }

    #[test]
    fn lengths_off_a_character_boundary_are_read_lossily() {
        // "é" is two bytes; a name length of 3 ends inside it.
        let mut raw = encode(&[("x-é".as_bytes(), b"v")]);
        raw[4..8].copy_from_slice(&3u32.to_le_bytes());
        raw[8..12].copy_from_slice(&0u32.to_le_bytes());
        let got = Headers::decode(raw).expect("fits");
        assert_eq!(pairs(&got), [("x-\u{fffd}", "")]);
    }

    #[test]
    fn push_retain_and_values() {
        let mut h: Headers = [("X-A", "1"), ("x-b", "2"), ("x-a", "3")]
            .into_iter()
            .collect();
        assert_eq!(h.values("x-a").collect::<Vec<_>>(), ["1", "3"]);
        // Same length, another name; a longer or shorter name sharing its start.
        assert_eq!(h.values("x-c").count(), 0);
        assert_eq!(h.values("x-").count() + h.values("x-aa").count(), 0);
        h.retain(|n, _| n != "x-b");
        assert_eq!(pairs(&h), [("x-a", "1"), ("x-a", "3")]);
        h.push("x-c", "4");
        assert_eq!(
            h.to_pairs().last(),
            Some(&("x-c".to_string(), "4".to_string()))
        );
        let decoded = Headers::decode(encode(&[(b"x-a", b"1"), (b"x-a", b"3"), (b"x-c", b"4")]));
        assert_eq!(decoded, Some(h), "equal however built");
    }
}
