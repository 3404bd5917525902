//! Request paths and query strings as a service reads them, so that a guard cannot be slipped
//! past by spelling the same resource differently.
//!
//! A path is matched and read by selectors in its canonical form: percent-decoded (RFC 3986
//! 2.1, every escape but those that change the path's structure), repeated slashes merged,
//! dot segments removed (RFC 3986 5.2.4), no query. Spellings that services read in more than
//! one way (an encoded `/`, a `\`, a NUL, a broken or double escape, `;` path parameters, a
//! `..` after an empty segment) are *ambiguous*: the form also lists the other readings, and
//! a request whose any reading fits a policy is refused rather than guessed.

use crate::support::text;
use std::borrow::Cow;

/// A request path as the filter reads it; the canonical reading borrows the raw path when it
/// already is canonical, as most are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PathForm<'a> {
    /// The canonical reading: what policies match and selectors read.
    pub(crate) canonical: Cow<'a, str>,
    /// Other readings a service might make of an ambiguous path (may be empty even when
    /// ambiguous, e.g. a broken escape every service keeps as it is).
    pub(crate) others: Vec<String>,
    /// The raw path holds a spelling services read differently.
    pub(crate) ambiguous: bool,
}

impl PathForm<'_> {
    /// Reading `n`: 0 is the canonical one, then the others.
    pub(crate) fn reading(&self, n: usize) -> Option<&str> {
        match n {
            0 => Some(&self.canonical),
            _ => self.others.get(n - 1).map(String::as_str),
        }
    }

    #[cfg(test)]
    pub(crate) fn readings(&self) -> usize {
        1 + self.others.len()
    }
}

/// The canonical form of `raw` (a `:path` without its query) and its other readings.
pub(crate) fn normalize_path(raw: &str) -> PathForm<'_> {
    let raw = text::split_once_byte(raw, b'#').map_or(raw, |(p, _)| p);
    if is_plain(raw) {
        return PathForm {
            canonical: Cow::Borrowed(raw),
            others: Vec::new(),
            ambiguous: false,
        };
    }
    let decoded = decode_path(raw);
    let strict = String::from_utf8_lossy(&decoded.strict).into_owned();
    let lenient = String::from_utf8_lossy(&decoded.lenient).into_owned();
    let mut ambiguous = decoded.ambiguous;
    let mut readings: Vec<String> = Vec::with_capacity(4);
    for text in [&strict, &lenient] {
        let merged_first = resolve(text, Order::MergeThenDots);
        let dots_first = resolve(text, Order::DotsThenMerge);
        if merged_first != dots_first {
            ambiguous = true;
        }
        for r in [merged_first, dots_first] {
            if !readings.contains(&r) {
                readings.push(r);
            }
        }
    }
    let mut readings = readings.into_iter();
    let canonical = readings.next().unwrap_or_else(|| "/".to_string());
    PathForm {
        canonical: Cow::Owned(canonical),
        others: readings.collect(),
        ambiguous,
    }
}

/// A path that is already canonical: no escapes, no backslash, no parameters, no empty or
/// dot segments. Most paths are; they cost one scan.
fn is_plain(raw: &str) -> bool {
    let b = raw.as_bytes();
    if b.first() != Some(&b'/') {
        return false;
    }
    let mut prev = b'/';
    for (i, &c) in b.iter().enumerate().skip(1) {
        match c {
            b'%' | b'\\' | b';' | 0 => return false,
            b'/' if prev == b'/' => return false,
            b'.' if prev == b'/' => {
                // "/." followed by the end, '/', or ".": a dot segment.
                let rest = &b[i + 1..];
                if rest.is_empty() || rest[0] == b'/' || rest[0] == b'.' {
                    return false;
                }
            }
            _ => {}
        }
        prev = c;
    }
    true
}

/// The two decodings of a path: `strict` keeps every structural escape as it is; `lenient`
/// is the most a permissive service makes of it.
struct Decoded {
    strict: Vec<u8>,
    lenient: Vec<u8>,
    ambiguous: bool,
    /// The lenient reading ended at a NUL, as a C string does.
    lenient_closed: bool,
    /// Inside `;` path parameters, which the lenient reading drops up to the next `/`.
    in_params: bool,
}

impl Decoded {
    fn push_lenient(&mut self, byte: u8) {
        if self.lenient_closed || self.in_params {
            return;
        }
        match byte {
            0 => self.lenient_closed = true,
            b'\\' => self.lenient.push(b'/'),
            _ => self.lenient.push(byte),
        }
    }
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn escape_at(b: &[u8], i: usize) -> Option<u8> {
    Some(hex(*b.get(i + 1)?)? << 4 | hex(*b.get(i + 2)?)?)
}

/// Escapes that change a path's structure when decoded: `/`, `\` and NUL.
fn structural(c: u8) -> bool {
    matches!(c, b'/' | b'\\' | 0)
}

fn decode_path(raw: &str) -> Decoded {
    let b = raw.as_bytes();
    let mut d = Decoded {
        strict: Vec::with_capacity(b.len()),
        lenient: Vec::with_capacity(b.len()),
        ambiguous: false,
        lenient_closed: false,
        in_params: false,
    };
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        match c {
            b'%' => match escape_at(b, i) {
                Some(x) if structural(x) => {
                    d.ambiguous = true;
                    d.strict.push(b'%');
                    d.strict.push(b"0123456789ABCDEF"[usize::from(x >> 4)]);
                    d.strict.push(b"0123456789ABCDEF"[usize::from(x & 15)]);
                    d.push_lenient(x);
                    i += 3;
                    continue;
                }
                Some(b'%') => {
                    // "%25": a double escape when an escape follows ("%252F").
                    if let Some(y) = escape_at(b, i + 2) {
                        d.ambiguous = true;
                        d.strict.push(b'%');
                        d.push_lenient(y);
                        i += 5;
                        d.strict.extend_from_slice(&b[i - 2..i]);
                        continue;
                    }
                    d.strict.push(b'%');
                    d.push_lenient(b'%');
                    i += 3;
                    continue;
                }
                Some(x) => {
                    d.strict.push(x);
                    d.push_lenient(x);
                    i += 3;
                    continue;
                }
                None => {
                    // A broken escape: every reading keeps it as it is.
                    d.ambiguous = true;
                    d.strict.push(b'%');
                    d.push_lenient(b'%');
                }
            },
            b'\\' | 0 => {
                d.ambiguous = true;
                d.strict.push(c);
                d.push_lenient(c);
            }
            b';' => {
                // Path parameters: some frameworks drop them up to the next '/'.
                d.ambiguous = true;
                d.strict.push(c);
                d.in_params = true;
            }
            b'/' => {
                d.in_params = false;
                d.strict.push(c);
                d.push_lenient(c);
            }
            _ => {
                d.strict.push(c);
                d.push_lenient(c);
            }
        }
        i += 1;
    }
    d
}

#[derive(Clone, Copy)]
enum Order {
    /// Repeated slashes merged, then dot segments removed (as most services do).
    MergeThenDots,
    /// Dot segments removed first, an empty segment counting as one (as Envoy's
    /// `normalize_path` followed by `merge_slashes` does).
    DotsThenMerge,
}

/// Merges slashes and removes dot segments; a path that does not start with `/` (`*`) is
/// returned as it is.
fn resolve(path: &str, order: Order) -> String {
    if !path.starts_with('/') {
        return path.to_string();
    }
    let merge_first = matches!(order, Order::MergeThenDots);
    let mut out: Vec<&str> = Vec::new();
    let mut trailing = false;
    for seg in path[1..].split('/') {
        trailing = false;
        match seg {
            "" if merge_first => trailing = true,
            "." => trailing = true,
            ".." => {
                out.pop();
                trailing = true;
            }
            s => out.push(s),
        }
    }
    // Empty segments left by dot removal first: merged now.
    out.retain(|s| !s.is_empty());
    let mut p = String::with_capacity(path.len());
    for s in &out {
        p.push('/');
        p.push_str(s);
    }
    if trailing || out.is_empty() || path.ends_with('/') {
        p.push('/');
    }
    p
}

/// The query string's parameters, names and values percent-decoded and `+` read as a space
/// (form encoding: a service reading `+` literally then sees two names for one value, which
/// only makes the guard stricter). A broken escape is kept as it is.
///
/// Split on the one byte search ([`text::split_once_byte`]), so a request without a query runs
/// no splitter at all.
pub(crate) fn query_pairs(query: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let mut rest = query;
    while !rest.is_empty() {
        let (pair, tail) = text::split_once_byte(rest, b'&').unwrap_or((rest, ""));
        rest = tail;
        if pair.is_empty() {
            continue;
        }
        let (k, v) = text::split_once_byte(pair, b'=').unwrap_or((pair, ""));
        pairs.push((decode_component(k), decode_component(v)));
    }
    pairs
}

/// The query's parameters as a service that also separates them with `;` reads them (HTML
/// 4's recommendation, older frameworks): [`query_pairs`] split on `&` and `;` alike. Only
/// asked of a query that holds a `;`.
pub(crate) fn query_pairs_semicolon(query: &str) -> Vec<(String, String)> {
    query
        .split(['&', ';'])
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = text::split_once_byte(p, b'=').unwrap_or((p, ""));
            (decode_component(k), decode_component(v))
        })
        .collect()
}

fn decode_component(s: &str) -> String {
    let b = s.as_bytes();
    if !b.iter().any(|&c| c == b'%' || c == b'+') {
        return s.to_string();
    }
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (b[i], escape_at(b, i)) {
            (b'%', Some(x)) => {
                out.push(x);
                i += 3;
                continue;
            }
            (b'+', _) => out.push(b' '),
            (c, _) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Path and prefix comparisons ignore one trailing slash: `/orders/` is `/orders` to most
/// routers.
pub(crate) fn trim_slash(path: &str) -> &str {
    match path.strip_suffix('/') {
        Some(p) if !p.is_empty() => p,
        _ => path,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn form(raw: &str) -> (String, Vec<String>, bool) {
        let f = normalize_path(raw);
        (f.canonical.into_owned(), f.others, f.ambiguous)
    }

    #[test]
    fn canonical_forms() {
        for (raw, want) in [
            ("/orders", "/orders"),
            ("/", "/"),
            ("//orders", "/orders"),
            ("/orders//", "/orders/"),
            ("/orders//7///act", "/orders/7/act"),
            ("/%6Frders", "/orders"),
            ("/%6frders", "/orders"),
            ("/ord%65rs/%31%32%33", "/orders/123"),
            ("/x/../orders", "/orders"),
            ("/x/./orders", "/x/orders"),
            ("/../orders", "/orders"),
            ("/orders/..", "/"),
            ("/orders/7/.", "/orders/7/"),
            ("/%2E%2E/orders", "/orders"),
            ("/a/%2e/b", "/a/b"),
            ("/a%20b", "/a b"),
            ("/a%3Ab", "/a:b"),
            ("/caf%C3%A9", "/café"),
            ("/orders#frag", "/orders"),
            ("/.well-known/x", "/.well-known/x"),
            ("/a..b/c", "/a..b/c"),
            ("*", "*"),
        ] {
            let (canonical, others, ambiguous) = form(raw);
            assert_eq!(canonical, want, "{raw}");
            assert!(!ambiguous, "{raw} is not ambiguous");
            assert!(others.is_empty(), "{raw}: {others:?}");
        }
    }

    #[test]
    fn ambiguous_forms() {
        for (raw, canonical, others) in [
            ("/orders%2F7", "/orders%2F7", &["/orders/7"][..]),
            ("/orders%2f7", "/orders%2F7", &["/orders/7"]),
            ("/x%2F..%2Forders", "/x%2F..%2Forders", &["/orders"]),
            ("/orders\\7", "/orders\\7", &["/orders/7"]),
            ("/orders%5C7", "/orders%5C7", &["/orders/7"]),
            ("/orders%00.jpg", "/orders%00.jpg", &["/orders"]),
            ("/orders%zz", "/orders%zz", &[]),
            ("/orders%4", "/orders%4", &[]),
            ("/orders;jsessionid=1", "/orders;jsessionid=1", &["/orders"]),
            ("/orders;x/7", "/orders;x/7", &["/orders/7"]),
            ("/orders%252F7", "/orders%2F7", &["/orders/7"]),
            ("/a//../orders", "/orders", &["/a/orders"]),
        ] {
            let (c, o, ambiguous) = form(raw);
            assert!(ambiguous, "{raw}");
            assert_eq!(c, canonical, "{raw}");
            assert_eq!(o, others, "{raw}");
        }
    }

    #[test]
    fn plain_paths_take_the_fast_path_and_agree_with_the_slow_one() {
        for raw in ["/orders", "/orders/7/act", "/a.b/c", "/.x", "/a/.b", "/"] {
            assert!(is_plain(raw), "{raw}");
            let d = decode_path(raw);
            assert_eq!(
                resolve(&String::from_utf8_lossy(&d.strict), Order::MergeThenDots),
                raw
            );
        }
        for raw in [
            "/a/./b", "/a/../b", "/a/.", "/a/..", "//a", "/a%41", "x", "",
        ] {
            assert!(!is_plain(raw), "{raw}");
        }
    }

    #[test]
    fn query_parameters_are_decoded() {
        assert_eq!(
            query_pairs("id=%38&i%64=9&a+b=c+d&e=%zz&&f"),
            vec![
                ("id".to_string(), "8".to_string()),
                ("id".to_string(), "9".to_string()),
                ("a b".to_string(), "c d".to_string()),
                ("e".to_string(), "%zz".to_string()),
                ("f".to_string(), String::new()),
            ]
        );
        assert!(query_pairs("").is_empty());
    }

    #[test]
    fn query_pairs_split_as_std_splits() {
        // Empty pairs dropped wherever they stand, a name's first `=` ends it, and names or
        // values that are empty or hold another `=`: as `split('&')` and `split_once('=')`.
        let reference = |q: &str| -> Vec<(String, String)> {
            q.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| p.split_once('=').unwrap_or((p, "")))
                .map(|(k, v)| (decode_component(k), decode_component(v)))
                .collect()
        };
        for q in [
            "&",
            "&&",
            "&a",
            "a&",
            "&&a&&b&&",
            "=",
            "=x",
            "x=",
            "a=b=c",
            "a==",
            "é=ü&日=本",
            "a",
        ] {
            assert_eq!(query_pairs(q), reference(q), "{q:?}");
        }
    }

    #[test]
    fn query_pairs_where_semicolons_separate_too() {
        let pairs = query_pairs_semicolon;
        let p = |k: &str, v: &str| (k.to_string(), v.to_string());
        assert_eq!(pairs("id=8;"), vec![p("id", "8")]);
        assert_eq!(
            pairs("x=1;id=9&a"),
            vec![p("x", "1"), p("id", "9"), p("a", "")]
        );
        assert_eq!(
            pairs("id=8%3B"),
            vec![p("id", "8;")],
            "an encoded ';' is data"
        );
        assert_eq!(query_pairs("id=8;"), vec![p("id", "8;")]);
    }

    #[test]
    fn trailing_slash() {
        assert_eq!(trim_slash("/orders/"), "/orders");
        assert_eq!(trim_slash("/orders"), "/orders");
        assert_eq!(trim_slash("/"), "/");
    }
}
