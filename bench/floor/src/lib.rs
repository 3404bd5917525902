//! The anchors `make bench` measures next to coordination-guard, each the least a filter of its
//! kind can do, so the report can say what bounds the filter's cost on this machine:
//!
//! - `wasm_floor` (plugin configuration without `callout`): per request it reads `:path` and
//!   bumps the counter `floor.requests`, nothing else. Its cost over plain Envoy is what every
//!   proxy-wasm filter pays on this Envoy (a context per stream, the V8 boundary per callback).
//! - `wasm_naive` (`{"callout": {...}}`): the same, plus one gateway callout per request that
//!   the request waits for (an `EVAL` of a one-line `INCR` through webdis), then
//!   `floor.callouts` counts the 200 answers. The naive design the issue quotes: what one
//!   callout per request costs, whatever the script does. A request with a body waits with
//!   its body (`wasm_naive_post`, `wasm_naive_routed`: the idempotency scenarios' POSTs).
//!
//! - `wasm_floor_429` (`{"local_reply": {...}}`): the same, but every request is answered by
//!   the filter with the given local reply (status, headers, body): the least a filter that
//!   rejects locally pays, the anchor of the over-limit cache's rejected path.
//!
//! - `wasm_pause` (`{"pause": true}`): the same as `wasm_floor`, but every request is paused
//!   and resumed from the root context on its next turn (a shared-queue wake-up, no callout):
//!   what pausing a request and resuming it from the root costs, apart from any callout.
//! - `wasm_naive_batched` (`{"callout": {...}, "batch": true}`): the naive callout, but sent
//!   by the root once per turn for every request that arrived since (woken through a shared
//!   queue, as coordination-guard's `redis.batch` is), and its answer resumes them all: the
//!   anchor of the batched path, the least one callout per N requests costs.
//!
//! - `wasm_floor_reads` (`{"reads": N}`): the floor plus N more reads of `:path` per request:
//!   what one host call that returns data costs (the host calls back into the VM to allocate
//!   what it returns).
//!
//! - `"limit": {"tenant_header", "limit", "window_s"}` adds to any mode the least a limit per
//!   tenant with the IETF headers does beyond it: the tenant is found in the whole request
//!   header map (one host call), and
//!   - with a callout, the callout's body names the tenant (`{tenant}`, percent-encoded, in
//!     its key), its answer's body is read for the count and the window's time left, and the
//!     response carries `RateLimit-Policy` and `RateLimit` (`wasm_naive_rl`); with
//!     `"acquire_reply": true` the answer is read as `acquire.lua`'s for one limit (remaining
//!     and reset) as the call's tag wraps it (the tag, the reply's length, the reply), for a
//!     callout sending coordination-guard's own call (`wasm_naive_script`);
//!   - with a local reply, a table of this worker keeps each tenant's window, the clock is
//!     read, and the 429's `Retry-After`, `RateLimit` and body say the time left
//!     (`wasm_floor_429_keyed`);
//!   - else the table counts the tenant's requests, the clock is read, and the response
//!     carries the two headers (`wasm_floor_rl`);
//!   - with a callout, `batch` and `batch_call`, the root's one callout per turn names every
//!     waiting request's tenant in its keys (`EVAL` of a loop running the two commands per
//!     key: `wasm_naive_batched_rl`; or `batch.lua` with an `acquire.lua` sub-call per key,
//!     coordination-guard's own batched call: `wasm_naive_batched_script`), its answer is
//!     split into each request's count and time left, and each response carries the two
//!     headers.
//!
//!   No hashing of the tenant, no metrics beyond the floor's, no fail mode: a ceiling for a
//!   filter that must do at least this, not a rival design.
//!
//! - `"code": n` adds to a limit per tenant `n` distinct functions run with each request's
//!   headers, the same ones every request (of 512 that build.rs writes, each 24 arithmetic
//!   steps on a `u64`, about 160 bytes of Wasm): what the code a filter runs costs in Envoy,
//!   beyond the instructions it executes (`wasm_naive_code*`, on `wasm_naive_script`).
//!   With `"sparse": true` they are build.rs's sparse functions instead: the same kind of
//!   steps, each third one followed by a branch that never runs, about as many bytes as the
//!   steps beside them (`wasm_naive_sparse*`): what code that never runs costs in the lines
//!   of code that does.
//!
//! It ignores every host error and never panics.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType, MetricType};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

mod footprint {
    include!(concat!(env!("OUT_DIR"), "/footprint.rs"));
}

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Floor::default()) });
}}

/// Where the naive mode's callout goes.
#[derive(serde::Deserialize)]
struct Callout {
    cluster: String,
    authority: String,
    authorization: String,
    /// The webdis command, e.g. `EVAL/return%20redis.call('INCR',KEYS[1])/1/naive.raw`.
    body: String,
}

/// The local reply mode's answer.
#[derive(serde::Deserialize)]
struct LocalReply {
    status: u32,
    headers: Vec<(String, String)>,
    body: String,
}

/// A limit per tenant (see the module's doc).
#[derive(serde::Deserialize)]
struct Limit {
    tenant_header: String,
    limit: u64,
    window_s: u64,
    /// The callout's answer is `acquire.lua`'s for one limit (`:admitted :allowed :remaining
    /// :reset_ms :retry_after_ms`) after the call's tag and its length 5, as
    /// coordination-guard's scripts reply (`*7`, a batch: the tag, the batch's length, then
    /// its sub-replies), not the naive script's `*2 :count :ttl_ms`.
    #[serde(default)]
    acquire_reply: bool,
}

impl Limit {
    /// What the naive script's count and time left (ms; negative: none) tell a request: the
    /// remaining units and the ms to the window's end.
    fn told(&self, count: u64, ttl_ms: i64) -> (u64, u64) {
        (
            self.limit.saturating_sub(count),
            u64::try_from(ttl_ms).unwrap_or(0),
        )
    }
}

/// The root's batched callout per tenant (see the module's doc): its body is `head`, the number
/// of requests, each request's `key`, then its `tag` (if any), (with `count_arg`) that number
/// again and each request's `args`, `/`-separated, then `.raw`.
#[derive(serde::Deserialize)]
struct BatchCall {
    /// The command and its script, e.g. `EVAL/<script>` or `EVALSHA/<sha>`, path-encoded.
    head: String,
    /// A request's key, `{tenant}` standing for its tenant.
    key: String,
    /// A request's arguments after the keys, `/`-separated (none if empty).
    #[serde(default)]
    args: String,
    /// The first argument is the number of requests (`batch.lua`'s count).
    #[serde(default)]
    count_arg: bool,
    /// The call's tag, an argument before every other (coordination-guard's calls carry one,
    /// and their replies carry it back first, the reply's length after it).
    #[serde(default)]
    tag: Option<String>,
}

#[derive(serde::Deserialize, Default)]
struct Settings {
    limit: Option<Limit>,
    callout: Option<Callout>,
    batch_call: Option<BatchCall>,
    local_reply: Option<LocalReply>,
    #[serde(default)]
    pause: bool,
    #[serde(default)]
    batch: bool,
    #[serde(default)]
    reads: u32,
    #[serde(default)]
    code: usize,
    #[serde(default)]
    sparse: bool,
}

/// The requests waiting for the root (pause and batch modes), and the batches in flight.
#[derive(Default)]
struct Waiting {
    /// Paused streams not yet handed to the root's turn, each with its tenant, percent-encoded
    /// (empty without a batched call per tenant).
    queued: Vec<(u32, String)>,
    /// The wake-up is enqueued and the root has not run yet.
    woken: bool,
    /// A batch callout's token -> the streams it answers.
    batches: Vec<(u32, Vec<u32>)>,
    /// What a batched call per tenant told each stream, until its response headers: remaining,
    /// seconds to the window's end.
    told: HashMap<u32, (u64, u64)>,
}

/// The counters' metric ids (None if the host refused one) and the callout, shared by the root
/// and every request.
#[derive(Default, Clone)]
struct Floor {
    requests: Option<u32>,
    callouts: Option<u32>,
    /// Callouts sent (one per request, or one per batch).
    calls: Option<u32>,
    callout: Option<Rc<Callout>>,
    batch_call: Option<Rc<BatchCall>>,
    local_reply: Option<Rc<LocalReply>>,
    pause: bool,
    batch: bool,
    /// Extra `:path` reads per request.
    reads: u32,
    /// Distinct functions run per request (with a limit).
    code: usize,
    /// Whether those are the sparse ones (code touched beside them that never runs).
    sparse: bool,
    /// This worker's wake-up queue (pause and batch modes).
    queue: Option<u32>,
    waiting: Rc<RefCell<Waiting>>,
    /// The stream's own context id (HTTP contexts only).
    id: u32,
    limit: Option<Rc<Limit>>,
    /// This worker's windows per tenant (limit without a callout): requests counted, and the
    /// window's end in ms since the epoch.
    table: Rc<RefCell<HashMap<String, (u64, u64)>>>,
    /// The stream's `RateLimit` values: remaining, seconds to the window's end.
    told: Option<(u64, u64)>,
    /// The stream waits for its own callout's answer.
    held: bool,
}

impl Floor {
    /// Hands this stream (and its tenant, for a batched call per tenant) to the root's next
    /// turn, waking it once per turn.
    fn queue_for_root(&self, tenant: String) -> Action {
        let Some(q) = self.queue else {
            return Action::Continue;
        };
        let mut w = self.waiting.borrow_mut();
        w.queued.push((self.id, tenant));
        if !w.woken {
            w.woken = true;
            let _ = hostcalls::enqueue_shared_queue(q, Some(b"1"));
        }
        Action::Pause
    }

    /// Sends the naive callout (counted); its token.
    fn send_callout(&self, c: &Callout, body: &[u8]) -> Option<u32> {
        if let Some(id) = self.calls {
            let _ = hostcalls::increment_metric(id, 1);
        }
        let headers = vec![
            (":method", "POST"),
            (":path", "/"),
            (":authority", c.authority.as_str()),
            ("authorization", c.authorization.as_str()),
            ("content-type", "text/plain"),
        ];
        hostcalls::dispatch_http_call(
            &c.cluster,
            headers,
            Some(body),
            vec![],
            Duration::from_secs(1),
        )
        .ok()
    }

    fn resume(streams: &[u32]) {
        for &s in streams {
            if hostcalls::set_effective_context(s).is_ok() {
                let _ = hostcalls::resume_http_request();
            }
        }
    }
}

impl Context for Floor {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body: usize, _tr: usize) {
        let status = hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status");
        let ok = matches!(status, Ok(Some(s)) if s == "200");
        let batch = {
            let mut w = self.waiting.borrow_mut();
            let at = w.batches.iter().position(|(t, _)| *t == token);
            at.map(|i| w.batches.swap_remove(i).1)
        };
        match batch {
            Some(streams) => {
                let ok = ok && self.tell_batch(&streams, body);
                if let (true, Some(id)) = (ok, self.callouts) {
                    let _ = hostcalls::increment_metric(id, streams.len() as i64);
                }
                Floor::resume(&streams);
            }
            None => {
                let ok = ok && self.tell_one(body);
                if let (true, Some(id)) = (ok, self.callouts) {
                    let _ = hostcalls::increment_metric(id, 1);
                }
                self.held = false;
                let _ = hostcalls::resume_http_request();
            }
        }
    }
}

impl RootContext for Floor {
    fn on_configure(&mut self, size: usize) -> bool {
        if self.requests.is_none() {
            self.requests = hostcalls::define_metric(MetricType::Counter, "floor.requests").ok();
            self.callouts = hostcalls::define_metric(MetricType::Counter, "floor.callouts").ok();
            self.calls = hostcalls::define_metric(MetricType::Counter, "floor.calls").ok();
        }
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size);
        let settings: Settings = match bytes {
            Ok(Some(b)) => serde_json::from_slice(&b).unwrap_or_default(),
            _ => Settings::default(),
        };
        self.callout = settings.callout.map(Rc::new);
        self.batch_call = settings.batch_call.map(Rc::new);
        self.local_reply = settings.local_reply.map(Rc::new);
        self.pause = settings.pause;
        self.batch = settings.batch;
        self.reads = settings.reads;
        self.code = settings.code.min(footprint::CODE.len());
        self.sparse = settings.sparse;
        self.limit = settings.limit.map(Rc::new);
        if (self.pause || self.batch) && self.queue.is_none() {
            // A queue of this worker's own: the host keys queues by VM and name, and every
            // worker runs the same VM, so the name must differ per worker.
            let mut seed = [0u8; 8];
            let _ = getrandom(&mut seed);
            let name = format!("floor.wake.{:016x}", u64::from_le_bytes(seed));
            self.queue = hostcalls::register_shared_queue(&name).ok();
        }
        true
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        let streams = {
            let mut w = self.waiting.borrow_mut();
            w.woken = false;
            std::mem::take(&mut w.queued)
        };
        if streams.is_empty() {
            return;
        }
        let ids: Vec<u32> = streams.iter().map(|(s, _)| *s).collect();
        let Some(c) = self.callout.clone().filter(|_| self.batch) else {
            return Floor::resume(&ids);
        };
        let sent = match &self.batch_call {
            Some(call) => self.send_callout(&c, batch_body(call, &streams).as_bytes()),
            None => self.send_callout(&c, c.body.as_bytes()),
        };
        match sent {
            Some(token) => self.waiting.borrow_mut().batches.push((token, ids)),
            None => Floor::resume(&ids),
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let mut f = self.clone();
        f.id = context_id;
        Some(Box::new(f))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

impl HttpContext for Floor {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let Some(limit) = self.limit.clone() {
            return self.limited(&limit);
        }
        // The SDK's get_http_request_header unwraps; the hostcall does not.
        let _ = hostcalls::get_map_value(MapType::HttpRequestHeaders, ":path");
        for _ in 0..self.reads {
            let _ = hostcalls::get_map_value(MapType::HttpRequestHeaders, ":path");
        }
        if let Some(id) = self.requests {
            let _ = hostcalls::increment_metric(id, 1);
        }
        if let Some(r) = &self.local_reply {
            let headers = r
                .headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_str()))
                .collect();
            let _ = hostcalls::send_http_response(r.status, headers, Some(r.body.as_bytes()));
            return Action::Pause;
        }
        if self.pause || self.batch {
            return self.queue_for_root(String::new());
        }
        let Some(c) = &self.callout else {
            return Action::Continue;
        };
        let sent = self.send_callout(c, c.body.as_bytes());
        self.hold(sent)
    }

    /// A request with a body: while the request waits, its body waits too (a body callback
    /// that continued would let Envoy pass the request on before the answer).
    fn on_http_request_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        let queued = {
            let w = self.waiting.borrow();
            w.queued.iter().any(|(s, _)| *s == self.id)
                || w.batches.iter().any(|(_, s)| s.contains(&self.id))
        };
        if self.held || queued {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.batch && self.told.is_none() {
            self.told = self.waiting.borrow_mut().told.remove(&self.id);
        }
        if let (Some(limit), Some((remaining, reset))) = (&self.limit, self.told) {
            let policy = format!("\"tenant\";q={};w={}", limit.limit, limit.window_s);
            let state = format!("\"tenant\";r={remaining};t={reset}");
            let _ =
                hostcalls::add_map_value(MapType::HttpResponseHeaders, "ratelimit-policy", &policy);
            let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, "ratelimit", &state);
        }
        Action::Continue
    }
}

impl Floor {
    /// Reads a per-request callout's answer (with a limit: the count and time left it tells
    /// the stream); whether it said what it should.
    fn tell_one(&mut self, body: usize) -> bool {
        let Some(limit) = &self.limit else {
            return true;
        };
        let answer = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body);
        let counted = match answer {
            Ok(Some(b)) if limit.acquire_reply => remaining_and_reset(&b),
            Ok(Some(b)) => count_and_ttl(&b).map(|(count, ttl)| limit.told(count, ttl)),
            _ => None,
        };
        self.told = counted.map(|(remaining, ttl_ms)| (remaining, ttl_ms.div_ceil(1000)));
        counted.is_some()
    }

    /// Reads a batched call per tenant's answer into what it tells each of `streams`, in
    /// order; whether it answered every one (a batch without a limit reads nothing).
    fn tell_batch(&self, streams: &[u32], body: usize) -> bool {
        let (Some(limit), Some(_)) = (&self.limit, &self.batch_call) else {
            return true;
        };
        let answer = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body);
        let Some(values) = answer.ok().flatten().and_then(|b| resp_integers_any(&b)) else {
            return false;
        };
        // A tagged reply: the tag, the batch's length, then the batch's reply.
        let tagged = self.batch_call.as_ref().is_some_and(|c| c.tag.is_some());
        let values = if tagged {
            match values.get(1).and_then(|&n| usize::try_from(n).ok()) {
                Some(n) if n + 2 == values.len() => &values[2..],
                _ => return false,
            }
        } else {
            &values[..]
        };
        let mut told = Vec::with_capacity(streams.len());
        let mut at = 0usize;
        while at < values.len() {
            // batch.lua's sub-replies: each acquire.lua's, after its length.
            let one = if limit.acquire_reply {
                let len = values.get(at).and_then(|&n| usize::try_from(n).ok());
                let reply = len.and_then(|n| values.get(at + 1..at + 1 + n));
                at = len.map_or(values.len(), |n| at.saturating_add(n).saturating_add(1));
                reply.and_then(acquire_told)
            } else {
                let got = values.get(at).zip(values.get(at + 1));
                at += 2;
                got.and_then(|(&n, &t)| Some(limit.told(u64::try_from(n).ok()?, t)))
            };
            let Some((remaining, ttl_ms)) = one else {
                return false;
            };
            told.push((remaining, ttl_ms.div_ceil(1000)));
        }
        if told.len() != streams.len() {
            return false;
        }
        let mut w = self.waiting.borrow_mut();
        w.told.extend(streams.iter().copied().zip(told));
        true
    }

    /// Pauses the request until the answer to `sent`'s callout, if it went out.
    fn hold(&mut self, sent: Option<u32>) -> Action {
        self.held = sent.is_some();
        if self.held {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    /// The request with a limit per tenant (see the module's doc).
    fn limited(&mut self, limit: &Limit) -> Action {
        let map = header_map_bytes();
        let tenant = header_value(&map, limit.tenant_header.as_bytes()).unwrap_or_default();
        run_code(self.code, self.sparse, tenant.len() as u64);
        if let Some(id) = self.requests {
            let _ = hostcalls::increment_metric(id, 1);
        }
        if self.batch_call.is_some() && self.batch {
            return self.queue_for_root(percent_encode(tenant));
        }
        if let Some(c) = self.callout.clone() {
            let body = c.body.replace("{tenant}", &percent_encode(tenant));
            let sent = self.send_callout(&c, body.as_bytes());
            return self.hold(sent);
        }
        let now = now_ms();
        let window_ms = limit.window_s.saturating_mul(1000);
        let (count, end) = {
            let mut table = self.table.borrow_mut();
            if !table.contains_key(tenant) {
                table.insert(tenant.to_string(), (0, 0));
            }
            let Some(entry) = table.get_mut(tenant) else {
                return Action::Continue;
            };
            if entry.1 <= now {
                *entry = (0, now.saturating_add(window_ms));
            }
            entry.0 = entry.0.saturating_add(1);
            *entry
        };
        let reset = end.saturating_sub(now).div_ceil(1000);
        let Some(r) = &self.local_reply else {
            self.told = Some((limit.limit.saturating_sub(count), reset));
            return Action::Continue;
        };
        let retry = reset.to_string();
        let policy = format!("\"tenant\";q={};w={}", limit.limit, limit.window_s);
        let state = format!("\"tenant\";r=0;t={reset}");
        let body = r.body.replace("{reset}", &retry);
        let headers = vec![
            ("content-type", "application/problem+json"),
            ("retry-after", retry.as_str()),
            ("ratelimit-policy", policy.as_str()),
            ("ratelimit", state.as_str()),
        ];
        let _ = hostcalls::send_http_response(r.status, headers, Some(body.as_bytes()));
        Action::Pause
    }
}

/// Runs the first `n` of the footprint functions, each on what the one before returned.
fn run_code(n: usize, sparse: bool, seed: u64) {
    let mut x = seed;
    let code = if sparse {
        &footprint::SPARSE
    } else {
        &footprint::CODE
    };
    for f in code.iter().take(n) {
        x = f(std::hint::black_box(x));
    }
    std::hint::black_box(x);
}

/// The effective stream's request header map, in the host's encoding.
fn header_map_bytes() -> Vec<u8> {
    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_get_header_map_pairs(map: MapType, data: *mut *mut u8, size: *mut usize) -> u32;
    }
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the host hands over `size` bytes it allocated through the SDK's
    // `proxy_on_memory_allocate` (a boxed slice of exactly that size), owned from here on.
    unsafe {
        if proxy_get_header_map_pairs(MapType::HttpRequestHeaders, &mut data, &mut size) != 0
            || data.is_null()
        {
            return Vec::new();
        }
        Vec::from_raw_parts(data, size, size)
    }
}

/// The first value of header `name` in a map in the host's encoding (a count, a length pair
/// per header, then each name and value NUL-terminated), if it is text.
fn header_value<'m>(map: &'m [u8], name: &[u8]) -> Option<&'m str> {
    let word = |at: usize| -> Option<usize> {
        let b = map.get(at..at.checked_add(4)?)?;
        Some(u32::from_le_bytes(b.try_into().ok()?) as usize)
    };
    let count = word(0)?;
    let mut text = 4usize.checked_add(count.checked_mul(8)?)?;
    for i in 0..count {
        let n = word(4 + 8 * i)?;
        let v = word(8 + 8 * i)?;
        let value_at = text.checked_add(n)?.checked_add(1)?;
        if map.get(text..text + n)? == name {
            return std::str::from_utf8(map.get(value_at..value_at.checked_add(v)?)?).ok();
        }
        text = value_at.checked_add(v)?.checked_add(1)?;
    }
    None
}

/// `text` with every byte but ASCII letters, digits and `-` percent-encoded (a webdis
/// argument).
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The remaining units and the ms to the window's end of `acquire.lua`'s answer for one
/// limit as the call's tag wraps it (the tag, 5, the five values), if it is one.
fn remaining_and_reset(body: &[u8]) -> Option<(u64, u64)> {
    let values = resp_integers(body, "*7")?;
    if values.get(1) != Some(&5) {
        return None;
    }
    acquire_told(values.get(2..)?)
}

/// The remaining units and the ms to the window's end in the values of `acquire.lua`'s answer
/// for one limit (admitted, allowed, remaining, reset, retry after).
fn acquire_told(values: &[i64]) -> Option<(u64, u64)> {
    Some((
        u64::try_from(*values.get(2)?).ok()?,
        u64::try_from(*values.get(3)?).ok()?,
    ))
}

/// The two integers of the naive script's answer (`*2 :count :ttl_ms`), if it is one.
fn count_and_ttl(body: &[u8]) -> Option<(u64, i64)> {
    let values = resp_integers(body, "*2")?;
    Some((u64::try_from(*values.first()?).ok()?, *values.get(1)?))
}

/// The body of a batched call per tenant for `streams` (see [`BatchCall`]).
fn batch_body(call: &BatchCall, streams: &[(u32, String)]) -> String {
    let n = streams.len();
    let mut body = format!("{}/{n}", call.head);
    for (_, tenant) in streams {
        body.push('/');
        body.push_str(&call.key.replace("{tenant}", tenant));
    }
    if let Some(tag) = &call.tag {
        body.push('/');
        body.push_str(tag);
    }
    if call.count_arg {
        body.push_str(&format!("/{n}"));
    }
    if !call.args.is_empty() {
        for _ in streams {
            body.push('/');
            body.push_str(&call.args);
        }
    }
    body.push_str(".raw");
    body
}

/// The integers of a RESP array answer whose first line is `head`; each may come as a bulk
/// string, as Debian's webdis 0.1.9 turns integers in arrays into strings.
fn resp_integers(body: &[u8], head: &str) -> Option<Vec<i64>> {
    let text = std::str::from_utf8(body).ok()?;
    let mut lines = text.split("\r\n");
    if lines.next()? != head {
        return None;
    }
    integer_lines(lines)
}

/// The integers of a RESP array answer of any length (as [`resp_integers`]).
fn resp_integers_any(body: &[u8]) -> Option<Vec<i64>> {
    let text = std::str::from_utf8(body).ok()?;
    let mut lines = text.split("\r\n");
    if !lines.next()?.starts_with('*') {
        return None;
    }
    integer_lines(lines)
}

/// Each line of an array's elements as an integer (`:n`, or a bulk string's text after its
/// `$len` line).
fn integer_lines<'t>(lines: impl Iterator<Item = &'t str>) -> Option<Vec<i64>> {
    lines
        .filter(|l| !l.is_empty() && !l.starts_with('$'))
        .map(|l| l.strip_prefix(':').unwrap_or(l).parse().ok())
        .collect()
}

/// WASI `random_get` (a per-worker queue name).
fn getrandom(buf: &mut [u8]) -> bool {
    #[link(wasm_import_module = "wasi_snapshot_preview1")]
    extern "C" {
        fn random_get(buf: *mut u8, len: usize) -> u16;
    }
    // SAFETY: the host writes exactly `len` bytes into `buf`, which is valid for them.
    unsafe { random_get(buf.as_mut_ptr(), buf.len()) == 0 }
}
