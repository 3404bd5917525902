//! Owner tokens and nonces: 128-bit values, unique per request across every sidecar.
//!
//! A small xorshift generator seeded once per VM from the host's entropy (WASI `random_get`
//! through std's hasher keys) and the clock. The tokens need to be unique and unguessable by
//! other requests, not cryptographically strong: they never authorize anything by themselves.
//!
//! Also the maps keyed by the host's own ids for the calls in flight ([`ByToken`]).

use crate::support::text::push_hex;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

pub struct TokenSource {
    state: [u64; 2],
}

impl TokenSource {
    /// Seeds from std's per-process random hasher keys mixed with `salt` (e.g. the time).
    pub(crate) fn from_entropy(salt: u64) -> TokenSource {
        let mut a = RandomState::new().build_hasher();
        a.write_u64(salt);
        let mut b = RandomState::new().build_hasher();
        b.write_u64(salt ^ 0x9e37_79b9_7f4a_7c15);
        TokenSource::with_seed(a.finish(), b.finish())
    }

    pub fn with_seed(a: u64, b: u64) -> TokenSource {
        let mut s = TokenSource {
            state: [splitmix(a), splitmix(b ^ 0xdead_beef_cafe_f00d)],
        };
        if s.state == [0, 0] {
            s.state = [1, 2];
        }
        s
    }

    fn next_u64(&mut self) -> u64 {
        // xorshift128+
        let mut s1 = self.state[0];
        let s0 = self.state[1];
        self.state[0] = s0;
        s1 ^= s1 << 23;
        self.state[1] = s1 ^ s0 ^ (s1 >> 17) ^ (s0 >> 26);
        self.state[1].wrapping_add(s0)
    }

    /// 32 lower-case hex digits.
    pub(crate) fn token(&mut self) -> String {
        let hi = self.next_u64();
        let lo = self.next_u64();
        let mut out = String::with_capacity(32);
        push_hex(&mut out, &hi.to_be_bytes());
        push_hex(&mut out, &lo.to_be_bytes());
        out
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A map keyed by the host's call tokens: the host chooses them (Envoy counts them up), so no
/// client can pick keys that collide, and a multiplication spreads them where SipHash, std's
/// default, would cost more than the rest of a lookup.
pub(crate) type ByToken<V> = HashMap<u32, V, BuildHasherDefault<TokenHasher>>;

/// [`ByToken`]'s hasher: a token times an odd constant (a bijection, so distinct tokens never
/// collide before the table's mask, and the high bits the table also reads are mixed).
#[derive(Default)]
pub(crate) struct TokenHasher(u64);

impl Hasher for TokenHasher {
    fn write_u32(&mut self, token: u32) {
        self.0 = (self.0 ^ u64::from(token)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    /// Not what a `u32` key writes; any other bytes are folded in one at a time.
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u32(u32::from(b));
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn call_tokens_hash_apart_in_the_low_and_the_high_bits() {
        let hash = |t: u32| {
            let mut h = TokenHasher::default();
            h.write_u32(t);
            h.finish()
        };
        // The host counts tokens up: a run of them fills a table's buckets evenly.
        let low: HashSet<u64> = (1..=1024).map(|t| hash(t) & 1023).collect();
        assert_eq!(low.len(), 1024);
        let high: HashSet<u64> = (1..=1024).map(|t| hash(t) >> 57).collect();
        assert!(high.len() >= 100, "{} of 128 top-7-bit values", high.len());
        let mut map: ByToken<u32> = ByToken::default();
        map.extend((1..=5000).map(|t| (t, t * 2)));
        assert!((1..=5000).all(|t| map.get(&t) == Some(&(t * 2))));
        assert_eq!(map.remove(&77), Some(154));
        assert_eq!(map.get(&77), None);
    }

    #[test]
    fn tokens_are_unique_and_hex() {
        let mut src = TokenSource::with_seed(1, 2);
        let mut seen = HashSet::new();
        for _ in 0..10_000 {
            let t = src.token();
            assert_eq!(t.len(), 32);
            assert!(t.bytes().all(|b| b.is_ascii_hexdigit()));
            assert!(seen.insert(t));
        }
        // Each of the two numbers as 16 lower-case hex digits, zeros kept.
        let (mut a, mut b) = (TokenSource::with_seed(3, 4), TokenSource::with_seed(3, 4));
        for _ in 0..1_000 {
            let (hi, lo) = (b.next_u64(), b.next_u64());
            assert_eq!(a.token(), format!("{hi:016x}{lo:016x}"));
        }
        let mut a = TokenSource::from_entropy(7);
        let mut b = TokenSource::from_entropy(7);
        assert_ne!(a.token(), b.token(), "separately seeded sources differ");
    }
}
