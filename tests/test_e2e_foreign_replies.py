"""A reply that is another call's is never read as the call's answer, end to end: real Envoy
running the filter (one worker), real webdis and redis-server, the counting upstream.

webdis writes a command's reply, once Redis answers, to the connection its client had, even
when that client closed first: a newer connection that got the same descriptor reads the old
command's reply as its own (src/redis/tag.rs). Here Redis is paused (`CLIENT PAUSE`) longer
than the callout's host timeout (twice the filter's timeout plus 100 ms), so Envoy closes the
connections of the acquires of tenant X's duplicates (whose replies are X's stored
responses); then, shortly before the pause ends, tenant Y's fresh requests open new
connections, which webdis numbers as the closed ones. Each of Y's requests must be answered
by its own call or fail closed; a filter that reads whatever comes back replays X's response
to Y (the same body, so the same fingerprint: X's record passes for Y's). Each call's tag
turns such a reply into an unknown outcome (`503 guard_unavailable`, counted
`redis.foreign_replies`), and what the call may have taken is given back: Y's retries run.

The misdelivery needs fresh connections at the right moment: a round that produced none
proves nothing, so rounds run until the filter saw at least one (bounded), and every round's
answers are checked.
"""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import problems
from harness.envoy import Envoy, Response
from harness.stack import Stack

pytestmark = pytest.mark.topologies("single")

TENANT = "x-tenant-id"
TIMEOUT_MS = 300  # the filter's; Envoy closes a callout's connection at 2 x 300 + 100 ms
PAUSE_MS = 900  # longer than that, and ends within the timeout of Y's requests
Y_AFTER = 0.74  # when Y's requests go: after X's connections closed, before the pause ends
X_REQUESTS, Y_REQUESTS = 8, 32
MAX_ROUNDS = 10
BODY = b'{"item":"book"}'


def uid() -> str:
    return uuid.uuid4().hex[:10]


def plugin(stack: Stack, prefix: str) -> dict:
    redis = stack.redis_section(key_prefix=prefix, timeout=f"{TIMEOUT_MS}ms")
    redis["batch"] = False  # a call per request: a connection per call
    return {"redis": redis, "identity": {"tenant_header": TENANT, "missing_tenant": "reject"},
            "policies": [{
                "name": "orders", "match": {"methods": ["POST"], "path_prefix": "/orders"},
                "failure_mode": "fail_closed",
                "idempotency": {"processing_ttl": "2m", "fingerprint": ["method", "body"]}}]}


def post(envoy: Envoy, tenant: str, key: str, path: str) -> Response:
    return envoy.request("POST", path, headers={TENANT: tenant, "idempotency-key": key,
                                                "content-type": "application/json",
                                                "x-upstream-status": "201"},
                         body=BODY, timeout=10)


def own_or_unavailable(resp: Response, path: str) -> str:
    """The answer of a request to `path` whose key was never sent before: the service's own
    answer to it ("ran"), or the filter's 503 ("503"). Anything else fails."""
    if resp.status == 503:
        assert problems.is_problem(resp.json(), "guard_unavailable"), resp
        return "503"
    assert resp.status == 201, resp
    assert "idempotent-replayed" not in resp.headers, (
        f"a fresh key of tenant Y replayed: {path} got {resp}")
    assert json.loads(resp.body)["path"] == path, f"{path} got another request's answer: {resp}"
    return "ran"


def foreign(envoy: Envoy) -> int:
    return envoy.stat("wasmcustom.cg.redis.foreign_replies")


def test_another_calls_reply_is_never_read_as_the_answer(stack_factory):
    stack = stack_factory(None, envoys=0)
    prefix = f"cg:test:{uid()}"
    envoy = stack.add_envoy(plugin(stack, prefix), concurrency=1)
    # Tenant X's records, completed: a duplicate's acquire replies X's stored response.
    xs = [(f"kx-{uid()}", f"/orders/x-{uid()}") for _ in range(X_REQUESTS)]
    for key, path in xs:
        assert post(envoy, "tenant-x", key, path).status == 201

    seen: dict[str, int] = {"ran": 0, "503": 0}
    unavailable: list[tuple[str, str]] = []
    rounds = 0
    while rounds < MAX_ROUNDS and not (foreign(envoy) > 0 and rounds >= 2):
        rounds += 1
        stack.redis.client_pause(PAUSE_MS)  # every client, webdis's connections to Redis too
        ys = [(f"ky-{uid()}", f"/orders/y-{uid()}") for _ in range(Y_REQUESTS)]
        with ThreadPoolExecutor(X_REQUESTS + Y_REQUESTS) as pool:
            started = time.monotonic()
            x_answers = [pool.submit(post, envoy, "tenant-x", k, p) for k, p in xs]
            time.sleep(max(0.0, started + Y_AFTER - time.monotonic()))
            y_answers = [pool.submit(post, envoy, "tenant-y", k, p) for k, p in ys]
            for (key, path), answer in zip(xs, x_answers):
                r = answer.result(timeout=10)
                # Its own replay, or failed closed while Redis was paused.
                assert r.status == 503 or (
                    r.status == 201 and json.loads(r.body)["path"] == path), (path, r)
            for (key, path), answer in zip(ys, y_answers):
                kind = own_or_unavailable(answer.result(timeout=10), path)
                seen[kind] += 1
                if kind == "503":
                    unavailable.append((key, path))
        time.sleep(PAUSE_MS / 1000 + 0.5)  # late replies, releases and their retries land

    counters = envoy.stats(filter="wasmcustom.cg.redis")
    assert foreign(envoy) >= 1, (
        f"no reply reached another call in {rounds} rounds: the test did not reproduce the "
        f"misdelivery ({counters}, Y's answers {seen})")
    # Every foreign reply failed its call (counted an error too), and none was an answer.
    assert counters["wasmcustom.cg.redis.errors"] >= foreign(envoy), counters
    assert seen["ran"] > 0, seen
    # What the calls answered by another's reply may have taken was given back: each of those
    # requests runs when its client sends it again, once, with its own answer.
    for key, path in unavailable:
        r = post(envoy, "tenant-y", key, path)
        assert own_or_unavailable(r, path) == "ran", (path, r)
        assert stack.upstream.count("POST", path) == 1, path
