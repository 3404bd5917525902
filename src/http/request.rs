//! The parts of an HTTP request the filter looks at, copied out of the host once: its method,
//! normalised path and query, host, client address, headers and claims. Which policy guards
//! it is [`crate::http::matching`]'s question, who is calling [`crate::http::identity`]'s.

use crate::http::claims::Claim;
use crate::http::headers::Headers;
use crate::http::normalize::{normalize_path, query_pairs, PathForm};
use crate::support::text;
use std::borrow::Cow;
use std::ops::Range;

#[derive(Debug, Clone, Default)]
pub struct Request {
    /// Upper-case method.
    pub(crate) method: Cow<'static, str>,
    /// The path without the query string, in its canonical form (see [`crate::http::normalize`]):
    /// [`Request::path`].
    path: Normal,
    /// Other readings of an ambiguous path; `path_ambiguous` says whether it is one.
    pub(crate) path_others: Vec<String>,
    pub(crate) path_ambiguous: bool,
    /// The raw query string, without `?`.
    pub(crate) query: String,
    /// The query's parameters, decoded, in order.
    pub(crate) params: Vec<(String, String)>,
    /// Lower-case host without port: [`Request::host`].
    host: Normal,
    /// The downstream address without port, if the host told us.
    pub(crate) client_ip: Option<String>,
    /// Lower-case header names with their values, in arrival order. Only ever added to: a
    /// [`Normal`] range of its text stays valid.
    pub(crate) headers: Headers,
    /// The tenant and principal read from the request's metadata (a verified token's claims),
    /// for an identity whose source is `metadata`.
    pub(crate) tenant_claim: Claim,
    pub(crate) principal_claim: Claim,
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
    pub(crate) fn from_map(headers: Headers, source_address: Option<&str>) -> Request {
        Request::from_probed(headers, source_address, Probed::default())
    }

    /// [`Request::from_map`], with what the policies' probe
    /// ([`crate::http::matching::Probe`]) already normalised of the same map (its first `:method`, `:path` and `:authority`), which is not done again.
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
    pub(crate) fn path(&self) -> &str {
        self.path.read(&self.headers)
    }

    /// Lower-case host without port or a trailing dot.
    pub(crate) fn host(&self) -> &str {
        self.host.read(&self.headers)
    }

    /// The first value of a header (name in lower case).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.values(name).next()
    }

    /// The value of a header that must appear at most once; `Err` when it is repeated.
    pub(crate) fn single_header(&self, name: &str) -> Result<Option<&str>, Repeated> {
        single(self.headers.values(name))
    }

    /// The value of a query parameter (decoded) that must appear at most once.
    pub(crate) fn single_param(&self, name: &str) -> Result<Option<&str>, Repeated> {
        single(
            self.params
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.as_str()),
        )
    }
}

/// The pseudo-headers the policies' probe normalised (each `None` when no matcher read it),
/// ranges of its map where they were in normal form: the path's canonical form, its other
/// readings and whether it is ambiguous.
#[derive(Debug, Default)]
pub struct Probed {
    method: Option<Cow<'static, str>>,
    path: Option<(Normal, Vec<String>, bool)>,
    host: Option<Normal>,
}

impl Probed {
    /// What a probe of `headers` normalised: the method, the path's form and the host, each
    /// borrowed from `headers` where it was in normal form.
    pub(super) fn new(
        headers: &Headers,
        method: Option<Cow<'static, str>>,
        path: Option<PathForm<'_>>,
        host: Option<Cow<'_, str>>,
    ) -> Probed {
        Probed {
            method,
            path: path.map(|p| (Normal::of(p.canonical, headers), p.others, p.ambiguous)),
            host: host.map(|h| Normal::of(h, headers)),
        }
    }

    /// Whether the probe normalised the method, the path and the host.
    #[cfg(test)]
    pub(super) fn read(&self) -> (bool, bool, bool) {
        (
            self.method.is_some(),
            self.path.is_some(),
            self.host.is_some(),
        )
    }
}

/// A request input that must appear at most once appears more often: which value counts is
/// ambiguous (a service may read the first, another the last).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repeated;

/// The one value of an input given as `values`, none, or `Err` when there is more than one.
pub(crate) fn single<'a>(
    mut values: impl Iterator<Item = &'a str>,
) -> Result<Option<&'a str>, Repeated> {
    let first = values.next();
    match values.next() {
        Some(_) => Err(Repeated),
        None => Ok(first),
    }
}

/// `:path` as the path and the query string (without `?`).
pub(super) fn split_path(raw: &str) -> (&str, &str) {
    text::split_once_byte(raw, b'?').unwrap_or((raw, ""))
}

/// `:authority` as a matcher compares it: lower case, without port or a trailing dot (a part
/// of `authority` when it has no upper case).
pub(super) fn host_of(authority: &str) -> Cow<'_, str> {
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
pub(super) fn method_of(method: &str) -> Cow<'static, str> {
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A request with a tenant header, from `10.1.2.3`.
    pub(crate) fn req(method: &str, path: &str, host: &str) -> Request {
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
}
