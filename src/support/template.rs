//! Path templates in Envoy's URI-template syntax (the `envoy.path.match.uri_template`
//! extension): `/accounts/{id}/transfer`, `/files/{rest=**}`, `/videos/*/{name}.mp4`. A
//! template is compiled once, when the configuration is read, into a list of parts; a request
//! path is matched against it in one pass, without a regex and without allocating, and a
//! variable's value is a slice of the path.
//!
//! The syntax is Envoy's: segments separated by `/`, each a literal, `*` (one segment), `**`
//! (any number of segments, none included) or a variable `{name}` (one segment), `{name=*}`,
//! `{name=**}` or `{name=<segments>}` (e.g. `{name=videos/*}`, the variable's value being all
//! of them); after the last operator or variable of a segment may come a literal suffix to the
//! end of the template (`{name}.mp4`). Variable names are a letter then letters, digits or
//! `_`, at most 16 characters, at most 5 variables, each once; no operator (`*`, `**`, `{x}`)
//! may follow a `**`, though literals may.
//!
//! What differs from Envoy follows from matching the canonical path (decoded, slashes merged,
//! dot segments removed) rather than the raw one:
//! - a literal is written decoded: a `%` escape is refused (it could never match, the path
//!   being decoded), and so are `;` (path parameters make a path ambiguous, refused anyway),
//!   the dot segments `.` and `..`, and an empty segment (`//`); a literal may hold characters
//!   beyond ASCII, written as they are;
//! - `*` matches any segment that is not empty, whatever its characters (Envoy's matches the
//!   characters a raw path may hold unencoded other than `=` and `*`);
//! - one trailing slash is ignored, as `path_exact` ignores it: `/accounts/{id}/transfer`
//!   matches `/accounts/42/transfer/` too (most routers serve both), a template's own trailing
//!   slash is optional, and a variable's value is the same either way (`/files/{rest=**}`
//!   reads `a/b` from `/files/a/b/` and `/files/a/b`).

use crate::support::normalize::trim_slash;
use std::ops::Range;

/// The most variables a template may define (Envoy's limit).
pub const MAX_VARIABLES: usize = 5;
/// The longest variable name (Envoy's limit).
pub const MAX_NAME_LEN: usize = 16;

/// A compiled path template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTemplate {
    /// As written in the configuration.
    text: String,
    /// One part per segment after the leading `/`, in order (a variable over several
    /// segments has several).
    parts: Vec<Part>,
    /// The text after the last part, to the end of the path (`.mp4` in `/{name}.mp4`).
    suffix: String,
    /// With a `**` among the parts: the fixed text that follows what it matches (`/` and each
    /// literal after it, then the suffix).
    tail: String,
    variables: Vec<Variable>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    /// A segment that must be this text.
    Literal(String),
    /// `*`: one segment, not empty.
    Segment,
    /// `**`: any number of segments, none included.
    Rest,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Variable {
    name: String,
    /// The parts it covers.
    parts: Range<usize>,
}

impl PathTemplate {
    /// Compiles `text`; `Err` says why it is not a template.
    pub fn parse(text: &str) -> Result<PathTemplate, String> {
        let Some(body) = text.strip_prefix('/') else {
            return Err("must start with '/'".into());
        };
        if let Some(c) = text.chars().find(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!("holds {c:?}, which no path holds unencoded"));
        }
        let mut t = PathTemplate {
            text: text.to_string(),
            parts: Vec::new(),
            suffix: String::new(),
            tail: String::new(),
            variables: Vec::new(),
        };
        let mut rest = body;
        while !rest.is_empty() {
            let (segment_end, after) = if let Some(inner) = rest.strip_prefix('{') {
                let Some(close) = inner.find('}') else {
                    return Err("a '{' has no '}'".into());
                };
                t.variable(&inner[..close])?;
                (true, &inner[close + 1..])
            } else if let Some(after) = rest.strip_prefix("**") {
                t.parts.push(Part::Rest);
                (true, after)
            } else if let Some(after) = rest.strip_prefix('*') {
                t.parts.push(Part::Segment);
                (true, after)
            } else {
                let end = rest.find('/').unwrap_or(rest.len());
                t.parts.push(Part::Literal(literal(&rest[..end])?));
                (false, &rest[end..])
            };
            rest = match after {
                "" | "/" => "",
                _ => match after.strip_prefix('/') {
                    Some(next) if next.starts_with('/') => {
                        return Err("an empty segment ('//') never matches: requests are \
                                    matched with repeated slashes merged"
                            .into())
                    }
                    Some(next) => next,
                    // Text right after an operator or a variable: the suffix, to the end.
                    None if segment_end && !after.contains('/') => {
                        t.suffix = literal(after)?;
                        ""
                    }
                    None => {
                        return Err(format!(
                            "{after:?} follows an operator or a variable inside a segment: \
                             only a suffix ending the template may (e.g. /{{name}}.mp4)"
                        ))
                    }
                },
            };
        }
        t.check()?;
        Ok(t)
    }

    /// Reads a variable, `name` or `name=<segments>`, and adds its parts.
    fn variable(&mut self, spec: &str) -> Result<(), String> {
        let (name, pattern) = match spec.split_once('=') {
            Some((n, p)) => (n, Some(p)),
            None => (spec, None),
        };
        if !is_variable_name(name) {
            return Err(format!(
                "{name:?} is not a variable name (a letter, then letters, digits or '_', at \
                 most {MAX_NAME_LEN} characters)"
            ));
        }
        if self.variables.iter().any(|v| v.name == name) {
            return Err(format!("the variable {name:?} is defined twice"));
        }
        let start = self.parts.len();
        match pattern {
            None => self.parts.push(Part::Segment),
            Some("") => {
                return Err(format!(
                    "the variable {name:?} has an empty match after '='"
                ))
            }
            Some(p) => {
                for piece in p.split('/') {
                    self.parts.push(match piece {
                        "*" => Part::Segment,
                        "**" => Part::Rest,
                        "" => {
                            return Err(format!(
                                "the variable {name:?} has an empty segment in {p:?}"
                            ))
                        }
                        lit => Part::Literal(literal(lit)?),
                    });
                }
            }
        }
        self.variables.push(Variable {
            name: name.to_string(),
            parts: start..self.parts.len(),
        });
        Ok(())
    }

    /// Envoy's rules on the whole: at most [`MAX_VARIABLES`] variables, nothing but literals
    /// after a `**`. Then the fixed text that follows a `**`.
    fn check(&mut self) -> Result<(), String> {
        if self.variables.len() > MAX_VARIABLES {
            return Err(format!("defines more than {MAX_VARIABLES} variables"));
        }
        if let Some(at) = self.rest_at() {
            let mut tail = String::new();
            for part in &self.parts[at + 1..] {
                match part {
                    Part::Literal(l) => {
                        tail.push('/');
                        tail.push_str(l);
                    }
                    Part::Segment | Part::Rest => {
                        return Err("'**' must be the last operator: only literals may follow \
                                    it (a variable without '=' is a '*')"
                            .into())
                    }
                }
            }
            tail.push_str(&self.suffix);
            self.tail = tail;
        }
        Ok(())
    }

    fn rest_at(&self) -> Option<usize> {
        self.parts.iter().position(|p| *p == Part::Rest)
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The index of the variable `name`, for [`PathTemplate::capture`].
    pub fn variable_index(&self, name: &str) -> Option<usize> {
        self.variables.iter().position(|v| v.name == name)
    }

    /// The variables' names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.variables.iter().map(|v| v.name.as_str())
    }

    /// Whether `path` (a canonical path, without its query) fits.
    pub fn matches(&self, path: &str) -> bool {
        readings(path).any(|p| self.walk(p, |_, _| {}))
    }

    /// The text variable `index` matches in `path`; `None` when the path does not fit. A
    /// `**` that matches no segment reads as empty.
    pub fn capture<'p>(&self, path: &'p str, index: usize) -> Option<&'p str> {
        let v = self.variables.get(index)?;
        let last = v.parts.end.checked_sub(1)?;
        for p in readings(path) {
            let (mut start, mut end) = (0, 0);
            let fits = self.walk(p, |i, span| {
                if i == v.parts.start {
                    start = span.start;
                }
                if i == last {
                    end = span.end;
                }
            });
            if fits {
                return p.get(start..end);
            }
        }
        None
    }

    /// Matches `path` part by part, telling `seen` where each part stands; `false` as soon
    /// as one does not fit. Without backtracking: a `*` never crosses a `/`, and what follows
    /// a `**` is fixed text.
    fn walk(&self, path: &str, mut seen: impl FnMut(usize, Range<usize>)) -> bool {
        if !path.starts_with('/') {
            return false;
        }
        let last = match self.parts.len().checked_sub(1) {
            Some(last) => last,
            // `/`: the root alone.
            None => return path == "/",
        };
        let mut at = 1;
        for (i, part) in self.parts.iter().enumerate() {
            let Some(rest) = path.get(at..) else {
                return false;
            };
            if *part == Part::Rest {
                let Some(middle) = rest.strip_suffix(self.tail.as_str()) else {
                    return false;
                };
                let end = at + middle.len();
                seen(i, at..end);
                // The literals after it, each after a '/'.
                let mut next = end;
                for (j, part) in self.parts.iter().enumerate().skip(i + 1) {
                    if let Part::Literal(l) = part {
                        next += 1;
                        seen(j, next..next + l.len());
                        next += l.len();
                    }
                }
                return true;
            }
            // The segment: to the next '/', or, for the last part, to the end less the suffix.
            let (text, next) = if i == last {
                match rest.strip_suffix(self.suffix.as_str()) {
                    Some(text) if !text.contains('/') => (text, path.len()),
                    _ => return false,
                }
            } else {
                match rest.find('/') {
                    Some(end) => (&rest[..end], at + end + 1),
                    None => return false,
                }
            };
            let fits = match part {
                Part::Literal(l) => text == l,
                _ => !text.is_empty(),
            };
            if !fits {
                return false;
            }
            seen(i, at..at + text.len());
            at = next;
        }
        true
    }

    /// What each variable reads, in a few words: `{id}: segment 2`, segments counted from 1
    /// after the leading `/` as `path_segment:<n>` counts them.
    pub fn describe_variables(&self) -> String {
        let rest = self.rest_at();
        let described: Vec<String> = self
            .variables
            .iter()
            .map(|v| {
                let (first, last) = (v.parts.start + 1, v.parts.end);
                // The fewest segments it reads: every part but a `**`.
                let least = self.parts[v.parts.clone()]
                    .iter()
                    .filter(|p| **p != Part::Rest)
                    .count();
                let what = match rest {
                    Some(r) if r < v.parts.start => "segments after the '**'".to_string(),
                    Some(r) if v.parts.contains(&r) && least == 0 => {
                        format!("segments {first} on, any number (none included)")
                    }
                    Some(r) if v.parts.contains(&r) => {
                        format!("segments {first} on, at least {least}")
                    }
                    _ if first == last => format!("segment {first}"),
                    _ => format!("segments {first}-{last}"),
                };
                let suffix = if v.parts.end == self.parts.len() && !self.suffix.is_empty() {
                    format!(" before {:?}", self.suffix)
                } else {
                    String::new()
                };
                format!("{{{}}}: {what}{suffix}", v.name)
            })
            .collect();
        described.join(", ")
    }
}

/// The readings of a path a template is tried on: without one trailing slash first, so that
/// a variable reads the same with and without it, then as it is.
fn readings(path: &str) -> impl Iterator<Item = &str> {
    let trimmed = trim_slash(path);
    std::iter::once(trimmed).chain((trimmed.len() != path.len()).then_some(path))
}

/// Whether `name` may name a variable: a letter, then letters, digits or `_`, at most
/// [`MAX_NAME_LEN`] characters.
pub fn is_variable_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    name.len() <= MAX_NAME_LEN
        && bytes.next().is_some_and(|b| b.is_ascii_alphabetic())
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// A literal segment (or suffix) as requests are matched: decoded, no path parameters, no
/// dot segment, of the characters Envoy takes (`-._~!$&'()+,:@`, letters and digits) or
/// beyond ASCII.
fn literal(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err(
            "an empty segment ('//') never matches: requests are matched with \
                    repeated slashes merged"
                .into(),
        );
    }
    if text == "." || text == ".." {
        return Err(format!(
            "the segment {text:?} never matches: dot segments are removed from requests \
             before they are matched"
        ));
    }
    for c in text.chars() {
        match c {
            '%' => {
                return Err(format!(
                    "{text:?} holds '%': requests are matched decoded, so write the \
                     character itself (an encoded '/', '\\' or NUL is refused in a request)"
                ))
            }
            ';' => {
                return Err(format!(
                    "{text:?} holds ';': path parameters make a request's path read more \
                     than one way, and such a request is refused (ambiguous_path)"
                ))
            }
            c if c.is_ascii_alphanumeric() || "-._~!$&'()+,:@".contains(c) || !c.is_ascii() => {}
            c => {
                return Err(format!(
                    "{c:?} is not allowed in a literal (letters, digits, -._~!$&'()+,:@)"
                ))
            }
        }
    }
    Ok(text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn t(text: &str) -> PathTemplate {
        PathTemplate::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    /// Every variable's value, or `None` when the path does not fit.
    fn captures(text: &str, path: &str) -> Option<Vec<String>> {
        let t = t(text);
        let fits = t.matches(path);
        let values: Option<Vec<String>> = (0..t.variables.len())
            .map(|i| t.capture(path, i).map(str::to_string))
            .collect();
        if !t.variables.is_empty() {
            assert_eq!(
                fits,
                values.is_some(),
                "{text} {path}: matches and captures agree"
            );
        }
        values.filter(|_| fits)
    }

    #[test]
    fn matching_and_captures() {
        let yes = |text: &str, path: &str, want: &[&str]| {
            assert_eq!(
                captures(text, path),
                Some(want.iter().map(|s| s.to_string()).collect()),
                "{text} {path}"
            );
        };
        let no = |text: &str, path: &str| assert_eq!(captures(text, path), None, "{text} {path}");

        let transfer = "/accounts/{id}/transfer";
        yes(transfer, "/accounts/42/transfer", &["42"]);
        yes(transfer, "/accounts/42/transfer/", &["42"]);
        yes(transfer, "/accounts/a b:c@d/transfer", &["a b:c@d"]);
        yes(transfer, "/accounts/café/transfer", &["café"]);
        no(transfer, "/accounts/42/close");
        no(transfer, "/accounts/transfer");
        no(transfer, "/accounts/42/transfer/x");
        no(transfer, "/accounts/42/43/transfer");
        no(transfer, "/accounts/42/transferx");
        no(transfer, "/Accounts/42/transfer");
        no(transfer, "/accounts//transfer");
        no(transfer, "accounts/42/transfer");
        no(transfer, "*");
        no(transfer, "");

        // `{name=*}` is `{name}`; a bare `*` matches without capturing.
        yes("/accounts/{id=*}/transfer", "/accounts/7/transfer", &["7"]);
        yes("/a/*/{b}", "/a/x/y", &["y"]);
        no("/a/*/{b}", "/a//y");
        no("/a/*/{b}", "/a/y");

        // `**`: any number of segments, none included.
        let files = "/files/{rest=**}";
        yes(files, "/files/a", &["a"]);
        yes(files, "/files/a/b/c", &["a/b/c"]);
        yes(files, "/files/a/b/c/", &["a/b/c"]);
        yes(files, "/files/", &[""]);
        no(files, "/files");
        no(files, "/filesx/a");
        no(files, "/other/files/a");
        yes("/{all=**}", "/", &[""]);
        yes("/{all=**}", "/x/y", &["x/y"]);
        yes("/files/**", "/files/a/b", &[]);
        // Literals may follow a `**`.
        let meta = "/files/{path=**}/meta";
        yes(meta, "/files/a/b/meta", &["a/b"]);
        yes(meta, "/files/a/meta/", &["a"]);
        no(meta, "/files/meta");
        no(meta, "/files/a/b/meta/x");
        // A variable over several segments is all of them.
        let videos = "/v1/{name=videos/*}/play";
        yes(videos, "/v1/videos/cat/play", &["videos/cat"]);
        no(videos, "/v1/audio/cat/play");
        no(videos, "/v1/videos/play");
        yes("/v1/{name=videos/**}", "/v1/videos/a/b", &["videos/a/b"]);
        yes("/v1/{name=videos/**}", "/v1/videos/", &["videos/"]);
        // A suffix ends the last segment.
        let mp4 = "/videos/{name}.mp4";
        yes(mp4, "/videos/cat.mp4", &["cat"]);
        yes(mp4, "/videos/cat.mp4.mp4", &["cat.mp4"]);
        no(mp4, "/videos/.mp4");
        no(mp4, "/videos/cat.mp3");
        no(mp4, "/videos/a/cat.mp4");
        yes("/m/{p=**}.m3u8", "/m/a/b.m3u8", &["a/b"]);
        yes("/m/{p=**}.m3u8", "/m/.m3u8", &[""]);
        no("/m/{p=**}.m3u8", "/m/a/b.m3u");
        // Several variables.
        let two = "/t/{tenant}/o/{order}";
        yes(two, "/t/acme/o/7", &["acme", "7"]);
        yes(two, "/t/acme/o/7/", &["acme", "7"]);
        // The root; a template's own trailing slash is optional.
        yes("/", "/", &[]);
        no("/", "/x");
        yes("/a/{x}/", "/a/1", &["1"]);
        yes("/a/{x}/", "/a/1/", &["1"]);
        // Literals are compared as they are (the path is already decoded).
        yes("/a:b/{x}", "/a:b/1", &["1"]);
        no("/a:b/{x}", "/a%3Ab/1");
    }

    #[test]
    fn rejected_templates_say_why() {
        for (text, why) in [
            ("accounts/{id}", "must start with '/'"),
            ("/a b/{x}", "holds ' '"),
            ("/a/{id", "has no '}'"),
            ("/a/{1d}", "not a variable name"),
            ("/a/{}", "not a variable name"),
            ("/a/{a_very_long_name_x}", "not a variable name"),
            ("/a/{x}/{x}", "defined twice"),
            ("/a/{x=}", "empty match"),
            ("/a/{x=a//b}", "empty segment"),
            ("/a/{x=a/}", "empty segment"),
            ("/{a}/{b}/{c}/{d}/{e}/{f}", "more than 5 variables"),
            ("/a/**/{x}", "'**' must be the last operator"),
            ("/a/**/*", "'**' must be the last operator"),
            ("/a/{x=**}/{y=*}", "'**' must be the last operator"),
            ("/a/**/**", "'**' must be the last operator"),
            ("/a//b", "empty segment"),
            ("//a", "empty segment"),
            ("/a/../b", "dot segments"),
            ("/./b", "dot segments"),
            ("/a%2Fb/{x}", "holds '%'"),
            ("/caf%C3%A9/{x}", "holds '%'"),
            ("/a;v=1/{x}", "holds ';'"),
            ("/a/{x}.mp4;x", "holds ';'"),
            ("/a=b/{x}", "'=' is not allowed"),
            ("/a*b", "'*' is not allowed"),
            ("/a/{x}{y}", "'{' is not allowed"),
            ("/a/{x}.mp4/b", "only a suffix ending the template"),
            ("/a/*x/b", "only a suffix ending the template"),
        ] {
            let err = PathTemplate::parse(text).expect_err(text);
            assert!(err.contains(why), "{text}: {err}");
        }
    }

    #[test]
    fn variables_are_described_by_segment() {
        for (text, want) in [
            ("/accounts/{id}/transfer", "{id}: segment 2"),
            (
                "/files/{rest=**}",
                "{rest}: segments 2 on, any number (none included)",
            ),
            ("/v1/{name=videos/*}", "{name}: segments 2-3"),
            ("/v/{n=a/**}", "{n}: segments 2 on, at least 1"),
            ("/videos/{name}.mp4", "{name}: segment 2 before \".mp4\""),
            (
                "/t/{tenant}/o/{order}",
                "{tenant}: segment 2, {order}: segment 4",
            ),
        ] {
            assert_eq!(t(text).describe_variables(), want, "{text}");
        }
    }

    /// Random templates and paths, multi-byte characters included: parsing and matching never
    /// panic, and a path fits exactly when every variable reads a value.
    #[test]
    fn random_templates_and_paths_never_panic() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut pick = |alphabet: &[&str], max: u64| -> String {
            let len = next() % (max + 1);
            (0..len)
                .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                .collect()
        };
        let template_chars = [
            "/", "{", "}", "=", "*", "**", "a", "b", "x", ".", "%", ";", "é", "_",
        ];
        let path_chars = ["/", "a", "b", "x", ".", "é", "%2F", "ab"];
        let mut compiled = 0;
        for _ in 0..20_000 {
            let text = format!("/{}", pick(&template_chars, 12));
            let Ok(t) = PathTemplate::parse(&text) else {
                continue;
            };
            compiled += 1;
            for _ in 0..8 {
                let path = format!("/{}", pick(&path_chars, 10));
                let fits = t.matches(&path);
                for i in 0..t.variables.len() {
                    assert_eq!(t.capture(&path, i).is_some(), fits, "{text} {path}");
                }
            }
        }
        assert!(compiled > 1000, "{compiled} templates compiled");
    }

    #[test]
    fn matching_allocates_nothing() {
        let t = t("/accounts/{id}/transfer/{rest=**}/end.json");
        let path = "/accounts/42/transfer/a/b/end.json";
        let (fits, allocs) = crate::support::alloc_count::allocations(|| {
            (t.matches(path), t.capture(path, 0), t.capture(path, 1))
        });
        assert_eq!(fits, (true, Some("42"), Some("a/b")));
        assert_eq!(allocs, 0);
    }
}
