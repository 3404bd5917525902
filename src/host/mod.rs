//! The proxy-wasm adapter: the only module that talks to the host. It copies what the core
//! needs out of the host, hands each event to this worker's [`Worker`], and carries out the
//! [`Effects`] it returns: host calls and nothing else. The core decides what is read: a
//! request's headers are read through [`crate::http::arrival::HostReads`] (`reads.rs`), and
//! whether a stream needs an event is the [`SharedWorker`]'s answer. The worker is borrowed
//! only to take an event, with reads of the host's buffers, never across another host call.
//!
//! The host is reached through the proxy-wasm SDK: its dispatcher calls the contexts in
//! `contexts.rs`, and every host call goes through `sdk.rs`, which keeps the SDK's
//! `hostcalls` from meeting a status they would panic on.

use crate::config::{Config, ConfigError, RedisConfig};
use crate::engine::flow::{Cx, Runtime, PROPERTY};
use crate::engine::shared::SharedWorker;
use crate::engine::worker::{Action, Callout, Dir, Effects, ResponseHead, StreamEffects, Worker};
use crate::guards::ratelimit::overlimit::SharedStore;
use crate::http::arrival::{arrive, Arrival};
use crate::http::headers::Headers;
use crate::http::local_reply;
use crate::redis::{webdis, CallError};
use crate::support::ids::TokenSource;
use crate::support::lograte::WarnKind;
use crate::support::metrics::{Kind, MetricSink, Metrics};
use sdk::{BufferType, MapType, MetricType};
use spans::Span;
mod contexts;
mod reads;
mod sdk;
mod spans;

use std::rc::Rc;
use std::time::Duration;

/// Per-VM (per worker) state shared by the root context and every HTTP context.
struct Vm {
    runtime: Runtime,
    /// This worker's streams and calls (keyed by context id).
    worker: SharedWorker<u32>,
    /// This worker's shared queue: an HTTP context enqueues to wake the root, which the host
    /// does on the worker's next event-loop turn, so every acquire raised in this turn shares
    /// one batch without waiting for a timer.
    wake_queue: Option<u32>,
    /// The host's time at the last event: the calls an event's effects send in the same
    /// callback are handed back to the worker at that time, without asking the host again.
    now_ms: std::cell::Cell<u64>,
}

impl Vm {
    /// Hands an event to the worker, at the host's time; `None` while the worker is taking
    /// another one.
    fn event(
        &self,
        f: impl FnOnce(&mut Worker<u32>, &Cx<'_>) -> Effects<u32>,
    ) -> Option<Effects<u32>> {
        let now = now_ms();
        self.now_ms.set(now);
        self.event_at(now, f)
    }

    /// [`Vm::event`] at a time already read in this callback (or at 0, by an event that reads
    /// none: see [`Filter::untimed`]).
    fn event_at<T>(&self, now: u64, f: impl FnOnce(&mut Worker<u32>, &Cx<'_>) -> T) -> Option<T> {
        let cx = Cx::new(&self.runtime, now, &HostMetrics);
        self.worker.event(|w| f(w, &cx))
    }

    /// [`Vm::event`] and the carrying out of its effects (see [`Vm::carry_out`]), the two timed
    /// as `parts`; `None` while the worker is taking another event.
    fn event_timed(
        &self,
        parts: Option<(Span, Span)>,
        current: Option<u32>,
        f: impl FnOnce(&mut Worker<u32>, &Cx<'_>) -> Effects<u32>,
    ) -> Option<Action> {
        let began = spans::mark();
        let fx = self.event(f);
        let carrying = spans::mark();
        if let Some((event, _)) = parts {
            began.end(event);
        }
        let action = fx.map(|fx| self.carry_out(fx, current));
        if let Some((_, carry)) = parts {
            carrying.end(carry);
        }
        action
    }

    /// Carries out `fx`. `current` is the stream whose callback raised the event (the host's
    /// effective context already); any other stream is switched to first.
    fn carry_out(&self, fx: Effects<u32>, current: Option<u32>) -> Action {
        let mut action = fx.action;
        for ops in fx.streams {
            if Some(ops.stream) != current && sdk::set_effective_context(ops.stream).is_err() {
                continue;
            }
            if let Some(a) = self.on_stream(ops, current) {
                action = a;
            }
        }
        for call in fx.calls {
            self.send(call, current);
        }
        if let Some(ms) = fx.tick_ms {
            sdk::set_tick_period(ms);
        }
        if let (true, Some(q)) = (fx.wake, self.wake_queue) {
            let _ = sdk::enqueue(q, b"1");
        }
        action
    }

    /// What to do on the effective context's stream; the answer of a refused call, if any.
    fn on_stream(&self, ops: StreamEffects<u32>, current: Option<u32>) -> Option<Action> {
        for (name, value) in &ops.add_response_headers {
            let _ = sdk::add_header(MapType::HttpResponseHeaders, name, value);
        }
        for (name, value) in &ops.set_request_headers {
            let _ = sdk::set_header(MapType::HttpRequestHeaders, name, value);
        }
        if let Some(decision) = &ops.decision {
            let _ = sdk::set_property(PROPERTY, decision.as_bytes());
        }
        let mut action = None;
        for call in ops.calls {
            action = self.send(call, current).or(action);
        }
        if let Some(r) = &ops.reply {
            send_local(r);
        }
        if let Some(dir) = ops.resume {
            let _ = sdk::resume(dir == Dir::Response);
        }
        action
    }

    /// Sends a call and tells the worker its token; a refusal is the call's answer at once,
    /// whose action is returned.
    fn send(&self, call: Callout<u32>, current: Option<u32>) -> Option<Action> {
        let token = dispatch(&self.runtime, &call.body);
        let refused = token.is_err();
        let fx = self.event_at(self.now_ms.get(), |w, cx| w.sent(cx, call.route, token))?;
        let action = self.carry_out(fx, current);
        refused.then_some(action)
    }
}

/// The proxy's shared data: the over-limit cache's log across workers.
struct HostShared;

impl SharedStore for HostShared {
    fn get(&self, name: &str) -> Option<(Vec<u8>, u32)> {
        sdk::shared_data(name)
    }
    fn set(&self, name: &str, value: &[u8], version: u32) -> bool {
        sdk::set_shared_data(name, value, version).is_ok()
    }
}

struct HostMetrics;

impl MetricSink for HostMetrics {
    fn increment(&self, id: u32) {
        if id != u32::MAX {
            sdk::increment_metric(id, 1);
        }
    }
    fn add(&self, id: u32, n: u64) {
        if id != u32::MAX {
            sdk::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
    fn record(&self, id: u32, value: u64) {
        if id != u32::MAX {
            sdk::record_metric(id, value);
        }
    }
}

/// The host's time since the epoch (zero if the host cannot say).
fn since_epoch() -> Duration {
    sdk::now().unwrap_or_default()
}

fn now_ms() -> u64 {
    u64::try_from(since_epoch().as_millis()).unwrap_or(u64::MAX)
}

/// Sends one gateway request; the token comes back with the answer.
fn dispatch(rt: &Runtime, body: &[u8]) -> Result<u32, CallError> {
    let redis: &RedisConfig = &rt.config.redis;
    let mut headers: Vec<(&str, &str)> = vec![
        (":method", "POST"),
        (":path", "/"),
        (":authority", redis.authority.as_str()),
        ("content-type", "text/plain"),
    ];
    if let Some(auth) = &redis.authorization {
        headers.push(("authorization", auth.as_str()));
    }
    sdk::http_call(
        &redis.cluster,
        headers,
        body,
        // The watchdog decides at `timeout` (within a tick); the host's own timer is a backstop
        // set later, so a slow gateway is counted as a timeout, not as Envoy's 504.
        Duration::from_millis(redis.timeout_ms.saturating_mul(2).saturating_add(100)),
    )
    .map_err(|status| {
        // Envoy refuses a callout to a cluster it does not know with BadArgument.
        let err = if status == sdk::Refused(sdk::Status::BadArgument) {
            CallError::NoSuchCluster
        } else {
            CallError::NotSent
        };
        rt.warnings.warn(WarnKind::Dispatch, 0, now_ms(), || {
            format!(
                "cannot dispatch to cluster {} ({status:?}): {}",
                redis.cluster,
                err.describe()
            )
        });
        err
    })
}

/// What reading an answer of `n` bytes takes at most (its copy, the reply decoded, a stored
/// response parsed, its body decoded or opened, the replay's body).
const ANSWER_COPIES: usize = 6;

/// [`call_answer`], timed; not read when the worker's memory budget cannot hold what reading it
/// takes (`CallError::OverBudget`: Redis ran the call, its answer is dropped).
fn read_answer(
    cx: &Cx<'_>,
    headers: usize,
    body_size: usize,
) -> Result<crate::redis::resp::Reply, CallError> {
    let _span = spans::enter(Span::AnswerRead);
    if !cx
        .rt
        .memory
        .admits_brief(body_size.saturating_mul(ANSWER_COPIES))
    {
        return Err(CallError::OverBudget);
    }
    call_answer(headers, body_size)
}

/// The answer of the callout whose response callback is running: its body, and its status
/// only when the body alone does not show that Redis ran the command (see
/// [`webdis::decode_array`]). A callout that failed (its connection reset) has no headers
/// (`headers` is 0), and the host no map to read them from.
fn call_answer(headers: usize, body_size: usize) -> Result<crate::redis::resp::Reply, CallError> {
    let body = sdk::buffer(BufferType::HttpCallResponseBody, body_size);
    if let Some(reply) = webdis::decode_array(&body) {
        return Ok(reply);
    }
    let header = |name: &str| {
        (headers > 0)
            .then(|| sdk::header_value(MapType::HttpCallResponseHeaders, name))
            .flatten()
    };
    let status = header(":status").and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u32>().ok());
    // The gateway's own answer (not Envoy's on its behalf): it names itself, or Envoy's router
    // timed it. Only a failure needs telling apart (a 200 is always the gateway's).
    let from_gateway = status == Some(200)
        || ["server", "x-envoy-upstream-service-time"]
            .iter()
            .any(|h| header(h).is_some());
    webdis::decode(status, from_gateway, &body)
}

/// A root context: the plugin's configuration, once loaded, as this worker's [`Vm`].
#[derive(Clone, Default)]
struct Root {
    vm: Option<Rc<Vm>>,
}

impl Root {
    fn configure(&mut self, bytes: &[u8]) -> Result<(), ConfigError> {
        // `redis.authorization_env` reads the VM's environment (WASI environ: Envoy's
        // `vm_config.environment_variables`, Istio's `vmConfig.env`). A value that is not
        // UTF-8 is passed on lossily, so it is refused as "not printable", not as "unset".
        let config = Config::parse_with_env(bytes, &|name| {
            std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
        })?;
        let metrics = Metrics::define(&config, |kind, name| {
            let t = match kind {
                Kind::Counter => MetricType::Counter,
                Kind::Histogram => MetricType::Histogram,
            };
            sdk::define_metric(t, name).unwrap_or(u32::MAX)
        });
        // A queue of this worker's own (a random name: the host keys queues by VM and name,
        // and every worker runs the same VM): a stream enqueues to wake the root, which sends
        // the releases it handed over (and the batches) at once instead of at the next tick.
        let name = format!("cg.wake.{}", TokenSource::from_entropy(now_ms()).token());
        let wake_queue = sdk::register_queue(&name).ok();
        // The watchdog's resolution; batches ride on the tick only without a wake queue.
        let tick = config.tick_ms(config.redis.batch.is_some() && wake_queue.is_none());
        sdk::set_tick_period(tick);
        contexts::set_budget(config.memory_budget);
        // Big copies may grow the VM's memory to twice the budget (room for the allocator's
        // spare and its fragments), never more: past it they are refused as over budget.
        crate::support::heap::cap_growth(
            usize::try_from(config.memory_budget.saturating_mul(2)).unwrap_or(usize::MAX),
        );
        let batch = config.redis.batch;
        let worker = Worker::new(TokenSource::from_entropy(now_ms()), batch, tick);
        self.vm = Some(Rc::new(Vm {
            runtime: Runtime::new(config, metrics, Some(Box::new(HostShared))),
            worker: SharedWorker::new(worker),
            wake_queue,
            now_ms: std::cell::Cell::new(now_ms()),
        }));
        Ok(())
    }

    /// Hands a root event to the worker and carries out its effects.
    fn event(&self, f: impl FnOnce(&mut Worker<u32>, &Cx<'_>) -> Effects<u32>) {
        self.event_in(None, f);
    }

    /// [`Root::event`], the worker's part and the carrying out timed as `parts`.
    fn event_in(
        &self,
        parts: Option<(Span, Span)>,
        f: impl FnOnce(&mut Worker<u32>, &Cx<'_>) -> Effects<u32>,
    ) {
        if let Some(vm) = &self.vm {
            vm.event_timed(parts, None, f);
        }
    }

    /// An answer to a callout the root sent.
    fn on_http_call_response(&self, token: u32, headers: usize, body_size: usize) {
        self.event_in(Some((Span::Answer, Span::Resume)), |w, cx| {
            w.on_answer(cx, token, || read_answer(cx, headers, body_size))
        });
    }

    /// Reads and loads the plugin's configuration; whether it is valid (the host refuses the
    /// plugin otherwise).
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = sdk::buffer(BufferType::PluginConfiguration, size);
        match self.configure(&bytes) {
            Ok(()) => {
                log::info!("configuration loaded");
                true
            }
            Err(e) => {
                log::error!("invalid plugin configuration: {e}");
                false
            }
        }
    }

    fn on_queue_ready(&self, queue_id: u32) {
        if self.vm.is_none() {
            return;
        }
        while sdk::dequeue(queue_id).is_some() {}
        self.event(|w, cx| w.on_queue_ready(cx));
    }

    fn on_tick(&self) {
        self.event(|w, cx| w.on_tick(cx));
    }

    /// A new stream of this plugin.
    fn stream(&self, context_id: u32) -> Filter {
        let _span = spans::enter(Span::Create);
        Filter {
            vm: self.vm.clone(),
            ctx: context_id,
        }
    }
}

/// Sends a local answer, with the header that keeps the caller's Envoy from retrying it
/// ([`local_reply::wire_headers`]).
fn send_local(r: &local_reply::LocalResponse) {
    let headers = local_reply::wire_headers(r);
    // A gRPC status given is what the host answers a gRPC request with (it sends every local
    // reply to a gRPC request trailers-only); none lets it map the HTTP status.
    let grpc_status = r
        .grpc_status
        .and_then(|c| i32::try_from(c).ok())
        .unwrap_or(-1);
    if let Err(status) = sdk::send_local_response(r.status, &headers, &r.body, grpc_status) {
        log::error!("cannot send a local response: {status:?}");
    }
}

/// One HTTP stream, known to the worker by its context id.
#[derive(Clone)]
struct Filter {
    vm: Option<Rc<Vm>>,
    ctx: u32,
}

impl Filter {
    /// Hands this stream's event to the worker and carries out its effects (Continue when
    /// the filter is not configured).
    fn event(&self, f: impl FnOnce(&mut Worker<u32>, &Cx<'_>, u32) -> Effects<u32>) -> Action {
        self.event_in(None, f)
    }

    /// [`Filter::event`], the worker's part and the carrying out timed as `parts`.
    fn event_in(
        &self,
        parts: Option<(Span, Span)>,
        f: impl FnOnce(&mut Worker<u32>, &Cx<'_>, u32) -> Effects<u32>,
    ) -> Action {
        let Some(vm) = &self.vm else {
            return Action::Continue;
        };
        // None: the worker is taking another event; the stream waits for it.
        vm.event_timed(parts, Some(self.ctx), |w, cx| f(w, cx, self.ctx))
            .unwrap_or(Action::Pause)
    }

    /// An event whose handling reads no time (`f` says `None` when it needs the timed
    /// [`Filter::event`]): the host's clock is not asked, and the context's time is 0.
    fn untimed(
        &self,
        f: impl FnOnce(&mut Worker<u32>, &Cx<'_>, u32) -> Option<Effects<u32>>,
    ) -> Option<Action> {
        let vm = self.vm.as_ref()?;
        let fx = vm.event_at(0, |w, cx| f(w, cx, self.ctx))??;
        Some(vm.carry_out(fx, Some(self.ctx)))
    }

    /// Whether the worker follows this stream (an unguarded one needs no event, so no clock).
    fn guarded(&self) -> bool {
        self.vm
            .as_ref()
            .is_some_and(|vm| vm.worker.follows(self.ctx))
    }

    /// A piece of the body in direction `dir`, read from the host only if the flow asks (and
    /// no event at all when the flow takes no body in that direction).
    fn body(&self, dir: Dir, body_size: usize, end_of_stream: bool) -> Action {
        if let Some(vm) = &self.vm {
            let _span = spans::enter(Span::Idle);
            if !vm.worker.takes_body(self.ctx, dir) {
                return Action::Continue;
            }
        }
        let kind = match dir {
            Dir::Request => BufferType::HttpRequestBody,
            Dir::Response => BufferType::HttpResponseBody,
        };
        self.event(|w, cx, s| {
            w.on_body(cx, s, dir, body_size, end_of_stream, || {
                sdk::buffer(kind, body_size)
            })
        })
    }

    /// An answer to a callout this stream sent.
    fn on_http_call_response(&self, token: u32, headers: usize, body_size: usize) {
        self.event_in(Some((Span::Answer, Span::Resume)), |w, cx, _| {
            w.on_answer(cx, token, || read_answer(cx, headers, body_size))
        });
    }

    fn on_done(&self) {
        let idle = spans::mark();
        if self.guarded() {
            let _span = spans::enter(Span::Done);
            self.event(|w, cx, s| w.on_done(cx, s));
        } else {
            idle.end(Span::Idle);
        }
    }

    /// The host deleted the stream's context: the worker forgets it.
    fn close(&self) {
        let _span = spans::enter(Span::Drop);
        if let Some(vm) = &self.vm {
            vm.worker.close(self.ctx);
        }
    }
}

fn header_map(map: MapType) -> Headers {
    Headers::decode(sdk::header_map_bytes(map)).unwrap_or_default()
}

fn header_pairs(map: MapType) -> Vec<(String, String)> {
    header_map(map).to_pairs()
}

fn property(path: &[&str]) -> Option<String> {
    String::from_utf8(sdk::property(path)?).ok()
}

impl Filter {
    /// The request's headers: what the core makes of them (see [`arrive`]), read through
    /// the host's calls, handed to the worker.
    fn on_request_headers(&self, end_of_stream: bool) -> Action {
        let Some(vm) = &self.vm else {
            return Action::Continue;
        };
        let began = spans::mark();
        let rt = &vm.runtime;
        match arrive(&rt.config, &rt.reserved_headers, &mut reads::SdkReads) {
            Arrival::Unguarded => Action::Continue,
            Arrival::AmbiguousPath(a) => {
                self.event(|w, cx, s| w.on_ambiguous_path(cx, s, a.index, a.content_type()))
            }
            Arrival::Guarded { index, request } => {
                began.end(Span::Headers);
                self.event_in(Some((Span::Decide, Span::Send)), |w, cx, s| {
                    w.on_request_headers(cx, s, index, request, end_of_stream)
                })
            }
        }
    }

    fn on_request_body(&self, body_size: usize, end_of_stream: bool) -> Action {
        // While the request is held for a decision its body is held too: returning Continue
        // here would let Envoy pass the headers on before the decision.
        self.body(Dir::Request, body_size, end_of_stream)
    }

    fn on_request_trailers(&self) -> Action {
        if !self.guarded() {
            return Action::Continue;
        }
        self.event(|w, cx, s| {
            w.on_request_trailers(cx, s, || {
                sdk::buffer(BufferType::HttpRequestBody, usize::MAX >> 1)
            })
        })
    }

    fn on_response_headers(&self, end_of_stream: bool) -> Action {
        let idle = spans::mark();
        if !self.guarded() {
            idle.end(Span::Idle);
            return Action::Continue;
        }
        let _span = spans::enter(Span::ResponseHeaders);
        // The usual guarded stream only gets its rate-limit headers here: no clock read.
        if let Some(action) = self.untimed(|w, cx, s| w.on_response_headers_untimed(cx, s)) {
            return action;
        }
        self.event(|w, cx, s| {
            w.on_response_headers(cx, s, end_of_stream, || ResponseHead {
                headers: header_pairs(MapType::HttpResponseHeaders),
                details: property(&["response", "code_details"]).unwrap_or_default(),
            })
        })
    }

    fn on_response_body(&self, body_size: usize, end_of_stream: bool) -> Action {
        self.body(Dir::Response, body_size, end_of_stream)
    }

    fn on_response_trailers(&self) -> Action {
        if !self.guarded() {
            return Action::Continue;
        }
        self.event(|w, cx, s| {
            w.on_response_trailers(cx, s, || header_pairs(MapType::HttpResponseTrailers))
        })
    }
}
