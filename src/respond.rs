//! What the filter answers by itself: `application/problem+json` bodies (RFC 9457) and the
//! `Retry-After`, `RateLimit-Policy` and `RateLimit` headers
//! (draft-ietf-httpapi-ratelimit-headers-10).

use serde_json::{Map, Value};
use std::fmt::Write;

/// A response the filter sends instead of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResponse {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl LocalResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The problem types the filter emits; `type` is `urn:coordination-guard:problem:<slug>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    RateLimited,
    GuardUnavailable,
    MissingTenant,
    AmbiguousTenant,
    IdempotencyKeyMissing,
    IdempotencyKeyInvalid,
    RequestBodyTooLarge,
    RequestBodyTimeout,
    /// The same request is still being processed (409).
    IdempotencyKeyInUse,
    /// The key was used for a different request (422, or 409 by configuration).
    IdempotencyKeyConflict {
        status: u32,
    },
    /// Another request holds the lease on this resource (409).
    ResourceLocked,
    /// The request does not carry the lease's resource selector (400).
    LeaseResourceMissing,
}

impl Problem {
    pub fn status(self) -> u32 {
        match self {
            Problem::RateLimited => 429,
            Problem::GuardUnavailable => 503,
            Problem::MissingTenant => 401,
            Problem::AmbiguousTenant => 400,
            Problem::IdempotencyKeyMissing | Problem::IdempotencyKeyInvalid => 400,
            Problem::RequestBodyTooLarge => 413,
            Problem::RequestBodyTimeout => 408,
            Problem::IdempotencyKeyInUse => 409,
            Problem::IdempotencyKeyConflict { status } => status,
            Problem::ResourceLocked => 409,
            Problem::LeaseResourceMissing => 400,
        }
    }

    pub fn slug(self) -> &'static str {
        match self {
            Problem::RateLimited => "rate_limited",
            Problem::GuardUnavailable => "guard_unavailable",
            Problem::MissingTenant => "missing_tenant",
            Problem::AmbiguousTenant => "ambiguous_tenant",
            Problem::IdempotencyKeyMissing => "idempotency_key_missing",
            Problem::IdempotencyKeyInvalid => "idempotency_key_invalid",
            Problem::RequestBodyTooLarge => "request_body_too_large",
            Problem::RequestBodyTimeout => "request_body_timeout",
            Problem::IdempotencyKeyInUse => "idempotency_key_in_use",
            Problem::IdempotencyKeyConflict { .. } => "idempotency_key_conflict",
            Problem::ResourceLocked => "resource_locked",
            Problem::LeaseResourceMissing => "lease_resource_missing",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Problem::RateLimited => "Too Many Requests",
            Problem::GuardUnavailable => "Service Unavailable",
            Problem::MissingTenant => "Unauthorized",
            Problem::AmbiguousTenant => "Ambiguous Tenant",
            Problem::IdempotencyKeyMissing => "Idempotency-Key Missing",
            Problem::IdempotencyKeyInvalid => "Idempotency-Key Invalid",
            Problem::RequestBodyTooLarge => "Content Too Large",
            Problem::RequestBodyTimeout => "Request Timeout",
            Problem::IdempotencyKeyInUse => "Request In Progress",
            Problem::IdempotencyKeyConflict { .. } => "Idempotency-Key Reused",
            Problem::ResourceLocked => "Resource Locked",
            Problem::LeaseResourceMissing => "Lease Resource Missing",
        }
    }
}

/// A problem+json response. `extra` members are added to the body (e.g. `violated-policies`).
///
/// The body is written directly, members sorted by name as serde_json's `Map` keeps them (an
/// `extra` member named like a standard one replaces it): this runs for every rejected
/// request, and building a `Value` tree for five members costs more than the rest of it.
pub fn problem(
    kind: Problem,
    detail: &str,
    extra: Map<String, Value>,
    headers: Vec<(String, String)>,
) -> LocalResponse {
    let type_uri = format!("urn:coordination-guard:problem:{}", kind.slug());
    let status = kind.status().to_string();
    let standard = [
        ("detail", JsonText::Str(detail)),
        ("status", JsonText::Raw(&status)),
        ("title", JsonText::Str(kind.title())),
        ("type", JsonText::Str(&type_uri)),
    ];
    let mut members: Vec<(&str, JsonText<'_>)> = standard
        .into_iter()
        .filter(|(name, _)| !extra.contains_key(*name))
        .collect();
    members.extend(extra.iter().map(|(k, v)| (k.as_str(), JsonText::Value(v))));
    members.sort_by(|a, b| a.0.cmp(b.0));
    let mut body = Vec::with_capacity(256);
    body.push(b'{');
    for (i, (name, value)) in members.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        write_json_str(&mut body, name);
        body.push(b':');
        match value {
            JsonText::Str(s) => write_json_str(&mut body, s),
            JsonText::Raw(s) => body.extend_from_slice(s.as_bytes()),
            JsonText::Value(v) => {
                // Writing a Value into a Vec cannot fail.
                let _ = serde_json::to_writer(&mut body, v);
            }
        }
    }
    body.push(b'}');
    let mut all = Vec::with_capacity(headers.len() + 1);
    all.push((
        "content-type".to_string(),
        "application/problem+json".to_string(),
    ));
    all.extend(headers);
    LocalResponse {
        status: kind.status(),
        headers: all,
        body,
    }
}

/// A member value of a problem body: a string to escape, JSON text as is, or a JSON value.
enum JsonText<'a> {
    Str(&'a str),
    Raw(&'a str),
    Value(&'a Value),
}

fn write_json_str(out: &mut Vec<u8>, s: &str) {
    // Escaping a str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// `Retry-After` delta-seconds: rounded up, at least 1.
pub fn retry_after_secs(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

/// One limit as the RateLimit headers show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaView<'a> {
    pub name: &'a str,
    pub quota: u64,
    pub window_ms: u64,
    pub remaining: u64,
    pub reset_ms: u64,
}

/// `RateLimit-Policy` and `RateLimit` values for `views`, in the order given (callers put the
/// most restrictive, or the violated, limit first). Names are sf-strings: config validation
/// restricts them to `[A-Za-z0-9_-]`, so no escaping is needed.
pub fn ratelimit_headers(views: &[QuotaView<'_>]) -> (String, String) {
    let mut policy = String::new();
    let mut state = String::new();
    for (i, v) in views.iter().enumerate() {
        if i > 0 {
            policy.push_str(", ");
            state.push_str(", ");
        }
        // Writing into a String cannot fail.
        let _ = write!(
            policy,
            "\"{}\";q={};w={}",
            v.name,
            v.quota,
            v.window_ms.div_ceil(1000).max(1)
        );
        let _ = write!(
            state,
            "\"{}\";r={};t={}",
            v.name,
            v.remaining,
            v.reset_ms.div_ceil(1000)
        );
    }
    (policy, state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn retry_after_rounds_up() {
        for (ms, want) in [(0, 1), (1, 1), (999, 1), (1000, 1), (1001, 2), (16_200, 17)] {
            assert_eq!(retry_after_secs(ms), want, "{ms}");
        }
    }

    #[test]
    fn header_syntax() {
        let views = [
            QuotaView {
                name: "tenant",
                quota: 100,
                window_ms: 60_000,
                remaining: 0,
                reset_ms: 16_200,
            },
            QuotaView {
                name: "user-burst",
                quota: 10,
                window_ms: 250,
                remaining: 7,
                reset_ms: 0,
            },
        ];
        let (policy, state) = ratelimit_headers(&views);
        assert_eq!(policy, "\"tenant\";q=100;w=60, \"user-burst\";q=10;w=1");
        assert_eq!(state, "\"tenant\";r=0;t=17, \"user-burst\";r=7;t=0");
        assert_eq!(ratelimit_headers(&[]), (String::new(), String::new()));
    }

    #[test]
    fn problem_body() {
        let mut extra = Map::new();
        extra.insert("violated-policies".into(), json!(["tenant"]));
        let r = problem(
            Problem::RateLimited,
            "limit exceeded",
            extra,
            vec![("retry-after".into(), "17".into())],
        );
        assert_eq!(r.status, 429);
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        assert_eq!(r.header("retry-after"), Some("17"));
        let body: Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(
            body,
            json!({
                "type": "urn:coordination-guard:problem:rate_limited",
                "title": "Too Many Requests",
                "status": 429,
                "detail": "limit exceeded",
                "violated-policies": ["tenant"]
            })
        );
    }

    /// The body is byte for byte what serializing the members as a serde_json `Map` gives
    /// (sorted members, compact, the same escaping), also with characters that need escaping
    /// and an extra member that replaces a standard one.
    #[test]
    fn problem_body_bytes() {
        let cases: Vec<(Problem, &str, Map<String, Value>)> = vec![
            (Problem::RateLimited, "plain", Map::new()),
            (
                Problem::MissingTenant,
                "needs \"x-tenant\"\n\t\u{1} and \\ ü \u{2028}",
                Map::new(),
            ),
            (
                Problem::LeaseResourceMissing,
                "d",
                [
                    ("missing-selector".to_string(), json!("path_segment:2")),
                    ("a-first".to_string(), json!({"z": 1, "a": [1.5, null]})),
                    ("status".to_string(), json!(499)),
                ]
                .into_iter()
                .collect(),
            ),
        ];
        for (kind, detail, extra) in cases {
            let mut want = Map::new();
            want.insert(
                "type".into(),
                json!(format!("urn:coordination-guard:problem:{}", kind.slug())),
            );
            want.insert("title".into(), json!(kind.title()));
            want.insert("status".into(), json!(kind.status()));
            want.insert("detail".into(), json!(detail));
            want.extend(extra.clone());
            let got = problem(kind, detail, extra, Vec::new()).body;
            assert_eq!(
                String::from_utf8(got).expect("utf-8"),
                Value::Object(want).to_string(),
                "{kind:?}"
            );
        }
    }
}
