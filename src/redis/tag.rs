//! Call tags: every script call carries a tag of its own, and its reply carries it back. A
//! reply without the call's tag is not that call's answer, whatever it holds.
//!
//! Why: webdis (0.1.9, and its current releases: nicolasff/webdis#212, #270) writes a
//! command's reply, once Redis answers, to the connection its client had, without checking that
//! the client is still there. When the client closed first (Envoy gave up on the callout at its
//! host timeout, a network reset the connection, Envoy restarted) while the command waited in
//! Redis (paused, busy, a master failing over), the operating system may have given the
//! descriptor to a newer connection by then, and that connection reads the old command's reply
//! as the answer to its own. Without a tag, a request could read another request's verdict,
//! fencing token or stored response (another tenant's, under another policy).
//!
//! How: the tag is the script's first argument (`ARGV[1]`). Every script as the filter sends it
//! is its body between `tagged_head.lua` and `tagged_tail.lua` ([`super::scripts`]): the
//! wrapper takes the tag out of `ARGV`, runs the body with the other arguments exactly as the
//! body alone would run, and replies `{tag, n, v1, ..., vn}` for the body's array reply of `n`
//! values, `{tag, -2, v}` for its integer reply `v` (the form of a sub-reply of `batch.lua`).
//! A batch is one call with one tag. [`untag`] gives the body's reply back when the tag is the
//! call's, and [`CallError::Foreign`] otherwise: an outcome that is unknown (the call may have
//! run), handled as a timeout after the call was sent is.
//!
//! An error reply carries no tag: Redis answers `NOSCRIPT`, `CROSSSLOT`, `NOPERM`, `BUSY` and
//! the like before any script runs, and an error the body raises is Redis's error reply as
//! without the wrapper. Every error is already an outcome that is unknown to the filter
//! ([`CallError::may_have_run`]), but two make it send the call again: `NOSCRIPT` (by `EVAL`)
//! and `CROSSSLOT` (a batch, per hash slot). Were that error another call's, the call's
//! own command may have run too and runs once more; the second run has the same owner tokens
//! and nonce, so it takes nothing a second time that it could keep (a record or a lease it
//! finds held answers `409`, and is released or expires as any unknown outcome's), and a rate
//! limit counts the request twice (a lower admission, never a higher one).
//!
//! The tag is 16 lower-case hex digits: 8 of a random prefix drawn once per VM (one per worker:
//! two workers draw the same prefix with a chance of one in 2^32, and even then their tags
//! meet only at the same count) and 8 of the worker's count of calls (it wraps after 2^32
//! calls, long after any reply of the first could come back). No client input is part of it. A string, not a
//! number: webdis 0.1.9 turns every integer inside an array into a string and fails on one of
//! more than 10 digits.

use crate::redis::resp::Reply;
use crate::redis::CallError;
use std::cell::Cell;
use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};

/// A tag's length in bytes.
pub(crate) const TAG_LEN: usize = 16;

/// The mark of an integer reply in a tagged reply, in place of an array's length.
const INTEGER: i64 = -2;

/// One call's tag: [`TAG_LEN`] lower-case hex digits.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CallTag([u8; TAG_LEN]);

impl CallTag {
    fn of(value: u64) -> CallTag {
        let mut out = [b'0'; TAG_LEN];
        // Lower-case hex as everywhere else (support::text): 8 bytes fill the 16 digits
        // exactly, so the lengths always agree.
        let _ = const_hex::encode_to_slice(value.to_be_bytes(), &mut out);
        CallTag(out)
    }

    /// The tag as the call sends it and its reply carries it back.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for CallTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(&self.0))
    }
}

/// The tags of one VM's calls: a random prefix and a count.
#[derive(Debug)]
pub struct CallTags {
    prefix: u32,
    count: Cell<u32>,
}

impl CallTags {
    /// A random prefix: from the host's entropy (WASI `random_get` in the VM), else from
    /// std's random hasher keys (drawn from the same source, and apart per call).
    pub(crate) fn from_entropy() -> CallTags {
        let mut bytes = [0u8; 4];
        if getrandom::fill(&mut bytes).is_ok() {
            return CallTags::with_prefix(u32::from_le_bytes(bytes));
        }
        let mut h = RandomState::new().build_hasher();
        h.write_u64(0x9e37_79b9_7f4a_7c15);
        let seed = h.finish();
        CallTags::with_prefix((seed >> 32) as u32 ^ seed as u32)
    }

    /// Tags of a given prefix (tests and benchmarks).
    pub fn with_prefix(prefix: u32) -> CallTags {
        CallTags {
            prefix,
            count: Cell::new(0),
        }
    }

    /// The next call's tag.
    pub fn next(&self) -> CallTag {
        let n = self.count.get();
        self.count.set(n.wrapping_add(1));
        CallTag::of((u64::from(self.prefix) << 32) | u64::from(n))
    }
}

/// The body's reply in `answer`, the gateway's answer to the call tagged `tag`: the reply the
/// script's body gave, when `answer` carries the tag; [`CallError::Foreign`] when it is a reply
/// but not this call's (another tag, or none); an error reply and a failure as they are (see
/// the module's doc). Allocates nothing.
pub(crate) fn untag(answer: Result<Reply, CallError>, tag: &CallTag) -> Result<Reply, CallError> {
    let mut items = match answer {
        Ok(Reply::Array(Some(items))) => items,
        Ok(Reply::Error(e)) => return Ok(Reply::Error(e)),
        Ok(_) => return Err(CallError::Foreign),
        Err(e) => return Err(e),
    };
    if items.first().and_then(Reply::as_bytes) != Some(tag.as_bytes()) {
        return Err(CallError::Foreign);
    }
    let bad = |why: &str| Err(CallError::UnexpectedReply(format!("tagged reply: {why}")));
    match items.get(1).and_then(Reply::as_int) {
        Some(INTEGER) if items.len() == 3 => Ok(items.pop().unwrap_or(Reply::Bulk(None))),
        Some(INTEGER) => bad("an integer reply of other than one value"),
        Some(n) if usize::try_from(n).is_ok_and(|n| n == items.len() - 2) => {
            items.drain(..2);
            Ok(Reply::Array(Some(items)))
        }
        Some(_) => bad("its length is not its number of values"),
        None => bad("no length after the tag"),
    }
}

/// `reply` as the wrapper returns the body's `reply` to the call tagged `tag` (an error
/// untagged): what tests and the benchmarks answer a call with.
#[cfg(test)]
pub(crate) fn wrap(tag: &CallTag, reply: Reply) -> Reply {
    let head = Reply::Bulk(Some(tag.as_bytes().to_vec()));
    match reply {
        Reply::Error(e) => Reply::Error(e),
        Reply::Array(Some(items)) => {
            let mut out = Vec::with_capacity(items.len() + 2);
            out.push(head);
            out.push(Reply::Int(items.len() as i64));
            out.extend(items);
            Reply::Array(Some(out))
        }
        other => Reply::Array(Some(vec![head, Reply::Int(INTEGER), other])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn bulk(b: &[u8]) -> Reply {
        Reply::Bulk(Some(b.to_vec()))
    }

    #[test]
    fn tags_are_sixteen_hex_digits_unique_per_call_and_apart_per_vm() {
        let tags = CallTags::with_prefix(0x0123_abcd);
        let first = tags.next();
        assert_eq!(first.as_bytes(), b"0123abcd00000000");
        assert_eq!(tags.next().as_bytes(), b"0123abcd00000001");
        assert_eq!(format!("{first:?}"), "0123abcd00000000");
        let wrapping = CallTags::with_prefix(7);
        wrapping.count.set(u32::MAX);
        assert_eq!(wrapping.next().as_bytes(), b"00000007ffffffff");
        assert_eq!(wrapping.next().as_bytes(), b"0000000700000000");
        // Two VMs draw their own prefixes (a chance of one in 2^32 that two are the same).
        let (a, b) = (CallTags::from_entropy(), CallTags::from_entropy());
        assert_ne!(a.prefix, b.prefix);
        let seen: std::collections::HashSet<Vec<u8>> =
            (0..1000).map(|_| a.next().as_bytes().to_vec()).collect();
        assert_eq!(seen.len(), 1000);
        assert!(seen
            .iter()
            .all(|t| t.len() == TAG_LEN && t.iter().all(|b| b"0123456789abcdef".contains(b))));
    }

    #[test]
    fn a_reply_with_the_calls_tag_is_the_bodys_reply() {
        let tag = CallTags::with_prefix(1).next();
        let t = bulk(tag.as_bytes());
        // An array reply, its integers as webdis 0.1.9 gives them (strings) or as RESP does.
        let array = Reply::Array(Some(vec![
            t.clone(),
            bulk(b"3"),
            bulk(b"1"),
            Reply::Int(0),
            bulk(b"x"),
        ]));
        assert_eq!(
            untag(Ok(array), &tag),
            Ok(Reply::Array(Some(vec![
                bulk(b"1"),
                Reply::Int(0),
                bulk(b"x")
            ])))
        );
        let empty = Reply::Array(Some(vec![t.clone(), Reply::Int(0)]));
        assert_eq!(untag(Ok(empty), &tag), Ok(Reply::Array(Some(vec![]))));
        let int = Reply::Array(Some(vec![t.clone(), bulk(b"-2"), bulk(b"-1")]));
        assert_eq!(untag(Ok(int), &tag), Ok(bulk(b"-1")));
        // What `wrap` makes is read back as it was.
        for reply in [
            Reply::Int(1),
            Reply::Array(Some(vec![Reply::Int(5), bulk(b"r")])),
        ] {
            assert_eq!(untag(Ok(wrap(&tag, reply.clone())), &tag), Ok(reply));
        }
    }

    #[test]
    fn a_reply_without_the_calls_tag_is_another_calls() {
        let tags = CallTags::with_prefix(1);
        let (mine, other) = (tags.next(), tags.next());
        let acquired = Reply::Array(Some(vec![Reply::Int(1), Reply::Int(3)]));
        for foreign in [
            // Another call's reply.
            wrap(&other, acquired.clone()),
            wrap(&other, Reply::Int(1)),
            // A reply of a script without the wrapper, or of anything else: no tag at all.
            acquired.clone(),
            Reply::Int(1),
            bulk(mine.as_bytes()),
            Reply::Status("OK".into()),
            Reply::Array(None),
            Reply::Array(Some(vec![])),
            // The tag of another VM's call of the same count, and a tag cut short.
            wrap(&CallTags::with_prefix(2).next(), acquired.clone()),
            Reply::Array(Some(vec![bulk(&mine.as_bytes()[..15]), Reply::Int(0)])),
        ] {
            assert_eq!(
                untag(Ok(foreign.clone()), &mine),
                Err(CallError::Foreign),
                "{foreign:?}"
            );
        }
        let e = CallError::Foreign;
        assert!(e.may_have_run() && e.retryable());
    }

    #[test]
    fn a_tagged_reply_that_does_not_add_up_is_unexpected() {
        let tag = CallTags::with_prefix(1).next();
        let t = bulk(tag.as_bytes());
        for bad in [
            // webdis 0.1.9 drops a nil inside an array: the length says so.
            vec![t.clone(), Reply::Int(3), Reply::Int(1), Reply::Int(2)],
            vec![t.clone(), Reply::Int(1), Reply::Int(1), Reply::Int(2)],
            vec![t.clone(), Reply::Int(-2)],
            vec![t.clone(), Reply::Int(-2), Reply::Int(1), Reply::Int(2)],
            vec![t.clone(), Reply::Int(-3), Reply::Int(1)],
            vec![t.clone(), bulk(b"x")],
            vec![t.clone()],
        ] {
            assert!(
                matches!(
                    untag(Ok(Reply::Array(Some(bad.clone()))), &tag),
                    Err(CallError::UnexpectedReply(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn errors_and_failures_pass_as_they_are() {
        let tag = CallTags::with_prefix(1).next();
        for e in [
            "NOSCRIPT No matching script",
            "CROSSSLOT Keys",
            "ERR acquire.lua: bad",
        ] {
            assert_eq!(
                untag(Ok(Reply::Error(e.into())), &tag),
                Ok(Reply::Error(e.into()))
            );
            assert_eq!(wrap(&tag, Reply::Error(e.into())), Reply::Error(e.into()));
        }
        for e in [
            CallError::Timeout,
            CallError::Gateway(503),
            CallError::OverBudget,
        ] {
            assert_eq!(untag(Err(e.clone()), &tag), Err(e));
        }
    }
}
