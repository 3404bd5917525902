//! The webdis gateway: a Redis command becomes an HTTP `POST /` whose body is
//! `COMMAND/arg1/.../argN.raw`, every argument percent-encoded; the answer is raw RESP.

use crate::redis::resp::{self, Reply};
use crate::redis::CallError;

/// Bytes sent unencoded: ASCII letters and digits, `-` and `_`; the rest, `.` and `/`
/// included (they are webdis syntax), are `%XX`. A table, looked up instead of compared: the
/// encoder runs over every byte of every call.
const UNRESERVED: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || c == b'-' || c == b'_';
        b += 1;
    }
    table
};

/// Up to this many bytes of words, a command's body is sized for every byte escaped.
const WORST_CASE_ROOM: usize = 4096;

#[cfg(test)]
/// Encodes a command for webdis. Webdis cannot carry NUL bytes or empty arguments; callers
/// never send either (arguments are hex, decimal, names and JSON text).
pub(crate) fn encode<'a, I>(command: I) -> Vec<u8>
where
    I: IntoIterator<Item = &'a [u8]>,
    I::IntoIter: Clone,
{
    encode_after(&[], command)
}

/// [`encode`] of a command whose first words are already encoded as `head` (a script's
/// `EVALSHA <sha1>`, the same in every call, from [`encode_words`]): `command` holds the words
/// after them.
pub(crate) fn encode_after<'a, I>(head: &[u8], command: I) -> Vec<u8>
where
    I: IntoIterator<Item = &'a [u8]>,
    I::IntoIter: Clone,
{
    let command = command.into_iter();
    // No growing: a `/` before every argument but the first, `.raw` after the last, and room
    // for the worst case (every byte `%XX`) when that is small, so that the usual call needs
    // no pass to count its reserved bytes; a big one (a stored response) is counted, so as not
    // to hold three times its size.
    let words: usize = command.clone().map(|a| 1 + a.len()).sum();
    let escapes = if words <= WORST_CASE_ROOM {
        2 * words
    } else {
        command
            .clone()
            .map(|a| 2 * a.iter().filter(|&&b| !UNRESERVED[usize::from(b)]).count())
            .sum()
    };
    let mut out = Vec::with_capacity(head.len() + words + escapes + 3);
    out.extend_from_slice(head);
    push_words(&mut out, !head.is_empty(), command);
    out.extend_from_slice(b".raw");
    out
}

/// The words of a command encoded as [`encode`] does, without the `.raw` that ends a command:
/// the head of [`encode_after`].
pub(crate) fn encode_words<'a>(command: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::new();
    push_words(&mut out, false, command);
    out
}

/// Appends `command`'s words, each percent-encoded and after a `/` (the first one too when
/// `after_words`: words are already there).
fn push_words<'a>(
    out: &mut Vec<u8>,
    after_words: bool,
    command: impl IntoIterator<Item = &'a [u8]>,
) {
    for (i, arg) in command.into_iter().enumerate() {
        if i > 0 || after_words {
            out.push(b'/');
        }
        // Runs of unreserved bytes are copied whole; each byte between them becomes `%XX`.
        let mut rest = arg;
        while let Some(at) = rest.iter().position(|&b| !UNRESERVED[usize::from(b)]) {
            let (run, tail) = rest.split_at(at);
            out.extend_from_slice(run);
            if let Some((&b, after)) = tail.split_first() {
                const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
                out.extend_from_slice(&[
                    b'%',
                    DIGITS[usize::from(b >> 4)],
                    DIGITS[usize::from(b & 0x0f)],
                ]);
                rest = after;
            }
        }
        out.extend_from_slice(rest);
    }
}

/// Envoy's own answers (body text) when the callout never reached the gateway: the
/// connection could not be made, no endpoint is healthy, or the pool overflowed. A reset of a
/// connection the request was sent on ("connection termination", "reset") is not one of them.
const NOT_SENT: &[&str] = &[
    "connection failure",
    "no healthy upstream",
    "overflow",
    "cluster not found",
];

/// The reply in an answer's body when the body alone says the command ran: a whole RESP
/// array, which only Redis writes (every script replies with one). Neither webdis nor Envoy
/// answers a failure with one: webdis's refusals (403, 405, 503) carry no RESP array, and
/// Envoy's own replies are plain text. So such a body needs no status read, one host call
/// fewer per answer; anything else (an error reply, an integer, a truncated or foreign body)
/// goes through [`decode`] with the status.
pub fn decode_array(body: &[u8]) -> Option<Reply> {
    if body.first() != Some(&b'*') {
        return None;
    }
    resp::parse(body)
        .ok()
        .filter(|r| matches!(r, Reply::Array(Some(_))))
}

/// Turns the gateway's HTTP answer into a Redis reply. `from_gateway` says the answer came
/// from the gateway itself (its response carries `server` or Envoy's
/// `x-envoy-upstream-service-time`), not from Envoy on its behalf. Webdis never answers 504
/// itself: that is Envoy's own reply when the callout's timeout fires.
pub fn decode(status: Option<u32>, from_gateway: bool, body: &[u8]) -> Result<Reply, CallError> {
    match status {
        Some(200) => resp::parse(body).map_err(CallError::Malformed),
        Some(504) => Err(CallError::Timeout),
        Some(s) if from_gateway => Err(CallError::Gateway(s)),
        Some(_) => {
            let text = String::from_utf8_lossy(body).to_ascii_lowercase();
            if NOT_SENT.iter().any(|t| text.contains(t)) {
                Err(CallError::NotSent)
            } else {
                Err(CallError::Transport)
            }
        }
        None => Err(CallError::Transport),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn encodes_arguments() {
        let body = encode([
            &b"EVALSHA"[..],
            b"ab12",
            b"1",
            b"cg:rl:{t.x}:p",
            b"a/b.c d%",
        ]);
        assert_eq!(
            String::from_utf8(body).expect("ascii"),
            "EVALSHA/ab12/1/cg%3Arl%3A%7Bt%2Ex%7D%3Ap/a%2Fb%2Ec%20d%25.raw"
        );
    }

    fn unreserved(b: u8) -> bool {
        b.is_ascii_alphanumeric() || b == b'-' || b == b'_'
    }

    #[test]
    fn every_byte_is_sent_as_itself_or_as_percent_hex() {
        for b in 0..=255u8 {
            assert_eq!(UNRESERVED[usize::from(b)], unreserved(b), "byte {b}");
            let body = encode([&[b'a', b, b'z'][..], &[b][..]]);
            let expected = if unreserved(b) {
                format!("a{0}z/{0}.raw", char::from(b))
            } else {
                format!("a%{b:02X}z/%{b:02X}.raw")
            };
            assert_eq!(body, expected.as_bytes(), "byte {b}");
            // Sized once for the worst case (both words all `%XX`), so never grown.
            assert_eq!(body.capacity(), 3 * (1 + 3) + 3 * (1 + 1) + 3, "byte {b}");
        }
    }

    #[test]
    fn a_big_command_is_sized_exactly_a_small_one_for_the_worst_case() {
        let big = [b"{\"a\":1}".repeat(WORST_CASE_ROOM), b"x".repeat(100)];
        let body = encode(big.iter().map(Vec::as_slice));
        // `{`, the two `"`, `:` and `}` take three bytes each; `a` and `1` one.
        assert_eq!(body.len(), WORST_CASE_ROOM * (5 * 3 + 2) + 1 + 100 + 4);
        assert_eq!(body.capacity(), body.len());
        let small = encode([&b"a:b"[..]]);
        assert_eq!(small, b"a%3Ab.raw");
        assert_eq!(small.capacity(), 3 * (1 + 3) + 3);
    }

    #[test]
    fn an_array_alone_is_a_reply_without_the_status() {
        let reply = decode_array(b"*2\r\n:1\r\n$2\r\nok\r\n");
        assert_eq!(
            reply,
            Some(Reply::Array(Some(vec![
                Reply::Int(1),
                Reply::Bulk(Some(b"ok".to_vec()))
            ])))
        );
        // What needs the status to be read: a failure's text, an error reply, another reply,
        // a nil array, a truncated array, an array followed by anything.
        for body in [
            &b"upstream request timeout"[..],
            b"-ERR unknown command\r\n",
            b":1\r\n",
            b"*-1\r\n",
            b"*2\r\n:1\r\n",
            b"*1\r\n:1\r\nHTTP",
            b"",
        ] {
            assert_eq!(decode_array(body), None, "{body:?}");
        }
    }

    #[test]
    fn decodes_answers() {
        assert_eq!(decode(Some(200), true, b":1\r\n"), Ok(Reply::Int(1)));
        assert_eq!(decode(Some(503), true, b""), Err(CallError::Gateway(503)));
        assert_eq!(
            decode(Some(504), false, b"upstream request timeout"),
            Err(CallError::Timeout)
        );
        assert_eq!(decode(Some(403), true, b""), Err(CallError::Gateway(403)));
        assert_eq!(decode(None, false, b""), Err(CallError::Transport));
        assert!(matches!(
            decode(Some(200), true, b"{\"EVAL\":1}"),
            Err(CallError::Malformed(_))
        ));
        // Envoy's own 503s: never sent, or sent on a connection that was then lost.
        for body in [
            &b"upstream connect error or disconnect/reset before headers. reset reason: remote connection failure"[..],
            b"upstream connect error or disconnect/reset before headers. retried and the latest reset reason: connection failure, transport failure reason: delayed connect error: 111",
            b"no healthy upstream",
            b"upstream connect error or disconnect/reset before headers. reset reason: overflow",
        ] {
            assert_eq!(decode(Some(503), false, body), Err(CallError::NotSent));
        }
        assert_eq!(
            decode(
                Some(503),
                false,
                b"upstream connect error or disconnect/reset before headers. reset reason: connection termination"
            ),
            Err(CallError::Transport)
        );
    }
}
