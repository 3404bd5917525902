"""Quotas end to end: concurrency limits, and rate limits with a `cost` per request and a
`charge` read from the response. Real Envoy running the filter, real redis-server behind
webdis, the counting upstream (which records when it started and ended every request, so the
tests measure how many ran at once where it matters: at the service) and, for trailers, the
gRPC service.

Concurrency (`algorithm: concurrency`): at most `limit` requests of a scope in flight across
every sidecar; a slot is taken at admission, extended at half the window while the request
runs, given back once the upstream answered (however the stream then ends); a slot whose
client left before the answer, and a crashed sidecar's slots, expire after the window. Over the limit: `429` quota-exceeded (`concurrency_limited`), `Retry-After: 1`,
the limit's `RateLimit` items in `qu="concurrent-requests"` with `r=0` and no reset.

Cost and charge: a request consumes its `cost` (a request header) at admission; after the
stream ends the counter moves by the difference to the `charge` the response reported (a
header, a trailer or a number in its JSON body). Charges go out from the filter's root once
the stream is over, so nothing waits for them: a test that sends its next request after a
charge waits until the counter shows it.

One Redis/webdis/upstream stack serves the module (on its topology); each test starts its own
Envoy(s) with a fresh `key_prefix`, tenant and path, so ledger entries and keys are its own.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from harness.concurrency import in_thread, wait_for
from harness.envoy import Envoy, Response
from harness.grpc_upstream import GrpcUpstream
from harness.stack import Stack
from harness.upstream import max_overlap
from harness.problems import is_problem
from test_e2e_lease import assert_problem, redis_now_us, uid

pytestmark = pytest.mark.topologies("single", "cluster")

TENANT = "x-tenant-id"
COST = "x-request-cost"
USED = "x-tokens-used"
POLICY = "jobs"
# Root tick 125 ms: releases, extensions and charges go out within about that.
REDIS_TIMEOUT = "250ms"
SINGLE_ONLY = pytest.mark.topologies("single", reason="the topology changes nothing the test "
                                     "looks at (timing, processes, gRPC, config refusal)")


# --- helpers -------------------------------------------------------------------------------------


def inflight(limit: int, window: str = "30s", name: str = "inflight") -> dict:
    return {"name": name, "by": ["tenant"], "algorithm": "concurrency", "limit": limit,
            "window": window}


def tokens(algorithm: str = "fixed_window", limit: int = 1000, window: str = "1h", *,
           cost: dict | None = None, charge: dict | None = None, **extra) -> dict:
    """A `tokens` limit per tenant; `cost` defaults to the x-request-cost header (default 1)."""
    limit_ = {"name": "tokens", "by": ["tenant"], "algorithm": algorithm, "limit": limit,
              "window": window, "cost": cost or {"header": COST, "default": 1}, **extra}
    if charge is not None:
        limit_["charge"] = charge
    return limit_


def policy(*limits: dict, prefix: str = "/jobs/", name: str = POLICY) -> dict:
    return {"name": name, "match": {"path_prefix": prefix}, "rate_limits": list(limits)}


def plugin(stack: Stack, key_prefix: str, *policies: dict, timeout: str = REDIS_TIMEOUT) -> dict:
    return {"redis": stack.redis_section(key_prefix=key_prefix, timeout=timeout),
            "identity": {"tenant_header": TENANT, "missing_tenant": "reject"},
            "policies": list(policies)}


class Run:
    """One test's tenant and path (`/jobs/<id>`), so its ledger entries are its own."""

    def __init__(self) -> None:
        self.tenant = f"tenant-{uid()}"
        self.path = f"/jobs/{uid()}"

    def send(self, envoy: Envoy, *, delay_ms: int = 0, status: int | None = None,
             cost: str | None = None, used: int | str | None = None,
             headers: dict | None = None, timeout: float = 15.0) -> Response:
        """POST <path> (no body), steering the upstream: its delay, status, `x-tokens-used`."""
        h = {TENANT: self.tenant}
        if delay_ms:
            h["x-upstream-delay-ms"] = str(delay_ms)
        if status:
            h["x-upstream-status"] = str(status)
        if cost is not None:
            h[COST] = cost
        if used is not None:
            h[f"x-upstream-header-{USED}"] = str(used)
        h.update(headers or {})
        return envoy.request("POST", self.path, headers=h, timeout=timeout)

    def fetch(self, envoy: Envoy, headers: dict) -> tuple[int, bool]:
        """POST <path> on a connection of its own: (status, whether the body came whole)."""
        conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=15)
        try:
            conn.request("POST", self.path, headers={TENANT: self.tenant, **headers})
            resp = conn.getresponse()
            try:
                resp.read()
                return resp.status, True
            except (http.client.IncompleteRead, ConnectionError):
                return resp.status, False
        finally:
            conn.close()

    def executed(self, stack: Stack) -> list[dict]:
        return [r for r in stack.upstream.requests() if r["path"] == self.path]

    def running(self, stack: Stack) -> int:
        return sum(1 for r in stack.upstream.in_flight() if r["path"] == self.path)


def assert_concurrency_limited(resp: Response, limit: str = "inflight") -> None:
    body = assert_problem(resp, 429, "concurrency_limited")
    assert body["violated-policies"] == [limit], body
    assert resp.headers.get("retry-after") == "1", resp
    # The full limit, in the draft's unit for it: slots, no window, none free, no reset.
    assert re.fullmatch(rf'"{limit}";q=\d+;qu="concurrent-requests"',
                        resp.headers.get("ratelimit-policy", "")), resp
    assert resp.headers.get("ratelimit") == f'"{limit}";r=0', resp


def remaining(resp: Response) -> int:
    """`r` of the `tokens` item of the RateLimit header (the only counting limit these tests
    report; a concurrency limit beside it has an item without a reset)."""
    match = re.search(r'(?:^|, )"tokens";r=(\d+);t=\d+(?:, |$)', resp.headers.get("ratelimit", ""))
    assert match, resp
    return int(match.group(1))


def limit_stat(envoy: Envoy, limit: str, name: str, policy_name: str = POLICY) -> int:
    return envoy.stat(f"wasmcustom.cg.policy.{policy_name}.limit.{limit}.{name}")


def total(envoys: list[Envoy], limit: str, name: str) -> int:
    return sum(limit_stat(e, limit, name) for e in envoys)


def only_key(stack: Stack, prefix: str, code: str) -> str:
    """The one rate-limit key of algorithm `code` (fw, sw, tb, cc) under `prefix`."""
    keys = [k.decode() for k in stack.redis.scan_iter(match=f"{prefix}:rl:*:{code}:*", count=1000)]
    assert len(keys) == 1, keys
    return keys[0]


def live_slots(stack: Stack, key: str) -> int:
    """Slots of a concurrency key that count now (scored by their expiry, µs)."""
    return stack.redis.zcount(key, f"({redis_now_us(stack)}", "+inf")


def held(stack: Stack, prefix: str) -> int:
    """Slots that count now in every concurrency key under `prefix` (an empty one is gone)."""
    keys = stack.redis.scan_iter(match=f"{prefix}:rl:*:cc:*", count=1000)
    return sum(live_slots(stack, k.decode()) for k in keys)


def fw_count(stack: Stack, key: str) -> int:
    raw = stack.redis.get(key)
    return 0 if raw is None else int(raw)


def units_used(stack: Stack, key: str, algorithm: str, limit: int = 1000) -> float:
    """Units a counter holds now: fw/sw its count, tb what its TAT is ahead of now."""
    if algorithm == "fixed_window":
        return fw_count(stack, key)
    if algorithm == "sliding_window":
        return int(stack.redis.hget(key, "c") or 0)
    tat = int(stack.redis.get(key) or 0)
    return max(0, tat - redis_now_us(stack)) / (3_600_000_000 / limit)  # window 1h


def open_request(envoy: Envoy, path: str, headers: dict) -> socket.socket:
    """An HTTP/1.1 POST (no body) sent on a socket of its own, its answer not read."""
    conn = socket.create_connection(("127.0.0.1", envoy.port), timeout=10)
    lines = [f"POST {path} HTTP/1.1", "host: x", "content-length: 0"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return conn


def raw_post(envoy: Envoy, path: str, headers: list[tuple[str, str]]) -> tuple[int, dict]:
    """A POST with exactly these header lines (repeats kept): (status, JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=10)
    try:
        conn.putrequest("POST", path)
        for name, value in headers:
            conn.putheader(name, value)
        conn.putheader("content-length", "0")
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def at_once(calls: list) -> list:
    """Runs the calls (no-argument functions) in threads released together; their results."""
    barrier = threading.Barrier(len(calls))

    def run(fn):
        barrier.wait()
        return fn()

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(run, calls))


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory, topology):
    """Redis, webdis and the upstream for the module (on its topology); Envoys per test."""
    stack = Stack(tmp_path_factory.mktemp("quotas-e2e"), None, envoys=0,
                  **topology.stack_kwargs).start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def grpc_service(shared, tmp_path_factory):
    service = GrpcUpstream(tmp_path_factory.mktemp("quotas-grpc")).start()
    yield service
    service.stop()


@pytest.fixture
def guard(shared, sidecars):
    """`guard(*policies, n=1, timeout=..., **variant) -> [Envoy, ...]`: n sidecars sharing one
    config and a key_prefix of their own (`envoy.key_prefix`); stopped when the test ends."""

    def make(*policies: dict, n: int = 1, timeout: str = REDIS_TIMEOUT, **variant) -> list[Envoy]:
        prefix = f"cg:e2e-quota:{uid()}"
        config = plugin(shared, prefix, *policies, timeout=timeout)
        return [sidecars(shared, config, prefix, **variant) for _ in range(n)]

    return make


# --- 1. concurrency: at most `limit` in flight, across sidecars ----------------------------------


def test_concurrency_caps_requests_in_flight_across_two_sidecars(shared, guard):
    limit = 4
    envoys = guard(policy(inflight(limit)), n=2)
    run = Run()

    first = at_once([lambda i=i: run.send(envoys[i % 2], delay_ms=1500) for i in range(limit + 5)])
    admitted = [r for r in first if r.status == 200]
    rejected = [r for r in first if r.status != 200]
    assert len(admitted) == limit and len(rejected) == 5, [r.status for r in first]
    for resp in rejected:
        assert_concurrency_limited(resp)
        assert resp.elapsed < 1.0, resp  # answered at once, not after a slot freed
    for resp in admitted:  # the in-flight limit in its unit: slots, no window, no reset
        assert resp.headers["ratelimit-policy"] == \
            f'"inflight";q={limit};qu="concurrent-requests"', resp
        assert re.fullmatch(r'"inflight";r=[0-3]', resp.headers["ratelimit"]), resp
    ran = run.executed(shared)
    assert len(ran) == limit and max_overlap(ran) == limit, ran
    # Five requests went through one sidecar, four through the other: a cap per sidecar
    # would have admitted eight.
    assert total(envoys, "inflight", "allowed") == limit
    assert total(envoys, "inflight", "rejected") == 5

    assert wait_for(lambda: held(shared, envoys[0].key_prefix) == 0, 2.0), \
        "the slots were not given back"
    # The slots are free again: `limit` more run at once, and still no more.
    second = at_once([lambda i=i: run.send(envoys[i % 2], delay_ms=800) for i in range(limit + 1)])
    assert sorted(r.status for r in second) == [200] * limit + [429], [r.status for r in second]
    ran = run.executed(shared)
    assert len(ran) == 2 * limit and max_overlap(ran) == limit, ran


def test_a_concurrency_limit_beside_a_rate_limit_reports_both(shared, guard):
    (envoy,) = guard(policy(inflight(1), tokens(limit=10, cost={"header": COST})))
    run = Run()
    holder = in_thread(run.send, envoy, delay_ms=800)
    assert wait_for(lambda: run.running(shared) == 1, 3.0), "the first request never ran"
    busy = run.send(envoy)
    assert_concurrency_limited(busy)
    # The 429 names the full concurrency limit alone: the rate limit was not violated.
    assert "tokens" not in busy.headers["ratelimit-policy"], busy
    ok = holder()
    assert ok.status == 200, ok
    # The most restrictive first: no slot was free once this request took the only one.
    assert ok.headers["ratelimit-policy"] == \
        '"inflight";q=1;qu="concurrent-requests", "tokens";q=10;w=3600', ok
    assert ok.headers["ratelimit"].startswith('"inflight";r=0, "tokens";r=9;t='), ok
    assert remaining(ok) == 9, ok
    # The rejected request consumed nothing from the rate limit (one script call checks both).
    assert fw_count(shared, only_key(shared, envoy.key_prefix, "fw")) == 1


def test_back_to_back_requests_of_one_client_each_find_a_free_slot(shared, guard):
    """With limit 1, a client that sends its next request as soon as it has the previous
    answer must never meet its own finished request's slot: the response waits for the slot's
    release (one round trip), as it does for a lease. (It once went out on the root's next tick,
    after the client had its answer: back-to-back requests got 429.)"""
    (envoy,) = guard(policy(inflight(1)))
    run = Run()
    spaced = []
    for _ in range(4):
        spaced.append(run.send(envoy).status)
        time.sleep(0.3)  # two ticks and a round trip
    assert spaced == [200] * 4, spaced
    statuses = [run.send(envoy).status for _ in range(8)]
    assert statuses == [200] * 8, (
        f"back-to-back requests of one client: {statuses}; a 429 here is the client's own "
        f"finished request still holding its slot")


def test_a_cap_above_the_real_concurrency_never_rejects(shared, guard):
    """Eight clients sending quick requests one after the other are never more than eight in
    flight, so a cap of 16 never rejects: a finished request's slot no longer counts once its
    response has gone out. (When releases rode the root's tick, the cap also counted about
    req/s x tick finished requests.)"""
    (envoy,) = guard(policy(inflight(16)))
    run = Run()
    deadline = time.monotonic() + 1.5

    def client() -> list[int]:
        statuses = []
        while time.monotonic() < deadline:
            statuses.append(run.send(envoy).status)
        return statuses

    statuses = [s for one in at_once([client] * 8) for s in one]
    assert max_overlap(run.executed(shared)) <= 8
    assert statuses.count(429) == 0, (
        f"{statuses.count(429)} of {len(statuses)} requests got 429 with at most 8 in flight "
        f"under a cap of 16")


# --- 2. every way a stream ends gives its slot back ----------------------------------------------


ENDINGS = {  # how the upstream ends the stream: its steering headers, (status, body whole)
    "ok": ({}, (200, True)),
    "upstream_503": ({"x-upstream-status": "503"}, (503, True)),
    "upstream_500": ({"x-upstream-status": "500"}, (500, True)),
    "upstream_reset": ({"x-upstream-body-bytes": "65536", "x-upstream-reset-after-bytes": "1000"},
                       (200, False)),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_the_slot_is_given_back_however_the_stream_ends(shared, guard, ending):
    limit = 2
    (envoy,) = guard(policy(inflight(limit)))
    run = Run()
    steer, want = ENDINGS[ending]
    steer = {**steer, "x-upstream-delay-ms": "200"}
    # Twice the limit at once, twice over: each round finds the slots of the one before free.
    for _ in range(2):
        got = at_once([lambda: run.fetch(envoy, steer)] * limit)
        assert got == [want] * limit, got
        assert wait_for(lambda: held(shared, envoy.key_prefix) == 0, 2.0), \
            f"{ending}: a slot was kept"
    assert len(run.executed(shared)) == 2 * limit
    assert limit_stat(envoy, "inflight", "allowed") == 2 * limit
    assert limit_stat(envoy, "inflight", "rejected") == 0


def test_a_client_that_goes_away_leaves_its_slot_until_the_window(shared, guard):
    """The clients leave before the service answered: the service is still busy with their
    requests, so their slots stay held (not extended) until the window frees them. More in
    test_e2e_hangups.py."""
    limit = 3
    (envoy,) = guard(policy(inflight(limit, window="3s")))
    run = Run()
    conns = [open_request(envoy, run.path, {TENANT: run.tenant, "x-upstream-delay-ms": "2000"})
             for _ in range(limit)]
    try:
        assert wait_for(lambda: run.running(shared) == limit, 3.0), "never all admitted"
        assert held(shared, envoy.key_prefix) == limit
    finally:
        for conn in conns:
            conn.close()
    assert wait_for(lambda: limit_stat(envoy, "inflight", "slot_orphaned") == limit, 1.0)
    assert run.running(shared) == limit
    assert held(shared, envoy.key_prefix) == limit, "a client that went away freed its slot"
    assert_concurrency_limited(run.send(envoy))
    assert wait_for(lambda: held(shared, envoy.key_prefix) == 0, 4.0, 0.05), "never expired"
    back = at_once([lambda: run.send(envoy, delay_ms=300)] * limit)
    assert [r.status for r in back] == [200] * limit, back


# --- 3. slots of a crashed sidecar expire; a long request keeps its slot -------------------------


@SINGLE_ONLY
def test_a_killed_sidecars_slots_expire_after_the_window(shared, guard):
    limit, window_s = 3, 2.0
    doomed, survivor = guard(policy(inflight(limit, window="2s")), n=2)
    run = Run()
    conns = [open_request(doomed, run.path, {TENANT: run.tenant, "x-upstream-delay-ms": "6000"})
             for _ in range(limit)]
    try:
        assert wait_for(lambda: run.running(shared) == limit, 3.0), "never all admitted"
        key = only_key(shared, doomed.key_prefix, "cc")
        os.kill(doomed.proc.pid, signal.SIGKILL)  # a crash: nothing is given back
        assert doomed.proc.wait_exit(5) is not None
        killed_at = redis_now_us(shared)
        expiries = [score for _, score in shared.redis.zrange(key, 0, -1, withscores=True)]
        assert len(expiries) == limit, expiries
        # Taken at most a window ago, not extended since (the first extension is due at half).
        assert all(killed_at < e <= killed_at + window_s * 1e6 for e in expiries), \
            (killed_at, expiries)

        # Before the window is over the crashed sidecar's slots still count...
        during = run.send(survivor)
        assert redis_now_us(shared) < min(expiries), "too slow to look before the window ended"
        assert_concurrency_limited(during)
        # ...and after it they are free, with nobody giving them back.
        time.sleep(max(0.0, (max(expiries) - redis_now_us(shared)) / 1e6) + 0.05)
        assert live_slots(shared, key) == 0
        again = at_once([lambda: run.send(survivor, delay_ms=300)] * limit)
        assert [r.status for r in again] == [200] * limit, again
        assert limit_stat(survivor, "inflight", "allowed") == limit
    finally:
        for conn in conns:
            conn.close()


@SINGLE_ONLY
def test_a_request_longer_than_the_window_keeps_its_slot(shared, guard):
    """window 1 s, a 3 s request: the slot is extended at half the window while it runs."""
    (envoy,) = guard(policy(inflight(1, window="1s")))
    run = Run()
    holder = in_thread(run.send, envoy, delay_ms=3000)
    assert wait_for(lambda: run.running(shared) == 1, 3.0), "the first request never ran"
    started = time.monotonic()
    checks = []
    for offset in (1.5, 2.5):
        time.sleep(max(0.0, started + offset - time.monotonic()))
        checks.append((offset, run.send(envoy), held(shared, envoy.key_prefix)))
    assert holder().status == 200
    for offset, resp, live in checks:
        assert live == 1, (offset, live)
        assert_concurrency_limited(resp)
    ran = run.executed(shared)
    assert len(ran) == 1 and ran[0]["time"] - ran[0]["started"] >= 2.9, ran
    assert wait_for(lambda: held(shared, envoy.key_prefix) == 0, 2.0)
    assert run.send(envoy).status == 200


@SINGLE_ONLY
def test_extension_keeps_up_when_the_redis_timeout_makes_the_tick_coarse(shared, guard):
    """A slot is extended at half its window, so the root's tick must come well before that
    even when the Redis timeout (which sets the usual tick) is long: the tick is capped at a
    quarter of every concurrency window, as for leases with `extend`."""
    (envoy,) = guard(policy(inflight(1, window="600ms")), timeout="2s")
    run = Run()
    holder = in_thread(run.send, envoy, delay_ms=3000)
    assert wait_for(lambda: run.running(shared) == 1, 3.0), "the first request never ran"
    started = time.monotonic()
    lapses = []
    while time.monotonic() - started < 2.5:
        if held(shared, envoy.key_prefix) != 1:
            lapses.append(round(time.monotonic() - started, 2))
        time.sleep(0.02)
    intruder = run.send(envoy)
    assert holder().status == 200
    assert not lapses, (f"the slot lapsed at {lapses[:3]}... s while its request ran; the "
                        f"intruder got {intruder.status}")
    assert_concurrency_limited(intruder)


# --- 4. cost and charge --------------------------------------------------------------------------


CHARGED_BY_HEADER = {"response_header": USED}


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window", "token_bucket"])
def test_the_response_header_charge_spends_the_budget(shared, guard, algorithm):
    """1000 units, each response reports 300: four requests are admitted (the fourth at 900
    used), the fifth is not; RateLimit says what was left at each admission."""
    (envoy,) = guard(policy(tokens(algorithm, charge=CHARGED_BY_HEADER)))
    run = Run()
    code = {"fixed_window": "fw", "sliding_window": "sw", "token_bucket": "tb"}[algorithm]
    left = []
    for i in range(4):
        resp = run.send(envoy, used=300)
        assert resp.status == 200, (i, resp)
        left.append(remaining(resp))
        key = only_key(shared, envoy.key_prefix, code)
        # The bucket refills 1000/h: a unit at most while this test runs.
        assert wait_for(lambda: units_used(shared, key, algorithm) >= 300 * (i + 1) - 1, 2.0), \
            f"charge {i + 1} never landed: {units_used(shared, key, algorithm)}"
    assert units_used(shared, key, algorithm) <= 1200
    # 1 unit at admission, then 299 more once the charge landed.
    expected = [999, 699, 399, 99]
    slack = 2 if algorithm == "token_bucket" else 0  # the bucket refills 1000/h meanwhile
    assert all(e <= got <= e + slack for e, got in zip(expected, left)), left
    over = run.send(envoy, used=300)
    body = assert_problem(over, 429, "rate_limited")
    assert body["violated-policies"] == ["tokens"]
    assert remaining(over) == 0 and int(over.headers["retry-after"]) >= 1, over
    assert len(run.executed(shared)) == 4
    assert limit_stat(envoy, "tokens", "allowed") == 4
    assert limit_stat(envoy, "tokens", "rejected") == 1
    assert limit_stat(envoy, "tokens", "charged") == 1200


def test_the_charge_moves_the_counter_to_the_real_amount_both_ways(shared, guard):
    """A response without a readable charge is charged `unreadable` (100 here), never its
    admitted cost silently."""
    (envoy,) = guard(policy(tokens(charge={**CHARGED_BY_HEADER, "unreadable": 100},
                                   cost={"header": COST, "default": 1, "min": 0})))
    run = Run()
    key_prefix = envoy.key_prefix

    def settled(count: int) -> bool:
        return wait_for(lambda: fw_count(shared, only_key(shared, key_prefix, "fw")) == count, 2.0)

    assert run.send(envoy, cost="7").status == 200  # no charge in the response: 100
    assert settled(100), "a response without a charge is charged the fallback"
    assert run.send(envoy, cost="300", used=50).status == 200  # charged less than admitted
    assert settled(150)
    assert run.send(envoy, cost="5", used="abc").status == 200  # unreadable: 100
    assert settled(250)
    assert run.send(envoy, cost="0", used=38).status == 200
    assert settled(288)
    assert limit_stat(envoy, "tokens", "charged") == 100 + 50 + 100 + 38
    assert limit_stat(envoy, "tokens", "charge_unreadable") == 2
    assert limit_stat(envoy, "tokens", "allowed") == 4


def test_a_cost_of_zero_admits_only_while_the_counter_is_below_the_limit(shared, guard):
    """(A configuration that lets a cost of 0 in says so: `min: 0`.)"""
    (envoy,) = guard(policy(tokens(charge={**CHARGED_BY_HEADER, "unreadable": "cost"},
                                   cost={"header": COST, "default": 1, "min": 0})))
    run = Run()
    assert run.send(envoy, cost="999").status == 200
    zero = run.send(envoy, cost="0", used=300)
    assert zero.status == 200 and remaining(zero) == 1, zero
    key = only_key(shared, envoy.key_prefix, "fw")
    assert wait_for(lambda: fw_count(shared, key) == 1299, 2.0), fw_count(shared, key)
    assert_problem(run.send(envoy, cost="0"), 429, "rate_limited")

    full = Run()
    assert full.send(envoy, cost="1000").status == 200
    assert_problem(full.send(envoy, cost="0"), 429, "rate_limited")
    assert len(run.executed(shared)) == 2 and len(full.executed(shared)) == 1


INVALID_COSTS = ["501", "-1", "1e3", "abc", "1.5", "+3", "0x10", "12345678901", "3 4", ""]


def test_an_invalid_cost_is_refused_with_400_and_consumes_nothing(shared, guard):
    """Plain digits up to `max` (500) only; anything else is the filter's 400."""
    (envoy,) = guard(policy(tokens(cost={"header": COST, "default": 1, "max": 500})))
    run = Run()
    for value in INVALID_COSTS:
        resp = run.send(envoy, cost=value)
        body = assert_problem(resp, 400, "invalid_cost")
        assert COST in body["detail"] and "500" in body["detail"], (value, body)
    assert run.executed(shared) == []
    assert not list(shared.redis.scan_iter(match=f"{envoy.key_prefix}:*", count=1000))
    assert limit_stat(envoy, "tokens", "allowed") + limit_stat(envoy, "tokens", "rejected") == 0
    ok = run.send(envoy, cost="500")  # max itself is fine
    assert ok.status == 200 and remaining(ok) == 500, ok


def test_a_repeated_cost_header_is_ambiguous(shared, guard):
    (envoy,) = guard(policy(tokens()))
    run = Run()
    status, body = raw_post(envoy, run.path, [(TENANT, run.tenant), (COST, "1"), (COST, "900")])
    assert status == 400, body
    assert is_problem(body, "ambiguous_selector"), body
    assert body["selector"] == f"header:{COST}", body
    assert run.executed(shared) == []
    assert envoy.stat(f"wasmcustom.cg.policy.{POLICY}.ambiguous_input") == 1
    assert not list(shared.redis.scan_iter(match=f"{envoy.key_prefix}:*", count=1000))


def test_two_sidecars_share_one_budget_exactly(shared, guard):
    """Four requests of 250 units through two sidecars fill 1000; each reports 200 used, so
    200 come back. Then six requests of 50 at once through both: exactly four fit."""
    envoys = guard(policy(tokens(charge=CHARGED_BY_HEADER)), n=2)
    run = Run()
    # The upstream holds each for 300 ms, so all four are admitted before any charge (sent as
    # soon as a response ends) lands: their remaining units are then exact.
    first = at_once([lambda i=i: run.send(envoys[i % 2], cost="250", used=200, delay_ms=300)
                     for i in range(4)])
    assert [r.status for r in first] == [200] * 4, first
    assert sorted(remaining(r) for r in first) == [0, 250, 500, 750], first
    key = only_key(shared, envoys[0].key_prefix, "fw")
    assert wait_for(lambda: fw_count(shared, key) == 800, 2.0), fw_count(shared, key)

    burst = at_once([lambda i=i: run.send(envoys[i % 2], cost="50", used=50) for i in range(6)])
    assert sorted(r.status for r in burst) == [200] * 4 + [429] * 2, burst
    for resp in burst:
        if resp.status == 429:
            assert resp.json()["violated-policies"] == ["tokens"] and remaining(resp) == 0, resp
    assert wait_for(lambda: total(envoys, "tokens", "charged") == 4 * 200 + 4 * 50, 2.0)
    time.sleep(0.3)  # the burst's charges equal its costs: nothing more moves
    assert fw_count(shared, key) == 1000
    assert len(run.executed(shared)) == 8
    assert total(envoys, "tokens", "allowed") == 8 and total(envoys, "tokens", "rejected") == 2
    assert all(limit_stat(e, "tokens", "allowed") for e in envoys), "both sidecars admitted"


def test_a_rejected_expensive_request_does_not_turn_away_cheaper_ones(shared, guard):
    """The over-limit cache must not remember a rejection that only the rejected request's
    own cost caused: a cheaper request may still fit. Only a rejection at cost <= 1, or with
    nothing left, is cached."""
    (envoy,) = guard(policy(tokens()))
    run = Run()
    assert run.send(envoy, cost="900").status == 200
    too_big = run.send(envoy, cost="200")
    assert_problem(too_big, 429, "rate_limited")
    assert remaining(too_big) == 100, too_big
    fits = run.send(envoy, cost="100")
    assert fits.status == 200, (f"100 units fit (100 left) but the over-limit cache answered: "
                                f"{fits}; cache hits "
                                f"{envoy.stat('wasmcustom.cg.over_limit_cache.hits')}")
    assert remaining(fits) == 0
    assert_problem(run.send(envoy, cost="1"), 429, "rate_limited")


def test_a_charge_that_gives_units_back_lets_requests_in_again(shared, guard):
    """A charge can lower a counter, so the over-limit cache's premise (a counter only gets
    fuller until retry_after) does not hold for a limit with `charge`: it is never cached."""
    (envoy,) = guard(policy(tokens(charge=CHARGED_BY_HEADER)))
    run = Run()
    holder = in_thread(run.send, envoy, cost="1000", used=100, delay_ms=600)
    assert wait_for(lambda: run.running(shared) == 1, 3.0), "the first request never ran"
    assert_problem(run.send(envoy), 429, "rate_limited")
    assert holder().status == 200
    key = only_key(shared, envoy.key_prefix, "fw")
    assert wait_for(lambda: fw_count(shared, key) == 100, 2.0), fw_count(shared, key)
    again = run.send(envoy)
    assert again.status == 200, (f"900 units are free again but the over-limit cache answered: "
                                 f"{again}")
    assert remaining(again) == 899


def test_the_charge_is_read_from_the_json_body(shared, guard):
    """With `unreadable: cost` a response whose usage cannot be read keeps its admitted cost
    (counted `charge_unreadable`): the pointer is missing, the value is not a plain whole
    number, the body is over `max_body` or is not JSON."""
    (envoy,) = guard(policy(tokens(charge={"response_json": "/usage/total_tokens",
                                           "max_body": "1KiB", "unreadable": "cost"})))
    run = Run()
    key_prefix = envoy.key_prefix
    usage = json.dumps({"id": "r1", "usage": {"prompt_tokens": 100, "total_tokens": 300}})
    resp = run.send(envoy, headers={"x-upstream-json": usage})
    assert resp.status == 200 and resp.json()["usage"]["total_tokens"] == 300, resp
    key = only_key(shared, key_prefix, "fw")
    assert wait_for(lambda: fw_count(shared, key) == 300, 2.0), fw_count(shared, key)
    assert limit_stat(envoy, "tokens", "charged") == 300

    no_charge = [json.dumps({"usage": {}}), json.dumps({"usage": {"total_tokens": "300"}}),
                 json.dumps({"usage": {"total_tokens": 2.5}}),
                 json.dumps({"usage": {"total_tokens": 300}, "pad": "x" * 2000})]
    for body in no_charge:
        assert run.send(envoy, headers={"x-upstream-json": body}).status == 200
    assert run.send(envoy, headers={"x-upstream-body-bytes": "64"}).status == 200  # text/plain
    time.sleep(0.3)
    assert wait_for(lambda: fw_count(shared, key) == 300 + 5, 2.0), fw_count(shared, key)
    assert limit_stat(envoy, "tokens", "charge_unreadable") == 5
    assert limit_stat(envoy, "tokens", "charged") == 300 + 5


# The README's LLM limit: 100,000 tokens a minute, a declared cost up to 10,000, the usage read
# from the response's JSON.
LLM_COST = {"header": COST, "default": 1, "max": 10000}
LLM_CHARGE = {"response_json": "/usage/total_tokens"}


def llm_tokens(**charge) -> dict:
    return tokens(limit=100000, window="1m", cost=LLM_COST, charge={**LLM_CHARGE, **charge})


def usage(n: int) -> str:
    return json.dumps({"usage": {"total_tokens": n}})


def test_a_usage_the_client_hides_is_charged_the_most_a_request_costs(shared, guard):
    """Issue 54: after one request each, JSON with usage 5000 left r=95000, but the same usage
    in an event stream, a gzip-compressed body or a body over `max_body` left r=99999 (the
    admitted estimate), and an event stream with `x-request-cost: 0` left r=100000: the
    client chooses streaming and compression itself. A usage that cannot be read is charged
    `unreadable` (by default `max`: the limit's cost.max, 10000), counted; a cost of 0 is
    refused (`cost.min` is 1 unless set)."""
    (envoy,) = guard(policy(llm_tokens()))
    run = Run()
    resp = run.send(envoy, headers={"x-upstream-json": usage(5000)})
    assert resp.status == 200, resp
    key = only_key(shared, envoy.key_prefix, "fw")
    assert wait_for(lambda: fw_count(shared, key) == 5000, 3.0), fw_count(shared, key)
    used = 5000
    hidden = {
        "an event stream": {"x-upstream-sse-events": "1", "x-upstream-sse-data": usage(5000)},
        "a gzip-compressed body": {"x-upstream-json": usage(5000),
                                   "x-upstream-content-encoding": "gzip"},
        "a body over max_body": {"x-upstream-json-raw": usage(5000),
                                 "x-upstream-json-filler": "160000"},
    }
    for how, steer in hidden.items():
        resp = run.send(envoy, headers=steer)
        assert resp.status == 200, (how, resp)
        used += 10000
        assert wait_for(lambda: fw_count(shared, key) == used, 3.0), (how, fw_count(shared, key))
    sse_free = run.send(envoy, cost="0", headers=hidden["an event stream"])
    body = assert_problem(sse_free, 400, "invalid_cost")
    assert "from 1 to 10000" in body["detail"], body
    assert len(run.executed(shared)) == 4
    resp = run.send(envoy, headers={"x-upstream-json": usage(0)})
    assert remaining(resp) == 100000 - used - 1, resp
    assert limit_stat(envoy, "tokens", "charge_unreadable") == 3
    assert wait_for(lambda: limit_stat(envoy, "tokens", "charged") == 5000 + 30000 + 0, 3.0)


@SINGLE_ONLY
def test_unreadable_can_be_the_admitted_cost_or_a_fixed_charge(shared, guard):
    """`unreadable: cost` keeps the admitted estimate, `unreadable: <n>` charges n; either is
    counted in `charge_unreadable`, never silent."""
    stream = {"x-upstream-sse-events": "1", "x-upstream-sse-data": usage(5000)}
    for unreadable, charged in (("cost", 7), (250, 250)):
        (envoy,) = guard(policy(llm_tokens(unreadable=unreadable)))
        run = Run()
        assert run.send(envoy, cost="7", headers=stream).status == 200
        key = only_key(shared, envoy.key_prefix, "fw")
        assert wait_for(lambda: fw_count(shared, key) == charged, 3.0), \
            (unreadable, fw_count(shared, key))
        assert limit_stat(envoy, "tokens", "charge_unreadable") == 1, unreadable
        assert limit_stat(envoy, "tokens", "charged") == charged, unreadable


@SINGLE_ONLY
def test_a_json_charge_takes_plain_digits_once_as_a_header_charge_does(shared, guard):
    """Issue 54: JSON charges accepted `5.0`, `0.5e1` and `1e30` (a header charge takes plain
    digits only), and a repeated member on the pointer's path is ambiguous (a reader keeping
    the first and one keeping the last disagree). One rule for both: anything but plain
    digits, once, is unreadable and charged the fallback (10000 here)."""
    (envoy,) = guard(policy(llm_tokens()))
    run = Run()
    unreadable = ['{"usage":{"total_tokens":5.0}}', '{"usage":{"total_tokens":0.5e1}}',
                  '{"usage":{"total_tokens":1e30}}',
                  '{"usage":{"total_tokens":5,"total_tokens":9000}}',
                  '{"usage":{"total_tokens":5},"usage":{"total_tokens":9000}}']
    expected = 0
    for raw in unreadable + ['{"usage":{"total_tokens":5}}']:
        assert run.send(envoy, headers={"x-upstream-json-raw": raw}).status == 200, raw
        expected += 10000 if raw in unreadable else 5
        key = only_key(shared, envoy.key_prefix, "fw")
        assert wait_for(lambda: fw_count(shared, key) == expected, 3.0), \
            (raw, fw_count(shared, key), expected)
    assert limit_stat(envoy, "tokens", "charge_unreadable") == len(unreadable)


@SINGLE_ONLY
def test_a_client_cannot_declare_its_requests_free(shared, guard):
    """Issue 54: 30 requests with `x-request-cost: 0` against a limit of 5 all passed (`min`
    defaulted to 0). Now `min` is 1 unless set: each is refused, nothing runs or is counted.
    A configuration that allows free requests says so (`min: 0`)."""
    (envoy,) = guard(policy(tokens(limit=5, cost={"header": COST})))
    run = Run()
    statuses = [run.send(envoy, cost="0").status for _ in range(30)]
    assert statuses == [400] * 30, statuses
    assert run.executed(shared) == []
    assert not list(shared.redis.scan_iter(match=f"{envoy.key_prefix}:*", count=1000))
    (free,) = guard(policy(tokens(limit=5, cost={"header": COST, "min": 0})))
    assert run.send(free, cost="0").status == 200


@SINGLE_ONLY
def test_the_charge_is_read_from_a_grpc_trailer(shared, guard, grpc_service):
    method = "/cg.test.Orders/Create"
    (envoy,) = guard({"name": "llm", "match": {"path_prefix": "/cg.test.Orders/"},
                      "rate_limits": [tokens(charge={"trailer": USED})]},
                     grpc_upstream_port=grpc_service.port)
    tenant = f"tenant-{uid()}"

    def call(used: int | None) -> grpc.StatusCode:
        metadata = [(TENANT, tenant)]
        if used is not None:
            metadata.append((f"x-upstream-trailer-{USED}", str(used)))
        with grpc.insecure_channel(f"127.0.0.1:{envoy.port}") as channel:
            rpc = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            try:
                _, c = rpc.with_call(b"job", metadata=metadata, timeout=10)
                trailers = dict(c.trailing_metadata() or ())
                assert used is None or trailers.get(USED) == str(used), trailers
                return c.code()
            except grpc.RpcError as e:
                return e.code()

    for i in range(4):
        assert call(300) == grpc.StatusCode.OK, i
        key = only_key(shared, envoy.key_prefix, "fw")
        assert wait_for(lambda: fw_count(shared, key) == 300 * (i + 1), 2.0), \
            f"charge {i + 1} never landed: {fw_count(shared, key)}"
    assert call(None) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert envoy.stat("wasmcustom.cg.policy.llm.limit.tokens.charged") == 1200
    assert envoy.stat("wasmcustom.cg.policy.llm.limit.tokens.allowed") == 4


# --- 5. configurations Envoy refuses -------------------------------------------------------------


REFUSED = {
    "sliding_log": (tokens("sliding_log"), "policies[0].rate_limits[0].cost: is not supported "
                    "with algorithm sliding_log"),
    "concurrency": ({**inflight(5), "charge": CHARGED_BY_HEADER},
                    "policies[0].rate_limits[0].charge: is not supported with algorithm "
                    "concurrency"),
    "leased": (tokens(mode="leased"), "policies[0].rate_limits[0].cost: is not supported with "
               'mode "leased"'),
    "max_over_limit": (tokens(limit=1000, cost={"header": COST, "default": 1, "max": 10000}),
                       "policies[0].rate_limits[0].cost.max: 10000 is more than the limit can "
                       "ever admit (1000)"),
    "max_body_over_buffer": (tokens(charge={"response_json": "/usage/total_tokens",
                                            "max_body": "2MiB"}),
                             "policies[0].rate_limits[0].charge.max_body: 2097152 bytes is above "
                             "envoy_buffer_limit (1048576 bytes)"),
    "unreadable": (tokens(charge={"response_header": USED, "unreadable": "maximum"}),
                   'policies[0].rate_limits[0].charge.unreadable: "maximum" is not "cost", "max" '
                   'or a whole number of units from 0 to 1000000000'),
    "pointer": (tokens(charge={"response_json": "/usage/a~2"}),
                'policies[0].rate_limits[0].charge.response_json: "/usage/a~2" is not a JSON '
                "pointer (RFC 6901)"),
}


@SINGLE_ONLY
@pytest.mark.parametrize("case", list(REFUSED))
def test_envoy_refuses_cost_or_charge_where_they_cannot_apply(shared, case):
    limit, message = REFUSED[case]
    config = plugin(shared, f"cg:e2e-quota:{uid()}", policy(limit))
    code, log = shared.envoy_expect_failure(config)
    assert code is not None and code != 0, log[-3000:]
    assert f"invalid plugin configuration: {message}" in log, log[-3000:]
