//! Strings in the scan: escapes (`\n`, `\uXXXX` and surrogate pairs), UTF-8 checked byte by
//! byte, and a member name's decoded text compared with the pointer's segment as it passes.

use super::{Pointer, Scan, Unreadable};

/// An escape being read in a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Escape {
    None,
    /// After `\`.
    Backslash,
    /// In `\uXXXX`: hex digits read and their value so far.
    Unicode {
        digits: u8,
        code: u32,
    },
}

impl Scan {
    /// A decoded character of a string (compared when it is a member name on the path).
    fn char_out(&mut self, p: &Pointer, name: bool, c: char) {
        if self.comparing(name) {
            let mut buf = [0u8; 4];
            for &b in c.encode_utf8(&mut buf).as_bytes() {
                self.name_byte(p, b);
            }
        }
    }

    pub(super) fn string_byte(&mut self, p: &Pointer, name: bool, b: u8) {
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
