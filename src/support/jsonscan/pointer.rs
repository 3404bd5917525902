//! The JSON pointer (RFC 6901) a scan looks for: parsed once, at load, into the member names
//! and array indexes it selects.

use super::MAX_DEPTH;

/// A JSON pointer, its reference tokens decoded (`~1` is `/`, `~0` is `~`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pointer {
    text: String,
    pub(super) segments: Vec<Segment>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Segment {
    /// The member name it selects in an object.
    pub(super) key: String,
    /// The element it selects in an array: decimal digits without a leading zero.
    pub(super) index: Option<u64>,
}

impl Pointer {
    /// Parses `text`: empty (the whole document) or `/`-separated reference tokens, where `~`
    /// is only ever followed by `0` or `1`.
    pub(crate) fn parse(text: &str) -> Result<Pointer, String> {
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
