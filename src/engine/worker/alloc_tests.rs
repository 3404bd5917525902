//! Allocation budgets of the paths every request takes, driven the way the adapter drives
//! them (the header map as the host encodes it, decoded, matched and parsed; the worker's
//! events; the callout's body and answer), host calls apart. A count is exact on any machine:
//! these hold the cuts that `make bench` can only show within its noise. A path that now
//! allocates less passes; lower its budget to keep the gain.

use crate::engine::flow::Runtime;
use crate::engine::worker::*;
use crate::http::headers::{self, Headers};
use crate::http::matching::{policy_index, Probe, Selected};
use crate::http::request::Request;
use crate::redis::tag::CallTag;
use crate::redis::webdis;
use crate::support::alloc_count::allocations;
use crate::support::metrics::NoMetrics;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn runtime(mode: &str) -> Runtime {
    Runtime::per_tenant_benchmark(mode).expect("valid")
}

/// The request's header map as the host hands it over (the benchmark's request).
fn map(path: &str, tenant: &str) -> Vec<u8> {
    headers::encode(&[
        (b":method", b"GET"),
        (b":path", path.as_bytes()),
        (b":authority", b"localhost"),
        (b"user-agent", b"wrk"),
        (b"x-tenant-id", tenant.as_bytes()),
    ])
}

/// The adapter's request headers: the map decoded, matched and parsed, then the worker's
/// event. `None` when no policy guards the request.
fn request_headers(
    w: &mut Worker<u32>,
    cx: &Cx<'_>,
    s: u32,
    bytes: Vec<u8>,
) -> Option<Effects<u32>> {
    let headers = Headers::decode(bytes).expect("a valid map");
    let mut probe = Probe::new(&headers);
    let Some(Selected::Policy(index)) = policy_index(&cx.rt.config.policies, &mut probe) else {
        return None;
    };
    let probed = probe.into_probed();
    let req = Request::from_probed(headers, None, probed);
    Some(w.on_request_headers(cx, s, index, req, true))
}

/// The answers `acquire.lua` gives the benchmark's limit: allowed (with the count and the
/// window left), rejected.
const ALLOWED: &[u8] = b"*5\r\n:1\r\n:1\r\n:999999\r\n:3600000\r\n:0\r\n";
const REJECTED: &[u8] = b"*5\r\n:0\r\n:0\r\n:0\r\n:3600000\r\n:3600000\r\n";
const GRANTED: &[u8] = b"*5\r\n:1\r\n:1\r\n:999999999\r\n:3600000\r\n:0\r\n";

/// One whole request through the worker: its headers; the callout it makes, if any,
/// answered with `answer` as webdis sends it; the response's headers; its end. The step
/// the headers or the answer ended with: a local reply or not.
fn whole(w: &mut Worker<u32>, cx: &Cx<'_>, s: u32, bytes: Vec<u8>, answer: &[u8]) -> bool {
    let Some(mut fx) = request_headers(w, cx, s, bytes) else {
        return false;
    };
    let calls: Vec<Callout<u32>> = fx
        .streams
        .iter_mut()
        .flat_map(|o| o.calls.drain(..))
        .collect();
    for (token, call) in (1..).zip(calls) {
        assert!(call.body.starts_with(b"EVALSHA/"), "one acquire call");
        let mut buf = [0u8; 256];
        let answer = tagged(call.route.tag(), answer, &mut buf);
        let _ = w.sent(cx, call.route, Ok(token));
        fx = w.on_answer(cx, token, || {
            webdis::decode_array(answer).ok_or(crate::redis::CallError::Transport)
        });
    }
    let replied = fx.streams.iter().any(|o| o.reply.is_some());
    let _ = w.on_response_headers(cx, s, false, || ResponseHead {
        headers: vec![(":status".into(), "200".into())],
        details: "via_upstream".into(),
    });
    let _ = w.on_done(cx, s);
    replied
}

/// `answer` (a body's array reply, as webdis sends it) as the tag's wrapper returns it to the
/// call tagged `tag`, written into `buf` (the tag's work is the filter's: the test allocates
/// nothing for it).
fn tagged<'b>(tag: CallTag, answer: &[u8], buf: &'b mut [u8; 256]) -> &'b [u8] {
    use std::io::Write;
    let text = std::str::from_utf8(answer).expect("ascii");
    let (head, rest) = text.split_once("\r\n").expect("an array");
    let n: usize = head
        .strip_prefix('*')
        .and_then(|n| n.parse().ok())
        .expect("*<n>");
    let mut out = &mut buf[..];
    write!(out, "*{}\r\n$16\r\n", n + 2).expect("room");
    out.write_all(tag.as_bytes()).expect("room");
    write!(out, "\r\n:{n}\r\n{rest}").expect("room");
    let left = out.len();
    &buf[..256 - left]
}

fn worker() -> Worker<u32> {
    Worker::new(crate::support::ids::TokenSource::with_seed(1, 2), None, 25)
}

/// Allocations of one request of `tenant` after `warm` ones warmed the worker's tables (the
/// over-limit cache marked by a rejecting answer, its 429 written once).
fn measured(rt: &Runtime, tenant: &str, answer: &[u8], warm: u32) -> (bool, u64) {
    let cx = Cx::new(rt, 1_000, &NoMetrics);
    let mut w = worker();
    for s in 1..=warm {
        whole(&mut w, &cx, s, map("/api/items", tenant), answer);
    }
    let bytes = map("/api/items", tenant);
    allocations(|| whole(&mut w, &cx, warm + 1, bytes, answer))
}

/// One path: its name, whether it answers locally, what it did (answered locally, the
/// allocations it made) and its budget. A table, so that one run shows every path.
/// Each guarded path's budget counts one allocation for the request's decision line (the
/// text Envoy's access log reads, see `engine/flow/decision.rs`): that is the feature's cost.
/// A path that makes a call counts one for the call's tag read back (the reply's first bulk
/// string, see `redis/tag.rs`). The unguarded path makes none.
type Case<'a> = (&'a str, bool, (bool, u64), u64);

#[test]
fn each_request_path_stays_within_its_allocation_budget() {
    let exact = runtime("exact");
    let leased = runtime("leased");
    let cases: [Case<'_>; 4] = [
        (
            "no policy (the map decoded and matched)",
            false,
            {
                let cx = Cx::new(&exact, 1_000, &NoMetrics);
                let (mut w, bytes) = (worker(), map("/health", "t"));
                allocations(|| request_headers(&mut w, &cx, 1, bytes).is_some())
            },
            1,
        ),
        (
            "exact, allowed (one callout)",
            false,
            measured(&exact, "tenant-4711", ALLOWED, 1),
            28,
        ),
        (
            "rejected by the over-limit cache",
            true,
            measured(&exact, "over", REJECTED, 2),
            5,
        ),
        (
            "admitted from a leased slice",
            false,
            measured(&leased, "t", GRANTED, 1),
            11,
        ),
    ];
    let report: Vec<String> = cases
        .iter()
        .map(|(name, _, (replied, n), budget)| {
            format!("{name}: {n} (budget {budget}), replied {replied}")
        })
        .collect();
    eprintln!("{}", report.join("\n"));
    for (name, replies, (replied, n), budget) in &cases {
        assert_eq!(replied, replies, "{name}: answered locally\n{report:#?}");
        assert!(
            n <= budget,
            "{name}: {n} allocations, budget {budget}\n{report:#?}"
        );
    }
}
