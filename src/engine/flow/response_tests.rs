//! The response an idempotency record stores, through the flow: buffered, copied as it passes
//! or streamed and stored by reference, its end (body, trailers, or never), and the shapes
//! (upgrades, event streams) that are never stored whole.

use crate::config::Replay;
use crate::engine::flow::idempotency_tests::{forwarded, idem_runtime, orders_admitted};
use crate::engine::flow::test_support::*;
use crate::engine::flow::*;
use crate::guards::idempotency::capture::{response_shape, Shape};
use crate::http::request::Request;
use crate::redis::scripts::ScriptId;
use crate::support::metrics::testing::Recorder;
use crate::support::metrics::NoMetrics;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// A plain-text response's headers, declaring a body of `n` bytes.
fn cl(n: u64) -> Vec<(String, String)> {
    headers(&[
        ("content-type", "text/plain"),
        ("content-length", &n.to_string()),
    ])
}

/// The complete call of `out` stores a reference: status and replay headers, no body.
fn assert_reference(out: &[Outgoing]) {
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].script, ScriptId::Complete);
    let stored = &out[0].call.args[3];
    assert!(stored.contains("\"reference\":true"), "{stored}");
    assert!(!stored.contains("\"body"), "{stored}");
    assert!(stored.contains("\"status\":201"), "{stored}");
}

/// An upgrade (to a WebSocket, or a `CONNECT`) of tenant `acme`, with an Idempotency-Key.
pub(super) fn upgrade_req(method: &str, path: &str) -> Request {
    let req = request(method, path)
        .authority("api")
        .tenant("acme")
        .json()
        .idempotency_key("k-up");
    if method == "CONNECT" {
        return req.build();
    }
    req.header("connection", "upgrade")
        .header("upgrade", "websocket")
        .build()
}

#[test]
fn sync_response_declared_too_large_streams_and_holds_only_its_last_piece() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = forwarded(&rt, &rec);
    // content-length over max_response_body (64 KiB): never buffered, headers go on at once.
    let step = flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &cl(100_000),
        false,
    );
    assert_eq!(step.next, Move::Continue);
    assert_eq!(flow.deadline_ms(), None);
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 60_000, false, never_read)
            .next,
        Move::Continue
    );
    // The piece that reaches the declared length waits for the record.
    let out =
        dispatched(flow.on_response_body(&Cx::new(&rt, 6, &NoMetrics), 40_000, false, never_read));
    assert_reference(&out);
    assert_eq!(flow.deadline_ms(), Some(6 + 50));
    // The host's empty end of stream comes later and waits too.
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 7, &NoMetrics), 0, true, never_read)
            .next,
        Move::Wait
    );
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 8, &rec), out[0].slot, Ok(settled()))
            .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.policy.orders.idem.completed"), 1);
    let bg = flow.on_done(&Cx::new(&rt, 0, &rec));
    assert_eq!(rec.count("cg.policy.orders.idem.outcome_unknown"), 0);
    assert!(bg.is_empty());
}

#[test]
fn sync_response_copies_its_body_and_streams_past_max_response_body() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = forwarded(&rt, &rec);
    let chunked = headers(&[("content-type", "text/plain")]);
    assert_eq!(
        flow.on_response_headers(
            &Cx::new(&rt, 4, &rec),
            201,
            true,
            "via_upstream",
            &chunked,
            false
        )
        .next,
        Move::Continue,
        "never held in Envoy's buffer"
    );
    // Copied while it may fit (body_size is each piece) ...
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 30_000, false, || vec![
            b'a';
            30_000
        ])
        .next,
        Move::Continue
    );
    // ... then only counted once it cannot.
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 6, &NoMetrics), 40_000, false, never_read)
            .next,
        Move::Continue
    );
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 7, &NoMetrics), 16_384, false, never_read)
            .next,
        Move::Continue
    );
    // Its end: the last piece waits for the reference record.
    let out = dispatched(flow.on_response_body(&Cx::new(&rt, 8, &NoMetrics), 10, true, never_read));
    assert_reference(&out);
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 9, &rec), out[0].slot, Ok(settled()))
            .next,
        Move::Continue
    );
    assert_eq!(rec.count("cg.policy.orders.idem.completed"), 1);
}

#[test]
fn response_trailers_end_a_streaming_body() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = forwarded(&rt, &rec);
    let chunked = headers(&[("content-type", "text/plain")]);
    flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &chunked,
        false,
    );
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 70_000, false, never_read)
            .next,
        Move::Continue
    );
    let out = dispatched(flow.on_response_trailers(&Cx::new(&rt, 6, &NoMetrics), &[]));
    assert_reference(&out);
    // Trailers of a body that fits: it is stored whole.
    let mut flow = forwarded(&rt, &rec);
    flow.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &chunked,
        false,
    );
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 2, false, || b"ok".to_vec())
            .next,
        Move::Continue
    );
    let out = dispatched(flow.on_response_trailers(&Cx::new(&rt, 6, &NoMetrics), &[]));
    assert!(out[0].call.args[3].contains("\"body\":\"ok\""));
}

#[test]
fn a_response_that_never_ends_is_never_stored_completed() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    // Streaming (declared too large), still buffering, and async copying: the stream ends
    // (upstream reset) before the body's end of stream.
    let mut streaming = forwarded(&rt, &rec);
    streaming.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &cl(100_000),
        false,
    );
    assert_eq!(
        streaming
            .on_response_body(&Cx::new(&rt, 5, &NoMetrics), 60_000, false, never_read)
            .next,
        Move::Continue
    );
    let mut buffering = forwarded(&rt, &rec);
    buffering.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &[],
        false,
    );
    assert_eq!(
        buffering
            .on_response_body(&Cx::new(&rt, 5, &NoMetrics), 10, false, || vec![b'a'; 10])
            .next,
        Move::Continue
    );
    for mut flow in [streaming, buffering] {
        assert!(flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
    }
    assert_eq!(rec.count("cg.policy.orders.idem.outcome_unknown"), 2);
    assert_eq!(rec.count("cg.policy.orders.idem.completed"), 0);

    let mut copying = Flow::default();
    dispatched(copying.on_request(
        &Cx::new(&rt, 0, &rec),
        json_post("/async").idempotency_key("k").build(),
        "n",
        "o",
        true,
    ));
    let acquired = acquire().record_new().reply();
    assert_eq!(
        copying
            .on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(acquired))
            .next,
        Move::Continue
    );
    copying.on_response_headers(
        &Cx::new(&rt, 2, &rec),
        201,
        true,
        "via_upstream",
        &cl(100_000),
        false,
    );
    assert_eq!(
        copying
            .on_response_body(&Cx::new(&rt, 3, &NoMetrics), 50_000, false, never_read)
            .next,
        Move::Continue
    );
    assert!(
        copying.on_done(&Cx::new(&rt, 0, &rec)).is_empty(),
        "nothing completed"
    );
    assert_eq!(rec.count("cg.policy.async.idem.outcome_unknown"), 1);
}

#[test]
fn async_response_over_max_is_stored_by_reference_at_its_end() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let mut flow = Flow::default();
    dispatched(flow.on_request(
        &Cx::new(&rt, 0, &rec),
        json_post("/async").idempotency_key("k").build(),
        "n",
        "o",
        true,
    ));
    let acquired = acquire().record_new().reply();
    assert_eq!(
        flow.on_reply(&Cx::new(&rt, 1, &rec), 0, Ok(acquired)).next,
        Move::Continue
    );
    // No content-length: copied while it fits, then only counted.
    flow.on_response_headers(
        &Cx::new(&rt, 2, &rec),
        201,
        true,
        "via_upstream",
        &[],
        false,
    );
    let first = flow.on_response_body(&Cx::new(&rt, 3, &NoMetrics), 40_000, false, || {
        vec![b'a'; 40_000]
    });
    assert_eq!(first.next, Move::Continue);
    let second = flow.on_response_body(&Cx::new(&rt, 4, &NoMetrics), 40_000, false, never_read);
    assert_eq!(second.next, Move::Continue);
    // The declared length is not the end for async: the end of stream is.
    assert!(first.out.background.is_empty() && second.out.background.is_empty());
    let step = flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 40_000, true, never_read);
    assert_eq!(step.next, Move::Continue);
    let bg = step.out.background;
    assert_eq!(bg.len(), 1);
    assert_eq!(bg[0].purpose, Purpose::Complete);
    assert!(
        bg[0].call.args[3].contains("\"reference\":true"),
        "{}",
        &bg[0].call.args[3]
    );
    assert!(!bg[0].call.args[3].contains("aaaa"));
}

#[test]
fn response_shapes() {
    let sse = headers(&[("content-type", "Text/Event-Stream; charset=utf-8")]);
    let mjpeg = headers(&[("content-type", "multipart/x-mixed-replace; boundary=f")]);
    let json = headers(&[("content-type", "application/json")]);
    type Case<'a> = (u32, bool, bool, &'a [(String, String)], bool, Shape);
    let cases: &[Case] = &[
        (101, true, false, &[], false, Shape::Tunnel),
        (200, true, true, &[], false, Shape::Tunnel),
        (204, true, true, &[], true, Shape::Tunnel),
        (407, true, true, &[], false, Shape::Plain),
        (200, true, false, &[], false, Shape::Plain),
        (200, true, false, &sse, false, Shape::EventStream),
        (200, true, false, &mjpeg, false, Shape::EventStream),
        // Nothing follows the headers: it has ended.
        (200, true, false, &sse, true, Shape::Plain),
        (200, true, false, &json, false, Shape::Plain),
        // Envoy's own replies are never streams.
        (101, false, false, &[], false, Shape::Plain),
        (200, false, false, &sse, false, Shape::Plain),
    ];
    for (status, via, connect, h, eos, want) in cases {
        assert_eq!(
            response_shape(*status, *via, *connect, h, *eos),
            *want,
            "{status} via_upstream={via} connect={connect} {h:?} eos={eos}"
        );
    }
}

#[test]
fn an_upgrade_is_acquired_without_waiting_for_a_body_and_its_record_released_at_the_101() {
    for method in ["POST", "CONNECT"] {
        let rec = Recorder::default();
        let mut rt = idem_runtime(&rec);
        if let Some(i) = rt.config.policies[0].idempotency.as_mut() {
            i.methods.push("CONNECT".into());
        }
        let mut flow = Flow::default();
        // The fingerprint covers the body, but an upgrade's body is the new protocol: the
        // acquire goes out with the headers.
        let out = dispatched(flow.on_request(
            &Cx::new(&rt, 0, &rec),
            upgrade_req(method, "/orders/live"),
            "n",
            "o",
            false,
        ));
        assert_eq!(out.len(), 1, "{method}");
        assert_eq!(
            flow.on_reply(
                &Cx::new(&rt, 1, &rec),
                0,
                Ok(orders_admitted().record_new().reply())
            )
            .next,
            Move::Continue
        );
        let status = if method == "CONNECT" { 200 } else { 101 };
        let out = dispatched(flow.on_response_headers(
            &Cx::new(&rt, 2, &rec),
            status,
            true,
            "via_upstream",
            &[],
            false,
        ));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].script, ScriptId::Release, "{method}: never stored");
        assert_eq!(
            flow.on_reply(&Cx::new(&rt, 3, &rec), out[0].slot, Ok(settled()))
                .next,
            Move::Continue
        );
        assert_eq!(
            flow.on_response_body(&Cx::new(&rt, 4, &NoMetrics), 5, false, never_read)
                .next,
            Move::Continue
        );
        assert!(flow.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
        assert_eq!(rec.count("cg.policy.orders.idem.released"), 1);
        assert_eq!(rec.count("cg.policy.orders.idem.completed"), 0);
        assert_eq!(rec.count("cg.policy.orders.idem.outcome_unknown"), 0);
    }
}

#[test]
fn an_event_stream_is_never_buffered_and_stored_by_reference_once_it_ended() {
    let rec = Recorder::default();
    let rt = idem_runtime(&rec);
    let sse = headers(&[("content-type", "text/event-stream")]);
    let mut flow = forwarded(&rt, &rec);
    assert_eq!(
        flow.on_response_headers(
            &Cx::new(&rt, 4, &rec),
            201,
            true,
            "via_upstream",
            &sse,
            false
        )
        .next,
        Move::Continue
    );
    for t in 5..8 {
        assert_eq!(
            flow.on_response_body(&Cx::new(&rt, t, &NoMetrics), 100_000, false, never_read)
                .next,
            Move::Continue,
            "events pass as they come"
        );
    }
    assert_reference(&dispatched(flow.on_response_body(
        &Cx::new(&rt, 9, &NoMetrics),
        0,
        true,
        never_read,
    )));
    // One that never ends (the client leaves): the outcome is unknown, nothing is stored.
    let mut endless = forwarded(&rt, &rec);
    endless.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &sse,
        false,
    );
    endless.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 10, false, never_read);
    assert!(endless.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
    assert_eq!(rec.count("cg.policy.orders.idem.outcome_unknown"), 1);
}

#[test]
fn replay_reference_is_stored_only_once_the_body_ended() {
    let rec = Recorder::default();
    let mut rt = idem_runtime(&rec);
    if let Some(i) = rt.config.policies[0].idempotency.as_mut() {
        i.replay = Replay::Reference;
    }
    // Sync: the body passes untouched; the piece that completes it waits for the record.
    let mut flow = forwarded(&rt, &rec);
    assert_eq!(
        flow.on_response_headers(
            &Cx::new(&rt, 4, &rec),
            201,
            true,
            "via_upstream",
            &cl(100),
            false
        )
        .next,
        Move::Continue
    );
    assert_eq!(
        flow.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 60, false, never_read)
            .next,
        Move::Continue
    );
    assert_reference(&dispatched(flow.on_response_body(
        &Cx::new(&rt, 6, &NoMetrics),
        40,
        false,
        never_read,
    )));
    // Reset before its end: never stored.
    let mut reset = forwarded(&rt, &rec);
    reset.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &cl(100),
        false,
    );
    reset.on_response_body(&Cx::new(&rt, 5, &NoMetrics), 60, false, never_read);
    assert!(reset.on_done(&Cx::new(&rt, 0, &rec)).is_empty());
    assert_eq!(rec.count("cg.policy.orders.idem.outcome_unknown"), 1);
    // A response without a body is complete at its headers.
    let mut empty = forwarded(&rt, &rec);
    assert_reference(&dispatched(empty.on_response_headers(
        &Cx::new(&rt, 4, &rec),
        201,
        true,
        "via_upstream",
        &[],
        true,
    )));
}
