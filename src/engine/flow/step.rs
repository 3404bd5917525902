//! What one event of the flow hands the worker: the stream's next move ([`Move`]) and what
//! the event produced beside it ([`Output`]), together one [`Step`]. Everything an event
//! produces leaves with its step, once: the worker never asks the flow for it afterwards.

use crate::guards::background::Background;
use crate::guards::context::Outgoing;
use crate::http::local_reply::LocalResponse;
use std::rc::Rc;

/// What an event of the flow produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// What the stream does next.
    pub next: Move,
    /// What goes with it.
    pub out: Output,
}

/// What the stream does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Move {
    /// Let the stream go on (resume it if it is paused).
    Continue,
    /// Send these calls and keep the stream paused.
    Dispatch(Vec<Outgoing>),
    /// Keep the stream paused.
    Wait,
    /// Answer the client locally (shared: a memoised answer is not copied).
    Respond(Rc<LocalResponse>),
}

/// What an event produced beside the stream's next move. Each list is empty unless the event
/// made something for it, and an empty list holds no allocation.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Output {
    /// Headers to set on the request before it goes upstream (the fingerprint, the fencing
    /// token), with the step that forwards it. (The client's own copies of them are removed
    /// from every request: see [`crate::guards::context::Runtime::reserved_headers`].)
    pub(crate) upstream_headers: Vec<(String, String)>,
    /// Headers to add to the upstream's response (`RateLimit-Policy`, `RateLimit`), with the
    /// step that forwards the request: the worker keeps them until the response's headers.
    pub response_headers: Vec<(String, String)>,
    /// Calls for the root to send: they must outlive the request.
    pub(crate) background: Vec<Background>,
    /// The lease this request gave back or the record it settled, once Redis said so: this
    /// worker's requests waiting for it poll at once (see [`super::Flow::wake`]).
    pub(crate) freed: Option<String>,
    /// The request's decision line (see `decision.rs`), with the step that reached its
    /// verdict: once per request a policy guards.
    pub decision: Option<String>,
}
