//! A Redis client for the operator's tool: RESP2 over TCP, one connection per node, the
//! admin's credentials sent with `AUTH` (and `HELLO`-free: RESP2 only), and Redis Cluster
//! redirections followed: a `MOVED` answer sends the command (and every later one for that
//! slot) to the node it names, an `ASK` sends it there once, after `ASKING`.
//!
//! It never scans: every command names its keys.

use crate::redis::resp::{self, Reply};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Redirections followed for one command before giving up (a cluster in the middle of a
/// resharding may answer a few).
const MAX_REDIRECTS: usize = 5;
/// How long a connection, a read or a write may take.
const TIMEOUT: Duration = Duration::from_secs(5);
/// The largest reply read (an idempotency record with a stored response is the largest).
const MAX_REPLY: usize = 64 << 20;

/// Where Redis is and who the tool is to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
}

impl Target {
    /// `redis://[user[:password]@]host[:port]` (port 6379 when left out). The user and the
    /// password may be percent-encoded.
    pub(crate) fn from_url(url: &str) -> Result<Target, String> {
        let rest = url
            .strip_prefix("redis://")
            .ok_or_else(|| format!("the Redis URL must start with redis://, got {url:?}"))?;
        let rest = rest.split(['/', '?']).next().unwrap_or_default();
        let (auth, hostport) = match rest.rsplit_once('@') {
            Some((a, h)) => (Some(a), h),
            None => (None, rest),
        };
        let (username, password) = match auth {
            None => (None, None),
            Some(a) => match a.split_once(':') {
                Some((u, p)) => (non_empty(decode(u)?), Some(decode(p)?)),
                None => (non_empty(decode(a)?), None),
            },
        };
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (
                h,
                p.parse::<u16>()
                    .map_err(|_| format!("the Redis URL's port is not a port: {p:?}"))?,
            ),
            _ => (hostport, 6379),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("the Redis URL names no host: {url:?}"));
        }
        Ok(Target {
            host: host.to_string(),
            port,
            username,
            password,
        })
    }

    /// The URL without its password, for messages.
    pub(crate) fn shown(&self) -> String {
        match &self.username {
            Some(u) => format!("redis://{u}@{}:{}", self.host, self.port),
            None => format!("redis://{}:{}", self.host, self.port),
        }
    }
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

fn decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| "a bad percent escape in the Redis URL".to_string())?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "the Redis URL's credentials are not UTF-8".to_string())
}

/// What went wrong talking to Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ClientError {
    /// Could not connect, read or write.
    Io(String),
    /// Redis answered with an error.
    Redis(String),
    /// The answer was not RESP.
    Protocol(String),
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientError::Io(e) => write!(f, "cannot reach Redis: {e}"),
            ClientError::Redis(e) => write!(f, "Redis answered: {e}"),
            ClientError::Protocol(e) => write!(f, "Redis's answer is not RESP: {e}"),
        }
    }
}

/// One connection per node; the first is the target's.
pub(crate) struct Client {
    target: Target,
    nodes: HashMap<String, TcpStream>,
    /// Where `MOVED` said each slot is.
    slots: HashMap<u16, String>,
}

impl Client {
    pub(crate) fn new(target: Target) -> Client {
        Client {
            target,
            nodes: HashMap::new(),
            slots: HashMap::new(),
        }
    }

    /// Sends one command (its words) and reads its reply, following cluster redirections.
    /// An error reply is [`ClientError::Redis`].
    pub(crate) fn call(&mut self, words: &[&[u8]]) -> Result<Reply, ClientError> {
        let slot = first_key(words).map(key_slot);
        let mut node = slot
            .and_then(|s| self.slots.get(&s).cloned())
            .unwrap_or_else(|| self.home());
        let mut asking = false;
        for _ in 0..=MAX_REDIRECTS {
            if asking {
                self.exchange(&node, &[b"ASKING"])?;
            }
            match self.exchange(&node, words)? {
                Reply::Error(e) => match redirect(&e) {
                    Some(("MOVED", slot, to)) => {
                        self.slots.insert(slot, to.to_string());
                        node = to.to_string();
                        asking = false;
                    }
                    Some((_, _, to)) => {
                        node = to.to_string();
                        asking = true;
                    }
                    None => return Err(ClientError::Redis(e)),
                },
                reply => return Ok(reply),
            }
        }
        Err(ClientError::Redis(format!(
            "more than {MAX_REDIRECTS} cluster redirections for one command"
        )))
    }

    fn home(&self) -> String {
        format!("{}:{}", self.target.host, self.target.port)
    }

    fn exchange(&mut self, node: &str, words: &[&[u8]]) -> Result<Reply, ClientError> {
        if !self.nodes.contains_key(node) {
            let stream = self.connect(node)?;
            self.nodes.insert(node.to_string(), stream);
        }
        let Some(stream) = self.nodes.get_mut(node) else {
            return Err(ClientError::Io(format!("no connection to {node}")));
        };
        let result = roundtrip(stream, words);
        if matches!(result, Err(ClientError::Io(_) | ClientError::Protocol(_))) {
            self.nodes.remove(node);
        }
        result
    }

    fn connect(&self, node: &str) -> Result<TcpStream, ClientError> {
        let addr = node
            .to_socket_addrs()
            .map_err(|e| ClientError::Io(format!("{node}: {e}")))?
            .next()
            .ok_or_else(|| ClientError::Io(format!("{node}: no address")))?;
        let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT)
            .map_err(|e| ClientError::Io(format!("{node}: {e}")))?;
        let io = |e: std::io::Error| ClientError::Io(format!("{node}: {e}"));
        stream.set_read_timeout(Some(TIMEOUT)).map_err(io)?;
        stream.set_write_timeout(Some(TIMEOUT)).map_err(io)?;
        if let Some(password) = &self.target.password {
            let mut words: Vec<&[u8]> = vec![b"AUTH"];
            if let Some(user) = &self.target.username {
                words.push(user.as_bytes());
            }
            words.push(password.as_bytes());
            if let Reply::Error(e) = roundtrip(&mut stream, &words)? {
                return Err(ClientError::Redis(format!(
                    "{e} (as {})",
                    self.target.username.as_deref().unwrap_or("default")
                )));
            }
        }
        Ok(stream)
    }
}

/// `MOVED 3999 127.0.0.1:6381` / `ASK 3999 127.0.0.1:6381`: the kind, slot and node.
fn redirect(error: &str) -> Option<(&str, u16, &str)> {
    let mut words = error.split(' ');
    let kind = words.next().filter(|k| *k == "MOVED" || *k == "ASK")?;
    let slot = words.next()?.parse().ok()?;
    let to = words.next()?;
    Some((kind, slot, to))
}

/// The first key a command names, for the commands this tool sends: `EVAL`/`EVALSHA` name
/// theirs after the key count; every other command it sends names its key first.
fn first_key<'a>(words: &[&'a [u8]]) -> Option<&'a [u8]> {
    let name = words.first()?.to_ascii_uppercase();
    match name.as_slice() {
        b"EVAL" | b"EVALSHA" => {
            let n: usize = std::str::from_utf8(words.get(2)?).ok()?.parse().ok()?;
            (n > 0).then(|| words.get(3).copied()).flatten()
        }
        b"TIME" | b"PING" | b"ASKING" | b"SCRIPT" | b"CLUSTER" | b"AUTH" => None,
        _ => words.get(1).copied(),
    }
}

/// Redis Cluster's slot of a key: CRC16 (XMODEM) of its hash tag, modulo 16384.
pub(crate) fn key_slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|b| *b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|b| *b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16(tagged) % 16384
}

fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for b in bytes {
        crc ^= u16::from(*b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// Writes one command as a RESP array of bulk strings and reads one reply.
fn roundtrip(stream: &mut TcpStream, words: &[&[u8]]) -> Result<Reply, ClientError> {
    let mut out = Vec::with_capacity(16 + words.iter().map(|w| w.len() + 16).sum::<usize>());
    out.extend_from_slice(format!("*{}\r\n", words.len()).as_bytes());
    for w in words {
        out.extend_from_slice(format!("${}\r\n", w.len()).as_bytes());
        out.extend_from_slice(w);
        out.extend_from_slice(b"\r\n");
    }
    stream
        .write_all(&out)
        .map_err(|e| ClientError::Io(e.to_string()))?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 8192];
    loop {
        let n = stream
            .read(&mut chunk)
            .map_err(|e| ClientError::Io(e.to_string()))?;
        if n == 0 {
            return Err(ClientError::Io("Redis closed the connection".into()));
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(len) = complete_len(&buf)? {
            return resp::parse(&buf[..len]).map_err(ClientError::Protocol);
        }
        if buf.len() > MAX_REPLY {
            return Err(ClientError::Protocol(format!(
                "a reply longer than {MAX_REPLY} bytes"
            )));
        }
    }
}

/// The length of the first complete reply in `buf`, or `None` when more must be read.
fn complete_len(buf: &[u8]) -> Result<Option<usize>, ClientError> {
    let mut pos = 0;
    let mut pending: u64 = 1; // replies still to read
    while pending > 0 {
        let Some(end) = buf
            .get(pos..)
            .and_then(|rest| rest.windows(2).position(|w| w == b"\r\n"))
        else {
            return Ok(None);
        };
        let line = &buf[pos..pos + end];
        pos += end + 2;
        pending -= 1;
        let number = || -> Result<i64, ClientError> {
            std::str::from_utf8(line.get(1..).unwrap_or_default())
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| ClientError::Protocol("a bad length".into()))
        };
        match line.first() {
            Some(b'+' | b'-' | b':') => {}
            Some(b'$') => {
                let len = number()?;
                if len >= 0 {
                    let len = usize::try_from(len)
                        .map_err(|_| ClientError::Protocol("a bad length".into()))?;
                    pos = pos.saturating_add(len).saturating_add(2);
                    if buf.len() < pos {
                        return Ok(None);
                    }
                }
            }
            Some(b'*') => {
                let n = number()?;
                if n > 0 {
                    pending = pending.saturating_add(n.unsigned_abs());
                }
            }
            _ => return Err(ClientError::Protocol("an unknown reply type".into())),
        }
    }
    Ok(Some(pos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_the_node_and_the_credentials() {
        let t = Target::from_url("redis://cg-admin:p%40ss@127.0.0.1:6390").unwrap();
        assert_eq!(
            (
                t.host.as_str(),
                t.port,
                t.username.as_deref(),
                t.password.as_deref()
            ),
            ("127.0.0.1", 6390, Some("cg-admin"), Some("p@ss"))
        );
        assert_eq!(t.shown(), "redis://cg-admin@127.0.0.1:6390");
        let t = Target::from_url("redis://:secret@localhost").unwrap();
        assert_eq!(
            (t.port, t.username, t.password.as_deref()),
            (6379, None, Some("secret"))
        );
        let t = Target::from_url("redis://[::1]:7000/0").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 7000));
        assert!(Target::from_url("http://x").is_err());
        assert!(Target::from_url("redis://x:port").is_err());
        assert!(Target::from_url("redis://:@").is_err());
    }

    #[test]
    fn slots_follow_the_hash_tag() {
        // Redis Cluster's own examples (CLUSTER KEYSLOT).
        assert_eq!(key_slot(b"123456789"), 12739);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_ne!(key_slot(b"foo{}{bar}"), key_slot(b"bar"));
    }

    #[test]
    fn a_reply_is_complete_only_when_all_of_it_came() {
        let whole = b"*3\r\n:1\r\n$5\r\nhello\r\n*-1\r\n";
        for cut in 0..whole.len() {
            assert_eq!(complete_len(&whole[..cut]).unwrap(), None, "cut at {cut}");
        }
        assert_eq!(complete_len(whole).unwrap(), Some(whole.len()));
        assert_eq!(complete_len(b"$-1\r\n+OK\r\n").unwrap(), Some(5));
        assert!(complete_len(b"?x\r\n").is_err());
    }

    #[test]
    fn redirections_are_read() {
        assert_eq!(
            redirect("MOVED 3999 127.0.0.1:6381"),
            Some(("MOVED", 3999, "127.0.0.1:6381"))
        );
        assert_eq!(redirect("ASK 1 h:1"), Some(("ASK", 1, "h:1")));
        assert_eq!(redirect("NOPERM no"), None);
        let eval: [&[u8]; 5] = [b"EVALSHA", b"abc", b"2", b"k1", b"k2"];
        assert_eq!(first_key(&eval), Some(&b"k1"[..]));
        assert_eq!(first_key(&[b"GET", b"k"]), Some(&b"k"[..]));
        assert_eq!(first_key(&[b"TIME"]), None);
    }
}
