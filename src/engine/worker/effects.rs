//! What the adapter must do after an event, as data: the answer to the host callback, what to
//! do on each stream the event moved (its decision to record among it), the calls to send (with where their answers go), the
//! root's tick and its wake-up. The adapter carries these out in order and does nothing else.

use crate::http::local_reply::LocalResponse;
use crate::redis::scripts::batch::InFlight;
use crate::redis::tag::CallTag;
use std::rc::Rc;

/// A direction of a stream, as the host pauses and resumes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Request,
    Response,
}

/// The answer to the host callback that raised the event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

/// Where the answer of a call goes.
#[derive(Debug)]
pub(super) enum Dest<S> {
    /// A stream's call, in its flow's `slot`.
    Stream(S, usize),
    /// The root's call in the outbox's `slot`.
    Outbox(usize),
    /// A batch: several streams' acquires, or the root's settlements.
    Batch(InFlight<Dest<S>>),
}

/// Where a call's answer goes, and the tag the call was sent with (its reply must carry it):
/// handed back to [`crate::engine::worker::Worker::sent`] with the host's token (or its
/// refusal). The adapter never looks inside.
#[derive(Debug)]
pub struct Route<S> {
    pub(super) dest: Dest<S>,
    pub(super) tag: CallTag,
}

impl<S> Route<S> {
    /// The tag the call's body carries: what its reply must carry back (the benchmarks answer
    /// a call with it).
    pub fn tag(&self) -> CallTag {
        self.tag
    }
}

/// One gateway request to send.
#[derive(Debug)]
pub struct Callout<S> {
    pub body: Vec<u8>,
    pub route: Route<S>,
}

/// What to do on one stream, in this order: headers, calls, local reply, resume.
#[derive(Debug)]
pub struct StreamEffects<S> {
    pub(crate) stream: S,
    /// Headers to add to the upstream's response (`RateLimit-Policy`, `RateLimit`).
    pub(crate) add_response_headers: Vec<(String, String)>,
    /// Headers to set on the request before it goes upstream (the fingerprint, the fencing
    /// token), while the host still holds them.
    pub(crate) set_request_headers: Vec<(String, String)>,
    /// Calls sent on this stream's behalf (from its context, so they end with it).
    pub calls: Vec<Callout<S>>,
    /// The request's decision line, to set as the stream's property
    /// [`crate::engine::flow::PROPERTY`] (before a local reply: Envoy's access log reads it).
    pub decision: Option<String>,
    /// Answer the client locally.
    pub reply: Option<Rc<LocalResponse>>,
    /// Resume this paused direction.
    pub resume: Option<Dir>,
}

impl<S> StreamEffects<S> {
    pub(super) fn new(stream: S) -> StreamEffects<S> {
        StreamEffects {
            stream,
            add_response_headers: Vec::new(),
            set_request_headers: Vec::new(),
            calls: Vec::new(),
            decision: None,
            reply: None,
            resume: None,
        }
    }

    /// Nothing to do on the stream (the adapter need not switch to it).
    pub(crate) fn is_empty(&self) -> bool {
        self.add_response_headers.is_empty()
            && self.set_request_headers.is_empty()
            && self.calls.is_empty()
            && self.decision.is_none()
            && self.reply.is_none()
            && self.resume.is_none()
    }
}

/// Everything an event asks of the adapter.
#[derive(Debug)]
pub struct Effects<S> {
    /// The answer to the callback that raised the event (meaningless for the root's events).
    /// A call that cannot be sent is answered at once, in the same callback: the effects of
    /// that answer then give the callback's answer.
    pub(crate) action: Action,
    /// The streams the event moved, in order.
    pub streams: Vec<StreamEffects<S>>,
    /// Calls the root sends for itself (background calls, batches), after the streams'.
    pub calls: Vec<Callout<S>>,
    /// The root's new tick period.
    pub(crate) tick_ms: Option<u64>,
    /// Wake the root on the event loop's next turn (acquires wait for a batch).
    pub(crate) wake: bool,
}

impl<S> Effects<S> {
    pub(crate) fn new(action: Action) -> Effects<S> {
        Effects {
            action,
            streams: Vec::new(),
            calls: Vec::new(),
            tick_ms: None,
            wake: false,
        }
    }

    /// The effects of one stream's operations alone. Its list is allocated at its size: a
    /// push onto an empty list runs the list's growth, code a request answered at once or
    /// given its rate-limit headers has no other use for.
    pub(crate) fn of_stream(action: Action, ops: StreamEffects<S>) -> Effects<S> {
        Effects {
            streams: vec![ops],
            ..Effects::new(action)
        }
    }
}
