//! One worker's guarded streams and the root's calls: which answer goes where, which paused
//! direction an answer resumes, which streams the tick visits, who is woken when a lease is
//! given back, and how fast the root ticks. Every event returns [`Effects`] for the adapter
//! to carry out; the worker never calls the host, so the adapter holds no borrow of it while
//! the host runs (a local reply calls back into the filter at once).
//!
//! `S` is the adapter's handle of a stream (its context id); anything in tests.

mod effects;

pub use effects::{Action, Callout, Dir, Effects, Route, StreamEffects};

use crate::config::Batch;
use crate::engine::flow::{Cx, Flow, Outbox, Outgoing, Step};
use crate::http::request::Request;
use crate::redis::scripts::batch::{BatchAnswer, Batcher, InFlight};
use crate::redis::{resp::Reply, CallError};
use crate::support::ids::{ByToken, TokenSource};
use effects::Dest;
use std::collections::{BTreeMap, BTreeSet};

/// The root's tick while a request of this worker waits for a busy lease: its polls are due
/// at jittered times, which the watchdog's coarser tick would bunch together again.
pub const LEASE_WAIT_TICK_MS: u64 = 5;

/// The upstream's response head, read only when the flow wants it.
#[derive(Debug, Default)]
pub struct ResponseHead {
    pub headers: Vec<(String, String)>,
    /// `response.code_details` (`via_upstream` for the upstream's own answer).
    pub details: String,
}

/// A guarded stream: its flow and which direction the filter holds.
#[derive(Debug, Default)]
struct Entry {
    flow: Flow,
    paused: Option<Dir>,
    /// The tokens of its calls in flight (its routes): a stream that closes forgets those
    /// routes by their tokens, so closing costs nothing however many calls the worker has in
    /// flight (a slow Redis piles them up). Its room is kept with the box.
    calls: Vec<u32>,
    /// Whether it is in the worker's `waiting` set: a stream that never waits costs the set
    /// nothing.
    waits: bool,
    /// The stream ended while its acquire was in flight, and the flow stays to read the
    /// answer ([`Flow::detach`]): the host's end of the stream does not forget it, and nothing
    /// it does reaches the stream.
    detached: bool,
}

/// Boxes of closed streams kept for the next ones, at most.
const SPARE_ENTRIES: usize = 64;

/// Streams a worker keeps after their end to read their acquire's answer, at most; past it a
/// stream that ends mid-acquire gives back at once what the acquire may take, with the
/// owner's cancellation marker, as when its answer cannot come back. Each waits no longer
/// than the Redis timeout.
pub const MAX_DETACHED: usize = 1024;

/// The guarded streams by handle. Boxed: a stream's state is large (about 600 bytes in Wasm),
/// and a map node moves its entries on every insertion and removal; a box moves as a pointer.
/// Each lookup is one function, not inlined: a request looks its stream up five or six
/// times, and the code it runs is what it costs in Envoy (one copy of the search, not one
/// per place that asks).
struct Streams<S>(BTreeMap<S, Box<Entry>>);

impl<S: Copy + Ord> Streams<S> {
    #[inline(never)]
    fn get(&self, s: &S) -> Option<&Entry> {
        self.0.get(s).map(|e| &**e)
    }

    #[inline(never)]
    fn get_mut(&mut self, s: &S) -> Option<&mut Entry> {
        self.0.get_mut(s).map(|e| &mut **e)
    }

    fn contains(&self, s: &S) -> bool {
        self.get(s).is_some()
    }

    #[inline(never)]
    fn remove(&mut self, s: &S) -> Option<Box<Entry>> {
        self.0.remove(s)
    }

    /// Keeps `entry` as stream `s`'s; the entry it replaces, if any.
    #[inline(never)]
    fn insert(&mut self, s: S, entry: Box<Entry>) -> Option<Box<Entry>> {
        self.0.insert(s, entry)
    }
}

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
    /// Calls in flight: the host's token -> where the answer goes (batches: in the batcher).
    routes: ByToken<Dest<S>>,
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
    pub fn on_ambiguous_path(
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
            Step::Respond(reply) if entry.flow.answered_without_calls() => {
                self.close(s);
                self.retire(entry);
                let mut ops = StreamEffects::new(s);
                ops.reply = Some(reply);
                Effects::of_stream(Action::Pause, ops)
            }
            step => {
                if let Some(mut old) = self.streams.insert(s, entry) {
                    if old.detached {
                        // A stream of this id still waiting for its acquire's answer (the
                        // host reuses no id; a test may): given up on now.
                        old.flow.on_done(cx);
                        old.flow
                            .take_background()
                            .into_iter()
                            .for_each(|bg| self.outbox.add(bg));
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
    pub fn on_request_trailers(
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
        // Added to this response once: the flow has no use for them after it.
        let extra = entry.flow.take_response_headers();
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
        // Added to this response once: the flow has no use for them after it.
        let extra = entry.flow.take_response_headers();
        // Nothing left for the stream's end: forgotten now, so its end costs no event.
        if entry.flow.owes_nothing_at_end(cx) {
            self.close(s);
        }
        let mut ops = StreamEffects::new(s);
        ops.add_response_headers = extra;
        Some(Effects::of_stream(Action::Continue, ops))
    }

    /// The response's trailers; `read` is asked only when the record settles on them.
    pub fn on_response_trailers(
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
            entry.flow.on_done(cx);
            self.settle(cx, s, &mut fx);
        }
        self.close(s);
        fx
    }

    /// Whether this worker guards stream `s` (events of any other stream change nothing).
    pub fn guards(&self, s: S) -> bool {
        self.streams.contains(&s)
    }

    /// Whether stream `s` takes a body piece in direction `dir` (else it passes untouched).
    pub fn wants_body(&self, s: S, dir: Dir) -> bool {
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
    fn forget_if_settled(&mut self, s: S) {
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
            // Every field, so that a new one cannot be left out: the box must be as a fresh
            // one (the flow keeps only the room of its lists).
            let Entry {
                flow,
                paused,
                calls,
                waits,
                detached,
            } = &mut *entry;
            flow.recycle();
            *paused = None;
            calls.clear();
            *waits = false;
            *detached = false;
            self.spare.push(entry);
        }
    }

    /// A call was handed to the host: its answer comes back with `token`, or it was refused
    /// (then that is its answer, at once).
    pub fn sent(
        &mut self,
        cx: &Cx<'_>,
        route: Route<S>,
        token: Result<u32, CallError>,
    ) -> Effects<S> {
        let mut fx = Effects::new(Action::Pause);
        match (route.0, token) {
            (Dest::Batch(batch), Ok(token)) => self.batcher.sent(token, batch),
            (dest, Ok(token)) => {
                if let Dest::Stream(s, _) = dest {
                    if let Some(entry) = self.streams.get_mut(&s) {
                        entry.calls.push(token);
                    }
                }
                self.routes.insert(token, dest);
            }
            (dest, Err(e)) => self.answer(cx, dest, Err(e), &mut fx),
        }
        fx
    }

    /// The answer of the call sent with `token`; `read` decodes it, asked only for a call
    /// the worker knows of.
    pub fn on_answer(
        &mut self,
        cx: &Cx<'_>,
        token: u32,
        read: impl FnOnce() -> Result<Reply, CallError>,
    ) -> Effects<S> {
        let mut fx = Effects::new(Action::Pause);
        let dest = match self.batcher.take(token) {
            Some(batch) => Some(Dest::Batch(batch)),
            None => self.routes.remove(&token),
        };
        if let Some(Dest::Stream(s, _)) = &dest {
            if let Some(entry) = self.streams.get_mut(s) {
                if let Some(i) = entry.calls.iter().position(|&t| t == token) {
                    entry.calls.swap_remove(i);
                }
            }
        }
        match dest {
            Some(Dest::Stream(s, _)) if !self.streams.contains(&s) => {}
            Some(dest) => self.answer(cx, dest, read(), &mut fx),
            None => {}
        }
        fx
    }

    /// The root's tick: what the other workers told the over-limit cache, the streams whose
    /// deadline passed (what they hand over goes out in this same tick), the tick period, then
    /// the root's due calls and the batches.
    pub fn on_tick(&mut self, cx: &Cx<'_>) -> Effects<S> {
        let mut fx = Effects::new(Action::Continue);
        cx.rt.over_limit.sync(cx.now_ms);
        let due: Vec<S> = self
            .waiting
            .iter()
            .filter(|s| {
                self.streams
                    .get(s)
                    .and_then(|e| e.flow.deadline_ms())
                    .is_some_and(|d| cx.now_ms >= d)
            })
            .copied()
            .collect();
        for s in due {
            if let Some(entry) = self.streams.get_mut(&s) {
                let step = entry.flow.on_tick(cx);
                self.carry(cx, s, None, step, &mut fx);
            }
        }
        if self.fine_tick && !self.any_lease_waiter() {
            self.set_fine_tick(false, &mut fx);
        }
        self.send_due(cx, &mut fx);
        self.flush(cx, &mut fx);
        fx
    }

    /// The root was woken: the calls it holds for streams (releases, completions) go out,
    /// and queued acquires as batches.
    pub fn on_queue_ready(&mut self, cx: &Cx<'_>) -> Effects<S> {
        let mut fx = Effects::new(Action::Continue);
        self.send_due(cx, &mut fx);
        self.flush(cx, &mut fx);
        fx
    }

    /// The root's calls that are due, sent now (those a batch takes with the next flush).
    fn send_due(&mut self, cx: &Cx<'_>, fx: &mut Effects<S>) {
        self.woken = false;
        for out in self.outbox.take_due(cx.now_ms) {
            if let Some(sub) = self.batcher.takes(out.script, out.by_sha) {
                self.batcher.queue(Dest::Outbox(out.slot), sub, out.call);
            } else {
                let slot = out.slot;
                fx.calls.push(callout(cx, &out, Dest::Outbox(slot)));
            }
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

    /// Routes an answer (or a refusal to send) to where its call came from.
    fn answer(
        &mut self,
        cx: &Cx<'_>,
        dest: Dest<S>,
        answer: Result<Reply, CallError>,
        fx: &mut Effects<S>,
    ) {
        match dest {
            Dest::Stream(s, slot) => {
                if let Some(entry) = self.streams.get_mut(&s) {
                    let step = entry.flow.on_reply(cx, slot, answer);
                    self.carry(cx, s, None, step, fx);
                }
            }
            Dest::Outbox(slot) => {
                let settled = self.outbox.on_answer(cx, slot, answer);
                if let Some(out) = settled.resend {
                    fx.calls.push(callout(cx, &out, Dest::Outbox(out.slot)));
                }
                if let Some(key) = settled.freed {
                    self.wake_waiters(&key, cx.now_ms);
                }
            }
            Dest::Batch(batch) => {
                match self
                    .batcher
                    .answer(batch, answer, cx.now_ms, &cx.rt.metrics.redis, cx.m)
                {
                    BatchAnswer::Resend(batches) => {
                        for batch in batches {
                            fx.calls.push(batch_callout(cx, batch));
                        }
                    }
                    BatchAnswer::Members(members) => {
                        for (to, part) in members {
                            self.answer(cx, to, part, fx);
                        }
                    }
                }
            }
        }
    }

    /// Carries out a stream's step: `dir` is the direction of the host callback that raised
    /// it, or `None` for an answer or a tick, where a paused direction is resumed instead.
    fn carry(&mut self, cx: &Cx<'_>, s: S, dir: Option<Dir>, step: Step, fx: &mut Effects<S>) {
        let Some(entry) = self.streams.get_mut(&s) else {
            return;
        };
        let mut ops = StreamEffects::new(s);
        fx.action = Action::Pause;
        let responded = matches!(step, Step::Respond(_));
        match step {
            Step::Continue => {
                let paused = entry.paused.take();
                if dir == Some(Dir::Request) || paused == Some(Dir::Request) {
                    ops.set_request_headers = entry.flow.take_upstream_headers();
                }
                if dir.is_none() {
                    ops.resume = paused;
                }
                fx.action = Action::Continue;
            }
            Step::Wait => entry.paused = dir.or(entry.paused),
            Step::Respond(r) => {
                entry.paused = None;
                ops.reply = Some(r);
            }
            Step::Dispatch(calls) => {
                entry.paused = dir.or(entry.paused);
                for call in calls {
                    if let Some(sub) = self.batcher.takes(call.script, call.by_sha) {
                        fx.wake |= self
                            .batcher
                            .queue(Dest::Stream(s, call.slot), sub, call.call);
                    } else {
                        ops.calls
                            .push(callout(cx, &call, Dest::Stream(s, call.slot)));
                    }
                }
            }
        }
        // A detached stream's host context is gone: nothing of it reaches the host (its flow
        // neither answers nor resumes nor sends; this is the belt to those braces).
        let detached = entry.detached;
        if !ops.is_empty() && !detached {
            fx.streams.push(ops);
        }
        self.settle(cx, s, fx);
        if detached {
            self.forget_if_settled(s);
            return;
        }
        // A local answer that took nothing: the stream's later events (the answer's own
        // response headers, its end) have nothing to do, so the worker forgets it now.
        if responded
            && self
                .streams
                .get(&s)
                .is_some_and(|e| e.flow.answered_without_calls())
        {
            self.close(s);
        }
    }

    /// After a stream's step: its background calls go to the outbox, the tick registry and
    /// period follow its deadline and lease wait, and a lease it gave back wakes its waiters.
    fn settle(&mut self, cx: &Cx<'_>, s: S, fx: &mut Effects<S>) {
        let Some(entry) = self.streams.get_mut(&s) else {
            return;
        };
        let flow = &mut entry.flow;
        let background = flow.take_background();
        let deadline = flow.deadline_ms();
        let was_waiting = std::mem::replace(&mut entry.waits, deadline.is_some());
        let freed = flow.take_freed();
        let waits = flow.waiting_for().is_some();
        if waits {
            self.set_fine_tick(true, fx);
        }
        if !background.is_empty() && !self.woken {
            // A release must not wait for the tick: the stream's next request (or another
            // sidecar's) would find the slot, lease or record still held.
            fx.wake = true;
            self.woken = true;
        }
        background.into_iter().for_each(|bg| self.outbox.add(bg));
        match (deadline.is_some(), was_waiting) {
            (true, false) => {
                self.waiting.insert(s);
            }
            (false, true) => {
                self.waiting.remove(&s);
            }
            _ => {}
        }
        if let Some(key) = freed {
            self.wake_waiters(&key, cx.now_ms);
        }
    }

    /// The lease `key` was given back: this worker's requests waiting for it poll at the next
    /// tick instead of at the end of their backoff.
    fn wake_waiters(&mut self, key: &str, now_ms: u64) {
        for s in &self.waiting {
            if let Some(entry) = self.streams.get_mut(s) {
                if entry.flow.waiting_for() == Some(key) {
                    entry.flow.wake(now_ms);
                }
            }
        }
    }

    fn any_lease_waiter(&self) -> bool {
        self.waiting.iter().any(|s| {
            self.streams
                .get(s)
                .is_some_and(|e| e.flow.waiting_for().is_some())
        })
    }

    /// Switches the root's tick to the fine one (`true`) or back.
    fn set_fine_tick(&mut self, fine: bool, fx: &mut Effects<S>) {
        if self.fine_tick != fine {
            self.fine_tick = fine;
            fx.tick_ms = Some(if fine {
                LEASE_WAIT_TICK_MS
            } else {
                self.tick_ms
            });
        }
    }

    /// The queued calls (acquires, the root's settlements) as batches to send.
    fn flush(&mut self, cx: &Cx<'_>, fx: &mut Effects<S>) {
        for batch in self
            .batcher
            .flush(cx.now_ms, &cx.rt.config.redis.key_prefix)
        {
            fx.calls.push(batch_callout(cx, batch));
        }
    }
}

/// A call to send, counted as a Redis call.
fn callout<S>(cx: &Cx<'_>, out: &Outgoing, dest: Dest<S>) -> Callout<S> {
    cx.m.increment(cx.rt.metrics.redis.calls);
    Callout {
        body: out.encode(&cx.rt.scripts),
        route: Route(dest),
    }
}

fn batch_callout<S>(cx: &Cx<'_>, batch: InFlight<Dest<S>>) -> Callout<S> {
    cx.m.increment(cx.rt.metrics.redis.calls);
    Callout {
        body: batch.encode(&cx.rt.scripts),
        route: Route(Dest::Batch(batch)),
    }
}

#[cfg(test)]
mod alloc_tests;
#[cfg(test)]
mod tests;
