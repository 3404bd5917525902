//! The proxy-wasm SDK's entry: `main!` sets up the log and what a panic says, and the SDK's
//! dispatcher hands every callback to this plugin's root context ([`RootCtx`]) or to one of
//! its streams ([`StreamCtx`]). Both only translate: the work is the adapter's ([`Root`],
//! [`Filter`]), which hands it to the worker.
//!
//! The module exports no `proxy_on_log` of its own use: the SDK's default does nothing.

use crate::engine::worker::Action;
use crate::host::sdk::{self, LogLevel};
use crate::host::{Filter, Root};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action as HostAction, ContextType};
use std::fmt::Write;

proxy_wasm::main! {{
    if log::set_logger(&HostLog).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
    std::panic::set_hook(Box::new(|info| {
        sdk::log(LogLevel::Critical, &format!("panicked: {info}"));
    }));
    crate::support::heap::on_failure(out_of_memory);
    proxy_wasm::set_root_context(|_| Box::new(RootCtx(Root::default())));
}}

thread_local! {
    /// This VM's `memory_budget`, for the line an allocation failure logs (0: not configured).
    static BUDGET: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Remembers the budget the configuration set, for [`out_of_memory`].
pub(super) fn set_budget(bytes: u64) {
    BUDGET.with(|b| b.set(bytes));
}

/// An allocation failed outside a `try_reserve`: the VM's memory could not grow (the SDK's
/// `proxy_on_memory_allocate`, which copies a host buffer in, is one: it cannot fail softly).
/// On a stable toolchain Rust aborts the VM right after (an `unreachable` trap); this says so
/// first, at error level and with the cause, without allocating (there is no memory to
/// allocate).
fn out_of_memory(size: usize, held: usize) {
    let budget = BUDGET.try_with(std::cell::Cell::get).unwrap_or(0);
    let mut line = StackLine::default();
    let _ = write!(
        line,
        "out of memory: cannot allocate {size} bytes with {held} bytes held on the heap \
         (memory_budget {budget}); this worker's Wasm VM aborts now, and Envoy answers its \
         requests as the filter's failure_policy says (FAIL_CLOSED: 503 until Envoy restarts, \
         FAIL_RELOAD: a new VM)"
    );
    sdk::log(LogLevel::Error, line.as_str());
}

/// A log line written on the stack, cut at its capacity.
struct StackLine {
    buf: [u8; 400],
    len: usize,
}

impl Default for StackLine {
    fn default() -> StackLine {
        StackLine {
            buf: [0; 400],
            len: 0,
        }
    }
}

impl StackLine {
    fn as_str(&self) -> &str {
        let bytes = self.buf.get(..self.len).unwrap_or_default();
        match std::str::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => std::str::from_utf8(bytes.get(..e.valid_up_to()).unwrap_or_default())
                .unwrap_or_default(),
        }
    }
}

impl std::fmt::Write for StackLine {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let room = self.buf.len() - self.len;
        let n = s.len().min(room);
        if let (Some(to), Some(from)) = (
            self.buf.get_mut(self.len..self.len + n),
            s.as_bytes().get(..n),
        ) {
            to.copy_from_slice(from);
            self.len += n;
        }
        Ok(())
    }
}

/// A root context: one per plugin sharing this VM.
struct RootCtx(Root);

impl Context for RootCtx {
    /// An answer to a callout the root sent.
    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, _: usize) {
        self.0.on_http_call_response(token, headers, body_size);
    }
}

impl RootContext for RootCtx {
    fn on_configure(&mut self, size: usize) -> bool {
        self.0.on_configure(size)
    }

    fn on_tick(&mut self) {
        self.0.on_tick();
    }

    fn on_queue_ready(&mut self, queue: u32) {
        self.0.on_queue_ready(queue);
    }

    fn create_http_context(&self, context: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(StreamCtx(self.0.stream(context))))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One HTTP stream of the plugin.
struct StreamCtx(Filter);

/// The worker's action as the host's.
fn host_action(action: Action) -> HostAction {
    match action {
        Action::Continue => HostAction::Continue,
        Action::Pause => HostAction::Pause,
    }
}

impl Context for StreamCtx {
    /// An answer to a callout this stream sent.
    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, _: usize) {
        self.0.on_http_call_response(token, headers, body_size);
    }

    /// The stream is done: the host may delete it at once.
    fn on_done(&mut self) -> bool {
        self.0.on_done();
        true
    }
}

impl HttpContext for StreamCtx {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> HostAction {
        host_action(self.0.on_request_headers(end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> HostAction {
        host_action(self.0.on_request_body(body_size, end_of_stream))
    }

    fn on_http_request_trailers(&mut self, _: usize) -> HostAction {
        host_action(self.0.on_request_trailers())
    }

    fn on_http_response_headers(&mut self, _: usize, end_of_stream: bool) -> HostAction {
        host_action(self.0.on_response_headers(end_of_stream))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> HostAction {
        host_action(self.0.on_response_body(body_size, end_of_stream))
    }

    fn on_http_response_trailers(&mut self, _: usize) -> HostAction {
        host_action(self.0.on_response_trailers())
    }
}

/// The host deleted the stream's context (the SDK drops it): the worker forgets it.
impl Drop for StreamCtx {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// The `log` crate's records, written to the host's log.
struct HostLog;

impl log::Log for HostLog {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Error => LogLevel::Error,
            log::Level::Warn => LogLevel::Warn,
            log::Level::Info => LogLevel::Info,
            log::Level::Debug => LogLevel::Debug,
            log::Level::Trace => LogLevel::Trace,
        };
        sdk::log(level, &record.args().to_string());
    }

    fn flush(&self) {}
}
