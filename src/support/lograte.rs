//! Rate-limited warnings: in an outage every request fails the same way, and one line per
//! request would flood the proxy's log. At most one line per kind (and policy) per
//! [`LOG_INTERVAL_MS`] goes out (per worker: each VM has its own limiter); the next line of
//! that kind says how many were suppressed since the last one. Time is an argument.

use std::cell::RefCell;

/// At most one line per kind in this many ms.
pub(crate) const LOG_INTERVAL_MS: u64 = 1000;

/// The kinds of warnings that repeat once per request in an outage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WarnKind {
    /// An acquire call failed; the policy's failure mode applies.
    AcquireFailed,
    /// A record could not be completed or released.
    RecordNotSettled,
    /// A lease could not be released or extended.
    LeaseNotSettled,
    /// A concurrency slot could not be released or extended, or a charge not applied.
    QuotaNotSettled,
    /// The host refused to dispatch a callout.
    Dispatch,
    /// A stored response could not be opened (e.g. its key is gone: every replay fails).
    RecordUnopened,
    /// The worker's memory budget refused a copy (a record stored by reference, a `503`).
    MemoryBudget,
}

/// What to do with one warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Log it; `suppressed` lines of its kind were dropped in the `since_ms` before it.
    Log { suppressed: u64, since_ms: u64 },
    /// Drop it (counted, and reported with the next line of its kind).
    Suppress,
}

impl Admit {
    /// The suffix of the logged line: empty, or " (and N more like it in the last X.Y s)".
    pub(crate) fn suffix(self) -> String {
        match self {
            Admit::Log {
                suppressed: n @ 1..,
                since_ms,
            } => format!(
                " (and {n} more like it in the last {}.{} s)",
                since_ms / 1000,
                (since_ms % 1000) / 100
            ),
            _ => String::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// When the last line of this kind was logged (None: never).
    last_ms: Option<u64>,
    suppressed: u64,
}

/// The pure limiter: one slot per kind and scope (the policy's index; the number of slots is
/// bounded by the configuration).
#[derive(Debug, Default)]
pub(crate) struct LogLimiter {
    slots: Vec<((WarnKind, usize), Slot)>,
}

impl LogLimiter {
    /// Decides about one warning of `kind` for `scope` (a policy index) at `now_ms`.
    pub(crate) fn admit(&mut self, kind: WarnKind, scope: usize, now_ms: u64) -> Admit {
        let at = match self.slots.iter().position(|(k, _)| *k == (kind, scope)) {
            Some(at) => at,
            None => {
                self.slots.push(((kind, scope), Slot::default()));
                self.slots.len() - 1
            }
        };
        let slot = &mut self.slots[at].1;
        match slot.last_ms {
            Some(last) if now_ms.saturating_sub(last) < LOG_INTERVAL_MS => {
                slot.suppressed += 1;
                Admit::Suppress
            }
            last => {
                let admit = Admit::Log {
                    suppressed: slot.suppressed,
                    since_ms: last.map_or(0, |l| now_ms.saturating_sub(l)),
                };
                slot.last_ms = Some(now_ms);
                slot.suppressed = 0;
                admit
            }
        }
    }
}

/// A [`LogLimiter`] behind a `RefCell`, for the per-VM runtime.
#[derive(Debug, Default)]
pub(crate) struct Warnings(RefCell<LogLimiter>);

impl Warnings {
    /// Logs `message()` at warning level unless this kind was logged for `scope` (a policy
    /// index) less than a second ago.
    pub(crate) fn warn(
        &self,
        kind: WarnKind,
        scope: usize,
        now_ms: u64,
        message: impl FnOnce() -> String,
    ) {
        let admit = match self.0.try_borrow_mut() {
            Ok(mut l) => l.admit(kind, scope, now_ms),
            Err(_) => Admit::Log {
                suppressed: 0,
                since_ms: 0,
            },
        };
        if admit != Admit::Suppress {
            log::warn!("{}{}", message(), admit.suffix());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn one_line_per_kind_per_second_with_the_suppressed_count() {
        let mut l = LogLimiter::default();
        let first = l.admit(WarnKind::AcquireFailed, 0, 10_000);
        assert_eq!(
            first,
            Admit::Log {
                suppressed: 0,
                since_ms: 0
            }
        );
        assert_eq!(first.suffix(), "");
        for t in 10_001..10_813 {
            assert_eq!(l.admit(WarnKind::AcquireFailed, 0, t), Admit::Suppress);
        }
        // Another kind, or the same kind for another policy, is limited on its own.
        assert!(matches!(
            l.admit(WarnKind::RecordNotSettled, 0, 10_500),
            Admit::Log { suppressed: 0, .. }
        ));
        assert!(matches!(
            l.admit(WarnKind::AcquireFailed, 1, 10_500),
            Admit::Log { suppressed: 0, .. }
        ));
        assert_eq!(l.admit(WarnKind::AcquireFailed, 1, 10_501), Admit::Suppress);
        assert_eq!(l.admit(WarnKind::AcquireFailed, 0, 10_999), Admit::Suppress);
        let next = l.admit(WarnKind::AcquireFailed, 0, 11_000);
        assert_eq!(
            next,
            Admit::Log {
                suppressed: 813,
                since_ms: 1000
            }
        );
        assert_eq!(next.suffix(), " (and 813 more like it in the last 1.0 s)");
        // A quiet spell: the next line comes at once and reports nothing suppressed.
        let later = l.admit(WarnKind::AcquireFailed, 0, 60_000);
        assert_eq!(later.suffix(), "");
        assert_eq!(l.admit(WarnKind::AcquireFailed, 0, 60_001), Admit::Suppress);
        assert_eq!(
            l.admit(WarnKind::AcquireFailed, 0, 62_500).suffix(),
            " (and 1 more like it in the last 2.5 s)"
        );
    }

    #[test]
    fn a_clock_going_backwards_does_not_open_the_gate() {
        let mut l = LogLimiter::default();
        assert!(matches!(
            l.admit(WarnKind::Dispatch, 0, 5_000),
            Admit::Log { .. }
        ));
        assert_eq!(l.admit(WarnKind::Dispatch, 0, 4_000), Admit::Suppress);
    }
}
