//! The charge of one request: what the response says it really cost (a response header, a
//! trailer, a number in its JSON body, or a number in the last event of an event stream that
//! carries it, each body read by a streaming scan that keeps nothing of it), or, when that
//! cannot be read, the limit's `unreadable` fallback (`missing` for an event stream that
//! ended without its number); and the correction of the counters it consumed from, sent from
//! the root once the stream ends (nothing waits for it).

use crate::config::{ChargeSource, Policy};
use crate::guards::background::Background;
use crate::guards::context::{Pcx, Purpose};
use crate::guards::idempotency::fingerprint::is_json;
use crate::guards::ratelimit::admission::Admission;
use crate::redis::scripts::charge::{self, Correction};
use crate::support::jsonscan::{Scan, Unreadable};
use crate::support::sse::{EventStream, Events};
use crate::support::text::media_type;

/// Charges are capped here (the scripts count in Lua doubles).
const MAX_CHARGE: u64 = 1_000_000_000;

/// What a limit's charge came to, as far as the response has said.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Reading {
    /// Nothing to charge: no `charge` on the limit, or the request never reached the upstream
    /// (Envoy answered itself before sending it), so its admitted cost stands.
    #[default]
    Nothing,
    /// Still to come: a trailer, a JSON body or an event stream still passing. At the stream's
    /// end a trailer or a JSON body is unreadable, an event stream what its events said.
    Pending,
    Read(u64),
    /// The response does not say (or not in a way that can be read): the fallback applies.
    Unreadable,
    /// An event stream that ended (or was cut, or never came) before any of its events
    /// carried the number: `missing` applies.
    Missing,
}

/// A JSON body's scan (a `response_json` charge, or a `response_sse_json` charge whose
/// response is JSON rather than a stream).
#[derive(Debug)]
struct BodyScan {
    limit: usize,
    max_body: u64,
    scan: Scan,
}

/// A `response_sse_json` charge reading an event stream: the scan of the current event's
/// data, and what the last event that carried the pointer said.
#[derive(Debug)]
struct EventRead {
    limit: usize,
    scan: Scan,
    /// `Read(n)`, or `Unreadable` when the last event carrying the pointer had something
    /// there that is not a charge; `None` until an event carries it.
    last: Option<Reading>,
}

/// What the response said, per limit (policy order).
#[derive(Debug, Default)]
pub(crate) struct Meter {
    readings: Vec<Reading>,
    /// The scans of the JSON charges still reading the body.
    scans: Vec<BodyScan>,
    /// Body bytes seen so far.
    body: u64,
    /// The event stream, read once for every `response_sse_json` charge of the policy.
    stream: EventStream,
    /// The event-stream charges still reading it.
    events: Vec<EventRead>,
}

/// How the response came about, as the charge needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// The upstream's own response.
    Upstream,
    /// Envoy's answer for a request it never sent upstream: nothing was used.
    NeverSent,
    /// Envoy's answer after the request went upstream (a timeout, a reset): what it cost
    /// cannot be read.
    Failed,
}

/// The value of `name` in `pairs` (any case), if it appears exactly once: a repeated one is
/// ambiguous, so not read.
fn single<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    let values = pairs
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str());
    crate::http::request::single(values).ok().flatten()
}

/// Whether the body is sent as it is (no `content-encoding`, or `identity` only): a
/// compressed body is not read.
fn plain_coding(headers: &[(String, String)]) -> bool {
    headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("content-encoding"))
        .all(|(_, v)| {
            v.split(',')
                .all(|c| c.trim().eq_ignore_ascii_case("identity"))
        })
}

/// The JSON pointer limit `limit` of `policy` reads, if it reads one.
fn pointer_of(policy: &Policy, limit: usize) -> Option<&crate::config::Pointer> {
    policy
        .rate_limits
        .get(limit)?
        .charge
        .as_ref()?
        .source
        .pointer()
}

/// The event-stream charges reading one event's data as the stream passes.
struct EventSink<'a> {
    policy: &'a Policy,
    reads: &'a mut [EventRead],
}

impl Events for EventSink<'_> {
    fn data(&mut self, bytes: &[u8]) {
        for r in self.reads.iter_mut() {
            if let Some(pointer) = pointer_of(self.policy, r.limit) {
                r.scan.feed(pointer, bytes);
            }
        }
    }

    /// An event is complete: one whose data is JSON with something at the pointer replaces
    /// what the earlier ones said; any other (not JSON, such as OpenAI's `[DONE]`, or nothing
    /// at the pointer) says nothing.
    fn dispatch(&mut self) {
        for r in self.reads.iter_mut() {
            let said = match r.scan.finish() {
                Ok(number) => Some(read(Some(number))),
                Err(Unreadable::Repeated | Unreadable::NotANumber | Unreadable::LongNumber) => {
                    Some(Reading::Unreadable)
                }
                Err(
                    Unreadable::Invalid
                    | Unreadable::Incomplete
                    | Unreadable::TooDeep
                    | Unreadable::Missing,
                ) => None,
            };
            if said.is_some() {
                r.last = said;
            }
            r.scan = Scan::new();
        }
    }
}

impl Meter {
    /// Whether any limit of `policy` is charged from the response.
    pub(crate) fn wanted(policy: &Policy) -> bool {
        policy.rate_limits.iter().any(|l| l.charge.is_some())
    }

    /// Whether the response's trailers are read for a charge.
    pub(crate) fn wants_trailers(policy: &Policy) -> bool {
        policy.rate_limits.iter().any(|l| {
            l.charge
                .as_ref()
                .is_some_and(|c| matches!(c.source, ChargeSource::Trailer(_)))
        })
    }

    /// Whether the response body is being read (a JSON charge's scan, an event stream's).
    pub(crate) fn scanning(&self) -> bool {
        !self.scans.is_empty() || !self.events.is_empty()
    }

    /// The response's headers: header charges are read, a JSON body is scanned if it can be
    /// read (JSON, not compressed, within `max_body`), an event stream is read if it is not
    /// compressed, and a response that ends here has its trailer charges in its headers (a
    /// trailers-only answer).
    pub(crate) fn on_headers(
        &mut self,
        policy: &Policy,
        headers: &[(String, String)],
        end: bool,
        origin: Origin,
    ) {
        self.readings.clear();
        self.scans.clear();
        self.events.clear();
        self.stream = EventStream::new();
        self.body = 0;
        let content_type = single(headers, "content-type");
        let plain = plain_coding(headers);
        let json = is_json(content_type) && plain;
        let events =
            content_type.is_some_and(|t| media_type(t).eq_ignore_ascii_case("text/event-stream"));
        let length = single(headers, "content-length").and_then(|v| v.trim().parse::<u64>().ok());
        for (i, limit) in policy.rate_limits.iter().enumerate() {
            let Some(charge) = &limit.charge else {
                self.readings.push(Reading::Nothing);
                continue;
            };
            let reading = match (&charge.source, origin) {
                (_, Origin::NeverSent) => Reading::Nothing,
                // The upstream never answered: no event carried the usage.
                (ChargeSource::SseJson { .. }, Origin::Failed) => Reading::Missing,
                (_, Origin::Failed) => Reading::Unreadable,
                (ChargeSource::Header(name), _) => read(single(headers, name)),
                (ChargeSource::Trailer(name), _) if end => read(single(headers, name)),
                (ChargeSource::Trailer(_), _) => Reading::Pending,
                (ChargeSource::SseJson { .. }, _) if events => {
                    if end {
                        Reading::Missing
                    } else if plain {
                        self.events.push(EventRead {
                            limit: i,
                            scan: Scan::new(),
                            last: None,
                        });
                        Reading::Pending
                    } else {
                        Reading::Unreadable
                    }
                }
                (
                    ChargeSource::Json { max_body, .. } | ChargeSource::SseJson { max_body, .. },
                    _,
                ) => {
                    if json && !end && length.is_none_or(|l| l <= *max_body) {
                        self.scans.push(BodyScan {
                            limit: i,
                            max_body: *max_body,
                            scan: Scan::new(),
                        });
                        Reading::Pending
                    } else {
                        Reading::Unreadable
                    }
                }
            };
            self.readings.push(reading);
        }
    }

    /// A piece of the response body (`None`: one that could not be read, so the scans give
    /// up); at its end the JSON and event-stream charges are read.
    pub(crate) fn on_body(&mut self, policy: &Policy, piece: Option<&[u8]>, end: bool) {
        if !self.scanning() {
            return;
        }
        let Some(piece) = piece else {
            return self.give_up();
        };
        self.body = self.body.saturating_add(piece.len() as u64);
        let body = self.body;
        let readings = &mut self.readings;
        self.scans.retain_mut(|s| {
            let (Some(pointer), Some(reading)) =
                (pointer_of(policy, s.limit), readings.get_mut(s.limit))
            else {
                return false;
            };
            if body > s.max_body {
                *reading = Reading::Unreadable;
                return false;
            }
            s.scan.feed(pointer, piece);
            if s.scan.failed() {
                *reading = Reading::Unreadable;
                return false;
            }
            true
        });
        if !self.events.is_empty() {
            let mut sink = EventSink {
                policy,
                reads: &mut self.events,
            };
            self.stream.feed(piece, &mut sink);
        }
        if end {
            self.body_ended();
        }
    }

    /// The body ended: each scan's reading, and what each event stream's events said (an
    /// event the stream ended in the middle of is not read).
    fn body_ended(&mut self) {
        for s in self.scans.drain(..) {
            if let Some(reading) = self.readings.get_mut(s.limit) {
                *reading = match s.scan.finish() {
                    Ok(number) => read(Some(number)),
                    Err(_) => Reading::Unreadable,
                };
            }
        }
        self.events_ended();
    }

    /// The event stream is over (ended, cut, or the request's stream is gone): what its last
    /// event carrying the pointer said, else missing.
    fn events_ended(&mut self) {
        for e in self.events.drain(..) {
            if let Some(reading) = self.readings.get_mut(e.limit) {
                *reading = e.last.unwrap_or(Reading::Missing);
            }
        }
    }

    /// The body cannot be read any further (the worker's memory budget): the JSON and
    /// event-stream charges are unreadable.
    pub(crate) fn give_up(&mut self) {
        let limits = self.scans.drain(..).map(|s| s.limit);
        let limits = limits.chain(self.events.drain(..).map(|e| e.limit));
        for limit in limits {
            if let Some(reading) = self.readings.get_mut(limit) {
                *reading = Reading::Unreadable;
            }
        }
    }

    /// The response's trailers (its body has ended): trailer charges are read.
    pub(crate) fn on_trailers(&mut self, policy: &Policy, trailers: &[(String, String)]) {
        self.body_ended();
        for (limit, reading) in policy.rate_limits.iter().zip(self.readings.iter_mut()) {
            if let Some(ChargeSource::Trailer(name)) = limit.charge.as_ref().map(|c| &c.source) {
                if *reading == Reading::Pending {
                    *reading = read(single(trailers, name));
                }
            }
        }
    }

    /// The corrections of the counters this request consumed from, one call per hash tag,
    /// counted: an event stream cut before its end is charged what its events said so far
    /// (`missing` if none carried the number); any other charge still pending (the response
    /// did not end, or said nothing) is unreadable and charged the limit's fallback; a limit
    /// without a charge keeps its admitted cost.
    pub(crate) fn corrections(&mut self, at: &Pcx<'_>, admission: &Admission) -> Vec<Background> {
        self.events_ended();
        let readings = std::mem::take(&mut self.readings);
        self.scans.clear();
        let mut by_tag: Vec<(&str, Vec<Correction<'_>>)> = Vec::new();
        let limits = at.policy.rate_limits.iter().zip(admission.all());
        for (i, (limit, slot)) in limits.enumerate() {
            let (Some(c), true) = (&limit.charge, slot.consumed && !slot.local) else {
                continue;
            };
            // No reading at all: the response's headers never came.
            let reading = readings.get(i).copied().unwrap_or(match c.source {
                ChargeSource::SseJson { .. } => Reading::Missing,
                _ => Reading::Pending,
            });
            let lm = at.pm.limits.get(i);
            let charge = match reading {
                Reading::Nothing => continue,
                Reading::Read(n) => n,
                Reading::Pending | Reading::Unreadable => {
                    if let Some(lm) = lm {
                        at.m.increment(lm.charge_unreadable);
                    }
                    c.unreadable.units(slot.cost)
                }
                Reading::Missing => {
                    if let Some(lm) = lm {
                        at.m.increment(lm.charge_missing);
                    }
                    match c.source {
                        ChargeSource::SseJson { missing, .. } => missing.units(slot.cost),
                        _ => slot.cost,
                    }
                }
            };
            if let Some(lm) = lm {
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
                quota: slot.state.and_then(|s| s.quota),
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

/// A charge as the response spells it, in a header, a trailer or a JSON number alike: plain
/// decimal digits (at most 10, capped at 10⁹); anything else (a sign, a fraction, an
/// exponent, a repeated header) is unreadable.
fn read(value: Option<&str>) -> Reading {
    match value.and_then(|v| parse_units(v.trim())) {
        Some(n) => Reading::Read(n.min(MAX_CHARGE)),
        None => Reading::Unreadable,
    }
}

/// Plain decimal digits only (no sign, no spaces inside, no exponent), at most 10 of them.
pub(crate) fn parse_units(v: &str) -> Option<u64> {
    if v.is_empty() || v.len() > 10 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
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

    const JSON: &[(&str, &str)] = &[("content-type", "application/json; charset=utf-8")];

    /// What `body` (in one piece, then its end) reads as under `p`.
    fn json_reading(p: &Policy, headers: &[(&str, &str)], body: &[u8]) -> Vec<Reading> {
        let mut m = Meter::default();
        m.on_headers(p, &h(headers), false, Origin::Upstream);
        m.on_body(p, Some(body), true);
        m.readings
    }

    #[test]
    fn header_charge_is_read_once_and_strictly() {
        let p = policy(r#"{"response_header": "x-tokens-used"}"#);
        let mut m = Meter::default();
        for (value, want) in [
            ("300", Reading::Read(300)),
            (" 7 ", Reading::Read(7)),
            ("9999999999", Reading::Read(MAX_CHARGE)),
            ("-1", Reading::Unreadable),
            ("1e3", Reading::Unreadable),
            ("5.0", Reading::Unreadable),
            ("", Reading::Unreadable),
            ("99999999999", Reading::Unreadable),
        ] {
            m.on_headers(&p, &h(&[("x-tokens-used", value)]), false, Origin::Upstream);
            assert_eq!(m.readings, vec![want], "{value:?}");
        }
        m.on_headers(
            &p,
            &h(&[("x-tokens-used", "1"), ("x-tokens-used", "2")]),
            false,
            Origin::Upstream,
        );
        assert_eq!(
            m.readings,
            vec![Reading::Unreadable],
            "a repeated header is ambiguous"
        );
        m.on_headers(&p, &h(&[]), false, Origin::Upstream);
        assert_eq!(m.readings, vec![Reading::Unreadable]);
        m.on_headers(&p, &h(&[("x-tokens-used", "3")]), false, Origin::NeverSent);
        assert_eq!(
            m.readings,
            vec![Reading::Nothing],
            "never sent: nothing used"
        );
        m.on_headers(&p, &h(&[("x-tokens-used", "3")]), false, Origin::Failed);
        assert_eq!(m.readings, vec![Reading::Unreadable]);
    }

    #[test]
    fn json_charge_follows_the_header_rule() {
        let p = policy(r#"{"response_json": "/usage/total_tokens", "max_body": 64}"#);
        let mut m = Meter::default();
        m.on_headers(&p, &h(JSON), false, Origin::Upstream);
        assert!(m.scanning());
        m.on_body(&p, Some(br#"{"usage": {"total_"#), false);
        m.on_body(&p, Some(br#"tokens": 300}}"#), true);
        assert_eq!(m.readings, vec![Reading::Read(300)]);
        assert!(!m.scanning());
        for (body, want) in [
            (&br#"{"usage":{"total_tokens":0}}"#[..], Reading::Read(0)),
            (
                br#"{"usage":{"total_tokens":9999999999}}"#,
                Reading::Read(MAX_CHARGE),
            ),
            (br#"{"usage":{"total_tokens":"300"}}"#, Reading::Unreadable),
            (br#"{"usage":{"total_tokens":-3}}"#, Reading::Unreadable),
            (br#"{"usage":{"total_tokens":5.0}}"#, Reading::Unreadable),
            (br#"{"usage":{"total_tokens":0.5e1}}"#, Reading::Unreadable),
            (br#"{"usage":{"total_tokens":1e30}}"#, Reading::Unreadable),
            (
                br#"{"usage":{"total_tokens":99999999999}}"#,
                Reading::Unreadable,
            ),
            (
                br#"{"usage":{"total_tokens":5,"total_tokens":5}}"#,
                Reading::Unreadable,
            ),
            (br#"{"usage":{}}"#, Reading::Unreadable),
            (b"{", Reading::Unreadable),
            (&[b' '; 65], Reading::Unreadable),
        ] {
            assert_eq!(
                json_reading(&p, JSON, body),
                vec![want],
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn a_body_the_scan_cannot_read_is_unreadable_at_once() {
        let p = policy(r#"{"response_json": "/usage/total_tokens", "max_body": 64}"#);
        let body = br#"{"usage":{"total_tokens":3}}"#;
        for headers in [
            &[("content-type", "text/event-stream")][..],
            &[("content-type", "text/plain")],
            &[],
            &[
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
            ],
            &[
                ("content-type", "application/json"),
                ("content-encoding", "identity, br"),
            ],
            &[
                ("content-type", "application/json"),
                ("content-length", "65"),
            ],
            &[
                ("content-type", "application/json"),
                ("content-type", "application/json"),
            ],
        ] {
            let mut m = Meter::default();
            m.on_headers(&p, &h(headers), false, Origin::Upstream);
            assert!(!m.scanning(), "{headers:?}");
            assert_eq!(m.readings, vec![Reading::Unreadable], "{headers:?}");
        }
        let identity = [
            ("content-type", "application/json"),
            ("content-encoding", "Identity"),
        ];
        assert_eq!(json_reading(&p, &identity, body), vec![Reading::Read(3)]);
        // The response ended at its headers: no body to read.
        let mut m = Meter::default();
        m.on_headers(&p, &h(JSON), true, Origin::Upstream);
        assert_eq!(m.readings, vec![Reading::Unreadable]);
        // Past max_body while it passes, or a piece the worker could not read.
        let mut m = Meter::default();
        m.on_headers(&p, &h(JSON), false, Origin::Upstream);
        m.on_body(&p, Some(&[b' '; 60]), false);
        assert!(m.scanning());
        m.on_body(&p, Some(&[b' '; 5]), false);
        assert!(!m.scanning());
        assert_eq!(m.readings, vec![Reading::Unreadable]);
        m.on_headers(&p, &h(JSON), false, Origin::Upstream);
        m.on_body(&p, None, false);
        assert_eq!(m.readings, vec![Reading::Unreadable]);
        // Cut short: still pending when the stream ends.
        m.on_headers(&p, &h(JSON), false, Origin::Upstream);
        m.on_body(&p, Some(br#"{"usage":{"total_tokens":3}}"#), false);
        assert_eq!(m.readings, vec![Reading::Pending]);
    }

    const SSE: &[(&str, &str)] = &[("content-type", "text/event-stream")];

    /// What the event stream `pieces` reads as under `p`: at its end if `end`, else cut.
    fn sse_reading(p: &Policy, headers: &[(&str, &str)], pieces: &[&[u8]], end: bool) -> Reading {
        let mut m = Meter::default();
        m.on_headers(p, &h(headers), false, Origin::Upstream);
        for (i, piece) in pieces.iter().enumerate() {
            m.on_body(p, Some(piece), end && i + 1 == pieces.len());
        }
        m.events_ended();
        assert_eq!(m.readings.len(), 1);
        m.readings[0]
    }

    #[test]
    fn an_event_stream_charge_is_the_last_event_carrying_the_pointer() {
        let p = policy(r#"{"response_sse_json": "/usage/total_tokens"}"#);
        let mut m = Meter::default();
        m.on_headers(&p, &h(SSE), false, Origin::Upstream);
        assert!(m.scanning());
        assert_eq!(m.readings, vec![Reading::Pending]);
        for (stream, want) in [
            (
                &b"data: {\"usage\":{\"total_tokens\":3}}\n\ndata: [DONE]\n\n"[..],
                Reading::Read(3),
            ),
            // The last one carrying it wins; events without it (or not JSON) say nothing.
            (
                b"data: {\"usage\":{\"total_tokens\":3}}\n\ndata: {\"usage\":{\"total_tokens\":8}}\n\ndata: {\"usage\":null}\n\ndata: [DONE]\n\n",
                Reading::Read(8),
            ),
            // Lines joined with LF, CR and CRLF line ends, comments and other fields.
            (
                b": hi\r\nevent: usage\r\ndata: {\"usage\":\r\ndata: {\"total_tokens\":\rdata: 12}}\r\n\r\n",
                Reading::Read(12),
            ),
            (
                b"data: {\"usage\":{\"total_tokens\":9999999999}}\n\n",
                Reading::Read(MAX_CHARGE),
            ),
            // Carried, but not a charge: unreadable, unless a later event says better.
            (
                b"data: {\"usage\":{\"total_tokens\":5.0}}\n\n",
                Reading::Unreadable,
            ),
            (
                b"data: {\"usage\":{\"total_tokens\":\"5\"}}\n\n",
                Reading::Unreadable,
            ),
            (
                b"data: {\"usage\":{\"total_tokens\":5,\"total_tokens\":6}}\n\n",
                Reading::Unreadable,
            ),
            (
                b"data: {\"usage\":{\"total_tokens\":-1}}\n\ndata: {\"usage\":{\"total_tokens\":4}}\n\n",
                Reading::Read(4),
            ),
            (
                b"data: {\"usage\":{\"total_tokens\":4}}\n\ndata: {\"usage\":{\"total_tokens\":null}}\n\n",
                Reading::Unreadable,
            ),
            // Not carried at all: missing.
            (b"data: {\"usage\":{}}\n\ndata: [DONE]\n\n", Reading::Missing),
            (b"data: {\"usage\":{\"total_tokens\":3}\n\n", Reading::Missing),
            (b"data: {\"usage\":{\"total_tokens\":3}}x\n\n", Reading::Missing),
            (b"data: {\"usage\":{\"total_tokens\":3}}\n", Reading::Missing),
            (b"Data: {\"usage\":{\"total_tokens\":3}}\n\n", Reading::Missing),
            (b"", Reading::Missing),
        ] {
            let whole = sse_reading(&p, SSE, &[stream], true);
            assert_eq!(whole, want, "{:?}", String::from_utf8_lossy(stream));
            let bytes: Vec<&[u8]> = stream.chunks(1).collect();
            assert_eq!(sse_reading(&p, SSE, &bytes, true), want, "byte by byte");
        }
        // Cut: what the events said so far.
        let usage = b"data: {\"usage\":{\"total_tokens\":3}}\n\n";
        assert_eq!(sse_reading(&p, SSE, &[usage], false), Reading::Read(3));
        assert_eq!(
            sse_reading(&p, SSE, &[&usage[..20]], false),
            Reading::Missing
        );
    }

    #[test]
    fn an_event_stream_charge_is_read_only_from_a_plain_stream_or_json() {
        let p = policy(r#"{"response_sse_json": "/usage/total_tokens", "max_body": 64}"#);
        let event = &b"data: {\"usage\":{\"total_tokens\":3}}\n\n"[..];
        let json = &br#"{"usage":{"total_tokens":3}}"#[..];
        for (headers, body, want) in [
            (
                &[("content-type", "Text/Event-Stream; charset=utf-8")][..],
                event,
                Reading::Read(3),
            ),
            (
                &[
                    ("content-type", "text/event-stream"),
                    ("content-encoding", "identity"),
                ],
                event,
                Reading::Read(3),
            ),
            (
                &[
                    ("content-type", "text/event-stream"),
                    ("content-encoding", "gzip"),
                ],
                event,
                Reading::Unreadable,
            ),
            (
                &[
                    ("content-type", "text/event-stream"),
                    ("content-type", "text/event-stream"),
                ],
                event,
                Reading::Unreadable,
            ),
            (JSON, json, Reading::Read(3)),
            (
                &[
                    ("content-type", "application/json"),
                    ("content-encoding", "br"),
                ],
                json,
                Reading::Unreadable,
            ),
            (
                &[
                    ("content-type", "application/json"),
                    ("content-length", "65"),
                ],
                json,
                Reading::Unreadable,
            ),
            (JSON, event, Reading::Unreadable),
            (
                &[("content-type", "text/plain")],
                event,
                Reading::Unreadable,
            ),
            (&[], event, Reading::Unreadable),
        ] {
            assert_eq!(sse_reading(&p, headers, &[body], true), want, "{headers:?}");
        }
        // A stream (JSON or events) longer than max_body: only the JSON answer is bounded.
        let mut long = b": padding\n".repeat(100);
        long.extend_from_slice(event);
        assert_eq!(sse_reading(&p, SSE, &[&long], true), Reading::Read(3));
        let mut m = Meter::default();
        // The stream ended at its headers; the upstream never answered; never sent.
        m.on_headers(&p, &h(SSE), true, Origin::Upstream);
        assert_eq!(m.readings, vec![Reading::Missing]);
        m.on_headers(&p, &h(SSE), false, Origin::Failed);
        assert_eq!(m.readings, vec![Reading::Missing]);
        m.on_headers(&p, &h(SSE), false, Origin::NeverSent);
        assert_eq!(m.readings, vec![Reading::Nothing]);
        // A piece the worker could not read: the stream cannot be followed any further.
        m.on_headers(&p, &h(SSE), false, Origin::Upstream);
        m.on_body(&p, Some(event), false);
        m.on_body(&p, None, false);
        assert!(!m.scanning());
        assert_eq!(m.readings, vec![Reading::Unreadable]);
        // Trailers end the stream too.
        m.on_headers(&p, &h(SSE), false, Origin::Upstream);
        m.on_body(&p, Some(event), false);
        m.on_trailers(&p, &h(&[("grpc-status", "0")]));
        assert_eq!(m.readings, vec![Reading::Read(3)]);
    }

    #[test]
    fn several_limits_read_their_own_pointers_in_one_pass() {
        let text = r#"{"redis": {"cluster": "gw"}, "policies": [{"name": "p", "rate_limits": [
          {"name": "prompt", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1000,
           "window": "1m", "charge": {"response_sse_json": "/usage/prompt_tokens"}},
          {"name": "calls", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1000,
           "window": "1m"},
          {"name": "completion", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1000,
           "window": "1m", "charge": {"response_sse_json": "/usage/completion_tokens"}},
          {"name": "total", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1000,
           "window": "1m", "charge": {"response_header": "x-total"}}]}]}"#;
        let mut c = Config::parse(text.as_bytes()).expect("valid");
        let p = c.policies.remove(0);
        let stream = b"data: {\"usage\":{\"prompt_tokens\":7}}\n\n\
                       data: {\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":30}}\n\n";
        for cut in 0..=stream.len() {
            let mut m = Meter::default();
            m.on_headers(
                &p,
                &h(&[SSE[0], ("x-total", "50")]),
                false,
                Origin::Upstream,
            );
            m.on_body(&p, Some(&stream[..cut]), false);
            m.on_body(&p, Some(&stream[cut..]), true);
            assert_eq!(
                m.readings,
                vec![
                    Reading::Read(20),
                    Reading::Nothing,
                    Reading::Read(30),
                    Reading::Read(50)
                ],
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn trailer_charge() {
        let p = policy(r#"{"trailer": "x-cost"}"#);
        let mut m = Meter::default();
        m.on_headers(&p, &h(&[("x-cost", "5")]), false, Origin::Upstream);
        assert_eq!(
            m.readings,
            vec![Reading::Pending],
            "a trailer charge ignores the headers"
        );
        m.on_trailers(&p, &h(&[("x-cost", "12")]));
        assert_eq!(m.readings, vec![Reading::Read(12)]);
        assert!(Meter::wants_trailers(&p));
        m.on_headers(&p, &h(&[]), false, Origin::Upstream);
        m.on_trailers(&p, &h(&[("x-other", "12")]));
        assert_eq!(m.readings, vec![Reading::Unreadable]);
        // A trailers-only answer (it ends at its headers) has its trailers there.
        m.on_headers(&p, &h(&[("x-cost", "5")]), true, Origin::Upstream);
        assert_eq!(m.readings, vec![Reading::Read(5)]);
    }

    #[test]
    fn fallbacks() {
        use crate::config::Fallback;
        let unreadable = |spelling: &str| {
            let p = policy(&format!(
                r#"{{"response_header": "x-used", "unreadable": {spelling}}}"#
            ));
            p.rate_limits[0].charge.as_ref().map(|c| c.unreadable)
        };
        assert_eq!(unreadable(r#""cost""#), Some(Fallback::Cost));
        assert_eq!(
            unreadable(r#""max""#),
            Some(Fallback::Max(1000)),
            "no cost: the limit"
        );
        assert_eq!(unreadable("7"), Some(Fallback::Units(7)));
        let p = policy(r#"{"response_header": "x-used"}"#);
        assert_eq!(
            p.rate_limits[0].charge.as_ref().map(|c| c.unreadable),
            Some(Fallback::Max(1000))
        );
        assert_eq!(Fallback::Cost.units(3), 3);
        assert_eq!(Fallback::Max(10).units(3), 10);
        assert_eq!(Fallback::Units(0).units(3), 0);
    }
}
