//! A streaming scan of one JSON document (RFC 8259) for the value at a JSON pointer (RFC
//! 6901), fed the document in pieces as they pass. It keeps the pointer's path and nothing of
//! the document: its memory is the size of [`Scan`] (about a hundred bytes), whatever the
//! document's size or shape (nesting is limited to [`MAX_DEPTH`]). The whole document is
//! checked (grammar, UTF-8, escapes), and a member the pointer goes through that appears twice
//! in its object makes the reading ambiguous: readers that keep the first and readers that keep
//! the last would disagree.
//!
//! A charge (`response_json`) scans a response body; a scan per event reads an event stream's
//! `data:` JSON the same way.

/// Nesting deeper than this makes the document unreadable (what [`Scan`] can track).
pub const MAX_DEPTH: usize = 128;

/// The longest number kept as it is spelled: longer ones are read as [`Unreadable::LongNumber`].
const NUMBER_ROOM: usize = 24;

/// A JSON pointer, its reference tokens decoded (`~1` is `/`, `~0` is `~`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pointer {
    text: String,
    segments: Vec<Segment>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Segment {
    /// The member name it selects in an object.
    key: String,
    /// The element it selects in an array: decimal digits without a leading zero.
    index: Option<u64>,
}

impl Pointer {
    /// Parses `text`: empty (the whole document) or `/`-separated reference tokens, where `~`
    /// is only ever followed by `0` or `1`.
    pub fn parse(text: &str) -> Result<Pointer, String> {
        let mut segments = Vec::new();
        if !text.is_empty() {
            let Some(rest) = text.strip_prefix('/') else {
                return Err(format!("{text:?} does not start with '/'"));
            };
            if rest.split('/').count() > MAX_DEPTH {
                return Err(format!("{text:?} goes deeper than {MAX_DEPTH} levels"));
            }
            for token in rest.split('/') {
                segments.push(Segment::decode(token).ok_or_else(|| {
                    format!(
                        "{token:?} has a '~' not followed by 0 or 1 (write ~0 for '~', ~1 for '/')"
                    )
                })?);
            }
        }
        Ok(Pointer {
            text: text.to_string(),
            segments,
        })
    }

    /// The pointer as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl Segment {
    fn decode(token: &str) -> Option<Segment> {
        let mut key = String::with_capacity(token.len());
        let mut chars = token.chars();
        while let Some(c) = chars.next() {
            match c {
                '~' => match chars.next()? {
                    '0' => key.push('~'),
                    '1' => key.push('/'),
                    _ => return None,
                },
                c => key.push(c),
            }
        }
        let digits = !key.is_empty() && key.bytes().all(|b| b.is_ascii_digit());
        let index = (digits && (key == "0" || !key.starts_with('0')))
            .then(|| key.parse().ok())
            .flatten();
        Some(Segment { key, index })
    }
}

/// Why a document gave no number at the pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreadable {
    /// Not JSON (or more than one document, or a byte after it).
    Invalid,
    /// Ended before the document did.
    Incomplete,
    /// Nested deeper than [`MAX_DEPTH`].
    TooDeep,
    /// A member on the pointer's path appears more than once in its object.
    Repeated,
    /// Nothing at the pointer.
    Missing,
    /// The value there is not a number.
    NotANumber,
    /// A number longer than [`NUMBER_ROOM`] characters.
    LongNumber,
}

/// Where the scan is in the document's grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// A value comes next.
    Value,
    /// After `[`: a value or `]`.
    ArrayFirst,
    /// After `{`: a member name or `}`.
    ObjectFirst,
    /// After `,` in an object: a member name.
    Name,
    /// After a member name: `:`.
    Colon,
    /// After a value: `,` or the container's end (or, at the top, the document's end).
    After,
    /// In a string (a member name when `name`).
    Str { name: bool },
    /// In a number.
    Num(Num),
    /// In `true`, `false` or `null`: the word, and how much of it was read.
    Word { word: &'static [u8], at: u8 },
    /// The document is complete: only whitespace may follow.
    Done,
    /// Not a document the scan can read.
    Failed(Unreadable),
}

/// Where a number is in its grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

impl Num {
    /// Whether a number can end here.
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::Exp)
    }

    /// The state after `b`, or `None` when `b` does not continue the number.
    fn next(self, b: u8) -> Option<Num> {
        let digit = b.is_ascii_digit();
        Some(match (self, b) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus, _) if digit => Num::Int,
            (Num::Int, _) if digit => Num::Int,
            (Num::Zero | Num::Int, b'.') => Num::Dot,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::E,
            (Num::Dot | Num::Frac, _) if digit => Num::Frac,
            (Num::E, b'+' | b'-') => Num::ESign,
            (Num::E | Num::ESign | Num::Exp, _) if digit => Num::Exp,
            _ => return None,
        })
    }
}

/// An escape being read in a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Escape {
    None,
    /// After `\`.
    Backslash,
    /// In `\uXXXX`: hex digits read and their value so far.
    Unicode {
        digits: u8,
        code: u32,
    },
}

/// What the scan found at the pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    None,
    Number { len: u8, long: bool },
    Other,
}

/// A scan in progress (see the module's documentation). Feed it the document's bytes in order
/// with [`Scan::feed`], then ask [`Scan::finish`].
#[derive(Debug, Clone)]
pub struct Scan {
    state: State,
    /// Open containers.
    depth: u8,
    /// Bit `d`: the container at depth `d + 1` is an object (set) or an array.
    objects: u128,
    /// How many of the pointer's segments the open containers follow: the container at depth
    /// `matched + 1`, when open, is the value at the pointer's first `matched` segments.
    matched: u8,
    /// In that container: the next element's index (an array).
    index: u64,
    /// In that container: its segment was met already (the member name, or the element).
    seen: bool,
    /// The member name being read, compared with that container's segment: how many of its
    /// bytes matched, `None` once it differs (or is not compared).
    name_at: Option<usize>,
    /// The value about to start is at the pointer's first this-many segments.
    next_on_path: Option<u8>,
    /// Whether the number being read is the pointer's value.
    capturing: bool,
    /// A member on the path appeared twice.
    repeated: bool,
    target: Target,
    number: [u8; NUMBER_ROOM],
    escape: Escape,
    /// A `\uD800`-`\uDBFF` escape waiting for its low half.
    high: u32,
    /// UTF-8 in a string: continuation bytes still to come, and the range of the next one.
    utf8_left: u8,
    utf8_lo: u8,
    utf8_hi: u8,
}

impl Default for Scan {
    fn default() -> Scan {
        Scan::new()
    }
}

impl Scan {
    pub fn new() -> Scan {
        Scan {
            state: State::Value,
            depth: 0,
            objects: 0,
            matched: 0,
            index: 0,
            seen: false,
            name_at: None,
            next_on_path: Some(0),
            capturing: false,
            repeated: false,
            target: Target::None,
            number: [0; NUMBER_ROOM],
            escape: Escape::None,
            high: 0,
            utf8_left: 0,
            utf8_lo: 0,
            utf8_hi: 0,
        }
    }

    /// Whether the document can no longer be read (feeding it more changes nothing).
    pub fn failed(&self) -> bool {
        matches!(self.state, State::Failed(_))
    }

    /// The next piece of the document.
    pub fn feed(&mut self, pointer: &Pointer, bytes: &[u8]) {
        let mut i = 0;
        while i < bytes.len() {
            if let State::Failed(_) = self.state {
                return;
            }
            // The bulk of a big document: string contents with nothing to decode or compare.
            if let State::Str { name } = self.state {
                let plain_state = self.escape == Escape::None && self.utf8_left == 0;
                if plain_state && self.high == 0 && !self.comparing(name) {
                    let rest = bytes.get(i..).unwrap_or_default();
                    let plain = rest
                        .iter()
                        .take_while(|&&b| (0x20..0x80).contains(&b) && b != b'"' && b != b'\\')
                        .count();
                    i += plain;
                    if i >= bytes.len() {
                        return;
                    }
                }
            }
            if let Some(&b) = bytes.get(i) {
                self.byte(pointer, b);
            }
            i += 1;
        }
    }

    /// The number at the pointer, as spelled, once the whole document was fed; or why there
    /// is none.
    pub fn finish(&self) -> Result<&str, Unreadable> {
        match self.state {
            State::Done => {}
            State::Num(n) if self.depth == 0 && n.complete() => {}
            State::Failed(why) => return Err(why),
            _ => return Err(Unreadable::Incomplete),
        }
        if self.repeated {
            return Err(Unreadable::Repeated);
        }
        match self.target {
            Target::None => Err(Unreadable::Missing),
            Target::Other => Err(Unreadable::NotANumber),
            Target::Number { long: true, .. } => Err(Unreadable::LongNumber),
            Target::Number { len, .. } => self
                .number
                .get(..usize::from(len))
                .and_then(|n| std::str::from_utf8(n).ok())
                .ok_or(Unreadable::Invalid),
        }
    }

    fn fail(&mut self, why: Unreadable) {
        self.state = State::Failed(why);
    }

    /// Whether the string being read is a member name compared with the path's segment.
    fn comparing(&self, name: bool) -> bool {
        name && self.name_at.is_some()
    }

    fn byte(&mut self, p: &Pointer, b: u8) {
        match self.state {
            State::Str { name } => self.string_byte(p, name, b),
            State::Num(n) => match n.next(b) {
                Some(next) => {
                    self.state = State::Num(next);
                    self.keep_digit(b);
                }
                None if n.complete() => {
                    self.capturing = false;
                    self.value_done();
                    self.byte(p, b);
                }
                None => self.fail(Unreadable::Invalid),
            },
            State::Word { word, at } => {
                if word.get(usize::from(at)) != Some(&b) {
                    return self.fail(Unreadable::Invalid);
                }
                if usize::from(at) + 1 == word.len() {
                    self.value_done();
                } else {
                    self.state = State::Word { word, at: at + 1 };
                }
            }
            _ if matches!(b, b' ' | b'\t' | b'\n' | b'\r') => {}
            State::Value => self.value_start(p, b),
            State::ArrayFirst if b == b']' => self.close(false),
            State::ArrayFirst => self.value_start(p, b),
            State::ObjectFirst if b == b'}' => self.close(true),
            State::ObjectFirst | State::Name if b == b'"' => self.name_start(p),
            State::Colon if b == b':' => self.state = State::Value,
            State::After => match b {
                b',' if self.in_object() => self.state = State::Name,
                b',' if self.depth > 0 => self.state = State::Value,
                b'}' | b']' if self.depth > 0 => self.close(b == b'}'),
                _ => self.fail(Unreadable::Invalid),
            },
            _ => self.fail(Unreadable::Invalid),
        }
    }

    fn in_object(&self) -> bool {
        self.depth > 0 && (self.objects >> (self.depth - 1)) & 1 == 1
    }

    /// The container the path follows is the one open at the top.
    fn at_path_level(&self) -> bool {
        self.depth == self.matched + 1
    }

    /// The first byte of a value.
    fn value_start(&mut self, p: &Pointer, b: u8) {
        let mut on_path = self.next_on_path.take();
        if self.depth > 0 && !self.in_object() && self.at_path_level() {
            // An element of the array the path follows.
            let wanted = p
                .segments
                .get(usize::from(self.matched))
                .and_then(|s| s.index);
            if !self.seen && wanted == Some(self.index) {
                self.seen = true;
                on_path = Some(self.matched + 1);
            }
            self.index = self.index.saturating_add(1);
        }
        let target = on_path.is_some_and(|n| usize::from(n) == p.segments.len());
        if target {
            if self.target != Target::None {
                self.repeated = true;
            }
            self.target = Target::Other;
        }
        match b {
            b'{' | b'[' => {
                if usize::from(self.depth) >= MAX_DEPTH {
                    return self.fail(Unreadable::TooDeep);
                }
                let object = b == b'{';
                if object {
                    self.objects |= 1 << self.depth;
                } else {
                    self.objects &= !(1 << self.depth);
                }
                self.depth += 1;
                if let Some(n) = on_path.filter(|_| !target) {
                    self.matched = n;
                    self.index = 0;
                    self.seen = false;
                }
                self.state = if object {
                    State::ObjectFirst
                } else {
                    State::ArrayFirst
                };
            }
            b'"' => {
                self.state = State::Str { name: false };
            }
            b'-' | b'0'..=b'9' => {
                if target {
                    self.target = Target::Number {
                        len: 0,
                        long: false,
                    };
                    self.capturing = true;
                    self.keep_digit(b);
                }
                self.state = State::Num(if b == b'-' {
                    Num::Minus
                } else if b == b'0' {
                    Num::Zero
                } else {
                    Num::Int
                });
            }
            b't' => {
                self.state = State::Word {
                    word: b"true",
                    at: 1,
                }
            }
            b'f' => {
                self.state = State::Word {
                    word: b"false",
                    at: 1,
                }
            }
            b'n' => {
                self.state = State::Word {
                    word: b"null",
                    at: 1,
                }
            }
            _ => self.fail(Unreadable::Invalid),
        }
    }

    /// A character of the number at the pointer.
    fn keep_digit(&mut self, b: u8) {
        if !self.capturing {
            return;
        }
        if let Target::Number { len, long } = &mut self.target {
            match self.number.get_mut(usize::from(*len)) {
                Some(slot) => {
                    *slot = b;
                    *len += 1;
                }
                None => *long = true,
            }
        }
    }

    /// A value ended (a string, a number, a word, a container).
    fn value_done(&mut self) {
        self.state = if self.depth == 0 {
            State::Done
        } else {
            State::After
        };
    }

    /// The `}` or `]` of the container open at the top.
    fn close(&mut self, object: bool) {
        if self.in_object() != object {
            return self.fail(Unreadable::Invalid);
        }
        if self.at_path_level() && self.matched > 0 {
            // Back in the container the path came through: its segment was met.
            self.matched -= 1;
            self.seen = true;
        }
        self.depth -= 1;
        self.value_done();
    }

    /// The opening quote of a member name.
    fn name_start(&mut self, p: &Pointer) {
        let compared = self.at_path_level() && usize::from(self.matched) < p.segments.len();
        self.name_at = compared.then_some(0);
        self.state = State::Str { name: true };
    }

    /// A member name ended: whether the value after it is on the path.
    fn name_done(&mut self, p: &Pointer) {
        let segment = p.segments.get(usize::from(self.matched));
        let matches = self
            .name_at
            .take()
            .zip(segment)
            .is_some_and(|(at, s)| at == s.key.len());
        if matches {
            if self.seen {
                self.repeated = true;
            }
            self.seen = true;
            self.next_on_path = Some(self.matched + 1);
        }
        self.state = State::Colon;
    }

    /// A byte of a member name's text, decoded: compared with the path's segment.
    fn name_byte(&mut self, p: &Pointer, b: u8) {
        if let Some(at) = self.name_at {
            let segment = p.segments.get(usize::from(self.matched));
            let same = segment.and_then(|s| s.key.as_bytes().get(at)) == Some(&b);
            self.name_at = same.then_some(at + 1);
        }
    }

    /// A decoded character of a string (compared when it is a member name on the path).
    fn char_out(&mut self, p: &Pointer, name: bool, c: char) {
        if self.comparing(name) {
            let mut buf = [0u8; 4];
            for &b in c.encode_utf8(&mut buf).as_bytes() {
                self.name_byte(p, b);
            }
        }
    }

    fn string_byte(&mut self, p: &Pointer, name: bool, b: u8) {
        match self.escape {
            Escape::Backslash => {
                self.escape = Escape::None;
                if b == b'u' {
                    self.escape = Escape::Unicode { digits: 0, code: 0 };
                    return;
                }
                let Some(c) = crate::support::text::json_escape(b) else {
                    return self.fail(Unreadable::Invalid);
                };
                if self.high != 0 {
                    return self.fail(Unreadable::Invalid);
                }
                self.char_out(p, name, c);
            }
            Escape::Unicode { digits, code } => {
                let Some(d) = char::from(b).to_digit(16) else {
                    return self.fail(Unreadable::Invalid);
                };
                let code = code << 4 | d;
                if digits < 3 {
                    self.escape = Escape::Unicode {
                        digits: digits + 1,
                        code,
                    };
                    return;
                }
                self.escape = Escape::None;
                self.code_unit(p, name, code);
            }
            Escape::None if self.utf8_left > 0 => {
                if b < self.utf8_lo || b > self.utf8_hi {
                    return self.fail(Unreadable::Invalid);
                }
                self.utf8_left -= 1;
                (self.utf8_lo, self.utf8_hi) = (0x80, 0xBF);
                if self.comparing(name) {
                    self.name_byte(p, b);
                }
            }
            Escape::None => {
                if self.high != 0 && b != b'\\' {
                    // A high surrogate not followed by an escape.
                    return self.fail(Unreadable::Invalid);
                }
                match b {
                    b'"' if name => self.name_done(p),
                    b'"' => self.value_done(),
                    b'\\' => self.escape = Escape::Backslash,
                    0x00..=0x1F => self.fail(Unreadable::Invalid),
                    0x20..=0x7F => {
                        if self.comparing(name) {
                            self.name_byte(p, b);
                        }
                    }
                    _ => self.utf8_lead(p, name, b),
                }
            }
        }
    }

    /// The first byte of a multi-byte UTF-8 character (RFC 3629: no overlong forms, no
    /// surrogates, nothing above U+10FFFF).
    fn utf8_lead(&mut self, p: &Pointer, name: bool, b: u8) {
        let (left, lo, hi) = match b {
            0xC2..=0xDF => (1, 0x80, 0xBF),
            0xE0 => (2, 0xA0, 0xBF),
            0xE1..=0xEC | 0xEE..=0xEF => (2, 0x80, 0xBF),
            0xED => (2, 0x80, 0x9F),
            0xF0 => (3, 0x90, 0xBF),
            0xF1..=0xF3 => (3, 0x80, 0xBF),
            0xF4 => (3, 0x80, 0x8F),
            _ => return self.fail(Unreadable::Invalid),
        };
        (self.utf8_left, self.utf8_lo, self.utf8_hi) = (left, lo, hi);
        if self.comparing(name) {
            self.name_byte(p, b);
        }
    }

    /// A `\uXXXX` escape's code unit: a character, or half of a surrogate pair.
    fn code_unit(&mut self, p: &Pointer, name: bool, unit: u32) {
        let high = std::mem::take(&mut self.high);
        let code = match (high, unit) {
            (0, 0xD800..=0xDBFF) => {
                self.high = unit;
                return;
            }
            (0, 0xDC00..=0xDFFF) => return self.fail(Unreadable::Invalid),
            (0, u) => u,
            (h, 0xDC00..=0xDFFF) => 0x10000 + ((h - 0xD800) << 10) + (unit - 0xDC00),
            _ => return self.fail(Unreadable::Invalid),
        };
        match char::from_u32(code) {
            Some(c) => self.char_out(p, name, c),
            None => self.fail(Unreadable::Invalid),
        }
    }
}

/// The number at `pointer` in `doc`, whole (a test's and a tool's shortcut).
pub fn number_at(pointer: &Pointer, doc: &[u8]) -> Result<String, Unreadable> {
    let mut scan = Scan::new();
    scan.feed(pointer, doc);
    scan.finish().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn ptr(text: &str) -> Pointer {
        Pointer::parse(text).expect("a pointer")
    }

    fn at(pointer: &str, doc: &str) -> Result<String, Unreadable> {
        number_at(&ptr(pointer), doc.as_bytes())
    }

    /// The same document fed in every split into two pieces, and byte by byte: one answer.
    fn every_split(pointer: &str, doc: &str) -> Result<String, Unreadable> {
        let p = ptr(pointer);
        let whole = number_at(&p, doc.as_bytes());
        let bytes = doc.as_bytes();
        for cut in 0..=bytes.len() {
            let mut s = Scan::new();
            s.feed(&p, &bytes[..cut]);
            s.feed(&p, &bytes[cut..]);
            assert_eq!(
                s.finish().map(str::to_string),
                whole,
                "cut at {cut} of {doc:?}"
            );
        }
        let mut s = Scan::new();
        for b in bytes {
            s.feed(&p, std::slice::from_ref(b));
        }
        assert_eq!(
            s.finish().map(str::to_string),
            whole,
            "byte by byte: {doc:?}"
        );
        whole
    }

    #[test]
    fn reads_the_number_at_the_pointer_however_the_document_is_cut() {
        let doc =
            r#"{"id":"r1","usage":{"prompt_tokens":100,"total_tokens":300},"x":[1,{"a":[]}]}"#;
        assert_eq!(every_split("/usage/total_tokens", doc), Ok("300".into()));
        assert_eq!(every_split("/usage/prompt_tokens", doc), Ok("100".into()));
        assert_eq!(every_split("/x/0", doc), Ok("1".into()));
        assert_eq!(every_split("/x/1/a", doc), Err(Unreadable::NotANumber));
        assert_eq!(every_split("/x/2", doc), Err(Unreadable::Missing));
        assert_eq!(every_split("/usage", doc), Err(Unreadable::NotANumber));
        assert_eq!(every_split("/id", doc), Err(Unreadable::NotANumber));
        assert_eq!(
            every_split("/usage/total_tokens/x", doc),
            Err(Unreadable::Missing)
        );
        assert_eq!(every_split("", " 42 "), Ok("42".into()));
        assert_eq!(every_split("", "42"), Ok("42".into()));
        assert_eq!(every_split("/0/1", "[[5, 6], 7]"), Ok("6".into()));
        let spaced = "\r\n { \"usage\" :\t{ \"total_tokens\" : 7 } } \n";
        assert_eq!(every_split("/usage/total_tokens", spaced), Ok("7".into()));
    }

    #[test]
    fn numbers_are_kept_as_spelled() {
        for n in ["0", "5", "5.0", "0.5e1", "1e30", "-3", "1E+2", "12.5e-3"] {
            let doc = format!(r#"{{"n": {n}}}"#);
            assert_eq!(every_split("/n", &doc), Ok(n.to_string()), "{n}");
        }
        let long = "1".repeat(NUMBER_ROOM + 1);
        assert_eq!(
            at("/n", &format!(r#"{{"n":{long}}}"#)),
            Err(Unreadable::LongNumber)
        );
        for bad in [
            "01", "-", "1.", ".5", "1e", "1e+", "+1", "0x10", "1.2.3", "--1", "NaN",
        ] {
            let doc = format!(r#"{{"n": {bad}}}"#);
            assert_eq!(at("/n", &doc), Err(Unreadable::Invalid), "{bad}");
        }
    }

    #[test]
    fn a_member_on_the_path_that_appears_twice_is_ambiguous() {
        for doc in [
            r#"{"usage":{"total_tokens":5,"total_tokens":5000}}"#,
            r#"{"usage":{"total_tokens":5},"usage":{"total_tokens":5000}}"#,
            r#"{"usage":{"total_tokens":5},"usage":1}"#,
            r#"{"usage":{},"usage":{"total_tokens":5}}"#,
            r#"{"usage":{"total_tokens":5,"total_\u0074okens":6}}"#,
        ] {
            assert_eq!(
                every_split("/usage/total_tokens", doc),
                Err(Unreadable::Repeated),
                "{doc}"
            );
        }
        // Repeats off the path are the document's business.
        let doc = r#"{"a":1,"a":2,"usage":{"x":1,"x":2,"total_tokens":9}}"#;
        assert_eq!(every_split("/usage/total_tokens", doc), Ok("9".into()));
        let doc = r#"{"usage":{"total_tokens":9},"other":{"usage":1,"usage":2}}"#;
        assert_eq!(every_split("/usage/total_tokens", doc), Ok("9".into()));
    }

    #[test]
    fn member_names_are_compared_decoded() {
        let p = "/a~1b/c~0d/é/😀";
        let doc = r#"{"a\/b":{"c~d":{"\u00e9":{"\ud83d\ude00":12}}}}"#;
        assert_eq!(every_split(p, doc), Ok("12".into()));
        let doc = r#"{"a/b":{"c~d":{"é":{"😀":13}}}}"#;
        assert_eq!(every_split(p, doc), Ok("13".into()));
        assert_eq!(at("/ab", r#"{"a":1,"abc":2,"ab":3}"#), Ok("3".into()));
        assert_eq!(at("/", r#"{"":4}"#), Ok("4".into()));
        // An array index is digits without a leading zero; "-" is past the end.
        assert_eq!(at("/01", "[1,2]"), Err(Unreadable::Missing));
        assert_eq!(at("/-", "[1,2]"), Err(Unreadable::Missing));
        assert_eq!(at("/1", r#"{"1":8}"#), Ok("8".into()));
    }

    #[test]
    fn anything_but_one_whole_document_is_unreadable() {
        let p = "/n";
        for doc in [
            "",
            "{",
            r#"{"n":1"#,
            r#"{"n":1}}"#,
            r#"{"n":1} {}"#,
            r#"{"n":1,}"#,
            r#"{"n":1]"#,
            r#"[1}"#,
            r#"{"n" 1}"#,
            r#"{n:1}"#,
            r#"{"n":tru}"#,
            r#"{"n":1,"s":"\x"}"#,
            r#"{"n":1,"s":"\u12"}"#,
            r#"{"n":1,"s":"\ud800"}"#,
            r#"{"n":1,"s":"\udc00"}"#,
            r#"{"n":1,"s":"\ud800\u0041"}"#,
            "{\"n\":1,\"s\":\"a\u{1}\"}",
            "\u{feff}{\"n\":1}",
        ] {
            assert!(
                matches!(
                    at(p, doc),
                    Err(Unreadable::Invalid | Unreadable::Incomplete)
                ),
                "{doc:?}: {:?}",
                at(p, doc)
            );
        }
        // Bytes that are not UTF-8 inside a string.
        for bad in [
            &b"\xff"[..],
            b"\xc0\x80",
            b"\xed\xa0\x80",
            b"\xf4\x90\x80\x80",
            b"\xe2\x82",
        ] {
            let mut doc = br#"{"n":1,"s":""#.to_vec();
            doc.extend_from_slice(bad);
            doc.extend_from_slice(br#""}"#);
            assert_eq!(
                number_at(&ptr(p), &doc),
                Err(Unreadable::Invalid),
                "{bad:?}"
            );
        }
        let ok = "{\"n\":1,\"s\":\"é€😀\"}";
        assert_eq!(every_split(p, ok), Ok("1".into()));
    }

    #[test]
    fn nesting_is_limited() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(at("/0", &deep(MAX_DEPTH)), Err(Unreadable::NotANumber));
        assert_eq!(at("/0", &deep(MAX_DEPTH + 1)), Err(Unreadable::TooDeep));
        let mut path = String::new();
        let mut doc = String::new();
        for _ in 0..MAX_DEPTH - 1 {
            path.push_str("/a");
            doc.push_str(r#"{"a":"#);
        }
        doc.push('3');
        doc.push_str(&"}".repeat(MAX_DEPTH - 1));
        assert_eq!(at(&path, &doc), Ok("3".into()));
    }

    #[test]
    fn pointers_are_parsed_by_rfc_6901() {
        assert!(Pointer::parse("usage").is_err());
        assert!(Pointer::parse("/a~2").is_err());
        assert!(Pointer::parse("/a~").is_err());
        assert_eq!(ptr("/a~01").segments[0].key, "a~1");
        assert_eq!(ptr("/").segments.len(), 1);
        assert_eq!(ptr("").segments.len(), 0);
        assert_eq!(ptr("/10").segments[0].index, Some(10));
        assert!(Pointer::parse(&"/a".repeat(MAX_DEPTH + 1)).is_err());
    }

    /// Mutations of real-looking documents (bytes flipped, cut, doubled, inserted), fed in two
    /// pieces: the scan calls a document valid exactly when serde_json does, and reads the same
    /// number at the pointer (serde_json keeps the last of a repeated member, which the scan
    /// calls ambiguous instead).
    #[test]
    fn agrees_with_serde_json_on_mutated_documents() {
        let seeds: [&[u8]; 5] = [
            br#"{"id":"r\u00e9","usage":{"prompt_tokens":10,"total_tokens":300},"list":[1,2.5,-3e2,true,null,"\ud83d\ude00"]}"#,
            br#"[{"usage":{"total_tokens":0}},{"a":[[],{}]}]"#,
            br#"{"usage":{"total_tokens":12345678901234567890}}"#,
            b"{\"usage\" : {\"total_tokens\" : 7 } , \"s\":\"\xc3\xa9\\n\\\"\"}",
            br#"{"usage":[{"total_tokens":1}],"":{"":2}}"#,
        ];
        let pointers = [
            "/usage/total_tokens",
            "/usage/0/total_tokens",
            "/0/usage/total_tokens",
            "//",
        ];
        let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let alphabet = b"{}[]\",:0123456789.eE+-tfnul \\/x\xc3\xa9\xff";
        for _ in 0..20_000 {
            let seed = seeds[(next() % seeds.len() as u64) as usize];
            let mut doc = seed.to_vec();
            for _ in 0..(next() % 3) {
                let at = (next() as usize) % (doc.len() + 1);
                match next() % 4 {
                    0 if at < doc.len() => doc[at] = alphabet[(next() as usize) % alphabet.len()],
                    1 => doc.truncate(at),
                    2 if at < doc.len() => doc.insert(at, doc[at]),
                    _ => doc.insert(at, alphabet[(next() as usize) % alphabet.len()]),
                }
            }
            for pointer in pointers {
                let p = ptr(pointer);
                let cut = (next() as usize) % (doc.len() + 1);
                let mut s = Scan::new();
                s.feed(&p, &doc[..cut]);
                s.feed(&p, &doc[cut..]);
                let ours = s.finish().map(str::to_string);
                let theirs = serde_json::from_slice::<serde_json::Value>(&doc);
                let shown = String::from_utf8_lossy(&doc);
                // RFC 8259 puts no bound on a number; serde_json refuses one beyond an f64.
                if theirs
                    .as_ref()
                    .is_err_and(|e| e.to_string().contains("number out of range"))
                {
                    continue;
                }
                match (&ours, &theirs) {
                    (Err(Unreadable::Invalid | Unreadable::Incomplete), Err(_)) => {}
                    (Err(Unreadable::Repeated), Ok(_)) => {}
                    (Ok(n), Ok(v)) => {
                        let want = v.pointer(pointer).expect("serde finds it too");
                        let got: serde_json::Value = serde_json::from_str(n).expect("a number");
                        assert_eq!(&got, want, "{shown} at {pointer}");
                    }
                    (Err(Unreadable::Missing), Ok(v)) => {
                        assert!(v.pointer(pointer).is_none(), "{shown} at {pointer}")
                    }
                    (Err(Unreadable::NotANumber), Ok(v)) => {
                        let found = v.pointer(pointer).expect("serde finds it too");
                        assert!(!found.is_number(), "{shown} at {pointer}");
                    }
                    (Err(Unreadable::LongNumber), Ok(v)) => {
                        assert!(v.pointer(pointer).is_some_and(|n| n.is_number()), "{shown}");
                    }
                    _ => panic!("{shown} at {pointer}: scan {ours:?}, serde_json {theirs:?}"),
                }
            }
        }
    }

    #[test]
    fn the_scan_keeps_nothing_of_the_document() {
        // Its state is its size, allocated once; feeding allocates nothing.
        assert!(
            std::mem::size_of::<Scan>() <= 128,
            "{}",
            std::mem::size_of::<Scan>()
        );
        let p = ptr("/usage/total_tokens");
        let mut doc = br#"{"usage":{"total_tokens":5},"x":["#.to_vec();
        for _ in 0..10_000 {
            doc.extend_from_slice(br#"{"":0},"#);
        }
        doc.extend_from_slice(br#"{"":0}]}"#);
        let mut s = Scan::new();
        let ((), n) = crate::support::alloc_count::allocations(|| s.feed(&p, &doc));
        assert_eq!(n, 0);
        assert_eq!(s.finish(), Ok("5"));
    }
}
