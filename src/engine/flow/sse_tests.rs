//! Charges read from an event stream (`response_sse_json`) through the flow: every limit
//! reads its own pointer from the same stream in one pass, each piece goes on at once, and
//! the correction goes out when the stream ends, however it ends.

use crate::engine::flow::test_support::*;
use crate::engine::flow::*;
use crate::support::metrics::testing::Recorder;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// Prompt and completion tokens counted apart, each admitted at the declared estimate.
const CONFIG: &str = r#"{
  "redis": {"cluster": "gw", "timeout": "50ms", "key_prefix": "cg"},
  "policies": [
    {"name": "chat", "match": {"path_prefix": "/chat"}, "rate_limits": [
      {"name": "prompt", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000, "window": "1m",
       "cost": {"header": "x-cost", "default": 1, "max": 5000},
       "charge": {"response_sse_json": "/usage/prompt_tokens"}},
      {"name": "completion", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000, "window": "1m",
       "cost": {"header": "x-cost", "default": 1, "max": 5000},
       "charge": {"response_sse_json": "/usage/completion_tokens", "missing": 900}}
    ]}
  ]
}"#;

/// OpenAI's shape: content chunks with `"usage": null`, then the usage, then `[DONE]`.
const STREAM: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}],\"usage\":null}\r\n\r\n\
: keep-alive\r\n\r\n\
data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}],\"usage\":null}\r\n\r\n\
data: {\"choices\":[],\r\ndata:  \"usage\":{\"prompt_tokens\":120,\"completion_tokens\":35,\"total_tokens\":155}}\r\n\r\n\
data: [DONE]\r\n\r\n";

const SSE: &[(&str, &str)] = &[
    (":status", "200"),
    ("content-type", "text/event-stream; charset=utf-8"),
];

/// A `/chat` request admitted at cost 10 on both limits, its response's headers in.
fn admitted(rt: &Runtime, rec: &Recorder, response: &[(&str, &str)]) -> Flow {
    let mut flow = Flow::default();
    let step = flow.on_request(
        &Cx::new(rt, 0, rec),
        request("POST", "/chat")
            .authority("api")
            .tenant("acme")
            .header("x-cost", "10")
            .build(),
        "n",
        "o",
        true,
    );
    let out = dispatched(step);
    let step = flow.on_reply(
        &Cx::new(rt, 5, rec),
        out[0].slot,
        Ok(acquire()
            .limit_ok(99_990, 60_000)
            .limit_ok(99_990, 60_000)
            .reply()),
    );
    assert_eq!(step.next, Move::Continue);
    let step = flow.on_response_headers(
        &Cx::new(rt, 6, rec),
        200,
        true,
        "via_upstream",
        &headers(response),
        false,
    );
    assert_eq!(step.next, Move::Continue);
    flow
}

/// The stream in `pieces`, each going on at once; the stream's end with the last one if
/// `ended`, then the stream is gone: the corrections, as `(key, delta)` per limit.
fn stream(rec: &Recorder, pieces: &[&[u8]], ended: bool) -> Vec<(String, String)> {
    let rt = runtime_of(rec, CONFIG);
    let mut flow = admitted(&rt, rec, SSE);
    for (i, piece) in pieces.iter().enumerate() {
        let cx = Cx::new(&rt, 7, rec);
        assert!(flow.wants_response_body(), "piece {i} is read");
        let end = ended && i + 1 == pieces.len();
        let step = flow.on_response_body(&cx, piece.len(), end, || piece.to_vec());
        assert_eq!(step.next, Move::Continue, "piece {i} goes on at once");
    }
    let bg = flow.on_done(&Cx::new(&rt, 8, rec));
    assert!(bg.iter().all(|b| b.purpose == Purpose::Charge));
    // One call: both limits are counted by tenant, so they share a hash tag.
    assert!(bg.len() <= 1, "{bg:?}");
    let mut out = Vec::new();
    for b in &bg {
        // `n`, then per counter: its code, limit, window and delta.
        let args = b.call.args.words_from(1);
        for (key, a) in b.call.keys.iter().zip(args.chunks(4)) {
            let name = if key.contains(":prompt:") {
                "prompt"
            } else {
                "completion"
            };
            let delta = a.get(3).copied().unwrap_or_default();
            out.push((name.to_string(), delta.to_string()));
        }
    }
    out
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

#[test]
fn each_limit_reads_its_own_number_from_the_last_event_carrying_it() {
    // Whole, and cut at every byte into two pieces.
    for cut in 0..=STREAM.len() {
        let rec = Recorder::default();
        let (a, b) = STREAM.split_at(cut);
        let got = stream(&rec, &[a, b], true);
        assert_eq!(
            got,
            pairs(&[("prompt", "110"), ("completion", "25")]),
            "cut at {cut}"
        );
        assert_eq!(rec.count("cg.policy.chat.limit.prompt.charged"), 120);
        assert_eq!(rec.count("cg.policy.chat.limit.completion.charged"), 35);
        assert_eq!(rec.count("cg.policy.chat.limit.prompt.charge_missing"), 0);
        assert_eq!(
            rec.count("cg.policy.chat.limit.prompt.charge_unreadable"),
            0
        );
    }
    // Byte by byte.
    let rec = Recorder::default();
    let bytes: Vec<&[u8]> = STREAM.chunks(1).collect();
    assert_eq!(
        stream(&rec, &bytes, true),
        pairs(&[("prompt", "110"), ("completion", "25")])
    );
}

#[test]
fn a_stream_that_ends_or_is_cut_before_its_usage_is_charged_missing() {
    // Cut (the client left, the upstream reset) before the usage event, or in its middle,
    // or the stream ended without it: prompt is charged its admitted cost (10, nothing to
    // correct), completion its `missing` (900), both counted.
    let last = STREAM.len() - b"data: [DONE]\r\n\r\n".len();
    for (pieces, ended) in [
        (&[&STREAM[..40]][..], false),
        (&[&STREAM[..last - 10]], false),
        (&[&STREAM[..last - 10]], true),
        (&[b"data: {\"usage\":{}}\n\n"], true),
        (&[b": nothing but comments\n\n"], true),
        (&[b""], true),
    ] {
        let rec = Recorder::default();
        assert_eq!(
            stream(&rec, pieces, ended),
            pairs(&[("completion", "890")]),
            "{pieces:?}"
        );
        assert_eq!(rec.count("cg.policy.chat.limit.prompt.charge_missing"), 1);
        assert_eq!(
            rec.count("cg.policy.chat.limit.completion.charge_missing"),
            1
        );
        assert_eq!(rec.count("cg.policy.chat.limit.prompt.charged"), 10);
        assert_eq!(rec.count("cg.policy.chat.limit.completion.charged"), 900);
        assert_eq!(
            rec.count("cg.policy.chat.limit.prompt.charge_unreadable"),
            0
        );
    }
    // Cut after the usage event: what it said stands.
    let rec = Recorder::default();
    assert_eq!(
        stream(&rec, &[&STREAM[..last]], false),
        pairs(&[("prompt", "110"), ("completion", "25")])
    );
    assert_eq!(rec.count("cg.policy.chat.limit.prompt.charge_missing"), 0);
}

#[test]
fn a_compressed_stream_is_unreadable_and_a_json_answer_is_read_as_json() {
    // gzip: the filter cannot inflate it, so the `unreadable` fallback (cost.max 5000).
    let rec = Recorder::default();
    let rt = runtime_of(&rec, CONFIG);
    let mut gz = SSE.to_vec();
    gz.push(("content-encoding", "gzip"));
    let mut flow = admitted(&rt, &rec, &gz);
    assert!(
        !flow.wants_response_body(),
        "a compressed stream is not read"
    );
    let bg = flow.on_done(&Cx::new(&rt, 8, &rec));
    assert_eq!(bg.len(), 1);
    assert_eq!(
        rec.count("cg.policy.chat.limit.prompt.charge_unreadable"),
        1
    );
    assert_eq!(rec.count("cg.policy.chat.limit.completion.charged"), 5000);
    assert_eq!(rec.count("cg.policy.chat.limit.prompt.charge_missing"), 0);
    // The same endpoint answering without streaming: the JSON body.
    let rec = Recorder::default();
    let rt = runtime_of(&rec, CONFIG);
    let mut flow = admitted(
        &rt,
        &rec,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    let body = br#"{"usage":{"prompt_tokens":7,"completion_tokens":3}}"#;
    let cx = Cx::new(&rt, 7, &rec);
    flow.on_response_body(&cx, body.len(), true, || body.to_vec());
    flow.on_done(&Cx::new(&rt, 8, &rec));
    assert_eq!(rec.count("cg.policy.chat.limit.prompt.charged"), 7);
    assert_eq!(rec.count("cg.policy.chat.limit.completion.charged"), 3);
}
