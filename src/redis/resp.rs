//! A parser for the Redis protocol (RESP2) replies webdis returns with the `.raw` suffix.

/// One Redis reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    /// `None` is the nil bulk string.
    Bulk(Option<Vec<u8>>),
    /// `None` is the nil array.
    Array(Option<Vec<Reply>>),
}

impl Reply {
    pub(crate) fn as_int(&self) -> Option<i64> {
        match self {
            Reply::Int(n) => Some(*n),
            Reply::Bulk(Some(b)) => std::str::from_utf8(b).ok()?.parse().ok(),
            _ => None,
        }
    }

    pub(crate) fn as_array(&self) -> Option<&[Reply]> {
        match self {
            Reply::Array(Some(items)) => Some(items),
            _ => None,
        }
    }

    pub(crate) fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Reply::Bulk(Some(b)) => Some(b),
            Reply::Status(s) => Some(s.as_bytes()),
            _ => None,
        }
    }
}

/// Nesting deeper than this is refused rather than recursed into.
const MAX_DEPTH: usize = 8;

/// Parses exactly one reply that fills `input` (trailing bytes are an error).
pub(crate) fn parse(input: &[u8]) -> Result<Reply, String> {
    let mut pos = 0;
    let reply = parse_at(input, &mut pos, 0)?;
    if pos != input.len() {
        return Err(format!(
            "{} trailing bytes after the reply",
            input.len() - pos
        ));
    }
    Ok(reply)
}

fn line<'a>(input: &'a [u8], pos: &mut usize) -> Result<&'a [u8], String> {
    let rest = input.get(*pos..).ok_or("truncated reply")?;
    let end = rest
        .windows(2)
        .position(|w| w == b"\r\n")
        .ok_or("reply line without CRLF")?;
    *pos += end + 2;
    Ok(&rest[..end])
}

fn number(bytes: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad number {:?}", String::from_utf8_lossy(bytes)))
}

fn parse_at(input: &[u8], pos: &mut usize, depth: usize) -> Result<Reply, String> {
    if depth > MAX_DEPTH {
        return Err("reply nested too deeply".into());
    }
    let kind = *input.get(*pos).ok_or("empty reply")?;
    *pos += 1;
    let head = line(input, pos)?;
    match kind {
        b'+' => Ok(Reply::Status(String::from_utf8_lossy(head).into_owned())),
        b'-' => Ok(Reply::Error(String::from_utf8_lossy(head).into_owned())),
        b':' => Ok(Reply::Int(number(head)?)),
        b'$' => {
            let len = number(head)?;
            if len < 0 {
                return Ok(Reply::Bulk(None));
            }
            let len = usize::try_from(len).map_err(|_| "bad bulk length")?;
            let end = pos.checked_add(len).ok_or("bad bulk length")?;
            let data = input.get(*pos..end).ok_or("truncated bulk string")?;
            if input.get(end..end + 2) != Some(b"\r\n") {
                return Err("bulk string without CRLF".into());
            }
            *pos = end + 2;
            Ok(Reply::Bulk(Some(data.to_vec())))
        }
        b'*' => {
            let n = number(head)?;
            if n < 0 {
                return Ok(Reply::Array(None));
            }
            let n = usize::try_from(n).map_err(|_| "bad array length")?;
            // Each element needs at least 3 bytes; refuse lengths the input cannot hold.
            if n > input.len() {
                return Err("array longer than the reply".into());
            }
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(parse_at(input, pos, depth + 1)?);
            }
            Ok(Reply::Array(Some(items)))
        }
        other => Err(format!("unknown reply type byte 0x{other:02x}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn parses_replies() {
        let cases: &[(&[u8], Reply)] = &[
            (b"+OK\r\n", Reply::Status("OK".into())),
            (
                b"-NOSCRIPT No matching script\r\n",
                Reply::Error("NOSCRIPT No matching script".into()),
            ),
            (b":42\r\n", Reply::Int(42)),
            (b":-7\r\n", Reply::Int(-7)),
            (b"$5\r\nhe\r\no\r\n", Reply::Bulk(Some(b"he\r\no".to_vec()))),
            (b"$0\r\n\r\n", Reply::Bulk(Some(vec![]))),
            (b"$-1\r\n", Reply::Bulk(None)),
            (b"*-1\r\n", Reply::Array(None)),
            (
                b"*3\r\n:1\r\n$1\r\nx\r\n*1\r\n:2\r\n",
                Reply::Array(Some(vec![
                    Reply::Int(1),
                    Reply::Bulk(Some(b"x".to_vec())),
                    Reply::Array(Some(vec![Reply::Int(2)])),
                ])),
            ),
        ];
        for (input, want) in cases {
            assert_eq!(
                &parse(input).expect("parses"),
                want,
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn refuses_malformed() {
        let cases: &[&[u8]] = &[
            b"",
            b"+OK",
            b":x\r\n",
            b"$5\r\nabc\r\n",
            b"$3\r\nabcd\r\n",
            b"*2\r\n:1\r\n",
            b"*99999999999\r\n",
            b"?\r\n",
            b":1\r\n:2\r\n",
            b"<html>503</html>",
            b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n",
        ];
        for input in cases {
            assert!(
                parse(input).is_err(),
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
    }
}
