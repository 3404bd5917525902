//! The entry points the host calls (the proxy-wasm ABI 0.2.1's exports) and the table of this
//! VM's contexts they dispatch to: its root contexts (one per plugin sharing the VM) and its
//! streams, each keyed by the host's context id. A callback copies its context out of the
//! table (a reference count) and runs without the table borrowed, so a host call that calls
//! back into the module finds it free. A callback for a context the table does not know (none
//! can come from the host) does nothing and lets the stream go on: never a panic.
//!
//! The module exports no `proxy_on_log`, which the filter has no use for: the host skips a
//! callback the module does not export.

use super::abi::{self, LogLevel};
use super::{Filter, Root};
use crate::flow::worker::Action;
use crate::ids::ByToken;
use std::cell::RefCell;
use std::fmt::Write;

#[derive(Default)]
struct Contexts {
    roots: ByToken<Root>,
    streams: ByToken<Filter>,
}

thread_local! {
    static CONTEXTS: RefCell<Contexts> = RefCell::new(Contexts::default());
}

/// What `f` reads from the table; `None` when it is borrowed (a callback inside a callback,
/// which the host does not make) or gone (the thread's end).
fn with<T>(f: impl FnOnce(&mut Contexts) -> Option<T>) -> Option<T> {
    CONTEXTS
        .try_with(|c| c.try_borrow_mut().ok().and_then(|mut c| f(&mut c)))
        .ok()
        .flatten()
}

fn stream(context: u32) -> Option<Filter> {
    with(|c| c.streams.get(&context).cloned())
}

fn root(context: u32) -> Option<Root> {
    with(|c| c.roots.get(&context).cloned())
}

/// A stream's callback `f`, its action as the host's (Continue for a stream not in the table).
fn on_stream(context: u32, f: impl FnOnce(&Filter) -> Action) -> u32 {
    stream(context).map_or(CONTINUE, |s| host(f(&s)))
}

/// Runs the module's constructors (the WASI reactor's contract, which the host honours by
/// calling `_initialize` first), then sets up the log and what a panic says.
#[no_mangle]
pub extern "C" fn _initialize() {
    extern "C" {
        fn __wasm_call_ctors();
    }
    // SAFETY: called once, by the host, before any other export: the reactor's contract.
    unsafe { __wasm_call_ctors() };
    if log::set_logger(&HostLog).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
    std::panic::set_hook(Box::new(|info| {
        abi::log(LogLevel::Critical, &format!("panicked: {info}"));
    }));
    crate::heap::on_failure(out_of_memory);
}

thread_local! {
    /// This VM's `memory_budget`, for the line an allocation failure logs (0: not configured).
    static BUDGET: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Remembers the budget the configuration set, for [`out_of_memory`].
pub(super) fn set_budget(bytes: u64) {
    BUDGET.with(|b| b.set(bytes));
}

/// An allocation failed outside a `try_reserve`: the VM's memory could not grow. On a stable
/// toolchain Rust aborts the VM right after (an `unreachable` trap); this says so first, at
/// error level and with the cause, without allocating (there is no memory to allocate).
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
    abi::log(LogLevel::Error, line.as_str());
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

#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root: u32, _size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(context: u32, size: usize) -> u32 {
    let Some(mut r) = root(context) else {
        return 0;
    };
    let ok = r.on_configure(size);
    with(|c| c.roots.insert(context, r));
    u32::from(ok)
}

/// A root context (no parent) or a stream of the root `parent`.
#[no_mangle]
pub extern "C" fn proxy_on_context_create(context: u32, parent: u32) {
    if parent == 0 {
        with(|c| c.roots.insert(context, Root::default()));
        return;
    }
    let Some(r) = root(parent) else {
        return;
    };
    let f = r.stream(context);
    with(|c| c.streams.insert(context, f));
}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(context: u32, _headers: usize, eos: u32) -> u32 {
    on_stream(context, |f| f.on_request_headers(eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(context: u32, size: usize, eos: u32) -> u32 {
    on_stream(context, |f| f.on_request_body(size, eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(context: u32, _trailers: usize) -> u32 {
    on_stream(context, Filter::on_request_trailers)
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(context: u32, _headers: usize, eos: u32) -> u32 {
    on_stream(context, |f| f.on_response_headers(eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(context: u32, size: usize, eos: u32) -> u32 {
    on_stream(context, |f| f.on_response_body(size, eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_trailers(context: u32, _trailers: usize) -> u32 {
    on_stream(context, Filter::on_response_trailers)
}

/// The answer to a callout, delivered to the context that sent it (a stream or a root).
#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(
    context: u32,
    token: u32,
    _headers: usize,
    body_size: usize,
    _trailers: usize,
) {
    if let Some(f) = stream(context) {
        f.on_http_call_response(token, body_size);
    } else if let Some(r) = root(context) {
        r.on_http_call_response(token, body_size);
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_queue_ready(context: u32, queue: u32) {
    if let Some(r) = root(context) {
        r.on_queue_ready(queue);
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(context: u32) {
    if let Some(r) = root(context) {
        r.on_tick();
    }
}

/// The stream is done (or the root is going away): the host may delete it at once.
#[no_mangle]
pub extern "C" fn proxy_on_done(context: u32) -> u32 {
    if let Some(f) = stream(context) {
        f.on_done();
    }
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(context: u32) {
    let removed = with(|c| match c.streams.remove(&context) {
        Some(f) => Some(Some(f)),
        None => c.roots.remove(&context).map(|_| None),
    });
    if let Some(Some(f)) = removed {
        f.close();
    }
}

/// The callbacks' answer that lets the stream go on (the ABI's `Action::Continue`).
const CONTINUE: u32 = 0;
/// The ABI's `Action::Pause`: the host holds the stream until it is resumed.
const PAUSE: u32 = 1;

/// The worker's action as the host's.
fn host(action: Action) -> u32 {
    match action {
        Action::Continue => CONTINUE,
        Action::Pause => PAUSE,
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
        abi::log(level, &record.args().to_string());
    }

    fn flush(&self) {}
}
