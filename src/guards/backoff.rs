//! Waiting for something another request holds (a busy lease, a record still in progress):
//! jittered polls that double up to a cap, until a deadline set at the first busy answer.

/// The polls of one waiting request.
#[derive(Debug)]
pub(crate) struct Backoff {
    /// Give up at this time (set at the first busy answer).
    until_ms: Option<u64>,
    backoff_ms: u64,
    max_ms: u64,
    /// The jitter's state, seeded from the owner token: waiters that met the same busy holder
    /// poll at different times instead of in lockstep.
    jitter: u64,
}

impl Backoff {
    /// Polls from `first_ms`, doubling up to `max_ms`, jittered by a seed from `token`.
    pub(crate) fn new(first_ms: u64, max_ms: u64, token: &str) -> Backoff {
        Backoff {
            until_ms: None,
            backoff_ms: first_ms.max(1),
            max_ms: max_ms.max(1),
            jitter: seed(token),
        }
    }

    /// Whether this request has waited (met a busy answer before).
    pub(crate) fn waited(&self) -> bool {
        self.until_ms.is_some()
    }

    /// When to poll next, waiting at most `max_wait_ms` from the first call (the last poll
    /// lands exactly then); `None` once that time has come.
    pub(crate) fn next_poll(&mut self, now_ms: u64, max_wait_ms: u64) -> Option<u64> {
        let until = *self
            .until_ms
            .get_or_insert(now_ms.saturating_add(max_wait_ms));
        if now_ms >= until {
            return None;
        }
        let next = now_ms
            .saturating_add(jittered(self.backoff_ms, &mut self.jitter))
            .min(until);
        self.backoff_ms = (self.backoff_ms * 2).min(self.max_ms);
        Some(next)
    }
}

/// The pause before the next poll: between half the backoff and all of it ("equal jitter"),
/// from a xorshift step of `state`.
fn jittered(backoff_ms: u64, state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    let half = backoff_ms / 2;
    half + x % (backoff_ms - half + 1)
}

/// A non-zero jitter seed from a token (FNV-1a).
fn seed(token: &str) -> u64 {
    let h = token.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    h.max(1)
}
