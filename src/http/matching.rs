//! Which policy guards a request: each policy's match (method, path, host, headers) against
//! the request's pseudo-headers, read from its header map only as far as the matchers need
//! ([`Probe`]) or from a request already parsed.

use crate::config::{HeaderTest, Match, Policy};
use crate::http::headers::Headers;
use crate::http::normalize::{normalize_path, trim_slash, PathForm};
use crate::http::request::{host_of, method_of, single, split_path, Probed, Repeated, Request};
use std::borrow::Cow;

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
    #[cfg(any(test, not(target_arch = "wasm32")))]
    pub(crate) fn matches(&self, req: &Request) -> bool {
        self.fits(&mut Parsed::of(req), 0)
    }

    /// Whether `input` fits with reading `reading` of its path: the method is read first (a
    /// word, where the path costs a scan to normalise, and most requests a service answers
    /// are reads its policies do not guard), then the path, then the host, each only if this
    /// match names it. A method that does not fit fails every reading of the path alike.
    pub(crate) fn fits(&self, input: &mut impl MatchInput, reading: usize) -> bool {
        if !self.methods.is_empty() {
            let method = input.method();
            if !self.methods.iter().any(|m| m == method) {
                return false;
            }
        }
        if self.path_prefix.is_some() || self.path_exact.is_some() || self.path_template.is_some() {
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
                || self
                    .path_template
                    .as_ref()
                    .is_some_and(|t| !t.matches(path))
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
    pub(crate) fn index(self) -> usize {
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
pub(crate) fn parsed_policy_index(policies: &[Policy], req: &Request) -> Option<Selected> {
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
        Probed::new(self.headers, self.method, self.path, self.host)
    }

    /// Not inlined: each of the matcher's path readings asks, and this is one copy.
    #[inline(never)]
    fn form(&mut self) -> &PathForm<'a> {
        self.path
            .get_or_insert_with(|| normalize_path(split_path(first(self.headers, ":path")).0))
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::http::request::tests::req;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

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
            let read = probed.read();
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

    /// A template matches the canonical path, as prefixes do: every spelling of a path that
    /// fits is guarded, and an ambiguous one any reading of which fits is refused.
    #[test]
    fn path_templates_on_hostile_spellings() {
        let config = Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [
                {"name": "transfer", "match": {"methods": ["POST"], "path_template": "/accounts/{id}/transfer"}},
                {"name": "files", "match": {"methods": ["PUT"], "path_template": "/files/{rest=**}"}},
                {"name": "video", "match": {"path_template": "/videos/{name}.mp4"}}
            ]}"#,
        )
        .expect("valid");
        let p = |i| Some(Selected::Policy(i));
        let amb = |i| Some(Selected::AmbiguousPath(i));
        let cases = [
            ("POST", "/accounts/42/transfer", p(0)),
            ("POST", "/accounts/42/transfer/", p(0)),
            ("POST", "/accounts/42/transfer?x=1", p(0)),
            ("POST", "/accounts/%34%32/transfer", p(0)),
            ("POST", "/accounts//42/transfer", p(0)),
            ("POST", "//accounts/42//transfer", p(0)),
            ("POST", "/accounts/x/../42/transfer", p(0)),
            ("POST", "/accounts/42/./transfer", p(0)),
            ("POST", "/accounts/42/%74ransfer", p(0)),
            ("POST", "/x/../accounts/42/transfer", p(0)),
            // Not the template: another action, another method, a segment too many or few.
            ("POST", "/accounts/42/close", None),
            ("GET", "/accounts/42/transfer", None),
            ("POST", "/accounts/42/43/transfer", None),
            ("POST", "/accounts/transfer", None),
            ("POST", "/accounts//transfer", None),
            ("POST", "/accounts/42/transfer/x", None),
            // Read more than one way, one reading fits: refused.
            ("POST", "/accounts/4%2F2/transfer", amb(0)),
            ("POST", "/accounts/42%2Ftransfer", amb(0)),
            ("POST", "/accounts/42;v=1/transfer", amb(0)),
            ("POST", "/accounts/42/transfer;v=1", amb(0)),
            ("POST", "/accounts/42%5Ctransfer", amb(0)),
            ("POST", "/accounts/42\\transfer", amb(0)),
            ("POST", "/accounts/42/transfer%00.json", amb(0)),
            ("POST", "/accounts/4%zz/transfer", amb(0)),
            ("POST", "/accounts/%252F/transfer", amb(0)),
            ("POST", "/a//../accounts/42/transfer", amb(0)),
            // Ambiguous, no reading fits: the service's.
            ("POST", "/accounts/42%2Fclose", None),
            // `**`: any depth, the empty rest too; never the bare prefix.
            ("PUT", "/files/a", p(1)),
            ("PUT", "/files/a/b/c", p(1)),
            ("PUT", "/files/", p(1)),
            ("PUT", "/files//a", p(1)),
            ("PUT", "/files", None),
            ("PUT", "/filesystem/a", None),
            ("PUT", "/files/a%2Fb", amb(1)),
            ("PUT", "/files/a/..%2F..%2Fetc", amb(1)),
            // A suffix.
            ("GET", "/videos/cat.mp4", p(2)),
            ("GET", "/videos/cat.mp4/", p(2)),
            ("GET", "/videos/cat%2Emp4", p(2)),
            ("GET", "/videos/.mp4", None),
            ("GET", "/videos/a/b.mp4", None),
            ("GET", "/videos/a%2Fb.mp4", amb(2)),
        ];
        for (method, path, want) in cases {
            let r = req(method, path, "h");
            assert_eq!(
                parsed_policy_index(&config.policies, &r),
                want,
                "{method} {path}"
            );
            let map: Headers = [(":method", method), (":path", path), (":authority", "h")]
                .into_iter()
                .collect();
            assert_eq!(
                policy_index(&config.policies, &mut Probe::new(&map)),
                want,
                "lazy: {method} {path}"
            );
        }
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
