//! Micro-benchmarks of the per-request core: policy match, key building, body fingerprint,
//! sealing and opening a stored response (`idempotency.encryption`), and the whole per-request
//! work of the filter's core on four paths (exact allowed, rejected by the over-limit cache,
//! admitted from a leased slice, an idempotency replay): what the filter itself adds to a
//! request, apart from the host (Envoy, V8) and the callout.
//!
//! `cargo bench --bench core` (or `make bench-core`). Plain `Instant` loops with `black_box`,
//! no benchmark framework: each case is calibrated to about 50 ms per sample, sampled
//! `SAMPLES` times, and the median ns/op is printed with the spread (min..max) so a noisy
//! machine shows as noise instead of a confident number. Native code by default: read those
//! figures as relative costs of the parts. `make bench-core-v8` builds the same cases for
//! wasm32-wasip1 and runs them in V8 (Node's, bench/wasi.mjs), the engine Envoy embeds: closer
//! to what the filter's own code costs a request in Envoy, host calls apart. `make
//! bench-instructions` counts the Wasm instructions a case executes per run (wasmtime's fuel,
//! `CORE_COUNT`), the working tree beside a git revision: a measure no noise moves.

use coordination_guard::config::Config;
use coordination_guard::engine::flow::{Cx, Flow, Move, Runtime, Step};
use coordination_guard::engine::worker::{Dir, Effects, ResponseHead, Worker};
use coordination_guard::guards::idempotency::fingerprint::{canonical_body, Fingerprint};
use coordination_guard::guards::idempotency::record::{Record, RecordResponse, StoredResponse};
use coordination_guard::guards::idempotency::seal::{fresh_nonce, record_aad, Keyring, RecordKey};
use coordination_guard::guards::ratelimit;
use coordination_guard::http::headers::{self, Headers};
use coordination_guard::http::identity::Caller;
use coordination_guard::http::matching::{policy_index, select_policy, Probe, Selected};
use coordination_guard::http::request::Request;
use coordination_guard::redis::keys;
use coordination_guard::redis::tag::{CallTag, CallTags};
use coordination_guard::redis::webdis;
use coordination_guard::support::ids::TokenSource;
use coordination_guard::support::metrics::{Metrics, NoMetrics};
use std::collections::VecDeque;
use std::hint::black_box;
use std::time::{Duration, Instant};

const SAMPLES: usize = 7;
const SAMPLE_TIME: Duration = Duration::from_millis(50);

/// Median, min and max ns/op of `f` over `SAMPLES` samples.
fn measure(mut f: impl FnMut()) -> (f64, f64, f64) {
    // Calibrate: double the batch until one batch takes a tenth of a sample.
    let mut batch: u64 = 1;
    loop {
        let start = Instant::now();
        for _ in 0..batch {
            f();
        }
        if start.elapsed() >= SAMPLE_TIME / 10 || batch >= 1 << 30 {
            break;
        }
        batch *= 2;
    }
    let iters = batch * 10;
    let mut per_op: Vec<f64> = (0..SAMPLES)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..iters {
                f();
            }
            start.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    per_op.sort_by(f64::total_cmp);
    (per_op[SAMPLES / 2], per_op[0], per_op[SAMPLES - 1])
}

/// `cargo bench --bench core -- <text>` runs only the cases whose name contains `<text>`.
fn selected(name: &str) -> bool {
    std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .is_none_or(|filter| name.contains(filter.as_str()))
}

/// `CORE_COUNT=<n>`: each selected case runs `n` times, untimed, instead of being measured.
/// `make bench-instructions` runs the Wasm build so in wasmtime with fuel metering: the Wasm
/// instructions of `n` runs less those of none are a case's per-request count, which no
/// machine's noise moves.
fn count() -> Option<u64> {
    std::env::var("CORE_COUNT").ok()?.parse().ok()
}

fn report(name: &str, mut f: impl FnMut()) {
    if !selected(name) {
        return;
    }
    if let Some(n) = count() {
        (0..n).for_each(|_| f());
        println!("counted: {name}");
        return;
    }
    let (median, min, max) = measure(f);
    println!("{name:<44} {median:>12.1} ns/op   ({min:.1} .. {max:.1})");
}

/// A config of 20 policies: 19 that the benchmark request does not match, then the one it does.
fn config_with_20_policies() -> Config {
    let mut policies: Vec<serde_json::Value> = (0..19)
        .map(|i| {
            serde_json::json!({
                "name": format!("op-{i}"),
                "match": { "methods": ["POST", "PUT"], "path_prefix": format!("/service-{i}/items") },
                "rate_limits": [
                    { "name": "tenant", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100, "window": "1m" }
                ]
            })
        })
        .collect();
    policies.push(serde_json::json!({
        "name": "create-order",
        "match": { "methods": ["POST"], "path_prefix": "/orders" },
        "rate_limits": [
            { "name": "tenant", "by": ["tenant"], "algorithm": "sliding_window", "limit": 100, "window": "1m" },
            { "name": "user-burst", "by": ["tenant", "principal"], "algorithm": "token_bucket",
              "limit": 10, "window": "1s", "burst": 20 },
            { "name": "global", "by": [], "algorithm": "fixed_window", "limit": 5000, "window": "1s" }
        ]
    }));
    let json = serde_json::json!({
        "redis": { "cluster": "redis_gateway", "key_prefix": "cg:bench" },
        "policies": policies
    });
    Config::parse(json.to_string().as_bytes()).expect("benchmark config is valid")
}

fn request(path: &str) -> Request {
    Request::from_headers(
        vec![
            (":method".into(), "POST".into()),
            (":path".into(), path.into()),
            (":authority".into(), "orders.example.com".into()),
            ("content-type".into(), "application/json".into()),
            ("x-tenant-id".into(), "tenant-4711".into()),
            ("x-user-id".into(), "user-42".into()),
            (
                "idempotency-key".into(),
                "8e03978e-40d5-43e8-bc93-6894a57f9324".into(),
            ),
        ],
        Some("10.1.2.3:5555"),
    )
}

/// A JSON object of about `size` bytes: an order with line items, keys deliberately unsorted.
fn json_body(size: usize) -> Vec<u8> {
    let mut items = Vec::new();
    let mut body = String::new();
    let mut i = 0;
    while body.len() < size {
        items.push(serde_json::json!({
            "sku": format!("SKU-{i:06}"), "qty": i % 7 + 1, "price": 12.5 + i as f64,
            "note": "gift wrap, deliver after 5pm", "tags": ["a", "b"]
        }));
        body = serde_json::json!({ "customer": "c-123", "currency": "EUR", "items": items })
            .to_string();
        i += 1;
    }
    body.into_bytes()
}

fn fingerprint(body: &[u8]) -> String {
    let mut fp = Fingerprint::default();
    fp.part("method", b"POST");
    fp.part("path", b"/orders");
    fp.part("body", &canonical_body(body, true));
    fp.finish()
}

fn main() {
    let config = config_with_20_policies();
    let matching = request("/orders");
    let unmatched = request("/nothing/here");
    let policy = select_policy(&config.policies, &matching).expect("the last policy matches");
    let limit = &policy.rate_limits[1];
    let caller = Caller {
        tenant: "tenant-4711".into(),
        principal: "user-42".into(),
    };
    let prefix = config.redis.key_prefix.as_str();
    let tag = keys::tenant_tag(&caller.tenant);
    let body_1k = json_body(1024);
    let body_64k = json_body(64 * 1024);

    let build = if cfg!(target_arch = "wasm32") {
        "wasm32-wasip1"
    } else {
        "native"
    };
    println!("coordination-guard core micro-benchmarks ({build}, median of {SAMPLES} samples)");
    report("select_policy: 20 policies, last matches", || {
        black_box(select_policy(
            black_box(&config.policies),
            black_box(&matching),
        ));
    });
    report("select_policy: 20 policies, none matches", || {
        black_box(select_policy(
            black_box(&config.policies),
            black_box(&unmatched),
        ));
    });
    report("Request::from_headers (7 headers)", || {
        black_box(request(black_box("/orders")));
    });
    report("keys::tenant_tag", || {
        black_box(keys::tenant_tag(black_box(&caller.tenant)));
    });
    report("keys::rate_limit_key", || {
        black_box(keys::rate_limit_key(
            black_box(prefix),
            black_box(&tag),
            policy,
            limit,
            black_box("5b0c3e1f9a2d4c6b"),
        ));
    });
    report("ratelimit::key (tenant+principal)", || {
        black_box(ratelimit::key(
            black_box(prefix),
            policy,
            limit,
            black_box(&caller),
            black_box(&matching),
        ));
    });
    report("ratelimit::key x3 (every limit of the policy)", || {
        for l in &policy.rate_limits {
            black_box(ratelimit::key(
                black_box(prefix),
                policy,
                l,
                black_box(&caller),
                black_box(&matching),
            ));
        }
    });
    for (name, body) in [("1 KiB", &body_1k), ("64 KiB", &body_64k)] {
        report(&format!("canonical_body: {name} JSON"), || {
            black_box(canonical_body(black_box(body), true));
        });
        report(
            &format!("fingerprint: {name} JSON (canonical + sha256)"),
            || {
                black_box(fingerprint(black_box(body)));
            },
        );
    }
    println!(
        "(bodies: {} and {} bytes of JSON)",
        body_1k.len(),
        body_64k.len()
    );
    sealed_records(&body_1k, &body_64k);
    whole_requests();
    worker_requests();
}

/// A completed record's response stored and read back, in the clear and sealed: what
/// `idempotency.encryption` adds to a completion (JSON, a nonce from the host, AES-256-GCM,
/// base64) and to a replay (parse, base64, AES-256-GCM, parse).
fn sealed_records(body_1k: &[u8], body_64k: &[u8]) {
    let keys = Keyring::new(
        RecordKey::from_bytes(&[0x5a; 32]).expect("a 32-byte key"),
        None,
    );
    let aad = record_aad(
        "cg:demo:idem:{t.5b0c3e1f9a2d4c6b}:create-order:0123456789abcdef0123456789abcdef",
        "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    );
    let record = |response: &str| {
        format!(
            r#"{{"schema_version":1,"state":"COMPLETED","fingerprint":"sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08","created_ms":1,"updated_ms":2,"response":{response}}}"#
        )
        .into_bytes()
    };
    let open = |bytes: &[u8]| -> StoredResponse {
        let response = Record::parse(bytes).and_then(|r| r.response);
        let opened = response.map(|r| r.open(Some(&keys), &aad));
        opened.and_then(Result::ok).expect("opens")
    };
    let seal = |stored: &StoredResponse| -> String {
        let nonce = fresh_nonce().expect("random bytes");
        stored.seal(&keys, &aad, nonce).expect("sealed").to_json()
    };
    for (name, body) in [("1 KiB", body_1k), ("64 KiB", body_64k)] {
        let headers = vec![
            ("content-type".to_string(), "application/json".to_string()),
            ("location".to_string(), "/orders/o-4711".to_string()),
        ];
        let stored = StoredResponse::new(201, headers, Some(body));
        let plain = record(&stored.to_json());
        let sealed = record(&seal(&stored));
        assert_eq!(open(&sealed), stored);
        assert!(matches!(
            Record::parse(&plain).and_then(|r| r.response),
            Some(RecordResponse::Plain(_))
        ));
        report(&format!("store in the clear: {name} response"), || {
            black_box(black_box(&stored).to_json());
        });
        report(&format!("seal: {name} response (+ nonce, AES-GCM)"), || {
            black_box(seal(black_box(&stored)));
        });
        report(&format!("read in the clear: {name} record"), || {
            black_box(Record::parse(black_box(&plain)));
        });
        report(&format!("open: {name} record (AES-GCM, parse)"), || {
            black_box(open(black_box(&sealed)));
        });
    }
}

/// The benchmarks' runtime: one policy on `/api` that limits each tenant to a billion
/// requests an hour in `mode` (`exact` or `leased`), with no host behind its metrics. Its
/// configuration is `per_tenant.json` (`MODE` stands for the mode), which the allocation
/// tests read too (`src/engine/worker/alloc_tests.rs`), so both measure the same request.
fn per_tenant(mode: &str) -> Runtime {
    let json = include_str!("per_tenant.json").replace("MODE", mode);
    let config = Config::parse(json.as_bytes()).expect("valid");
    let metrics = Metrics::define(&config, |_, _| 0);
    Runtime::new(config, metrics, None)
}

/// One rate-limited request through the core as the adapter drives it: headers in, the
/// gateway body out, the gateway's raw answer decoded and read, the response's headers, done.
fn whole_requests() {
    let config = per_tenant;
    let headers = |tenant: &str| {
        vec![
            (":method".to_string(), "GET".to_string()),
            (":path".to_string(), "/api/items".to_string()),
            (":authority".to_string(), "localhost".to_string()),
            ("user-agent".to_string(), "wrk".to_string()),
            ("x-tenant-id".to_string(), tenant.to_string()),
        ]
    };
    // One request: what the core does, and the Redis answer it gets (None: none expected).
    // The flow reads its answers untagged: the worker checks a call's tag (the cases through
    // the worker below).
    let tags = CallTags::with_prefix(1);
    let run = |rt: &Runtime, tenant: &str, answer: Option<&[u8]>| -> Step {
        let mut flow = Flow::default();
        let req = Request::from_headers(headers(tenant), None);
        let mut step = flow.on_request(&Cx::new(rt, 1_000, &NoMetrics), req, "-", "-", true);
        if let (Move::Dispatch(out), Some(answer)) = (step.next.clone(), answer) {
            for o in out {
                black_box(o.encode(&rt.scripts, &tags.next()));
                let reply = webdis::decode(Some(200), true, answer);
                step = flow.on_reply(&Cx::new(rt, 1_001, &NoMetrics), o.slot, reply);
            }
        }
        black_box(step.out.response_headers.to_vec());
        flow.on_done(&Cx::new(rt, 1_002, &NoMetrics));
        step
    };
    let allowed: &[u8] = b"*5\r\n:1\r\n:1\r\n:999999\r\n:3600000\r\n:0\r\n";
    let rejected: &[u8] = b"*5\r\n:0\r\n:0\r\n:0\r\n:3600000\r\n:3600000\r\n";
    let granted: &[u8] = b"*5\r\n:1\r\n:1\r\n:999999999\r\n:3600000\r\n:0\r\n";

    let exact = config("exact");
    assert_eq!(run(&exact, "t", Some(allowed)).next, Move::Continue);
    report("request, exact, allowed (1 Redis answer)", || {
        black_box(run(&exact, "tenant-4711", Some(allowed)));
    });
    // The benchmark's 10k tenants: nearly every request misses the key memo (256 slots).
    let mut n = 0u32;
    report("request, exact, allowed, 10k tenants", || {
        n = (n + 7919) % 10_000;
        black_box(run(&exact, &format!("tenant-{n}"), Some(allowed)));
    });
    assert!(matches!(
        run(&exact, "over", Some(rejected)).next,
        Move::Respond(_)
    ));
    assert!(matches!(run(&exact, "over", None).next, Move::Respond(_)));
    report("request, rejected by the over-limit cache", || {
        black_box(run(&exact, "over", None));
    });
    let leased = config("leased");
    assert_eq!(run(&leased, "t", Some(granted)).next, Move::Continue);
    assert_eq!(run(&leased, "t", None).next, Move::Continue);
    report("request, admitted from a leased slice", || {
        black_box(run(&leased, "t", None));
    });
}

/// The benchmark request's header map as the host hands it over, for `tenant`.
fn host_map(tenant: &str) -> Vec<u8> {
    headers::encode(&[
        (b":method", b"GET"),
        (b":path", b"/api/items"),
        (b":authority", b"localhost"),
        (b"user-agent", b"wrk"),
        (b"x-tenant-id", tenant.as_bytes()),
    ])
}

/// The adapter's request headers: the host's `map` decoded, matched and parsed, then the
/// worker's event for stream `s` (`end_of_stream`: the request has no body).
fn request_headers(
    w: &mut Worker<u32>,
    cx: &Cx<'_>,
    s: u32,
    map: Vec<u8>,
    end_of_stream: bool,
) -> Effects<u32> {
    let headers = Headers::decode(map).expect("a valid map");
    let mut probe = Probe::new(&headers);
    let Some(Selected::Policy(index)) = policy_index(&cx.rt.config.policies, &mut probe) else {
        panic!("the benchmark's policy matches");
    };
    let probed = probe.into_probed();
    let req = Request::from_probed(headers, None, probed);
    w.on_request_headers(cx, s, index, req, end_of_stream)
}

/// Requests whose streams end before their call's answer (the client gone, or the watchdog
/// answered them while Redis hangs), with 512 streams waiting on their calls: each stream
/// ends 512 requests after it began, its call still in flight, and that call's answer comes
/// after its end. Each stream's end forgets its own call among the 512 in flight.
fn worker_abandoned(rt: &Runtime, maps: &[Vec<u8>]) {
    let name = "request through the worker, exact, ended before its answer, 512 in flight";
    if !selected(name) {
        return;
    }
    let mut w: Worker<u32> = Worker::new(TokenSource::with_seed(1, 2), None, 25);
    let mut open: VecDeque<u32> = VecDeque::new();
    let (mut stream, mut n) = (0u32, 0usize);
    let mut request = |w: &mut Worker<u32>| {
        let cx = Cx::new(rt, 1_000, &NoMetrics);
        stream += 1;
        n = (n + 7919) % maps.len();
        let mut fx = request_headers(w, &cx, stream, maps[n].clone(), true);
        let call = fx.streams.iter_mut().flat_map(|o| o.calls.drain(..)).next();
        let call = call.expect("one acquire call");
        let _ = w.sent(&cx, call.route, Ok(stream));
        open.push_back(stream);
        if open.len() < 512 {
            return;
        }
        let Some(s) = open.pop_front() else {
            return;
        };
        black_box(w.on_done(&cx, s));
        w.close(s);
        black_box(w.on_answer(&cx, s, || panic!("a late answer is not read")));
    };
    for _ in 0..512 {
        request(&mut w);
    }
    report(name, || request(&mut w));
}

/// `answer` (a script body's array reply, as webdis sends it) as the tag's wrapper returns it
/// to a call: the tag (here a placeholder), the body's number of values, the values. Every
/// call's reply carries its call's tag (src/redis/tag.rs): [`retag`] writes it in.
fn tagged(answer: &[u8]) -> Vec<u8> {
    let text = std::str::from_utf8(answer).expect("ascii");
    let (head, rest) = text.split_once("\r\n").expect("an array");
    let n: usize = head
        .strip_prefix('*')
        .and_then(|n| n.parse().ok())
        .expect("*<n>");
    format!("*{}\r\n$16\r\n{}\r\n:{n}\r\n{rest}", n + 2, "0".repeat(16)).into_bytes()
}

/// Writes `tag` over the tag of `answer`, an answer [`tagged`] made: the 16 bytes after its
/// first line and `$16`.
fn retag(answer: &mut [u8], tag: CallTag) {
    let at = answer.iter().position(|&b| b == b'\n').map_or(0, |i| i + 6);
    answer[at..at + 16].copy_from_slice(tag.as_bytes());
}

/// Requests through the worker, driven as the adapter drives it: the header map as the host
/// hands it over, decoded, matched and parsed; the callout's body; its answer; the response
/// headers; the end. `in_flight` requests are open at once (each answered that many requests
/// after it began), as under load. Beyond [`whole_requests`]: the host's map decoded, and the
/// worker's tables of streams and calls.
fn worker_requests() {
    let rt = per_tenant("exact");
    let mut allowed = tagged(b"*5\r\n:1\r\n:1\r\n:999999\r\n:3600000\r\n:0\r\n");
    let maps: Vec<Vec<u8>> = (0..10_000)
        .map(|n| host_map(&format!("tenant-{n}")))
        .collect();
    for in_flight in [1, 8, 512] {
        let name = format!("request through the worker, exact, 10k tenants, {in_flight} in flight");
        // Warming 512 streams up is work of its own (hash tables' seeds move its count): only
        // for the case that runs.
        if !selected(&name) {
            continue;
        }
        let mut w: Worker<u32> = Worker::new(TokenSource::with_seed(1, 2), None, 25);
        let mut open: VecDeque<(u32, u32, CallTag)> = VecDeque::new();
        let (mut stream, mut n) = (0u32, 0usize);
        let mut request = |w: &mut Worker<u32>| {
            let cx = Cx::new(&rt, 1_000, &NoMetrics);
            stream += 1;
            n = (n + 7919) % maps.len();
            // The host's copy of the map, as a callback gets it.
            let mut fx = request_headers(w, &cx, stream, maps[n].clone(), true);
            let call = fx.streams.iter_mut().flat_map(|o| o.calls.drain(..)).next();
            let call = call.expect("one acquire call");
            black_box(&call.body);
            let tag = call.route.tag();
            let _ = w.sent(&cx, call.route, Ok(stream));
            open.push_back((stream, stream, tag));
            if open.len() < in_flight {
                return;
            }
            let Some((s, token, tag)) = open.pop_front() else {
                return;
            };
            retag(&mut allowed, tag);
            let fx = w.on_answer(&cx, token, || {
                webdis::decode_array(&allowed)
                    .ok_or(coordination_guard::redis::CallError::Transport)
            });
            black_box(fx);
            let fx = w.on_response_headers(&cx, s, false, || ResponseHead {
                headers: vec![(":status".into(), "200".into())],
                details: "via_upstream".into(),
            });
            black_box(fx);
            black_box(w.on_done(&cx, s));
        };
        for _ in 0..in_flight {
            request(&mut w);
        }
        report(&name, || request(&mut w));
    }
    worker_abandoned(&rt, &maps);
    worker_batched(&rt, &maps);
    worker_local(
        "exact",
        b"*5\r\n:0\r\n:0\r\n:0\r\n:3600000\r\n:3600000\r\n",
        true,
    );
    worker_local(
        "leased",
        b"*5\r\n:1\r\n:1\r\n:999999999\r\n:3600000\r\n:0\r\n",
        false,
    );
    worker_replay();
}

/// The exact path batched (`redis.batch`, the default), as the adapter drives it: every
/// [`BATCHED`]-th request the root is woken and sends the acquires of the requests since as one
/// `batch.lua` call, whose answer resumes them all; then their responses and ends. One run is
/// one request (a batch's flush and answer are shared by its requests).
fn worker_batched(rt: &Runtime, maps: &[Vec<u8>]) {
    const BATCHED: usize = 8;
    let name = format!("request through the worker, exact, 10k tenants, batched {BATCHED}");
    if !selected(&name) {
        return;
    }
    let admitted = ":5\r\n:1\r\n:1\r\n:999999\r\n:3600000\r\n:0\r\n";
    let mut answer = tagged(format!("*{}\r\n{}", 6 * BATCHED, admitted.repeat(BATCHED)).as_bytes());
    let mut w: Worker<u32> = Worker::new(TokenSource::with_seed(1, 2), rt.config.redis.batch, 25);
    let mut open: Vec<u32> = Vec::with_capacity(BATCHED);
    let (mut stream, mut n, mut token) = (0u32, 0usize, 0u32);
    // One request; the requests its batch's answer resumed to go on upstream.
    let mut request = |w: &mut Worker<u32>| -> usize {
        let cx = Cx::new(rt, 1_000, &NoMetrics);
        stream += 1;
        n = (n + 7919) % maps.len();
        black_box(request_headers(w, &cx, stream, maps[n].clone(), true));
        open.push(stream);
        if open.len() < BATCHED {
            return 0;
        }
        let mut resumed = 0;
        let fx = w.on_queue_ready(&cx);
        for call in fx.calls {
            black_box(&call.body);
            token += 1;
            retag(&mut answer, call.route.tag());
            black_box(w.sent(&cx, call.route, Ok(token)));
            // The first flush also carries the probe of whether batches may mix hash slots
            // (any array says they may); a batch of another size than BATCHED fails, in the
            // warm-up only.
            let fx = w.on_answer(&cx, token, || {
                webdis::decode_array(&answer).ok_or(coordination_guard::redis::CallError::Transport)
            });
            resumed += fx
                .streams
                .iter()
                .filter(|o| o.resume.is_some() && o.reply.is_none())
                .count();
            black_box(fx);
        }
        for s in open.drain(..) {
            if w.guards(s) {
                black_box(w.on_response_headers(&cx, s, false, || ResponseHead {
                    headers: vec![(":status".into(), "200".into())],
                    details: "via_upstream".into(),
                }));
                black_box(w.on_done(&cx, s));
            }
            w.close(s);
        }
        resumed
    };
    for _ in 0..2 * BATCHED {
        request(&mut w);
    }
    let resumed: usize = (0..BATCHED).map(|_| request(&mut w)).sum();
    assert_eq!(
        resumed, BATCHED,
        "one batch of {BATCHED} mixed slots, all admitted"
    );
    report(&name, || {
        black_box(request(&mut w));
    });
}

/// `make bench`'s replay, driven as the adapter drives it: a POST with a JSON body and an
/// `Idempotency-Key` (the host's map decoded, matched and parsed), its body read and
/// fingerprinted, the acquire's body, its answer (the completed record, parsed) and the stored
/// response as the local reply, the stream's end.
fn worker_replay() {
    let config = Config::parse(
        br#"{"redis": {"cluster": "gw"}, "identity": {"tenant_header": "x-tenant-id",
        "principal_header": "x-user-id", "missing_tenant": "reject"},
        "failure_mode": "fail_closed", "policies": [{"name": "create-order",
        "match": {"methods": ["POST"], "path_prefix": "/orders"},
        "idempotency": {"header": "idempotency-key", "required": true, "methods": ["POST"],
        "processing_ttl": "2m", "completed_ttl": "10m", "fingerprint": ["method", "path", "body"],
        "max_request_body": "512KiB", "replay": "full", "max_response_body": "64KiB",
        "replay_headers": ["content-type"], "complete": "sync"}}]}"#,
    )
    .expect("valid");
    let metrics = Metrics::define(&config, |_, _| 0);
    let rt = Runtime::new(config, metrics, None);
    let body: &[u8] = br#"{"customer":"c-123","items":[{"sku":"SKU-1","qty":2}],"currency":"EUR"}"#;
    let length = body.len().to_string();
    let map = headers::encode(&[
        (b":method", b"POST"),
        (b":path", b"/orders"),
        (b":authority", b"localhost"),
        (b"user-agent", b"wrk"),
        (b"content-length", length.as_bytes()),
        (b"x-tenant-id", b"bench"),
        (b"content-type", b"application/json"),
        (b"idempotency-key", b"bench-replay-0123456789ab"),
    ]);
    let stored = StoredResponse::new(
        200,
        vec![("content-type".to_string(), "application/json".to_string())],
        Some(br#"{"id":"o-4711","status":"created"}"#),
    );
    let record = format!(
        r#"{{"schema_version":1,"state":"COMPLETED","fingerprint":"{}","created_ms":1,"updated_ms":2,"response":{}}}"#,
        fingerprint(body),
        stored.to_json()
    );
    // acquire.lua's reply for a policy without limits: admitted, the record's code (3:
    // completed), its time to live, the record.
    let mut answer = b"*4\r\n:1\r\n:3\r\n:600000\r\n".to_vec();
    answer.extend_from_slice(format!("${}\r\n", record.len()).as_bytes());
    answer.extend_from_slice(record.as_bytes());
    answer.extend_from_slice(b"\r\n");
    let mut answer = tagged(&answer);
    let mut w: Worker<u32> = Worker::new(TokenSource::with_seed(1, 2), None, 25);
    let mut stream = 0u32;
    // One request: the status of its local reply.
    let mut request = |w: &mut Worker<u32>| -> Option<u32> {
        let cx = Cx::new(&rt, 1_000, &NoMetrics);
        stream += 1;
        black_box(request_headers(w, &cx, stream, map.clone(), false));
        let mut fx = w.on_body(&cx, stream, Dir::Request, body.len(), true, || {
            body.to_vec()
        });
        let call = fx.streams.iter_mut().flat_map(|o| o.calls.drain(..)).next();
        let call = call.expect("one acquire call");
        black_box(&call.body);
        retag(&mut answer, call.route.tag());
        let _ = w.sent(&cx, call.route, Ok(stream));
        let fx = w.on_answer(&cx, stream, || {
            webdis::decode_array(&answer).ok_or(coordination_guard::redis::CallError::Transport)
        });
        let status = fx
            .streams
            .iter()
            .find_map(|o| o.reply.as_ref().map(|r| r.status));
        black_box(fx);
        black_box(w.on_done(&cx, stream));
        w.close(stream);
        status
    };
    assert_eq!(request(&mut w), Some(200), "the stored response replayed");
    report("request through the worker, idempotency replay", || {
        black_box(request(&mut w));
    });
}

/// A request of one tenant that the worker answers without Redis, driven as the adapter
/// drives it (the host's map decoded, matched and parsed; the worker's events; the stream's
/// end and its context freed): rejected by the over-limit cache (`mode` "exact", after one
/// rejecting `answer`), or admitted from a leased slice ("leased", after one granting one).
fn worker_local(mode: &str, answer: &[u8], rejects: bool) {
    let rt = per_tenant(mode);
    let map = host_map("bench");
    let mut answer = tagged(answer);
    let mut w: Worker<u32> = Worker::new(TokenSource::with_seed(1, 2), None, 25);
    let mut stream = 0u32;
    // One request: whether it was answered locally (the cached 429).
    let mut request = |w: &mut Worker<u32>| -> bool {
        let cx = Cx::new(&rt, 1_000, &NoMetrics);
        stream += 1;
        let mut fx = request_headers(w, &cx, stream, map.clone(), true);
        let call = fx.streams.iter_mut().flat_map(|o| o.calls.drain(..)).next();
        if let Some(call) = call {
            retag(&mut answer, call.route.tag());
            let _ = w.sent(&cx, call.route, Ok(stream));
            fx = w.on_answer(&cx, stream, || {
                webdis::decode_array(&answer).ok_or(coordination_guard::redis::CallError::Transport)
            });
        }
        let replied = fx.streams.iter().any(|o| o.reply.is_some());
        black_box(fx);
        if w.guards(stream) {
            black_box(w.on_response_headers_untimed(&cx, stream));
            black_box(w.on_done(&cx, stream));
        }
        w.close(stream);
        replied
    };
    request(&mut w);
    assert_eq!(request(&mut w), rejects, "{mode}: answered locally");
    let what = if rejects {
        "rejected by the over-limit cache"
    } else {
        "admitted from a leased slice"
    };
    report(&format!("request through the worker, {what}"), || {
        black_box(request(&mut w));
    });
}
