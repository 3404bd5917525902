//! Host calls that the proxy-wasm SDK would turn into a panic when the host refuses them
//! (`hostcalls::*` panics on any status it does not expect, and a panic aborts the VM for every
//! request of the worker). These bindings return the host's status instead. They cover the
//! calls whose refusal depends on the stream's state: changing headers, resuming a stream,
//! answering locally; the read of a header map, whose decoding here cannot panic; and the
//! shared data, whose write is refused when another worker wrote first.

use proxy_wasm::types::MapType;

/// A host status other than Ok.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused(pub u32);

const OK: u32 = 0;

#[link(wasm_import_module = "env")]
extern "C" {
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

/// A header map in the host's encoding (see [`crate::headers::Headers::decode`]); empty
/// when the host has none to give.
pub fn header_map_bytes(map: MapType) -> Vec<u8> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the host writes a pointer to `size` bytes it allocated through this module's
    // `proxy_on_memory_allocate` (the SDK's: a boxed slice of exactly `size` bytes), which
    // this Vec now owns and frees.
    unsafe {
        if proxy_get_header_map_pairs(map, &mut data, &mut size) != OK || data.is_null() {
            return Vec::new();
        }
        Vec::from_raw_parts(data, size, size)
    }
}

/// The shared data under `name` and its version (the host's CAS); `None` when there is none
/// or the host refuses.
pub fn shared_data(name: &str) -> Option<(Vec<u8>, u32)> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    let mut cas: u32 = 0;
    // SAFETY: `name` is a live `&str` the host copies; the host writes a pointer to `size`
    // bytes it allocated through this module's `proxy_on_memory_allocate` (see
    // [`header_map_bytes`]), which this Vec now owns and frees.
    unsafe {
        let status =
            proxy_get_shared_data(name.as_ptr(), name.len(), &mut data, &mut size, &mut cas);
        if status != OK || data.is_null() {
            return None;
        }
        Some((Vec::from_raw_parts(data, size, size), cas))
    }
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
