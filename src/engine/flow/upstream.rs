//! The upstream's response (headers, body, trailers), for the guards that outlive the
//! request's decision: whether the response matters to them, the record that takes it in and
//! settles on it, the lease and the slots given back once the upstream answered, the charge
//! read from it.

use crate::config::{Completion, Idempotency};
use crate::engine::flow::{Cx, Flow, Meter, Move, Outgoing, Pcx, Pending, Phase, Purpose, Step};
use crate::guards::idempotency::capture::{
    response_shape, Assembly, BodyIntake, RecordAction, ResponseView, Shape, NEVER_SENT,
};
use crate::guards::ratelimit::charge::Origin;
use crate::redis::ScriptCall;

impl Flow {
    /// Whether the response matters to this request (a record to complete, a lease to
    /// release, a charge to read); if not, the adapter skips reading the response.
    pub(crate) fn wants_response(&self, cx: &Cx<'_>) -> bool {
        self.record.as_ref().is_some_and(|i| i.owned)
            || self.lease.as_ref().is_some_and(|l| l.held)
            || self.at(cx).is_some_and(|at| {
                (self.forwarded() && Meter::wanted(at.policy)) || self.holds_slots(&at)
            })
    }

    /// The response body is taken in (a record copying it, a completion it waits for, a
    /// charge read from it).
    pub(crate) fn wants_response_body(&self) -> bool {
        matches!(self.phase, Phase::Response(_) | Phase::Completing { .. }) || self.meter.scanning()
    }

    /// Whether the response's trailers matter (a record that settles on them, a charge).
    pub(crate) fn wants_response_trailers(&self, cx: &Cx<'_>) -> bool {
        matches!(self.phase, Phase::Response(_))
            || (self.forwarded()
                && self
                    .at(cx)
                    .is_some_and(|at| Meter::wants_trailers(at.policy)))
    }

    /// The response's headers. `via_upstream` is false for Envoy's own local replies, with
    /// `details` its `response.code_details`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_response_headers(
        &mut self,
        cx: &Cx<'_>,
        status: u32,
        via_upstream: bool,
        details: &str,
        headers: &[(String, String)],
        end_of_stream: bool,
    ) -> Step {
        self.step(cx, |f| {
            f.response_headers(cx, status, via_upstream, details, headers, end_of_stream)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn response_headers(
        &mut self,
        cx: &Cx<'_>,
        status: u32,
        via_upstream: bool,
        details: &str,
        headers: &[(String, String)],
        end_of_stream: bool,
    ) -> Move {
        let Some(at) = self.at(cx) else {
            return Move::Continue;
        };
        let shape = response_shape(
            status,
            via_upstream,
            self.kind.connect,
            headers,
            end_of_stream,
        );
        // An accepted upgrade or tunnel, or an event stream: the operation goes on for as long
        // as the stream is open, so a held lease stays held (the watchdog extends it) and is
        // released when the stream ends (`on_done`).
        self.kind.open_ended = shape != Shape::Plain;
        let async_idem = self.record.as_ref().is_some_and(|i| i.owned)
            && at
                .policy
                .idempotency
                .as_ref()
                .is_some_and(|c| c.complete == Completion::Async);
        let head = ResponseView {
            status,
            via_upstream,
            details,
            headers,
            end_of_stream,
            shape,
        };
        if self.forwarded() && Meter::wanted(at.policy) {
            let origin = if via_upstream {
                Origin::Upstream
            } else if NEVER_SENT.iter().any(|d| details.contains(d)) {
                Origin::NeverSent
            } else {
                Origin::Failed
            };
            self.meter
                .on_headers(at.policy, headers, end_of_stream, origin);
        }
        let step = self.record_response_headers(&at, &head);
        let release = self.held_at_response(&at, async_idem);
        if matches!(self.phase, Phase::Forwarded) {
            self.phase = Phase::Responded;
        }
        self.with_release(&at, release, step)
    }

    /// The lease and the concurrency slots once the response's headers are in. An
    /// open-ended response keeps them. Otherwise the upstream answered: the protected
    /// operation is over and the request no longer in flight there. The response waits for
    /// the releases (one round trip; the calls are returned), so the client's next request
    /// finds them free. When the record settles off the response path (async) the root
    /// releases them; when the body passes while the record takes it in (pausing the headers
    /// would hold the body), they are released with the record at the body's end (see
    /// `settle_record`).
    fn held_at_response(&mut self, at: &Pcx<'_>, async_idem: bool) -> Vec<Outgoing> {
        let body_passes = matches!(self.phase, Phase::Response(_));
        if self.kind.open_ended || (body_passes && !async_idem) {
            Vec::new()
        } else if async_idem {
            self.release_lease(at);
            self.release_slots(at);
            Vec::new()
        } else {
            let mut out: Vec<Outgoing> = self.lease_release_now(at).into_iter().collect();
            out.extend(self.slots_release_now(at));
            out
        }
    }

    /// The record's step at the response headers, with the releases the response waits
    /// for, if any.
    fn with_release(&mut self, at: &Pcx<'_>, release: Vec<Outgoing>, step: Move) -> Move {
        if release.is_empty() {
            return step;
        }
        match step {
            Move::Continue => {
                self.phase = Phase::Completing {
                    deadline_ms: at.call_deadline(),
                };
                Move::Dispatch(release)
            }
            Move::Wait => Move::Dispatch(release),
            Move::Dispatch(mut calls) => {
                calls.extend(release);
                Move::Dispatch(calls)
            }
            step => step,
        }
    }

    /// The lease release the response waits for.
    fn lease_release_now(&mut self, at: &Pcx<'_>) -> Option<Outgoing> {
        let call = self.lease.as_mut()?.release_now()?;
        let tag = Pending::of(Purpose::LeaseRelease);
        self.calls
            .push_and_send(tag, Purpose::LeaseRelease.script(), call, at.now_ms)
    }

    /// The record's side of the response headers: complete, release, or take the body first.
    fn record_response_headers(&mut self, at: &Pcx<'_>, head: &ResponseView<'_>) -> Move {
        if !matches!(self.phase, Phase::Forwarded) {
            return Move::Continue;
        }
        let (Some(record), Some(cfg)) = (
            self.record.as_mut().filter(|i| i.owned),
            at.policy.idempotency.as_ref(),
        ) else {
            return Move::Continue;
        };
        let record = record.stored.on_response_headers(cfg, head, self.kind.grpc);
        self.apply_record(at, record, head.details)
    }

    /// A piece of the response body (`body_size`: this chunk), copied as it passes for the
    /// record and scanned for a JSON charge, each only as far as the worker's memory budget
    /// lets it be read; a body over `max_response_body` (or one the budget cannot hold) is not
    /// copied any further: it streams, and a reference record is stored when its end is seen.
    /// With sync completion the final chunk waits for it.
    pub(crate) fn on_response_body(
        &mut self,
        cx: &Cx<'_>,
        body_size: usize,
        end_of_stream: bool,
        read: impl FnOnce() -> Vec<u8>,
    ) -> Step {
        self.step(cx, |f| f.response_body(cx, body_size, end_of_stream, read))
    }

    fn response_body(
        &mut self,
        cx: &Cx<'_>,
        body_size: usize,
        end_of_stream: bool,
        read: impl FnOnce() -> Vec<u8>,
    ) -> Move {
        let Some(at) = self.at(cx) else {
            return Move::Continue;
        };
        let copies = match (
            self.phase.intake(),
            self.record.as_ref(),
            at.policy.idempotency.as_ref(),
        ) {
            (Some(intake), Some(record), Some(cfg)) => {
                record.stored.takes(cfg, intake, body_size, &at.rt.memory)
            }
            _ => false,
        };
        let piece = if (copies || self.meter.scanning()) && at.rt.memory.admits_brief(body_size) {
            Some(read()).filter(|p| p.len() == body_size)
        } else {
            None
        };
        self.meter
            .on_body(at.policy, piece.as_deref(), end_of_stream);
        let memory = &at.rt.memory;
        let step = self.record_piece(cx, |stored, cfg, intake, _| {
            stored.on_response_body(
                cfg,
                intake,
                body_size,
                end_of_stream,
                piece.as_deref(),
                memory,
            )
        });
        if let Some(record) = self.record.as_mut() {
            if record.stored.take_over_budget() {
                at.m.increment(at.rt.metrics.memory.by_reference);
                record.over_budget(&at);
            }
        }
        step
    }

    /// The response's trailers (`trailers`): its body has ended (without a body callback that
    /// said so). The record is settled now: a gRPC call by the `grpc-status` in them (released
    /// when it is in `retryable_grpc_codes`), and the trailers that matter are stored.
    pub(crate) fn on_response_trailers(
        &mut self,
        cx: &Cx<'_>,
        trailers: &[(String, String)],
    ) -> Step {
        self.step(cx, |f| f.response_trailers(cx, trailers))
    }

    fn response_trailers(&mut self, cx: &Cx<'_>, trailers: &[(String, String)]) -> Move {
        if let Some(at) = self.at(cx).filter(|_| self.forwarded()) {
            self.meter.on_trailers(at.policy, trailers);
        }
        self.record_piece(cx, |stored, cfg, _, grpc| {
            stored.on_response_trailers(cfg, trailers, grpc)
        })
    }

    /// A piece of the response the record takes in (`piece` reads it into the assembly):
    /// while a sync completion is outstanding the stream waits; with no record taking the
    /// response in it goes on.
    fn record_piece(
        &mut self,
        cx: &Cx<'_>,
        piece: impl FnOnce(&mut Assembly, &Idempotency, BodyIntake, bool) -> RecordAction,
    ) -> Move {
        let intake = match self.phase {
            Phase::Response(intake) => intake,
            Phase::Completing { .. } => return Move::Wait,
            _ => return Move::Continue,
        };
        let Some(at) = self.at(cx) else {
            return Move::Continue;
        };
        let grpc = self.kind.grpc;
        let (Some(record), Some(cfg)) = (self.record.as_mut(), at.policy.idempotency.as_ref())
        else {
            return Move::Continue;
        };
        let record = piece(&mut record.stored, cfg, intake, grpc);
        self.apply_record(&at, record, "")
    }

    /// Carries out what the record decided at a piece of the response.
    fn apply_record(&mut self, at: &Pcx<'_>, action: RecordAction, details: &str) -> Move {
        match action {
            RecordAction::Pass => Move::Continue,
            RecordAction::Take(intake) => {
                self.phase = Phase::Response(intake);
                Move::Continue
            }
            RecordAction::Complete | RecordAction::Release => {
                let (Some(guard), Some(cfg)) =
                    (self.record.as_mut(), at.policy.idempotency.as_ref())
                else {
                    return Move::Continue;
                };
                let (purpose, call) = match action {
                    RecordAction::Complete => {
                        let sealed = cfg.encryption.is_some();
                        if guard.stored.drop_body_over_budget(sealed, &at.rt.memory) {
                            at.m.increment(at.rt.metrics.memory.by_reference);
                            guard.over_budget(at);
                        }
                        guard.completion_call(cfg)
                    }
                    _ => guard.release_call(),
                };
                self.settle_record(at, purpose, call)
            }
            RecordAction::Unknown => {
                self.outcome_unknown(at, details);
                Move::Continue
            }
        }
    }

    /// Sends a complete/release now (sync: the response waits) or hands it to the root.
    fn settle_record(&mut self, at: &Pcx<'_>, purpose: Purpose, call: ScriptCall) -> Move {
        let Some(cfg) = at.policy.idempotency.as_ref() else {
            return Move::Continue;
        };
        if !crate::engine::flow::IdempotencyGuard::sync(cfg) {
            if let Some(i) = self.record.as_mut() {
                let bg = i.settle_later(at.index, (purpose, call));
                self.out.background.push(bg);
            }
            self.phase = Phase::Done;
            return Move::Continue;
        }
        let mut out: Vec<_> = self
            .calls
            .push_and_send(Pending::of(purpose), purpose.script(), call, at.now_ms)
            .into_iter()
            .collect();
        // A lease or slot still held (its response's body passed) is released with the
        // record.
        if !self.kind.open_ended {
            out.extend(self.lease_release_now(at));
            out.extend(self.slots_release_now(at));
        }
        self.phase = Phase::Completing {
            deadline_ms: at.call_deadline(),
        };
        Move::Dispatch(out)
    }

    pub(super) fn outcome_unknown(&mut self, at: &Pcx<'_>, details: &str) {
        if let Some(i) = self.record.as_mut() {
            i.outcome_unknown(at, details);
        }
        self.phase = Phase::Done;
    }
}
