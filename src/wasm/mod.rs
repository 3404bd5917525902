//! The proxy-wasm adapter: the only module that talks to the host. It copies what the core
//! needs out of the host, feeds events to the per-request [`Flow`], and carries out the
//! [`Step`] it returns. It never holds a `RefCell` borrow across a host call, because the host
//! may call back into the filter (a local reply runs the response path synchronously).
//!
//! Host calls go through `hostcalls` with their `Result`s handled: the SDK's trait helpers
//! unwrap internally, and a panic would abort the VM for every request on the worker.

use crate::config::{Config, ConfigError};
use crate::flow::{Flow, Outgoing, Runtime, Step};
use crate::ids::TokenSource;
use crate::metrics::{Kind, MetricSink, Metrics};
use crate::redis::{webdis, CallError, Scripts};
use crate::request::Request;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};
use std::time::{Duration, UNIX_EPOCH};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("coordination-guard panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { vm: None }) });
}}

/// Per-VM (per worker) state shared by the root context and every HTTP context.
struct Vm {
    runtime: Runtime,
    tokens: RefCell<TokenSource>,
    /// Requests paused on Redis, for the watchdog.
    waiting: RefCell<HashMap<u32, Weak<RefCell<Flow>>>>,
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

struct Root {
    vm: Option<Rc<Vm>>,
}

impl Context for Root {}

impl Root {
    fn configure(&mut self, bytes: &[u8]) -> Result<(), ConfigError> {
        let config = Config::parse(bytes)?;
        let metrics = Metrics::define(&config, |kind, name| {
            let t = match kind {
                Kind::Counter => MetricType::Counter,
                Kind::Histogram => MetricType::Histogram,
            };
            hostcalls::define_metric(t, name).unwrap_or(u32::MAX)
        });
        // The watchdog's resolution: half the timeout, within 5 ms .. 1 s.
        let tick = (config.timeout_ms() / 2).clamp(5, 1_000);
        let _ = hostcalls::set_tick_period(Duration::from_millis(tick));
        self.vm = Some(Rc::new(Vm {
            runtime: Runtime {
                config,
                scripts: Scripts::load(),
                metrics,
            },
            tokens: RefCell::new(TokenSource::from_entropy(now_ms())),
            waiting: RefCell::new(HashMap::new()),
        }));
        Ok(())
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

    fn on_tick(&mut self) {
        let Some(vm) = self.vm.clone() else {
            return;
        };
        let now = now_ms();
        // Collect first: no borrow of `waiting` may be held while the host is called.
        let mut expired = Vec::new();
        vm.waiting
            .borrow_mut()
            .retain(|&ctx, weak| match weak.upgrade() {
                None => false,
                Some(flow) => {
                    let due = flow
                        .try_borrow()
                        .map(|f| f.deadline_ms().is_some_and(|d| now >= d))
                        .unwrap_or(false);
                    if due {
                        expired.push((ctx, flow));
                    }
                    !due
                }
            });
        for (ctx, flow) in expired {
            let step = match flow.try_borrow_mut() {
                Ok(mut f) => f.on_tick(&vm.runtime, now, &HostMetrics),
                Err(_) => continue,
            };
            if hostcalls::set_effective_context(ctx).is_ok() {
                finish_paused(step);
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Filter {
            context_id,
            vm: self.vm.clone(),
            flow: Rc::new(RefCell::new(Flow::default())),
            calls: HashMap::new(),
            paused: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Carries out a step for a request that is paused (watchdog path): resume or answer.
fn finish_paused(step: Step) {
    match step {
        Step::Continue => {
            let _ = hostcalls::resume_http_request();
        }
        Step::Respond(r) => send_local(&r),
        Step::Dispatch(_) | Step::Wait => {}
    }
}

fn send_local(r: &crate::respond::LocalResponse) {
    let headers: Vec<(&str, &str)> = r
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    if let Err(status) = hostcalls::send_http_response(r.status, headers, Some(&r.body)) {
        log::error!("cannot send a local response: {status:?}");
    }
}

struct Filter {
    context_id: u32,
    vm: Option<Rc<Vm>>,
    flow: Rc<RefCell<Flow>>,
    /// Outstanding callout token -> flow slot.
    calls: HashMap<u32, usize>,
    /// The request is stopped in the filter and must be resumed to go on.
    paused: bool,
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
        let status = hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u32>().ok());
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        let answer = webdis::decode(status, &body);
        let step =
            self.with_flow(|f| f.on_reply(&vm.runtime, slot, answer, now_ms(), &HostMetrics));
        self.carry_out(&vm, step);
    }
}

impl Filter {
    fn with_flow(&self, f: impl FnOnce(&mut Flow) -> Step) -> Step {
        match self.flow.try_borrow_mut() {
            Ok(mut flow) => f(&mut flow),
            Err(_) => Step::Wait,
        }
    }

    /// Carries out a step from this context's own callbacks; returns the filter's action.
    fn carry_out(&mut self, vm: &Rc<Vm>, step: Step) -> Action {
        match step {
            Step::Continue => {
                self.unregister(vm);
                if self.paused {
                    self.paused = false;
                    let _ = hostcalls::resume_http_request();
                }
                Action::Continue
            }
            Step::Wait => Action::Pause,
            Step::Respond(r) => {
                self.unregister(vm);
                send_local(&r);
                self.paused = true;
                Action::Pause
            }
            Step::Dispatch(calls) => {
                self.paused = true;
                vm.waiting
                    .borrow_mut()
                    .insert(self.context_id, Rc::downgrade(&self.flow));
                let mut failed = Vec::new();
                for call in calls {
                    if let Err(slot) = self.dispatch(vm, &call) {
                        failed.push(slot);
                    }
                }
                let mut action = Action::Pause;
                for slot in failed {
                    let step = self.with_flow(|f| {
                        f.on_reply(
                            &vm.runtime,
                            slot,
                            Err(CallError::Transport),
                            now_ms(),
                            &HostMetrics,
                        )
                    });
                    action = self.carry_out(vm, step);
                }
                action
            }
        }
    }

    fn dispatch(&mut self, vm: &Vm, call: &Outgoing) -> Result<(), usize> {
        let redis = &vm.runtime.config.redis;
        let mut headers: Vec<(&str, &str)> = vec![
            (":method", "POST"),
            (":path", "/"),
            (":authority", redis.authority.as_str()),
            ("content-type", "text/plain"),
        ];
        if let Some(auth) = &redis.authorization {
            headers.push(("authorization", auth.as_str()));
        }
        match hostcalls::dispatch_http_call(
            &redis.cluster,
            headers,
            Some(&call.body),
            vec![],
            Duration::from_millis(redis.timeout_ms),
        ) {
            Ok(token) => {
                self.calls.insert(token, call.slot);
                Ok(())
            }
            Err(status) => {
                log::warn!(
                    "cannot dispatch to cluster {}: {status:?}",
                    redis.cluster
                );
                Err(call.slot)
            }
        }
    }

    fn unregister(&self, vm: &Vm) {
        if let Ok(mut waiting) = vm.waiting.try_borrow_mut() {
            waiting.remove(&self.context_id);
        }
    }

    fn is_waiting(&self) -> bool {
        self.flow
            .try_borrow()
            .map(|f| f.deadline_ms().is_some())
            .unwrap_or(false)
    }
}

fn request_headers() -> Vec<(String, String)> {
    hostcalls::get_map_bytes(MapType::HttpRequestHeaders)
        .unwrap_or_default()
        .into_iter()
        .map(|(n, v)| (n, String::from_utf8_lossy(&v).into_owned()))
        .collect()
}

fn source_address() -> Option<String> {
    let bytes = hostcalls::get_property(vec!["source", "address"]).ok()??;
    String::from_utf8(bytes).ok()
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(vm) = self.vm.clone() else {
            return Action::Continue;
        };
        let req = Request::from_headers(request_headers(), source_address().as_deref());
        let nonce = match vm.tokens.try_borrow_mut() {
            Ok(mut t) => t.token(),
            Err(_) => format!("{}-{}", self.context_id, now_ms()),
        };
        let step =
            self.with_flow(|f| f.on_request(&vm.runtime, &req, &nonce, now_ms(), &HostMetrics));
        self.carry_out(&vm, step)
    }

    fn on_http_request_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        // While headers are held for a decision, hold the body too: returning Continue here
        // would let Envoy pass the headers on before the decision.
        if self.is_waiting() {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.is_waiting() {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let headers: Vec<(String, String)> = match self.flow.try_borrow() {
            Ok(f) => f.response_headers().to_vec(),
            Err(_) => Vec::new(),
        };
        for (name, value) in &headers {
            let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value);
        }
        Action::Continue
    }
}

impl Drop for Filter {
    fn drop(&mut self) {
        if let Some(vm) = &self.vm {
            self.unregister(vm);
        }
    }
}
