//! Concurrency slots, costs and charges through the flow.

use crate::engine::flow::test_support::*;
use crate::engine::flow::*;
use crate::http::local_reply::Problem;
use crate::redis::CallError;
use crate::support::metrics::testing::Recorder;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const CONFIG: &str = r#"{
  "redis": {"cluster": "gw", "timeout": "50ms", "key_prefix": "cg"},
  "policies": [
    {"name": "run", "match": {"path_prefix": "/run"}, "rate_limits": [
      {"name": "inflight", "by": ["tenant"], "algorithm": "concurrency", "limit": 2, "window": "30s"}
    ]},
    {"name": "mixed", "match": {"path_prefix": "/mixed"}, "rate_limits": [
      {"name": "inflight", "by": ["tenant"], "algorithm": "concurrency", "limit": 2, "window": "30s"},
      {"name": "global", "by": [], "algorithm": "fixed_window", "limit": 5, "window": "1m"}
    ]},
    {"name": "llm", "match": {"path_prefix": "/llm"}, "rate_limits": [
      {"name": "tokens", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1000, "window": "1m",
       "cost": {"header": "x-cost", "default": 1, "min": 1, "max": 500},
       "charge": {"response_header": "x-tokens-used"}}
    ]}
  ]
}"#;

fn runtime(rec: &Recorder) -> Runtime {
    runtime_of(rec, CONFIG)
}

/// A `POST` of tenant `acme` to `path`.
fn req(path: &str) -> RequestBuilder {
    request("POST", path)
        .authority("api")
        .tenant("acme")
        .peer("127.0.0.1:4000")
}

/// A request of `path` sent; its acquire calls.
fn start(flow: &mut Flow, rt: &Runtime, rec: &Recorder, path: &str) -> Vec<Outgoing> {
    let step = flow.on_request(&Cx::new(rt, 0, rec), req(path).build(), "n1", "o1", true);
    dispatched(step)
}

#[test]
fn a_slot_is_taken_extended_and_given_back_at_the_end() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let out = start(&mut flow, &rt, &rec, "/run");
    assert_eq!(out.len(), 1);
    let call = &out[0].call;
    assert_eq!(
        call.args,
        vec!["1", "n1", "cc", "2", "30000", "2", "0", "1", "0", "0"]
    );
    assert!(call.keys[0].contains(":inflight:cc:"), "{:?}", call.keys);
    assert_eq!(
        call.keys.last(),
        Some("cg:cancel:{t.d2e79529ba2c46b2}:run:o1"),
        "the marker rides with a concurrency limit"
    );
    let step = flow.on_reply(
        &Cx::new(&rt, 5, &rec),
        out[0].slot,
        Ok(acquire().limit_ok(1, 30_000).reply()),
    );
    assert_eq!(step.next, Move::Continue);
    assert_eq!(
        step.out.response_headers,
        vec![
            (
                "ratelimit-policy".to_string(),
                "\"inflight\";q=2;qu=\"concurrent-requests\"".to_string()
            ),
            ("ratelimit".to_string(), "\"inflight\";r=1".to_string()),
        ],
        "an in-flight quota: slots, no window, no reset"
    );
    assert_eq!(rec.count("cg.policy.run.limit.inflight.allowed"), 1);
    assert_eq!(
        flow.deadline_ms(),
        Some(15_005),
        "extended at half the window"
    );
    let step = flow.on_tick(&Cx::new(&rt, 15_005, &rec));
    assert_eq!(step.next, Move::Wait);
    let bg = step.out.background;
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::SlotExtend);
    assert_eq!(bg[0].call.args, vec!["n1", "30000"]);
    assert_eq!(flow.deadline_ms(), Some(30_005));
    // An event stream: the slot stays held (and extended) until the stream ends.
    let h = headers(&[(":status", "200"), ("content-type", "text/event-stream")]);
    let step = flow.on_response_headers(&Cx::new(&rt, 16_000, &rec), 200, true, "", &h, false);
    assert_eq!(step.next, Move::Continue);
    let bg = flow.on_done(&Cx::new(&rt, 20_000, &rec));
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::SlotRelease);
    assert_eq!(
        (bg[0].call.keys.len(), &bg[0].call.args),
        (1, &crate::redis::Words::from(["n1"]))
    );
    assert!(bg[0].certain && !bg[0].compensation);
    assert_eq!(flow.deadline_ms(), None);
}

#[test]
fn a_full_limit_is_429_concurrency_limited_and_holds_nothing() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let out = start(&mut flow, &rt, &rec, "/run");
    let step = flow.on_reply(
        &Cx::new(&rt, 5, &rec),
        out[0].slot,
        Ok(acquire().limit_over(0, 30_000, 1_000).reply()),
    );
    let r = respond_with(step);
    assert_eq!(r.status, 429);
    assert_eq!(r.problem, Some(Problem::ConcurrencyLimited));
    assert!(String::from_utf8_lossy(&r.body).contains("#quota-exceeded"));
    assert!(String::from_utf8_lossy(&r.body).contains("concurrency limit \\\"inflight\\\""));
    assert_eq!(header(&r, "retry-after"), Some("1"));
    assert_eq!(header(&r, "ratelimit"), Some("\"inflight\";r=0"));
    assert_eq!(
        header(&r, "ratelimit-policy"),
        Some("\"inflight\";q=2;qu=\"concurrent-requests\"")
    );
    assert_eq!(rec.count("cg.policy.run.limit.inflight.rejected"), 1);
    assert!(
        flow.on_done(&Cx::new(&rt, 6, &rec)).is_empty(),
        "no slot was taken"
    );
}

#[test]
fn a_slot_taken_by_a_call_the_filter_gave_up_on_is_released_with_the_marker() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let out = start(&mut flow, &rt, &rec, "/run");
    // The gateway timed out: the acquire may still run.
    let step = flow.on_reply(
        &Cx::new(&rt, 60, &rec),
        out[0].slot,
        Err(CallError::Timeout),
    );
    assert_eq!(respond_with(step.clone()).status, 503);
    let bg = step.out.background;
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::SlotRelease);
    assert!(bg[0].compensation);
    assert_eq!(&bg[0].call.keys[1], "cg:cancel:{t.d2e79529ba2c46b2}:run:o1");
    assert_eq!(&bg[0].call.args[0], "n1");
    assert!(
        flow.on_done(&Cx::new(&rt, 70, &rec)).is_empty(),
        "handed over once"
    );
}

#[test]
fn a_slot_taken_in_one_hash_slot_is_given_back_when_another_rejects() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let out = start(&mut flow, &rt, &rec, "/mixed");
    assert_eq!(out.len(), 2, "tenant slot and policy slot");
    let tenant = out
        .iter()
        .position(|o| &o.call.args[2] == "cc")
        .expect("cc call");
    let other = 1 - tenant;
    assert_eq!(
        flow.on_reply(
            &Cx::new(&rt, 5, &rec),
            out[tenant].slot,
            Ok(acquire().limit_ok(1, 30_000).reply())
        )
        .next,
        Move::Wait
    );
    let step = flow.on_reply(
        &Cx::new(&rt, 6, &rec),
        out[other].slot,
        Ok(acquire().limit_over(0, 9_000, 9_000).reply()),
    );
    let r = respond_with(step.clone());
    assert_eq!(r.problem, Some(Problem::RateLimited));
    let ratelimit = header(&r, "ratelimit").expect("RateLimit for the counting limit");
    assert!(
        ratelimit.contains("\"global\"") && !ratelimit.contains("inflight"),
        "only the violated limit: {ratelimit}"
    );
    let bg = step.out.background;
    assert_eq!(
        bg.iter().map(|b| b.purpose).collect::<Vec<_>>(),
        vec![Purpose::SlotRelease]
    );
    assert!(bg[0].certain && !bg[0].compensation);
}

#[test]
fn the_cost_header_is_read_strictly() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let cx = Cx::new(&rt, 0, &rec);
    let mut flow = Flow::default();
    let out = dispatched(flow.on_request(
        &cx,
        req("/llm").header("x-cost", "42").build(),
        "n",
        "o",
        true,
    ));
    assert_eq!(
        &out[0].call.args.words_from(2)[..6],
        &["fw", "1000", "60000", "1000", "0", "42"]
    );
    let mut flow = Flow::default();
    let out = dispatched(flow.on_request(&cx, req("/llm").build(), "n", "o", true));
    assert_eq!(&out[0].call.args[7], "1", "the default");
    for bad in ["501", "0", "-1", "1e3", "abc", "4 2", "+3", ""] {
        let mut flow = Flow::default();
        let r = respond_with(flow.on_request(
            &cx,
            req("/llm").header("x-cost", bad).build(),
            "n",
            "o",
            true,
        ));
        assert_eq!(r.status, 400, "{bad:?}");
        assert!(
            String::from_utf8_lossy(&r.body).contains("invalid_cost"),
            "{bad:?}"
        );
    }
    let mut flow = Flow::default();
    let twice = req("/llm")
        .header("x-cost", "1")
        .header("x-cost", "2")
        .build();
    let r = respond_with(flow.on_request(&cx, twice, "n", "o", true));
    assert_eq!(r.status, 400);
    assert!(String::from_utf8_lossy(&r.body).contains("ambiguous_selector"));
}

/// A `/llm` request admitted with `cost`, its response carrying `response`.
fn charged(cost: &str, response: &[(&str, &str)], rec: &Recorder) -> Vec<Background> {
    let rt = runtime(rec);
    let mut flow = Flow::default();
    let step = flow.on_request(
        &Cx::new(&rt, 0, rec),
        req("/llm").header("x-cost", cost).build(),
        "n",
        "o",
        true,
    );
    let out = dispatched(step);
    let step = flow.on_reply(
        &Cx::new(&rt, 5, rec),
        out[0].slot,
        Ok(acquire().limit_ok(900, 60_000).reply()),
    );
    assert_eq!(step.next, Move::Continue);
    assert!(flow.wants_response(&Cx::new(&rt, 6, rec)));
    let headers: Vec<(String, String)> = std::iter::once((":status", "200"))
        .chain(response.iter().copied())
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    flow.on_response_headers(
        &Cx::new(&rt, 6, rec),
        200,
        true,
        "via_upstream",
        &headers,
        true,
    );
    flow.on_done(&Cx::new(&rt, 7, rec))
}

#[test]
fn the_charge_corrects_the_counter_after_the_response() {
    let rec = Recorder::default();
    let bg = charged("1", &[("x-tokens-used", "300")], &rec);
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::Charge);
    assert_eq!(bg[0].call.args, vec!["1", "fw", "1000", "60000", "299"]);
    assert!(bg[0].call.keys[0].contains(":tokens:fw:"));
    assert_eq!(rec.count("cg.policy.llm.limit.tokens.charged"), 300);
    // Less than admitted: the difference goes back.
    let rec = Recorder::default();
    let bg = charged("100", &[("x-tokens-used", "40")], &rec);
    assert_eq!(&bg[0].call.args[4], "-60");
    assert_eq!(rec.count("cg.policy.llm.limit.tokens.charged"), 40);
    // The same as admitted: nothing to correct, but charged.
    let rec = Recorder::default();
    assert!(charged("7", &[("x-tokens-used", "7")], &rec).is_empty());
    assert_eq!(rec.count("cg.policy.llm.limit.tokens.charged"), 7);
    // No charge, or one that is not a number: the limit's `unreadable` fallback (by default
    // the most a request is admitted at, cost.max 500), counted; never the admitted estimate
    // silently.
    for response in [
        &[][..],
        &[("x-tokens-used", "lots")],
        &[("x-tokens-used", "5.0")],
    ] {
        let rec = Recorder::default();
        let bg = charged("7", response, &rec);
        assert_eq!(&bg[0].call.args[4], "493", "{response:?}");
        assert_eq!(rec.count("cg.policy.llm.limit.tokens.charged"), 500);
        assert_eq!(rec.count("cg.policy.llm.limit.tokens.charge_unreadable"), 1);
    }
}

#[test]
fn a_response_that_never_came_is_charged_the_fallback_and_one_never_sent_is_not() {
    let forwarded = |details: Option<&str>, rec: &Recorder| {
        let rt = runtime(rec);
        let mut flow = Flow::default();
        let step = flow.on_request(
            &Cx::new(&rt, 0, rec),
            req("/llm").header("x-cost", "7").build(),
            "n",
            "o",
            true,
        );
        let out = dispatched(step);
        let step = flow.on_reply(
            &Cx::new(&rt, 5, rec),
            out[0].slot,
            Ok(acquire().limit_ok(900, 60_000).reply()),
        );
        assert_eq!(step.next, Move::Continue);
        if let Some(details) = details {
            let headers = vec![(":status".to_string(), "503".to_string())];
            flow.on_response_headers(&Cx::new(&rt, 6, rec), 503, false, details, &headers, true);
        }
        flow.on_done(&Cx::new(&rt, 7, rec))
    };
    // The client left before the response's headers; the upstream timed out.
    for details in [None, Some("upstream_response_timeout")] {
        let rec = Recorder::default();
        let bg = forwarded(details, &rec);
        assert_eq!(&bg[0].call.args[4], "493", "{details:?}");
        assert_eq!(rec.count("cg.policy.llm.limit.tokens.charge_unreadable"), 1);
    }
    // Envoy could not send it: nothing was used, the admitted cost stands.
    let rec = Recorder::default();
    assert!(forwarded(Some("no_healthy_upstream"), &rec).is_empty());
    assert_eq!(rec.count("cg.policy.llm.limit.tokens.charge_unreadable"), 0);
}

#[test]
fn a_rejected_request_is_never_charged() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    let step = flow.on_request(&Cx::new(&rt, 0, &rec), req("/llm").build(), "n", "o", true);
    let out = dispatched(step);
    let step = flow.on_reply(
        &Cx::new(&rt, 5, &rec),
        out[0].slot,
        Ok(acquire().limit_over(0, 60_000, 60_000).reply()),
    );
    assert_eq!(respond_with(step).status, 429);
    assert!(!flow.wants_response(&Cx::new(&rt, 6, &rec)));
    assert!(flow.on_done(&Cx::new(&rt, 7, &rec)).is_empty());
}

/// A `/run` request admitted with its slot.
fn admitted(flow: &mut Flow, rt: &Runtime, rec: &Recorder) {
    let out = start(flow, rt, rec, "/run");
    let step = flow.on_reply(
        &Cx::new(rt, 5, rec),
        out[0].slot,
        Ok(acquire().limit_ok(1, 30_000).reply()),
    );
    assert_eq!(step.next, Move::Continue);
}

fn response(flow: &mut Flow, rt: &Runtime, rec: &Recorder, headers: &[(&str, &str)]) -> Step {
    assert!(
        flow.wants_response(&Cx::new(rt, 10, rec)),
        "a slot to give back"
    );
    let h: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    flow.on_response_headers(&Cx::new(rt, 10, rec), 200, true, "via_upstream", &h, false)
}

#[test]
fn the_response_waits_for_the_slot_release_so_the_next_request_finds_it_free() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    admitted(&mut flow, &rt, &rec);
    let out = dispatched(response(&mut flow, &rt, &rec, &[(":status", "200")]));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].script, crate::redis::scripts::ScriptId::SlotRelease);
    assert_eq!(out[0].call.args, vec!["n1"]);
    assert_eq!(
        flow.deadline_ms(),
        Some(10 + 50),
        "no longer extended; the call's deadline"
    );
    let step = flow.on_reply(&Cx::new(&rt, 12, &rec), out[0].slot, Ok(settled()));
    assert_eq!(step.next, Move::Continue);
    assert!(
        flow.on_done(&Cx::new(&rt, 13, &rec)).is_empty(),
        "given back once"
    );
}

#[test]
fn a_slot_release_that_fails_or_times_out_goes_to_the_root() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    admitted(&mut flow, &rt, &rec);
    let out = dispatched(response(&mut flow, &rt, &rec, &[(":status", "200")]));
    let step = flow.on_reply(
        &Cx::new(&rt, 12, &rec),
        out[0].slot,
        Err(CallError::Timeout),
    );
    assert_eq!(step.next, Move::Continue, "the response goes on");
    let bg = step.out.background;
    assert_eq!(
        bg.iter().map(|b| b.purpose).collect::<Vec<_>>(),
        vec![Purpose::SlotRelease]
    );
    assert!(!bg[0].certain, "it may have run: not ours is expected");

    let mut flow = Flow::default();
    admitted(&mut flow, &rt, &rec);
    let _ = dispatched(response(&mut flow, &rt, &rec, &[(":status", "200")]));
    let deadline = flow.deadline_ms().expect("the call's deadline");
    let step = flow.on_tick(&Cx::new(&rt, deadline, &rec));
    assert_eq!(step.next, Move::Continue);
    let bg = step.out.background;
    assert_eq!(
        bg.iter().map(|b| b.purpose).collect::<Vec<_>>(),
        vec![Purpose::SlotRelease]
    );
}

#[test]
fn an_open_ended_response_keeps_its_slot_until_the_stream_ends() {
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    admitted(&mut flow, &rt, &rec);
    let step = response(
        &mut flow,
        &rt,
        &rec,
        &[(":status", "200"), ("content-type", "text/event-stream")],
    );
    assert_eq!(step.next, Move::Continue);
    assert_eq!(flow.deadline_ms(), Some(15_005), "still extended");
    let bg = flow.on_done(&Cx::new(&rt, 20_000, &rec));
    assert_eq!(
        bg.iter().map(|b| b.purpose).collect::<Vec<_>>(),
        vec![Purpose::SlotRelease]
    );
}

#[test]
fn a_client_gone_before_the_response_leaves_its_slot_to_expire() {
    // Forwarded, no response yet: the service may still be working. The slot is neither
    // given back nor extended any more: it expires after its window. Counted.
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    admitted(&mut flow, &rt, &rec);
    assert_eq!(
        flow.deadline_ms(),
        Some(15_005),
        "extended while the request runs"
    );
    assert!(
        flow.on_done(&Cx::new(&rt, 1_000, &rec)).is_empty(),
        "nothing given back"
    );
    assert_eq!(flow.deadline_ms(), None, "no longer extended");
    assert_eq!(rec.count("cg.policy.run.limit.inflight.slot_orphaned"), 1);
    let step = flow.on_tick(&Cx::new(&rt, 15_005, &rec));
    assert!(step.next == Move::Wait);
    assert!(step.out.background.is_empty(), "no extension either");
}

#[test]
fn a_client_gone_after_the_response_headers_gives_its_slot_back() {
    // The service answered (an event stream holds the slot to its end): the client leaving
    // mid-body gives the slot back at once, not counted as orphaned.
    let rec = Recorder::default();
    let rt = runtime(&rec);
    let mut flow = Flow::default();
    admitted(&mut flow, &rt, &rec);
    response(
        &mut flow,
        &rt,
        &rec,
        &[(":status", "200"), ("content-type", "text/event-stream")],
    );
    let bg = flow.on_done(&Cx::new(&rt, 1_000, &rec));
    assert_eq!(
        bg.iter()
            .map(|b| (b.purpose, b.certain))
            .collect::<Vec<_>>(),
        vec![(Purpose::SlotRelease, true)]
    );
    assert_eq!(rec.count("cg.policy.run.limit.inflight.slot_orphaned"), 0);
}
