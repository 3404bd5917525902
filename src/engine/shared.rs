//! One VM's worker as the adapter shares it between the root context and every stream: it
//! takes one event at a time. The adapter borrows it only to hand it an event, and makes no
//! host call meanwhile that calls back into the filter (only reads of the host's buffers), so
//! a callback never finds it busy. Should one, the event it brings is refused (`None`: the
//! stream waits), and its question whether the stream needs an event is answered yes, so that
//! the event decides.

use crate::engine::worker::{Dir, Worker};
use std::cell::RefCell;

pub(crate) struct SharedWorker<S>(RefCell<Worker<S>>);

impl<S: Copy + Ord> SharedWorker<S> {
    pub(crate) fn new(worker: Worker<S>) -> SharedWorker<S> {
        SharedWorker(RefCell::new(worker))
    }

    /// Hands an event to the worker; `None` while it is taking another one.
    pub(crate) fn event<T>(&self, f: impl FnOnce(&mut Worker<S>) -> T) -> Option<T> {
        let mut worker = self.0.try_borrow_mut().ok()?;
        Some(f(&mut worker))
    }

    /// Whether stream `s` needs the worker's events: a stream it does not guard needs none
    /// (so no clock read either).
    pub(crate) fn follows(&self, s: S) -> bool {
        match self.0.try_borrow() {
            Ok(w) => w.guards(s),
            Err(_) => true,
        }
    }

    /// Whether a body piece of stream `s` in direction `dir` needs an event: none when the
    /// flow takes no body in that direction (the piece passes, never read from the host).
    pub(crate) fn takes_body(&self, s: S, dir: Dir) -> bool {
        match self.0.try_borrow() {
            Ok(w) => w.wants_body(s, dir),
            Err(_) => true,
        }
    }

    /// Forgets stream `s` (the host deleted it); nothing while the worker takes an event.
    pub(crate) fn close(&self, s: S) {
        if let Ok(mut worker) = self.0.try_borrow_mut() {
            worker.close(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::flow::{Cx, Runtime};
    use crate::http::request::Request;
    use crate::support::ids::TokenSource;
    use crate::support::metrics::NoMetrics;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn request() -> Request {
        Request::from_headers(
            vec![
                (":method".into(), "GET".into()),
                (":path".into(), "/api/items".into()),
                (":authority".into(), "h".into()),
                ("x-tenant-id".into(), "acme".into()),
            ],
            None,
        )
    }

    #[test]
    fn a_stream_asks_the_worker_and_is_told_yes_while_it_takes_an_event() {
        let rt = Runtime::per_tenant_benchmark("exact").expect("valid");
        let cx = Cx::new(&rt, 1_000, &NoMetrics);
        let shared = SharedWorker::new(Worker::new(TokenSource::with_seed(1, 2), None, 25));
        // A stream the worker never guarded needs no event, and takes no body.
        assert!(!shared.follows(1));
        assert!(!shared.takes_body(1, Dir::Request));
        assert!(!shared.takes_body(1, Dir::Response));
        // A guarded request held for its acquire takes its body in; the response's body
        // is not asked for.
        let fx = shared.event(|w| w.on_request_headers(&cx, 1, 0, request(), false));
        assert!(fx.is_some());
        assert!(shared.follows(1));
        assert!(shared.takes_body(1, Dir::Request));
        assert!(!shared.takes_body(1, Dir::Response));
        // While the worker takes an event, another is refused and every stream is followed.
        let inside = shared.event(|_| {
            (
                shared.event(|_| ()).is_none(),
                shared.follows(2),
                shared.takes_body(2, Dir::Response),
            )
        });
        assert_eq!(inside, Some((true, true, true)));
        // A close asked meanwhile forgets nothing; one after does.
        shared.event(|_| shared.close(1));
        assert!(shared.follows(1));
        shared.close(1);
        assert!(!shared.follows(1));
    }
}
