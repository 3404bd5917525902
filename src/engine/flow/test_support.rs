//! What the flow's tests share: requests and Redis replies built by naming their parts, the
//! runtime of a configuration, steps read back, and background calls answered.
//!
//! A reply is built the way its script writes it (`src/redis/scripts/*.lua` and their Rust
//! contracts), so a test reads as what Redis said: `acquire().limit_ok(4, 60_000)
//! .record_new()` is "the one limit allows, 4 units left until its window ends in 60 s, and
//! the record is new, this request's", where the gateway hands the flat array
//! `[1, 1, 4, 60000, 0, 1, 100000, ""]`.

use crate::config::Config;
use crate::engine::flow::{Background, Cx, Move, Outbox, Outgoing, Runtime, Step};
use crate::http::local_reply::LocalResponse;
use crate::http::request::Request;
use crate::redis::resp::Reply;
use crate::redis::CallError;
use crate::support::metrics::testing::Recorder;

// --- requests --------------------------------------------------------------------------------

/// A request's headers in the order the host hands them, then its peer's address: built by
/// naming each part, `request("POST", "/orders").tenant("acme").idempotency_key("\"k-1\"")`.
/// The body is not part of it: the flow takes a body in events of its own.
#[derive(Debug, Clone)]
#[must_use = "a request is used by `build`"]
pub(crate) struct RequestBuilder {
    headers: Vec<(String, String)>,
    peer: Option<&'static str>,
}

/// A request of `method` to `path`, with no other header and no peer address yet.
pub(crate) fn request(method: &str, path: &str) -> RequestBuilder {
    RequestBuilder {
        headers: vec![
            (":method".to_string(), method.to_string()),
            (":path".to_string(), path.to_string()),
        ],
        peer: None,
    }
}

impl RequestBuilder {
    /// Any header, added after those before it (a name given twice is sent twice).
    pub(crate) fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Several headers, in order.
    pub(crate) fn headers(self, pairs: &[(&str, &str)]) -> Self {
        pairs.iter().fold(self, |r, (n, v)| r.header(n, v))
    }

    /// `:authority`.
    pub(crate) fn authority(self, host: &str) -> Self {
        self.header(":authority", host)
    }

    /// The tenant, in the header the tests' configurations read it from (`x-tenant-id`).
    pub(crate) fn tenant(self, tenant: &str) -> Self {
        self.header("x-tenant-id", tenant)
    }

    /// `content-type`.
    pub(crate) fn content_type(self, content_type: &str) -> Self {
        self.header("content-type", content_type)
    }

    /// `content-type: application/json`: a body the fingerprint reads in its canonical form.
    pub(crate) fn json(self) -> Self {
        self.content_type("application/json")
    }

    /// The `Idempotency-Key` header's raw value (a structured-field string keeps its quotes).
    pub(crate) fn idempotency_key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }

    /// `content-length`: the body's declared size.
    pub(crate) fn content_length(self, bytes: u64) -> Self {
        self.header("content-length", &bytes.to_string())
    }

    /// The downstream peer's address, where a `client_ip` limit reads the client from.
    pub(crate) fn peer(mut self, address: &'static str) -> Self {
        self.peer = Some(address);
        self
    }

    /// The request as the flow reads it.
    pub(crate) fn build(self) -> Request {
        Request::from_headers(self.headers, self.peer)
    }
}

/// A `POST` to `path` of tenant `acme`, with a JSON body: the shape of most requests a record
/// guards in these tests.
pub(crate) fn json_post(path: &str) -> RequestBuilder {
    request("POST", path).tenant("acme").json()
}

/// Owned header pairs (a response's headers or trailers, as the host hands them).
pub(crate) fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

// --- replies ---------------------------------------------------------------------------------

/// The record's PTTL in every acquire reply built here: the flow never reads it.
pub(crate) const RECORD_PTTL_MS: i64 = 100_000;

/// An `acquire.lua` reply (contract: `src/redis/scripts/acquire.rs`, `acquire.lua`), built in
/// the order the script writes it: each limit's verdict in the call's order, then the
/// idempotency record's section and the lease's, when the call carried them. Whether the
/// call admitted follows from the limits: every one allows, except a shadow's.
#[derive(Debug, Clone, Default)]
#[must_use = "a reply is used by `reply`"]
pub(crate) struct AcquireReply {
    /// Each limit's four values, and whether its verdict counts for admission.
    limits: Vec<([i64; 4], bool)>,
    /// The record's code, PTTL and stored value.
    record: Option<(i64, Vec<u8>)>,
    /// The lease's code and value.
    lease: Option<(i64, Reply)>,
}

/// An acquire reply with nothing in it yet (no limits: it admits).
pub(crate) fn acquire() -> AcquireReply {
    AcquireReply::default()
}

impl AcquireReply {
    /// The next limit allows: `remaining` units left (a leased quota: the slice granted; a
    /// concurrency limit: the free slots), its quota whole again in `reset_ms`.
    pub(crate) fn limit_ok(mut self, remaining: i64, reset_ms: i64) -> Self {
        self.limits.push(([1, remaining, reset_ms, 0], true));
        self
    }

    /// The next limit rejects: `remaining` units left, whole again in `reset_ms`, and a
    /// request of this cost allowed again in `retry_after_ms`. The call does not admit.
    pub(crate) fn limit_over(mut self, remaining: i64, reset_ms: i64, retry_after_ms: i64) -> Self {
        self.limits
            .push(([0, remaining, reset_ms, retry_after_ms], true));
        self
    }

    /// The next limit is a shadow that would reject (values as [`Self::limit_over`]): it is
    /// reported, and the call still admits.
    pub(crate) fn shadow_over(
        mut self,
        remaining: i64,
        reset_ms: i64,
        retry_after_ms: i64,
    ) -> Self {
        self.limits
            .push(([0, remaining, reset_ms, retry_after_ms], false));
        self
    }

    /// The record was absent: a `PROCESSING` record now exists, owned by this request.
    pub(crate) fn record_new(self) -> Self {
        self.record(1, "")
    }

    /// The same request's record is `PROCESSING`: it runs elsewhere.
    pub(crate) fn record_in_progress(self) -> Self {
        self.record(2, "")
    }

    /// The same request's record is `COMPLETED`: `record` is its stored JSON, to replay.
    pub(crate) fn record_completed(self, record: &str) -> Self {
        self.record(3, record)
    }

    /// Another request used this key (a different fingerprint).
    pub(crate) fn record_conflict(self) -> Self {
        self.record(4, "")
    }

    /// The stored value is not a record the script can read.
    pub(crate) fn record_unreadable(self) -> Self {
        self.record(5, "")
    }

    fn record(mut self, code: i64, stored: &str) -> Self {
        self.record = Some((code, stored.as_bytes().to_vec()));
        self
    }

    /// The lease was free and is now this request's, with fencing token `token` (which the
    /// script sends as a decimal string: it has more digits than webdis carries in an integer).
    pub(crate) fn lease_granted(mut self, token: u64) -> Self {
        self.lease = Some((1, Reply::Bulk(Some(token.to_string().into_bytes()))));
        self
    }

    /// Another request holds the lease, for `pttl_ms` more.
    pub(crate) fn lease_busy(mut self, pttl_ms: i64) -> Self {
        self.lease = Some((2, Reply::Int(pttl_ms)));
        self
    }

    /// The lease was not tried: the limits did not admit, or the record was not acquired.
    pub(crate) fn lease_skipped(mut self) -> Self {
        self.lease = Some((0, Reply::Int(0)));
        self
    }

    /// The reply as the gateway hands it: one flat array.
    pub(crate) fn reply(self) -> Reply {
        self.into()
    }
}

impl From<AcquireReply> for Reply {
    fn from(r: AcquireReply) -> Reply {
        let admitted = r.limits.iter().all(|(v, counts)| v[0] == 1 || !counts);
        let mut items = vec![Reply::Int(i64::from(admitted))];
        for (values, _) in &r.limits {
            items.extend(values.iter().map(|v| Reply::Int(*v)));
        }
        if let Some((code, stored)) = r.record {
            items.push(Reply::Int(code));
            items.push(Reply::Int(RECORD_PTTL_MS));
            items.push(Reply::Bulk(Some(stored)));
        }
        if let Some((code, value)) = r.lease {
            items.push(Reply::Int(code));
            items.push(value);
        }
        Reply::Array(Some(items))
    }
}

/// A settling script's `1` (`complete.lua`, `release.lua`, `lease_release.lua`,
/// `lease_extend.lua`, `slot_release.lua`): done.
pub(crate) fn settled() -> Reply {
    Reply::Int(1)
}

/// A settling script's `0`: there was nothing to settle (missing, or expired).
pub(crate) fn missing() -> Reply {
    Reply::Int(0)
}

/// A settling script's `-1`: the record or lease is another owner's now.
pub(crate) fn another_owner() -> Reply {
    Reply::Int(-1)
}

/// Redis's answer to an `EVALSHA` of a script it does not hold (after a restart or `SCRIPT
/// FLUSH`): the caller sends it again by `EVAL`.
pub(crate) fn noscript() -> Reply {
    Reply::Error("NOSCRIPT No matching script. Please use EVAL.".into())
}

/// A `batch.lua` reply: each sub-call's reply in order, in one flat array. An array reply
/// goes as its length and then its values; an integer reply as `-2` and then the integer as
/// webdis gives it, text.
pub(crate) fn batch<R: Into<Reply>>(parts: impl IntoIterator<Item = R>) -> Reply {
    let mut items = Vec::new();
    for part in parts {
        match part.into() {
            Reply::Array(Some(values)) => {
                items.push(Reply::Int(i64::try_from(values.len()).unwrap_or(-1)));
                items.extend(values);
            }
            Reply::Int(n) => {
                items.push(Reply::Int(-2));
                items.push(Reply::Bulk(Some(n.to_string().into_bytes())));
            }
            other => panic!("a batch part is an array or an integer, not {other:?}"),
        }
    }
    Reply::Array(Some(items))
}

/// An array reply of integers that follows no script's contract (a reply the filter cannot
/// read).
pub(crate) fn ints(v: &[i64]) -> Reply {
    Reply::Array(Some(v.iter().map(|n| Reply::Int(*n)).collect()))
}

// --- the runtime and steps -------------------------------------------------------------------

/// The runtime of configuration `json`, its metrics counted by `rec`.
pub(crate) fn runtime_of(rec: &Recorder, json: &str) -> Runtime {
    let config = Config::parse(json.as_bytes()).expect("valid");
    let metrics = rec.metrics(&config);
    Runtime::new(config, metrics, None)
}

/// The calls of a `Dispatch` step (any other step fails the test).
pub(crate) fn dispatched(step: Step) -> Vec<Outgoing> {
    match step.next {
        Move::Dispatch(out) => out,
        other => panic!("expected Dispatch, got {other:?}"),
    }
}

/// The local answer of a `Respond` step (any other step fails the test).
pub(crate) fn respond_with(step: Step) -> LocalResponse {
    match step.next {
        Move::Respond(r) => std::rc::Rc::unwrap_or_clone(r),
        other => panic!("expected Respond, got {other:?}"),
    }
}

/// A body the test expects the flow never to read (one it neither keeps nor scans).
pub(crate) fn never_read() -> Vec<u8> {
    panic!("a body over max_response_body must not be read")
}

/// A header of a local answer.
pub(crate) fn header<'a>(r: &'a LocalResponse, name: &str) -> Option<&'a str> {
    r.headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

// --- background calls ------------------------------------------------------------------------

/// What became of a background call's answer, as the tests read it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Settled or given up: the outbox let it go.
    Done,
    /// Kept, to be sent again at this time.
    Retry(u64),
    /// Sent again at once (by `EVAL`).
    Resend,
}

/// Hands `answer` at `now` to the one call the outbox holds.
pub(crate) fn settle(
    outbox: &mut Outbox,
    rt: &Runtime,
    slot: usize,
    answer: Result<Reply, CallError>,
    now: u64,
    rec: &Recorder,
) -> Next {
    let settled = outbox.on_answer(&Cx::new(rt, now, rec), slot, answer);
    if settled.resend.is_some() {
        Next::Resend
    } else if let Some(due) = outbox.next_due_ms() {
        Next::Retry(due)
    } else {
        Next::Done
    }
}

/// Sends `bg` alone at `now` and hands it `answer` then.
pub(crate) fn answer_once(
    rt: &Runtime,
    bg: Background,
    answer: Result<Reply, CallError>,
    now: u64,
    rec: &Recorder,
) -> Next {
    let mut outbox = Outbox::default();
    outbox.add(bg);
    let sent = outbox.take_due(now);
    assert_eq!(sent.len(), 1);
    settle(&mut outbox, rt, sent[0].slot, answer, now, rec)
}
