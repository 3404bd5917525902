//! A request's headers as they arrive: which policy guards the request, and what the worker
//! is handed for it. The host is read through [`HostReads`], and only as far as the decision
//! needs: every request costs one read of its header map (and the removal of the reserved
//! headers it sent); a request no policy guards costs nothing more; the client's address is
//! read only for a policy that selects by it, and the request's metadata only for an identity
//! read from claims. The adapter implements [`HostReads`] with the host's calls and carries
//! out the [`Arrival`]; the tests implement it in memory.

use crate::config::{Config, IdSource};
use crate::http::claims::metadata_claim;
use crate::http::headers::Headers;
use crate::http::matching::{policy_index, Probe, Selected};
use crate::http::request::Request;

/// What [`arrive`] reads of the host for a request's headers, and the one change it makes
/// there: removing a reserved header the client sent.
pub(crate) trait HostReads {
    /// The request's header map, whole, in one read (empty when the host has none).
    fn request_headers(&mut self) -> Headers;

    /// Removes every value of header `name` (lower case) from the request the host forwards.
    fn remove_request_header(&mut self, name: &str);

    /// The downstream's address (the `source.address` property: `ip:port` or `[v6]:port`),
    /// if the host tells it.
    fn source_address(&mut self) -> Option<String>;

    /// The request's metadata (the `metadata` property: Envoy's serialized
    /// `envoy.config.core.v3.Metadata`, see [`crate::http::claims`]); empty when there is none.
    fn metadata(&mut self) -> Vec<u8>;

    /// Runs `f`, one part of reading the request's headers, which the host may time (the
    /// adapter measures each as a span for `make bench-spans`). By default it only runs it.
    fn timed<T>(&mut self, part: Part, f: impl FnOnce(&mut Self) -> T) -> T
    where
        Self: Sized,
    {
        let _ = part;
        f(self)
    }
}

/// The parts of reading a request's headers that [`HostReads::timed`] is given, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// Reading the whole header map, and removing the reserved headers the client sent.
    Map,
    /// Matching the policies on the map.
    Match,
    /// Parsing the map into the request the worker decides on (a guarded request only).
    Parse,
}

/// What the filter makes of a request's headers. The request is not boxed: that would cost
/// every guarded request an allocation, for a value that only passes from [`arrive`] to the
/// worker.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub(crate) enum Arrival {
    /// No policy guards the request: it goes on, and the filter follows it no further.
    Unguarded,
    /// The request's path reads more than one way, and one of its readings is guarded: it is
    /// refused with a problem, not guessed.
    AmbiguousPath(AmbiguousPath),
    /// Policy `index` guards the request: the worker decides on `request`.
    Guarded { index: usize, request: Request },
}

/// A request whose path reads more than one way, one of its readings guarded by policy
/// `index`. Its header map is kept for the answer's kind: a gRPC request is answered in gRPC.
#[derive(Debug)]
pub(crate) struct AmbiguousPath {
    pub(crate) index: usize,
    headers: Headers,
}

impl AmbiguousPath {
    /// The request's first `content-type`, which tells a gRPC request.
    pub(crate) fn content_type(&self) -> Option<&str> {
        self.headers.values("content-type").next()
    }
}

/// Reads a request's headers from `host` and decides what the worker is handed: nothing, the
/// ambiguous path's answer, or the guarding policy's index with the request (its client
/// address and its claims included when the policy and the identity read them). `reserved`
/// are the headers only the filter may set: they are removed from every request, guarded or
/// not, before the matchers see it.
pub(crate) fn arrive(config: &Config, reserved: &[String], host: &mut impl HostReads) -> Arrival {
    // One read of the whole map: the matchers, the reserved headers and the request come from
    // it. Headers only the filter may set never come from the client, whatever the request:
    // they are invisible to the matchers and removed from the request.
    let headers = host.timed(Part::Map, |host| {
        let mut headers = host.request_headers();
        strip(reserved, &mut headers, host);
        headers
    });
    let policies = &config.policies;
    let (selected, probed) = host.timed(Part::Match, |_| {
        let mut probe = Probe::new(&headers);
        let selected = policy_index(policies, &mut probe);
        (selected, probe.into_probed())
    });
    let (index, policy) = match selected {
        None => return Arrival::Unguarded,
        Some(Selected::AmbiguousPath(index)) => {
            return Arrival::AmbiguousPath(AmbiguousPath { index, headers })
        }
        Some(Selected::Policy(i)) => match policies.get(i) {
            Some(p) => (i, p),
            None => return Arrival::Unguarded,
        },
    };
    let address = if policy.uses_client_ip {
        host.source_address()
    } else {
        None
    };
    let mut request = host.timed(Part::Parse, |_| {
        Request::from_probed(headers, address.as_deref(), probed)
    });
    // Claims Envoy verified (jwt_authn's payload in the request's metadata), read only for
    // the roles configured to come from there: the whole metadata, whose serialization
    // (protobuf) says each value's type, where a leaf's bytes do not (crate::http::claims).
    let identity = &config.identity;
    if identity.uses_metadata() {
        let metadata = host.metadata();
        if let IdSource::Metadata(path) = &identity.tenant {
            request.tenant_claim = metadata_claim(&metadata, path);
        }
        if let IdSource::Metadata(path) = &identity.principal {
            request.principal_claim = metadata_claim(&metadata, path);
        }
    }
    Arrival::Guarded { index, request }
}

/// Removes the reserved headers the client sent from the request and from `headers`, its map.
/// Only those it sent: Envoy clears the stream's route cache on every change to the
/// request's headers, a removal of an absent header included, so the router would match the
/// route again for every request.
fn strip(reserved: &[String], headers: &mut Headers, host: &mut impl HostReads) {
    let mut sent = false;
    for name in reserved {
        if headers.values(name).next().is_some() {
            host.remove_request_header(name);
            sent = true;
        }
    }
    if sent {
        headers.retain(|n, _| !reserved.iter().any(|r| r == n));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::claims::Claim;
    use crate::http::headers::encode;
    use crate::support::alloc_count::allocations;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The host in memory: a request's header map as the host encodes it, its address and
    /// metadata, and what was read of it (and removed from it), with the parts timed.
    struct Memory {
        map: Vec<u8>,
        address: Option<String>,
        metadata: Vec<u8>,
        /// Reads of the header map, the address and the metadata.
        reads: (u32, u32, u32),
        removed: Vec<String>,
        parts: Vec<Part>,
    }

    impl Memory {
        fn new(pairs: &[(&str, &str)]) -> Memory {
            let pairs: Vec<(&[u8], &[u8])> = pairs
                .iter()
                .map(|(n, v)| (n.as_bytes(), v.as_bytes()))
                .collect();
            Memory {
                map: encode(&pairs),
                address: Some("10.0.0.7:5555".into()),
                metadata: Vec::new(),
                reads: (0, 0, 0),
                removed: Vec::new(),
                // Room for every part: timing one allocates nothing.
                parts: Vec::with_capacity(4),
            }
        }
    }

    impl HostReads for Memory {
        fn request_headers(&mut self) -> Headers {
            self.reads.0 += 1;
            Headers::decode(std::mem::take(&mut self.map)).unwrap_or_default()
        }
        fn remove_request_header(&mut self, name: &str) {
            self.removed.push(name.to_string());
        }
        fn source_address(&mut self) -> Option<String> {
            self.reads.1 += 1;
            self.address.clone()
        }
        fn metadata(&mut self) -> Vec<u8> {
            self.reads.2 += 1;
            self.metadata.clone()
        }
        fn timed<T>(&mut self, part: Part, f: impl FnOnce(&mut Self) -> T) -> T {
            self.parts.push(part);
            f(self)
        }
    }

    const FINGERPRINT: &str = "x-idempotency-fingerprint";
    const FENCING: &str = "x-fencing-token";

    fn reserved() -> Vec<String> {
        vec![FINGERPRINT.into(), FENCING.into()]
    }

    /// Policy 0 limits each client address on `/ip`; policy 1 each tenant on `/api`, and
    /// policy 2 guards a request that carries a fencing token.
    fn config() -> Config {
        Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [
                {"name": "ip", "match": {"path_prefix": "/ip"}, "rate_limits": [{"name": "ip",
                 "by": ["client_ip"], "algorithm": "fixed_window", "limit": 10, "window": "1s"}]},
                {"name": "api", "match": {"path_prefix": "/api"}, "rate_limits": [{"name": "t",
                 "by": ["tenant"], "algorithm": "fixed_window", "limit": 10, "window": "1s"}]},
                {"name": "fenced", "match": {"headers": [{"name": "x-fencing-token",
                 "present": true}]}}
            ]}"#,
        )
        .expect("valid")
    }

    fn get(path: &str) -> Memory {
        Memory::new(&[
            (":method", "GET"),
            (":path", path),
            (":authority", "h"),
            ("x-tenant-id", "acme"),
        ])
    }

    fn guarded(arrival: Arrival) -> (usize, Request) {
        match arrival {
            Arrival::Guarded { index, request } => (index, request),
            other => panic!("not guarded: {other:?}"),
        }
    }

    #[test]
    fn a_request_no_policy_guards_reads_nothing_but_its_headers() {
        let mut host = get("/health");
        host.metadata = metadata(&[("tid", "acme")]);
        let mut config = config();
        config.identity.tenant = IdSource::Metadata(vec!["f".into(), "tid".into()]);
        assert!(matches!(
            arrive(&config, &reserved(), &mut host),
            Arrival::Unguarded
        ));
        assert_eq!(host.reads, (1, 0, 0));
        assert!(host.removed.is_empty());
        assert_eq!(host.parts, [Part::Map, Part::Match]);
    }

    #[test]
    fn the_client_address_is_read_only_for_a_policy_that_uses_it() {
        let mut host = get("/ip/1");
        let (index, request) = guarded(arrive(&config(), &reserved(), &mut host));
        assert_eq!(index, 0);
        assert_eq!(request.client_ip.as_deref(), Some("10.0.0.7"));
        assert_eq!(host.reads, (1, 1, 0));
        assert_eq!(host.parts, [Part::Map, Part::Match, Part::Parse]);

        let mut host = get("/api/1");
        let (index, request) = guarded(arrive(&config(), &reserved(), &mut host));
        assert_eq!(index, 1);
        assert_eq!(request.client_ip, None);
        assert_eq!(host.reads, (1, 0, 0));
        assert_eq!(request.header("x-tenant-id"), Some("acme"));
    }

    /// `filter_metadata {"f": {fields}}`, each field a string value: the protobuf Envoy
    /// serializes the `metadata` property as (see crate::http::claims).
    fn metadata(fields: &[(&str, &str)]) -> Vec<u8> {
        fn delimited(field: u8, payload: &[u8]) -> Vec<u8> {
            let mut out = vec![field << 3 | 2];
            let mut n = payload.len();
            while n >= 0x80 {
                out.push((n & 0x7f) as u8 | 0x80);
                n >>= 7;
            }
            out.push(n as u8);
            out.extend_from_slice(payload);
            out
        }
        let entry = |key: &str, value: &[u8]| {
            delimited(
                1,
                &[delimited(1, key.as_bytes()), delimited(2, value)].concat(),
            )
        };
        let structure: Vec<u8> = fields
            .iter()
            .flat_map(|(k, v)| entry(k, &delimited(3, v.as_bytes())))
            .collect();
        entry("f", &structure)
    }

    #[test]
    fn the_metadata_is_read_only_for_an_identity_of_claims_and_its_claims_land_in_the_request() {
        let claims = metadata(&[("tid", "tenant-a"), ("sub", "alice")]);
        let claim = |name: &str| IdSource::Metadata(vec!["f".into(), name.into()]);
        // Headers only: the metadata is never read, the claims stay absent.
        let mut host = get("/api/1");
        host.metadata = claims.clone();
        let (_, request) = guarded(arrive(&config(), &reserved(), &mut host));
        assert_eq!(host.reads.2, 0);
        assert_eq!(request.tenant_claim, Claim::Absent);
        // The tenant from a claim, the principal from a header.
        let mut config = config();
        config.identity.tenant = claim("tid");
        let mut host = get("/api/1");
        host.metadata = claims.clone();
        let (_, request) = guarded(arrive(&config, &reserved(), &mut host));
        assert_eq!(host.reads, (1, 0, 1));
        assert_eq!(request.tenant_claim, Claim::Text("tenant-a".into()));
        assert_eq!(request.principal_claim, Claim::Absent);
        // Both from claims, from one read of the metadata.
        config.identity.principal = claim("sub");
        let mut host = get("/api/1");
        host.metadata = claims;
        let (_, request) = guarded(arrive(&config, &reserved(), &mut host));
        assert_eq!(host.reads.2, 1);
        assert_eq!(request.tenant_claim, Claim::Text("tenant-a".into()));
        assert_eq!(request.principal_claim, Claim::Text("alice".into()));
        // No metadata: the claims are absent.
        let mut host = get("/api/1");
        let (_, request) = guarded(arrive(&config, &reserved(), &mut host));
        assert_eq!(
            (request.tenant_claim, request.principal_claim),
            (Claim::Absent, Claim::Absent)
        );
    }

    /// A reserved header is removed from every request that sent it, guarded or not, before
    /// the matchers see it; a request that sent none changes nothing on the host (every
    /// removal would clear Envoy's route cache).
    #[test]
    fn reserved_headers_are_removed_only_when_the_client_sent_them() {
        let mut host = get("/api/1");
        guarded(arrive(&config(), &reserved(), &mut host));
        assert!(host.removed.is_empty());

        let forged = |path: &str| {
            Memory::new(&[
                (":method", "GET"),
                (":path", path),
                (FENCING, "99"),
                ("x-tenant-id", "acme"),
                (FENCING, "100"),
            ])
        };
        // Unguarded, and the fencing token it sent cannot make policy 2 guard it.
        let mut host = forged("/health");
        assert!(matches!(
            arrive(&config(), &reserved(), &mut host),
            Arrival::Unguarded
        ));
        assert_eq!(host.removed, [FENCING]);
        // Guarded: removed from the host's request and from the request the worker gets.
        let mut host = forged("/api/1");
        let (_, request) = guarded(arrive(&config(), &reserved(), &mut host));
        assert_eq!(host.removed, [FENCING]);
        assert_eq!(request.header(FENCING), None);
        assert_eq!(request.header("x-tenant-id"), Some("acme"));
        // Each reserved header it sent, once.
        let mut host = Memory::new(&[
            (":path", "/health"),
            (FINGERPRINT, "sha256:00"),
            (FENCING, "1"),
        ]);
        arrive(&config(), &reserved(), &mut host);
        assert_eq!(host.removed, [FINGERPRINT, FENCING]);
    }

    #[test]
    fn an_ambiguous_path_is_the_problem_answer_with_the_content_type() {
        let mut host = Memory::new(&[
            (":method", "POST"),
            (":path", "/api/a%2Fb"),
            ("content-type", "application/grpc"),
            ("content-type", "text/plain"),
        ]);
        match arrive(&config(), &reserved(), &mut host) {
            Arrival::AmbiguousPath(a) => {
                assert_eq!(a.index, 1);
                assert_eq!(a.content_type(), Some("application/grpc"));
            }
            other => panic!("not ambiguous: {other:?}"),
        }
        assert_eq!(host.reads, (1, 0, 0));
        assert_eq!(host.parts, [Part::Map, Part::Match]);
        let mut host = Memory::new(&[(":path", "/ip/..%2F")]);
        match arrive(&config(), &reserved(), &mut host) {
            Arrival::AmbiguousPath(a) => assert_eq!((a.index, a.content_type()), (0, None)),
            other => panic!("not ambiguous: {other:?}"),
        }
        assert_eq!(host.reads, (1, 0, 0), "no address read for an answer");
    }

    /// The request the worker gets is the one parsed from scratch from the same map.
    #[test]
    fn the_guarded_request_is_the_map_parsed() {
        let pairs = [
            (":method", "post"),
            (":path", "/ip/%31/x?a=1"),
            (":authority", "H.example:80"),
            ("x-tenant-id", "acme"),
        ];
        let (_, request) = guarded(arrive(&config(), &reserved(), &mut Memory::new(&pairs)));
        let map: Headers = pairs.into_iter().collect();
        assert_eq!(request, Request::from_map(map, Some("10.0.0.7:5555")));
    }

    /// Reading through [`HostReads`] allocates what the steps it takes allocate by hand (the
    /// map decoded, matched, parsed): the allocation budgets of the worker's tests, which take
    /// those steps, hold for the adapter too.
    #[test]
    fn arriving_allocates_what_its_steps_do() {
        let config = config();
        let reserved = reserved();
        for path in ["/health", "/api/items", "/api/a%2Fb"] {
            let mut host = get(path);
            let (_, through_reads) = allocations(|| {
                let _ = arrive(&config, &reserved, &mut host);
            });
            let bytes = get(path).map;
            let (_, by_hand) = allocations(|| {
                let headers = Headers::decode(bytes).expect("a valid map");
                let mut probe = Probe::new(&headers);
                let selected = policy_index(&config.policies, &mut probe);
                let probed = probe.into_probed();
                if let Some(Selected::Policy(_)) = selected {
                    let _ = Request::from_probed(headers, None, probed);
                }
            });
            assert_eq!(through_reads, by_hand, "{path}");
        }
    }
}
