//! Callout coalescing: the acquire calls of several paused requests of one worker sent to
//! Redis as one `batch.lua` call, each request resumed with its own answer. The script runs
//! the sub-calls one after the other exactly as separate calls would, so every decision is the
//! same as without batching.

use crate::redis::{resp::Reply, CallError, ScriptCall};

/// The batch call for `calls`, in order.
pub fn build<'a>(calls: impl IntoIterator<Item = &'a ScriptCall>) -> ScriptCall {
    let mut keys = Vec::new();
    let mut args = vec![String::new()];
    let mut count = 0usize;
    for call in calls {
        count += 1;
        keys.extend(call.keys.iter().cloned());
        args.push(call.keys.len().to_string());
        args.push(call.args.len().to_string());
        args.extend(call.args.iter().cloned());
    }
    args[0] = count.to_string();
    ScriptCall { keys, args }
}

/// Splits a batch reply into the `n` sub-replies (an error for a sub-call that failed).
pub fn split(reply: &Reply, n: usize) -> Result<Vec<Result<Reply, CallError>>, CallError> {
    let bad = |why: &str| CallError::UnexpectedReply(format!("batch reply: {why}"));
    if let Reply::Error(e) = reply {
        return Err(CallError::Redis(e.clone()));
    }
    let items = reply.as_array().ok_or_else(|| bad("not an array"))?;
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    while out.len() < n {
        let len = items
            .get(at)
            .and_then(Reply::as_int)
            .ok_or_else(|| bad("missing length"))?;
        at += 1;
        if len < 0 {
            let text = items
                .get(at)
                .and_then(Reply::as_bytes)
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default();
            at += 1;
            out.push(Err(CallError::Redis(text)));
            continue;
        }
        let len = usize::try_from(len).map_err(|_| bad("bad length"))?;
        let part = items
            .get(at..at + len)
            .ok_or_else(|| bad("shorter than its lengths"))?;
        at += len;
        out.push(Ok(Reply::Array(Some(part.to_vec()))));
    }
    if at != items.len() {
        return Err(bad("longer than its lengths"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(keys: &[&str], args: &[&str]) -> ScriptCall {
        ScriptCall {
            keys: keys.iter().map(|s| s.to_string()).collect(),
            args: args.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn builds_the_batch() {
        let a = call(&["k1", "k2"], &["x"]);
        let b = call(&["k3"], &["y", "z"]);
        let batch = build([&a, &b]);
        assert_eq!(batch.keys, vec!["k1", "k2", "k3"]);
        assert_eq!(batch.args, vec!["2", "2", "1", "x", "1", "2", "y", "z"]);
    }

    #[test]
    fn splits_replies() {
        let r = |v: i64| Reply::Int(v);
        let reply = Reply::Array(Some(vec![
            r(2),
            r(1),
            r(0),
            r(-1),
            Reply::Bulk(Some(b"ERR boom".to_vec())),
            r(1),
            Reply::Bulk(Some(b"77".to_vec())),
        ]));
        let parts = split(&reply, 3).expect("valid");
        assert_eq!(parts[0], Ok(Reply::Array(Some(vec![r(1), r(0)]))));
        assert_eq!(parts[1], Err(CallError::Redis("ERR boom".into())));
        assert_eq!(
            parts[2],
            Ok(Reply::Array(Some(vec![Reply::Bulk(Some(b"77".to_vec()))])))
        );
        assert!(split(&reply, 4).is_err(), "too short");
        assert!(split(&reply, 2).is_err(), "too long");
        assert_eq!(
            split(&Reply::Error("NOSCRIPT x".into()), 1),
            Err(CallError::Redis("NOSCRIPT x".into()))
        );
    }
}
