use crate::engine::flow::test_support::{self, acquire, batch, noscript, settled};
use crate::engine::flow::Runtime;
use crate::engine::worker::root::LEASE_WAIT_TICK_MS;
use crate::engine::worker::*;
use crate::redis::tag::{wrap, CallTags};
use crate::redis::{resp::Reply, CallError};
use crate::support::metrics::testing::Recorder;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const CONFIG: &str = r#"{
  "redis": {"cluster": "gw", "timeout": "50ms", "key_prefix": "cg", "batch": false},
  "failure_mode": "fail_closed",
  "policies": [
    {"name": "reads", "match": {"methods": ["GET"]}, "failure_mode": "fail_open", "rate_limits": [
      {"name": "global", "by": [], "algorithm": "token_bucket", "limit": 5, "window": "1s"}
    ]},
    {"name": "writes", "match": {"methods": ["PUT"]}, "rate_limits": [
      {"name": "global", "by": [], "algorithm": "fixed_window", "limit": 5, "window": "1s"}
    ]},
    {"name": "wait", "match": {"path_prefix": "/wait"},
     "lease": {"resource": ["path_segment:2"], "ttl": "2s", "on_busy": "wait", "max_wait": "200ms",
               "fencing_header": "x-lease-token", "extend": false}}
  ]
}"#;

/// The root's usual tick in these tests.
const TICK_MS: u64 = 25;

fn runtime(rec: &Recorder, config: &str) -> Runtime {
    test_support::runtime_of(rec, config)
}

fn worker(rt: &Runtime) -> Worker<u32> {
    Worker::new(TokenSource::with_seed(1, 2), rt.config.redis.batch, TICK_MS)
}

fn req(method: &str, path: &str) -> Request {
    test_support::request(method, path)
        .authority("api")
        .tenant("acme")
        .peer("127.0.0.1:4000")
        .build()
}

/// The policy index a request of `method` to `path` matches.
fn request(w: &mut Worker<u32>, cx: &Cx<'_>, s: u32, method: &str, path: &str) -> Effects<u32> {
    let req = req(method, path);
    let Some(crate::http::matching::Selected::Policy(index)) =
        crate::http::matching::parsed_policy_index(&cx.rt.config.policies, &req)
    else {
        panic!("no policy for {method} {path}");
    };
    w.on_request_headers(cx, s, index, req, true)
}

/// Hands every call of `fx` to the "host", which gives them tokens from `next`.
fn send_all(w: &mut Worker<u32>, cx: &Cx<'_>, fx: Effects<u32>, next: &mut u32) -> Vec<u32> {
    let mut calls: Vec<Callout<u32>> = fx.calls;
    for ops in fx.streams {
        calls.extend(ops.calls);
    }
    let mut tokens = Vec::new();
    for call in calls {
        *next += 1;
        tokens.push(*next);
        let more = w.sent(cx, call.route, Ok(*next));
        assert!(more.streams.is_empty() && more.calls.is_empty());
    }
    tokens
}

/// Sends the one call of `fx` (see [`send_all`]) and answers it with `reply`.
fn answer(
    w: &mut Worker<u32>,
    cx: &Cx<'_>,
    fx: Effects<u32>,
    next: &mut u32,
    reply: impl Into<Reply>,
) -> Effects<u32> {
    let tokens = send_all(w, cx, fx, next);
    assert_eq!(tokens.len(), 1, "one call");
    reply_to(w, cx, tokens[0], reply.into())
}

/// Answers the call sent with `token` with the script body's `reply` as the tag's wrapper
/// returns it: with the call's tag.
fn reply_to(w: &mut Worker<u32>, cx: &Cx<'_>, token: u32, reply: impl Into<Reply>) -> Effects<u32> {
    let tag = w.tag_of(token).expect("a call in flight");
    let reply = wrap(&tag, reply.into());
    w.on_answer(cx, token, || Ok(reply))
}

/// Streams 1 and 2, and only they, resumed their requests with no reply of the filter's own.
fn assert_both_resumed(fx: &Effects<u32>) {
    let resumed: Vec<(u32, Option<Dir>, bool)> = fx
        .streams
        .iter()
        .map(|o| (o.stream, o.resume, o.reply.is_some()))
        .collect();
    assert_eq!(
        resumed,
        vec![
            (1, Some(Dir::Request), false),
            (2, Some(Dir::Request), false)
        ]
    );
}

/// Stream `s`'s response headers: an event stream, which holds its lease and slots until
/// the stream ends (then the root gives them back).
fn event_stream(w: &mut Worker<u32>, cx: &Cx<'_>, s: u32) -> Effects<u32> {
    w.on_response_headers(cx, s, false, || ResponseHead {
        headers: vec![
            (":status".to_string(), "200".to_string()),
            ("content-type".to_string(), "text/event-stream".to_string()),
        ],
        details: "via_upstream".to_string(),
    })
}

fn unread() -> Result<Reply, CallError> {
    panic!("an answer nobody waits for is not read")
}

#[test]
fn an_answer_goes_back_to_its_stream_and_resumes_it() {
    let rec = Recorder::default();
    let rt = runtime(&rec, CONFIG);
    let cx = Cx::new(&rt, 1_000, &rec);
    let mut w = worker(&rt);
    let fx = request(&mut w, &cx, 7, "GET", "/x");
    assert_eq!(fx.action, Action::Pause);
    assert_eq!(fx.streams.len(), 1);
    assert_eq!(fx.streams[0].stream, 7);
    assert_eq!(fx.streams[0].calls.len(), 1);
    assert_eq!(rec.count("cg.redis.calls"), 1, "counted as it goes out");
    let mut next = 100;
    let tokens = send_all(&mut w, &cx, fx, &mut next);
    assert!(w.on_answer(&cx, 999, unread).streams.is_empty());
    let fx = reply_to(&mut w, &cx, tokens[0], acquire().limit_ok(4, 1_000).reply());
    assert_eq!(fx.streams.len(), 1);
    assert_eq!(
        fx.streams[0].resume,
        Some(Dir::Request),
        "paused by the headers"
    );
    assert_eq!(rec.count("cg.policy.reads.limit.global.allowed"), 1);
    assert!(
        w.on_answer(&cx, tokens[0], unread).streams.is_empty(),
        "once"
    );
    // The response of a stream that wants nothing of it passes, with the rate-limit headers.
    let fx = w.on_response_headers(&cx, 7, false, || panic!("not read"));
    assert_eq!(fx.action, Action::Continue);
    assert_eq!(fx.streams[0].add_response_headers.len(), 2);
}

#[test]
fn a_refused_send_is_its_answer_at_once() {
    let rec = Recorder::default();
    let rt = runtime(&rec, CONFIG);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    // Fail open: the request goes on, resumed in the same callback.
    let mut fx = request(&mut w, &cx, 1, "GET", "/x");
    let call = fx.streams.remove(0).calls.remove(0);
    let fx = w.sent(&cx, call.route, Err(CallError::NotSent));
    assert_eq!(fx.action, Action::Continue);
    assert_eq!(fx.streams[0].resume, Some(Dir::Request));
    // Fail closed: answered locally, and the stream stays held.
    let mut fx = request(&mut w, &cx, 2, "PUT", "/x");
    let call = fx.streams.remove(0).calls.remove(0);
    let fx = w.sent(&cx, call.route, Err(CallError::NotSent));
    assert_eq!(fx.action, Action::Pause);
    assert_eq!(fx.streams[0].reply.as_ref().map(|r| r.status), Some(503));
    assert_eq!(fx.streams[0].resume, None);
}

#[test]
fn the_tick_decides_only_streams_past_their_deadline() {
    let rec = Recorder::default();
    let rt = runtime(&rec, CONFIG);
    let mut w = worker(&rt);
    let fx = request(&mut w, &Cx::new(&rt, 0, &rec), 1, "PUT", "/x");
    send_all(&mut w, &Cx::new(&rt, 0, &rec), fx, &mut 0);
    let fx = request(&mut w, &Cx::new(&rt, 30, &rec), 2, "PUT", "/x");
    send_all(&mut w, &Cx::new(&rt, 30, &rec), fx, &mut 10);
    let fx = w.on_tick(&Cx::new(&rt, 50, &rec));
    assert_eq!(fx.streams.len(), 1, "stream 2 still has time");
    assert_eq!(fx.streams[0].stream, 1);
    assert_eq!(fx.streams[0].reply.as_ref().map(|r| r.status), Some(503));
    assert_eq!(rec.count("cg.redis.timeouts"), 1);
    assert!(w.on_tick(&Cx::new(&rt, 60, &rec)).streams.is_empty());
    let fx = w.on_tick(&Cx::new(&rt, 80, &rec));
    assert_eq!(fx.streams[0].stream, 2);
}

/// Stream 1 acquires the lease of /wait/9, then stream 2 finds it busy and waits: the
/// effects of both answers.
fn holder_and_waiter(
    w: &mut Worker<u32>,
    cx: &Cx<'_>,
    next: &mut u32,
) -> (Effects<u32>, Effects<u32>) {
    let fx = request(w, cx, 1, "POST", "/wait/9/a");
    let t1 = send_all(w, cx, fx, next);
    let held = reply_to(w, cx, t1[0], acquire().lease_granted(77).reply());
    let fx = request(w, cx, 2, "POST", "/wait/9/b");
    let t2 = send_all(w, cx, fx, next);
    let waits = reply_to(w, cx, t2[0], acquire().lease_busy(1500).reply());
    (held, waits)
}

#[test]
fn a_lease_given_back_wakes_its_waiters_and_the_fine_tick_follows_them() {
    let rec = Recorder::default();
    let rt = runtime(&rec, CONFIG);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    // Stream 1 holds the lease of /wait/9, stream 2 finds it busy and waits: the root ticks
    // finely.
    let (held, waits) = holder_and_waiter(&mut w, &cx, &mut next);
    assert_eq!(
        held.streams[0].set_request_headers,
        vec![("x-lease-token".to_string(), "77".to_string())]
    );
    assert_eq!(held.tick_ms, None);
    assert!(waits.streams.is_empty(), "still held");
    assert_eq!(waits.tick_ms, Some(LEASE_WAIT_TICK_MS));
    // Nothing is due before its poll.
    assert!(w.on_tick(&Cx::new(&rt, 1, &rec)).streams.is_empty());
    // Stream 1's response waits for the release; Redis confirms it.
    let head = || ResponseHead {
        headers: vec![(":status".to_string(), "200".to_string())],
        details: "via_upstream".to_string(),
    };
    let fx = w.on_response_headers(&Cx::new(&rt, 2, &rec), 1, true, head);
    assert_eq!(fx.action, Action::Pause);
    let t3 = send_all(&mut w, &cx, fx, &mut next);
    let fx = reply_to(&mut w, &Cx::new(&rt, 3, &rec), t3[0], settled());
    assert_eq!(fx.streams[0].resume, Some(Dir::Response));
    // Stream 2 polls at the next tick, not at the end of its backoff.
    let fx = w.on_tick(&Cx::new(&rt, 3, &rec));
    assert_eq!(fx.streams.len(), 1);
    assert_eq!(fx.streams[0].stream, 2);
    assert_eq!(fx.streams[0].calls.len(), 1, "the lease-only acquire");
    assert_eq!(fx.tick_ms, Some(TICK_MS), "nobody waits any more");
    let t4 = send_all(&mut w, &cx, fx, &mut next);
    let fx = reply_to(
        &mut w,
        &Cx::new(&rt, 4, &rec),
        t4[0],
        acquire().lease_granted(78).reply(),
    );
    assert_eq!(fx.streams[0].resume, Some(Dir::Request));
    assert_eq!(
        w.on_tick(&Cx::new(&rt, 5, &rec)).tick_ms,
        None,
        "switched once"
    );
}

#[test]
fn what_a_stream_owes_at_its_end_goes_out_from_the_root() {
    let rec = Recorder::default();
    let rt = runtime(&rec, CONFIG);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    holder_and_waiter(&mut w, &cx, &mut next);
    // An event stream holds the lease to its end; then the release goes to the root's outbox.
    assert!(event_stream(&mut w, &cx, 1).calls.is_empty());
    let fx = w.on_done(&cx, 1);
    assert!(fx.streams.is_empty() && fx.calls.is_empty());
    let fx = w.on_tick(&Cx::new(&rt, 1, &rec));
    assert!(fx.streams.is_empty());
    assert_eq!(fx.calls.len(), 1, "the release, from the root");
    let t3 = send_all(&mut w, &cx, fx, &mut next);
    let fx = reply_to(&mut w, &Cx::new(&rt, 2, &rec), t3[0], settled());
    assert!(fx.streams.is_empty());
    assert_eq!(rec.count("cg.policy.wait.lease.released"), 1);
    let fx = w.on_tick(&Cx::new(&rt, 2, &rec));
    assert_eq!(fx.streams[0].stream, 2, "woken by the root's release");
}

/// A stream's calls are forgotten with it: when it closes, and when its request starts
/// afresh (the host hands a stream's request headers once; were it to hand them again).
#[test]
fn a_closed_or_restarted_stream_forgets_its_calls() {
    let rec = Recorder::default();
    let rt = runtime(&rec, CONFIG);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let fx = request(&mut w, &cx, 1, "PUT", "/x");
    let tokens = send_all(&mut w, &cx, fx, &mut 0);
    assert!(w.waiting.contains(&1), "paused on Redis, with a deadline");
    w.close(1);
    assert!(w.waiting.is_empty() && w.routes.is_empty());
    // The host's end of a stream already forgotten, or never guarded: nothing to forget.
    w.close(1);
    w.close(2);
    assert!(w.streams.0.is_empty() && w.waiting.is_empty());
    assert!(w.on_answer(&cx, tokens[0], unread).streams.is_empty());
    assert!(w.on_tick(&Cx::new(&rt, 1_000, &rec)).streams.is_empty());
    // Events of an unguarded stream: it goes on.
    let fx = w.on_body(&cx, 3, Dir::Request, 10, true, || panic!("not read"));
    assert_eq!(fx.action, Action::Continue);
    assert!(fx.streams.is_empty());
    // Request headers again: only the new request's call is routed.
    let fx = request(&mut w, &cx, 4, "PUT", "/x");
    let first = send_all(&mut w, &cx, fx, &mut 10);
    let fx = request(&mut w, &cx, 4, "PUT", "/x");
    let second = send_all(&mut w, &cx, fx, &mut 20);
    assert!(w.guards(4) && w.waiting.contains(&4));
    assert_eq!(w.routes.len(), 1);
    assert!(w.on_answer(&cx, first[0], unread).streams.is_empty());
    let fx = reply_to(&mut w, &cx, second[0], acquire().limit_ok(4, 1_000).reply());
    assert_eq!(fx.streams[0].resume, Some(Dir::Request), "{fx:?}");
}

#[test]
fn acquires_wait_for_a_batch_and_each_gets_its_answer() {
    let config = CONFIG.replace(r#""batch": false}"#, r#""batch": {"max_delay": "2ms"}}"#);
    let rec = Recorder::default();
    let rt = runtime(&rec, &config);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let fx = request(&mut w, &cx, 1, "GET", "/x");
    assert!(fx.wake, "the first queued acquire wakes the root");
    assert!(fx.streams.is_empty(), "nothing to send yet");
    assert_eq!(fx.action, Action::Pause);
    let fx = request(&mut w, &cx, 2, "GET", "/y");
    assert!(!fx.wake, "once per batch");
    let fx = w.on_queue_ready(&cx);
    assert_eq!(fx.calls.len(), 1, "one batch");
    let tokens = send_all(&mut w, &cx, fx, &mut 0);
    // batch.lua's flat reply: each sub-call's length, then its reply.
    let part = batch([acquire().limit_ok(4, 1_000), acquire().limit_ok(3, 1_000)]);
    let fx = reply_to(&mut w, &cx, tokens[0], part);
    assert_both_resumed(&fx);
    // A batch the host refuses: every member gets the refusal.
    request(&mut w, &cx, 3, "PUT", "/x");
    let mut fx = w.on_tick(&cx);
    let fx = w.sent(&cx, fx.calls.remove(0).route, Err(CallError::NotSent));
    assert_eq!(fx.streams[0].reply.as_ref().map(|r| r.status), Some(503));
}

#[test]
fn a_release_handed_to_the_root_wakes_it_once_instead_of_waiting_for_the_tick() {
    let rec = Recorder::default();
    let config = r#"{"redis": {"cluster": "gw", "timeout": "50ms", "key_prefix": "cg", "batch": false},
      "policies": [{"name": "run", "rate_limits": [
        {"name": "inflight", "by": ["tenant"], "algorithm": "concurrency", "limit": 2, "window": "1s"}]}]}"#;
    let rt = runtime(&rec, config);
    assert_eq!(
        rt.config.tick_ms(false),
        25,
        "a quarter of the window, before its half"
    );
    let mut w = worker(&rt);
    let cx = Cx::new(&rt, 0, &rec);
    let mut next = 0;
    for s in [1, 2] {
        let fx = request(&mut w, &cx, s, "POST", "/run");
        let fx = answer(&mut w, &cx, fx, &mut next, acquire().limit_ok(1, 1_000));
        assert_eq!(fx.streams[0].resume, Some(Dir::Request));
        event_stream(&mut w, &cx, s);
    }
    let done = w.on_done(&cx, 1);
    assert!(done.wake, "the slot's release must not wait for the tick");
    assert!(
        done.calls.is_empty(),
        "sent by the root, not the ending stream"
    );
    assert!(!w.on_done(&cx, 2).wake, "one wake-up until the root ran");
    let fx = w.on_queue_ready(&cx);
    assert_eq!(fx.calls.len(), 2, "both releases go out at once");
    let fx = request(&mut w, &cx, 3, "POST", "/run");
    let _ = send_all(&mut w, &cx, fx, &mut next);
    assert!(w.on_done(&cx, 3).wake, "woken again once the root ran");
}

#[test]
fn only_guarded_streams_and_bodies_the_flow_takes_need_events() {
    let rec = Recorder::default();
    let rt = runtime(&rec, CONFIG);
    let mut w = worker(&rt);
    let cx = Cx::new(&rt, 0, &rec);
    assert!(
        !w.guards(9) && !w.wants_body(9, Dir::Response),
        "an unknown stream"
    );
    let mut next = 0;
    let fx = request(&mut w, &cx, 1, "PUT", "/x");
    assert!(w.guards(1));
    assert!(
        w.wants_body(1, Dir::Request),
        "held while the limit is decided"
    );
    let _ = answer(&mut w, &cx, fx, &mut next, acquire().limit_ok(4, 1_000));
    assert!(!w.wants_body(1, Dir::Request), "forwarded: the body passes");
    assert!(
        !w.wants_body(1, Dir::Response),
        "no record, no charge: nothing to take in"
    );
    let _ = w.on_done(&cx, 1);
    assert!(!w.guards(1));
}

#[test]
fn a_local_answer_that_took_nothing_forgets_its_stream_and_one_after_a_call_does_not() {
    let rec = Recorder::default();
    let rt = runtime(&rec, CONFIG);
    let mut w = worker(&rt);
    let cx = Cx::new(&rt, 1_000, &rec);
    let mut next = 0;
    // Redis says the limit rejects for the next second: the over-limit cache learns it.
    let fx = request(&mut w, &cx, 1, "PUT", "/x");
    let fx = answer(
        &mut w,
        &cx,
        fx,
        &mut next,
        acquire().limit_over(0, 1_000, 1_000),
    );
    assert_eq!(fx.streams[0].reply.as_ref().map(|r| r.status), Some(429));
    assert!(
        w.guards(1),
        "answered after a call: its end still goes to the flow"
    );
    // The next request is rejected by the cache, with no call: nothing is left to do, and
    // its box goes back to the spares at once.
    let spare = w.spare.len();
    let fx = request(&mut w, &cx, 2, "PUT", "/x");
    assert_eq!(
        w.spare.len(),
        spare.max(1),
        "its box kept for the next stream"
    );
    assert_eq!(fx.streams[0].reply.as_ref().map(|r| r.status), Some(429));
    assert!(fx.streams[0].calls.is_empty() && fx.calls.is_empty());
    assert_eq!(rec.count("cg.over_limit_cache.hits"), 1);
    assert!(!w.guards(2), "forgotten at once");
    assert!(w
        .on_response_headers(&cx, 2, true, || panic!("not read"))
        .streams
        .is_empty());
    assert!(w.on_done(&cx, 2).calls.is_empty());
    // Request headers again on stream 1, answered from the cache: nothing of it is kept.
    let fx = request(&mut w, &cx, 1, "PUT", "/x");
    assert_eq!(fx.streams[0].reply.as_ref().map(|r| r.status), Some(429));
    assert!(!w.guards(1));
    // A path that reads more than one way is refused at once: nothing is kept either.
    let fx = w.on_ambiguous_path(&cx, 3, 1, None);
    assert_eq!(fx.streams[0].reply.as_ref().map(|r| r.status), Some(400));
    assert_eq!(fx.action, Action::Pause);
    assert!(!w.guards(3));
}

#[test]
fn a_forwarded_request_that_owes_nothing_is_forgotten_at_its_response_headers() {
    let rec = Recorder::default();
    let rt = runtime(&rec, CONFIG);
    let mut w = worker(&rt);
    let cx = Cx::new(&rt, 1_000, &rec);
    let mut next = 0;
    // Rate limits only: admitted by Redis, forwarded.
    let fx = request(&mut w, &cx, 1, "PUT", "/x");
    let fx = answer(&mut w, &cx, fx, &mut next, acquire().limit_ok(4, 1_000));
    assert_eq!(fx.streams[0].resume, Some(Dir::Request));
    assert!(
        w.guards(1),
        "its response still gets the rate-limit headers"
    );
    // What the adapter does: no clock read for it (the untimed context's time is 0).
    let untimed = Cx::new(&rt, 0, &rec);
    let fx = w
        .on_response_headers_untimed(&untimed, 1)
        .expect("its response only gets the headers");
    assert_eq!(fx.action, Action::Continue);
    let added: Vec<&str> = fx.streams[0]
        .add_response_headers
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(added, ["ratelimit-policy", "ratelimit"]);
    assert!(!w.guards(1), "forgotten once its headers are out");
    assert!(w.on_done(&cx, 1).calls.is_empty());
    // A request holding a lease is followed to its end, which gives the lease back.
    let fx = request(&mut w, &cx, 2, "POST", "/wait/9/a");
    let fx = answer(&mut w, &cx, fx, &mut next, acquire().lease_granted(17));
    assert_eq!(fx.streams[0].resume, Some(Dir::Request));
    assert!(
        w.on_response_headers_untimed(&untimed, 2).is_none(),
        "its response needs the timed event"
    );
    assert!(w.guards(2), "left for it");
    let fx = w.on_response_headers(&cx, 2, false, || ResponseHead {
        headers: vec![(":status".into(), "200".into())],
        details: "via_upstream".into(),
    });
    assert_eq!(
        fx.action,
        Action::Pause,
        "the response waits for the release"
    );
    assert!(w.guards(2));
}

/// A closed stream's box is emptied and taken by the next stream: whatever the closed one
/// left (a lease it held, a call in flight), the next behaves as on a worker whose streams all
/// got new boxes. The boxes kept are bounded.
#[test]
fn a_closed_streams_box_carries_nothing_to_the_next_stream() {
    let rec = Recorder::default();
    // Twins through the same events (so the same tokens and call tags drawn, each from a
    // runtime of its own); one keeps its boxes.
    let mut rts = [runtime(&rec, CONFIG), runtime(&rec, CONFIG)];
    for rt in &mut rts {
        rt.tags = CallTags::with_prefix(1);
    }
    let [cx, twin_cx] = [Cx::new(&rts[0], 1_000, &rec), Cx::new(&rts[1], 1_000, &rec)];
    let mut twins = [worker(&rts[0]), worker(&rts[1])];
    for (w, cx) in twins.iter_mut().zip([cx, twin_cx]) {
        let mut next = 0;
        // Their clients go away: stream 1 holding a lease, stream 2 admitted with its
        // rate-limit headers not yet added, stream 3 with its call in flight.
        let fx = request(w, &cx, 1, "GET", "/wait/r1");
        let fx = answer(w, &cx, fx, &mut next, acquire().lease_granted(7));
        assert_eq!(fx.action, Action::Continue, "{fx:?}");
        let fx = request(w, &cx, 2, "PUT", "/orders");
        let fx = answer(w, &cx, fx, &mut next, acquire().limit_ok(4, 1_000));
        assert_eq!(fx.streams[0].resume, Some(Dir::Request), "{fx:?}");
        let fx = request(w, &cx, 3, "PUT", "/orders");
        send_all(w, &cx, fx, &mut next);
        for s in 1..=3 {
            w.close(s);
            assert!(!w.guards(s));
        }
        assert_eq!(w.spare.len(), 3, "every box kept");
    }
    let [reusing, fresh] = &mut twins;
    fresh.spare.clear();
    // Streams 4 to 6 take their boxes.
    for (s, method, path) in [
        (4, "PUT", "/orders"),
        (5, "PUT", "/orders"),
        (6, "GET", "/wait/r1"),
    ] {
        let got = request(reusing, &cx, s, method, path);
        let expected = request(fresh, &twin_cx, s, method, path);
        assert_eq!(
            format!("{got:?}"),
            format!("{expected:?}"),
            "{method} {path}"
        );
        assert_eq!(
            format!("{:?}", reusing.streams.get(&s)),
            format!("{:?}", fresh.streams.get(&s)),
            "{method} {path}: the stream's state"
        );
    }
    assert!(reusing.spare.is_empty());
    // Boxes that ended with calls made, reused by a request answered before any call (a
    // lease without its resource): it owes nothing, so the worker forgets it at once.
    for w in [&mut *reusing, &mut *fresh] {
        for s in 4..=6 {
            w.close(s);
        }
    }
    fresh.spare.clear();
    let got = request(reusing, &cx, 7, "POST", "/wait");
    let expected = request(fresh, &twin_cx, 7, "POST", "/wait");
    assert!(got.streams[0].reply.is_some(), "{got:?}");
    assert_eq!(format!("{got:?}"), format!("{expected:?}"));
    assert!(!reusing.guards(7) && !fresh.guards(7));
    // However many streams close at once, the worker keeps a bounded number of boxes.
    for s in 100..300 {
        let _ = request(reusing, &cx, s, "PUT", "/orders");
    }
    for s in 100..300 {
        reusing.close(s);
    }
    assert_eq!(reusing.spare.len(), SPARE_ENTRIES);
}

/// Streams 1, 2 and 3 each with its acquire in flight: their tokens.
fn three_in_flight(w: &mut Worker<u32>, cx: &Cx<'_>, next: &mut u32) -> Vec<u32> {
    let mut tokens = Vec::new();
    for s in 1..=3 {
        let fx = request(w, cx, s, "GET", "/x");
        tokens.extend(send_all(w, cx, fx, next));
    }
    tokens
}

#[test]
fn a_stream_closes_without_touching_other_streams_calls() {
    let rec = Recorder::default();
    let rt = runtime(&rec, CONFIG);
    let cx = Cx::new(&rt, 1_000, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    let tokens = three_in_flight(&mut w, &cx, &mut next);
    assert_eq!(w.routes.len(), 3);
    // Answered, then closed: nothing of its own is left to forget.
    let fx = reply_to(&mut w, &cx, tokens[0], acquire().limit_ok(4, 1_000).reply());
    assert_eq!(fx.streams[0].resume, Some(Dir::Request));
    // Its deadline went with its call; the others still wait on theirs.
    assert_eq!(w.waiting.iter().copied().collect::<Vec<_>>(), [2, 3]);
    w.close(1);
    assert_eq!(w.routes.len(), 2);
    // Closed with its call in flight: that call's route goes, the late answer is not read.
    w.close(2);
    assert_eq!(w.routes.len(), 1);
    assert!(w.on_answer(&cx, tokens[1], unread).streams.is_empty());
    let fx = reply_to(&mut w, &cx, tokens[2], acquire().limit_ok(4, 1_000).reply());
    assert_eq!(fx.streams[0].stream, 3);
    assert_eq!(fx.streams[0].resume, Some(Dir::Request));
    w.close(3);
    // A stream on a closed one's box forgets the call it closes in the middle of, too.
    let fx = request(&mut w, &cx, 4, "GET", "/x");
    let late = send_all(&mut w, &cx, fx, &mut next);
    w.close(4);
    assert!(w.routes.is_empty());
    assert!(w.on_answer(&cx, late[0], unread).streams.is_empty());
}

#[test]
fn a_stream_forgets_the_calls_it_resent_and_only_those() {
    let rec = Recorder::default();
    let rt = runtime(&rec, CONFIG);
    let cx = Cx::new(&rt, 1_000, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    let tokens = three_in_flight(&mut w, &cx, &mut next);
    // Stream 2's call answered NOSCRIPT: its EVAL goes out under a new token.
    let noscript = noscript();
    let fx = reply_to(&mut w, &cx, tokens[1], noscript);
    let again = send_all(&mut w, &cx, fx, &mut next);
    assert_eq!(again.len(), 1, "the EVAL");
    assert_eq!(w.routes.len(), 3);
    // Closed with the EVAL in flight: that route goes, by its token; the others stay.
    w.close(2);
    assert_eq!(w.routes.len(), 2);
    assert!(!w.routes.contains_key(&again[0]));
    assert!(w.on_answer(&cx, again[0], unread).streams.is_empty());
    for (s, token) in [(1, tokens[0]), (3, tokens[2])] {
        let fx = reply_to(&mut w, &cx, token, acquire().limit_ok(4, 1_000).reply());
        assert_eq!(fx.streams[0].stream, s);
        assert_eq!(fx.streams[0].resume, Some(Dir::Request));
    }
    assert!(w.routes.is_empty());
}

#[test]
fn the_roots_settlements_due_together_share_a_batch() {
    let rec = Recorder::default();
    let config = r#"{"redis": {"cluster": "gw", "timeout": "50ms", "key_prefix": "cg"},
      "policies": [{"name": "run", "rate_limits": [
        {"name": "inflight", "by": ["tenant"], "algorithm": "concurrency", "limit": 2, "window": "1s"}]}]}"#;
    let rt = runtime(&rec, config);
    let mut w = worker(&rt);
    let cx = Cx::new(&rt, 0, &rec);
    let mut next = 0;
    for s in [1, 2] {
        request(&mut w, &cx, s, "POST", "/run");
    }
    let fx = w.on_queue_ready(&cx);
    assert_eq!(
        fx.calls.len(),
        1,
        "both acquires in one batch (one hash tag: no probe)"
    );
    let tokens = send_all(&mut w, &cx, fx, &mut next);
    let admitted = acquire().limit_ok(1, 1_000);
    let both = batch([admitted.clone(), admitted]);
    let fx = reply_to(&mut w, &cx, tokens[0], both);
    assert_both_resumed(&fx);
    // Both streams end in the same turn: their slots' releases go out in one batch call.
    for s in [1, 2] {
        event_stream(&mut w, &cx, s);
    }
    assert!(w.on_done(&cx, 1).wake);
    assert!(w.on_done(&cx, 2).calls.is_empty());
    let fx = w.on_queue_ready(&cx);
    assert_eq!(fx.calls.len(), 1, "both releases in one batch");
    let body = String::from_utf8_lossy(&fx.calls[0].body).into_owned();
    assert!(body.starts_with("EVALSHA/"), "{body}");
    assert!(
        body.contains(&rt.scripts.batch.sha1),
        "batch.lua, not slot_release.lua"
    );
    let tokens = send_all(&mut w, &cx, fx, &mut next);
    // Each sub-call's integer reply comes back as -2 then the value (webdis 0.1.9: a string).
    let released = batch([settled(), settled()]);
    let fx = reply_to(&mut w, &cx, tokens[0], released);
    assert!(fx.calls.is_empty(), "nothing sent again");
    assert_eq!(rec.count("cg.redis.errors"), 0);
    let later = w.on_tick(&Cx::new(&rt, 10_000, &rec));
    assert!(later.calls.is_empty(), "both settled: no retry");
    assert_eq!(
        rec.count("cg.redis.calls"),
        2,
        "one acquire batch, one release batch"
    );
}

/// A policy whose rate limit and lease share the tenant's script call, batched.
const GONE: &str = r#"{
  "redis": {"cluster": "gw", "timeout": "50ms", "key_prefix": "cg", "batch": {"max_delay": "1ms"}},
  "policies": [
    {"name": "orders", "match": {"path_prefix": "/orders"}, "rate_limits": [
      {"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1, "window": "10s"}],
     "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "10s"}}
  ]
}"#;

/// Stream `s` asks for `path`; its acquire goes out in a batch; then its client leaves and the
/// host deletes its context. The batch's token.
fn asked_then_gone(w: &mut Worker<u32>, cx: &Cx<'_>, s: u32, path: &str, next: &mut u32) -> u32 {
    request(w, cx, s, "POST", path);
    let fx = w.on_queue_ready(cx);
    let tokens = send_all(w, cx, fx, next);
    assert_eq!(tokens.len(), 1);
    let fx = w.on_done(cx, s);
    assert!(
        fx.streams.is_empty() && fx.calls.is_empty() && !fx.wake,
        "nothing given back before the answer says what was taken"
    );
    w.close(s);
    assert!(w.guards(s), "kept to read the answer");
    tokens[0]
}

#[test]
fn a_rejection_answered_after_the_client_left_feeds_the_over_limit_cache() {
    let rec = Recorder::default();
    let rt = runtime(&rec, GONE);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    let token = asked_then_gone(&mut w, &cx, 1, "/orders/1", &mut next);
    // Rejected until 9 s from now; the lease skipped (a rejected request takes none).
    let rejected = acquire().limit_over(0, 9_000, 9_000).lease_skipped();
    let fx = reply_to(&mut w, &cx, token, batch([rejected]));
    assert!(fx.streams.is_empty(), "nothing reaches the gone stream");
    assert!(
        fx.calls.is_empty() && !fx.wake,
        "nothing taken: nothing given back"
    );
    assert!(!w.guards(1), "forgotten once answered");
    assert_eq!(rec.count("cg.policy.orders.limit.tenant.rejected"), 1);
    // The tenant's next request is answered from the over-limit cache, without a call.
    let fx = request(&mut w, &Cx::new(&rt, 10, &rec), 2, "POST", "/orders/2");
    assert_eq!(fx.streams[0].reply.as_ref().map(|r| r.status), Some(429));
    assert!(!fx.wake && fx.calls.is_empty());
    assert_eq!(rec.count("cg.over_limit_cache.hits"), 1);
    assert_eq!(rec.count("cg.redis.calls"), 1, "the first acquire only");
}

#[test]
fn what_an_answer_after_the_client_left_took_goes_back_without_a_marker() {
    let rec = Recorder::default();
    let rt = runtime(&rec, GONE);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    let token = asked_then_gone(&mut w, &cx, 1, "/orders/1", &mut next);
    // Admitted, lease acquired (token 42): the request will never run, so it goes back.
    let leased = acquire().limit_ok(0, 10_000).lease_granted(42);
    let fx = reply_to(&mut w, &cx, token, batch([leased]));
    assert!(fx.streams.is_empty(), "nothing reaches the gone stream");
    assert!(fx.wake, "the release goes out from the root at once");
    assert!(!w.guards(1));
    let fx = w.on_queue_ready(&cx);
    assert_eq!(fx.calls.len(), 1);
    let body = String::from_utf8_lossy(&fx.calls[0].body).into_owned();
    assert!(
        !body.contains("%3Acancel%3A") && !body.contains(":cancel:"),
        "the answer came: no marker is needed ({body})"
    );
    let tokens = send_all(&mut w, &cx, fx, &mut next);
    let released = batch([settled()]);
    assert!(reply_to(&mut w, &cx, tokens[0], released).calls.is_empty());
    // Undoing an acquire the request never used: not a lease acquired, nor released.
    assert_eq!(rec.count("cg.policy.orders.lease.acquired"), 0);
    assert_eq!(rec.count("cg.policy.orders.lease.released"), 0);
    assert_eq!(rec.count("cg.policy.orders.limit.tenant.allowed"), 1);
}

#[test]
fn an_acquire_unanswered_after_the_client_left_is_compensated_at_its_deadline() {
    let rec = Recorder::default();
    let rt = runtime(&rec, GONE);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    let token = asked_then_gone(&mut w, &cx, 1, "/orders/1", &mut next);
    let fx = w.on_tick(&Cx::new(&rt, 49, &rec));
    assert!(
        fx.calls.is_empty() && w.guards(1),
        "waits until the Redis timeout"
    );
    let fx = w.on_tick(&Cx::new(&rt, 50, &rec));
    assert_eq!(fx.calls.len(), 1, "the compensation");
    let body = String::from_utf8_lossy(&fx.calls[0].body).into_owned();
    assert!(
        body.contains("%3Acancel%3A") || body.contains(":cancel:"),
        "{body}"
    );
    assert!(fx.streams.is_empty());
    assert!(!w.guards(1));
    assert_eq!(rec.count("cg.redis.timeouts"), 1);
    let leased = acquire().limit_ok(0, 10_000).lease_granted(42);
    let late = reply_to(&mut w, &cx, token, batch([leased]));
    assert!(
        late.streams.is_empty() && late.calls.is_empty() && !late.wake,
        "the late answer goes nowhere (the marker already undid it)"
    );
}

#[test]
fn a_later_round_is_never_sent_for_a_client_that_left() {
    // A limit in the policy's slot goes first; the tenant's limit and the lease follow only
    // if it admits. The client leaves during the first round: no lease is asked for.
    let config = GONE.replace(
        r#""limit": 1, "window": "10s"}]"#,
        r#""limit": 1, "window": "10s"},
        {"name": "all", "by": [], "algorithm": "fixed_window", "limit": 100, "window": "10s"}]"#,
    );
    let rec = Recorder::default();
    let rt = runtime(&rec, &config);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    let token = asked_then_gone(&mut w, &cx, 1, "/orders/1", &mut next);
    let fx = reply_to(&mut w, &cx, token, batch([acquire().limit_ok(99, 10_000)]));
    assert!(fx.streams.is_empty() && !fx.wake);
    assert!(w.on_queue_ready(&cx).calls.is_empty(), "no second round");
    assert!(!w.guards(1));
    assert_eq!(rec.count("cg.redis.calls"), 1);
}

#[test]
fn without_batches_a_stream_ending_mid_acquire_gives_back_at_once() {
    // Its own call ends with its context: no answer will come to wait for.
    let config = GONE.replace(r#""batch": {"max_delay": "1ms"}"#, r#""batch": false"#);
    let rec = Recorder::default();
    let rt = runtime(&rec, &config);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    let fx = request(&mut w, &cx, 1, "POST", "/orders/1");
    send_all(&mut w, &cx, fx, &mut next);
    assert!(w.on_done(&cx, 1).wake, "the compensation goes out at once");
    assert!(!w.guards(1));
    let fx = w.on_queue_ready(&cx);
    let body = String::from_utf8_lossy(&fx.calls[0].body).into_owned();
    assert!(
        body.contains("%3Acancel%3A") || body.contains(":cancel:"),
        "{body}"
    );
}

#[test]
fn the_streams_kept_after_their_end_are_bounded() {
    let rec = Recorder::default();
    let rt = runtime(&rec, GONE);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let n = u32::try_from(MAX_DETACHED).unwrap_or(u32::MAX) + 1;
    for s in 1..=n {
        request(&mut w, &cx, s, "POST", &format!("/orders/{s}"));
    }
    let _ = w.on_queue_ready(&cx);
    for s in 1..n {
        assert!(!w.on_done(&cx, s).wake, "kept to read its answer");
    }
    assert!(
        w.on_done(&cx, n).wake,
        "past the bound: compensated at once"
    );
    assert!(!w.guards(n));
    assert!(w.guards(n - 1));
}

#[test]
fn a_lease_poll_answered_after_the_client_left_gives_the_lease_back() {
    // The lease was busy and the request waits (`on_busy: wait`); its client leaves while a
    // poll is in flight, and the poll takes the lease: it goes back at once, uncounted.
    let config = GONE.replace(r#""ttl": "10s"}"#, r#""ttl": "10s", "on_busy": "wait"}"#);
    let rec = Recorder::default();
    let rt = runtime(&rec, &config);
    let cx = Cx::new(&rt, 0, &rec);
    let mut w = worker(&rt);
    let mut next = 0;
    request(&mut w, &cx, 1, "POST", "/orders/1");
    let fx = w.on_queue_ready(&cx);
    let tokens = send_all(&mut w, &cx, fx, &mut next);
    let busy = batch([acquire().limit_ok(0, 10_000).lease_busy(800)]);
    let fx = reply_to(&mut w, &cx, tokens[0], busy);
    assert!(fx.streams.is_empty(), "waits for the lease");
    // The poll goes out on the tick when it is due, in a batch.
    let mut now = 0;
    let poll = loop {
        now += 5;
        let fx = w.on_tick(&Cx::new(&rt, now, &rec));
        let fx = if fx.calls.is_empty() {
            w.on_queue_ready(&Cx::new(&rt, now, &rec))
        } else {
            fx
        };
        if !fx.calls.is_empty() {
            break send_all(&mut w, &cx, fx, &mut next)[0];
        }
        assert!(now < 1_000, "never polled");
    };
    let at = Cx::new(&rt, now, &rec);
    assert!(!w.on_done(&at, 1).wake, "kept to read the poll's answer");
    let fx = reply_to(&mut w, &at, poll, batch([acquire().lease_granted(9)]));
    assert!(fx.streams.is_empty());
    assert!(fx.wake, "the lease goes back from the root");
    assert!(!w.guards(1));
    let fx = w.on_queue_ready(&at);
    let body = String::from_utf8_lossy(&fx.calls[0].body).into_owned();
    assert!(
        !body.contains("%3Acancel%3A") && !body.contains(":cancel:"),
        "{body}"
    );
    assert_eq!(rec.count("cg.policy.orders.lease.acquired"), 0);
}

#[test]
fn a_gone_streams_call_that_provably_did_not_run_leaves_nothing_to_give_back() {
    // The acquire's batch is refused by the gateway (webdis' own 503: no Redis): nothing ran,
    // so nothing is released and no marker written; a Redis error may have run: the marker.
    for (answer, compensated) in [
        (Err(CallError::Gateway(503)), false),
        (Err(CallError::Timeout), true),
        (Ok(Reply::Error("ERR boom".into())), true),
    ] {
        let rec = Recorder::default();
        let rt = runtime(&rec, GONE);
        let cx = Cx::new(&rt, 0, &rec);
        let mut w = worker(&rt);
        let mut next = 0;
        let token = asked_then_gone(&mut w, &cx, 1, "/orders/1", &mut next);
        let fx = w.on_answer(&cx, token, || answer.clone());
        assert!(fx.streams.is_empty());
        assert!(!w.guards(1), "{answer:?}: forgotten");
        let out = w.on_queue_ready(&cx);
        assert_eq!(out.calls.len(), usize::from(compensated), "{answer:?}");
        if compensated {
            let body = String::from_utf8_lossy(&out.calls[0].body).into_owned();
            assert!(
                body.contains("%3Acancel%3A") || body.contains(":cancel:"),
                "{body}"
            );
        }
    }
}

/// Every answer of the filter's own goes to the host with `x-envoy-ratelimited: true`, once
/// (`local_reply::wire_headers`): a caller's Envoy retries none of them. Nothing the filter
/// adds to a request it forwards, or to the service's response to it, carries it: a service's
/// own `503` is retried as the mesh retries any.
#[test]
fn every_local_answer_says_do_not_retry_and_no_forwarded_response_does() {
    use crate::http::local_reply::{wire_headers, NO_RETRY};
    let rec = Recorder::default();
    let rt = runtime(&rec, CONFIG);
    let mut w = worker(&rt);
    let cx = Cx::new(&rt, 1_000, &rec);
    let mut next = 0;
    let answered = |fx: &Effects<u32>, status: u32, grpc: bool| {
        let reply = fx.streams[0].reply.as_ref().expect("a local answer");
        assert_eq!(reply.status, status, "{reply:?}");
        assert_eq!(reply.grpc_status.is_some(), grpc, "{reply:?}");
        let wire = wire_headers(reply);
        let ours = wire.iter().filter(|(n, _)| *n == NO_RETRY.0).count();
        assert_eq!(ours, 1, "{wire:?}");
        assert!(wire.contains(&NO_RETRY), "{wire:?}");
    };
    let none_added = |headers: &[(String, String)]| {
        assert!(
            !headers
                .iter()
                .any(|(n, _)| n.eq_ignore_ascii_case(NO_RETRY.0)),
            "{headers:?}"
        );
    };
    // Redis rejects: 429; the next request is rejected by the over-limit cache, with no call.
    let fx = request(&mut w, &cx, 1, "PUT", "/x");
    let fx = answer(
        &mut w,
        &cx,
        fx,
        &mut next,
        acquire().limit_over(0, 1_000, 1_000),
    );
    answered(&fx, 429, false);
    answered(&request(&mut w, &cx, 2, "PUT", "/x"), 429, false);
    // Past the cached wait, Redis is down (webdis answers 503): fail closed, to an HTTP
    // client and to a gRPC one (its gRPC form).
    let later = Cx::new(&rt, 3_000, &rec);
    let fx = request(&mut w, &later, 3, "PUT", "/x");
    let token = send_all(&mut w, &later, fx, &mut next)[0];
    answered(
        &w.on_answer(&later, token, || Err(CallError::Gateway(503))),
        503,
        false,
    );
    let grpc = test_support::request("PUT", "/cg.test.Orders/Create")
        .authority("api")
        .tenant("acme")
        .content_type("application/grpc")
        .build();
    let fx = w.on_request_headers(&later, 4, 1, grpc, true);
    let token = send_all(&mut w, &later, fx, &mut next)[0];
    answered(
        &w.on_answer(&later, token, || Err(CallError::Gateway(503))),
        503,
        true,
    );
    // Input refused before any call: 400.
    answered(&w.on_ambiguous_path(&later, 5, 1, None), 400, false);
    // Admitted and forwarded: neither the request's headers nor the response's get it, a
    // service's 503 included.
    let fx = request(&mut w, &later, 6, "PUT", "/x");
    let fx = answer(&mut w, &later, fx, &mut next, acquire().limit_ok(3, 1_000));
    assert_eq!(fx.streams[0].resume, Some(Dir::Request));
    assert!(fx.streams[0].reply.is_none());
    none_added(&fx.streams[0].set_request_headers);
    let fx = w.on_response_headers(&later, 6, false, || ResponseHead {
        headers: vec![(":status".into(), "503".into())],
        details: "via_upstream".into(),
    });
    assert!(fx.streams[0].reply.is_none());
    assert_eq!(
        fx.streams[0].add_response_headers.len(),
        2,
        "the RateLimit headers"
    );
    none_added(&fx.streams[0].add_response_headers);
    // Failed open (Redis down, `reads` fails open): forwarded, and its response is untouched.
    let fx = request(&mut w, &later, 7, "GET", "/x");
    let token = send_all(&mut w, &later, fx, &mut next)[0];
    let fx = w.on_answer(&later, token, || Err(CallError::Gateway(503)));
    assert_eq!(fx.streams[0].resume, Some(Dir::Request));
    assert!(fx.streams[0].reply.is_none());
    let fx = w.on_response_headers(&later, 7, false, || ResponseHead {
        headers: vec![(":status".into(), "503".into())],
        details: "via_upstream".into(),
    });
    assert!(fx.streams.iter().all(|o| o.reply.is_none()));
    fx.streams
        .iter()
        .for_each(|o| none_added(&o.add_response_headers));
}
