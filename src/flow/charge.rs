//! The charge of one request: what the response says it really cost (a response header, a
//! trailer, or a number in its JSON body), and the correction of the counters it consumed
//! from, sent from the root once the stream ends (nothing waits for it).

use super::admit::Admission;
use super::background::Background;
use super::context::{Pcx, Purpose};
use crate::config::{Charge, Policy};
use crate::flow::intake::parse_units;
use crate::idempotency::fingerprint::is_json;
use crate::lua::charge::{self, Correction};

/// Charges are capped here (the scripts count in Lua doubles).
const MAX_CHARGE: u64 = 1_000_000_000;

/// What the response said, per limit (policy order).
#[derive(Debug, Default)]
pub struct Meter {
    charges: Vec<Option<u64>>,
    /// The JSON body copied for `response_json` charges, while it is within their largest
    /// `max_body`.
    body: Option<Vec<u8>>,
    max_body: u64,
}

/// The value of `name` in `pairs` (any case), if it appears exactly once: a repeated one is
/// ambiguous, so not read.
fn single<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    let values = pairs
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str());
    crate::request::single(values).ok().flatten()
}

impl Meter {
    /// Whether any limit of `policy` is charged from the response.
    pub fn wanted(policy: &Policy) -> bool {
        policy.rate_limits.iter().any(|l| l.charge.is_some())
    }

    /// Whether the response's trailers are read for a charge.
    pub fn wants_trailers(policy: &Policy) -> bool {
        policy
            .rate_limits
            .iter()
            .any(|l| matches!(l.charge, Some(Charge::Trailer(_))))
    }

    /// Whether the response body is being copied.
    pub fn copying(&self) -> bool {
        self.body.is_some()
    }

    /// The response's headers: header charges are read; a JSON body is copied if it can fit.
    pub fn on_headers(&mut self, policy: &Policy, headers: &[(String, String)], end: bool) {
        self.charges = vec![None; policy.rate_limits.len()];
        let json = is_json(single(headers, "content-type"));
        let length = single(headers, "content-length").and_then(|v| v.trim().parse::<u64>().ok());
        self.max_body = 0;
        for (limit, charge) in policy.rate_limits.iter().zip(self.charges.iter_mut()) {
            match &limit.charge {
                Some(Charge::Header(name)) => *charge = single(headers, name).and_then(units),
                Some(Charge::Json { max_body, .. }) if json && !end => {
                    self.max_body = self.max_body.max(*max_body);
                }
                _ => {}
            }
        }
        let fits = length.is_none_or(|l| l <= self.max_body);
        self.body = (self.max_body > 0 && fits).then(Vec::new);
    }

    /// A piece of the response body (copied while within the largest `max_body`); at its end
    /// the JSON charges are read.
    pub fn on_body(&mut self, policy: &Policy, piece: &[u8], end: bool) {
        let Some(body) = self.body.as_mut() else {
            return;
        };
        if body.len().saturating_add(piece.len()) as u64 > self.max_body {
            self.body = None;
            return;
        }
        body.extend_from_slice(piece);
        if !end {
            return;
        }
        let body = self.body.take().unwrap_or_default();
        let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&body) else {
            return;
        };
        for (limit, charge) in policy.rate_limits.iter().zip(self.charges.iter_mut()) {
            if let Some(Charge::Json { pointer, max_body }) = &limit.charge {
                if body.len() as u64 <= *max_body {
                    *charge = doc.pointer(pointer).and_then(json_units);
                }
            }
        }
    }

    /// The response's trailers: trailer charges are read.
    pub fn on_trailers(&mut self, policy: &Policy, trailers: &[(String, String)]) {
        for (limit, charge) in policy.rate_limits.iter().zip(self.charges.iter_mut()) {
            if let Some(Charge::Trailer(name)) = &limit.charge {
                if let Some(v) = single(trailers, name) {
                    *charge = units(v);
                }
            }
        }
    }

    /// The corrections of the counters this request consumed from, one call per hash tag,
    /// counted: a limit without a charge keeps its admitted cost.
    pub fn corrections(&mut self, at: &Pcx<'_>, admission: &Admission) -> Vec<Background> {
        let charges = std::mem::take(&mut self.charges);
        let mut by_tag: Vec<(&str, Vec<Correction<'_>>)> = Vec::new();
        let limits = at.policy.rate_limits.iter().zip(admission.all());
        for (i, ((limit, slot), charge)) in limits.zip(charges).enumerate() {
            let Some(charge) = charge.filter(|_| slot.consumed && !slot.local) else {
                continue;
            };
            if let Some(lm) = at.pm.limits.get(i) {
                at.m.add(lm.charged, charge);
            }
            let delta = i64::try_from(charge).unwrap_or(i64::MAX)
                - i64::try_from(slot.cost).unwrap_or(i64::MAX);
            if delta == 0 {
                continue;
            }
            let c = Correction {
                key: slot.key.text(),
                limit,
                delta,
            };
            match by_tag.iter_mut().find(|(t, _)| *t == slot.key.tag()) {
                Some((_, cs)) => cs.push(c),
                None => by_tag.push((slot.key.tag(), vec![c])),
            }
        }
        by_tag
            .iter()
            .map(|(_, cs)| {
                Background::new(at.index, Purpose::Charge, charge::call(cs), String::new())
            })
            .collect()
    }
}

/// A charge spelled as a header or trailer value: plain decimal digits, capped.
fn units(v: &str) -> Option<u64> {
    parse_units(v.trim()).map(|n| n.min(MAX_CHARGE))
}

/// A charge in the JSON body: a non-negative whole number, capped.
fn json_units(v: &serde_json::Value) -> Option<u64> {
    if let Some(n) = v.as_u64() {
        return Some(n.min(MAX_CHARGE));
    }
    let f = v.as_f64()?;
    (f >= 0.0 && f.fract() == 0.0 && f.is_finite()).then(|| (f as u64).min(MAX_CHARGE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn policy(charge: &str) -> Policy {
        let text = format!(
            r#"{{"redis": {{"cluster": "gw"}}, "policies": [{{"name": "p", "rate_limits": [
              {{"name": "tokens", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1000,
               "window": "1m", "charge": {charge}}}]}}]}}"#
        );
        let mut c = Config::parse(text.as_bytes()).expect("valid");
        c.policies.remove(0)
    }

    fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn header_charge_is_read_once_and_strictly() {
        let p = policy(r#"{"response_header": "x-tokens-used"}"#);
        let mut m = Meter::default();
        for (value, want) in [
            ("300", Some(300)),
            (" 7 ", Some(7)),
            ("-1", None),
            ("1e3", None),
            ("", None),
            ("99999999999", None),
        ] {
            m.on_headers(&p, &h(&[("x-tokens-used", value)]), false);
            assert_eq!(m.charges, vec![want], "{value:?}");
        }
        m.on_headers(
            &p,
            &h(&[("x-tokens-used", "1"), ("x-tokens-used", "2")]),
            false,
        );
        assert_eq!(m.charges, vec![None], "a repeated header is ambiguous");
        m.on_headers(&p, &h(&[]), false);
        assert_eq!(m.charges, vec![None]);
    }

    #[test]
    fn json_charge_reads_the_pointer_within_max_body() {
        let p = policy(r#"{"response_json": "/usage/total_tokens", "max_body": 64}"#);
        let mut m = Meter::default();
        let json = h(&[("content-type", "application/json; charset=utf-8")]);
        m.on_headers(&p, &json, false);
        assert!(m.copying());
        m.on_body(&p, br#"{"usage": {"total_"#, false);
        m.on_body(&p, br#"tokens": 300}}"#, true);
        assert_eq!(m.charges, vec![Some(300)]);
        // Too large, not JSON, not a number, negative: no charge.
        m.on_headers(&p, &json, false);
        m.on_body(&p, &[b' '; 65], true);
        assert_eq!(m.charges, vec![None]);
        m.on_headers(&p, &h(&[("content-type", "text/plain")]), false);
        assert!(!m.copying());
        for body in [
            &br#"{"usage": {"total_tokens": "300"}}"#[..],
            br#"{"usage": {"total_tokens": -3}}"#,
            b"{",
        ] {
            m.on_headers(&p, &json, false);
            m.on_body(&p, body, true);
            assert_eq!(m.charges, vec![None]);
        }
        m.on_headers(
            &p,
            &h(&[
                ("content-type", "application/json"),
                ("content-length", "65"),
            ]),
            false,
        );
        assert!(!m.copying(), "content-length over max_body: not copied");
    }

    #[test]
    fn trailer_charge() {
        let p = policy(r#"{"trailer": "x-cost"}"#);
        let mut m = Meter::default();
        m.on_headers(&p, &h(&[("x-cost", "5")]), false);
        assert_eq!(
            m.charges,
            vec![None],
            "a trailer charge ignores the headers"
        );
        m.on_trailers(&p, &h(&[("x-cost", "12")]));
        assert_eq!(m.charges, vec![Some(12)]);
        assert!(Meter::wants_trailers(&p));
    }
}
