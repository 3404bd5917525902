//! The proxy-wasm ABI (0.2.1) as the filter uses it, without the Rust SDK: the host calls,
//! each returning the host's status instead of panicking on one it does not expect (the SDK's
//! `hostcalls` panic, and a panic aborts the VM for every request of the worker), and the
//! buffers the host hands over, which it allocates through [`proxy_on_memory_allocate`].
//! The entry points the host calls are in `exports.rs`.

use std::time::Duration;

/// The host's header maps (the ABI's `MapType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum MapType {
    RequestHeaders = 0,
    ResponseHeaders = 2,
    ResponseTrailers = 3,
    CallResponseHeaders = 6,
}

/// The host's buffers (the ABI's `BufferType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum BufferType {
    HttpRequestBody = 0,
    HttpResponseBody = 1,
    HttpCallResponseBody = 4,
    PluginConfiguration = 7,
}

/// The host's metric kinds (the ABI's `MetricType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum MetricType {
    Counter = 0,
    Histogram = 2,
}

/// The host's log levels (the ABI's `LogLevel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u32)]
pub enum LogLevel {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

/// The host's status for an argument it refuses (a callout to a cluster it does not know).
pub const BAD_ARGUMENT: u32 = 2;
const NOT_FOUND: u32 = 1;
const EMPTY: u32 = 7;

/// A host status other than Ok.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Refused(pub u32);

/// The ABI's name for the status (`BadArgument`), or its number.
impl std::fmt::Debug for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.0 {
            NOT_FOUND => "NotFound",
            BAD_ARGUMENT => "BadArgument",
            3 => "SerializationFailure",
            4 => "ParseFailure",
            EMPTY => "Empty",
            8 => "CasMismatch",
            10 => "InternalFailure",
            n => return write!(f, "status {n}"),
        };
        f.write_str(name)
    }
}

const OK: u32 = 0;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: LogLevel, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_register_shared_queue(
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_enqueue_shared_queue(queue_id: u32, value_data: *const u8, value_size: usize) -> u32;
    fn proxy_dequeue_shared_queue(
        queue_id: u32,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: MetricType,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
    fn proxy_http_call(
        upstream_data: *const u8,
        upstream_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        body_data: *const u8,
        body_size: usize,
        trailers_data: *const u8,
        trailers_size: usize,
        timeout_milliseconds: u32,
        return_token: *mut u32,
    ) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_replace_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
    ) -> u32;
    fn proxy_add_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
}

fn check(status: u32) -> Result<(), Refused> {
    if status == OK {
        Ok(())
    } else {
        Err(Refused(status))
    }
}

pub fn set_header(map: MapType, name: &str, value: &str) -> Result<(), Refused> {
    // SAFETY: pointers and lengths come from live `&str`s; the host copies them.
    check(unsafe {
        proxy_replace_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

pub fn remove_header(map: MapType, name: &str) -> Result<(), Refused> {
    // SAFETY: as above.
    check(unsafe { proxy_remove_header_map_value(map, name.as_ptr(), name.len()) })
}

pub fn add_header(map: MapType, name: &str, value: &str) -> Result<(), Refused> {
    // SAFETY: as above.
    check(unsafe {
        proxy_add_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

/// The host's allocations of what it hands over: a `Vec<u8>`'s buffer of capacity `size`,
/// which [`Returned::take`] owns again. (A zero size gets a dangling pointer, which the host
/// writes nothing to.)
///
/// A large one is asked fallibly: when the VM's memory cannot take it (or may not grow for
/// it, see [`crate::heap`]) the host gets a null pointer and fails the call that asked, which
/// the caller sees as a refusal, never an abort of the VM. A small one may always grow it.
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let mut buf = Vec::<u8>::new();
    if size <= crate::memory::SMALL {
        buf.reserve_exact(size);
    } else if crate::heap::fallibly(|| buf.try_reserve_exact(size)).is_err() {
        return std::ptr::null_mut();
    }
    let ptr = buf.as_mut_ptr();
    std::mem::forget(buf);
    ptr
}

/// The two slots a host call returns a buffer through.
struct Returned {
    data: *mut u8,
    size: usize,
}

impl Returned {
    fn new() -> Self {
        Returned {
            data: std::ptr::null_mut(),
            size: 0,
        }
    }

    /// The buffer the host wrote, if any, after a call that answered `status`.
    fn take(self, status: u32) -> Result<Option<Vec<u8>>, Refused> {
        check(status)?;
        if self.data.is_null() {
            return Ok(None);
        }
        // SAFETY: the host wrote `data`, which it allocated through proxy_on_memory_allocate
        // (self.size): a Vec's buffer of capacity `size`, all of it filled.
        Ok(Some(unsafe {
            Vec::from_raw_parts(self.data, self.size, self.size)
        }))
    }
}

/// A header map in the host's encoding (see [`crate::headers::Headers::decode`]); empty
/// when the host has none to give.
pub fn header_map_bytes(map: MapType) -> Vec<u8> {
    let mut r = Returned::new();
    // SAFETY: the two return slots outlive the call.
    let status = unsafe { proxy_get_header_map_pairs(map, &mut r.data, &mut r.size) };
    r.take(status).ok().flatten().unwrap_or_default()
}

/// One header's value; `None` when the map has no such header or the host refuses.
pub fn header_value(map: MapType, name: &str) -> Option<Vec<u8>> {
    let mut r = Returned::new();
    // SAFETY: `name` is a live `&str` the host copies; the return slots outlive the call.
    let status = unsafe {
        proxy_get_header_map_value(map, name.as_ptr(), name.len(), &mut r.data, &mut r.size)
    };
    r.take(status).ok().flatten()
}

/// Up to `max` bytes of a buffer from its start; empty when there is none or the host refuses.
pub fn buffer(kind: BufferType, max: usize) -> Vec<u8> {
    buffer_or_refusal(kind, max).unwrap_or_default()
}

/// Up to `max` bytes of a buffer from its start (empty when the host has none: the plugin's
/// configuration may be empty), or the host's refusal.
pub fn buffer_or_refusal(kind: BufferType, max: usize) -> Result<Vec<u8>, Refused> {
    let mut r = Returned::new();
    // SAFETY: the return slots outlive the call.
    let status = unsafe { proxy_get_buffer_bytes(kind, 0, max, &mut r.data, &mut r.size) };
    match r.take(status) {
        Err(Refused(NOT_FOUND)) => Ok(Vec::new()),
        other => other.map(Option::unwrap_or_default),
    }
}

/// A property of the stream or the host (`path`'s segments, e.g. `["source", "address"]`).
pub fn property(path: &[&str]) -> Option<Vec<u8>> {
    let joined = path.join("\0");
    let mut r = Returned::new();
    // SAFETY: the path is a live buffer the host copies; the return slots outlive the call.
    let status =
        unsafe { proxy_get_property(joined.as_ptr(), joined.len(), &mut r.data, &mut r.size) };
    r.take(status).ok().flatten()
}

/// The shared data under `name` and its version (the host's CAS); `None` when there is none
/// or the host refuses.
pub fn shared_data(name: &str) -> Option<(Vec<u8>, u32)> {
    let mut r = Returned::new();
    let mut cas: u32 = 0;
    // SAFETY: `name` is a live `&str` the host copies; the return slots outlive the call.
    let status = unsafe {
        proxy_get_shared_data(
            name.as_ptr(),
            name.len(),
            &mut r.data,
            &mut r.size,
            &mut cas,
        )
    };
    Some((r.take(status).ok()??, cas))
}

/// Registers this VM's shared queue `name`; its id.
pub fn register_queue(name: &str) -> Result<u32, Refused> {
    let mut id = 0;
    // SAFETY: `name` is a live `&str` the host copies; the id's slot outlives the call.
    check(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn enqueue(queue: u32, value: &[u8]) -> Result<(), Refused> {
    // SAFETY: a live buffer the host copies.
    check(unsafe { proxy_enqueue_shared_queue(queue, value.as_ptr(), value.len()) })
}

/// Takes the queue's next item; `None` when it is empty (or the host refuses).
pub fn dequeue(queue: u32) -> Option<Vec<u8>> {
    let mut r = Returned::new();
    // SAFETY: the return slots outlive the call.
    let status = unsafe { proxy_dequeue_shared_queue(queue, &mut r.data, &mut r.size) };
    if status == EMPTY {
        return None;
    }
    // An item the host hands over empty is an item all the same.
    r.take(status).ok().map(Option::unwrap_or_default)
}

pub fn define_metric(kind: MetricType, name: &str) -> Result<u32, Refused> {
    let mut id = 0;
    // SAFETY: `name` is a live `&str` the host copies; the id's slot outlives the call.
    check(unsafe { proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn increment_metric(id: u32, by: i64) {
    // SAFETY: integer arguments only.
    let _ = unsafe { proxy_increment_metric(id, by) };
}

pub fn record_metric(id: u32, value: u64) {
    // SAFETY: integer arguments only.
    let _ = unsafe { proxy_record_metric(id, value) };
}

/// The host's time since the epoch; `None` if it cannot say.
pub fn now() -> Option<Duration> {
    let mut ns = 0u64;
    // SAFETY: the slot outlives the call.
    check(unsafe { proxy_get_current_time_nanoseconds(&mut ns) }).ok()?;
    Some(Duration::from_nanos(ns))
}

pub fn set_tick_period(ms: u64) {
    // SAFETY: an integer argument only.
    let _ = unsafe { proxy_set_tick_period_milliseconds(u32::try_from(ms).unwrap_or(u32::MAX)) };
}

/// Makes `context` the one the following host calls act on (a stream the root resumes).
pub fn set_effective_context(context: u32) -> Result<(), Refused> {
    // SAFETY: an integer argument only.
    check(unsafe { proxy_set_effective_context(context) })
}

pub fn log(level: LogLevel, message: &str) {
    // SAFETY: a live `&str` the host copies.
    let _ = unsafe { proxy_log(level, message.as_ptr(), message.len()) };
}

/// Sends an HTTP call to `cluster`; its token, which comes back with its answer.
pub fn http_call(
    cluster: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<u32, Refused> {
    let map = serialize(headers);
    let trailers = NO_PAIRS;
    let timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
    let mut token = 0;
    // SAFETY: all pointers and lengths come from live buffers the host copies; the token's
    // slot outlives the call.
    check(unsafe {
        proxy_http_call(
            cluster.as_ptr(),
            cluster.len(),
            map.as_ptr(),
            map.len(),
            body.as_ptr(),
            body.len(),
            trailers.as_ptr(),
            trailers.len(),
            timeout_ms,
            &mut token,
        )
    })?;
    Ok(token)
}

/// Sets the shared data under `name` to `value` if its version is still `cas` (0: whatever
/// it is).
pub fn set_shared_data(name: &str, value: &[u8], cas: u32) -> Result<(), Refused> {
    // SAFETY: pointers and lengths come from live buffers; the host copies them.
    check(unsafe {
        proxy_set_shared_data(name.as_ptr(), name.len(), value.as_ptr(), value.len(), cas)
    })
}

/// Resumes the request (`response: false`) or the response of the effective context.
pub fn resume(response: bool) -> Result<(), Refused> {
    // SAFETY: plain integer argument (StreamType::HttpRequest = 0, HttpResponse = 1).
    check(unsafe { proxy_continue_stream(u32::from(response)) })
}

/// Answers the effective context's stream locally. `grpc_status` (0-16, or -1 for none) is
/// the status the host gives a gRPC request's answer when the headers carry no `grpc-status`;
/// with -1 it maps the HTTP status.
pub fn send_local_response(
    status: u32,
    headers: &[(&str, &str)],
    body: &[u8],
    grpc_status: i32,
) -> Result<(), Refused> {
    let map = serialize(headers);
    // SAFETY: all pointers and lengths come from live buffers; the host copies them.
    check(unsafe {
        proxy_send_local_response(
            status,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            map.as_ptr(),
            map.len(),
            grpc_status,
        )
    })
}

/// An empty header map in the host's encoding (a count of 0): a callout's trailers.
const NO_PAIRS: [u8; 4] = [0; 4];

/// The host's header-map encoding: count, (name length, value length) pairs, then each name
/// and value followed by a NUL.
fn serialize(map: &[(&str, &str)]) -> Vec<u8> {
    let size = 4 + map
        .iter()
        .map(|(n, v)| n.len() + v.len() + 10)
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&u32::try_from(map.len()).unwrap_or(0).to_le_bytes());
    for (name, value) in map {
        out.extend_from_slice(&u32::try_from(name.len()).unwrap_or(0).to_le_bytes());
        out.extend_from_slice(&u32::try_from(value.len()).unwrap_or(0).to_le_bytes());
    }
    for (name, value) in map {
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.extend_from_slice(value.as_bytes());
        out.push(0);
    }
    out
}
