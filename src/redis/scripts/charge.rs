//! The contract of `charge.lua`: after the response, each counter of one hash slot moves by
//! the difference between what the response says the request cost and what it consumed at
//! admission (never below zero).

use crate::config::{Quota, RateLimit};
use crate::redis::{keys, ScriptCall, Words};

/// One counter to correct: its key, its limit, the tenant's own quota it was counted with at
/// admission (an override; `None`: the configuration's), and `charge - cost` (may be
/// negative).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Correction<'a> {
    pub(crate) key: &'a str,
    pub(crate) limit: &'a RateLimit,
    pub(crate) quota: Option<Quota>,
    pub(crate) delta: i64,
}

/// The call for the corrections of one hash slot (at least one).
pub(crate) fn call(corrections: &[Correction<'_>]) -> ScriptCall {
    let mut args = Words::with_capacity(1 + 4 * corrections.len(), 48 * corrections.len());
    args.push_u64(corrections.len() as u64);
    for c in corrections {
        args.push(keys::limit_code(c.limit));
        match c.quota {
            Some(quota) => {
                args.push_u64(quota.limit);
                args.push_u64(quota.window_ms);
            }
            None => {
                args.push_u64(c.limit.limit);
                // A calendar-aligned limit: its spec (it has no overrides).
                super::acquire::push_window(&mut args, c.limit);
            }
        }
        args.push_i64(c.delta);
    }
    let keys: Words = corrections.iter().map(|c| c.key).collect();
    ScriptCall::new(keys, args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn arguments() {
        let c = Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "p", "rate_limits": [
              {"name": "tokens", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1000,
               "window": "1m", "charge": {"response_header": "x-tokens-used"}}]}]}"#,
        )
        .expect("valid");
        let limit = &c.policies[0].rate_limits[0];
        let call = call(&[Correction {
            key: "k",
            limit,
            quota: None,
            delta: -5,
        }]);
        assert_eq!(call.keys, vec!["k"]);
        assert_eq!(call.args, vec!["1", "fw", "1000", "60000", "-5"]);
        // Counted with a tenant's own quota at admission: corrected with it.
        let own = Quota {
            limit: 50,
            window_ms: 1_000,
        };
        let call = super::call(&[Correction {
            key: "k",
            limit,
            quota: Some(own),
            delta: 2,
        }]);
        assert_eq!(call.args, vec!["1", "fw", "50", "1000", "2"]);
    }

    #[test]
    fn a_calendar_window_is_corrected_with_its_spec() {
        let c = Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [{"name": "p", "rate_limits": [
              {"name": "tokens", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1000,
               "window": "1d", "align": "calendar", "zone": "-05:00",
               "charge": {"response_header": "x-tokens-used"}}]}]}"#,
        )
        .expect("valid");
        let call = call(&[Correction {
            key: "k",
            limit: &c.policies[0].rate_limits[0],
            quota: None,
            delta: 7,
        }]);
        assert_eq!(call.args, vec!["1", "fw", "1000", "1d@-18000", "7"]);
    }
}
