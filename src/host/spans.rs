//! Where the filter's time goes inside Envoy: the wall time of each part of its callbacks,
//! the profile `perf` cannot give (Envoy's binary is stripped and its V8 writes no perf map,
//! so the filter's Wasm is one anonymous block of JIT code to it).
//!
//! Compiled in only with the cargo feature `spans` (`make bench-spans`): without it, [`enter`]
//! returns a guard that reads no clock and does nothing. With it, each span adds its wall time
//! to this worker's total (two clock reads, about 0.5 µs, are part of it), and every
//! [`REPORT_EVERY`] guarded requests the worker logs the mean of each span in µs, one warning
//! that begins with `spans:`. Wall time, not CPU time: a worker descheduled inside a span
//! counts the wait too, so compare spans of one run, and runs at one load.

/// The parts of the filter's callbacks, in the order a request meets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Span {
    /// Request headers: the reads, the policy match and the request's parsing, up to the
    /// worker's event (a guarded request only).
    Headers,
    /// Of [`Span::Headers`]: reading the whole request header map (and removing the reserved
    /// headers a client sent).
    HeadersMap,
    /// Of [`Span::Headers`]: matching the policies.
    HeadersMatch,
    /// Of [`Span::Headers`]: parsing the map into the request the core decides on.
    HeadersParse,
    /// The worker's event for the request headers: the core's decision.
    Decide,
    /// Carrying out the decision: the callout's dispatch, a local reply, headers to set.
    Send,
    /// A callout's answer: its event, the read below included.
    Answer,
    /// Reading the answer from the host.
    AnswerRead,
    /// Carrying out what the answer decided (resuming the request).
    Resume,
    /// The response headers callback of a guarded stream.
    ResponseHeaders,
    /// The stream's end (`on_done`) of a guarded stream.
    Done,
    /// A stream's context made by the root (every stream).
    Create,
    /// The callbacks with nothing to do: bodies the flow does not take, and the response
    /// headers and end of a stream the worker no longer follows.
    Idle,
    /// A stream's context dropped: the worker forgets it, its state is freed.
    Drop,
}

#[cfg(feature = "spans")]
const SPANS: [(Span, &str); 14] = [
    (Span::Headers, "headers"),
    (Span::HeadersMap, "headers_map"),
    (Span::HeadersMatch, "headers_match"),
    (Span::HeadersParse, "headers_parse"),
    (Span::Decide, "decide"),
    (Span::Send, "send"),
    (Span::Answer, "answer"),
    (Span::AnswerRead, "answer_read"),
    (Span::Resume, "resume"),
    (Span::ResponseHeaders, "response_headers"),
    (Span::Done, "done"),
    (Span::Create, "create"),
    (Span::Idle, "idle"),
    (Span::Drop, "drop"),
];

/// Guarded requests per report.
#[cfg(feature = "spans")]
pub(crate) const REPORT_EVERY: u64 = 10_000;

/// When a span began (nothing without the feature).
#[derive(Clone, Copy)]
pub(crate) struct Mark {
    #[cfg(feature = "spans")]
    start_ns: u64,
}

/// Now, as the beginning of a span ended by [`Mark::end`] (or never, when the callback turns
/// out to have nothing to measure).
#[inline(always)]
pub(crate) fn mark() -> Mark {
    Mark {
        #[cfg(feature = "spans")]
        start_ns: on::now_ns(),
    }
}

impl Mark {
    /// Ends `span`, begun at this mark.
    #[inline(always)]
    pub(crate) fn end(self, _span: Span) {
        #[cfg(feature = "spans")]
        on::add(_span, on::now_ns().saturating_sub(self.start_ns));
    }
}

/// Ends its span when dropped.
pub(crate) struct Guard {
    #[cfg(feature = "spans")]
    span: Span,
    #[cfg(feature = "spans")]
    mark: Mark,
}

/// Starts `span`; it ends when the guard is dropped.
#[inline(always)]
pub(crate) fn enter(_span: Span) -> Guard {
    Guard {
        #[cfg(feature = "spans")]
        span: _span,
        #[cfg(feature = "spans")]
        mark: mark(),
    }
}

#[cfg(feature = "spans")]
impl Drop for Guard {
    fn drop(&mut self) {
        self.mark.end(self.span);
    }
}

#[cfg(feature = "spans")]
mod on {
    use super::{Span, REPORT_EVERY, SPANS};
    use crate::host::sdk::{self, LogLevel};
    use std::cell::RefCell;

    thread_local! {
        /// Per span: total ns, count.
        static TOTALS: RefCell<[(u64, u64); SPANS.len()]> =
            const { RefCell::new([(0, 0); SPANS.len()]) };
    }

    pub(crate) fn now_ns() -> u64 {
        u64::try_from(crate::host::since_epoch().as_nanos()).unwrap_or(u64::MAX)
    }

    pub(crate) fn add(span: Span, ns: u64) {
        let Some(i) = SPANS.iter().position(|(s, _)| *s == span) else {
            return;
        };
        let line = TOTALS.with(|t| {
            let Ok(mut t) = t.try_borrow_mut() else {
                return None;
            };
            let slot = t.get_mut(i)?;
            slot.0 = slot.0.saturating_add(ns);
            slot.1 += 1;
            if span != Span::Headers || slot.1 < REPORT_EVERY {
                return None;
            }
            let parts: Vec<String> = SPANS
                .iter()
                .zip(t.iter())
                .filter(|(_, (_, n))| *n > 0)
                .map(|((_, name), (total, n))| {
                    format!("{name}={:.2}/{n}", *total as f64 / *n as f64 / 1000.0)
                })
                .collect();
            *t = [(0, 0); SPANS.len()];
            Some(format!("spans: {}", parts.join(" ")))
        });
        if let Some(line) = line {
            sdk::log(LogLevel::Warn, &line);
        }
    }
}
