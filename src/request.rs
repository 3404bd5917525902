//! The parts of an HTTP request the filter looks at, copied out of the host once.

use crate::config::{Identity, Match, MissingTenant, Policy, Selector};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    /// Upper-case method.
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// The raw query string, without `?`.
    pub query: String,
    /// Lower-case host without port.
    pub host: String,
    /// The downstream address without port, if the host told us.
    pub client_ip: Option<String>,
    /// Lower-case header names with their values, in arrival order.
    pub headers: Vec<(String, String)>,
}

impl Request {
    /// Builds a request from header pairs (pseudo-headers `:method`, `:path`, `:authority`
    /// included) and the downstream address (`ip:port` or `[v6]:port`).
    pub fn from_headers(headers: Vec<(String, String)>, source_address: Option<&str>) -> Request {
        let mut req = Request {
            client_ip: source_address.map(strip_port),
            ..Request::default()
        };
        for (name, value) in &headers {
            match name.as_str() {
                ":method" => req.method = value.to_ascii_uppercase(),
                ":path" => {
                    let (path, query) = split_path(value);
                    req.path = path.to_string();
                    req.query = query.to_string();
                }
                ":authority" => req.host = host_of(value),
                _ => {}
            }
        }
        // Envoy hands names over in lower case already: lower-case in place, no copies.
        req.headers = headers;
        for (name, _) in &mut req.headers {
            name.make_ascii_lowercase();
        }
        req
    }

    /// The first value of a header (name in lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `:path` as the path and the query string (without `?`).
fn split_path(raw: &str) -> (&str, &str) {
    raw.split_once('?').unwrap_or((raw, ""))
}

/// `:authority` as a matcher compares it: lower case, without port.
fn host_of(authority: &str) -> String {
    strip_port(authority).to_ascii_lowercase()
}

fn strip_port(addr: &str) -> String {
    if let Some(rest) = addr.strip_prefix('[') {
        // [v6]:port
        return rest.split(']').next().unwrap_or(rest).to_string();
    }
    match addr.rsplit_once(':') {
        // A bare IPv6 address has more than one colon and no port.
        Some((host, port)) if !host.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => {
            host.to_string()
        }
        _ => addr.to_string(),
    }
}

/// The pseudo-headers a policy's match reads, normalised as in [`Request`].
pub trait MatchInput {
    fn method(&mut self) -> &str;
    fn path(&mut self) -> &str;
    fn host(&mut self) -> &str;
}

impl MatchInput for &Request {
    fn method(&mut self) -> &str {
        &self.method
    }
    fn path(&mut self) -> &str {
        &self.path
    }
    fn host(&mut self) -> &str {
        &self.host
    }
}

impl Match {
    pub fn matches(&self, req: &Request) -> bool {
        self.fits(&mut &*req)
    }

    /// Whether `input` fits: the path is read first (it tells most policies apart), then the
    /// method, then the host, each only if this match names it.
    pub fn fits(&self, input: &mut impl MatchInput) -> bool {
        if self.path_prefix.is_some() || self.path_exact.is_some() {
            let path = input.path();
            if self
                .path_prefix
                .as_ref()
                .is_some_and(|p| !path.starts_with(p.as_str()))
                || self.path_exact.as_ref().is_some_and(|p| path != p)
            {
                return false;
            }
        }
        if !self.methods.is_empty() {
            let method = input.method();
            if !self.methods.iter().any(|m| m == method) {
                return false;
            }
        }
        self.host.as_ref().is_none_or(|h| input.host() == h)
    }
}

/// The first policy whose match fits the request.
pub fn select_policy<'a>(policies: &'a [Policy], req: &Request) -> Option<&'a Policy> {
    policies.iter().find(|p| p.matcher.matches(req))
}

/// The pseudo-headers a matcher reads, each fetched at most once and only when a matcher
/// needs it: in the proxy every read is a host call, and most requests match no policy.
pub struct Probe<F: FnMut(&str) -> Option<String>> {
    read: F,
    method: Option<String>,
    path: Option<String>,
    host: Option<String>,
}

impl<F: FnMut(&str) -> Option<String>> Probe<F> {
    /// `read(name)` returns the raw value of `:method`, `:path` or `:authority`.
    pub fn new(read: F) -> Probe<F> {
        Probe {
            read,
            method: None,
            path: None,
            host: None,
        }
    }
}

impl<F: FnMut(&str) -> Option<String>> MatchInput for Probe<F> {
    fn method(&mut self) -> &str {
        let read = &mut self.read;
        self.method
            .get_or_insert_with(|| read(":method").unwrap_or_default().to_ascii_uppercase())
    }

    fn path(&mut self) -> &str {
        let read = &mut self.read;
        self.path.get_or_insert_with(|| {
            let raw = read(":path").unwrap_or_default();
            split_path(&raw).0.to_string()
        })
    }

    fn host(&mut self) -> &str {
        let read = &mut self.read;
        self.host
            .get_or_insert_with(|| host_of(&read(":authority").unwrap_or_default()))
    }
}

/// The index of the first policy whose match fits `input`; with a [`Probe`], only the
/// pseudo-headers the matchers need are read, each at most once.
pub fn policy_index(policies: &[Policy], input: &mut impl MatchInput) -> Option<usize> {
    policies.iter().position(|p| p.matcher.fits(input))
}

/// Who is calling: the raw tenant and principal. These never leave the filter unhashed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub tenant: String,
    pub principal: String,
}

pub const ANONYMOUS: &str = "anonymous";

/// Why a request has no usable tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantError {
    /// Absent or empty, and `missing_tenant: reject`.
    Missing,
    /// The header appears more than once: which tenant is calling is ambiguous.
    Repeated,
}

/// Resolves the caller from the identity headers.
pub fn identify(identity: &Identity, req: &Request) -> Result<Caller, TenantError> {
    let mut values = req
        .headers
        .iter()
        .filter(|(n, _)| *n == identity.tenant_header);
    let first = values.next().map(|(_, v)| v.as_str());
    if values.next().is_some() {
        return Err(TenantError::Repeated);
    }
    let tenant = match first.filter(|t| !t.is_empty()) {
        Some(t) => t.to_string(),
        None if identity.missing_tenant == MissingTenant::Anonymous => ANONYMOUS.to_string(),
        None => return Err(TenantError::Missing),
    };
    let principal = req
        .header(&identity.principal_header)
        .filter(|p| !p.is_empty())
        .unwrap_or(ANONYMOUS)
        .to_string();
    Ok(Caller { tenant, principal })
}

/// The value a selector takes for this request; `None` when the request does not carry it.
pub fn selector_value<'a>(sel: &Selector, caller: &'a Caller, req: &'a Request) -> Option<&'a str> {
    match sel {
        Selector::Tenant => Some(caller.tenant.as_str()),
        Selector::Principal => Some(caller.principal.as_str()),
        Selector::ClientIp => req.client_ip.as_deref(),
        Selector::Method => Some(req.method.as_str()),
        Selector::Path => Some(req.path.as_str()),
        Selector::Header(h) => req.header(h),
        Selector::PathSegment(n) => req.path.split('/').nth(*n).filter(|s| !s.is_empty()),
        Selector::Query(name) => req.query.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (k == name).then_some(v)
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

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
        assert_eq!(r.path, "/orders/1");
        assert_eq!(r.query, "x=1&y=2");
        assert_eq!(r.host, "api.example.com");
        assert_eq!(r.client_ip.as_deref(), Some("10.1.2.3"));
        assert_eq!(r.header("x-tenant-id"), Some("acme"));
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
            // The lazy probe agrees and reads each pseudo-header at most once.
            let mut reads = Vec::new();
            let mut probe = Probe::new(|name: &str| {
                reads.push(name.to_string());
                [(":method", method), (":path", path), (":authority", host)]
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.to_string())
            });
            let lazy = policy_index(&config.policies, &mut probe)
                .map(|i| config.policies[i].name.as_str());
            drop(probe);
            assert_eq!(lazy, want, "lazy: {method} {path} {host}");
            let mut unique = reads.clone();
            unique.sort();
            unique.dedup();
            assert_eq!(unique.len(), reads.len(), "each read once: {reads:?}");
        }
        // A request no policy's path fits costs one read.
        let mut reads = 0;
        let mut probe = Probe::new(|name: &str| {
            reads += 1;
            (name == ":path").then(|| "/elsewhere".to_string())
        });
        let only_orders = Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [
                {"name": "a", "match": {"methods": ["POST"], "path_prefix": "/orders"}},
                {"name": "b", "match": {"host": "h", "path_exact": "/x"}}]}"#,
        )
        .expect("valid");
        assert!(policy_index(&only_orders.policies, &mut probe).is_none());
        drop(probe);
        assert_eq!(reads, 1);
        let catch_all =
            Config::parse(br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "all"}]}"#)
                .expect("valid");
        assert!(select_policy(&catch_all.policies, &req("GET", "/", "h")).is_some());
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
        let trailing = req("POST", "/orders//x", "h");
        assert_eq!(
            selector_value(&Selector::PathSegment(2), &caller, &trailing),
            None,
            "empty segment"
        );
    }

    #[test]
    fn identity() {
        let mut id = Identity {
            tenant_header: "x-tenant-id".into(),
            principal_header: "x-user-id".into(),
            missing_tenant: MissingTenant::Reject,
        };
        let with = req("GET", "/", "h");
        let caller = identify(&id, &with).expect("tenant present");
        assert_eq!(caller.tenant, "acme");
        assert_eq!(caller.principal, ANONYMOUS);
        let mut without = with.clone();
        without.headers.retain(|(n, _)| n != "x-tenant-id");
        assert_eq!(identify(&id, &without), Err(TenantError::Missing));
        without.headers.push(("x-tenant-id".into(), String::new()));
        assert_eq!(
            identify(&id, &without),
            Err(TenantError::Missing),
            "empty tenant is missing"
        );
        let mut twice = with.clone();
        twice.headers.push(("x-tenant-id".into(), "globex".into()));
        assert_eq!(identify(&id, &twice), Err(TenantError::Repeated));
        id.missing_tenant = MissingTenant::Anonymous;
        assert_eq!(
            identify(&id, &without).expect("anonymous").tenant,
            ANONYMOUS
        );
    }
}
