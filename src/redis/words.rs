//! A command's words kept in one text with where each ends: two allocations however many
//! words, where a list of strings makes one per word (a rate limit's acquire has a dozen).

use std::fmt;
#[cfg(test)]
use std::ops::Index;

/// Words, in order. Compares with a list of strings (`words == ["a", "b"]`).
#[derive(Clone, Default, PartialEq, Eq)]
pub(crate) struct Words {
    text: String,
    /// Where each word ends in `text`.
    ends: Vec<usize>,
}

impl Words {
    /// Room for `words` words of `bytes` bytes in all, so that pushing them reallocates nothing.
    pub(crate) fn with_capacity(words: usize, bytes: usize) -> Words {
        Words {
            text: String::with_capacity(bytes),
            ends: Vec::with_capacity(words),
        }
    }

    /// Not inlined: a call's words are pushed in dozens of places, and this is one copy.
    #[inline(never)]
    pub(crate) fn push(&mut self, word: &str) {
        crate::support::text::push(&mut self.text, word);
        self.ends.push(self.text.len());
    }

    /// A number, in decimal (one copy, as [`Words::push`]).
    #[inline(never)]
    pub(crate) fn push_u64(&mut self, n: u64) {
        crate::support::text::push_u64(&mut self.text, n);
        self.ends.push(self.text.len());
    }

    /// A signed number, in decimal.
    pub(crate) fn push_i64(&mut self, n: i64) {
        if n < 0 {
            self.text.push('-');
        }
        self.push_u64(n.unsigned_abs());
    }

    /// Every word of `other`, after these.
    pub(crate) fn extend_from(&mut self, other: &Words) {
        let base = self.text.len();
        self.text.push_str(&other.text);
        self.ends.extend(other.ends.iter().map(|e| base + e));
    }

    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub(crate) fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = match i.checked_sub(1) {
            Some(before) => self.ends.get(before).copied().unwrap_or(0),
            None => 0,
        };
        self.text.get(start..end)
    }

    pub(crate) fn first(&self) -> Option<&str> {
        self.get(0)
    }

    #[cfg(test)]
    pub(crate) fn last(&self) -> Option<&str> {
        self.len().checked_sub(1).and_then(|i| self.get(i))
    }

    /// The words as bytes, in one walk of the ends (what a call's encoding reads).
    pub(crate) fn iter_bytes(&self) -> impl Iterator<Item = &[u8]> + Clone + '_ {
        let text = self.text.as_bytes();
        self.ends.iter().scan(0, move |start, &end| {
            let word = text.get(*start..end).unwrap_or_default();
            *start = end;
            Some(word)
        })
    }

    pub(crate) fn iter(&self) -> impl ExactSizeIterator<Item = &str> + Clone + '_ {
        (0..self.len()).map(|i| self.get(i).unwrap_or_default())
    }

    /// The words from `from` on (tests compare parts of a call).
    #[cfg(test)]
    pub(crate) fn words_from(&self, from: usize) -> Vec<&str> {
        self.iter().skip(from).collect()
    }

    /// The sum of the words' lengths.
    pub(crate) fn bytes(&self) -> usize {
        self.text.len()
    }
}

/// Tests index words as they would a list; the filter uses [`Words::get`].
#[cfg(test)]
impl Index<usize> for Words {
    type Output = str;

    /// The `i`-th word; panics past the last, as a list would.
    fn index(&self, i: usize) -> &str {
        match self.get(i) {
            Some(w) => w,
            None => panic!("word {i} of {}", self.len()),
        }
    }
}

impl fmt::Debug for Words {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<S: AsRef<str>> FromIterator<S> for Words {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Words {
        let mut words = Words::default();
        for w in iter {
            words.push(w.as_ref());
        }
        words
    }
}

impl<const N: usize> From<[&str; N]> for Words {
    fn from(words: [&str; N]) -> Words {
        let mut out = Words::with_capacity(N, words.iter().map(|w| w.len()).sum());
        for w in words {
            out.push(w);
        }
        out
    }
}

impl<S: AsRef<str>> PartialEq<[S]> for Words {
    fn eq(&self, other: &[S]) -> bool {
        self.len() == other.len() && self.iter().zip(other).all(|(a, b)| a == b.as_ref())
    }
}

impl<S: AsRef<str>, const N: usize> PartialEq<[S; N]> for Words {
    fn eq(&self, other: &[S; N]) -> bool {
        *self == other[..]
    }
}

impl<S: AsRef<str>> PartialEq<Vec<S>> for Words {
    fn eq(&self, other: &Vec<S>) -> bool {
        *self == other[..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn words_keep_their_bounds() {
        let mut w = Words::from(["", "a", "bc"]);
        w.push_u64(0);
        w.push_i64(-12);
        w.push_u64(u64::MAX);
        w.push("");
        assert_eq!(w, ["", "a", "bc", "0", "-12", "18446744073709551615", ""]);
        assert_eq!(w.len(), 7);
        assert_eq!((w.first(), w.last(), w.get(7)), (Some(""), Some(""), None));
        assert_eq!(&w[2], "bc");
        let mut more = Words::from(["x"]);
        more.extend_from(&w);
        more.extend_from(&Words::default());
        assert_eq!(more.words_from(1), w.iter().collect::<Vec<_>>());
        assert_eq!(
            format!("{more:?}"),
            format!("{:?}", more.iter().collect::<Vec<_>>())
        );
        assert_ne!(Words::from(["ab"]), Words::from(["a", "b"]));
        assert_ne!(Words::from(["a"]), ["a", ""]);
        assert!(Words::default().is_empty());
        let collected: Words = ["p", "q"].iter().collect();
        assert_eq!(collected, vec!["p", "q"]);
    }
}
