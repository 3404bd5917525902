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

mod pointer;
mod strings;

pub(crate) use pointer::Pointer;
use strings::Escape;

/// Nesting deeper than this makes the document unreadable (what [`Scan`] can track).
pub(crate) const MAX_DEPTH: usize = 128;

/// The longest number kept as it is spelled: longer ones are read as [`Unreadable::LongNumber`].
const NUMBER_ROOM: usize = 24;

/// Why a document gave no number at the pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unreadable {
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
pub(crate) struct Scan {
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
    pub(crate) fn new() -> Scan {
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
    pub(crate) fn failed(&self) -> bool {
        matches!(self.state, State::Failed(_))
    }

    /// The next piece of the document.
    pub(crate) fn feed(&mut self, pointer: &Pointer, bytes: &[u8]) {
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
    pub(crate) fn finish(&self) -> Result<&str, Unreadable> {
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
}

#[cfg(test)]
/// The number at `pointer` in `doc`, whole (a test's and a tool's shortcut).
pub(crate) fn number_at(pointer: &Pointer, doc: &[u8]) -> Result<String, Unreadable> {
    let mut scan = Scan::new();
    scan.feed(pointer, doc);
    scan.finish().map(str::to_string)
}

#[cfg(test)]
mod tests;
