//! The proxy-wasm adapter: the only module that talks to the host. It copies what the core
//! needs out of the host, feeds events to the per-request [`Flow`], and carries out the
//! [`Step`] it returns. It never holds a `RefCell` borrow across a host call, because the host
//! may call back into the filter (a local reply runs the response path synchronously).
//!
//! Host calls go through `hostcalls` with their `Result`s handled: the SDK's trait helpers
//! unwrap internally, and a panic would abort the VM for every request on the worker.

use crate::config::{Config, ConfigError, IdSource, RedisConfig};
use crate::flow::{take_due, Background, Flow, Next, Runtime, Step};
use crate::ids::TokenSource;
use crate::local::overlimit::SharedStore;
use crate::lograte::WarnKind;
use crate::lua::batch::{BatchAnswer, Batcher, InFlight};
use crate::metrics::{Kind, MetricSink, Metrics};
use crate::redis::{resp::Reply, webdis, CallError};
use crate::request::{claim_text, policy_index, Probe, Request, Selected};
mod abi;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::{Rc, Weak};
use std::time::{Duration, UNIX_EPOCH};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root {
            vm: None,
            calls: HashMap::new(),
            stream_calls: HashMap::new(),
        })
    });
}}

/// Per-VM (per worker) state shared by the root context and every HTTP context.
struct Vm {
    runtime: Runtime,
    tokens: RefCell<TokenSource>,
    /// Streams with a deadline (paused on Redis or the body, or holding a lease to extend),
    /// for the root's tick.
    waiting: RefCell<HashMap<u32, Weak<Stream>>>,
    /// Calls the root sends on its next tick.
    outbox: RefCell<Vec<Background>>,
    /// Acquire calls waiting to be coalesced (`redis.batch`), sent by the root when this
    /// worker's event loop comes back to it (or on the tick at the latest), and the batches
    /// in flight.
    batcher: RefCell<Batcher<Weak<Stream>>>,
    /// This worker's shared queue: an HTTP context enqueues to wake the root, which the host
    /// does on the worker's next event-loop turn, so every acquire raised in this turn shares
    /// one batch without waiting for a timer.
    wake_queue: Option<u32>,
    /// The root's tick, and whether it is the fine one (a request waits for a lease).
    tick_ms: u64,
    fine_tick: Cell<bool>,
}

/// The root's tick while a request of this worker waits for a busy lease: its polls are due
/// at jittered times, which the watchdog's coarser tick would bunch together again.
const LEASE_WAIT_TICK_MS: u64 = 5;

impl Vm {
    /// Switches the root's tick to the fine one (`true`) or back.
    fn fine_tick(&self, fine: bool) {
        if self.fine_tick.get() != fine {
            self.fine_tick.set(fine);
            let ms = if fine {
                LEASE_WAIT_TICK_MS
            } else {
                self.tick_ms
            };
            let _ = hostcalls::set_tick_period(Duration::from_millis(ms));
        }
    }

    /// The lease `key` was given back: this worker's requests waiting for it poll at the next
    /// tick instead of at the end of their backoff.
    fn wake_waiters(&self, key: &str) {
        let streams: Vec<Rc<Stream>> = match self.waiting.try_borrow() {
            Ok(w) => w.values().filter_map(Weak::upgrade).collect(),
            Err(_) => return,
        };
        let now = now_ms();
        for stream in streams {
            if let Ok(mut f) = stream.flow.try_borrow_mut() {
                if f.waiting_for_lease() == Some(key) {
                    f.wake(now);
                }
            }
        }
    }
}

impl Vm {
    fn token(&self) -> String {
        match self.tokens.try_borrow_mut() {
            Ok(mut t) => t.token(),
            Err(_) => format!("{:032x}", now_ms()),
        }
    }
}

/// One HTTP stream: its state machine and which direction is stopped in the filter.
struct Stream {
    ctx: u32,
    flow: RefCell<Flow>,
    paused: Cell<Option<Dir>>,
}

impl Stream {
    fn step(&self, f: impl FnOnce(&mut Flow) -> Step) -> Step {
        match self.flow.try_borrow_mut() {
            Ok(mut flow) => f(&mut flow),
            Err(_) => Step::Wait,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Request,
    Response,
}

/// Carries out `step` for `stream`. `dir` is the direction of the host callback that raised
/// it, or `None` for asynchronous events (callout answers, ticks), where the stream is
/// resumed instead of continued. Calls are registered through `register(token, slot)`.
fn apply(
    vm: &Vm,
    stream: &Rc<Stream>,
    step: Step,
    dir: Option<Dir>,
    register: &mut dyn FnMut(u32, usize),
) -> Action {
    let action = match step {
        Step::Continue => {
            let paused = stream.paused.take();
            if dir == Some(Dir::Request) || paused == Some(Dir::Request) {
                set_upstream_headers(stream);
            }
            if dir.is_none() {
                match paused {
                    Some(Dir::Request) => {
                        let _ = abi::resume(false);
                    }
                    Some(Dir::Response) => {
                        let _ = abi::resume(true);
                    }
                    None => {}
                }
            }
            Action::Continue
        }
        Step::Wait => {
            if dir.is_some() {
                stream.paused.set(dir);
            }
            Action::Pause
        }
        Step::Respond(r) => {
            stream.paused.set(None);
            send_local(&r);
            Action::Pause
        }
        Step::Dispatch(calls) => {
            if dir.is_some() {
                stream.paused.set(dir);
            }
            let mut action = Action::Pause;
            for call in calls {
                if let Ok(mut batcher) = vm.batcher.try_borrow_mut() {
                    if batcher.takes(call.script, call.by_sha) {
                        let first = batcher.queue(Rc::downgrade(stream), call.slot, call.call);
                        drop(batcher);
                        if let (true, Some(q)) = (first, vm.wake_queue) {
                            let _ = hostcalls::enqueue_shared_queue(q, Some(b"1"));
                        }
                        continue;
                    }
                }
                match send(vm, &call.encode(&vm.runtime.scripts)) {
                    Ok(token) => register(token, call.slot),
                    Err(e) => {
                        let step = stream.step(|f| {
                            f.on_reply(&vm.runtime, call.slot, Err(e), now_ms(), &HostMetrics)
                        });
                        action = apply(vm, stream, step, None, register);
                    }
                }
            }
            action
        }
    };
    settle_stream(vm, stream);
    action
}

/// Hands the stream's background calls to the root and keeps the watchdog registry current.
fn settle_stream(vm: &Vm, stream: &Rc<Stream>) {
    let (calls, deadline, freed, waits) = match stream.flow.try_borrow_mut() {
        Ok(mut f) => (
            f.take_background(),
            f.deadline_ms(),
            f.take_freed_lease(),
            f.waiting_for_lease().is_some(),
        ),
        Err(_) => return,
    };
    if waits {
        vm.fine_tick(true);
    }
    if !calls.is_empty() {
        if let Ok(mut outbox) = vm.outbox.try_borrow_mut() {
            outbox.extend(calls);
        }
    }
    if let Ok(mut waiting) = vm.waiting.try_borrow_mut() {
        if deadline.is_some() {
            waiting.insert(stream.ctx, Rc::downgrade(stream));
        } else {
            waiting.remove(&stream.ctx);
        }
    }
    if let Some(key) = freed {
        vm.wake_waiters(&key);
    }
}

/// Applies the flow's request-header changes, once, while the headers are still held (the
/// host refuses changes to headers already sent).
fn set_upstream_headers(stream: &Stream) {
    let set = match stream.flow.try_borrow_mut() {
        Ok(mut f) => f.take_upstream_headers(),
        Err(_) => return,
    };
    for (name, value) in &set {
        let _ = abi::set_header(MapType::HttpRequestHeaders, name, value);
    }
}

/// The proxy's shared data: the over-limit cache's mirror across workers.
struct HostShared;

impl SharedStore for HostShared {
    fn get(&self, slot: &str) -> Option<Vec<u8>> {
        hostcalls::get_shared_data(slot).ok()?.0
    }
    fn set(&self, slot: &str, value: &[u8]) {
        let _ = hostcalls::set_shared_data(slot, Some(value), None);
    }
}

struct HostMetrics;

impl MetricSink for HostMetrics {
    fn increment(&self, id: u32) {
        if id != u32::MAX {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }
    fn record(&self, id: u32, value: u64) {
        if id != u32::MAX {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Sends one gateway request; the token comes back with the answer.
/// Sends one gateway request and counts it.
fn send(vm: &Vm, body: &[u8]) -> Result<u32, CallError> {
    HostMetrics.increment(vm.runtime.metrics.redis.calls);
    dispatch(&vm.runtime, body)
}

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
    hostcalls::dispatch_http_call(
        &redis.cluster,
        headers,
        Some(body),
        vec![],
        // The watchdog decides at `timeout` (within a tick); the host's own timer is a backstop
        // set later, so a slow gateway is counted as a timeout, not as Envoy's 504.
        Duration::from_millis(redis.timeout_ms.saturating_mul(2).saturating_add(100)),
    )
    .map_err(|status| {
        // Envoy refuses a callout to a cluster it does not know with BadArgument.
        let err = if status == proxy_wasm::types::Status::BadArgument {
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

/// The answer of the callout whose response callback is running.
fn call_answer(body_size: usize) -> Result<crate::redis::resp::Reply, CallError> {
    let status = hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
        .ok()
        .flatten()
        .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u32>().ok());
    // The gateway's own answer (not Envoy's on its behalf): it names itself, or Envoy's router
    // timed it.
    let from_gateway = ["server", "x-envoy-upstream-service-time"].iter().any(|h| {
        hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, h)
            .ok()
            .flatten()
            .is_some()
    });
    let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
        .ok()
        .flatten()
        .unwrap_or_default();
    webdis::decode(status, from_gateway, &body)
}

struct Root {
    vm: Option<Rc<Vm>>,
    /// Outstanding background callouts.
    calls: HashMap<u32, Background>,
    /// Callouts the root sent for a stream (lease polls): token -> stream, slot.
    stream_calls: HashMap<u32, (Weak<Stream>, usize)>,
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
            hostcalls::define_metric(t, name).unwrap_or(u32::MAX)
        });
        // A queue of this worker's own (a random name: the host keys queues by VM and name,
        // and every worker runs the same VM).
        let wake_queue = match config.redis.batch {
            Some(_) => {
                let name = format!("cg.batch.{}", TokenSource::from_entropy(now_ms()).token());
                hostcalls::register_shared_queue(&name).ok()
            }
            None => None,
        };
        // The watchdog's resolution; batches ride on the tick only without a wake queue.
        let tick = config.tick_ms(config.redis.batch.is_some() && wake_queue.is_none());
        let _ = hostcalls::set_tick_period(Duration::from_millis(tick));
        let batch = config.redis.batch;
        self.vm = Some(Rc::new(Vm {
            runtime: Runtime::new(config, metrics, Some(Box::new(HostShared))),
            tokens: RefCell::new(TokenSource::from_entropy(now_ms())),
            waiting: RefCell::new(HashMap::new()),
            outbox: RefCell::new(Vec::new()),
            batcher: RefCell::new(Batcher::new(batch)),
            wake_queue,
            tick_ms: tick,
            fine_tick: Cell::new(false),
        }));
        Ok(())
    }

    fn send_background(&mut self, vm: &Vm, mut bg: Background) {
        let body = bg.encode(&vm.runtime, now_ms());
        match send(vm, &body) {
            Ok(token) => {
                self.calls.insert(token, bg);
            }
            Err(e) => {
                let next = bg.on_answer(&vm.runtime, Err(e), now_ms(), &HostMetrics);
                self.after_background(vm, bg, next, false);
            }
        }
    }

    /// Carries out what the core decided about a background call after its answer.
    /// `resend_now` is false where the call was just refused (no loop on a refusing host).
    fn after_background(&mut self, vm: &Vm, bg: Background, next: Next, resend_now: bool) {
        match next {
            Next::Done => {}
            Next::Resend if resend_now => self.send_background(vm, bg),
            Next::Resend | Next::Retry => {
                if let Ok(mut outbox) = vm.outbox.try_borrow_mut() {
                    outbox.push(bg);
                }
            }
        }
    }
}

impl Root {
    /// Sends the queued acquire calls as batches.
    fn flush_batches(&mut self, vm: &Rc<Vm>) {
        let batches = match vm.batcher.try_borrow_mut() {
            Ok(mut b) => b.flush(),
            Err(_) => return,
        };
        for batch in batches {
            self.send_batch(vm, batch);
        }
    }

    fn send_batch(&mut self, vm: &Rc<Vm>, batch: InFlight<Weak<Stream>>) {
        match send(vm, &batch.encode(&vm.runtime.scripts)) {
            Ok(token) => {
                if let Ok(mut b) = vm.batcher.try_borrow_mut() {
                    b.sent(token, batch);
                }
            }
            Err(e) => self.on_batch_answer(vm, batch, Err(e)),
        }
    }

    /// Hands every member of a batch its own answer.
    fn on_batch_answer(
        &mut self,
        vm: &Rc<Vm>,
        batch: InFlight<Weak<Stream>>,
        answer: Result<Reply, CallError>,
    ) {
        let members = match Batcher::answer(batch, answer, &vm.runtime.metrics.redis, &HostMetrics)
        {
            BatchAnswer::Resend(batch) => return self.send_batch(vm, batch),
            BatchAnswer::Members(members) => members,
        };
        let now = now_ms();
        for (weak, slot, part) in members {
            let Some(stream) = weak.upgrade() else {
                continue;
            };
            let step = stream.step(|f| f.on_reply(&vm.runtime, slot, part, now, &HostMetrics));
            self.apply_for(vm, &stream, step);
        }
    }

    /// Carries out a step for a stream from the root (tick or a call the root sent).
    fn apply_for(&mut self, vm: &Rc<Vm>, stream: &Rc<Stream>, step: Step) {
        if step == Step::Wait {
            settle_stream(vm, stream);
            return;
        }
        if hostcalls::set_effective_context(stream.ctx).is_err() {
            return;
        }
        let weak = Rc::downgrade(stream);
        let calls = &mut self.stream_calls;
        apply(vm, stream, step, None, &mut |token, slot| {
            calls.insert(token, (weak.clone(), slot));
        });
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let Some(vm) = self.vm.clone() else {
            return;
        };
        let batch = vm
            .batcher
            .try_borrow_mut()
            .ok()
            .and_then(|mut b| b.take(token));
        if let Some(batch) = batch {
            let answer = call_answer(body_size);
            self.on_batch_answer(&vm, batch, answer);
            return;
        }
        if let Some((weak, slot)) = self.stream_calls.remove(&token) {
            let Some(stream) = weak.upgrade() else {
                return;
            };
            let answer = call_answer(body_size);
            let step =
                stream.step(|f| f.on_reply(&vm.runtime, slot, answer, now_ms(), &HostMetrics));
            self.apply_for(&vm, &stream, step);
            return;
        }
        let Some(mut bg) = self.calls.remove(&token) else {
            return;
        };
        let answer = call_answer(body_size);
        let freed = bg.freed_lease(&answer).map(str::to_string);
        let next = bg.on_answer(&vm.runtime, answer, now_ms(), &HostMetrics);
        self.after_background(&vm, bg, next, true);
        if let Some(key) = freed {
            vm.wake_waiters(&key);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size) {
            Ok(Some(b)) => b,
            Ok(None) => Vec::new(),
            Err(status) => {
                log::error!("cannot read the plugin configuration: {status:?}");
                return false;
            }
        };
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

    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(vm) = self.vm.clone() else {
            return;
        };
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        self.flush_batches(&vm);
    }

    fn on_tick(&mut self) {
        let Some(vm) = self.vm.clone() else {
            return;
        };
        let now = now_ms();
        // Streams first, so what they hand over (extensions, releases, polls) goes out in
        // this same tick. Collect first: no borrow of `waiting` may be held while the host
        // is called.
        let mut due = Vec::new();
        if let Ok(mut waiting) = vm.waiting.try_borrow_mut() {
            waiting.retain(|_, weak| match weak.upgrade() {
                None => false,
                Some(stream) => {
                    let deadline = stream.flow.try_borrow().ok().and_then(|f| f.deadline_ms());
                    if deadline.is_some_and(|d| now >= d) {
                        due.push(stream);
                    }
                    true
                }
            });
        }
        for stream in due {
            let step = stream.step(|f| f.on_tick(&vm.runtime, now, &HostMetrics));
            self.apply_for(&vm, &stream, step);
        }
        if vm.fine_tick.get() {
            let still = vm.waiting.try_borrow().is_ok_and(|w| {
                w.values().filter_map(Weak::upgrade).any(|s| {
                    s.flow
                        .try_borrow()
                        .is_ok_and(|f| f.waiting_for_lease().is_some())
                })
            });
            if !still {
                vm.fine_tick(false);
            }
        }
        // What is due now; retries waiting for their backoff stay.
        let outbox: Vec<Background> = vm
            .outbox
            .try_borrow_mut()
            .map(|mut o| take_due(&mut o, now))
            .unwrap_or_default();
        for bg in outbox {
            self.send_background(&vm, bg);
        }
        self.flush_batches(&vm);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Filter {
            vm: self.vm.clone(),
            stream: Rc::new(Stream {
                ctx: context_id,
                flow: RefCell::new(Flow::default()),
                paused: Cell::new(None),
            }),
            calls: HashMap::new(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

fn send_local(r: &crate::respond::LocalResponse) {
    let headers: Vec<(&str, &str)> = r
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    // A gRPC status given is what the host answers a gRPC request with (it sends every local
    // reply to a gRPC request trailers-only); none lets it map the HTTP status.
    let grpc_status = r
        .grpc_status
        .and_then(|c| i32::try_from(c).ok())
        .unwrap_or(-1);
    if let Err(status) = abi::send_local_response(r.status, &headers, &r.body, grpc_status) {
        log::error!("cannot send a local response: {status:?}");
    }
}

struct Filter {
    vm: Option<Rc<Vm>>,
    stream: Rc<Stream>,
    /// Outstanding callout token -> flow slot.
    calls: HashMap<u32, usize>,
}

impl Context for Filter {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let Some(slot) = self.calls.remove(&token) else {
            return;
        };
        let Some(vm) = self.vm.clone() else {
            return;
        };
        let answer = call_answer(body_size);
        let step = self
            .stream
            .step(|f| f.on_reply(&vm.runtime, slot, answer, now_ms(), &HostMetrics));
        self.apply(&vm, step, None);
    }

    fn on_done(&mut self) -> bool {
        if let Some(vm) = self.vm.clone() {
            if let Ok(mut f) = self.stream.flow.try_borrow_mut() {
                f.on_done(&vm.runtime, &HostMetrics);
            }
            settle_stream(&vm, &self.stream);
            if let Ok(mut waiting) = vm.waiting.try_borrow_mut() {
                waiting.remove(&self.stream.ctx);
            }
        }
        true
    }
}

impl Filter {
    fn apply(&mut self, vm: &Rc<Vm>, step: Step, dir: Option<Dir>) -> Action {
        let calls = &mut self.calls;
        apply(vm, &self.stream, step, dir, &mut |token, slot| {
            calls.insert(token, slot);
        })
    }

    /// Feeds the flow the event of a host callback in direction `dir` and carries out the
    /// step it returns (Continue when the filter is not configured).
    fn event(&mut self, dir: Dir, event: impl FnOnce(&mut Flow, &Runtime) -> Step) -> Action {
        let Some(vm) = self.vm.clone() else {
            return Action::Continue;
        };
        let step = self.stream.step(|f| event(f, &vm.runtime));
        self.apply(&vm, step, Some(dir))
    }
}

fn header_pairs(map: MapType) -> Vec<(String, String)> {
    hostcalls::get_map_bytes(map)
        .unwrap_or_default()
        .into_iter()
        .map(|(n, v)| {
            // Valid UTF-8 (nearly always) keeps its buffer; anything else is made lossy.
            let v = String::from_utf8(v)
                .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
            (n, v)
        })
        .collect()
}

/// A leaf of the request's dynamic metadata (`metadata.filter_metadata.<path...>`) as an
/// identity (see [`claim_text`]).
fn metadata_text(path: &[String]) -> Option<String> {
    let mut full = vec!["metadata", "filter_metadata"];
    full.extend(path.iter().map(String::as_str));
    claim_text(&hostcalls::get_property(full).ok()??)
}

fn property(path: Vec<&str>) -> Option<String> {
    let bytes = hostcalls::get_property(path).ok()??;
    String::from_utf8(bytes).ok()
}

fn buffer(kind: BufferType, size: usize) -> Vec<u8> {
    hostcalls::get_buffer(kind, 0, size)
        .ok()
        .flatten()
        .unwrap_or_default()
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(vm) = self.vm.clone() else {
            return Action::Continue;
        };
        // Headers only the filter may set never come from the client, whatever the request.
        for name in &vm.runtime.reserved_headers {
            let _ = abi::remove_header(MapType::HttpRequestHeaders, name);
        }
        // The hot path of a request no policy matches: the pseudo-headers the matchers need
        // (often only `:path`), nothing else.
        let mut probe = Probe::new(|name: &str| {
            hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
                .ok()
                .flatten()
                .map(|v| String::from_utf8_lossy(&v).into_owned())
        })
        .with_headers(|| header_pairs(MapType::HttpRequestHeaders));
        let policies = &vm.runtime.config.policies;
        let (index, policy) = match policy_index(policies, &mut probe) {
            None => return Action::Continue,
            Some(Selected::AmbiguousPath(i)) => {
                let content_type =
                    hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, "content-type")
                        .ok()
                        .flatten()
                        .map(|v| String::from_utf8_lossy(&v).into_owned());
                let step = self.stream.step(|f| {
                    f.set_grpc(content_type.as_deref());
                    f.on_ambiguous_path(&vm.runtime, i, &HostMetrics)
                });
                return self.apply(&vm, step, Some(Dir::Request));
            }
            Some(Selected::Policy(i)) => match policies.get(i) {
                Some(p) => (i, p),
                None => return Action::Continue,
            },
        };
        let (nonce, owner) = if policy.needs_tokens {
            (vm.token(), vm.token())
        } else {
            ("-".to_string(), "-".to_string())
        };
        let address = if policy.uses_client_ip {
            property(vec!["source", "address"])
        } else {
            None
        };
        let mut req = Request::from_headers(
            header_pairs(MapType::HttpRequestHeaders),
            address.as_deref(),
        );
        // Claims Envoy verified (jwt_authn's payload in the request's metadata), read only for
        // the roles configured to come from there.
        let identity = &vm.runtime.config.identity;
        if let IdSource::Metadata(path) = &identity.tenant {
            req.tenant_claim = metadata_text(path);
        }
        if let IdSource::Metadata(path) = &identity.principal {
            req.principal_claim = metadata_text(path);
        }
        let step = self.stream.step(|f| {
            f.on_policy_request(
                &vm.runtime,
                index,
                req,
                &nonce,
                &owner,
                end_of_stream,
                now_ms(),
                &HostMetrics,
            )
        });
        self.apply(&vm, step, Some(Dir::Request))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // While the request is held for a decision its body is held too: returning Continue
        // here would let Envoy pass the headers on before the decision.
        self.event(Dir::Request, |f, rt| {
            f.on_request_body(
                rt,
                body_size,
                end_of_stream,
                || buffer(BufferType::HttpRequestBody, body_size),
                now_ms(),
                &HostMetrics,
            )
        })
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.event(Dir::Request, |f, rt| {
            f.on_request_trailers(
                rt,
                || buffer(BufferType::HttpRequestBody, usize::MAX >> 1),
                now_ms(),
                &HostMetrics,
            )
        })
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(vm) = self.vm.clone() else {
            return Action::Continue;
        };
        let (extra, interested) = match self.stream.flow.try_borrow() {
            Ok(f) => (f.response_headers().to_vec(), f.wants_response()),
            Err(_) => (Vec::new(), false),
        };
        for (name, value) in &extra {
            let _ = abi::add_header(MapType::HttpResponseHeaders, name, value);
        }
        if !interested {
            return Action::Continue;
        }
        let headers = header_pairs(MapType::HttpResponseHeaders);
        let status = headers
            .iter()
            .find(|(n, _)| n == ":status")
            .and_then(|(_, v)| v.parse::<u32>().ok())
            .unwrap_or(0);
        let details = property(vec!["response", "code_details"]).unwrap_or_default();
        let via_upstream = details == "via_upstream";
        let step = self.stream.step(|f| {
            f.on_response_headers(
                &vm.runtime,
                status,
                via_upstream,
                &details,
                &headers,
                end_of_stream,
                now_ms(),
                &HostMetrics,
            )
        });
        self.apply(&vm, step, Some(Dir::Response))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.event(Dir::Response, |f, rt| {
            f.on_response_body(
                rt,
                body_size,
                end_of_stream,
                || buffer(BufferType::HttpResponseBody, body_size),
                now_ms(),
            )
        })
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        let interested = self
            .stream
            .flow
            .try_borrow()
            .is_ok_and(|f| f.wants_response_trailers());
        let trailers = if interested {
            header_pairs(MapType::HttpResponseTrailers)
        } else {
            Vec::new()
        };
        self.event(Dir::Response, |f, rt| {
            f.on_response_trailers(
                rt,
                &trailers,
                || buffer(BufferType::HttpResponseBody, usize::MAX >> 1),
                now_ms(),
            )
        })
    }
}

impl Drop for Filter {
    fn drop(&mut self) {
        if let Some(vm) = &self.vm {
            if let Ok(mut waiting) = vm.waiting.try_borrow_mut() {
                waiting.remove(&self.stream.ctx);
            }
        }
    }
}
