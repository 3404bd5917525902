//! Redis access as data: a script call's keys and arguments as the gateway's request, and
//! what can go wrong. No I/O happens here; the adapter sends the encoded request and hands back the answer.

pub mod keys;
pub(crate) mod resp;
pub(crate) mod scripts;
pub mod tag;
pub mod webdis;
mod words;

use crate::support::metrics::{MetricSink, RedisMetrics};
use resp::Reply;
use sha1::{Digest, Sha1};
use tag::CallTag;

pub(crate) use words::Words;

/// A Lua script with its SHA-1, for EVALSHA.
#[derive(Debug)]
pub(crate) struct Script {
    /// The script's name and SHA-1, which the filter sends as encoded in `by_sha`: read by the
    /// tests and the host tools.
    #[cfg_attr(target_os = "wasi", allow(dead_code))]
    pub name: &'static str,
    pub(crate) source: &'static str,
    #[cfg_attr(target_os = "wasi", allow(dead_code))]
    pub sha1: String,
    /// `EVALSHA <sha1>` for the gateway, encoded once: every call by SHA starts with it.
    by_sha: Vec<u8>,
}

impl Script {
    pub(crate) fn new(name: &'static str, source: &'static str) -> Script {
        let sha1 = crate::support::text::hex(&Sha1::digest(source.as_bytes()));
        let by_sha = webdis::encode_words([&b"EVALSHA"[..], sha1.as_bytes()]);
        Script {
            name,
            source,
            sha1,
            by_sha,
        }
    }
}

/// One script invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScriptCall {
    pub(crate) keys: Words,
    pub(crate) args: Words,
}

impl ScriptCall {
    pub(crate) fn new(keys: impl Into<Words>, args: impl Into<Words>) -> ScriptCall {
        ScriptCall {
            keys: keys.into(),
            args: args.into(),
        }
    }

    /// The gateway request body for this call, sent with `tag`: `EVALSHA <sha> n keys...
    /// tag args...` (the tag is the script's `ARGV[1]`, see [`tag`]), or `EVAL <source> ...`
    /// after a `NOSCRIPT` answer.
    pub(crate) fn encode(&self, script: &Script, by_sha: bool, tag: &CallTag) -> Vec<u8> {
        let mut digits = [0u8; 20];
        let numkeys = crate::support::text::decimal(self.keys.len() as u64, &mut digits);
        let rest = || {
            [numkeys]
                .into_iter()
                .chain(self.keys.iter_bytes())
                .chain([tag.as_bytes()])
                .chain(self.args.iter_bytes())
        };
        if by_sha {
            webdis::encode_after(&script.by_sha, rest())
        } else {
            let verb = [&b"EVAL"[..], script.source.as_bytes()];
            webdis::encode_after(&[], verb.into_iter().chain(rest()))
        }
    }
}

/// Why a Redis call produced no usable answer. Every variant is handled by the policy's
/// failure mode; none is retried within the request except `NOSCRIPT` (see [`is_noscript`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// The call never reached the gateway: the host refused to dispatch it, or the
    /// connection to the gateway could not be made (Envoy's own answer says so).
    NotSent,
    /// The gateway connection failed with an unknown outcome (reset after the request may
    /// have been sent, or no answer at all).
    Transport,
    /// The gateway itself answered with a non-200 status (503: Redis down; 403:
    /// ACL/credentials).
    Gateway(u32),
    /// The gateway's body was not a Redis reply.
    Malformed(String),
    /// Redis answered with an error (script error, OOM, ...).
    Redis(String),
    /// The reply was a valid Redis reply but not what the script returns.
    UnexpectedReply(String),
    /// No answer within the configured timeout (watchdog).
    Timeout,
    /// The host refused to dispatch: `redis.cluster` names no cluster of this proxy.
    NoSuchCluster,
    /// The answer came, but this worker's memory budget cannot hold it now (a stored response
    /// to replay, say): it was not read. Redis ran the call.
    OverBudget,
    /// The answer is a reply, but not this call's: it does not carry the call's tag (the
    /// gateway handed over the reply of a command another, closed, connection sent; see
    /// [`tag`]). The call's own outcome is unknown, as after a timeout.
    Foreign,
}

impl CallError {
    /// A short description for logs; never contains keys or request data.
    pub(crate) fn describe(&self) -> String {
        match self {
            CallError::NotSent => "gateway unreachable".into(),
            CallError::Transport => "gateway connection lost".into(),
            CallError::Gateway(status) => format!("gateway answered HTTP {status}"),
            CallError::Malformed(why) => format!(
                "the gateway's answer is not a Redis reply (RESP): {why}; check that \
                 redis.cluster is the webdis gateway (not Redis itself or another service)"
            ),
            CallError::Redis(e) => {
                let e: String = e.chars().take(120).collect();
                match RedisErrorKind::of(&e) {
                    RedisErrorKind::Authentication => format!(
                        "the gateway could not authenticate to Redis: {e}; check the gateway's \
                         Redis credential (webdis: redis_auth) against Redis's password or ACL user"
                    ),
                    RedisErrorKind::Permission => format!(
                        "Redis refused the gateway's user: {e}; check the gateway's Redis ACL \
                         user: it needs the keys under redis.key_prefix and the scripts' commands"
                    ),
                    RedisErrorKind::Protocol => format!(
                        "Redis could not read the gateway's command (a protocol error): {e}; \
                         check that the gateway speaks to Redis (webdis: redis_host, redis_port)"
                    ),
                    RedisErrorKind::Other => format!("redis error: {e}"),
                }
            }
            CallError::UnexpectedReply(why) => format!("unexpected reply: {why}"),
            CallError::Timeout => "no answer within the timeout".into(),
            CallError::NoSuchCluster => {
                "redis.cluster is not a cluster of this proxy (check its spelling)".into()
            }
            CallError::OverBudget => {
                "its answer is larger than this worker's memory budget can hold now \
                 (memory_budget)"
                    .into()
            }
            CallError::Foreign => "the gateway answered with another call's reply (it does not \
                                   carry this call's tag): this call's outcome is unknown"
                .into(),
        }
    }

    /// The cause as the client's `503` says it: which part failed, without configuration
    /// values or Redis data.
    pub(crate) fn client_detail(&self, timeout_ms: u64) -> String {
        let cause = match self {
            CallError::NoSuchCluster => "the proxy has no route to it (its gateway cluster is \
                                         not configured)"
                .to_string(),
            CallError::NotSent | CallError::Transport => "its gateway is unreachable".into(),
            CallError::Gateway(401 | 403) => "its gateway refused the proxy's credentials".into(),
            CallError::Gateway(503) => "Redis is unavailable behind its gateway".into(),
            CallError::Gateway(status) => format!("its gateway answered HTTP {status}"),
            CallError::Redis(e) => match RedisErrorKind::of(e) {
                RedisErrorKind::Permission => {
                    "Redis refused the command (its ACL does not allow the proxy's keys)".into()
                }
                RedisErrorKind::Authentication => {
                    "its gateway could not authenticate to Redis".into()
                }
                RedisErrorKind::Protocol | RedisErrorKind::Other => {
                    "Redis answered with an error".into()
                }
            },
            CallError::Malformed(_) | CallError::UnexpectedReply(_) => {
                "Redis answered with an error".into()
            }
            CallError::OverBudget => "this proxy cannot hold its answer now".into(),
            CallError::Foreign => "its gateway answered with another call's reply".into(),
            CallError::Timeout => {
                let mut t = String::from("it did not answer within ");
                crate::support::text::push_u64(&mut t, timeout_ms);
                t.push_str(" ms");
                t
            }
        };
        format!("the coordination store cannot decide: {cause}; retry shortly")
    }
}

/// What a Redis error reply says went wrong, by its code (its first word).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RedisErrorKind {
    /// `NOAUTH`, `WRONGPASS`: the gateway's connection is not authenticated.
    Authentication,
    /// `NOPERM`: the gateway's ACL user may not run the command or touch the keys.
    Permission,
    /// `ERR Protocol error: ...`: Redis could not read what the gateway sent.
    Protocol,
    Other,
}

impl RedisErrorKind {
    fn of(error: &str) -> RedisErrorKind {
        let code = error.split(' ').next().unwrap_or_default();
        let rest = error.get(code.len()..).unwrap_or_default().trim_start();
        match code {
            "NOAUTH" | "WRONGPASS" => RedisErrorKind::Authentication,
            "NOPERM" => RedisErrorKind::Permission,
            // Redis reads only short commands from a connection that has not authenticated:
            // a longer one (a script's source) gets `ERR Protocol error: unauthenticated
            // multibulk length` (or `bulk length`) instead of `NOAUTH`, and the connection
            // is closed.
            _ if rest.starts_with("Protocol error") && rest.contains("unauthenticated") => {
                RedisErrorKind::Authentication
            }
            _ if rest.starts_with("Protocol error") => RedisErrorKind::Protocol,
            _ => RedisErrorKind::Other,
        }
    }
}

impl CallError {
    /// Whether the command may have run in Redis. `false` only when it provably did not: it
    /// was never sent, or the gateway refused it without passing it on (webdis answers 4xx
    /// for a request it will not run and 503 when it has no Redis connection). A call that
    /// may have run may have written something: only then is compensation worth a call.
    pub(crate) fn may_have_run(&self) -> bool {
        match self {
            CallError::NotSent | CallError::NoSuchCluster => false,
            CallError::Gateway(status) => !((400..500).contains(status) || *status == 503),
            CallError::Transport
            | CallError::Malformed(_)
            | CallError::Redis(_)
            | CallError::UnexpectedReply(_)
            | CallError::Timeout
            | CallError::Foreign
            | CallError::OverBudget => true,
        }
    }

    /// Whether sending the same call again may get an answer: not when Redis itself answered
    /// (a script error or a reply we cannot read would be the same again). Another call's
    /// reply says nothing of this one's: as after a timeout, its own may come the next time.
    pub(crate) fn retryable(&self) -> bool {
        matches!(
            self,
            CallError::NotSent
                | CallError::Transport
                | CallError::Gateway(_)
                | CallError::Timeout
                | CallError::Foreign
        )
    }
}

/// True when Redis does not know the script yet (first call after a restart or `SCRIPT FLUSH`).
pub(crate) fn is_noscript(reply: &Reply) -> bool {
    matches!(reply, Reply::Error(e) if e.starts_with("NOSCRIPT"))
}

/// The one `NOSCRIPT` -> `EVAL` retry of every call: true (and counted) when `answer` says
/// Redis does not know the script and the call went by `EVALSHA`; `by_sha` is then cleared,
/// so the call is sent again once, with the script's source.
pub(crate) fn resend_by_eval(
    by_sha: &mut bool,
    answer: &Result<Reply, CallError>,
    metrics: &RedisMetrics,
    m: &dyn MetricSink,
) -> bool {
    let retry = *by_sha && matches!(answer, Ok(reply) if is_noscript(reply));
    if retry {
        m.increment(metrics.noscript);
        *by_sha = false;
    }
    retry
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn the_clients_503_names_the_cause() {
        for (err, cause) in [
            (CallError::NoSuchCluster, "the proxy has no route to it"),
            (CallError::NotSent, "its gateway is unreachable"),
            (
                CallError::Gateway(403),
                "its gateway refused the proxy's credentials",
            ),
            (
                CallError::Gateway(503),
                "Redis is unavailable behind its gateway",
            ),
            (
                CallError::Redis("NOPERM this user has no permissions".into()),
                "its ACL does not allow the proxy's keys",
            ),
            (CallError::Timeout, "it did not answer within 50 ms"),
            (
                CallError::Foreign,
                "its gateway answered with another call's reply",
            ),
        ] {
            let detail = err.client_detail(50);
            assert!(detail.contains(cause), "{err:?}: {detail}");
            assert!(detail.starts_with("the coordination store cannot decide: "));
        }
        assert!(!CallError::NoSuchCluster.may_have_run());
        assert!(!CallError::NoSuchCluster.retryable());
    }

    #[test]
    fn the_log_says_what_redis_refused_and_what_to_check() {
        for (err, says, check) in [
            (
                CallError::Redis("NOAUTH Authentication required.".into()),
                "the gateway could not authenticate to Redis: NOAUTH Authentication required.;",
                "check the gateway's Redis credential (webdis: redis_auth)",
            ),
            (
                CallError::Redis(
                    "WRONGPASS invalid username-password pair or user is disabled.".into(),
                ),
                "the gateway could not authenticate to Redis: WRONGPASS invalid username-password pair",
                "check the gateway's Redis credential",
            ),
            (
                CallError::Redis("ERR Protocol error: unauthenticated multibulk length".into()),
                "the gateway could not authenticate to Redis: ERR Protocol error: unauthenticated multibulk length;",
                "check the gateway's Redis credential",
            ),
            (
                CallError::Redis(
                    "NOPERM User default has no permissions to access the 'app:x' key".into(),
                ),
                "Redis refused the gateway's user: NOPERM User default has no permissions",
                "check the gateway's Redis ACL user",
            ),
            (
                CallError::Redis("ERR Protocol error: invalid multibulk length".into()),
                "Redis could not read the gateway's command (a protocol error): ERR Protocol error: invalid multibulk length;",
                "check that the gateway speaks to Redis",
            ),
            (
                CallError::Malformed("reply line without CRLF".into()),
                "the gateway's answer is not a Redis reply (RESP): reply line without CRLF;",
                "check that redis.cluster is the webdis gateway",
            ),
            (
                CallError::Redis("ERR user_script:1: boom".into()),
                "redis error: ERR user_script:1: boom",
                "",
            ),
            (CallError::Redis("OOM command not allowed".into()), "redis error: OOM", ""),
        ] {
            let text = err.describe();
            assert!(text.starts_with(says), "{err:?}: {text}");
            assert!(text.contains(check), "{err:?}: {text}");
        }
        // Only the error's code tells: a word inside a message does not.
        let other = CallError::Redis("ERR not NOAUTH and no Protocol error".into()).describe();
        assert!(other.starts_with("redis error: "), "{other}");
        // A long error is cut, whatever its kind.
        let long = CallError::Redis(format!("NOAUTH {}", "x".repeat(500))).describe();
        assert!(long.len() < 400, "{long}");
        assert_eq!(
            CallError::Redis("NOAUTH Authentication required.".into()).client_detail(50),
            "the coordination store cannot decide: its gateway could not authenticate to Redis; \
             retry shortly"
        );
    }

    #[test]
    fn evalsha_then_eval() {
        let script = Script::new("t", "return 1");
        assert_eq!(script.sha1, "e0e1f9fabfc9d4800c877a703b823ac0578ff8db");
        let call = ScriptCall::new(["k"], ["a"]);
        let tag = tag::CallTags::with_prefix(0xab).next();
        assert_eq!(
            String::from_utf8(call.encode(&script, true, &tag)).expect("ascii"),
            "EVALSHA/e0e1f9fabfc9d4800c877a703b823ac0578ff8db/1/k/000000ab00000000/a.raw"
        );
        assert_eq!(
            String::from_utf8(call.encode(&script, false, &tag)).expect("ascii"),
            "EVAL/return%201/1/k/000000ab00000000/a.raw"
        );
        assert!(is_noscript(&Reply::Error(
            "NOSCRIPT No matching script. Please use EVAL.".into()
        )));
        assert!(!is_noscript(&Reply::Error("ERR x".into())));
    }

    #[test]
    fn which_failures_may_have_run() {
        for (e, ran) in [
            (CallError::NotSent, false),
            (CallError::Gateway(503), false),
            (CallError::Gateway(403), false),
            (CallError::Gateway(401), false),
            (CallError::Gateway(502), true),
            (CallError::Gateway(500), true),
            (CallError::Transport, true),
            (CallError::Timeout, true),
            (CallError::Redis("OOM".into()), true),
            (CallError::Malformed("x".into()), true),
            (CallError::UnexpectedReply("x".into()), true),
            (CallError::Foreign, true),
        ] {
            assert_eq!(e.may_have_run(), ran, "{e:?}");
        }
        assert!(CallError::Timeout.retryable() && CallError::Gateway(503).retryable());
        assert!(!CallError::Redis("ERR".into()).retryable());
    }
}
