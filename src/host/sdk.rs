//! The host calls the adapter makes, through the proxy-wasm SDK's `hostcalls`, each returning
//! what the adapter needs and never panicking on a status Envoy can answer.
//!
//! The SDK's `hostcalls` return `Result` for the statuses each call documents and panic on any
//! other (a panic aborts the VM for every request of the worker). Each call below is one whose
//! other statuses Envoy 1.40 never answers (its `source/extensions/common/wasm/context.cc`),
//! except four kinds, which go through the host's own functions here:
//!
//! - a change to a header map (`add`, `replace`, `remove`): Envoy answers `BadArgument` when
//!   the map is no longer there (a request's headers once they went on), which the SDK's
//!   `add_map_value` and `set_map_value` panic on;
//! - a local reply with both an HTTP and a gRPC status: the SDK's `send_http_response` sends no
//!   gRPC status and its `send_grpc_response` no HTTP status, and a gRPC client is answered
//!   with an explicit code (`429` -> `RESOURCE_EXHAUSTED`, where Envoy would map `429` to
//!   `UNAVAILABLE`);
//! - the setting of a property (the request's decision): Envoy answers `NotFound` when the
//!   context has no stream and `BadArgument` when the property was declared read-only and is
//!   set already, which the SDK's `set_property` panics on;
//! - the read of a whole header map, on every request: the SDK's readers allocate two buffers
//!   per header (the host hands the map over as one, which `Headers::decode` keeps as one).
//!
//! A callout's answer headers are read only when the host handed some: on a failed callout
//! (connection reset) Envoy has no such map and answers `BadArgument`.

use proxy_wasm::hostcalls;
pub(crate) use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status};
use std::time::{Duration, UNIX_EPOCH};

/// A host call the host refused, with its status (shown as the status alone).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refused(pub(crate) Status);

impl std::fmt::Debug for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

fn check(status: Status) -> Result<(), Refused> {
    match status {
        Status::Ok => Ok(()),
        other => Err(Refused(other)),
    }
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_replace_header_map_value(
        map: MapType,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> Status;
    fn proxy_remove_header_map_value(map: MapType, key: *const u8, key_size: usize) -> Status;
    fn proxy_add_header_map_value(
        map: MapType,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> Status;
    fn proxy_set_property(
        path: *const u8,
        path_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> Status;
    fn proxy_get_header_map_pairs(
        map: MapType,
        return_data: *mut *mut u8,
        return_size: *mut usize,
    ) -> Status;
    fn proxy_send_local_response(
        status_code: u32,
        details: *const u8,
        details_size: usize,
        body: *const u8,
        body_size: usize,
        headers: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> Status;
}

pub(crate) fn set_header(map: MapType, name: &str, value: &str) -> Result<(), Refused> {
    // SAFETY: pointers and lengths come from live `&str`s; the host copies them.
    check(unsafe {
        proxy_replace_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

pub(crate) fn remove_header(map: MapType, name: &str) -> Result<(), Refused> {
    // SAFETY: as above.
    check(unsafe { proxy_remove_header_map_value(map, name.as_ptr(), name.len()) })
}

pub(crate) fn add_header(map: MapType, name: &str, value: &str) -> Result<(), Refused> {
    // SAFETY: as above.
    check(unsafe {
        proxy_add_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

/// Sets the effective context's property `name` (one path segment) to `value`: Envoy keeps
/// it in the stream's filter state as `wasm.<name>`, where access logs and RBAC read it.
pub(crate) fn set_property(name: &str, value: &[u8]) -> Result<(), Refused> {
    // SAFETY: as above. A path of one segment is the segment's bytes alone.
    check(unsafe { proxy_set_property(name.as_ptr(), name.len(), value.as_ptr(), value.len()) })
}

/// Answers the effective context's stream locally. `grpc_status` (0-16, or -1 for none) is
/// the status the host gives a gRPC request's answer when the headers carry no `grpc-status`;
/// with -1 it maps the HTTP status. (Envoy always answers `Ok`: the reply is sent after the
/// callback returns.)
pub(crate) fn send_local_response(
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

/// A header map in the host's encoding (see [`crate::http::headers::Headers::decode`]), as one
/// buffer; empty when the host has none to give. The host's own import: the SDK's `get_map`
/// and `get_map_bytes` decode every name and value into buffers of their own (two per
/// header), on every request, and panic on a name that is not UTF-8.
pub(crate) fn header_map_bytes(map: MapType) -> Vec<u8> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the two return slots outlive the call.
    let status = unsafe { proxy_get_header_map_pairs(map, &mut data, &mut size) };
    if status != Status::Ok || data.is_null() {
        return Vec::new();
    }
    // SAFETY: the host wrote `data`, which it allocated through the SDK's
    // proxy_on_memory_allocate(size): a boxed slice of `size` bytes, all of it filled.
    unsafe { Vec::from_raw_parts(data, size, size) }
}

/// One header's value; `None` when the map has no such header. Envoy answers `Ok`,
/// `NotFound`, or `BadArgument` for a map it does not have, which the caller rules out.
pub(crate) fn header_value(map: MapType, name: &str) -> Option<Vec<u8>> {
    hostcalls::get_map_value_bytes(map, name).ok().flatten()
}

/// Up to `max` bytes of a buffer from its start; empty when there is none (`NotFound`).
pub(crate) fn buffer(kind: BufferType, max: usize) -> Vec<u8> {
    hostcalls::get_buffer(kind, 0, max)
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// A property of the stream or the host (`path`'s segments, e.g. `["source", "address"]`).
pub(crate) fn property(path: &[&str]) -> Option<Vec<u8>> {
    hostcalls::get_property(path.to_vec()).ok().flatten()
}

/// The shared data under `name` and its version (the host's CAS); `None` when there is none.
pub(crate) fn shared_data(name: &str) -> Option<(Vec<u8>, u32)> {
    match hostcalls::get_shared_data(name) {
        Ok((Some(value), Some(cas))) => Some((value, cas)),
        _ => None,
    }
}

/// Sets the shared data under `name` to `value` if its version is still `cas` (0: whatever
/// it is).
pub(crate) fn set_shared_data(name: &str, value: &[u8], cas: u32) -> Result<(), Refused> {
    let cas = (cas != 0).then_some(cas);
    hostcalls::set_shared_data(name, Some(value), cas).map_err(Refused)
}

/// Registers this VM's shared queue `name`; its id.
pub(crate) fn register_queue(name: &str) -> Result<u32, Refused> {
    hostcalls::register_shared_queue(name).map_err(Refused)
}

pub(crate) fn enqueue(queue: u32, value: &[u8]) -> Result<(), Refused> {
    hostcalls::enqueue_shared_queue(queue, Some(value)).map_err(Refused)
}

/// Takes the queue's next item; `None` when it is empty.
pub(crate) fn dequeue(queue: u32) -> Option<Vec<u8>> {
    hostcalls::dequeue_shared_queue(queue).ok().flatten()
}

pub(crate) fn define_metric(kind: MetricType, name: &str) -> Result<u32, Refused> {
    hostcalls::define_metric(kind, name).map_err(Refused)
}

pub(crate) fn increment_metric(id: u32, by: i64) {
    let _ = hostcalls::increment_metric(id, by);
}

/// Records a histogram's sample (Envoy answers `Ok`, or `NotFound` for an unknown id).
pub(crate) fn record_metric(id: u32, value: u64) {
    let _ = hostcalls::record_metric(id, value);
}

/// The host's time since the epoch; `None` if it cannot say.
pub(crate) fn now() -> Option<Duration> {
    hostcalls::get_current_time()
        .ok()?
        .duration_since(UNIX_EPOCH)
        .ok()
}

pub(crate) fn set_tick_period(ms: u64) {
    let _ = hostcalls::set_tick_period(Duration::from_millis(ms));
}

/// Makes `context` the one the following host calls act on (a stream the root resumes).
pub(crate) fn set_effective_context(context: u32) -> Result<(), Refused> {
    hostcalls::set_effective_context(context).map_err(Refused)
}

pub(crate) fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, message);
}

/// Sends an HTTP call to `cluster`; its token, which comes back with its answer. Envoy answers
/// `BadArgument` for a cluster it does not know, `InternalFailure` for a call it cannot make.
pub(crate) fn http_call(
    cluster: &str,
    headers: Vec<(&str, &str)>,
    body: &[u8],
    timeout: Duration,
) -> Result<u32, Refused> {
    hostcalls::dispatch_http_call(cluster, headers, Some(body), Vec::new(), timeout)
        .map_err(Refused)
}

/// Resumes the request (`response: false`) or the response of the effective context.
pub(crate) fn resume(response: bool) -> Result<(), Refused> {
    let done = if response {
        hostcalls::resume_http_response()
    } else {
        hostcalls::resume_http_request()
    };
    done.map_err(Refused)
}
