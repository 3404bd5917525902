//! One worker's guarded streams and the root's calls: which answer goes where, which paused
//! direction an answer resumes, which streams the tick visits, who is woken when a lease is
//! given back, and how fast the root ticks. Every event returns [`Effects`] for the adapter
//! to carry out; the worker never calls the host, so the adapter holds no borrow of it while
//! the host runs (a local reply calls back into the filter at once). Each event of a flow
//! returns its [`Step`], which holds everything the event produced: the worker never asks the
//! flow for more afterwards.
//!
//! `S` is the adapter's handle of a stream (its context id); anything in tests.
//!
//! Where to read each concern:
//!
//! - this file: the worker's state and a stream's events from the host (its request, its
//!   response, its end), and forgetting a stream;
//! - `streams.rs`: what the worker keeps of each stream, and the map it is kept in;
//! - `steps.rs`: carrying out a flow's step (effects, calls, the outbox, the tick registry);
//! - `routes.rs`: where a call's answer goes (a stream, the root's outbox, a batch);
//! - `root.rs`: the root's tick and wake-up, the tick's period, waking a lease's waiters;
//! - `effects.rs`: what the adapter is asked to do, as data.

mod effects;
mod root;
mod routes;
mod steps;
mod streams;

pub use effects::{Action, Callout, Dir, Effects, Route, StreamEffects};

use crate::config::Batch;
use crate::engine::flow::{Cx, Flow, Move, Outbox, Step};
use crate::http::request::Request;
use crate::redis::scripts::batch::Batcher;
use crate::redis::tag::CallTag;
use crate::support::ids::{ByToken, TokenSource};
use effects::Dest;
use std::collections::{BTreeMap, BTreeSet};
use streams::{Entry, Streams, SPARE_ENTRIES};

/// The upstream's response head, read only when the flow wants it.
#[derive(Debug, Default)]
pub struct ResponseHead {
    pub headers: Vec<(String, String)>,
    /// `response.code_details` (`via_upstream` for the upstream's own answer).
    pub details: String,
}

/// Streams a worker keeps after their end to read their acquire's answer, at most; past it a
/// stream that ends mid-acquire gives back at once what the acquire may take, with the
/// owner's cancellation marker, as when its answer cannot come back. Each waits no longer
/// than the Redis timeout.
pub(crate) const MAX_DETACHED: usize = 1024;

pub struct Worker<S> {
    streams: Streams<S>,
    /// Boxes of closed streams, emptied, for the next streams (up to [`SPARE_ENTRIES`]): a
    /// stream takes no allocation of its own. Boxes, not entries: one goes into `streams` as
    /// it is.
    #[allow(clippy::vec_box)]
    spare: Vec<Box<Entry>>,
    /// Streams with a deadline (paused on Redis or the body, waiting for a lease, or holding
    /// a lease to extend): the ones the tick visits.
    waiting: BTreeSet<S>,
    /// Calls in flight: the host's token -> where the answer goes and the tag the call was
    /// sent with (batches: in the batcher).
    routes: ByToken<(Dest<S>, CallTag)>,
    /// Calls the root sends on its tick (and retries).
    outbox: Outbox,
    /// Acquires waiting to be coalesced (`redis.batch`), and the batches in flight.
    batcher: Batcher<Dest<S>>,
    tokens: TokenSource,
    /// The root's tick, and whether the fine one runs (a request waits for a lease).
    tick_ms: u64,
    fine_tick: bool,
    /// The root was asked to wake (a release or other root call is queued): not again until
    /// it did, or the tick came first.
    woken: bool,
    /// Streams kept after their end to read their acquire's answer (see [`MAX_DETACHED`]).
    detached: usize,
}

impl<S: Copy + Ord> Worker<S> {
    /// `tick_ms` is the period the adapter set at configuration.
    pub fn new(tokens: TokenSource, batch: Option<Batch>, tick_ms: u64) -> Worker<S> {
        Worker {
            streams: Streams(BTreeMap::new()),
            spare: Vec::new(),
            waiting: BTreeSet::new(),
            routes: ByToken::default(),
            outbox: Outbox::default(),
            batcher: Batcher::new(batch),
            tokens,
            tick_ms,
            fine_tick: false,
            woken: false,
            detached: 0,
        }
    }

    /// A request whose path reads more than one way, one of them guarded by policy `index`.
    pub(crate) fn on_ambiguous_path(
        &mut self,
        cx: &Cx<'_>,
        s: S,
        index: usize,
        content_type: Option<&str>,
    ) -> Effects<S> {
        self.start(cx, s, |flow| {
            flow.set_grpc(content_type);
            flow.on_ambiguous_path(cx, index)
        })
    }

    /// Request headers of a request policy `index` guards (the adapter matched it).
    pub fn on_request_headers(
        &mut self,
        cx: &Cx<'_>,
        s: S,
        index: usize,
        req: Request,
        end_of_stream: bool,
    ) -> Effects<S> {
        let needs_tokens = cx
            .rt
            .config
            .policies
            .get(index)
            .is_some_and(|p| p.needs_tokens);
        let tokens = needs_tokens.then(|| (self.tokens.token(), self.tokens.token()));
        let (nonce, owner) = tokens
            .as_ref()
            .map_or(("-", "-"), |(n, o)| (n.as_str(), o.as_str()));
        self.start(cx, s, |flow| {
            flow.on_policy_request(cx, index, req, nonce, owner, end_of_stream)
        })
    }

    /// A stream's first event, `first` on a fresh flow. The flow runs in a spare box, put in
    /// the map only if the stream has more to do: a request answered at once with nothing
    /// taken (a cached rejection, a refused input) is forgotten before it was ever kept.
    /// Whatever the worker kept of an earlier request of the stream is forgotten either way.
    fn start(&mut self, cx: &Cx<'_>, s: S, first: impl FnOnce(&mut Flow) -> Step) -> Effects<S> {
        let mut entry = self.spare.pop().unwrap_or_default();
        match first(&mut entry.flow) {
            Step {
                next: Move::Respond(reply),
                out,
            } if out.background.is_empty() && entry.flow.answered_without_calls() => {
                self.close(s);
                self.retire(entry);
                let mut ops = StreamEffects::new(s);
                ops.decision = out.decision;
                ops.reply = Some(reply);
                Effects::of_stream(Action::Pause, ops)
            }
            step => {
                if let Some(mut old) = self.streams.insert(s, entry) {
                    if old.detached {
                        // A stream of this id still waiting for its acquire's answer (the
                        // host reuses no id; a test may): given up on now.
                        let owed = old.flow.on_done(cx);
                        owed.into_iter().for_each(|bg| self.outbox.add(bg));
                    }
                    self.forget(s, old);
                }
                self.event(cx, s, Some(Dir::Request), step)
            }
        }
    }

    /// A piece of the body in direction `dir`: `read` gives what the host holds of it (the
    /// request's whole body buffered so far; the response's piece).
    pub fn on_body(
        &mut self,
        cx: &Cx<'_>,
        s: S,
        dir: Dir,
        body_size: usize,
        end_of_stream: bool,
        read: impl FnOnce() -> Vec<u8>,
    ) -> Effects<S> {
        self.flow_event(cx, s, dir, |f| match dir {
            Dir::Request => f.on_request_body(cx, body_size, end_of_stream, read),
            Dir::Response => f.on_response_body(cx, body_size, end_of_stream, read),
        })
    }

    /// The request's trailers; `read` gives the body the host buffered.
    pub(crate) fn on_request_trailers(
        &mut self,
        cx: &Cx<'_>,
        s: S,
        read: impl FnOnce() -> Vec<u8>,
    ) -> Effects<S> {
        self.flow_event(cx, s, Dir::Request, |f| f.on_request_trailers(cx, read))
    }

    /// The response's headers: the rate-limit headers are added, and `read` is asked for the
    /// head only when the response matters (a record to complete, a lease to release). The
    /// head read is the upstream's, with the added headers after it, as the host lists them.
    pub fn on_response_headers(
        &mut self,
        cx: &Cx<'_>,
        s: S,
        end_of_stream: bool,
        read: impl FnOnce() -> ResponseHead,
    ) -> Effects<S> {
        if let Some(fx) = self.on_response_headers_untimed(cx, s) {
            return fx;
        }
        let Some(entry) = self.streams.get_mut(&s) else {
            return Effects::new(Action::Continue);
        };
        // Added to this response once.
        let extra = std::mem::take(&mut entry.response_headers);
        let mut head = read();
        head.headers.extend(extra.iter().cloned());
        let status = head
            .headers
            .iter()
            .find(|(n, _)| n == ":status")
            .and_then(|(_, v)| v.parse::<u32>().ok())
            .unwrap_or(0);
        let via_upstream = head.details == "via_upstream";
        let step = entry.flow.on_response_headers(
            cx,
            status,
            via_upstream,
            &head.details,
            &head.headers,
            end_of_stream,
        );
        let mut fx = self.event(cx, s, Some(Dir::Response), step);
        match fx.streams.first_mut() {
            Some(ops) => ops.add_response_headers = extra,
            None => {
                let mut ops = StreamEffects::new(s);
                ops.add_response_headers = extra;
                fx.streams.insert(0, ops);
            }
        }
        fx
    }

    /// [`Worker::on_response_headers`] of a stream that reads nothing of its response (the
    /// usual rate-limited request): its rate-limit headers are added, and it is forgotten
    /// when its end owes nothing. Nothing of that reads the time, so the adapter reads no clock
    /// for it: `cx`'s time is never looked at. `None` when the stream needs the timed event
    /// (or is not guarded).
    pub fn on_response_headers_untimed(&mut self, cx: &Cx<'_>, s: S) -> Option<Effects<S>> {
        let entry = self.streams.get_mut(&s)?;
        if entry.flow.wants_response(cx) {
            return None;
        }
        // Added to this response once.
        let extra = std::mem::take(&mut entry.response_headers);
        // Nothing left for the stream's end: forgotten now, so its end costs no event.
        if entry.flow.owes_nothing_at_end(cx) {
            self.close(s);
        }
        let mut ops = StreamEffects::new(s);
        ops.add_response_headers = extra;
        Some(Effects::of_stream(Action::Continue, ops))
    }

    /// The response's trailers; `read` is asked only when the record settles on them.
    pub(crate) fn on_response_trailers(
        &mut self,
        cx: &Cx<'_>,
        s: S,
        read: impl FnOnce() -> Vec<(String, String)>,
    ) -> Effects<S> {
        self.flow_event(cx, s, Dir::Response, |f| {
            let trailers = if f.wants_response_trailers(cx) {
                read()
            } else {
                Vec::new()
            };
            f.on_response_trailers(cx, &trailers)
        })
    }

    /// The stream ended: what it still owes goes to the root; the worker forgets it. A
    /// stream whose acquire is in flight and will be answered (it went out in a batch, from
    /// the root; a stream's own call ends with it) stays, detached, to read that answer (see
    /// [`Flow::detach`]), while there is room.
    pub fn on_done(&mut self, cx: &Cx<'_>, s: S) -> Effects<S> {
        let mut fx = Effects::new(Action::Continue);
        let room = self.detached < MAX_DETACHED;
        if let Some(entry) = self.streams.get_mut(&s) {
            if entry.detached {
                return fx;
            }
            if room && entry.calls.is_empty() && entry.flow.detach() {
                entry.detached = true;
                entry.paused = None;
                self.detached += 1;
                return fx;
            }
            let owed = entry.flow.on_done(cx);
            self.settle(cx, s, owed, None, &mut fx);
        }
        self.close(s);
        fx
    }

    /// Whether this worker guards stream `s` (events of any other stream change nothing).
    pub fn guards(&self, s: S) -> bool {
        self.streams.contains(&s)
    }

    /// Whether stream `s` takes a body piece in direction `dir` (else it passes untouched).
    pub(crate) fn wants_body(&self, s: S, dir: Dir) -> bool {
        self.streams.get(&s).is_some_and(|e| match dir {
            Dir::Request => e.flow.holds_request(),
            Dir::Response => e.flow.wants_response_body(),
        })
    }

    /// Forgets a stream (and where its calls' answers would have gone). A stream the worker
    /// does not know (never guarded, or forgotten already: the host's end of every stream
    /// comes here) has nothing here to forget: a call sent for it after it was forgotten is
    /// dropped with its answer (see [`Worker::on_answer`]).
    /// A detached stream stays until its flow is settled (see [`Worker::on_done`]).
    pub fn close(&mut self, s: S) {
        if self.streams.get(&s).is_some_and(|e| e.detached) {
            return;
        }
        if let Some(entry) = self.streams.remove(&s) {
            self.forget(s, entry);
        }
    }

    /// Forgets a detached stream once its flow has nothing more to wait for.
    pub(super) fn forget_if_settled(&mut self, s: S) {
        let settled = self
            .streams
            .get(&s)
            .is_some_and(|e| e.detached && e.flow.gone_and_settled());
        if settled {
            if let Some(entry) = self.streams.remove(&s) {
                self.forget(s, entry);
            }
        }
    }

    /// What the worker keeps for stream `s` beside `entry`, its box (taken out of the map),
    /// forgotten with it.
    fn forget(&mut self, s: S, mut entry: Box<Entry>) {
        if entry.detached {
            self.detached = self.detached.saturating_sub(1);
        }
        if entry.waits {
            self.waiting.remove(&s);
        }
        for token in entry.calls.drain(..) {
            self.routes.remove(&token);
        }
        self.retire(entry);
    }

    /// Keeps a forgotten stream's box for the next stream, emptied (while there is room).
    fn retire(&mut self, mut entry: Box<Entry>) {
        if self.spare.len() < SPARE_ENTRIES {
            entry.recycle();
            self.spare.push(entry);
        }
    }

    /// A guarded stream's own event in direction `dir`; an unguarded stream goes on.
    fn flow_event(
        &mut self,
        cx: &Cx<'_>,
        s: S,
        dir: Dir,
        event: impl FnOnce(&mut Flow) -> Step,
    ) -> Effects<S> {
        match self.streams.get_mut(&s) {
            Some(entry) => {
                let step = event(&mut entry.flow);
                self.event(cx, s, Some(dir), step)
            }
            None => Effects::new(Action::Continue),
        }
    }

    fn event(&mut self, cx: &Cx<'_>, s: S, dir: Option<Dir>, step: Step) -> Effects<S> {
        let mut fx = Effects::new(Action::Pause);
        self.carry(cx, s, dir, step, &mut fx);
        fx
    }
}

#[cfg(test)]
mod alloc_tests;
#[cfg(test)]
mod tag_tests;
#[cfg(test)]
mod tests;
