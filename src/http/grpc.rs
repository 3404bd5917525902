//! gRPC over the guard: which requests are gRPC, how a response's outcome is read from its
//! `grpc-status`, and which status code the filter's own answers carry. Pure logic.
//!
//! The status codes are `support::grpc_status`'s (the configuration reads their names too);
//! the ones the filter answers with are named here as well.

pub(crate) use crate::support::grpc_status::{
    ABORTED, ALREADY_EXISTS, DEADLINE_EXCEEDED, FAILED_PRECONDITION, INVALID_ARGUMENT, OK,
    RESOURCE_EXHAUSTED, UNAUTHENTICATED, UNAVAILABLE,
};

/// The response trailer (or trailers-only header) holding the status code.
pub(crate) const STATUS: &str = "grpc-status";
/// The response trailer (or trailers-only header) holding the status message.
pub(crate) const MESSAGE: &str = "grpc-message";

/// Whether a request is gRPC the way Envoy decides it (and so answers it with gRPC local
/// replies): `content-type` is `application/grpc`, or starts with `application/grpc+` or
/// `application/grpc;`. gRPC-Web (`application/grpc-web…`) is not.
pub(crate) fn is_grpc_content_type(content_type: Option<&str>) -> bool {
    let Some(ct) = content_type else {
        return false;
    };
    let ct = ct.trim();
    let prefix = "application/grpc";
    match ct.get(..prefix.len()) {
        Some(head) if head.eq_ignore_ascii_case(prefix) => {
            matches!(ct.as_bytes().get(prefix.len()), None | Some(b'+' | b';'))
        }
        _ => false,
    }
}

/// The `grpc-status` among `headers` (a trailers-only response's headers, or trailers):
/// `None` when absent, repeated or not a number. A number past the 17 known codes is
/// returned as is (clients read it as UNKNOWN).
pub(crate) fn status_of(headers: &[(String, String)]) -> Option<u32> {
    let mut values = headers.iter().filter(|(n, _)| n == STATUS);
    let (_, v) = values.next()?;
    if values.next().is_some() {
        return None;
    }
    v.trim().parse().ok()
}

/// `grpc-message` encoding (gRPC over HTTP/2: percent-encode every byte outside
/// printable ASCII, and `%` itself).
pub(crate) fn encode_message(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            const HEX: &[u8; 16] = b"0123456789ABCDEF";
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 15)]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn grpc_content_types() {
        for (ct, want) in [
            (Some("application/grpc"), true),
            (Some("application/grpc+proto"), true),
            (Some("application/grpc;charset=utf-8"), true),
            (Some("Application/GRPC"), true),
            (Some("application/grpc-web"), false),
            (Some("application/grpc-web+proto"), false),
            (Some("application/grpcx"), false),
            (Some("application/json"), false),
            (Some("appl"), false),
            (None, false),
        ] {
            assert_eq!(is_grpc_content_type(ct), want, "{ct:?}");
        }
    }

    #[test]
    fn reads_grpc_status() {
        let h = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect()
        };
        for (headers, want) in [
            (h(&[(":status", "200"), ("grpc-status", "14")]), Some(14)),
            (h(&[("grpc-status", "0"), ("grpc-message", "x")]), Some(0)),
            (h(&[("grpc-status", " 5 ")]), Some(5)),
            (h(&[("grpc-status", "99")]), Some(99)),
            (h(&[("grpc-status", "x")]), None),
            (h(&[("grpc-status", "1"), ("grpc-status", "2")]), None),
            (h(&[(":status", "200")]), None),
            (h(&[]), None),
        ] {
            assert_eq!(status_of(&headers), want, "{headers:?}");
        }
    }

    #[test]
    fn message_encoding() {
        for (raw, want) in [
            ("plain text", "plain text"),
            ("100%", "100%25"),
            ("ü", "%C3%BC"),
            ("a\nb", "a%0Ab"),
            ("\"quoted\" ~", "\"quoted\" ~"),
        ] {
            assert_eq!(encode_message(raw), want, "{raw:?}");
        }
    }
}
