"""End-to-end: every decision the filter makes is visible to Envoy's own tooling.

The filter sets its decision as the stream's property `coordination_guard` (Envoy's filter state
`wasm.coordination_guard`); the tests' Envoy (envoy/template.yaml) writes one access log line per
request with `%RESPONSE_CODE%` and `%FILTER_STATE(wasm.coordination_guard:PLAIN)%`. For each
verdict the request that produces it is sent and its line read back: policy, verdict, limit,
remaining, the tenant's hash tag (the raw tenant id never appears), status; a request no policy
guards logs `-`.

Requests go one at a time and each waits for its own line (Envoy flushes the log about once a
second), so the log's n-th line is the n-th request's.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
import uuid

import pytest

from harness.envoy import Envoy
from harness.stack import DEAD_CLUSTER, Stack

pytestmark = pytest.mark.topologies("single", "cluster")

TENANT = "x-tenant-id"
LINE = re.compile(r'^\[[^\]]+\] "(?P<method>\S+) (?P<path>\S+)" (?P<code>\d+) (?P<state>.*)$')
DECISION = re.compile(r"^policy=(?P<policy>[A-Za-z0-9_-]+) verdict=(?P<verdict>[a-z_]+) "
                      r"limit=(?P<limit>[A-Za-z0-9_-]+|-) remaining=(?P<remaining>\d+|-) "
                      r"tenant=(?P<tenant>t\.[0-9a-f]{16}|-) status=(?P<status>\d+|-)$")


def tag(tenant: str) -> str:
    """The tenant's hash tag, as the Redis keys carry it (src/redis/keys.rs)."""
    return "t." + hashlib.sha256(b"tenant\0" + tenant.encode()).digest()[:8].hex()


def rl(name: str, limit: int, **extra) -> dict:
    return {"name": name, "by": ["tenant"], "algorithm": "fixed_window", "limit": limit,
            "window": "60s", **extra}


IDEMPOTENCY = {"header": "idempotency-key", "required": True, "methods": ["POST"],
               "processing_ttl": "2m", "completed_ttl": "1h", "fingerprint": ["method", "path", "body"],
               "replay": "full", "conflict_status": 422}

POLICIES = [
    {"name": "limited", "match": {"path_prefix": "/limited"}, "rate_limits": [rl("per-tenant", 2)]},
    {"name": "dry", "match": {"path_prefix": "/dry"},
     "rate_limits": [rl("enforced", 10), rl("trial", 1, shadow=True)]},
    {"name": "orders", "match": {"methods": ["POST"], "path_prefix": "/orders"},
     "idempotency": IDEMPOTENCY},
    {"name": "activate", "match": {"methods": ["POST"], "path_prefix": "/devices"},
     "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "10s", "on_busy": "reject"}},
]

FAILING = [
    {"name": "closed", "match": {"path_prefix": "/closed"}, "failure_mode": "fail_closed",
     "rate_limits": [rl("per-tenant", 5)]},
    {"name": "open", "match": {"path_prefix": "/open"}, "failure_mode": "fail_open",
     "rate_limits": [rl("per-tenant", 5)]},
]


def start(stack_factory, policies: list[dict], **redis) -> Stack:
    stack = stack_factory(None, envoys=0)
    stack.add_envoy({"redis": stack.redis_section(key_prefix="cg:e2e", timeout="1s", **redis),
                     "identity": {"tenant_header": TENANT, "missing_tenant": "reject"},
                     "policies": policies})
    return stack


class AccessLog:
    """The Envoy's access log, read line by line as requests complete."""

    def __init__(self, envoy: Envoy):
        self.path = envoy.workdir / "access.log"
        self.seen = 0

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines() if self.path.exists() else []

    def next(self, count: int = 1, timeout: float = 10.0) -> list[re.Match]:
        """The next `count` lines, once Envoy has written them."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.lines()
            if len(lines) >= self.seen + count:
                break
            assert time.monotonic() < deadline, f"no access log line after {self.seen}: {lines}"
            time.sleep(0.1)
        new = lines[self.seen:self.seen + count]
        self.seen += count
        parsed = [LINE.match(line) for line in new]
        assert all(parsed), new
        return parsed


def decision(line: re.Match) -> dict:
    state = line["state"]
    found = DECISION.match(state)
    assert found, f"not a decision line: {state!r}"
    return found.groupdict()


def send(envoy: Envoy, log: AccessLog, method: str, path: str, tenant: str | None = None,
         body: bytes | None = None, **headers) -> tuple[int, dict | None]:
    """One request and its access log line: (the status Envoy logged, the decision or None)."""
    sent = {TENANT: tenant} if tenant else {}
    sent.update({k.replace("_", "-"): v for k, v in headers.items()})
    resp = envoy.request(method, path, headers=sent, body=body)
    (line,) = log.next()
    assert line["path"] == path and int(line["code"]) == resp.status, (line.string, resp)
    return resp.status, (None if line["state"] == "-" else decision(line))


def expect(got: tuple[int, dict | None], code: int, **fields) -> None:
    """`got` has the status `code` Envoy logged and the decision's `fields`."""
    logged, facts = got
    assert logged == code, got
    assert facts is not None, got
    want = {k: str(v) for k, v in fields.items()}
    assert {k: facts[k] for k in want} == want, facts


def test_each_verdict_is_in_the_access_log(stack_factory):
    stack = start(stack_factory, POLICIES)
    envoy = stack.envoy
    log = AccessLog(envoy)
    tenant = f"tenant-{uuid.uuid4().hex[:10]}"
    t = tag(tenant)

    # No policy guards it: no filter state, `-`.
    assert send(envoy, log, "GET", "/health", tenant) == (200, None)

    # Rate limits: allowed (the limit with its remaining), rejected by Redis, then by the
    # over-limit cache (the same line: the limit that rejects, nothing remaining).
    for remaining in (1, 0):
        expect(send(envoy, log, "GET", "/limited/a", tenant), 200, policy="limited",
               verdict="allowed", limit="per-tenant", remaining=remaining, tenant=t, status="-")
    for _ in range(2):
        expect(send(envoy, log, "GET", "/limited/a", tenant), 429, policy="limited",
               verdict="rejected", limit="per-tenant", remaining=0, tenant=t, status=429)

    # A shadow limit that would reject: forwarded, named with what it has left.
    expect(send(envoy, log, "GET", "/dry", tenant), 200, verdict="allowed", limit="enforced",
           remaining=9)
    expect(send(envoy, log, "GET", "/dry", tenant), 200, policy="dry", verdict="shadow_rejected",
           limit="trial", remaining=0, tenant=t, status="-")

    # Idempotency: the first request goes on, the same again is replayed (with the stored
    # status), another body under the key conflicts, no key is refused.
    key = uuid.uuid4().hex
    expect(send(envoy, log, "POST", "/orders", tenant, b'{"n":1}', idempotency_key=key,
                x_upstream_status="201"),
           201, policy="orders", verdict="allowed", limit="-", remaining="-", tenant=t, status="-")
    expect(send(envoy, log, "POST", "/orders", tenant, b'{"n":1}', idempotency_key=key),
           201, policy="orders", verdict="replayed", tenant=t, status=201)
    expect(send(envoy, log, "POST", "/orders", tenant, b'{"n":2}', idempotency_key=key),
           422, policy="orders", verdict="conflict", tenant=t, status=422)
    expect(send(envoy, log, "POST", "/orders", tenant, b'{"n":3}'),
           400, policy="orders", verdict="refused", tenant=t, status=400)
    # No tenant at all: refused before anyone is known.
    expect(send(envoy, log, "GET", "/limited/a"), 401, policy="limited", verdict="refused",
           limit="-", remaining="-", tenant="-", status=401)

    # The same request while the first is in progress, and a lease another request holds:
    # the first of each is slow upstream; the second goes while it runs.
    def slow(path: str, **headers) -> threading.Thread:
        def run() -> None:
            envoy.request("POST", path, headers={TENANT: tenant, "x-upstream-delay-ms": "1500",
                                                 **headers}, body=b'{"n":9}')
        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.5)
        return thread

    key = uuid.uuid4().hex
    first = slow("/orders", **{"idempotency-key": key})
    busy = envoy.request("POST", "/orders", headers={TENANT: tenant, "idempotency-key": key},
                         body=b'{"n":9}')
    first.join()
    lines = [decision(line) | {"code": line["code"]} for line in log.next(2)]
    assert busy.status == 409, busy
    assert {(d["verdict"], d["status"], d["code"]) for d in lines} == {
        ("in_progress", "409", "409"), ("allowed", "-", "200")}, lines

    first = slow("/devices/d1/activate")
    busy = envoy.request("POST", "/devices/d1/activate", headers={TENANT: tenant}, body=b"{}")
    first.join()
    lines = [decision(line) | {"code": line["code"]} for line in log.next(2)]
    assert busy.status == 409, busy
    assert {(d["policy"], d["verdict"], d["status"], d["code"]) for d in lines} == {
        ("activate", "locked", "409", "409"), ("activate", "allowed", "-", "200")}, lines
    assert all(d["tenant"] == t for d in lines), lines

    # The raw tenant id is never written.
    assert tenant not in log.path.read_text()


def test_failures_are_in_the_access_log(stack_factory):
    stack = start(stack_factory, FAILING, cluster=DEAD_CLUSTER)
    envoy = stack.envoy
    log = AccessLog(envoy)
    tenant = f"tenant-{uuid.uuid4().hex[:10]}"
    expect(send(envoy, log, "GET", "/closed", tenant), 503, policy="closed",
           verdict="failed_closed", limit="-", remaining="-", tenant=tag(tenant), status=503)
    expect(send(envoy, log, "GET", "/open", tenant), 200, policy="open", verdict="failed_open",
           limit="-", remaining="-", tenant=tag(tenant), status="-")
    assert tenant not in log.path.read_text()
