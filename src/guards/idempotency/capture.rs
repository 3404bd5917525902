//! The response side of an owned idempotency record: what the response's headers, body and
//! trailers mean for it (store, release, or unknown), and the response assembled for storing:
//! copied as it passes (never held in Envoy's buffer, whose limit would turn a large read into
//! Envoy's own 500; with `complete: sync` only the response's end waits for the record), or
//! streamed untouched (too large, `replay: reference`, an event stream) with a reference stored
//! at its end.

use crate::config::{Completion, Idempotency, Replay};
use crate::http::grpc;
use crate::support::memory::Budget;
use crate::support::text;

/// The response being stored.
#[derive(Debug, Default)]
pub(crate) struct Assembly {
    pub status: u32,
    pub(crate) headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The body is not stored (larger than `max_response_body`): a reference record.
    pub(crate) too_large: bool,
    /// The response's `content-length`, if it declared one.
    declared: Option<u64>,
    /// Bytes of the response body let through so far while it streams.
    passed: u64,
    /// The trailers stored with the response (gRPC status, `replay_trailers`).
    pub(crate) trailers: Vec<(String, String)>,
    /// The worker's memory budget could not hold the body: stored by reference (counted once).
    over_budget: bool,
}

/// How the response body is taken in for the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyIntake {
    /// Copied as it passes.
    Copy,
    /// Passes untouched; a reference record is stored once its end of stream is seen.
    Stream,
}

/// What the record does at a piece of the response.
#[derive(Debug)]
pub(crate) enum RecordAction {
    /// Nothing for the record (not ours, or not yet decided).
    Pass,
    /// Store the assembled response as `COMPLETED` now.
    Complete,
    /// Release the record now (a retry may run the operation again).
    Release,
    /// Take the body in this way.
    Take(BodyIntake),
    /// The outcome is unknown: the record stays `PROCESSING` until its TTL.
    Unknown,
}

/// What the response's headers say, as the record's decision needs it.
#[derive(Clone, Copy)]
pub(crate) struct ResponseView<'a> {
    pub status: u32,
    pub(crate) via_upstream: bool,
    pub(crate) details: &'a str,
    pub(crate) headers: &'a [(String, String)],
    pub(crate) end_of_stream: bool,
    pub(crate) shape: Shape,
}

/// What kind of stream a response is, as far as the guards care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// A response that ends (its body, however large, has an end the filter waits for).
    Plain,
    /// An accepted upgrade (`101 Switching Protocols`, e.g. WebSocket) or a `CONNECT` tunnel
    /// (`2xx`): a session in another protocol, open until either side closes it.
    Tunnel,
    /// A response whose body is a stream of events that may never end (`text/event-stream`,
    /// `multipart/x-mixed-replace`).
    EventStream,
}

/// Envoy's `response.code_details` for local replies where the request never reached an
/// upstream, so a retry cannot repeat a side effect: the record is released.
pub(crate) const NEVER_SENT: &[&str] = &[
    "no_healthy_upstream",
    "cluster_not_found",
    "route_not_found",
    "connection_failure",
    "upstream_reset_before_response_started{connection_failure",
    "overflow",
    "maintenance_mode",
    "request_payload_too_large",
    "direct_response",
];

/// Media types of responses that stream for as long as the producer likes.
const EVENT_STREAM_TYPES: &[&str] = &["text/event-stream", "multipart/x-mixed-replace"];

impl Assembly {
    /// The response's headers: release, store, or take the body in first.
    pub(crate) fn on_response_headers(
        &mut self,
        cfg: &Idempotency,
        head: &ResponseView<'_>,
        grpc: bool,
    ) -> RecordAction {
        if !head.via_upstream {
            if NEVER_SENT.iter().any(|d| head.details.contains(d)) {
                return RecordAction::Release;
            }
            // Timed out or reset after it was sent: the outcome is unknown, keep PROCESSING.
            return RecordAction::Unknown;
        }
        let headers = head.headers;
        // A gRPC call's outcome is its grpc-status: in the headers of a trailers-only answer,
        // else in the trailers, so the decision waits for them.
        let trailers_only = if grpc { grpc::status_of(headers) } else { None };
        let awaits_trailers = grpc && trailers_only.is_none() && !head.end_of_stream;
        let retry = match trailers_only {
            Some(code) => cfg.retryable_grpc(code),
            None => cfg.retryable(head.status),
        };
        // A switched protocol or a tunnel is a session, not a response that could be
        // replayed: the record is released (counted `released`) and the 101 goes on.
        if retry || head.shape == Shape::Tunnel {
            return RecordAction::Release;
        }
        self.keep_head(cfg, head, trailers_only.is_some(), awaits_trailers);
        let needs_body = cfg.replay == Replay::Full && !head.end_of_stream;
        // No body to store (`replay: reference`) while the status waits in the trailers; or
        // never buffered: the body streams and the reference is stored at its end, never
        // before (a response that does not end is never stored as completed). An event
        // stream's events are not stored: they pass as they are produced.
        if (awaits_trailers && !needs_body) || self.too_large || head.shape == Shape::EventStream {
            self.too_large = true;
            return RecordAction::Take(BodyIntake::Stream);
        }
        if needs_body {
            return RecordAction::Take(BodyIntake::Copy);
        }
        RecordAction::Complete
    }

    /// Keeps what the record stores of the response's head: status, replay headers, a
    /// trailers-only answer's trailers, whether the body is too large to store, and the
    /// length it declares (unless the decision waits for the trailers, as a gRPC one does).
    fn keep_head(
        &mut self,
        cfg: &Idempotency,
        head: &ResponseView<'_>,
        trailers_only: bool,
        awaits_trailers: bool,
    ) {
        let headers = head.headers;
        self.status = head.status;
        self.headers = headers
            .iter()
            .filter(|(n, _)| cfg.replay_headers.iter().any(|h| h == n))
            .cloned()
            .collect();
        self.trailers = if trailers_only {
            kept_trailers(cfg, headers)
        } else {
            Vec::new()
        };
        self.too_large = streams_body(cfg, headers, head.end_of_stream);
        // A gRPC response is decided at its trailers, never at its last declared byte.
        self.declared = if awaits_trailers {
            None
        } else {
            content_length(headers)
        };
    }

    /// Whether a piece of `body_size` bytes is copied for the record (in `intake`): it is
    /// within `max_response_body`, and the memory budget can hold the piece read and the room
    /// the body grows by.
    pub(crate) fn takes(
        &self,
        cfg: &Idempotency,
        intake: BodyIntake,
        body_size: usize,
        memory: &Budget,
    ) -> bool {
        let cap = usize::try_from(cfg.max_response_body).unwrap_or(usize::MAX);
        let room = crate::support::memory::growth(&self.body, body_size, cap);
        let held = if room == 0 {
            // Room taken already (the declared length): only the piece's brief copy.
            memory.admits_brief(body_size)
        } else {
            memory.admits(body_size.saturating_add(room))
        };
        self.fits(cfg, intake, body_size) && held
    }

    /// Whether a piece of `body_size` bytes is within `max_response_body` (in `intake`).
    fn fits(&self, cfg: &Idempotency, intake: BodyIntake, body_size: usize) -> bool {
        intake == BodyIntake::Copy
            && (self.body.len().saturating_add(body_size)) as u64 <= cfg.max_response_body
    }

    /// A piece of the response body (`body_size`: this chunk; `piece` is it, read if
    /// [`Assembly::takes`] it, `None` if it could not be read). A body over
    /// `max_response_body`, or one the worker's memory budget cannot hold (`memory`), is not
    /// taken in any further: it streams, and a reference record is stored when its end is seen.
    pub(crate) fn on_response_body(
        &mut self,
        cfg: &Idempotency,
        intake: BodyIntake,
        body_size: usize,
        end_of_stream: bool,
        piece: Option<&[u8]>,
        memory: &Budget,
    ) -> RecordAction {
        match intake {
            BodyIntake::Copy => {
                let fits = self.fits(cfg, intake, body_size);
                let kept = fits && piece.is_some_and(|p| self.keep(cfg, p, memory));
                if !kept {
                    // Too large to store, or to hold: stored by reference once the body has
                    // ended.
                    self.over_budget = fits;
                    self.too_large = true;
                    self.body = Vec::new();
                }
                match self.stream(cfg, body_size, end_of_stream) {
                    RecordAction::Pass if !kept => RecordAction::Take(BodyIntake::Stream),
                    settle => settle,
                }
            }
            BodyIntake::Stream => self.stream(cfg, body_size, end_of_stream),
        }
    }

    /// Appends `piece` to the body within the memory budget (the first piece of a body whose
    /// length is declared takes room for all of it at once); whether it could.
    fn keep(&mut self, cfg: &Idempotency, piece: &[u8], memory: &Budget) -> bool {
        let cap = usize::try_from(cfg.max_response_body).unwrap_or(usize::MAX);
        if self.body.capacity() == 0 {
            if let Some(n) = self.declared.and_then(|n| usize::try_from(n).ok()) {
                // Within max_response_body (a larger one is never copied).
                memory.reserve(&mut self.body, n.min(cap));
            }
        }
        memory.append(&mut self.body, piece, cap)
    }

    /// The body was dropped because the worker's memory budget could not hold it (once).
    pub(crate) fn take_over_budget(&mut self) -> bool {
        std::mem::take(&mut self.over_budget)
    }

    /// Drops the body if writing the record with it would take the worker past its memory
    /// budget (`sealed`: with encryption): the record is then stored by reference. Whether
    /// it did.
    pub(crate) fn drop_body_over_budget(&mut self, sealed: bool, memory: &Budget) -> bool {
        if self.too_large || self.body.is_empty() {
            return false;
        }
        let need = crate::guards::idempotency::record::completion_need(&self.body, sealed);
        if memory.admits_brief(need) {
            return false;
        }
        self.too_large = true;
        self.body = Vec::new();
        true
    }

    /// A piece of the response body passes (`body_size` bytes more). The response is stored
    /// at its end: the end of stream, or the last byte its `content-length` declared
    /// (with sync completion that piece waits for the record, so the client cannot see the
    /// whole response before it is written; the host's empty end of stream may come later).
    fn stream(&mut self, cfg: &Idempotency, body_size: usize, end_of_stream: bool) -> RecordAction {
        let s = self;
        s.passed = s.passed.saturating_add(body_size as u64);
        let complete = s.declared.is_some_and(|n| s.passed >= n);
        if end_of_stream || (cfg.complete == Completion::Sync && complete) {
            return RecordAction::Complete;
        }
        RecordAction::Pass
    }

    /// The response's trailers: its body has ended. A gRPC call is settled by the
    /// `grpc-status` in them (released when it is in `retryable_grpc_codes`), and the
    /// trailers that matter are stored.
    pub(crate) fn on_response_trailers(
        &mut self,
        cfg: &Idempotency,
        trailers: &[(String, String)],
        grpc: bool,
    ) -> RecordAction {
        let code = if grpc {
            grpc::status_of(trailers)
        } else {
            None
        };
        if code.is_some_and(|c| cfg.retryable_grpc(c)) {
            self.body = Vec::new();
            return RecordAction::Release;
        }
        self.trailers = kept_trailers(cfg, trailers);
        RecordAction::Complete
    }
}

/// What kind of stream the response is.
pub(crate) fn response_shape(
    status: u32,
    via_upstream: bool,
    connect: bool,
    headers: &[(String, String)],
    end_of_stream: bool,
) -> Shape {
    if !via_upstream {
        return Shape::Plain;
    }
    if status == 101 || (connect && (200..300).contains(&status)) {
        return Shape::Tunnel;
    }
    let event_stream = headers
        .iter()
        .filter(|(n, _)| n == "content-type")
        .any(|(_, v)| {
            let media = text::media_type(v);
            EVENT_STREAM_TYPES
                .iter()
                .any(|t| media.eq_ignore_ascii_case(t))
        });
    if event_stream && !end_of_stream {
        Shape::EventStream
    } else {
        Shape::Plain
    }
}

/// The response has a body the filter does not store, so it streams untouched and a reference
/// record is written at its end: `replay: reference`, or `content-length` says the body is
/// larger than `max_response_body`.
fn streams_body(cfg: &Idempotency, headers: &[(String, String)], end_of_stream: bool) -> bool {
    (cfg.replay == Replay::Reference && !end_of_stream)
        || declared_too_large(cfg, headers, end_of_stream)
}

/// The response says (`content-length`) that its body is larger than `max_response_body`:
/// it is never buffered. Only with `replay: full` (a reference record needs no body).
fn declared_too_large(
    cfg: &Idempotency,
    headers: &[(String, String)],
    end_of_stream: bool,
) -> bool {
    cfg.replay == Replay::Full
        && !end_of_stream
        && content_length(headers).is_some_and(|n| n > cfg.max_response_body)
}

/// The `content-length` of a response, when it has exactly one readable value.
fn content_length(headers: &[(String, String)]) -> Option<u64> {
    let mut values = headers.iter().filter(|(n, _)| n == "content-length");
    let (_, v) = values.next()?;
    if values.next().is_some() {
        return None;
    }
    v.trim().parse().ok()
}

/// The trailers of a response the record keeps: `grpc-status`, `grpc-message` and the
/// configured `replay_trailers`, in the order received.
fn kept_trailers(cfg: &Idempotency, trailers: &[(String, String)]) -> Vec<(String, String)> {
    trailers
        .iter()
        .filter(|(n, _)| {
            n == grpc::STATUS || n == grpc::MESSAGE || cfg.replay_trailers.iter().any(|t| t == n)
        })
        .cloned()
        .collect()
}
