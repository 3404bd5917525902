//! What the filter answers by itself: `application/problem+json` bodies (RFC 9457) and the
//! `Retry-After`, `RateLimit-Policy` and `RateLimit` headers
//! (draft-ietf-httpapi-ratelimit-headers-10), and the header that keeps a caller's Envoy from
//! retrying any of them ([`NO_RETRY`]).
//!
//! Problem `type`s are URIs a client can open: a `429` has the quota-exceeded type the
//! RateLimit draft registers ([`QUOTA_EXCEEDED`]), every other problem the configuration's
//! `problem_type_base` followed by its name (by default an anchor of the project's
//! `docs/problems.md`).

// The wait in whole seconds that `Retry-After` and the memo of a 429 show: the configuration's
// unit, as a limit's `w=` is.
pub(crate) use crate::config::units::whole_secs;
use crate::config::{push_policy_item, Quota, RateLimit};
use crate::http::grpc;
use crate::support::text::{push, push_u64, push_u64_bytes};
use std::rc::Rc;

/// Every `429` of the filter's (a rate limit's, a concurrency limit's) has this type.
pub(crate) use crate::config::QUOTA_EXCEEDED;

/// The header every answer of the filter's own goes out with, so that the caller's Envoy (a
/// mesh sidecar, a gateway) does not send the request again. Envoy's router retries no
/// response that carries `x-envoy-ratelimited`, whatever its status or `grpc-status`, unless
/// the route's retry policy names `envoy-ratelimited`: the header is checked before every
/// other retry condition. Istio's default outbound route retries a gRPC `UNAVAILABLE` or
/// `CANCELLED` twice, and up to Istio 1.23 (or with `compatibilityVersion: 1.23`) an HTTP
/// `503` as well; without the header a fail-closed answer would reach the guarded sidecar
/// three times, each attempt calling the gateway, exactly when Redis is failing, and an
/// operator's policy that retries `429` or `409` would do the same to a rejection. The
/// guard's answers are final for the request as sent: the client, told when by
/// `Retry-After`, is the one to send it again. Only the filter's own answers carry it (see
/// [`wire_headers`]), never a response it passes on from the service: a service's own `503`
/// is retried as the mesh retries any.
pub(crate) const NO_RETRY: (&str, &str) = ("x-envoy-ratelimited", "true");

/// The headers `response` goes to the host with: its own, then [`NO_RETRY`]. Every local
/// answer is sent through this (problems, their gRPC form, replays, the over-limit cache's
/// answers), so none can leave without it; a replay's stored header of that name (a service
/// that sent one, kept by `replay_headers`) gives way to it, so it is there once.
pub(crate) fn wire_headers(response: &LocalResponse) -> Vec<(&str, &str)> {
    let mut headers = Vec::with_capacity(response.headers.len() + 1);
    headers.extend(
        response
            .headers
            .iter()
            .filter(|(n, _)| !n.eq_ignore_ascii_case(NO_RETRY.0))
            .map(|(n, v)| (n.as_str(), v.as_str())),
    );
    headers.push(NO_RETRY);
    headers
}

/// A response the filter sends instead of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResponse {
    pub status: u32,
    pub(crate) headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The problem this answer reports (none for a replay).
    pub(crate) problem: Option<Problem>,
    /// The gRPC status the host is told to answer a gRPC request with (none: the host maps
    /// the HTTP status itself).
    pub(crate) grpc_status: Option<u32>,
}

impl LocalResponse {
    #[cfg(test)]
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The problems the filter answers with. A `429` has the `type` [`QUOTA_EXCEEDED`]; the others
/// `<problem_type_base><slug>`, e.g. `…/docs/problems.md#guard_unavailable`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Problem {
    RateLimited,
    /// A limit on requests in flight is full (429).
    ConcurrencyLimited,
    /// A rate limit's cost header is not a non-negative integer, or is above its max (400).
    InvalidCost,
    GuardUnavailable,
    /// The worker cannot hold what the request needs now (its memory budget): 503.
    GuardOverloaded,
    MissingTenant,
    AmbiguousTenant,
    /// The principal header appears more than once (400).
    AmbiguousPrincipal,
    /// The path has more than one reading and one of them is guarded (400).
    AmbiguousPath,
    /// A header or query parameter a selector reads appears more than once (400).
    AmbiguousSelector,
    IdempotencyKeyMissing,
    IdempotencyKeyInvalid,
    RequestBodyTooLarge,
    RequestBodyTimeout,
    /// The same request is still being processed (409, or 425 by configuration).
    IdempotencyKeyInUse {
        status: u32,
    },
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
    pub(crate) fn status(self) -> u32 {
        match self {
            Problem::RateLimited | Problem::ConcurrencyLimited => 429,
            Problem::InvalidCost => 400,
            Problem::GuardUnavailable | Problem::GuardOverloaded => 503,
            Problem::MissingTenant => 401,
            Problem::AmbiguousTenant
            | Problem::AmbiguousPrincipal
            | Problem::AmbiguousPath
            | Problem::AmbiguousSelector => 400,
            Problem::IdempotencyKeyMissing | Problem::IdempotencyKeyInvalid => 400,
            Problem::RequestBodyTooLarge => 413,
            Problem::RequestBodyTimeout => 408,
            Problem::IdempotencyKeyInUse { status } => status,
            Problem::IdempotencyKeyConflict { status } => status,
            Problem::ResourceLocked => 409,
            Problem::LeaseResourceMissing => 400,
        }
    }

    pub(crate) fn slug(self) -> &'static str {
        match self {
            Problem::RateLimited => "rate_limited",
            Problem::ConcurrencyLimited => "concurrency_limited",
            Problem::InvalidCost => "invalid_cost",
            Problem::GuardUnavailable => "guard_unavailable",
            Problem::GuardOverloaded => "guard_overloaded",
            Problem::MissingTenant => "missing_tenant",
            Problem::AmbiguousTenant => "ambiguous_tenant",
            Problem::AmbiguousPrincipal => "ambiguous_principal",
            Problem::AmbiguousPath => "ambiguous_path",
            Problem::AmbiguousSelector => "ambiguous_selector",
            Problem::IdempotencyKeyMissing => "idempotency_key_missing",
            Problem::IdempotencyKeyInvalid => "idempotency_key_invalid",
            Problem::RequestBodyTooLarge => "request_body_too_large",
            Problem::RequestBodyTimeout => "request_body_timeout",
            Problem::IdempotencyKeyInUse { .. } => "idempotency_key_in_use",
            Problem::IdempotencyKeyConflict { .. } => "idempotency_key_conflict",
            Problem::ResourceLocked => "resource_locked",
            Problem::LeaseResourceMissing => "lease_resource_missing",
        }
    }

    /// A summary of the problem type, the same for every answer of that type (RFC 9457): for a
    /// `429`, the registered type's title.
    pub(crate) fn title(self) -> &'static str {
        match self {
            Problem::RateLimited | Problem::ConcurrencyLimited => "Quota Exceeded",
            Problem::InvalidCost => "Invalid Cost",
            Problem::GuardUnavailable | Problem::GuardOverloaded => "Service Unavailable",
            Problem::MissingTenant => "Unauthorized",
            Problem::AmbiguousTenant => "Ambiguous Tenant",
            Problem::AmbiguousPrincipal => "Ambiguous Principal",
            Problem::AmbiguousPath => "Ambiguous Path",
            Problem::AmbiguousSelector => "Ambiguous Request",
            Problem::IdempotencyKeyMissing => "Idempotency-Key Missing",
            Problem::IdempotencyKeyInvalid => "Idempotency-Key Invalid",
            Problem::RequestBodyTooLarge => "Content Too Large",
            Problem::RequestBodyTimeout => "Request Timeout",
            Problem::IdempotencyKeyInUse { .. } => "Request In Progress",
            Problem::IdempotencyKeyConflict { .. } => "Idempotency-Key Reused",
            Problem::ResourceLocked => "Resource Locked",
            Problem::LeaseResourceMissing => "Lease Resource Missing",
        }
    }

    /// Whether the answer uses the registered [`QUOTA_EXCEEDED`] type rather than one of the
    /// project's own.
    pub(crate) fn quota_exceeded(self) -> bool {
        matches!(self, Problem::RateLimited | Problem::ConcurrencyLimited)
    }

    /// A problem of the Idempotency-Key header: its answer carries a link to the
    /// documentation (draft-ietf-httpapi-idempotency-key-header, "Error Handling"), in its
    /// `type` and in a `Link: <…>; rel="describedby"` header.
    pub(crate) fn idempotency(self) -> bool {
        matches!(
            self,
            Problem::IdempotencyKeyMissing
                | Problem::IdempotencyKeyInvalid
                | Problem::IdempotencyKeyInUse { .. }
                | Problem::IdempotencyKeyConflict { .. }
        )
    }

    /// The gRPC status a gRPC client gets for this problem. Not the host's mapping of the HTTP
    /// status (429, 409 and 503 would all be `UNAVAILABLE`, which gRPC clients retry at once):
    /// a rejection a client should back off from is `RESOURCE_EXHAUSTED`, a call that
    /// conflicts with one in flight is `ABORTED` (retry later, at a higher level), a key
    /// reused for another request is `FAILED_PRECONDITION` (not retryable as it is).
    pub(crate) fn grpc_code(self) -> u32 {
        match self {
            Problem::RateLimited | Problem::ConcurrencyLimited | Problem::RequestBodyTooLarge => {
                grpc::RESOURCE_EXHAUSTED
            }
            Problem::GuardUnavailable | Problem::GuardOverloaded => grpc::UNAVAILABLE,
            Problem::MissingTenant => grpc::UNAUTHENTICATED,
            Problem::AmbiguousTenant
            | Problem::AmbiguousPrincipal
            | Problem::AmbiguousPath
            | Problem::AmbiguousSelector
            | Problem::IdempotencyKeyMissing
            | Problem::IdempotencyKeyInvalid
            | Problem::InvalidCost
            | Problem::LeaseResourceMissing => grpc::INVALID_ARGUMENT,
            Problem::RequestBodyTimeout => grpc::DEADLINE_EXCEEDED,
            Problem::IdempotencyKeyInUse { .. } | Problem::ResourceLocked => grpc::ABORTED,
            Problem::IdempotencyKeyConflict { .. } => grpc::FAILED_PRECONDITION,
        }
    }
}

/// The same answer for a gRPC client: a trailers-only response (the host sends HTTP 200 with
/// `content-type: application/grpc` for any local reply to a gRPC request) whose
/// `grpc-status` is the problem's [`Problem::grpc_code`] and whose `grpc-message` is the
/// problem's `detail` (not the JSON). The other headers (`retry-after`, `ratelimit*`,
/// `www-authenticate`) stay; the body is dropped (the host would put it in `grpc-message`).
/// An answer that is no problem (a replay) is returned as it is.
pub(crate) fn for_grpc(response: Rc<LocalResponse>) -> Rc<LocalResponse> {
    let Some(kind) = response.problem else {
        return response;
    };
    let mut response = Rc::unwrap_or_clone(response);
    let detail = serde_json::from_slice::<serde_json::Value>(&response.body)
        .ok()
        .and_then(|v| v.get("detail")?.as_str().map(str::to_string))
        .unwrap_or_default();
    let code = kind.grpc_code();
    response
        .headers
        .retain(|(n, _)| n != "content-type" && n != grpc::STATUS && n != grpc::MESSAGE);
    let mut status = String::with_capacity(2);
    push_u64(&mut status, u64::from(code));
    response.headers.push((grpc::STATUS.into(), status));
    if !detail.is_empty() {
        response
            .headers
            .push((grpc::MESSAGE.into(), grpc::encode_message(&detail)));
    }
    response.body = Vec::new();
    response.grpc_status = Some(code);
    Rc::new(response)
}

/// An extra member of a problem body: a string or a list of strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Member<'a> {
    Str(&'a str),
    Strs(&'a [&'a str]),
}

/// A problem+json response. `extra` members are added to the body (e.g. `violated-policies`).
/// `types` is the configuration's `problem_type_base`: the `type` of every problem but a
/// `429` is it followed by the problem's slug. An Idempotency-Key problem also gets a `Link`
/// to that documentation.
///
/// The body is written directly, members sorted by name as serde_json's `Map` keeps them (an
/// `extra` member named like a standard one replaces it): this runs for every rejected
/// request, and building a `Value` tree for five members costs more than the rest of it.
pub(crate) fn problem(
    types: &str,
    kind: Problem,
    detail: &str,
    extra: &[(&str, Member<'_>)],
    headers: Vec<(String, String)>,
) -> LocalResponse {
    let slug = kind.slug();
    let type_uri = if kind.quota_exceeded() {
        JsonText::TypeUri(QUOTA_EXCEEDED, "")
    } else {
        JsonText::TypeUri(types, slug)
    };
    let standard = [
        ("detail", JsonText::Str(detail)),
        ("status", JsonText::Int(u64::from(kind.status()))),
        ("title", JsonText::Str(kind.title())),
        ("type", type_uri),
    ];
    let mut members: Vec<(&str, JsonText<'_>)> = Vec::with_capacity(standard.len() + extra.len());
    members.extend(
        standard
            .into_iter()
            .filter(|(name, _)| !extra.iter().any(|(n, _)| n == name)),
    );
    members.extend(extra.iter().map(|&(k, v)| (k, JsonText::Member(v))));
    // A stable sort: of an extra member named twice, the first one counts.
    members.sort_by(|a, b| a.0.cmp(b.0));
    members.dedup_by(|later, first| later.0 == first.0);
    let mut body = Vec::with_capacity(256);
    body.push(b'{');
    for (i, (name, value)) in members.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        write_json_str(&mut body, name);
        body.push(b':');
        match value {
            JsonText::Str(s) | JsonText::Member(Member::Str(s)) => write_json_str(&mut body, s),
            JsonText::Int(n) => push_u64_bytes(&mut body, *n),
            JsonText::TypeUri(base, slug) => {
                // The base is URI characters without '"' or '\\' (the configuration checks
                // it) and slugs are lower-case ASCII words: nothing to escape.
                body.push(b'"');
                body.extend_from_slice(base.as_bytes());
                body.extend_from_slice(slug.as_bytes());
                body.push(b'"');
            }
            JsonText::Member(Member::Strs(list)) => {
                body.push(b'[');
                for (j, s) in list.iter().enumerate() {
                    if j > 0 {
                        body.push(b',');
                    }
                    write_json_str(&mut body, s);
                }
                body.push(b']');
            }
        }
    }
    body.push(b'}');
    let mut all = Vec::with_capacity(headers.len() + 2);
    all.push((
        "content-type".to_string(),
        "application/problem+json".to_string(),
    ));
    all.extend(headers);
    if kind.idempotency() {
        let mut link = String::with_capacity(types.len() + slug.len() + 24);
        link.push('<');
        link.push_str(types);
        link.push_str(slug);
        link.push_str(">; rel=\"describedby\"");
        all.push(("link".to_string(), link));
    }
    LocalResponse {
        status: kind.status(),
        headers: all,
        body,
        problem: Some(kind),
        grpc_status: None,
    }
}

/// A member value of a problem body: a string to escape, a number, a type URI (a base and a
/// slug, written as they are), or an extra member.
enum JsonText<'a> {
    Str(&'a str),
    Int(u64),
    TypeUri(&'a str, &'a str),
    Member(Member<'a>),
}

fn write_json_str(out: &mut Vec<u8>, s: &str) {
    // Escaping a str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// One limit as the RateLimit headers show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct QuotaView<'a> {
    pub(crate) limit: &'a RateLimit,
    /// The tenant's own quota (an override), written instead of the limit's item.
    pub(crate) quota: Option<Quota>,
    pub(crate) remaining: u64,
    /// Until more quota comes back (the script's `reset_ms`): `t`, in whole seconds rounded
    /// up. Not shown for a concurrency limit.
    pub(crate) reset_ms: u64,
}

/// `RateLimit-Policy` and `RateLimit` values for `views`, in the order given (callers put the
/// most restrictive, or the violated, limit first), per draft-ietf-httpapi-ratelimit-headers-10:
/// `"name";q=..[;qu=".."][;w=..]` ([`push_policy_item`]) and `"name";r=..[;t=..]`, with
/// - `r` at most the item's `q` (a token bucket's `q` is its burst; a tenant's own bucket,
///   whose burst the reply does not say, shows its limit);
/// - `t` the seconds until the limit has more room than `r`, at most `t_cap` (the answer's
///   `Retry-After`: the draft wants no `Retry-After` earlier than a `t`); none for a
///   concurrency limit (a slot frees when a request ends, which no clock says).
///
/// Names are sf-strings: config validation restricts them to `[A-Za-z0-9_-]`, and units to
/// `[a-z0-9-]`, so no escaping is needed.
pub(crate) fn ratelimit_headers(views: &[QuotaView<'_>], t_cap: Option<u64>) -> (String, String) {
    // Room for the usual view (its policy item; a short name and two numbers), so no growing.
    let mut policy = String::with_capacity(40 * views.len());
    let mut state = String::with_capacity(40 * views.len());
    for (i, v) in views.iter().enumerate() {
        if i > 0 {
            push(&mut policy, ", ");
            push(&mut state, ", ");
        }
        match v.quota {
            Some(q) => push_policy_item(&mut policy, v.limit, Some(q)),
            None => push(&mut policy, &v.limit.policy_item),
        }
        push(&mut state, "\"");
        push(&mut state, &v.limit.name);
        push(&mut state, "\";r=");
        push_u64(&mut state, v.remaining.min(v.limit.shown_quota(v.quota)));
        if !v.limit.concurrency() {
            let t = v.reset_ms.div_ceil(1000);
            push(&mut state, ";t=");
            push_u64(&mut state, t_cap.map_or(t, |cap| t.min(cap)));
        }
    }
    (policy, state)
}

/// Adds the `RateLimit-Policy` and `RateLimit` headers of the request's limits (`limit_headers`,
/// as [`ratelimit_headers`] wrote them) to an answer that is not about them (a replay, a busy
/// lease, a request in progress). When the answer has a `Retry-After`, a limit whose `t` is
/// later is left out of both (the draft wants no `Retry-After` earlier than a `t`), and both
/// headers when none is left. Rare answers: the items are read back from the text.
pub(crate) fn with_limit_headers(
    mut response: LocalResponse,
    limit_headers: &[(String, String)],
) -> LocalResponse {
    let retry_after = response
        .headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("retry-after"))
        .and_then(|(_, v)| v.trim().parse::<u64>().ok());
    let Some(retry_after) = retry_after else {
        response.headers.extend(limit_headers.iter().cloned());
        return response;
    };
    let state = limit_headers
        .iter()
        .find(|(n, _)| n == "ratelimit")
        .map_or("", |(_, v)| v.as_str());
    let later: Vec<&str> = state
        .split(", ")
        .filter(|item| {
            item.split(';')
                .find_map(|p| p.strip_prefix("t="))
                .and_then(|t| t.parse::<u64>().ok())
                .is_some_and(|t| t > retry_after)
        })
        .filter_map(item_name)
        .collect();
    if later.is_empty() {
        response.headers.extend(limit_headers.iter().cloned());
        return response;
    }
    for (name, value) in limit_headers {
        let kept: Vec<&str> = value
            .split(", ")
            .filter(|item| item_name(item).is_some_and(|n| !later.contains(&n)))
            .collect();
        if !kept.is_empty() {
            response.headers.push((name.clone(), kept.join(", ")));
        }
    }
    response
}

/// The name of a list item of ours, `"name";...`.
fn item_name(item: &str) -> Option<&str> {
    item.strip_prefix('"')?.split('"').next()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, DEFAULT_PROBLEM_TYPE_BASE};
    use serde_json::{json, Map, Value};
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// Every problem's gRPC code, with the HTTP status it replaces (table-driven: one row per
    /// problem kind, so a new kind must be added here).
    #[test]
    fn grpc_codes() {
        let cases = [
            (Problem::RateLimited, 429, grpc::RESOURCE_EXHAUSTED),
            (Problem::GuardUnavailable, 503, grpc::UNAVAILABLE),
            (Problem::GuardOverloaded, 503, grpc::UNAVAILABLE),
            (Problem::MissingTenant, 401, grpc::UNAUTHENTICATED),
            (Problem::AmbiguousTenant, 400, grpc::INVALID_ARGUMENT),
            (Problem::AmbiguousPrincipal, 400, grpc::INVALID_ARGUMENT),
            (Problem::AmbiguousPath, 400, grpc::INVALID_ARGUMENT),
            (Problem::AmbiguousSelector, 400, grpc::INVALID_ARGUMENT),
            (Problem::IdempotencyKeyMissing, 400, grpc::INVALID_ARGUMENT),
            (Problem::IdempotencyKeyInvalid, 400, grpc::INVALID_ARGUMENT),
            (Problem::RequestBodyTooLarge, 413, grpc::RESOURCE_EXHAUSTED),
            (Problem::RequestBodyTimeout, 408, grpc::DEADLINE_EXCEEDED),
            (
                Problem::IdempotencyKeyInUse { status: 409 },
                409,
                grpc::ABORTED,
            ),
            (
                Problem::IdempotencyKeyConflict { status: 422 },
                422,
                grpc::FAILED_PRECONDITION,
            ),
            (
                Problem::IdempotencyKeyConflict { status: 409 },
                409,
                grpc::FAILED_PRECONDITION,
            ),
            (Problem::ResourceLocked, 409, grpc::ABORTED),
            (Problem::LeaseResourceMissing, 400, grpc::INVALID_ARGUMENT),
        ];
        for (kind, status, code) in cases {
            assert_eq!(kind.status(), status, "{kind:?}");
            assert_eq!(kind.grpc_code(), code, "{kind:?}");
        }
    }

    /// The default `problem_type_base`.
    const TYPES: &str = DEFAULT_PROBLEM_TYPE_BASE;

    #[test]
    fn grpc_answer() {
        let http = problem(
            TYPES,
            Problem::RateLimited,
            "rate limit \"t\" exceeded; retry after 3 s (100%)",
            &[("violated-policies", Member::Strs(&["t"]))],
            vec![
                ("retry-after".into(), "3".into()),
                ("ratelimit".into(), "\"t\";r=0;t=3".into()),
            ],
        );
        let g = Rc::unwrap_or_clone(for_grpc(Rc::new(http.clone())));
        assert_eq!(g.status, 429);
        assert_eq!(g.grpc_status, Some(grpc::RESOURCE_EXHAUSTED));
        assert!(g.body.is_empty());
        assert_eq!(
            g.headers,
            vec![
                ("retry-after".to_string(), "3".to_string()),
                ("ratelimit".to_string(), "\"t\";r=0;t=3".to_string()),
                ("grpc-status".to_string(), "8".to_string()),
                (
                    "grpc-message".to_string(),
                    "rate limit \"t\" exceeded; retry after 3 s (100%25)".to_string()
                ),
            ]
        );
        // The HTTP answer is untouched by it, and a replay is no problem: as it is.
        assert_eq!(http.grpc_status, None);
        assert_eq!(
            http.header("content-type"),
            Some("application/problem+json")
        );
        let replay = LocalResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body: b"{}".to_vec(),
            problem: None,
            grpc_status: None,
        };
        let same = Rc::new(replay);
        assert!(Rc::ptr_eq(&for_grpc(Rc::clone(&same)), &same), "no copy");
    }

    /// Every kind of answer goes out with [`NO_RETRY`], once, after its own headers in their
    /// order: each problem as problem+json and in its gRPC form, and a replay, whose stored
    /// header of that name (any case, any value) gives way to it.
    #[test]
    fn every_answer_goes_out_with_no_retry_once() {
        let no_retry = |r: &LocalResponse| {
            let wire = wire_headers(r);
            let ours: Vec<_> = wire
                .iter()
                .filter(|(n, _)| n.eq_ignore_ascii_case("x-envoy-ratelimited"))
                .copied()
                .collect();
            assert_eq!(ours, vec![("x-envoy-ratelimited", "true")], "{r:?}");
            assert_eq!(wire.last(), Some(&NO_RETRY), "{r:?}");
            wire[..wire.len() - 1]
                .iter()
                .map(|&(n, v)| (n.to_string(), v.to_string()))
                .collect::<Vec<_>>()
        };
        let kinds = [
            Problem::RateLimited,
            Problem::ConcurrencyLimited,
            Problem::InvalidCost,
            Problem::GuardUnavailable,
            Problem::GuardOverloaded,
            Problem::MissingTenant,
            Problem::AmbiguousTenant,
            Problem::AmbiguousPrincipal,
            Problem::AmbiguousPath,
            Problem::AmbiguousSelector,
            Problem::IdempotencyKeyMissing,
            Problem::IdempotencyKeyInvalid,
            Problem::RequestBodyTooLarge,
            Problem::RequestBodyTimeout,
            Problem::IdempotencyKeyInUse { status: 425 },
            Problem::IdempotencyKeyConflict { status: 422 },
            Problem::ResourceLocked,
            Problem::LeaseResourceMissing,
        ];
        for kind in kinds {
            let http = problem(
                TYPES,
                kind,
                "d",
                &[],
                vec![("retry-after".into(), "1".into())],
            );
            assert_eq!(no_retry(&http), http.headers, "{kind:?}");
            let g = for_grpc(Rc::new(http));
            assert!(g.grpc_status.is_some(), "{kind:?}");
            assert_eq!(no_retry(&g), g.headers, "{kind:?}");
        }
        let replay = LocalResponse {
            status: 503,
            headers: vec![
                ("content-type".into(), "text/plain".into()),
                ("X-Envoy-RateLimited".into(), "false".into()),
                ("idempotent-replayed".into(), "true".into()),
            ],
            body: b"stored".to_vec(),
            problem: None,
            grpc_status: None,
        };
        assert_eq!(
            no_retry(&replay),
            vec![
                ("content-type".to_string(), "text/plain".to_string()),
                ("idempotent-replayed".to_string(), "true".to_string()),
            ]
        );
    }

    /// Every problem's `type` dereferences: `docs/problems.md` (the default base) has a
    /// section headed by its slug, which is the anchor a `#<slug>` URI opens; so have the two
    /// whose `type` is the registered quota-exceeded one.
    #[test]
    fn every_problem_has_its_section_in_the_docs() {
        let page = include_str!("../../docs/problems.md");
        let kinds = [
            Problem::RateLimited,
            Problem::ConcurrencyLimited,
            Problem::InvalidCost,
            Problem::GuardUnavailable,
            Problem::GuardOverloaded,
            Problem::MissingTenant,
            Problem::AmbiguousTenant,
            Problem::AmbiguousPrincipal,
            Problem::AmbiguousPath,
            Problem::AmbiguousSelector,
            Problem::IdempotencyKeyMissing,
            Problem::IdempotencyKeyInvalid,
            Problem::RequestBodyTooLarge,
            Problem::RequestBodyTimeout,
            Problem::IdempotencyKeyInUse { status: 409 },
            Problem::IdempotencyKeyConflict { status: 422 },
            Problem::ResourceLocked,
            Problem::LeaseResourceMissing,
        ];
        let headings: Vec<&str> = page.lines().filter_map(|l| l.strip_prefix("## ")).collect();
        let slugs: Vec<&str> = kinds.iter().map(|k| k.slug()).collect();
        assert_eq!(headings, slugs, "one section per problem, in this order");
        assert!(DEFAULT_PROBLEM_TYPE_BASE.ends_with("docs/problems.md#"));
    }

    /// A limit of each algorithm, and one counted in a unit of the service's own.
    fn limits() -> Config {
        Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "p", "rate_limits": [
              {"name": "tenant", "by": ["tenant"], "algorithm": "sliding_window", "limit": 100, "window": "1m"},
              {"name": "user-burst", "by": ["tenant"], "algorithm": "token_bucket", "limit": 10, "window": "250ms", "burst": 30},
              {"name": "inflight", "by": ["tenant"], "algorithm": "concurrency", "limit": 8, "window": "10s"},
              {"name": "tokens", "by": ["tenant"], "algorithm": "fixed_window", "limit": 5000, "window": "1h",
               "cost": {"header": "x-tokens"}, "unit": "tokens"}
            ]}]}"#,
        )
        .expect("valid")
    }

    #[test]
    fn header_syntax() {
        let c = limits();
        let l = &c.policies[0].rate_limits;
        let view = |i: usize, remaining: u64, reset_ms: u64| QuotaView {
            limit: &l[i],
            quota: None,
            remaining,
            reset_ms,
        };
        let mut views = [view(0, 0, 16_200), view(1, 7, 0)];
        let (policy, state) = ratelimit_headers(&views, None);
        // The bucket holds 30 tokens and fills in 750 ms: 30 per 1 s (rounded up).
        assert_eq!(policy, "\"tenant\";q=100;w=60, \"user-burst\";q=30;w=1");
        assert_eq!(state, "\"tenant\";r=0;t=17, \"user-burst\";r=7;t=0");
        // `t` is at most the answer's Retry-After.
        let (_, state) = ratelimit_headers(&views, Some(5));
        assert_eq!(state, "\"tenant\";r=0;t=5, \"user-burst\";r=7;t=0");
        // A tenant's own quota (an override) is written in place of the limit's item, and
        // `r` is never more than its `q`.
        views[1].quota = Some(Quota {
            limit: 4,
            window_ms: 120_000,
        });
        let (policy, state) = ratelimit_headers(&views, None);
        assert_eq!(policy, "\"tenant\";q=100;w=60, \"user-burst\";q=4;w=120");
        assert_eq!(state, "\"tenant\";r=0;t=17, \"user-burst\";r=4;t=0");
        // A concurrency limit: slots, no window, no `t`; a unit of the service's own in `qu`.
        let (policy, state) = ratelimit_headers(&[view(2, 3, 10_000), view(3, 100, 61_000)], None);
        assert_eq!(
            policy,
            "\"inflight\";q=8;qu=\"concurrent-requests\", \"tokens\";q=5000;qu=\"tokens\";w=3600"
        );
        assert_eq!(state, "\"inflight\";r=3, \"tokens\";r=100;t=61");
        assert_eq!(ratelimit_headers(&[], None), (String::new(), String::new()));
    }

    /// The request's limit headers on an answer that is not about them: all of them without a
    /// `Retry-After`; with one, the limits whose `t` is later are left out of both headers,
    /// and both headers when none is left.
    #[test]
    fn limit_headers_on_other_answers_are_never_later_than_retry_after() {
        let limit_headers = vec![
            (
                "ratelimit-policy".to_string(),
                "\"a\";q=10;w=60, \"inflight\";q=8;qu=\"concurrent-requests\", \"b\";q=5;w=1"
                    .to_string(),
            ),
            (
                "ratelimit".to_string(),
                "\"a\";r=3;t=40, \"inflight\";r=2, \"b\";r=4;t=1".to_string(),
            ),
        ];
        let answer = |retry_after: Option<&str>| {
            let headers = retry_after
                .map(|v| vec![("retry-after".to_string(), v.to_string())])
                .unwrap_or_default();
            problem(TYPES, Problem::ResourceLocked, "d", &[], headers)
        };
        let plain = with_limit_headers(answer(None), &limit_headers);
        assert_eq!(plain.headers[1..], limit_headers[..]);
        let late = with_limit_headers(answer(Some("40")), &limit_headers);
        assert_eq!(late.headers[2..], limit_headers[..]);
        let soon = with_limit_headers(answer(Some("7")), &limit_headers);
        assert_eq!(
            soon.header("ratelimit-policy"),
            Some("\"inflight\";q=8;qu=\"concurrent-requests\", \"b\";q=5;w=1")
        );
        assert_eq!(
            soon.header("ratelimit"),
            Some("\"inflight\";r=2, \"b\";r=4;t=1")
        );
        let only_a = [
            (
                "ratelimit-policy".to_string(),
                "\"a\";q=10;w=60".to_string(),
            ),
            ("ratelimit".to_string(), "\"a\";r=3;t=40".to_string()),
        ];
        let none = with_limit_headers(answer(Some("1")), &only_a);
        assert_eq!(none.header("ratelimit-policy"), None);
        assert_eq!(none.header("ratelimit"), None);
    }

    #[test]
    fn problem_body() {
        let r = problem(
            TYPES,
            Problem::RateLimited,
            "limit exceeded",
            &[("violated-policies", Member::Strs(&["tenant"]))],
            vec![("retry-after".into(), "17".into())],
        );
        assert_eq!(r.status, 429);
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        assert_eq!(r.header("retry-after"), Some("17"));
        assert_eq!(r.header("link"), None);
        let body: Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(
            body,
            json!({
                "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
                "title": "Quota Exceeded",
                "status": 429,
                "detail": "limit exceeded",
                "violated-policies": ["tenant"]
            })
        );
    }

    /// Every problem but a `429` has a `type` of the configured base and its slug; the
    /// Idempotency-Key problems link to the same page (`rel="describedby"`), the others not.
    #[test]
    fn problem_types_are_the_configured_base_and_the_slug() {
        let base = "https://api.example.com/problems/";
        let kinds = [
            (Problem::RateLimited, None),
            (Problem::ConcurrencyLimited, None),
            (Problem::GuardUnavailable, None),
            (
                Problem::IdempotencyKeyMissing,
                Some("idempotency_key_missing"),
            ),
            (
                Problem::IdempotencyKeyInvalid,
                Some("idempotency_key_invalid"),
            ),
            (
                Problem::IdempotencyKeyInUse { status: 409 },
                Some("idempotency_key_in_use"),
            ),
            (
                Problem::IdempotencyKeyConflict { status: 422 },
                Some("idempotency_key_conflict"),
            ),
            (Problem::ResourceLocked, None),
        ];
        for (kind, link) in kinds {
            let r = problem(base, kind, "d", &[], Vec::new());
            let body: Value = serde_json::from_slice(&r.body).expect("json");
            let want = if kind.quota_exceeded() {
                QUOTA_EXCEEDED.to_string()
            } else {
                format!("{base}{}", kind.slug())
            };
            assert_eq!(body["type"], json!(want), "{kind:?}");
            let want_link = link.map(|slug| format!("<{base}{slug}>; rel=\"describedby\""));
            assert_eq!(r.header("link"), want_link.as_deref(), "{kind:?}");
        }
    }

    /// The body is byte for byte what serializing the members as a serde_json `Map` gives
    /// (sorted members, compact, the same escaping), also with characters that need escaping
    /// and an extra member that replaces a standard one.
    #[test]
    fn problem_body_bytes() {
        type Extra<'a> = Vec<(&'a str, Member<'a>)>;
        let cases: Vec<(Problem, &str, Extra<'_>)> = vec![
            (Problem::RateLimited, "plain", vec![]),
            (
                Problem::MissingTenant,
                "needs \"x-tenant\"\n\t\u{1} and \\ ü \u{2028}",
                vec![],
            ),
            (
                Problem::LeaseResourceMissing,
                "d",
                vec![
                    ("missing-selector", Member::Str("path_segment:2")),
                    ("a-first", Member::Strs(&["z\"", "", "ü\u{7}"])),
                    ("status", Member::Str("499")),
                    ("violated-policies", Member::Strs(&[])),
                ],
            ),
        ];
        for (kind, detail, extra) in cases {
            let mut want = Map::new();
            let type_uri = if kind.quota_exceeded() {
                QUOTA_EXCEEDED.to_string()
            } else {
                format!("{TYPES}{}", kind.slug())
            };
            want.insert("type".into(), json!(type_uri));
            want.insert("title".into(), json!(kind.title()));
            want.insert("status".into(), json!(kind.status()));
            want.insert("detail".into(), json!(detail));
            for &(name, member) in &extra {
                let value = match member {
                    Member::Str(s) => json!(s),
                    Member::Strs(list) => json!(list),
                };
                want.insert(name.to_string(), value);
            }
            let got = problem(TYPES, kind, detail, &extra, Vec::new()).body;
            assert_eq!(
                String::from_utf8(got).expect("utf-8"),
                Value::Object(want).to_string(),
                "{kind:?}"
            );
        }
    }
}
