"""The invariants of a chaos schedule, checked on its history, the service's ledger and Redis.

    result = check(Schedule(history=..., ledger=..., faults=..., redis_keys=..., envoy_logs=...))
    result.violations   # [{"invariant": ..., "detail": ..., "history": [...]}]
    result.weaker       # {"<invariant>": n}: how often only the documented weaker bound held

Every check is sound: it flags only what no correct filter can produce, given what the
documents promise. Times are wall-clock seconds (the clients, the service and Redis `TIME`
read one clock on one machine). The filter decides a request between the client's `send`
and the service's `begin`, so that interval brackets every decision; a check counts an
admission inside an interval only when its whole bracket is inside.

Where a fault may lose acknowledged writes (a fault whose `data_loss` is true: Redis restarted
without persistence, a Cluster failover), the documents promise less, and a check applies the
documented weaker bound to whatever overlaps such a fault: a counter lost once admits at most
its limit again, a record lost runs its key again, a lease lost lets a second holder in. The
result counts each time only the weaker bound held (`weaker`). Fencing tokens stay strictly
increasing even then (docs/redis-cluster.md), and are always checked strictly.

The invariants (each a function below, each shown to catch a violation by
tests/test_chaos_checker.py):

- `answers`: every answer is one the README documents for its route and situation: the
  service's own, a replay, or the filter's problem+json of a documented type with its
  `Retry-After`; no 500, no empty 503 (the VM failing), no answer of a guarded route that
  went on without a Redis decision on a fail_closed policy; no panic or critical line in an
  Envoy's log. A `503 guard_unavailable` outside every fault is counted (a busy machine can
  be slower than the filter's timeout), not flagged. To a gRPC call the filter answers
  trailers-only (no message) with the gRPC status docs/design.md#grpc gives its problem
  (`RESOURCE_EXHAUSTED`, `ABORTED`, `FAILED_PRECONDITION`, `UNAVAILABLE`,
  `UNAUTHENTICATED`), the problem's detail as `grpc-message`, the same `Retry-After`, and
  `x-envoy-ratelimited`.
- `rate_limits`: per tenant (or per policy) and limit, admissions (requests that reached the
  service) within the algorithm's own bound: a fixed window at most `limit` units from the
  request that opened it (the one whose `RateLimit` remaining says the counter was empty)
  until `window` later; a sliding window at most `limit` in each aligned window; a sliding
  log at most `limit` in any `window`; a token bucket at most `burst + span / (window /
  limit)` in any span; a concurrency limit at most `limit` at the service at once; a leased
  quota (`mode: leased`) at most `limit` per window of its counter, which the history can
  place only to within a window and the latency of a slice's grant (see `_check_leased`).
- `idempotency`: a key never executes twice while its record lives (the service's count), an
  execution always carried its fingerprint, and every replay equals the response of an
  execution of the same key and request (over gRPC: its status and message, without its
  messages, or `ALREADY_EXISTS` for a call that completed OK after sending messages).
- `leases`: never two holders of a resource at the service at once while the lease lives,
  every forwarded request carried a fencing token, and tokens rise with time: a request sent
  after another reached the service has a larger token.
- `leftovers`: after the schedule healed and the TTLs passed, Redis holds no record in
  progress, no lease, no concurrency slot, no key without a TTL, and no key whose TTL
  exceeds what the configuration gives its kind.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

from chaos import config
from harness import problems

TOL = 0.005  # seconds: rounding of clocks to µs / ms and of Redis expiries
GRACE = 1.0  # seconds after a fault's heal during which answers may still show it
# Seconds a busy machine may add between Redis running a leased quota's grant and the filter
# reading its answer, beyond the longest decision the history shows (see `_check_leased`).
LEASED_SLACK = 0.1


@dataclass
class Schedule:
    history: list[dict]
    ledger: list[dict]
    faults: list[dict] = field(default_factory=list)
    redis_keys: list[dict] | None = None
    envoy_logs: list[str] = field(default_factory=list)
    seed: str = ""
    now: float | None = None  # when redis_keys was read (wall clock)


@dataclass
class Result:
    violations: list[dict] = field(default_factory=list)
    weaker: dict = field(default_factory=lambda: defaultdict(int))
    stats: dict = field(default_factory=lambda: defaultdict(int))

    def flag(self, invariant: str, detail: str, history: list[dict] | None = None) -> None:
        self.violations.append({"invariant": invariant, "detail": detail,
                                "history": history or []})


# --- what the history says -------------------------------------------------------------------


def ratelimit_items(value: str | None) -> dict[str, int]:
    """`"fw";r=3;t=1, "g";r=0;t=1` -> {"fw": 3, "g": 0} (the remaining of each limit)."""
    out: dict[str, int] = {}
    for item in (value or "").split(","):
        parts = item.strip().split(";")
        name = parts[0].strip().strip('"')
        for p in parts[1:]:
            k, _, v = p.partition("=")
            if k.strip() == "r" and v.strip().isdigit() and name:
                out[name] = int(v)
    return out


def problem_type(record: dict) -> str | None:
    """The slug of a problem+json answer (`rate_limited`), else None."""
    ctype = (record.get("headers") or {}).get("content-type", "")
    if "application/problem+json" not in ctype:
        return None
    try:
        body = json.loads(record.get("body") or "")
        t, detail = body.get("type", ""), str(body.get("detail", ""))
    except (ValueError, AttributeError):
        return "unreadable"
    if t == problems.QUOTA_EXCEEDED:
        # The registered type of both kinds of 429; the detail tells them apart.
        return next((slug for slug, start in problems.QUOTA_DETAIL.items() if detail.startswith(start)),
                    "unknown")
    return t[len(problems.DOCS):] if t.startswith(problems.DOCS) else "unknown"


def from_service(record: dict) -> bool:
    return (record.get("headers") or {}).get("x-chaos-service") == "1"


def replayed(record: dict) -> bool:
    return (record.get("headers") or {}).get("idempotent-replayed", "").lower() == "true"


class Faults:
    """The schedule's faults as time intervals [injected, healed + GRACE]."""

    def __init__(self, faults: list[dict]):
        self.all = [(f["injected_at"], f.get("healed_at") or math.inf, f) for f in faults]
        self.losing = [(a, b) for a, b, f in self.all if f.get("data_loss")]

    def any_during(self, start: float, end: float) -> bool:
        return any(a <= end and start <= b + GRACE for a, b, _ in self.all)

    def loss_during(self, start: float, end: float) -> bool:
        return any(a <= end and start <= b + GRACE for a, b in self.losing)

    def kinds_during(self, start: float, end: float) -> set[str]:
        return {f["kind"] for a, b, f in self.all if a <= end and start <= b + GRACE}


def _brief(record: dict) -> dict:
    keep = ("id", "route", "tenant", "key", "resource", "shape", "send", "headers_at", "recv",
            "status", "reset", "error", "headers", "body", "n", "begin", "end", "count",
            "token", "accepted", "fingerprint", "complete", "events", "cost", "charge",
            "details", "messages", "sent", "message", "trailers_only")
    out = {k: record[k] for k in keep if k in record}
    if isinstance(out.get("body"), str) and len(out["body"]) > 300:
        out["body"] = out["body"][:300] + "..."
    return out


# --- answers ---------------------------------------------------------------------------------

# The filter's own answers each route may give (README "Status codes", docs/design.md), as
# (status, problem slug): besides these, a route gets the service's answer or a replay.
DOCUMENTED = {
    "rl": {(429, "rate_limited"), (503, "guard_unavailable")},
    "rl/cc": {(429, "concurrency_limited"), (503, "guard_unavailable")},
    "idem": {(409, "idempotency_key_in_use"), (503, "guard_unavailable")},
    "idem/conflict": {(422, "idempotency_key_conflict")},
    "lease": {(409, "resource_locked"), (503, "guard_unavailable")},
    "no_tenant": {(401, "missing_tenant")},
}


def _documented(record: dict) -> set:
    route = record.get("route") or ""
    if record.get("op") == "no_tenant":
        return DOCUMENTED["no_tenant"]
    kind = route.split("/")[0]
    allowed = set(DOCUMENTED.get(route, DOCUMENTED.get(kind, set())))
    if route == "rl/cc":
        allowed = set(DOCUMENTED["rl/cc"])
    if kind == "idem" and record.get("conflict_probe"):
        allowed |= DOCUMENTED["idem/conflict"]
    return allowed


# The filter's own answers to a gRPC call, by route (docs/design.md, "The filter's answers to
# gRPC clients"): gRPC status -> the problem it stands for. Besides these a call gets the
# service's answer or a replay.
GRPC_DOCUMENTED = {
    "grpc/rl": {8: "rate_limited", 14: "guard_unavailable"},
    "grpc/idem": {10: "idempotency_key_in_use", 14: "guard_unavailable"},
    "grpc/idem/conflict": {9: "idempotency_key_conflict"},
    "grpc/lease": {10: "resource_locked", 14: "guard_unavailable"},
    "no_tenant": {16: "missing_tenant"},
}
ALREADY_EXISTS = 6
ALREADY_COMPLETED = "already completed with OK"


def _grpc_documented(record: dict) -> dict:
    if record.get("no_tenant"):
        return GRPC_DOCUMENTED["no_tenant"]
    allowed = dict(GRPC_DOCUMENTED.get(record.get("route") or "", {}))
    if record.get("route") == "grpc/idem" and record.get("conflict_probe"):
        allowed.update(GRPC_DOCUMENTED["grpc/idem/conflict"])
    return allowed


def _check_grpc_answer(rec: dict, faults: Faults, r: Result) -> None:
    route, status = rec.get("route") or "", rec["status"]
    headers = rec.get("headers") or {}
    if from_service(rec):
        r.stats["forwarded"] += 1
        r.stats["grpc_forwarded"] += 1
        if route == "grpc/rl" and "ratelimit" not in headers and not rec.get("no_tenant"):
            r.flag("answers", f"{route}: forwarded without the RateLimit headers of a Redis "
                   "decision on a fail_closed policy", [_brief(rec)])
        if rec.get("no_tenant"):
            r.flag("answers", "a gRPC call without a tenant reached the service", [_brief(rec)])
        return
    problems = []
    if not rec.get("trailers_only") or rec.get("messages"):
        problems.append(f"not trailers-only ({rec.get('messages')} messages)")
    if headers.get("x-envoy-ratelimited") != "true":
        problems.append("without x-envoy-ratelimited")
    if replayed(rec) and route == "grpc/idem":
        r.stats["replayed"] += 1
        r.stats["grpc_replayed"] += 1
        if problems:
            r.flag("answers", f"{route}: a replay " + "; ".join(problems), [_brief(rec)])
        return
    slug = _grpc_documented(rec).get(status)
    if slug is None:
        r.flag("answers", f"{route}: undocumented gRPC answer {status} {rec.get('details')!r}",
               [_brief(rec)])
        return
    r.stats[f"answer_grpc_{status}_{slug}"] += 1
    if not rec.get("details"):
        problems.append("no grpc-message (the problem's detail)")
    retry_after = headers.get("retry-after")
    if slug in ("guard_unavailable", "idempotency_key_in_use"):
        if retry_after != "1":
            problems.append(f"Retry-After {retry_after!r}")
    elif slug in ("rate_limited", "resource_locked"):
        if not (retry_after and retry_after.isdigit() and int(retry_after) >= 1):
            problems.append(f"Retry-After {retry_after!r}")
    if problems:
        r.flag("answers", f"{route}: gRPC {status} {slug}: " + "; ".join(problems), [_brief(rec)])
    if slug == "guard_unavailable" and not faults.any_during(rec["send"], rec["recv"]):
        r.stats["guard_unavailable_outside_faults"] += 1


def check_answers(s: Schedule, faults: Faults, r: Result) -> None:
    for rec in s.history:
        if rec.get("op") == "workload_error":
            r.flag("answers", f"the workload failed: {rec.get('error')}", [_brief(rec)])
            continue
        status = rec.get("status")
        if status is None:
            r.stats["no_answer"] += 1  # reset by the client, or the connection failed
            continue
        r.stats["answers"] += 1
        if rec.get("grpc"):
            _check_grpc_answer(rec, faults, r)
            continue
        route = rec.get("route") or ""
        headers = rec.get("headers") or {}
        if from_service(rec):
            r.stats["forwarded"] += 1
            if (route.startswith("rl/") and route not in ("rl/cc", "rl/open")
                    and "ratelimit" not in headers and rec.get("op") != "no_tenant"):
                r.flag("answers", f"{route}: forwarded without the RateLimit headers of a Redis "
                       "decision on a fail_closed policy", [_brief(rec)])
            if rec.get("op") == "no_tenant":
                r.flag("answers", "a request without a tenant reached the service", [_brief(rec)])
            continue
        if replayed(rec) and route.startswith("idem/"):
            r.stats["replayed"] += 1
            continue
        slug = problem_type(rec)
        if slug == "unreadable" and rec.get("reset") == "mid_body":
            r.stats["answer_cut_short"] += 1  # the client left in the middle of the problem
            continue
        if slug is None or (status, slug) not in _documented(rec):
            r.flag("answers", f"{route}: undocumented answer {status} "
                   f"({slug or headers.get('content-type') or 'no content-type'})", [_brief(rec)])
            continue
        r.stats[f"answer_{status}_{slug}"] += 1
        retry_after = headers.get("retry-after")
        if status in (429, 409, 503) and slug != "idempotency_key_conflict":
            ok = retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1
            if slug in ("guard_unavailable", "idempotency_key_in_use"):
                ok = retry_after == "1"
            if not ok:
                r.flag("answers", f"{route}: {status} {slug} with Retry-After {retry_after!r}",
                       [_brief(rec)])
        if slug == "guard_unavailable" and not faults.any_during(rec["send"], rec["recv"]):
            r.stats["guard_unavailable_outside_faults"] += 1
    for i, log in enumerate(s.envoy_logs):
        for line in log.splitlines():
            low = line.lower()
            if "[critical]" in low or "panicked" in low or "wasm vm failed" in low:
                r.flag("answers", f"envoy {i} logged: {line[:300]}")


# --- rate limits -----------------------------------------------------------------------------


@dataclass(eq=False)
class Admit:
    lo: float  # the earliest the filter can have decided: the client's send
    hi: float  # the latest: the service's begin
    units: int
    remaining: dict  # limit name -> RateLimit remaining, as the answer said (may be empty)
    entry: dict
    record: dict | None


def _admits(s: Schedule, route: str, schedule_start: float, by_id: dict) -> list[Admit]:
    out = []
    for e in s.ledger:
        if e.get("route") != route:
            continue
        rec = by_id.get(e.get("id"))
        lo = rec["send"] if rec else schedule_start
        remaining = ratelimit_items((rec.get("headers") or {}).get("ratelimit")) if rec else {}
        out.append(Admit(lo, e["begin"], int(e.get("cost") or 1), remaining, e, rec))
    return out


def _bound_flag(r: Result, faults: Faults, name: str, units: int, bound: float, weaker: float,
                span: tuple[float, float], what: str, admits: list[Admit]) -> None:
    r.stats["rate_limit_checks"] += 1
    if units <= bound:
        return
    if faults.loss_during(span[0], span[1]) and units <= weaker:
        r.weaker[f"rate_limit_{name}"] += 1
        return
    r.flag("rate_limits", what, [_brief(a.record or a.entry) for a in admits])


def _check_fixed(r: Result, faults: Faults, lim: dict, admits: list[Admit]) -> None:
    L, W = lim["limit"], lim["window_ms"] / 1000
    name = lim["name"]
    for o in admits:
        rem = o.remaining.get(name)
        if rem is None or L - rem != o.units:
            continue  # not known to have opened its window
        # Certainly after the opener, and certainly before its window expired.
        members = [o] + [a for a in admits if a is not o and a.lo >= o.hi
                         and a.hi < o.lo + W - TOL]
        units = sum(a.units for a in members)
        _bound_flag(r, faults, name, units, L, 2 * L, (o.lo, o.hi + W),
                    f"{lim['route']} {name}: {units} units admitted in the fixed window opened at "
                    f"{o.hi:.3f} (limit {L} per {W}s)", members)


def _check_sliding_window(r: Result, faults: Faults, lim: dict, admits: list[Admit]) -> None:
    L, W = lim["limit"], lim["window_ms"]
    windows: dict[int, list[Admit]] = defaultdict(list)
    margin = TOL * 1000
    for a in admits:
        k = math.floor((a.lo * 1000 - margin) / W)
        if k == math.floor((a.hi * 1000 + margin) / W):
            windows[k].append(a)
    for k, members in windows.items():
        units = sum(a.units for a in members)
        _bound_flag(r, faults, lim["name"], units, L, 2 * L,
                    (k * W / 1000, (k + 1) * W / 1000),
                    f"{lim['route']} {lim['name']}: {units} units admitted in the aligned window "
                    f"starting {k * W / 1000:.3f} (limit {L})", members)


def _spans(admits: list[Admit]):
    """Every (first, last, members) with members the admits whose bracket lies in
    [first.lo, last.hi], for first and last over the admits (O(n^2))."""
    by_lo = sorted(admits, key=lambda a: a.lo)
    for i, first in enumerate(by_lo):
        inside = sorted((a for a in by_lo[i:]), key=lambda a: a.hi)
        members: list[Admit] = []
        for a in inside:
            if a.hi < first.lo:
                continue
            members.append(a)
            yield first.lo, a.hi, members


def _check_sliding_log(r: Result, faults: Faults, lim: dict, admits: list[Admit]) -> None:
    L, W = lim["limit"], lim["window_ms"] / 1000
    worst = None
    for lo, hi, members in _spans(admits):
        if hi - lo >= W - TOL:
            continue
        units = sum(a.units for a in members)
        r.stats["rate_limit_checks"] += 1
        if units > L and (worst is None or units > worst[0]):
            worst = (units, lo, hi, list(members))
    if worst:
        units, lo, hi, members = worst
        _bound_flag(r, faults, lim["name"], units, L, 2 * L, (lo - W, hi),
                    f"{lim['route']} {lim['name']}: {units} units admitted within {hi - lo:.3f}s "
                    f"(limit {L} per {W}s)", members)


def _check_token_bucket(r: Result, faults: Faults, lim: dict, admits: list[Admit]) -> None:
    L, W, burst = lim["limit"], lim["window_ms"] / 1000, lim["burst"]
    T = W / L
    worst = None
    for lo, hi, members in _spans(admits):
        units = sum(a.units for a in members)
        bound = burst + (hi - lo) / T + 1
        r.stats["rate_limit_checks"] += 1
        if units > bound and (worst is None or units - bound > worst[0]):
            worst = (units - bound, units, bound, lo, hi, list(members))
    if worst:
        _, units, bound, lo, hi, members = worst
        _bound_flag(r, faults, lim["name"], units, bound, bound + burst, (lo - W, hi),
                    f"{lim['route']} {lim['name']}: {units} units admitted within {hi - lo:.3f}s, "
                    f"above burst {burst} + span / {T:.3f}s = {bound:.1f}", members)


def _check_concurrency(r: Result, faults: Faults, lim: dict, admits: list[Admit]) -> None:
    cap = lim["limit"]
    events = sorted([(a.entry["begin"], 1, a) for a in admits]
                    + [(a.entry.get("end", a.entry["begin"]), -1, a) for a in admits],
                    key=lambda x: (x[0], x[1]))
    running: list[Admit] = []
    for t, step, a in events:
        if step < 0:
            if a in running:
                running.remove(a)
            continue
        running.append(a)
        if len(running) > cap:
            start = min(x.lo for x in running)
            _bound_flag(r, faults, lim["name"], len(running), cap, 2 * cap, (start, t),
                        f"{lim['route']}: {len(running)} requests at the service at once "
                        f"(limit {cap})", list(running))
            if len(running) > cap:
                running = running[:cap]  # report each excess once


def _check_leased(r: Result, faults: Faults, lim: dict, admits: list[Admit]) -> None:
    """`mode: leased` (docs/configuration.md): a fixed window whose quota Redis hands out in
    slices, which the workers admit from locally. The slices of one window never add up to
    more than `limit`, so no window of the counter admits more. The history cannot tell which
    window a request was admitted from: `RateLimit` shows the worker's slice, not the counter,
    so no answer says it opened a window (as a fixed window's opener does), and a worker spends
    a slice until the window's end as it computed it when it read the grant: the time it read
    the answer plus the window's remaining time in Redis, later than the window's end in Redis
    by the answer's latency `d`. So a window's admissions lie between its opening and `d` after
    its end, windows follow each other at least `window` apart, and admissions within a span
    of `s` seconds come from at most `1 + ceil((s + d) / window)` windows: at most `limit`
    units for each. That is the bound checked (twice the limit in a span shorter than
    `window - d`), looser than a fixed window's `limit` from its opener. `d` is taken as the
    longest decision of the group (a forwarded request's send to its arrival, which holds its
    own grant's answer) or the filter's Redis timeout (a grant read for a client that left),
    whichever is longer, plus LEASED_SLACK. A lost counter opens one window more."""
    L, W = lim["limit"], lim["window_ms"] / 1000
    r.stats["leased_admissions"] += sum(a.units for a in admits)
    d = max([a.hi - a.lo for a in admits] + [config.REDIS_TIMEOUT_MS / 1000]) + LEASED_SLACK
    worst = None
    for lo, hi, members in _spans(admits):
        units = sum(a.units for a in members)
        windows = 1 + math.ceil((hi - lo + d + TOL) / W)
        bound = L * windows
        r.stats["rate_limit_checks"] += 1
        if units > bound and (worst is None or units - bound > worst[0]):
            worst = (units - bound, units, bound, windows, lo, hi, list(members))
    if worst:
        _, units, bound, windows, lo, hi, members = worst
        _bound_flag(r, faults, lim["name"], units, bound, bound + L, (lo - W, hi),
                    f"{lim['route']} {lim['name']} (leased): {units} units admitted within "
                    f"{hi - lo:.3f}s, above {windows} windows of {L} (grant latency {d:.3f}s)",
                    members)


CHECKS = {"fixed_window": _check_fixed, "sliding_window": _check_sliding_window,
          "sliding_log": _check_sliding_log, "token_bucket": _check_token_bucket,
          "concurrency": _check_concurrency}


def check_rate_limits(s: Schedule, faults: Faults, r: Result, by_id: dict,
                      start: float) -> None:
    for lim in config.checked_limits():
        admits = _admits(s, lim["route"], start, by_id)
        if lim["failure_mode"] == "fail_open":
            # Only what Redis admitted counts: an answer with this limit's RateLimit item.
            admits = [a for a in admits if lim["name"] in a.remaining]
        groups: dict = defaultdict(list)
        for a in admits:
            groups[a.entry.get("tenant") if lim["per_tenant"] else None].append(a)
        check = _check_leased if lim.get("mode") == "leased" else CHECKS[lim["algorithm"]]
        for group in groups.values():
            r.stats["rate_limit_groups"] += 1
            check(r, faults, lim, group)


# --- idempotency -----------------------------------------------------------------------------


def _idempotent(route) -> bool:
    return str(route or "").startswith(("idem/", "grpc/idem"))


def _released(e: dict) -> bool:
    """Whether the execution's answer released its record: a retryable status (HTTP: a 5xx;
    gRPC: a code of `retryable_grpc_codes`, the call having ended as the service meant)."""
    if e.get("grpc"):
        return e.get("status") in config.RETRYABLE_GRPC_CODES and bool(e.get("complete"))
    return e.get("status", 0) >= 500


def check_idempotency(s: Schedule, faults: Faults, r: Result, by_id: dict) -> None:
    ttl = config.PROCESSING_TTL_MS / 1000
    executions: dict = defaultdict(list)
    by_n = {}
    for e in s.ledger:
        if not _idempotent(e.get("route")):
            continue
        by_n[e["n"]] = e
        executions[(e["route"], e.get("tenant"), e.get("key"))].append(e)
        if not e.get("fingerprint"):
            r.flag("idempotency", f"{e['route']} key {e.get('key')}: executed without "
                   "x-idempotency-fingerprint (forwarded without its record on a fail_closed "
                   "policy)", [_brief(e)])
    for (route, tenant, key), runs in executions.items():
        runs.sort(key=lambda e: e["begin"])
        r.stats["idempotency_keys"] += 1
        for a, b in zip(runs, runs[1:]):
            ra = by_id.get(a.get("id"))
            send_a = ra["send"] if ra else a["begin"] - 10.0
            if _released(a) and b["begin"] >= a.get("end", a["begin"]) - TOL:
                continue  # a retryable answer released the record
            if b["begin"] >= send_a + ttl - TOL:
                continue  # the record may have expired (outcome unknown: PROCESSING until its TTL)
            if faults.loss_during(send_a, b["begin"]):
                r.weaker["idempotency_lost_record"] += 1
                continue
            history = [_brief(a), _brief(b)] + [_brief(x) for x in (ra, by_id.get(b.get("id")))
                                                if x]
            r.flag("idempotency", f"{route} tenant {tenant} key {key} executed twice while its "
                   f"record lived: executions {a['n']} and {b['n']}, "
                   f"{b['begin'] - a['begin']:.3f}s apart", history)
    for rec in s.history:
        if not replayed(rec) or not _idempotent(rec.get("route")) or rec.get("status") is None:
            continue
        if rec.get("grpc"):
            _check_grpc_replay(rec, executions, by_n, r)
        else:
            _check_replay(rec, executions, by_n, r)


def _shape(e: dict) -> str | None:
    try:
        return json.loads(e.get("body") or "{}").get("shape")
    except (ValueError, AttributeError):
        return None


def _check_grpc_replay(rec: dict, executions: dict, by_n: dict, r: Result) -> None:
    """A gRPC replay (docs/design.md#grpc) carries the stored status and message and none of
    the messages: `ALREADY_EXISTS` for a call that completed OK after sending messages; the
    service's message (`exec <n>`) names the execution of any other status but OK."""
    route, key, status = rec["route"], rec.get("key"), rec.get("status")
    details = rec.get("details") or ""
    runs = executions.get((route, rec.get("tenant"), key), [])
    before = [e for e in runs if e["begin"] < rec["recv"] + TOL]
    same = [e for e in before if _shape(e) == rec.get("shape")]
    named = re.fullmatch(r"exec (\d+)", details)
    history = [_brief(rec)] + [_brief(e) for e in runs]
    if status == ALREADY_EXISTS:
        ok = [e for e in same if e.get("status") == 0 and e.get("messages") and e.get("complete")]
        if ALREADY_COMPLETED not in details or not ok:
            r.flag("idempotency", f"{route} key {key}: ALREADY_EXISTS replay {details!r} matches "
                   "no call of this request that completed OK after sending messages", history)
        return
    if named is None:
        ok = [e for e in same if status == 0 and not details and e.get("status") == 0
              and not e.get("messages") and e.get("complete")]
        if not ok:
            r.flag("idempotency", f"{route} key {key}: replay {status} {details!r} matches no "
                   "call of this request that ended so", history)
        return
    e = by_n.get(int(named.group(1)))
    if e is None or (e.get("route"), e.get("tenant"), e.get("key")) != (route, rec.get("tenant"),
                                                                       key):
        r.flag("idempotency", f"{route} tenant {rec.get('tenant')} key {key}: replayed the "
               f"status of another call: {details!r}", history + ([_brief(e)] if e else []))
        return
    problems = []
    if e.get("status") != status or e.get("message") != details:
        problems.append(f"status {status} {details!r}, the call ended {e.get('status')} "
                        f"{e.get('message')!r}")
    if e.get("status") in config.RETRYABLE_GRPC_CODES:
        problems.append("a retryable status was stored")
    if _shape(e) != rec.get("shape"):
        problems.append("replayed to a different request (another body)")
    if problems:
        r.flag("idempotency", f"{route} key {key}: replay of call {e['n']}: "
               + "; ".join(problems), [_brief(rec), _brief(e)])


def _check_replay(rec: dict, executions: dict, by_n: dict, r: Result) -> None:
    route, key = rec["route"], rec.get("key")
    runs = executions.get((route, rec.get("tenant"), key), [])
    status = rec.get("status")
    if route == "idem/stream":
        # Stored by reference: the status and no body; the stream must have ended normally.
        ok = any(e.get("complete") and e.get("status") == status for e in runs) and not rec.get("body")
        if not ok:
            r.flag("idempotency", f"{route} key {key}: replay {status} matches no stream that "
                   "ended", [_brief(rec)] + [_brief(e) for e in runs])
        return
    # The execution's number: its ETag (a replay header, whole even when the client left
    # mid-body), else the body's `exec`.
    etag = (rec.get("headers") or {}).get("etag", "").strip('"')
    exec_n = int(etag) if etag.isdigit() else None
    if exec_n is None:
        try:
            exec_n = json.loads(rec.get("body") or "").get("exec")
        except (ValueError, AttributeError):
            exec_n = None
    e = by_n.get(exec_n)
    if e is None:
        r.flag("idempotency", f"{route} key {key}: replay names no execution",
               [_brief(rec)] + [_brief(x) for x in runs])
        return
    if (e.get("route"), e.get("tenant"), e.get("key")) != (route, rec.get("tenant"), key):
        r.flag("idempotency", f"{route} tenant {rec.get('tenant')} key {key}: replayed the "
               f"response of another request: execution {exec_n} of {e.get('route')} tenant "
               f"{e.get('tenant')} key {e.get('key')}", [_brief(rec), _brief(e)]
               + [_brief(x) for x in runs])
        return
    problems = []
    if e.get("status") != status:
        problems.append(f"status {status}, the execution answered {e.get('status')}")
    if rec.get("reset") != "mid_body" and e.get("response") != rec.get("body"):
        problems.append("the body differs from the execution's")
    if e.get("status", 0) >= 500:
        problems.append("a retryable answer was stored")
    if json.loads(e.get("body") or "{}").get("shape") != rec.get("shape"):
        problems.append("replayed to a different request (another body)")
    if problems:
        r.flag("idempotency", f"{route} key {key}: replay of execution {exec_n}: "
               + "; ".join(problems), [_brief(rec), _brief(e)])


# --- leases ----------------------------------------------------------------------------------


def check_leases(s: Schedule, faults: Faults, r: Result, by_id: dict) -> None:
    ttl = config.LEASE_TTL_MS / 1000
    resources: dict = defaultdict(list)
    for e in s.ledger:
        if str(e.get("route", "")).startswith(("lease/", "grpc/lease")):
            resources[(e["route"], e.get("tenant"), e.get("resource"))].append(e)
    for (route, tenant, res), entries in resources.items():
        r.stats["lease_resources"] += 1
        for e in entries:
            if e.get("token") is None:
                r.flag("leases", f"{route} {res}: forwarded without a fencing token on a "
                       "fail_closed policy", [_brief(e)])
        tokened = [e for e in entries if _token(e) is not None]
        # Tokens rise with time: B sent after A reached the service was issued after A's.
        for a in tokened:
            for b in tokened:
                rb = by_id.get(b.get("id"))
                if rb and a["begin"] < rb["send"] - TOL and _token(a) >= _token(b):
                    r.flag("leases", f"{route} {res}: fencing token {_token(b)} issued after "
                           f"{_token(a)} is not larger", [_brief(a), _brief(b), _brief(rb)])
        accepted = sorted((e for e in tokened if e.get("accepted")), key=lambda e: e["begin"])
        for a, b in zip(accepted, accepted[1:]):
            if _token(b) <= _token(a):
                r.flag("leases", f"{route} {res}: the service accepted {_token(b)} after "
                       f"{_token(a)}", [_brief(a), _brief(b)])
        stale = [e for e in tokened if not e.get("accepted")]
        r.stats["fencing_stale_refused"] += len(stale)
        # Two holders: B accepted while A (accepted before it) still held the resource.
        holders = [(e, _held_until(e, by_id)) for e in accepted]
        for i, b in enumerate(accepted):
            for a, until in holders[:i]:
                if b["begin"] < until - TOL:
                    _second_holder(r, faults, route, res, a, b, by_id, ttl)
        # Refused as stale: a newer token was accepted before B arrived, so B's lease (taken
        # before the newer one) and the newer one were held at once.
        for b in stale:
            newer = [a for a in accepted if _token(a) > _token(b) and a["begin"] <= b["begin"]]
            if newer:
                _second_holder(r, faults, route, res, b, newer[0], by_id, ttl)


def _token(e: dict) -> int | None:
    try:
        return int(e.get("token"))
    except (TypeError, ValueError):
        return None


def _held_until(e: dict, by_id: dict) -> float:
    """When the service stopped holding: its end, or for a stream the moment its client left
    (the lease is given back when the stream ends, whichever side ends it)."""
    end = e.get("end", e["begin"])
    rec = by_id.get(e.get("id"))
    if e.get("stream") and rec and rec.get("recv") is not None and (rec.get("reset") or rec.get("error")):
        end = min(end, rec["recv"])
    return end


def _second_holder(r: Result, faults: Faults, route: str, res: str, a: dict, b: dict,
                   by_id: dict, ttl: float) -> None:
    ra = by_id.get(a.get("id"))
    send_a = ra["send"] if ra else a["begin"] - 10.0
    if faults.loss_during(send_a, b["begin"]):
        r.weaker["lease_lost"] += 1
        return
    orphaned = bool(ra and ra.get("reset") == "before_response")
    if b["begin"] >= send_a + ttl - TOL and (orphaned or faults.any_during(send_a, b["begin"])):
        r.weaker["lease_expired"] += 1  # not extended (client gone, or Redis failing): documented
        return
    r.flag("leases", f"{route} {res}: two holders at once: tokens {_token(a)} and {_token(b)}, "
           f"the second {b['begin'] - a['begin']:.3f}s after the first began",
           [_brief(a), _brief(b)] + [_brief(x) for x in (ra, by_id.get(b.get("id"))) if x])


# --- leftovers -------------------------------------------------------------------------------


def _kind(key: str) -> str:
    rest = key[len(config.KEY_PREFIX) + 1:] if key.startswith(config.KEY_PREFIX + ":") else key
    return rest.split(":", 1)[0]


def check_leftovers(s: Schedule, r: Result) -> None:
    if s.redis_keys is None:
        return
    now_us = (s.now or 0) * 1e6
    limits = {
        "idem": config.COMPLETED_TTL_MS,
        "lease": config.LEASE_TTL_MS,
        "fence": 7 * 24 * 3600 * 1000,
        "cancel": config.CANCEL_TTL_MS,
        "rl": max(config.counter_ttls_ms().values()),
    }
    counters = config.counter_ttls_ms()
    for k in s.redis_keys:
        key, kind, pttl = k["key"], _kind(k["key"]), k.get("pttl")
        r.stats["redis_keys"] += 1
        if pttl is not None and pttl == -1:
            r.flag("leftovers", f"{key}: no TTL", [k])
            continue
        # A counter's own policy: `<prefix>:rl:{<hash tag>}:<policy>:...`.
        policy = key.split("}:", 1)[1].split(":", 1)[0] if kind == "rl" and "}:" in key else ""
        most = counters.get(policy, limits.get(kind)) if kind == "rl" else limits.get(kind)
        if pttl is not None and most is not None and pttl > most + 1000:
            r.flag("leftovers", f"{key}: TTL {pttl} ms, above the {most} ms its kind "
                   "is given", [k])
        if kind == "idem" and k.get("state") == "PROCESSING":
            r.flag("leftovers", f"{key}: a record still PROCESSING after the schedule healed and "
                   f"its {config.PROCESSING_TTL_MS} ms passed", [k])
        elif kind == "lease":
            r.flag("leftovers", f"{key}: a lease still held after the schedule healed and its "
                   f"{config.LEASE_TTL_MS} ms passed", [k])
        elif kind == "rl" and ":cc:" in key:
            live = [m for m in k.get("members", []) if m[1] > now_us]
            if live:
                r.flag("leftovers", f"{key}: {len(live)} concurrency slots still held", [k])
        elif kind not in limits and kind != "ovr":
            r.flag("leftovers", f"{key}: a key of no known kind", [k])


# --- all -------------------------------------------------------------------------------------


def check(s: Schedule) -> Result:
    r = Result()
    faults = Faults(s.faults)
    by_id = {rec["id"]: rec for rec in s.history if rec.get("id")}
    start = min((rec["send"] for rec in s.history if "send" in rec), default=0.0)
    r.stats["requests"] = len(s.history)
    r.stats["executions"] = len(s.ledger)
    check_answers(s, faults, r)
    check_rate_limits(s, faults, r, by_id, start)
    check_idempotency(s, faults, r, by_id)
    check_leases(s, faults, r, by_id)
    check_leftovers(s, r)
    for v in r.violations:
        v["seed"] = s.seed
    return r
