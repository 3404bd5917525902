//! What the worker keeps of each guarded stream ([`Entry`]: its flow, its paused direction,
//! its calls in flight, the headers its response gets) and the map they are kept in.

use super::effects::Dir;
use crate::engine::flow::Flow;
use std::collections::BTreeMap;

/// A guarded stream: its flow and which direction the filter holds.
#[derive(Debug, Default)]
pub(super) struct Entry {
    pub(super) flow: Flow,
    pub(super) paused: Option<Dir>,
    /// The tokens of its calls in flight (its routes): a stream that closes forgets those
    /// routes by their tokens, so closing costs nothing however many calls the worker has in
    /// flight (a slow Redis piles them up). Its room is kept with the box.
    pub(super) calls: Vec<u32>,
    /// Whether it is in the worker's `waiting` set: a stream that never waits costs the set
    /// nothing.
    pub(super) waits: bool,
    /// The stream ended while its acquire was in flight, and the flow stays to read the
    /// answer ([`Flow::detach`]): the host's end of the stream does not forget it, and nothing
    /// it does reaches the stream.
    pub(super) detached: bool,
    /// Headers to add to the upstream's response (`RateLimit-Policy`, `RateLimit`): the flow
    /// hands them out when it forwards the request, and they are added to its response.
    pub(super) response_headers: Vec<(String, String)>,
}

impl Entry {
    /// The entry as a fresh one, but for the room of its flow's lists and of its calls: a
    /// reused box allocates neither again.
    pub(super) fn recycle(&mut self) {
        // Every field, so that a new one cannot be left out.
        let Entry {
            flow,
            paused,
            calls,
            waits,
            detached,
            response_headers,
        } = self;
        flow.recycle();
        *paused = None;
        calls.clear();
        *waits = false;
        *detached = false;
        *response_headers = Vec::new();
    }
}

/// Boxes of closed streams kept for the next ones, at most.
pub(super) const SPARE_ENTRIES: usize = 64;

/// The guarded streams by handle. Boxed: a stream's state is large (about 600 bytes in Wasm),
/// and a map node moves its entries on every insertion and removal; a box moves as a pointer.
/// Each lookup is one function, not inlined: a request looks its stream up five or six
/// times, and the code it runs is what it costs in Envoy (one copy of the search, not one
/// per place that asks).
pub(super) struct Streams<S>(pub(super) BTreeMap<S, Box<Entry>>);

impl<S: Copy + Ord> Streams<S> {
    #[inline(never)]
    pub(super) fn get(&self, s: &S) -> Option<&Entry> {
        self.0.get(s).map(|e| &**e)
    }

    #[inline(never)]
    pub(super) fn get_mut(&mut self, s: &S) -> Option<&mut Entry> {
        self.0.get_mut(s).map(|e| &mut **e)
    }

    pub(super) fn contains(&self, s: &S) -> bool {
        self.get(s).is_some()
    }

    #[inline(never)]
    pub(super) fn remove(&mut self, s: &S) -> Option<Box<Entry>> {
        self.0.remove(s)
    }

    /// Keeps `entry` as stream `s`'s; the entry it replaces, if any.
    #[inline(never)]
    pub(super) fn insert(&mut self, s: S, entry: Box<Entry>) -> Option<Box<Entry>> {
        self.0.insert(s, entry)
    }
}
