//! gRPC's status codes (`grpc/status.h`): their numbers and names, as the configuration
//! writes them (`retryable_grpc_codes`) and the filter's gRPC answers carry them.

/// gRPC status codes by number (`grpc/status.h`), index = code.
const NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

pub(crate) const OK: u32 = 0;
pub(crate) const INVALID_ARGUMENT: u32 = 3;
pub(crate) const DEADLINE_EXCEEDED: u32 = 4;
pub(crate) const ALREADY_EXISTS: u32 = 6;
pub(crate) const RESOURCE_EXHAUSTED: u32 = 8;
pub(crate) const FAILED_PRECONDITION: u32 = 9;
pub(crate) const ABORTED: u32 = 10;
pub(crate) const UNAVAILABLE: u32 = 14;
pub(crate) const UNAUTHENTICATED: u32 = 16;

/// The name of a code (`UNAVAILABLE`), if it is one of the 17.
pub(crate) fn code_name(code: u32) -> Option<&'static str> {
    NAMES.get(usize::try_from(code).ok()?).copied()
}

/// A code written as a name (`"UNAVAILABLE"`, any case) or its number (`"14"`).
pub(crate) fn parse_code(text: &str) -> Option<u32> {
    let t = text.trim();
    if let Ok(n) = t.parse::<u32>() {
        return code_name(n).map(|_| n);
    }
    NAMES
        .iter()
        .position(|n| n.eq_ignore_ascii_case(t))
        .and_then(|i| u32::try_from(i).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn names_and_numbers() {
        for (text, want) in [
            ("UNAVAILABLE", Some(14)),
            ("unavailable", Some(14)),
            ("14", Some(14)),
            (" 4 ", Some(4)),
            ("OK", Some(0)),
            ("UNAUTHENTICATED", Some(16)),
            ("16", Some(16)),
            ("17", None),
            ("-1", None),
            ("UNAVAILABLE_", None),
            ("", None),
        ] {
            assert_eq!(parse_code(text), want, "{text:?}");
        }
        assert_eq!(code_name(8), Some("RESOURCE_EXHAUSTED"));
        assert_eq!(code_name(17), None);
    }
}
