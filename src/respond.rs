//! What the filter answers by itself: `application/problem+json` bodies (RFC 9457) and the
//! `Retry-After`, `RateLimit-Policy` and `RateLimit` headers
//! (draft-ietf-httpapi-ratelimit-headers-10).

use serde_json::{json, Map, Value};

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
pub fn problem(
    kind: Problem,
    detail: &str,
    extra: Map<String, Value>,
    headers: Vec<(String, String)>,
) -> LocalResponse {
    let mut body = Map::new();
    body.insert(
        "type".into(),
        json!(format!("urn:coordination-guard:problem:{}", kind.slug())),
    );
    body.insert("title".into(), json!(kind.title()));
    body.insert("status".into(), json!(kind.status()));
    body.insert("detail".into(), json!(detail));
    body.extend(extra);
    let mut all = vec![(
        "content-type".to_string(),
        "application/problem+json".to_string(),
    )];
    all.extend(headers);
    LocalResponse {
        status: kind.status(),
        headers: all,
        body: Value::Object(body).to_string().into_bytes(),
    }
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
        policy.push_str(&format!(
            "\"{}\";q={};w={}",
            v.name,
            v.quota,
            v.window_ms.div_ceil(1000).max(1)
        ));
        state.push_str(&format!(
            "\"{}\";r={};t={}",
            v.name,
            v.remaining,
            v.reset_ms.div_ceil(1000)
        ));
    }
    (policy, state)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
