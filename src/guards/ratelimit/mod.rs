//! Rate limits of one request: which script calls to make, and what their replies mean.
//!
//! Keys, script arguments and the verdict. The calls themselves are planned by
//! [`crate::redis::scripts::acquire`], which groups limits by hash tag.

pub mod admission;
pub mod charge;
pub mod leased;
pub mod overlimit;

use crate::config::{Policy, RateLimit};
use crate::http::identity::Caller;
use crate::http::local_reply::{self, LocalResponse, Member, Problem, QuotaView};
use crate::http::request::Request;
use crate::http::selectors::selector_value;
use crate::redis::keys::{self, LimitKey};
use crate::redis::Words;
use crate::support::slots::SlotTable;
use crate::support::text::push_u64;
use std::cell::RefCell;
use std::rc::Rc;

/// The counter key of `limit` for this caller and request.
pub fn key(
    prefix: &str,
    policy: &Policy,
    limit: &RateLimit,
    caller: &Caller,
    req: &Request,
) -> LimitKey {
    keys::write_rate_limit_key(
        prefix,
        policy,
        limit,
        // The hash tag: the hashed tenant for tenant-scoped limits, else the policy.
        |k| {
            if limit.tenant_scoped() {
                keys::push_tenant_tag(k, &caller.tenant);
            } else {
                keys::push_policy_tag(k, &policy.name);
            }
        },
        |k| {
            keys::push_scope_hash(
                k,
                limit
                    .by
                    .iter()
                    .map(|sel| (sel, selector_value(sel, caller, req))),
            )
        },
    )
}

/// Rate-limit keys this worker built, by what they were built from: a key costs two SHA-256
/// digests, and the requests of one tenant build the same keys again and again.
///
/// A [`SlotTable`] indexed by a hash of the inputs; a slot stores the inputs in full, so a
/// colliding request rebuilds its key (and takes the slot) instead of reading another's.
pub struct KeyMemo {
    slots: SlotTable<Memo>,
}

/// A memo slot: the inputs a key was built from, and the key.
struct Memo {
    input: Vec<u8>,
    key: LimitKey,
}

/// Slots of [`KeyMemo`] per worker.
pub const KEY_MEMO_SLOTS: usize = 256;

/// Inputs longer than this (a long header value as a selector) are not memoised, so a slot
/// holds at most this plus a key (a few hundred bytes): the table stays around 100 KiB.
const MAX_MEMO_INPUT: usize = 256;

impl KeyMemo {
    pub fn new(slots: usize) -> KeyMemo {
        KeyMemo {
            slots: SlotTable::new(slots),
        }
    }

    /// [`key`] of limit `limit_index` of policy `policy_index`, from the table when this
    /// worker built it before.
    pub fn key(
        &self,
        prefix: &str,
        (policy_index, policy): (usize, &Policy),
        (limit_index, limit): (usize, &RateLimit),
        caller: &Caller,
        req: &Request,
    ) -> LimitKey {
        if self.slots.capacity() == 0 {
            return key(prefix, policy, limit, caller, req);
        }
        // Everything the key depends on besides the config (the tag is the tenant, one of the
        // selected values, or the policy), length-prefixed so that no two requests with
        // different inputs have the same bytes; written on the stack, copied only into a slot.
        let mut input = MemoInput::default();
        for n in [policy_index, limit_index] {
            input.push(&(n as u64).to_le_bytes());
        }
        for value in limit.by.iter().map(|sel| selector_value(sel, caller, req)) {
            match value {
                Some(v) => {
                    input.push(&[1]);
                    input.push(&(v.len() as u64).to_le_bytes());
                    input.push(v.as_bytes());
                }
                None => input.push(&[0]),
            }
        }
        let Some(input) = input.bytes() else {
            return key(prefix, policy, limit, caller, req);
        };
        // FNV-1a: the slot only needs spreading (the inputs are compared in full), and
        // SipHash costs more than the rest of the lookup.
        let hash = input.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let found = self.slots.update(hash, |slot| match slot {
            Some(memo) if memo.input == input => memo.key.clone(),
            _ => {
                let built = key(prefix, policy, limit, caller, req);
                *slot = Some(Memo {
                    input: input.to_vec(),
                    key: built.clone(),
                });
                built
            }
        });
        found.unwrap_or_else(|| key(prefix, policy, limit, caller, req))
    }
}

/// A memo lookup's inputs, at most [`MAX_MEMO_INPUT`] bytes (longer ones are not memoised).
struct MemoInput {
    bytes: [u8; MAX_MEMO_INPUT],
    len: usize,
    too_long: bool,
}

impl Default for MemoInput {
    fn default() -> MemoInput {
        MemoInput {
            bytes: [0; MAX_MEMO_INPUT],
            len: 0,
            too_long: false,
        }
    }
}

impl MemoInput {
    fn push(&mut self, more: &[u8]) {
        let end = self.len + more.len();
        match self.bytes.get_mut(self.len..end) {
            Some(room) if !self.too_long => {
                room.copy_from_slice(more);
                self.len = end;
            }
            _ => self.too_long = true,
        }
    }

    /// The inputs, unless they were too long to memoise.
    fn bytes(&self) -> Option<&[u8]> {
        if self.too_long {
            return None;
        }
        self.bytes.get(..self.len)
    }
}

/// The six per-limit arguments of `acquire.lua`; `cost`: this request's units.
pub fn push_limit_args(args: &mut Words, limit: &RateLimit, cost: u64) {
    args.push(limit.code());
    args.push_u64(limit.limit);
    args.push_u64(limit.window_ms);
    args.push_u64(limit.burst);
    args.push(if limit.shadow { "1" } else { "0" });
    args.push_u64(cost);
}

/// One limit's answer for this request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitState {
    pub allowed: bool,
    pub remaining: u64,
    pub reset_ms: u64,
    pub retry_after_ms: u64,
}

fn view<'a>((l, s): &(&'a RateLimit, &LimitState)) -> QuotaView<'a> {
    QuotaView {
        name: l.name.as_str(),
        policy: l.policy_item.as_str(),
        remaining: s.remaining,
        reset_ms: s.reset_ms,
    }
}

/// The request's verdict once every group answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Forward; add these `(name, value)` headers to the response if configured.
    Allow(Vec<(String, String)>),
    Reject(LocalResponse),
}

/// Decides from every limit's state (`states[i]` for `policy.rate_limits[i]`).
/// Rejected when any non-shadow limit rejected.
/// `None` is a limit whose state is unknown (the over-limit cache answered for another one):
/// it is left out of the headers. Concurrency limits are never in the `RateLimit` headers (the
/// draft defines no in-flight quota); a request only they reject gets `concurrency_limited`.
pub fn decide(policy: &Policy, states: &[Option<LimitState>]) -> Verdict {
    // Walked again where needed rather than collected: this runs for every request.
    let enforced = || {
        policy
            .rate_limits
            .iter()
            .zip(states)
            .filter_map(|(l, s)| Some((l, s.as_ref()?)))
            .filter(|(l, _)| !l.shadow)
    };
    let violated = || enforced().filter(|(_, s)| !s.allowed);
    let counted = || enforced().filter(|(l, _)| !l.concurrency());
    if violated().next().is_none() {
        let mut each = counted();
        let (p, r) = match (each.next(), each.next()) {
            (None, _) => return Verdict::Allow(Vec::new()),
            // The usual policy counts one limit: no list to sort.
            (Some(one), None) => local_reply::ratelimit_headers(&[view(&one)]),
            _ => {
                let mut views: Vec<QuotaView<'_>> = counted().map(|e| view(&e)).collect();
                views.sort_by_key(|v| v.remaining);
                local_reply::ratelimit_headers(&views)
            }
        };
        return Verdict::Allow(vec![
            ("ratelimit-policy".into(), p),
            ("ratelimit".into(), r),
        ]);
    }
    let names: Vec<&str> = violated().map(|(l, _)| l.name.as_str()).collect();
    if violated().all(|(l, _)| l.concurrency()) {
        return Verdict::Reject(concurrency_limited(policy, &names));
    }
    let retry_ms = violated()
        .map(|(_, s)| s.retry_after_ms)
        .max()
        .unwrap_or(1000);
    let mut views: Vec<QuotaView<'_>> = violated()
        .filter(|(l, _)| !l.concurrency())
        .map(|e| view(&e))
        .collect();
    views.extend(counted().filter(|(_, s)| s.allowed).map(|e| view(&e)));
    let (p, r) = local_reply::ratelimit_headers(&views);
    let retry_after = local_reply::whole_secs(retry_ms);
    let mut detail = String::with_capacity(96);
    detail.push_str("rate limit ");
    push_names(&mut detail, &names);
    detail.push_str(" of operation \"");
    detail.push_str(&policy.name);
    detail.push_str("\" exceeded; retry after ");
    push_u64(&mut detail, retry_after);
    detail.push_str(" s");
    let mut retry_after_value = String::with_capacity(8);
    push_u64(&mut retry_after_value, retry_after);
    Verdict::Reject(local_reply::problem(
        Problem::RateLimited,
        &detail,
        &[("violated-policies", Member::Strs(&names))],
        vec![
            ("retry-after".into(), retry_after_value),
            ("ratelimit-policy".into(), p),
            ("ratelimit".into(), r),
        ],
    ))
}

/// The `429` of a full concurrency limit: a slot frees when a request ends, so retry soon.
fn concurrency_limited(policy: &Policy, names: &[&str]) -> LocalResponse {
    let mut detail = String::with_capacity(96);
    detail.push_str("concurrency limit ");
    push_names(&mut detail, names);
    detail.push_str(" of operation \"");
    detail.push_str(&policy.name);
    detail.push_str("\" is full (too many requests in flight); retry after 1 s");
    local_reply::problem(
        Problem::ConcurrencyLimited,
        &detail,
        &[("violated-policies", Member::Strs(names))],
        vec![("retry-after".into(), "1".into())],
    )
}

/// The over-limit cache's last 429 per policy. Such a 429 depends on the policy, on which of
/// its limits the cache knows to reject and on each one's wait in whole seconds (its
/// `RateLimit` reset, and the largest as `Retry-After`), so the requests of a rejected tenant
/// within one second get the same answer: written once, copied after.
pub struct RejectionMemo {
    last: RefCell<Vec<Option<Rejection>>>,
}

/// A memoised 429 and each limit's wait in whole seconds it was written for (0: unknown).
struct Rejection {
    secs: Vec<u64>,
    response: Rc<LocalResponse>,
}

impl RejectionMemo {
    /// A memo for `policies` policies (one answer each).
    pub fn new(policies: usize) -> RejectionMemo {
        RejectionMemo {
            last: RefCell::new((0..policies).map(|_| None).collect()),
        }
    }

    /// The verdict on a request of policy `index` whose limits the over-limit cache knows:
    /// `waits[i]` is how long limit `i` still rejects, in ms (`None`: not known to reject;
    /// `Some` is never 0). Each known limit rejects with nothing remaining until its wait ends.
    /// `None` if that admits (no limit known to reject is enforced).
    pub fn cached(
        &self,
        index: usize,
        policy: &Policy,
        waits: &[Option<u64>],
    ) -> Option<Rc<LocalResponse>> {
        let secs = |w: &Option<u64>| w.map_or(0, local_reply::whole_secs);
        let written = || match decide(policy, &rejecting(waits)) {
            Verdict::Reject(response) => Some(Rc::new(response)),
            Verdict::Allow(_) => None,
        };
        let Ok(mut last) = self.last.try_borrow_mut() else {
            return written();
        };
        let Some(slot) = last.get_mut(index) else {
            return written();
        };
        if let Some(r) = slot.as_ref() {
            if r.secs.len() == waits.len() && r.secs.iter().zip(waits).all(|(s, w)| *s == secs(w)) {
                return Some(Rc::clone(&r.response));
            }
        }
        let response = written()?;
        *slot = Some(Rejection {
            secs: waits.iter().map(secs).collect(),
            response: Rc::clone(&response),
        });
        Some(response)
    }
}

/// The states of limits known to reject for `waits` ms (see [`RejectionMemo::cached`]).
fn rejecting(waits: &[Option<u64>]) -> Vec<Option<LimitState>> {
    waits
        .iter()
        .map(|w| {
            w.map(|wait| LimitState {
                allowed: false,
                remaining: 0,
                reset_ms: wait,
                retry_after_ms: wait,
            })
        })
        .collect()
}

/// `"a", "b"`
fn push_names(out: &mut String, names: &[&str]) {
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push('"');
        out.push_str(n);
        out.push('"');
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::Config;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A policy with one limit of each algorithm (one of them shadow), and one keyed by the
    /// client address only; the unit tests of this module and of `acquire` share it.
    pub(crate) fn config() -> Config {
        Config::parse(
            br#"{"redis": {"cluster": "gw", "key_prefix": "cg:demo"}, "policies": [
            {"name": "create-order", "rate_limits": [
              {"name": "tenant", "by": ["tenant"], "algorithm": "sliding_window", "limit": 100, "window": "1m"},
              {"name": "user-burst", "by": ["tenant", "principal"], "algorithm": "token_bucket", "limit": 10, "window": "1s", "burst": 20},
              {"name": "per-ip", "by": ["client_ip"], "algorithm": "fixed_window", "limit": 1000, "window": "1h", "shadow": true},
              {"name": "global", "by": [], "algorithm": "sliding_log", "limit": 5, "window": "250ms"}
            ]},
            {"name": "ip-only", "rate_limits": [
              {"name": "per-ip", "by": ["client_ip"], "algorithm": "fixed_window", "limit": 1000, "window": "1h"}
            ]}]}"#,
        )
        .expect("valid")
    }

    fn st(allowed: bool, remaining: u64, reset_ms: u64, retry_after_ms: u64) -> LimitState {
        LimitState {
            allowed,
            remaining,
            reset_ms,
            retry_after_ms,
        }
    }

    /// The memo answers what [`key`] builds: for every limit of the fixture (tenant,
    /// tenant + principal, client address, none), for inputs that would run together
    /// without length prefixes or are too long to memoise, and with one slot, so every other
    /// lookup collides.
    #[test]
    fn key_memo_gives_the_built_key() {
        let c = config();
        let policy = &c.policies[0];
        let request = |ip: Option<&str>| {
            Request::from_headers(
                vec![
                    (":method".into(), "POST".into()),
                    (":path".into(), "/o".into()),
                ],
                ip,
            )
        };
        // Too long to memoise: built each time.
        let long = "t".repeat(MAX_MEMO_INPUT);
        let inputs = [
            (long.as_str(), "c", None),
            ("ab", "c", Some("10.0.0.1:1")),
            ("a", "bc", Some("10.0.0.1:1")),
            ("ab", "c", None),
            ("", "", Some("10.0.0.2:2")),
            ("ab", "c", Some("10.0.0.1:1")),
        ];
        for slots in [0, 1, 256] {
            let memo = KeyMemo::new(slots);
            for round in 0..2 {
                for (tenant, principal, ip) in inputs {
                    let caller = Caller {
                        tenant: tenant.into(),
                        principal: principal.into(),
                    };
                    let req = request(ip);
                    for (i, limit) in policy.rate_limits.iter().enumerate() {
                        assert_eq!(
                            memo.key("cg", (0, policy), (i, limit), &caller, &req),
                            key("cg", policy, limit, &caller, &req),
                            "slots {slots}, round {round}, {tenant:?}/{principal:?}/{ip:?}, limit {i}"
                        );
                    }
                }
            }
        }
        // Two keys of different limits never share a memo entry.
        let memo = KeyMemo::new(256);
        let caller = Caller {
            tenant: "t".into(),
            principal: "p".into(),
        };
        let req = request(None);
        let keys: Vec<String> = policy
            .rate_limits
            .iter()
            .enumerate()
            .map(|l| {
                memo.key("cg", (0, policy), l, &caller, &req)
                    .text()
                    .to_string()
            })
            .collect();
        let mut unique = keys.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), keys.len(), "{keys:?}");
    }

    #[test]
    fn allow_lists_most_restrictive_first_and_hides_shadow() {
        let c = config();
        let verdict = decide(
            &c.policies[0],
            &[
                Some(st(true, 50, 30_000, 0)),
                Some(st(true, 3, 700, 0)),
                Some(st(false, 0, 10, 10)),
                Some(st(true, 4, 250, 0)),
            ],
        );
        assert_eq!(
            verdict,
            Verdict::Allow(vec![
                (
                    "ratelimit-policy".into(),
                    "\"user-burst\";q=10;w=1, \"global\";q=5;w=1, \"tenant\";q=100;w=60".into()
                ),
                (
                    "ratelimit".into(),
                    "\"user-burst\";r=3;t=1, \"global\";r=4;t=1, \"tenant\";r=50;t=30".into()
                ),
            ])
        );
    }

    #[test]
    fn reject_names_violated_limits() {
        let c = config();
        let verdict = decide(
            &c.policies[0],
            &[
                Some(st(false, 0, 16_200, 16_200)),
                Some(st(true, 3, 700, 0)),
                Some(st(true, 1, 10, 0)),
                Some(st(false, 0, 200, 120)),
            ],
        );
        let Verdict::Reject(r) = verdict else {
            panic!("expected a rejection");
        };
        assert_eq!(r.status, 429);
        assert_eq!(r.header("retry-after"), Some("17"));
        assert_eq!(
            r.header("ratelimit-policy"),
            Some("\"tenant\";q=100;w=60, \"global\";q=5;w=1, \"user-burst\";q=10;w=1")
        );
        assert_eq!(
            r.header("ratelimit"),
            Some("\"tenant\";r=0;t=17, \"global\";r=0;t=1, \"user-burst\";r=3;t=1")
        );
        let body: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(
            body["violated-policies"],
            serde_json::json!(["tenant", "global"])
        );
        assert_eq!(body["status"], serde_json::json!(429));
    }

    #[test]
    fn shadow_over_limit_never_rejects() {
        let c = config();
        let verdict = decide(
            &c.policies[0],
            &[
                Some(st(true, 1, 1, 0)),
                Some(st(true, 1, 1, 0)),
                Some(st(false, 0, 5, 5)),
                Some(st(true, 1, 1, 0)),
            ],
        );
        assert!(matches!(verdict, Verdict::Allow(_)));
    }

    /// The memo answers exactly what the verdict would say, for every combination of limits
    /// known to reject and waits around whole seconds (within a second, across one, a limit
    /// joining or leaving, the shadow limit, a second policy): a stale `Retry-After` or
    /// `RateLimit` never goes out. Within one second of every wait the answer is shared.
    #[test]
    fn rejection_memo_answers_what_the_verdict_says() {
        let c = config();
        let memo = RejectionMemo::new(c.policies.len());
        let waits_ms = [
            1, 999, 1000, 1001, 1999, 2000, 2001, 59_999, 60_000, 3_600_000,
        ];
        let mut cases: Vec<(usize, Vec<Option<u64>>)> = Vec::new();
        for &a in &waits_ms {
            for &b in &waits_ms {
                cases.push((0, vec![Some(a), None, None, Some(b)]));
                cases.push((0, vec![None, Some(a), None, None]));
                cases.push((0, vec![Some(a), Some(b), Some(a), None]));
                cases.push((1, vec![Some(b)]));
            }
            cases.push((0, vec![None, None, Some(a), None]));
        }
        for (index, waits) in cases.iter().chain(cases.iter().rev()) {
            let policy = &c.policies[*index];
            let fresh = match decide(policy, &rejecting(waits)) {
                Verdict::Reject(r) => Some(r),
                Verdict::Allow(_) => None,
            };
            let memoised = memo.cached(*index, policy, waits);
            assert_eq!(
                memoised.as_deref(),
                fresh.as_ref(),
                "policy {index}, waits {waits:?}"
            );
        }
        let policy = &c.policies[0];
        let first = memo.cached(0, policy, &[Some(1_001), None, None, None]);
        let same_second = memo.cached(0, policy, &[Some(1_999), None, None, None]);
        let next_second = memo.cached(0, policy, &[Some(2_001), None, None, None]);
        let (Some(first), Some(same), Some(next)) = (first, same_second, next_second) else {
            panic!("each rejects");
        };
        assert!(Rc::ptr_eq(&first, &same), "one answer within a second");
        assert_eq!(next.header("retry-after"), Some("3"));
        assert_eq!(first.header("retry-after"), Some("2"));
        assert!(
            memo.cached(0, policy, &[None, None, Some(5), None])
                .is_none(),
            "the shadow limit alone admits"
        );
        assert!(
            RejectionMemo::new(0)
                .cached(0, policy, &[Some(5), None, None, None])
                .is_some(),
            "a policy beyond the memo is answered unmemoised"
        );
    }
}
