//! The parts of an HTTP request the filter looks at, copied out of the host once.

use crate::config::{HeaderTest, IdSource, Identity, Match, MissingTenant, Policy, Selector};
use crate::http::claims::Claim;
use crate::http::headers::Headers;
use crate::http::normalize::{
    normalize_path, query_pairs, query_pairs_semicolon, trim_slash, PathForm,
};
use crate::support::text;
use std::borrow::Cow;
use std::ops::Range;

#[derive(Debug, Clone, Default)]
pub struct Request {
    /// Upper-case method.
    pub method: Cow<'static, str>,
    /// The path without the query string, in its canonical form (see [`crate::http::normalize`]):
    /// [`Request::path`].
    path: Normal,
    /// Other readings of an ambiguous path; `path_ambiguous` says whether it is one.
    pub path_others: Vec<String>,
    pub path_ambiguous: bool,
    /// The raw query string, without `?`.
    pub query: String,
    /// The query's parameters, decoded, in order.
    pub params: Vec<(String, String)>,
    /// Lower-case host without port: [`Request::host`].
    host: Normal,
    /// The downstream address without port, if the host told us.
    pub client_ip: Option<String>,
    /// Lower-case header names with their values, in arrival order. Only ever added to: a
    /// [`Normal`] range of its text stays valid.
    pub(crate) headers: Headers,
    /// The tenant and principal read from the request's metadata (a verified token's claims),
    /// for an identity whose source is `metadata`.
    pub tenant_claim: Claim,
    pub principal_claim: Claim,
}

/// A pseudo-header's normal form (the path, the host): where it stands in the request's own
/// map when the header already was in that form, as most are, else a copy of its own.
#[derive(Debug, Clone)]
enum Normal {
    /// A range of the map's text.
    Within(Range<usize>),
    Owned(String),
}

impl Default for Normal {
    fn default() -> Normal {
        Normal::Owned(String::new())
    }
}

impl Normal {
    /// `text`, normalised from a value of `headers`: a range of the map when it was borrowed
    /// from it.
    fn of(text: Cow<'_, str>, headers: &Headers) -> Normal {
        match text {
            Cow::Borrowed(t) => headers
                .range_of(t)
                .map_or_else(|| Normal::Owned(t.to_string()), Normal::Within),
            Cow::Owned(t) => Normal::Owned(t),
        }
    }

    fn read<'a>(&'a self, headers: &'a Headers) -> &'a str {
        match self {
            Normal::Within(r) => headers.text_at(r),
            Normal::Owned(t) => t,
        }
    }
}

/// Two requests are equal when they read alike, however their path and host are kept. Every
/// field is named, so that a new one cannot be left out.
impl PartialEq for Request {
    fn eq(&self, other: &Request) -> bool {
        let Request {
            method,
            path: _,
            path_others,
            path_ambiguous,
            query,
            params,
            host: _,
            client_ip,
            headers,
            tenant_claim,
            principal_claim,
        } = self;
        *method == other.method
            && self.path() == other.path()
            && *path_others == other.path_others
            && *path_ambiguous == other.path_ambiguous
            && *query == other.query
            && *params == other.params
            && self.host() == other.host()
            && *client_ip == other.client_ip
            && *headers == other.headers
            && *tenant_claim == other.tenant_claim
            && *principal_claim == other.principal_claim
    }
}

impl Eq for Request {}

impl Request {
    /// Builds a request from header pairs (pseudo-headers `:method`, `:path`, `:authority`
    /// included) and the downstream address (`ip:port` or `[v6]:port`).
    pub fn from_headers(headers: Vec<(String, String)>, source_address: Option<&str>) -> Request {
        Request::from_map(headers.into_iter().collect(), source_address)
    }

    /// [`Request::from_headers`] from headers as the host hands them over.
    pub fn from_map(headers: Headers, source_address: Option<&str>) -> Request {
        Request::from_probed(headers, source_address, Probed::default())
    }

    /// [`Request::from_map`], with what the policies' [`Probe`] already normalised of the
    /// same map (its first `:method`, `:path` and `:authority`), which is not done again.
    pub fn from_probed(
        headers: Headers,
        source_address: Option<&str>,
        mut probed: Probed,
    ) -> Request {
        let mut req = Request {
            client_ip: source_address.map(|a| strip_port(a).to_string()),
            ..Request::default()
        };
        for (name, value) in headers.iter() {
            match name {
                ":method" => {
                    req.method = probed.method.take().unwrap_or_else(|| method_of(value));
                }
                ":path" => {
                    let (path, query) = split_path(value);
                    let (canonical, others, ambiguous) = match probed.path.take() {
                        Some(p) => p,
                        None => {
                            let form = normalize_path(path);
                            (
                                Normal::of(form.canonical, &headers),
                                form.others,
                                form.ambiguous,
                            )
                        }
                    };
                    req.path = canonical;
                    req.path_others = others;
                    req.path_ambiguous = ambiguous;
                    req.query = query.to_string();
                    req.params = query_pairs(query);
                }
                ":authority" => {
                    req.host = probed
                        .host
                        .take()
                        .unwrap_or_else(|| Normal::of(host_of(value), &headers));
                }
                _ => {}
            }
        }
        req.headers = headers;
        req
    }

    /// The path without the query string, in its canonical form.
    pub fn path(&self) -> &str {
        self.path.read(&self.headers)
    }

    /// Lower-case host without port or a trailing dot.
    pub fn host(&self) -> &str {
        self.host.read(&self.headers)
    }

    /// The first value of a header (name in lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.values(name).next()
    }

    /// The value of a header that must appear at most once; `Err` when it is repeated.
    pub fn single_header(&self, name: &str) -> Result<Option<&str>, Repeated> {
        single(self.headers.values(name))
    }

    /// The value of a query parameter (decoded) that must appear at most once.
    pub fn single_param(&self, name: &str) -> Result<Option<&str>, Repeated> {
        single(
            self.params
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.as_str()),
        )
    }
}

/// A request input that must appear at most once appears more often: which value counts is
/// ambiguous (a service may read the first, another the last).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repeated;

/// The one value of an input given as `values`, none, or `Err` when there is more than one.
pub fn single<'a>(mut values: impl Iterator<Item = &'a str>) -> Result<Option<&'a str>, Repeated> {
    let first = values.next();
    match values.next() {
        Some(_) => Err(Repeated),
        None => Ok(first),
    }
}

/// `:path` as the path and the query string (without `?`).
fn split_path(raw: &str) -> (&str, &str) {
    text::split_once_byte(raw, b'?').unwrap_or((raw, ""))
}

/// `:authority` as a matcher compares it: lower case, without port or a trailing dot (a part
/// of `authority` when it has no upper case).
fn host_of(authority: &str) -> Cow<'_, str> {
    let host = strip_port(authority);
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(host.to_ascii_lowercase())
    } else {
        Cow::Borrowed(host)
    }
}

/// The methods a request names in upper case without a copy.
const METHODS: [&str; 9] = [
    "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "CONNECT", "TRACE",
];

/// `:method` in upper case.
fn method_of(method: &str) -> Cow<'static, str> {
    match METHODS.iter().find(|m| m.eq_ignore_ascii_case(method)) {
        Some(m) => Cow::Borrowed(m),
        None => Cow::Owned(method.to_ascii_uppercase()),
    }
}

fn strip_port(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        // [v6]:port
        return text::split_once_byte(rest, b']').map_or(rest, |(host, _)| host);
    }
    match text::rsplit_once_byte(addr, b':') {
        // A bare IPv6 address has more than one colon and no port.
        Some((host, port))
            if !host.bytes().any(|b| b == b':') && port.bytes().all(|b| b.is_ascii_digit()) =>
        {
            host
        }
        _ => addr,
    }
}

/// The pseudo-headers a policy's match reads, normalised as in [`Request`].
pub trait MatchInput {
    fn method(&mut self) -> &str;
    /// Reading `n` of the path (0: the canonical one); `None` past the last.
    fn path(&mut self, n: usize) -> Option<&str>;
    /// Whether the path is ambiguous (reads it if no matcher has).
    fn path_ambiguous(&mut self) -> bool;
    /// Whether a matcher has read the path.
    fn path_read(&self) -> bool;
    fn host(&mut self) -> &str;
    /// The value of a request header a matcher tests (`Err` when it appears more than once).
    fn header(&mut self, name: &str) -> Result<Option<&str>, Repeated>;
}

/// A parsed request as the matchers read it: its path read once (every match with a path
/// reads it), its host once if a match names one.
struct Parsed<'a> {
    req: &'a Request,
    path: &'a str,
    host: Option<&'a str>,
}

impl<'a> Parsed<'a> {
    fn of(req: &'a Request) -> Parsed<'a> {
        Parsed {
            req,
            path: req.path(),
            host: None,
        }
    }
}

impl MatchInput for Parsed<'_> {
    fn method(&mut self) -> &str {
        &self.req.method
    }
    fn path(&mut self, n: usize) -> Option<&str> {
        match n {
            0 => Some(self.path),
            _ => self.req.path_others.get(n - 1).map(String::as_str),
        }
    }
    fn path_ambiguous(&mut self) -> bool {
        self.req.path_ambiguous
    }
    fn path_read(&self) -> bool {
        true
    }
    fn host(&mut self) -> &str {
        self.host.get_or_insert_with(|| self.req.host())
    }
    fn header(&mut self, name: &str) -> Result<Option<&str>, Repeated> {
        self.req.single_header(name)
    }
}

impl HeaderTest {
    /// Whether a header seen this way passes: a repeated header is present, and never
    /// matches a value (which of its values would count is ambiguous).
    fn holds(&self, seen: Result<Option<&str>, Repeated>) -> bool {
        match (self, seen) {
            (HeaderTest::Present(want), seen) => *want == !matches!(seen, Ok(None)),
            (HeaderTest::Exact(v), Ok(Some(got))) => got == v,
            (HeaderTest::Prefix(p), Ok(Some(got))) => got.starts_with(p.as_str()),
            _ => false,
        }
    }
}

impl Match {
    pub fn matches(&self, req: &Request) -> bool {
        self.fits(&mut Parsed::of(req), 0)
    }

    /// Whether `input` fits with reading `reading` of its path: the method is read first (a
    /// word, where the path costs a scan to normalise, and most requests a service answers
    /// are reads its policies do not guard), then the path, then the host, each only if this
    /// match names it. A method that does not fit fails every reading of the path alike.
    pub fn fits(&self, input: &mut impl MatchInput, reading: usize) -> bool {
        if !self.methods.is_empty() {
            let method = input.method();
            if !self.methods.iter().any(|m| m == method) {
                return false;
            }
        }
        if self.path_prefix.is_some() || self.path_exact.is_some() {
            let Some(path) = input.path(reading) else {
                return false;
            };
            if self
                .path_prefix
                .as_ref()
                .is_some_and(|p| !path.starts_with(p.as_str()))
                || self
                    .path_exact
                    .as_ref()
                    .is_some_and(|p| trim_slash(path) != trim_slash(p))
            {
                return false;
            }
        } else if reading > 0 {
            // Another reading of the path changes nothing for a match that ignores it.
            return false;
        }
        if self.host.as_ref().is_some_and(|h| input.host() != h) {
            return false;
        }
        self.headers
            .iter()
            .all(|h| h.test.holds(input.header(&h.name)))
    }
}

/// What the policies make of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selected {
    /// Policy `i` guards the request.
    Policy(usize),
    /// The path is ambiguous and one of its readings fits policy `i`: refused, not guessed.
    AmbiguousPath(usize),
}

impl Selected {
    pub fn index(self) -> usize {
        match self {
            Selected::Policy(i) | Selected::AmbiguousPath(i) => i,
        }
    }
}

/// The first policy whose match fits `input`. With a [`Probe`], only the pseudo-headers the
/// matchers need are read, each at most once; the other readings of an ambiguous path are
/// tried only when no policy fits the canonical one.
pub fn policy_index(policies: &[Policy], input: &mut impl MatchInput) -> Option<Selected> {
    if let Some(i) = policies.iter().position(|p| p.matcher.fits(input, 0)) {
        return Some(if input.path_ambiguous() {
            Selected::AmbiguousPath(i)
        } else {
            Selected::Policy(i)
        });
    }
    // No matcher read the path: none looks at it, so no reading of it fits either.
    if !input.path_read() || !input.path_ambiguous() {
        return None;
    }
    let mut n = 1;
    while input.path(n).is_some() {
        if let Some(i) = policies.iter().position(|p| p.matcher.fits(input, n)) {
            return Some(Selected::AmbiguousPath(i));
        }
        n += 1;
    }
    None
}

/// The first policy that guards the request (ambiguous paths included).
pub fn select_policy<'a>(policies: &'a [Policy], req: &Request) -> Option<&'a Policy> {
    parsed_policy_index(policies, req).and_then(|s| policies.get(s.index()))
}

/// [`policy_index`] of a request already parsed.
pub fn parsed_policy_index(policies: &[Policy], req: &Request) -> Option<Selected> {
    policy_index(policies, &mut Parsed::of(req))
}

/// The pseudo-headers a matcher reads, from the request's header map, each normalised at most
/// once and only when a matcher needs it: most requests match no policy, and normalising a
/// path costs a scan.
pub struct Probe<'a> {
    headers: &'a Headers,
    method: Option<Cow<'static, str>>,
    path: Option<PathForm<'a>>,
    host: Option<Cow<'a, str>>,
}

impl<'a> Probe<'a> {
    /// Matches on `headers`, the request's map (lower-case names), borrowed: nothing is copied
    /// but what a matcher normalises.
    pub fn new(headers: &'a Headers) -> Probe<'a> {
        Probe {
            headers,
            method: None,
            path: None,
            host: None,
        }
    }

    /// What the matchers made this probe normalise, for [`Request::from_probed`].
    pub fn into_probed(self) -> Probed {
        let headers = self.headers;
        Probed {
            method: self.method,
            path: self
                .path
                .map(|p| (Normal::of(p.canonical, headers), p.others, p.ambiguous)),
            host: self.host.map(|h| Normal::of(h, headers)),
        }
    }

    /// Not inlined: each of the matcher's path readings asks, and this is one copy.
    #[inline(never)]
    fn form(&mut self) -> &PathForm<'a> {
        self.path
            .get_or_insert_with(|| normalize_path(split_path(first(self.headers, ":path")).0))
    }
}

/// The pseudo-headers a [`Probe`] normalised (each `None` when no matcher read it), ranges of
/// its map where they were in normal form: the path's canonical form, its other readings and
/// whether it is ambiguous.
#[derive(Debug, Default)]
pub struct Probed {
    method: Option<Cow<'static, str>>,
    path: Option<(Normal, Vec<String>, bool)>,
    host: Option<Normal>,
}

/// The first value of `name`, empty when the request has none.
fn first<'a>(headers: &'a Headers, name: &str) -> &'a str {
    headers.values(name).next().unwrap_or_default()
}

impl MatchInput for Probe<'_> {
    fn method(&mut self) -> &str {
        self.method
            .get_or_insert_with(|| method_of(first(self.headers, ":method")))
    }

    fn path(&mut self, n: usize) -> Option<&str> {
        self.form().reading(n)
    }

    fn path_ambiguous(&mut self) -> bool {
        self.form().ambiguous
    }

    fn path_read(&self) -> bool {
        self.path.is_some()
    }

    fn host(&mut self) -> &str {
        self.host
            .get_or_insert_with(|| host_of(first(self.headers, ":authority")))
    }

    fn header(&mut self, name: &str) -> Result<Option<&str>, Repeated> {
        single(self.headers.values(name))
    }
}

/// Who is calling: the raw tenant and principal. These never leave the filter unhashed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub tenant: String,
    /// Borrowed when anonymous: most requests name no principal.
    pub principal: Cow<'static, str>,
}

/// The tenant of requests without one (`missing_tenant: anonymous`), and the principal of
/// requests without one: a name no request can give (no header value or claim holds a NUL,
/// see [`identify`]), so no real tenant or principal shares their counters.
pub const ANONYMOUS: &str = "\0anonymous";

/// Why a request has no usable identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantError {
    /// Absent or empty, and `missing_tenant: reject`.
    Missing,
    /// Present, but it names no one tenant (a claim that is a fraction, a number a double
    /// cannot hold exactly, a boolean, a map, a list or null; a value with a NUL): refused
    /// whatever `missing_tenant` says.
    Unusable,
    /// The tenant header appears more than once: which tenant is calling is ambiguous.
    Repeated,
    /// The principal header appears more than once.
    PrincipalRepeated,
    /// The principal is present but names no one principal (as [`TenantError::Unusable`]).
    PrincipalUnusable,
}

/// Resolves the caller from its identity sources: headers, or claims read from the request's
/// metadata (then the header of that role is ignored entirely: a forged one changes nothing).
pub fn identify(identity: &Identity, req: &Request) -> Result<Caller, TenantError> {
    let tenant = match &identity.tenant {
        IdSource::Header(h) => req
            .single_header(h)
            .map_err(|Repeated| TenantError::Repeated)?,
        IdSource::Metadata(_) => claim(&req.tenant_claim).ok_or(TenantError::Unusable)?,
    };
    let tenant = match tenant.filter(|t| !t.is_empty()) {
        Some(t) if t.contains('\0') => return Err(TenantError::Unusable),
        Some(t) => t.to_string(),
        None if identity.missing_tenant == MissingTenant::Anonymous => ANONYMOUS.to_string(),
        None => return Err(TenantError::Missing),
    };
    let principal = match &identity.principal {
        IdSource::Header(h) => req
            .single_header(h)
            .map_err(|Repeated| TenantError::PrincipalRepeated)?,
        IdSource::Metadata(_) => {
            claim(&req.principal_claim).ok_or(TenantError::PrincipalUnusable)?
        }
    };
    let principal = match principal.filter(|p| !p.is_empty()) {
        Some(p) if p.contains('\0') => return Err(TenantError::PrincipalUnusable),
        Some(p) => Cow::Owned(p.to_string()),
        None => Cow::Borrowed(ANONYMOUS),
    };
    Ok(Caller { tenant, principal })
}

/// A claim as an identity's text (`Ok(None)`: absent); `None` when it names no one identity.
fn claim(claim: &Claim) -> Option<Option<&str>> {
    match claim {
        Claim::Absent => Some(None),
        Claim::Text(t) => Some(Some(t.as_str())),
        Claim::Unusable => None,
    }
}

/// The value a selector takes for this request; `None` when the request does not carry it.
/// Paths are canonical and query parameters decoded, so one resource has one name; a
/// repeated input is refused before (see [`repeated_input`]).
pub fn selector_value<'a>(sel: &Selector, caller: &'a Caller, req: &'a Request) -> Option<&'a str> {
    match sel {
        Selector::Tenant => Some(caller.tenant.as_str()),
        Selector::Principal => Some(caller.principal.as_ref()),
        Selector::ClientIp => req.client_ip.as_deref(),
        Selector::Method => Some(&req.method),
        Selector::Path => Some(trim_slash(req.path())),
        Selector::Header(h) => req.header(h),
        Selector::PathSegment(n) => req.path().split('/').nth(*n).filter(|s| !s.is_empty()),
        Selector::Query(name) => req
            .params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str()),
    }
}

/// Why a selector's input has more than one reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ambiguity {
    /// The request carries it more than once (a service may read the first, another the last).
    Repeated,
    /// A service that also splits the query on `;` reads another value of the parameter (or
    /// none, or more): `?id=8;` is `8;` here and `8` there.
    Semicolon,
}

/// The first of `selectors` whose input has more than one reading (a header or a query
/// parameter the request carries more than once, a query parameter a `;` changes), and why:
/// which value names the scope is ambiguous.
pub fn ambiguous_input<'s>(
    selectors: impl IntoIterator<Item = &'s Selector>,
    req: &Request,
) -> Option<(&'s Selector, Ambiguity)> {
    // The `;` reading, made once and only for a query that holds one.
    let mut semicolon: Option<Vec<(String, String)>> = None;
    selectors.into_iter().find_map(|sel| match sel {
        Selector::Header(h) if req.single_header(h).is_err() => Some((sel, Ambiguity::Repeated)),
        Selector::Query(q) if req.single_param(q).is_err() => Some((sel, Ambiguity::Repeated)),
        Selector::Query(q) if req.query.contains(';') => {
            let other = semicolon.get_or_insert_with(|| query_pairs_semicolon(&req.query));
            let values = |pairs: &[(String, String)]| -> Vec<String> {
                pairs
                    .iter()
                    .filter(|(n, _)| n == q)
                    .map(|(_, v)| v.clone())
                    .collect()
            };
            (values(&req.params) != values(other)).then_some((sel, Ambiguity::Semicolon))
        }
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    pub fn req(method: &str, path: &str, host: &str) -> Request {
        Request::from_headers(
            vec![
                (":method".into(), method.into()),
                (":path".into(), path.into()),
                (":authority".into(), host.into()),
                ("X-Tenant-Id".into(), "acme".into()),
            ],
            Some("10.1.2.3:5555"),
        )
    }

    #[test]
    fn parses_pseudo_headers() {
        let r = req("post", "/orders/1?x=1&y=2", "API.example.com:8443");
        assert_eq!(r.method, "POST");
        assert_eq!(r.path(), "/orders/1");
        assert_eq!(r.query, "x=1&y=2");
        assert_eq!(r.host(), "api.example.com");
        assert_eq!(r.client_ip.as_deref(), Some("10.1.2.3"));
        assert_eq!(r.header("x-tenant-id"), Some("acme"));
    }

    /// The method, path and host in normal form: borrowed from the map when it already was
    /// (no copy), else a copy; either way the same text as normalising a copy.
    #[test]
    fn normal_forms_borrow_what_is_already_normal() {
        for (raw, want, borrowed) in [
            ("GET", "GET", true),
            ("get", "GET", true),
            ("Patch", "PATCH", true),
            ("PROPFIND", "PROPFIND", false),
            ("propfind", "PROPFIND", false),
            ("", "", false),
        ] {
            let m = method_of(raw);
            assert_eq!(
                (&*m, matches!(m, Cow::Borrowed(_))),
                (want, borrowed),
                "{raw}"
            );
        }
        for (raw, want, borrowed) in [
            ("api.example.com:8443", "api.example.com", true),
            ("example.com.", "example.com", true),
            ("[::1]:80", "::1", true),
            ("API.Example.com:8443", "api.example.com", false),
            ("", "", true),
        ] {
            let h = host_of(raw);
            assert_eq!(
                (&*h, matches!(h, Cow::Borrowed(_))),
                (want, borrowed),
                "{raw}"
            );
        }
        for (path, host, want_path, want_host, within) in [
            (
                "/a/b?q=1",
                "h.example:80",
                "/a/b",
                "h.example",
                (true, true),
            ),
            (
                "/a//./b%41",
                "H.example",
                "/a/bA",
                "h.example",
                (false, false),
            ),
        ] {
            let mut r = req("GET", path, host);
            let kept = |n: &Normal| matches!(n, Normal::Within(_));
            assert_eq!((kept(&r.path), kept(&r.host)), within, "{path} {host}");
            // The map only grows: what was borrowed from it reads the same.
            r.headers.push(":path", "/other");
            r.headers.push(":authority", "other");
            assert_eq!((r.path(), r.host()), (want_path, want_host));
            assert_eq!(r.method, "GET");
        }
    }

    #[test]
    fn strips_ports() {
        for (input, want) in [
            ("10.0.0.1:80", "10.0.0.1"),
            ("[::1]:8080", "::1"),
            ("::1", "::1"),
            ("example.com", "example.com"),
            ("example.com:443", "example.com"),
        ] {
            assert_eq!(strip_port(input), want, "{input}");
        }
    }

    #[test]
    fn policy_matching() {
        let config = Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [
                {"name": "exact", "match": {"path_exact": "/health"}},
                {"name": "orders-post", "match": {"methods": ["POST", "patch"], "path_prefix": "/orders"}},
                {"name": "admin-host", "match": {"host": "Admin.Example.com", "path_prefix": "/"}},
                {"name": "orders-any-get", "match": {"methods": ["GET"], "path_prefix": "/orders"}}
            ]}"#,
        )
        .expect("valid");
        let cases = [
            ("GET", "/health", "x", Some("exact")),
            ("GET", "/health/deep", "x", None),
            ("POST", "/orders", "x", Some("orders-post")),
            ("PATCH", "/orders/7", "x", Some("orders-post")),
            ("POST", "/order", "x", None),
            (
                "DELETE",
                "/anything",
                "admin.example.com:80",
                Some("admin-host"),
            ),
            ("GET", "/orders?page=2", "x", Some("orders-any-get")),
            ("PUT", "/orders", "x", None),
        ];
        for (method, path, host, want) in cases {
            let got =
                select_policy(&config.policies, &req(method, path, host)).map(|p| p.name.as_str());
            assert_eq!(got, want, "{method} {path} {host}");
            // The lazy probe agrees.
            let map: Headers = [(":method", method), (":path", path), (":authority", host)]
                .into_iter()
                .collect();
            let lazy = policy_index(&config.policies, &mut Probe::new(&map))
                .map(|i| config.policies[i.index()].name.as_str());
            assert_eq!(lazy, want, "lazy: {method} {path} {host}");
        }
        // A request no policy's method fits reads only the method, whatever its path: no
        // reading of an ambiguous one fits either.
        let only_posts = Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [
                {"name": "a", "match": {"methods": ["POST"], "path_prefix": "/orders"}},
                {"name": "b", "match": {"methods": ["PUT"], "path_exact": "/x"}}]}"#,
        )
        .expect("valid");
        for path in ["/orders", "/x", "/elsewhere/..%2Forders", "//orders"] {
            let map: Headers = [(":method", "GET"), (":path", path)].into_iter().collect();
            let mut probe = Probe::new(&map);
            assert!(
                policy_index(&only_posts.policies, &mut probe).is_none(),
                "{path}"
            );
            assert!(probe.method.is_some() && probe.path.is_none() && probe.host.is_none());
        }
        // One whose method fits and no path does reads the path, never the host.
        let map: Headers = [(":method", "POST"), (":path", "/elsewhere")]
            .into_iter()
            .collect();
        let mut probe = Probe::new(&map);
        let only_orders = Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [
                {"name": "a", "match": {"methods": ["POST"], "path_prefix": "/orders"}},
                {"name": "b", "match": {"host": "h", "path_exact": "/x"}}]}"#,
        )
        .expect("valid");
        assert!(policy_index(&only_orders.policies, &mut probe).is_none());
        assert!(probe.path.is_some() && probe.method.is_some() && probe.host.is_none());
        let catch_all =
            Config::parse(br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "all"}]}"#)
                .expect("valid");
        assert!(select_policy(&catch_all.policies, &req("GET", "/", "h")).is_some());
    }

    /// The request built with what the policies' probe normalised is the one built from
    /// scratch, whatever the map: repeated, odd or missing pseudo-headers included (a repeat
    /// reads as it always did, the last one counting in the request).
    #[test]
    fn a_probed_request_is_the_request_parsed_from_scratch() {
        let config = Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [
                {"name": "m", "match": {"methods": ["POST"], "path_prefix": "/zz"}},
                {"name": "h", "match": {"host": "nothing.example"}},
                {"name": "p", "match": {"path_prefix": "/api"}}
            ]}"#,
        )
        .expect("valid");
        let cases: [(&str, &[(&str, &str)]); 8] = [
            (
                "plain",
                &[
                    (":method", "get"),
                    (":path", "/api/x?a=1&a=2"),
                    (":authority", "H.example:8080"),
                ],
            ),
            (
                "encoded and dotted",
                &[
                    (":method", "POST"),
                    (":path", "/api/%2e%2e/x%2Fy;p=1"),
                    (":authority", "[::1]:80"),
                ],
            ),
            (
                "repeated path",
                &[
                    (":method", "GET"),
                    (":path", "/api/a"),
                    (":path", "/b/../api/c"),
                ],
            ),
            (
                "repeated method and host",
                &[
                    (":method", "get"),
                    (":method", "PoSt"),
                    (":authority", "a."),
                    (":authority", "B:1"),
                    (":path", "/api"),
                ],
            ),
            ("no pseudo-headers", &[("x-tenant-id", "t")]),
            (
                "empty path",
                &[(":method", "GET"), (":path", ""), (":authority", "")],
            ),
            (
                "backslash and NUL",
                &[
                    (":method", "GET"),
                    (":path", "/api\\x%00"),
                    (":authority", "h"),
                ],
            ),
            (
                "query only",
                &[(":method", "GET"), (":path", "?q"), (":authority", "h:")],
            ),
        ];
        for (name, pairs) in cases {
            let map: Headers = pairs.iter().copied().collect();
            let mut probe = Probe::new(&map);
            let _ = policy_index(&config.policies, &mut probe);
            let probed = probe.into_probed();
            let read = (
                probed.method.is_some(),
                probed.path.is_some(),
                probed.host.is_some(),
            );
            assert_eq!(
                Request::from_probed(map.clone(), Some("10.0.0.1:5"), probed),
                Request::from_map(map, Some("10.0.0.1:5")),
                "{name} (probe read method, path, host: {read:?})"
            );
        }
    }

    #[test]
    fn hostile_spellings_of_a_guarded_path() {
        let config = Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [
                {"name": "exact", "match": {"methods": ["POST"], "path_exact": "/orders"}},
                {"name": "lease", "match": {"methods": ["POST"], "path_prefix": "/lease/"}},
                {"name": "admin", "match": {"host": "admin.example.com"}}
            ]}"#,
        )
        .expect("valid");
        let p = |i| Some(Selected::Policy(i));
        let amb = |i| Some(Selected::AmbiguousPath(i));
        let cases = [
            ("/orders", "x", p(0)),
            ("//orders", "x", p(0)),
            ("/%6Frders", "x", p(0)),
            ("/x/../orders", "x", p(0)),
            ("/orders//", "x", p(0)),
            ("/orders/", "x", p(0)),
            ("/./orders?x=1", "x", p(0)),
            ("/%2E%2E/orders", "x", p(0)),
            ("/lease/%31/act", "x", p(1)),
            ("/lease/1%2F2/act", "x", amb(1)),
            ("/x%2F..%2Forders", "x", amb(0)),
            ("/orders;jsessionid=1", "x", amb(0)),
            ("/orders%00", "x", amb(0)),
            ("/orders\\", "x", amb(0)),
            ("/lease/1%zz", "x", amb(1)),
            ("/a//../orders", "x", amb(0)),
            ("/orders%252F", "x", amb(0)),
            // Ambiguous, but no reading is guarded: not the filter's business.
            ("/other%2Fpath", "x", None),
            ("/other;x", "x", None),
            // A policy that ignores the path still refuses an ambiguous one.
            ("/any%2Fthing", "admin.example.com.", amb(2)),
            ("/anything", "ADMIN.example.com:443", p(2)),
        ];
        for (path, host, want) in cases {
            let r = req("POST", path, host);
            assert_eq!(
                parsed_policy_index(&config.policies, &r),
                want,
                "{path} {host}"
            );
            let map: Headers = [(":method", "POST"), (":path", path), (":authority", host)]
                .into_iter()
                .collect();
            assert_eq!(
                policy_index(&config.policies, &mut Probe::new(&map)),
                want,
                "lazy: {path} {host}"
            );
        }
    }

    #[test]
    fn selector_values() {
        let r = req("POST", "/orders/123/activate?mode=fast&x=&dry", "h");
        let caller = Caller {
            tenant: "t".into(),
            principal: "p".into(),
        };
        let cases = [
            (Selector::PathSegment(1), Some("orders")),
            (Selector::PathSegment(2), Some("123")),
            (Selector::PathSegment(3), Some("activate")),
            (Selector::PathSegment(4), None),
            (Selector::Query("mode".into()), Some("fast")),
            (Selector::Query("x".into()), Some("")),
            (Selector::Query("dry".into()), Some("")),
            (Selector::Query("missing".into()), None),
            (Selector::Header("x-tenant-id".into()), Some("acme")),
            (Selector::Method, Some("POST")),
            (Selector::Path, Some("/orders/123/activate")),
        ];
        for (sel, want) in cases {
            assert_eq!(selector_value(&sel, &caller, &r), want, "{sel:?}");
        }
        // One resource, one name: however the path and query are spelled.
        for (path, segment, id) in [
            ("/orders//123/activate/?id=8", "123", "8"),
            ("/orders/%31%32%33/activate?id=%38", "123", "8"),
            ("/x/../orders/123/./activate?i%64=8", "123", "8"),
            ("/%6Frders/12%33/activate?id=8&other=1", "123", "8"),
        ] {
            let r = req("POST", path, "h");
            assert_eq!(
                selector_value(&Selector::PathSegment(2), &caller, &r),
                Some(segment),
                "{path}"
            );
            assert_eq!(
                selector_value(&Selector::Query("id".into()), &caller, &r),
                Some(id),
                "{path}"
            );
            assert_eq!(
                selector_value(&Selector::Path, &caller, &r),
                Some("/orders/123/activate"),
                "{path}"
            );
        }
        let r = req("POST", "/orders/a%3Ab?q=a+b%2Bc", "h");
        assert_eq!(
            selector_value(&Selector::PathSegment(2), &caller, &r),
            Some("a:b")
        );
        assert_eq!(
            selector_value(&Selector::Query("q".into()), &caller, &r),
            Some("a b+c")
        );
    }

    #[test]
    fn repeated_inputs_are_ambiguous() {
        let mut r = req("POST", "/orders/1?id=1&id=2&one=1", "h");
        r.headers.push("x-a", "1");
        r.headers.push("x-a", "2");
        r.headers.push("x-b", "1");
        let q = Selector::Query("id".into());
        let a = Selector::Header("x-a".into());
        type Found<'s> = Option<(&'s Selector, Ambiguity)>;
        let repeated = |s| Some((s, Ambiguity::Repeated));
        let cases: [(&[Selector], Found<'_>); 6] = [
            (&[Selector::Tenant, Selector::PathSegment(2)], None),
            (&[Selector::Query("one".into())], None),
            (&[Selector::Header("x-b".into())], None),
            (&[Selector::Tenant, q.clone()], repeated(&q)),
            (std::slice::from_ref(&a), repeated(&a)),
            (&[Selector::Query("absent".into())], None),
        ];
        for (sels, want) in cases {
            assert_eq!(ambiguous_input(sels, &r), want, "{sels:?}");
        }
        // Repeated once decoded: `i%64` is `id`.
        let r = req("POST", "/orders/1?id=1&i%64=1", "h");
        assert_eq!(ambiguous_input(std::slice::from_ref(&q), &r), repeated(&q));
    }

    #[test]
    fn a_semicolon_that_changes_a_query_selector_is_ambiguous() {
        let q = Selector::Query("id".into());
        let semicolon = Some((&q, Ambiguity::Semicolon));
        for (query, want) in [
            ("id=8;", semicolon),
            ("id=8;id=9", semicolon),
            ("x=1;id=9", semicolon),
            ("id=8;x=1", semicolon),
            ("id=8&x=1;id=9", semicolon),
            ("x=a;b&id=8", None),
            ("id=8&x=a;b", None),
            ("id=8%3B", None),
            ("x=a;b", None),
            ("id=8&id=8;", Some((&q, Ambiguity::Repeated))),
        ] {
            let r = req("POST", &format!("/orders/1?{query}"), "h");
            assert_eq!(
                ambiguous_input(std::slice::from_ref(&q), &r),
                want,
                "{query}"
            );
        }
        // Other selectors never mind a `;`.
        let r = req("POST", "/orders/1?id=8;", "h");
        assert_eq!(ambiguous_input(&[Selector::PathSegment(2)], &r), None);
    }

    #[test]
    fn identity() {
        let mut id = Identity {
            tenant: IdSource::Header("x-tenant-id".into()),
            principal: IdSource::Header("x-user-id".into()),
            missing_tenant: MissingTenant::Reject,
        };
        let with = req("GET", "/", "h");
        let caller = identify(&id, &with).expect("tenant present");
        assert_eq!(caller.tenant, "acme");
        assert_eq!(caller.principal, ANONYMOUS);
        let mut without = with.clone();
        without.headers.retain(|n, _| n != "x-tenant-id");
        assert_eq!(identify(&id, &without), Err(TenantError::Missing));
        without.headers.push("x-tenant-id", "");
        assert_eq!(
            identify(&id, &without),
            Err(TenantError::Missing),
            "empty tenant is missing"
        );
        let mut twice = with.clone();
        twice.headers.push("x-tenant-id", "globex");
        assert_eq!(identify(&id, &twice), Err(TenantError::Repeated));
        let mut two_users = with.clone();
        two_users.headers.push("x-user-id", "alice");
        two_users.headers.push("x-user-id", "mallory");
        assert_eq!(
            identify(&id, &two_users),
            Err(TenantError::PrincipalRepeated)
        );
        id.missing_tenant = MissingTenant::Anonymous;
        assert_eq!(
            identify(&id, &without).expect("anonymous").tenant,
            ANONYMOUS
        );
        // No tenant a request names is the anonymous bucket.
        let mut named = with.clone();
        named.headers.retain(|n, _| n != "x-tenant-id");
        named.headers.push("x-tenant-id", "anonymous");
        assert_eq!(identify(&id, &named).expect("a tenant").tenant, "anonymous");
        assert_ne!(ANONYMOUS, "anonymous");
        named.headers.retain(|n, _| n != "x-tenant-id");
        named.headers.push("x-tenant-id", ANONYMOUS);
        assert_eq!(identify(&id, &named), Err(TenantError::Unusable));
    }

    #[test]
    fn identity_from_claims_ignores_the_headers() {
        let claims = Identity {
            tenant: IdSource::Metadata(vec!["f".into(), "payload".into(), "tid".into()]),
            principal: IdSource::Metadata(vec!["f".into(), "payload".into(), "sub".into()]),
            missing_tenant: MissingTenant::Reject,
        };
        let mut r = req("GET", "/", "h");
        r.headers.push("x-user-id", "mallory");
        r.headers.push("x-user-id", "again");
        assert_eq!(
            identify(&claims, &r),
            Err(TenantError::Missing),
            "no claim, header ignored"
        );
        r.tenant_claim = Claim::Text("tenant-a".into());
        let caller = identify(&claims, &r).expect("from the claim");
        assert_eq!(
            (caller.tenant.as_str(), caller.principal.as_ref()),
            ("tenant-a", ANONYMOUS)
        );
        r.principal_claim = Claim::Text("alice".into());
        assert_eq!(identify(&claims, &r).expect("claims").principal, "alice");
        r.principal_claim = Claim::Unusable;
        assert_eq!(identify(&claims, &r), Err(TenantError::PrincipalUnusable));
        r.principal_claim = Claim::Absent;
        // A claim that names no one tenant is refused, even where a missing one is anonymous.
        let mut anonymous = claims.clone();
        anonymous.missing_tenant = MissingTenant::Anonymous;
        r.tenant_claim = Claim::Unusable;
        assert_eq!(identify(&anonymous, &r), Err(TenantError::Unusable));
        r.tenant_claim = Claim::Absent;
        assert_eq!(
            identify(&anonymous, &r).expect("anonymous").tenant,
            ANONYMOUS
        );
        r.tenant_claim = Claim::Text("anonymous".into());
        assert_ne!(
            identify(&anonymous, &r).expect("a tenant").tenant,
            ANONYMOUS
        );
    }

    #[test]
    fn header_conditions() {
        let config = Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [
                {"name": "gold", "match": {"headers": [{"name": "x-plan", "exact": "gold"}]}},
                {"name": "free", "match": {"headers": [{"name": "x-plan", "prefix": "fr"},
                                                       {"name": "x-beta", "present": false}]}},
                {"name": "beta", "match": {"headers": [{"name": "x-beta", "present": true}]}},
                {"name": "rest"}]}"#,
        )
        .expect("valid");
        let cases: [(&[(&str, &str)], &str); 6] = [
            (&[("x-plan", "gold")], "gold"),
            (&[("x-plan", "free")], "free"),
            (&[("x-plan", "free"), ("x-beta", "1")], "beta"),
            (&[("x-plan", "gold"), ("x-plan", "gold")], "rest"),
            (&[("x-beta", "1"), ("x-beta", "2")], "beta"),
            (&[("x-plan", "GOLD")], "rest"),
        ];
        for (headers, want) in cases {
            let mut r = req("GET", "/", "h");
            r.headers
                .extend(headers.iter().map(|(n, v)| (n.to_string(), v.to_string())));
            let got = select_policy(&config.policies, &r).map(|p| p.name.as_str());
            assert_eq!(got, Some(want), "{headers:?}");
            let lazy = policy_index(&config.policies, &mut Probe::new(&r.headers))
                .map(|s| config.policies[s.index()].name.as_str());
            assert_eq!(lazy, Some(want), "lazy: {headers:?}");
        }
    }
}
