"""Idempotency-Key end to end: real Envoy running the filter, real redis-server behind webdis,
and the counting upstream. Every test asserts on what the client sees (status, headers, body),
on what the upstream executed, on the record in Redis and on the filter's metrics.

One Redis/webdis/upstream stack serves the module; each test starts its own Envoy(s) with a
fresh `key_prefix`, and uses its own request paths so the upstream's per-path counts are its
own. Tests that stop Redis or the upstream get a stack of their own. The last test scans every
key the module left in the shared Redis, and every Envoy log.

test_json_bodies_an_upstream_can_tell_apart_are_not_the_same_request fails on purpose until the
fingerprint stops canonicalising JSON lossily (numbers through f64, duplicate members).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import socket
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.concurrency import in_thread, wait_for
from harness.envoy import Envoy, Response
from harness.stack import Stack
from harness.upstream import Upstream
from harness.problems import is_problem

# Every test that builds its stack through `topology` (stack_factory, the module's shared stack)
# runs on a single Redis and on Redis Cluster behind redis_proxy (conftest.py, harness/cluster.py).
pytestmark = pytest.mark.topologies("single", "cluster")

TENANT_HEADER = "x-tenant-id"
FINGERPRINT_RE = re.compile(r"^sha256:[0-9a-f]{64}$")

# Every tenant and client key the module sends, and every Envoy it started, so the last test
# can look for raw identifiers in Redis keys, records and logs.
SENT_TENANTS: set[str] = set()
SENT_KEYS: set[str] = set()
STARTED_ENVOYS: list[Envoy] = []


# --- helpers -------------------------------------------------------------------------------------


def uid() -> str:
    return uuid.uuid4().hex[:10]


def new_tenant() -> str:
    tenant = f"tenant-{uid()}"
    SENT_TENANTS.add(tenant)
    return tenant


def new_key(label: str = "key") -> str:
    key = f"{label}-{uid()}"
    SENT_KEYS.add(key)
    return key


def policy(name: str = "create-order", prefix: str = "/orders", *,
           failure_mode: str = "fail_closed", rate_limits: list | None = None, **idem) -> dict:
    """A policy guarding POST/PATCH under `prefix`; `idem` overrides the idempotency block."""
    block = {"header": "idempotency-key", "required": True, "methods": ["POST", "PATCH"],
             "processing_ttl": "2m", "completed_ttl": "24h",
             "fingerprint": ["method", "path", "body"], "max_request_body": "512KiB",
             "replay": "full", "max_response_body": "64KiB",
             "replay_headers": ["content-type", "location", "etag"], "conflict_status": 422,
             "retryable_statuses": ["5xx", 408, 425, 429], "complete": "sync"}
    block.update(idem)
    p = {"name": name, "match": {"methods": ["POST", "PATCH"], "path_prefix": prefix},
         "failure_mode": failure_mode, "idempotency": block}
    if rate_limits:
        p["rate_limits"] = rate_limits
    return p


def plugin(stack: Stack, key_prefix: str, *policies: dict, timeout: str = "500ms") -> dict:
    """The plugin config. These tests check what happens, not how fast: a generous Redis
    timeout keeps a busy machine from turning a slow callout into a 503 (the 50ms default did,
    once in ~10 runs of the 50-request burst, while other suites ran on the same box). Async
    completion is sent on the root's tick (timeout / 2), so its tests use 50ms."""
    return {"redis": stack.redis_section(key_prefix=key_prefix, timeout=timeout),
            "identity": {"tenant_header": TENANT_HEADER, "principal_header": "x-user-id",
                         "missing_tenant": "reject"},
            "policies": list(policies)}


def post(envoy: Envoy, path: str, key: str | None, body: bytes = b'{"item":"book"}', *,
         tenant: str, content_type: str = "application/json", method: str = "POST",
         **upstream) -> Response:
    """One request; `upstream` keyword args become steering headers (`status=201` ->
    `x-upstream-status: 201`, `header_location="/o/1"` -> `x-upstream-header-location`)."""
    headers = {TENANT_HEADER: tenant, "content-type": content_type}
    if key is not None:
        headers["idempotency-key"] = key
    for name, value in upstream.items():
        if name.startswith("header_"):
            headers["x-upstream-header-" + name[len("header_"):].replace("_", "-")] = str(value)
        else:
            headers["x-upstream-" + name.replace("_", "-")] = str(value)
    return envoy.request(method, path, headers=headers, body=body)


def raw_request(envoy: Envoy, method: str, path: str, headers: list[tuple[str, str | bytes]],
                body: bytes = b"", chunked: bool = False) -> Response:
    """A request with header lines exactly as given (repeated names, non-ASCII bytes) and,
    with `chunked`, a body sent in 256-byte chunks without Content-Length."""
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=10)
    start = time.monotonic()
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        if chunked:
            conn.putheader("transfer-encoding", "chunked")
            conn.endheaders()
            for i in range(0, len(body), 256):
                piece = body[i:i + 256]
                conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
            conn.send(b"0\r\n\r\n")
        else:
            conn.putheader("content-length", str(len(body)))
            conn.endheaders(body)
        resp = conn.getresponse()
        return Response(resp.status, dict(resp.getheaders()), resp.read(), time.monotonic() - start)
    finally:
        conn.close()


def wasm_warnings(envoy: Envoy) -> str:
    """The filter's warnings and errors from the Envoy log, for assertion messages."""
    return "\n".join(line for line in envoy.log_text().splitlines()
                     if "wasm log" in line and ("][warning][" in line or "][error][" in line
                                                or "][critical][" in line))


def idem_stat(envoy: Envoy, policy_name: str, name: str) -> int:
    return envoy.stat(f"wasmcustom.cg.policy.{policy_name}.idem.{name}")


def assert_problem(resp: Response, status: int, slug: str, case: str = "") -> dict:
    assert resp.status == status, (case, resp)
    assert resp.headers.get("content-type") == "application/problem+json", (case, resp)
    problem = resp.json()
    assert is_problem(problem, slug), (case, problem)
    assert problem["status"] == status, (case, problem)
    assert "idempotent-replayed" not in resp.headers, (case, resp)
    return problem


def assert_replay_of(replay: Response, original: Response, headers=("content-type", "location", "etag")):
    assert replay.status == original.status, replay
    assert replay.headers.get("idempotent-replayed") == "true", replay
    for name in headers:
        assert replay.headers.get(name) == original.headers.get(name), (name, replay, original)
    assert replay.body == original.body, (replay.body, original.body)


def record_key(prefix: str, tenant: str, policy_name: str, client_key: str) -> str:
    """The documented key: <prefix>:idem:{t.<16 hex>}:<policy>:<32 hex>."""
    tenant_hash = hashlib.sha256(b"tenant\0" + tenant.encode()).hexdigest()[:16]
    key_hash = hashlib.sha256(client_key.encode()).hexdigest()[:32]
    return f"{prefix}:idem:{{t.{tenant_hash}}}:{policy_name}:{key_hash}"


def stored(stack: Stack, key: str) -> dict | None:
    raw = stack.redis.get(key)
    return None if raw is None else json.loads(raw)


def upstream_requests(stack: Stack, path: str) -> list[dict]:
    return [r for r in stack.upstream.requests() if r["path"] == path]


def own_envoy(stack: Stack, key_prefix: str, *policies: dict) -> Envoy:
    """An Envoy on a stack of the test's own (stopped with that stack)."""
    envoy = stack.add_envoy(plugin(stack, key_prefix, *policies))
    STARTED_ENVOYS.append(envoy)
    return envoy


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory, topology):
    """Redis, webdis and the upstream for the whole module (on its topology); Envoys are
    added per test."""
    stack = Stack(tmp_path_factory.mktemp("idem-e2e"), None, envoys=0, **topology.stack_kwargs).start()
    yield stack
    stack.stop()


@pytest.fixture
def guard(shared):
    """`guard(*policies) -> Envoy` on the shared stack, with a key_prefix of its own
    (`envoy.key_prefix`); `guard(*policies, sidecars=n)` -> n Envoys sharing one config;
    `timeout` is the Redis timeout. Stopped when the test ends."""
    started: list[Envoy] = []

    def make(*policies: dict, sidecars: int = 1, timeout: str = "500ms"):
        prefix = f"cg:e2e-idem:{uid()}"
        envoys = []
        for _ in range(sidecars):
            envoy = shared.add_envoy(plugin(shared, prefix, *policies, timeout=timeout))
            envoy.key_prefix = prefix
            started.append(envoy)
            STARTED_ENVOYS.append(envoy)
            envoys.append(envoy)
        return envoys[0] if sidecars == 1 else envoys

    yield make
    for envoy in started:
        envoy.stop()


# --- sequential retry ----------------------------------------------------------------------------


def test_sequential_retry_executes_once_and_replays_the_stored_response(shared, guard):
    envoy = guard(policy())
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"

    first = post(envoy, path, key, b'{"a":1,"b":2}', tenant=tenant, status=201,
                 header_location="/orders/o-1", header_etag='"v1"')
    assert first.status == 201, first
    assert "idempotent-replayed" not in first.headers
    assert (first.headers["location"], first.headers["etag"]) == ("/orders/o-1", '"v1"')
    assert first.json()["served"] == 1

    # The retry reorders the JSON and would be answered 500 with other headers if it ran.
    retry = post(envoy, path, key, b'{ "b": 2, "a": 1 }', tenant=tenant, status=500,
                 header_location="/orders/o-2", header_etag='"v2"')
    assert_replay_of(retry, first)
    again = post(envoy, path, key, b'{"b":2,\n"a":1}', tenant=tenant)
    assert_replay_of(again, first)

    executed = upstream_requests(shared, path)
    assert len(executed) == 1, executed
    assert FINGERPRINT_RE.match(executed[0]["headers"]["x-idempotency-fingerprint"]), executed[0]
    assert executed[0]["body_sha256"] == hashlib.sha256(b'{"a":1,"b":2}').hexdigest()

    record = stored(shared, record_key(envoy.key_prefix, tenant, "create-order", key))
    assert record["state"] == "COMPLETED", record
    assert record["fingerprint"] == executed[0]["headers"]["x-idempotency-fingerprint"]
    assert record["response"]["status"] == 201
    pttl = shared.redis.pttl(record_key(envoy.key_prefix, tenant, "create-order", key))
    assert 86_000_000 < pttl <= 86_400_000, pttl  # completed_ttl 24h, not processing_ttl

    stats = {n: idem_stat(envoy, "create-order", n) for n in ("acquired", "completed", "replayed")}
    assert stats == {"acquired": 1, "completed": 1, "replayed": 2}


# --- concurrent duplicates -----------------------------------------------------------------------


def test_fifty_concurrent_duplicates_execute_once(shared, guard):
    envoy = guard(policy())
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    barrier = threading.Barrier(50)

    def one(_):
        barrier.wait(timeout=10)
        return post(envoy, path, key, b'{"qty":3}', tenant=tenant, delay_ms=1500, status=201,
                    header_location="/orders/o-9")

    with ThreadPoolExecutor(max_workers=50) as pool:
        responses = list(pool.map(one, range(50)))

    assert Counter(r.status for r in responses) == {201: 1, 409: 49}, (
        [r for r in responses if r.status not in (201, 409)], wasm_warnings(envoy))
    winner = next(r for r in responses if r.status == 201)
    assert "idempotent-replayed" not in winner.headers
    for r in responses:
        if r.status == 409:
            assert_problem(r, 409, "idempotency_key_in_use")
            assert int(r.headers["retry-after"]) >= 1, r
            assert r.elapsed < 1.4, r  # answered at once, not after the upstream
    assert shared.upstream.count("POST", path) == 1

    retry = post(envoy, path, key, b'{"qty":3}', tenant=tenant)
    assert_replay_of(retry, winner)
    assert shared.upstream.count("POST", path) == 1
    stats = {n: idem_stat(envoy, "create-order", n)
             for n in ("acquired", "in_progress", "completed", "replayed")}
    assert stats == {"acquired": 1, "in_progress": 49, "completed": 1, "replayed": 1}


def test_concurrent_duplicates_across_two_sidecars_execute_once(shared, guard):
    left, right = guard(policy(), sidecars=2)
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    barrier = threading.Barrier(20)

    def one(i):
        barrier.wait(timeout=10)
        return post((left, right)[i % 2], path, key, b'{"qty":1}', tenant=tenant, delay_ms=800, status=201)

    with ThreadPoolExecutor(max_workers=20) as pool:
        responses = list(pool.map(one, range(20)))
    assert Counter(r.status for r in responses) == {201: 1, 409: 19}, (
        [r for r in responses if r.status not in (201, 409)],
        wasm_warnings(left), wasm_warnings(right))
    winner = next(r for r in responses if r.status == 201)
    assert_replay_of(post(left, path, key, b'{"qty":1}', tenant=tenant), winner)
    assert_replay_of(post(right, path, key, b'{"qty":1}', tenant=tenant), winner)
    assert shared.upstream.count("POST", path) == 1
    assert sum(idem_stat(e, "create-order", "acquired") for e in (left, right)) == 1
    assert sum(idem_stat(e, "create-order", "in_progress") for e in (left, right)) == 19


# --- waiting duplicates (in_progress: wait) -------------------------------------------------------


def processing(stack: Stack, envoy: Envoy, tenant: str, key: str) -> bool:
    """The record of `key` is PROCESSING: the first request is running."""
    record = stored(stack, record_key(envoy.key_prefix, tenant, "create-order", key))
    return record is not None and record["state"] == "PROCESSING"


def test_waiting_duplicates_get_the_first_answer_across_two_sidecars(shared, guard):
    left, right = guard(policy(in_progress="wait", max_wait="5s"), sidecars=2)
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    barrier = threading.Barrier(20)

    def one(i):
        barrier.wait(timeout=10)
        return post((left, right)[i % 2], path, key, b'{"qty":2}', tenant=tenant, delay_ms=1000,
                    status=201, header_location="/orders/o-20")

    with ThreadPoolExecutor(max_workers=20) as pool:
        responses = list(pool.map(one, range(20)))
    assert Counter(r.status for r in responses) == {201: 20}, (
        [r for r in responses if r.status != 201], wasm_warnings(left), wasm_warnings(right))
    originals = [r for r in responses if "idempotent-replayed" not in r.headers]
    assert len(originals) == 1, originals
    for r in responses:
        if r is not originals[0]:
            assert_replay_of(r, originals[0])
    assert shared.upstream.count("POST", path) == 1
    envoys = (left, right)
    stats = {n: sum(idem_stat(e, "create-order", n) for e in envoys)
             for n in ("acquired", "waited", "replayed", "in_progress")}
    assert stats == {"acquired": 1, "waited": 19, "replayed": 19, "in_progress": 0}, stats


def test_a_failed_first_request_is_run_again_by_exactly_one_waiter(shared, guard):
    envoy = guard(policy(in_progress="wait", max_wait="5s"))
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    # The first runs for 1 s and fails with a retryable 503: its record is released.
    first = in_thread(lambda: post(envoy, path, key, b'{"qty":4}', tenant=tenant, delay_ms=1000,
                                   status=503))
    assert wait_for(lambda: processing(shared, envoy, tenant, key), timeout=5)

    def duplicate(_):
        return post(envoy, path, key, b'{"qty":4}', tenant=tenant, delay_ms=500, status=201,
                    header_location="/orders/o-21")

    with ThreadPoolExecutor(max_workers=8) as pool:
        waiters = list(pool.map(duplicate, range(8)))
    assert first(timeout=10).status == 503
    assert Counter(r.status for r in waiters) == {201: 8}, (waiters, wasm_warnings(envoy))
    ran = [r for r in waiters if "idempotent-replayed" not in r.headers]
    assert len(ran) == 1, ran
    for r in waiters:
        if r is not ran[0]:
            assert_replay_of(r, ran[0])
    assert shared.upstream.count("POST", path) == 2
    assert idem_stat(envoy, "create-order", "released") == 1


@pytest.mark.parametrize("status", [409, 425])
def test_a_duplicate_waits_at_most_max_wait(shared, guard, status):
    envoy = guard(policy(in_progress="wait", max_wait="300ms", in_progress_status=status))
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    first = in_thread(lambda: post(envoy, path, key, tenant=tenant, delay_ms=2000, status=201))
    assert wait_for(lambda: processing(shared, envoy, tenant, key), timeout=5)
    late = post(envoy, path, key, tenant=tenant, status=201)
    assert_problem(late, status, "idempotency_key_in_use")
    assert late.headers.get("retry-after") == "1", late
    assert 0.25 <= late.elapsed < 1.5, late.elapsed  # after max_wait, not after the upstream
    assert first(timeout=10).status == 201
    assert shared.upstream.count("POST", path) == 1
    assert idem_stat(envoy, "create-order", "in_progress") == 1


def test_a_waiting_duplicate_with_another_body_is_a_conflict_at_once(shared, guard):
    envoy = guard(policy(in_progress="wait", max_wait="5s"))
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    first = in_thread(lambda: post(envoy, path, key, b'{"a":1}', tenant=tenant, delay_ms=1500))
    assert wait_for(lambda: processing(shared, envoy, tenant, key), timeout=5)
    other = post(envoy, path, key, b'{"a":2}', tenant=tenant)
    assert_problem(other, 422, "idempotency_key_conflict")
    assert other.elapsed < 1.0, other.elapsed
    assert first(timeout=10).status == 200


# --- same key, different request -----------------------------------------------------------------


@pytest.mark.parametrize("conflict_status", [422, 409])
def test_same_key_different_body_is_a_conflict_that_reveals_nothing(shared, guard, conflict_status):
    envoy = guard(policy(conflict_status=conflict_status))
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    original = b'{"amount":100,"card":"4111-SECRET-original"}'
    first = post(envoy, path, key, original, tenant=tenant, status=201)
    assert first.status == 201
    rkey = record_key(envoy.key_prefix, tenant, "create-order", key)
    before, pttl_before = shared.redis.get(rkey), shared.redis.pttl(rkey)
    fingerprint = json.loads(before)["fingerprint"]

    for method, body, where in [("POST", b'{"amount":200,"card":"4111-SECRET-original"}', path),
                                ("POST", b'{"amount":100}', path),
                                ("POST", original, path + "-other"),  # the path is fingerprinted
                                ("PATCH", original, path)]:  # and so is the method
        conflict = post(envoy, where, key, body, tenant=tenant, method=method, status=201)
        problem = assert_problem(conflict, conflict_status, "idempotency_key_conflict")
        text = conflict.body.decode()
        for secret in ("SECRET", "4111", "amount", fingerprint.split(":")[1], "served", key):
            assert secret not in text, (secret, problem)

    assert shared.upstream.count("POST", path) == 1
    assert shared.upstream.count("POST", path + "-other") == 0
    assert shared.upstream.count("PATCH", path) == 0
    assert shared.redis.get(rkey) == before, "a conflict must not touch the stored record"
    assert shared.redis.pttl(rkey) <= pttl_before
    assert idem_stat(envoy, "create-order", "conflict") == 4
    # The original request still replays.
    assert_replay_of(post(envoy, path, key, original, tenant=tenant), first)


def test_different_body_while_the_first_is_processing_is_a_conflict_not_in_progress(shared, guard):
    envoy = guard(policy())
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    slow = in_thread(post, envoy, path, key, b'{"n":1}', tenant=tenant, delay_ms=800)
    rkey = record_key(envoy.key_prefix, tenant, "create-order", key)
    assert wait_for(lambda: shared.redis.exists(rkey), 2.0), "the first request never acquired"
    assert_problem(post(envoy, path, key, b'{"n":2}', tenant=tenant), 422, "idempotency_key_conflict")
    assert_problem(post(envoy, path, key, b'{"n":1}', tenant=tenant), 409, "idempotency_key_in_use")
    assert slow().status == 200
    assert shared.upstream.count("POST", path) == 1


# --- scope: tenant and policy --------------------------------------------------------------------


def test_same_key_in_another_tenant_or_policy_is_independent(shared, guard):
    envoy = guard(policy("create-order", "/orders"), policy("create-payment", "/payments"))
    acme, globex, key = new_tenant(), new_tenant(), new_key()
    order_path, payment_path = f"/orders/{uid()}", f"/payments/{uid()}"
    body = b'{"total":5}'

    a = post(envoy, order_path, key, body, tenant=acme, status=201)
    b = post(envoy, order_path, key, body, tenant=globex, status=201)
    c = post(envoy, payment_path, key, body, tenant=acme, status=201)
    assert [r.status for r in (a, b, c)] == [201, 201, 201]
    assert [r.json()["served"] for r in (a, b)] == [1, 2]  # both executed
    assert all("idempotent-replayed" not in r.headers for r in (a, b, c))
    assert shared.upstream.count("POST", order_path) == 2
    assert shared.upstream.count("POST", payment_path) == 1

    # Each scope replays its own response.
    assert_replay_of(post(envoy, order_path, key, body, tenant=acme), a)
    assert_replay_of(post(envoy, order_path, key, body, tenant=globex), b)
    assert_replay_of(post(envoy, payment_path, key, body, tenant=acme), c)
    keys = {record_key(envoy.key_prefix, acme, "create-order", key),
            record_key(envoy.key_prefix, globex, "create-order", key),
            record_key(envoy.key_prefix, acme, "create-payment", key)}
    assert {k.decode() for k in shared.redis.scan_iter(match=envoy.key_prefix + ":*")} == keys
    assert shared.upstream.count("POST", order_path) == 2


# --- what the upstream answered ------------------------------------------------------------------


def test_retryable_failures_are_released_and_final_answers_are_stored(shared, guard):
    envoy = guard(policy())
    tenant = new_tenant()

    # 500: released, the retry executes and its 201 is what gets stored and replayed.
    key, path = new_key("k500"), f"/orders/{uid()}"
    failed = post(envoy, path, key, tenant=tenant, status=500)
    assert failed.status == 500 and "idempotent-replayed" not in failed.headers
    assert shared.redis.exists(record_key(envoy.key_prefix, tenant, "create-order", key)) == 0
    ok = post(envoy, path, key, tenant=tenant, status=201, header_location="/orders/o-5")
    assert ok.status == 201 and "idempotent-replayed" not in ok.headers
    assert ok.json()["served"] == 2
    assert_replay_of(post(envoy, path, key, tenant=tenant, status=500), ok)
    assert shared.upstream.count("POST", path) == 2

    # 400: a final answer, stored and replayed; the retry does not execute.
    key, path = new_key("k400"), f"/orders/{uid()}"
    bad = post(envoy, path, key, tenant=tenant, status=400)
    assert bad.status == 400
    assert_replay_of(post(envoy, path, key, tenant=tenant, status=201), bad)
    assert shared.upstream.count("POST", path) == 1

    # 429 and 408: released, the retry executes.
    for status in (429, 408):
        key, path = new_key(f"k{status}"), f"/orders/{uid()}"
        first = post(envoy, path, key, tenant=tenant, status=status)
        assert first.status == status, first
        second = post(envoy, path, key, tenant=tenant, status=201)
        assert second.status == 201 and "idempotent-replayed" not in second.headers, second
        assert shared.upstream.count("POST", path) == 2

    stats = {n: idem_stat(envoy, "create-order", n)
             for n in ("acquired", "released", "completed", "replayed")}
    assert stats == {"acquired": 7, "released": 3, "completed": 4, "replayed": 2}


# --- processing lease expiry ---------------------------------------------------------------------


def test_expired_lease_lets_a_retry_run_and_refuses_the_late_completion(shared, guard):
    envoy = guard(policy(processing_ttl="1s",
                         replay_headers=["content-type", "location", "etag", "x-which"]))
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    rkey = record_key(envoy.key_prefix, tenant, "create-order", key)
    body = b'{"slow":true}'

    late = in_thread(post, envoy, path, key, body, tenant=tenant, delay_ms=2500, header_x_which="A")
    assert wait_for(lambda: shared.redis.exists(rkey), 1.0), "A never acquired"
    time.sleep(1.2)
    assert shared.redis.exists(rkey) == 0, "A's PROCESSING record outlived its 1s lease"

    b = post(envoy, path, key, body, tenant=tenant, header_x_which="B")
    assert b.status == 200 and b.headers["x-which"] == "B" and "idempotent-replayed" not in b.headers, b
    a = late()
    assert a.status == 200 and a.headers["x-which"] == "A", a  # A's client still gets its answer

    assert shared.upstream.count("POST", path) == 2
    assert idem_stat(envoy, "create-order", "stale_owner") >= 1
    assert idem_stat(envoy, "create-order", "completed") == 1
    record = stored(shared, rkey)
    assert record["state"] == "COMPLETED" and ["x-which", "B"] in record["response"]["headers"], record
    replay = post(envoy, path, key, body, tenant=tenant, header_x_which="C")
    assert_replay_of(replay, b, headers=("content-type", "x-which"))
    assert shared.upstream.count("POST", path) == 2


def test_after_the_completed_ttl_the_key_runs_again(shared, guard):
    envoy = guard(policy(completed_ttl="1s"))
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    first = post(envoy, path, key, tenant=tenant, status=201)
    rkey = record_key(envoy.key_prefix, tenant, "create-order", key)
    assert 0 < shared.redis.pttl(rkey) <= 1000
    assert_replay_of(post(envoy, path, key, tenant=tenant), first)
    assert wait_for(lambda: not shared.redis.exists(rkey), 2.0)
    again = post(envoy, path, key, tenant=tenant, status=201)
    assert again.status == 201 and "idempotent-replayed" not in again.headers, again
    assert again.json()["served"] == 2


# --- keys and bodies the filter refuses ----------------------------------------------------------


def test_missing_and_optional_keys(shared, guard):
    envoy = guard(policy("create-order", "/orders"),
                  policy("notes", "/notes", required=False))
    tenant = new_tenant()
    path, notes = f"/orders/{uid()}", f"/notes/{uid()}"

    problem = assert_problem(post(envoy, path, None, tenant=tenant), 400, "idempotency_key_missing")
    assert "idempotency-key" in problem["detail"]
    assert idem_stat(envoy, "create-order", "missing_key") == 1
    assert shared.upstream.count("POST", path) == 0

    # Not required: passes untouched, every time, with no fingerprint and no record.
    for served in (1, 2):
        r = post(envoy, notes, None, tenant=tenant)
        assert r.status == 200 and r.json()["served"] == served, r
    assert all("x-idempotency-fingerprint" not in q["headers"] for q in upstream_requests(shared, notes))
    assert list(shared.redis.scan_iter(match=envoy.key_prefix + ":*")) == []
    assert idem_stat(envoy, "notes", "missing_key") == 0
    assert idem_stat(envoy, "notes", "acquired") == 0


def test_malformed_keys_are_refused(shared, guard):
    envoy = guard(policy())
    tenant, path = new_tenant(), f"/orders/{uid()}"
    base = [(TENANT_HEADER, tenant), ("content-type", "application/json")]
    cases = {
        "unterminated": [("idempotency-key", '"unterminated')],
        "token_with_space": [("idempotency-key", "two words")],
        "non_ascii": [("idempotency-key", '"cl\u00e9"'.encode())],
        "non_ascii_token": [("idempotency-key", "cl\u00e9".encode())],
        "trailing_param": [("idempotency-key", '"abc";x=1')],
        "empty_string": [("idempotency-key", '""')],
        "repeated": [("idempotency-key", "aaa-1"), ("idempotency-key", "aaa-2")],
        "too_long": [("idempotency-key", "k" * 256)],
        "too_long_quoted": [("idempotency-key", '"' + "k" * 256 + '"')],
    }
    for name, headers in cases.items():
        r = raw_request(envoy, "POST", path, base + headers, b"{}")
        assert_problem(r, 400, "idempotency_key_invalid", name)
    assert idem_stat(envoy, "create-order", "invalid_key") == len(cases)
    assert shared.upstream.count("POST", path) == 0

    longest = "k" * 255
    ok = raw_request(envoy, "POST", path, base + [("idempotency-key", longest)], b"{}")
    assert ok.status == 200, ok
    quoted = raw_request(envoy, "POST", path, base + [("idempotency-key", f'"{longest}"')], b"{}")
    assert_replay_of(quoted, ok)
    assert shared.upstream.count("POST", path) == 1


def test_sf_string_and_bare_token_are_the_same_key(shared, guard):
    envoy = guard(policy())
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    first = post(envoy, path, key, tenant=tenant, status=201)
    assert first.status == 201
    assert_replay_of(post(envoy, path, f'"{key}"', tenant=tenant), first)
    assert_replay_of(post(envoy, path, f' "{key}" ', tenant=tenant), first)
    assert shared.upstream.count("POST", path) == 1
    assert upstream_requests(shared, path)[0]["headers"]["idempotency-key"] == key


def test_oversize_body_is_refused_before_the_upstream(shared, guard):
    envoy = guard(policy(max_request_body="1KiB"))
    tenant, path = new_tenant(), f"/orders/{uid()}"
    big = b'{"blob":"' + b"x" * 2037 + b'"}'
    assert len(big) == 2048

    assert_problem(post(envoy, path, new_key(), big, tenant=tenant), 413, "request_body_too_large")
    headers = [(TENANT_HEADER, tenant), ("content-type", "application/json"),
               ("idempotency-key", new_key())]
    chunked = raw_request(envoy, "POST", path, headers, big, chunked=True)
    assert_problem(chunked, 413, "request_body_too_large")
    assert shared.upstream.count("POST", path) == 0
    assert idem_stat(envoy, "create-order", "body_too_large") == 2
    assert list(shared.redis.scan_iter(match=envoy.key_prefix + ":*")) == []

    # At the limit it goes through, also chunked.
    fits = b'{"blob":"' + b"x" * (1024 - 11) + b'"}'
    assert len(fits) == 1024
    assert post(envoy, path, new_key(), fits, tenant=tenant).status == 200
    headers[-1] = ("idempotency-key", new_key())
    assert raw_request(envoy, "POST", path, headers, fits, chunked=True).status == 200
    assert shared.upstream.count("POST", path) == 2


def test_non_json_bodies_are_fingerprinted_byte_for_byte(shared, guard):
    envoy = guard(policy())
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    first = post(envoy, path, key, b'{"a":1,"b":2}', tenant=tenant, content_type="text/plain")
    assert first.status == 200
    conflict = post(envoy, path, key, b'{ "b": 2, "a": 1 }', tenant=tenant, content_type="text/plain")
    assert_problem(conflict, 422, "idempotency_key_conflict")
    same = post(envoy, path, key, b'{"a":1,"b":2}', tenant=tenant, content_type="text/plain")
    assert_replay_of(same, first)
    assert shared.upstream.count("POST", path) == 1


# The fingerprint canonicalises JSON, but only in ways every parser agrees on: two bodies an
# upstream may read as different requests must not share a fingerprint, or the second one is
# answered with the first one's stored response and never executed.
@pytest.mark.parametrize("first, second", [
    pytest.param(b'{"account":123456789012345678901}', b'{"account":123456789012345678902}',
                 id="integer_beyond_u64"),
    pytest.param(b'{"amount":0.1}', b'{"amount":0.10000000000000001}', id="decimal_beyond_f64"),
    pytest.param(b'{"to":"alice","to":"bob"}', b'{"to":"bob"}', id="duplicate_member"),
])
def test_json_bodies_an_upstream_can_tell_apart_are_not_the_same_request(shared, guard, first, second):
    envoy = guard(policy())
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    assert post(envoy, path, key, first, tenant=tenant, status=201).status == 201
    retry = post(envoy, path, key, second, tenant=tenant, status=201)
    assert "idempotent-replayed" not in retry.headers, (
        f"{second!r} was answered with the stored response of {first!r}: {retry}")
    assert_problem(retry, 422, "idempotency_key_conflict")
    assert shared.upstream.count("POST", path) == 1


# --- Redis goes away -----------------------------------------------------------------------------


def test_redis_down_at_acquire_follows_the_failure_mode(stack_factory):
    stack = stack_factory(None, envoys=0)
    envoy = own_envoy(stack, "cg:e2e-idem:down", policy("closed", "/orders"),
                      policy("open", "/open", failure_mode="fail_open"))
    tenant, key = new_tenant(), new_key()
    stack.stop_redis()
    try:
        closed = post(envoy, "/orders/x", key, tenant=tenant)
        assert_problem(closed, 503, "guard_unavailable")
        assert closed.headers.get("retry-after") == "1"
        assert stack.upstream.count("POST", "/orders/x") == 0
        assert envoy.stat("wasmcustom.cg.policy.closed.failed_closed") == 1

        for served in (1, 2):  # forwarded, and nothing to replay from
            r = post(envoy, "/open/x", key, tenant=tenant, status=201)
            assert r.status == 201 and r.json()["served"] == served, r
            assert "idempotent-replayed" not in r.headers
        assert envoy.stat("wasmcustom.cg.policy.open.failed_open") == 2
    finally:
        stack.start_redis()
    # Redis is back: the same key is guarded again.
    first = post(envoy, "/open/x", key, tenant=tenant, status=201)
    assert first.status == 201 and first.json()["served"] == 3, first
    assert_replay_of(post(envoy, "/open/x", key, tenant=tenant), first)
    assert stack.upstream.count("POST", "/open/x") == 3


def test_redis_down_at_completion_keeps_the_record_processing_until_its_lease_ends(stack_factory):
    stack = stack_factory(None, envoys=0)
    envoy = own_envoy(stack, "cg:e2e-idem:complete", policy("closed", "/orders", processing_ttl="3s"))
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    rkey = record_key("cg:e2e-idem:complete", tenant, "closed", key)
    # This Redis keeps its data over a restart (an RDB written at shutdown), as a production
    # Redis with persistence would: the PROCESSING record must survive the outage.
    stack.redis.config_set("save", "3600 1")

    first = in_thread(post, envoy, path, key, tenant=tenant, delay_ms=1500, status=201)
    assert wait_for(lambda: stack.redis.exists(rkey), 1.0), "never acquired"
    processing = stack.redis.get(rkey)
    stack.stop_redis()
    try:
        r = first()
        assert r.status == 201 and r.json()["served"] == 1, r  # the client gets the upstream's answer
        assert "idempotent-replayed" not in r.headers
        assert idem_stat(envoy, "closed", "complete_failed") == 1
        assert idem_stat(envoy, "closed", "completed") == 0
    finally:
        stack.start_redis()
    assert stack.redis.get(rkey) == processing
    assert json.loads(processing)["state"] == "PROCESSING"
    assert 0 < stack.redis.pttl(rkey) <= 3000

    retry = post(envoy, path, key, tenant=tenant, status=201)
    assert_problem(retry, 409, "idempotency_key_in_use")
    # Once the lease has run out the retry executes (the outcome was unknown to Redis).
    deadline = time.monotonic() + 4.0
    while retry.status == 409 and time.monotonic() < deadline:
        time.sleep(0.1)
        retry = post(envoy, path, key, tenant=tenant, status=201)
    assert retry.status == 201 and "idempotent-replayed" not in retry.headers, retry
    assert stack.upstream.count("POST", path) == 2

    log = envoy.log_text()
    key_hash = hashlib.sha256(key.encode()).hexdigest()[:32]
    assert re.search(rf"idempotency record of policy closed key {key_hash} not completed", log), log[-3000:]
    assert key not in log and tenant not in log


# --- the upstream's outcome ----------------------------------------------------------------------


def test_a_request_that_never_reached_the_upstream_is_released(stack_factory):
    stack = stack_factory(None, envoys=0)
    envoy = own_envoy(stack, "cg:e2e-idem:unsent", policy())
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    port = stack.upstream.port
    stack.upstream.stop()
    refused = post(envoy, path, key, tenant=tenant, status=201)
    assert refused.status == 503, refused  # Envoy's own answer: connection refused
    assert idem_stat(envoy, "create-order", "released") == 1
    assert stack.redis.exists(record_key("cg:e2e-idem:unsent", tenant, "create-order", key)) == 0

    stack.upstream = Upstream(stack.workdir / "upstream-again", port=port).start()
    retry = post(envoy, path, key, tenant=tenant, status=201)
    assert retry.status == 201 and "idempotent-replayed" not in retry.headers, retry
    assert stack.upstream.count("POST", path) == 1


def test_a_client_gone_before_the_answer_leaves_the_outcome_unknown(shared, guard):
    envoy = guard(policy(processing_ttl="2s"))
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    rkey = record_key(envoy.key_prefix, tenant, "create-order", key)
    with socket.create_connection(("127.0.0.1", envoy.port), timeout=5) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\n{TENANT_HEADER}: {tenant}\r\n"
                     f"idempotency-key: {key}\r\nx-upstream-delay-ms: 600\r\n"
                     f"content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}".encode())
        assert wait_for(lambda: shared.redis.exists(rkey), 1.0), "never acquired"
    # The upstream may still act on it: the record stays PROCESSING until its lease ends.
    assert wait_for(lambda: idem_stat(envoy, "create-order", "outcome_unknown") == 1, 2.0)
    assert json.loads(shared.redis.get(rkey))["state"] == "PROCESSING"
    assert_problem(post(envoy, path, key, b"{}", tenant=tenant), 409, "idempotency_key_in_use")
    assert idem_stat(envoy, "create-order", "released") == 0


# --- large responses -----------------------------------------------------------------------------


@pytest.mark.parametrize("complete", ["sync", "async"])
def test_a_response_over_max_response_body_is_stored_as_a_reference(shared, guard, complete):
    envoy = guard(policy(max_response_body="1KiB", complete=complete), timeout="50ms")
    tenant, key = new_tenant(), new_key()
    path = f"/orders/{uid()}-" + "x" * 1200  # the upstream echoes the path: a body over 1 KiB
    first = post(envoy, path, key, tenant=tenant, status=201, header_location="/orders/o-big")
    assert first.status == 201 and first.json()["path"] == path, first  # delivered whole
    assert len(first.body) > 1024

    rkey = record_key(envoy.key_prefix, tenant, "create-order", key)
    completed = wait_for(lambda: (stored(shared, rkey) or {}).get("state") == "COMPLETED", 1.0)
    assert completed, stored(shared, rkey)
    response = stored(shared, rkey)["response"]
    assert response["status"] == 201 and response.get("reference") is True, response
    assert "body" not in response and "body_base64" not in response, response

    retry = post(envoy, path, key, tenant=tenant, status=500)
    assert retry.status == 201 and retry.headers.get("idempotent-replayed") == "true", retry
    assert retry.headers["location"] == "/orders/o-big"
    assert retry.body == b""
    assert shared.upstream.count("POST", path) == 1


def test_replay_reference_stores_status_and_headers_only(shared, guard):
    envoy = guard(policy(replay="reference"))
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    first = post(envoy, path, key, tenant=tenant, status=201, header_location="/orders/o-r")
    assert first.status == 201 and first.json()["served"] == 1
    response = stored(shared, record_key(envoy.key_prefix, tenant, "create-order", key))["response"]
    assert response.get("reference") is True and "body" not in response, response
    retry = post(envoy, path, key, tenant=tenant)
    assert (retry.status, retry.headers.get("location"), retry.body) == (201, "/orders/o-r", b""), retry
    assert retry.headers.get("idempotent-replayed") == "true"
    assert shared.upstream.count("POST", path) == 1


# --- async completion ----------------------------------------------------------------------------


def test_async_completion_replays_shortly_after_the_response(shared, guard):
    envoy = guard(policy(complete="async"), timeout="50ms")
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    first = post(envoy, path, key, tenant=tenant, status=201, header_location="/orders/o-a")
    answered = time.monotonic()
    assert first.status == 201 and "idempotent-replayed" not in first.headers

    seen = []
    while True:
        retry = post(envoy, path, key, tenant=tenant, status=500)
        seen.append(retry.status)
        if retry.status != 409 or time.monotonic() - answered > 0.2:
            break
        time.sleep(0.01)
    assert_replay_of(retry, first)
    assert set(seen[:-1]) <= {409}, seen
    assert shared.upstream.count("POST", path) == 1
    assert idem_stat(envoy, "create-order", "completed") == 1


# --- records the filter cannot read --------------------------------------------------------------


def test_unreadable_records_answer_conflict_and_are_left_alone(shared, guard):
    envoy = guard(policy())
    tenant, path = new_tenant(), f"/orders/{uid()}"

    key = new_key()
    assert post(envoy, path, key, tenant=tenant).status == 200
    rkey = record_key(envoy.key_prefix, tenant, "create-order", key)
    assert [k.decode() for k in shared.redis.scan_iter(match=envoy.key_prefix + ":*")] == [rkey]

    garbage = b"\x00\xffnot a record {"
    shared.redis.set(rkey, garbage, ex=600)
    conflict = post(envoy, path, key, tenant=tenant)
    assert_problem(conflict, 422, "idempotency_key_conflict")
    assert shared.redis.get(rkey) == garbage
    assert idem_stat(envoy, "create-order", "unreadable") == 1

    # Not a string at all.
    key = new_key()
    hkey = record_key(envoy.key_prefix, tenant, "create-order", key)
    shared.redis.hset(hkey, mapping={"state": "COMPLETED"})
    shared.redis.expire(hkey, 600)
    assert_problem(post(envoy, path, key, tenant=tenant), 422, "idempotency_key_conflict")
    assert shared.redis.hgetall(hkey) == {b"state": b"COMPLETED"}

    # A COMPLETED record with this very fingerprint but nothing to replay.
    first_fp = upstream_requests(shared, path)[0]["headers"]["x-idempotency-fingerprint"]
    key = new_key()
    ckey = record_key(envoy.key_prefix, tenant, "create-order", key)
    hollow = json.dumps({"schema_version": 1, "state": "COMPLETED", "fingerprint": first_fp})
    shared.redis.set(ckey, hollow, ex=600)
    assert_problem(post(envoy, path, key, tenant=tenant), 422, "idempotency_key_conflict")
    assert shared.redis.get(ckey) == hollow.encode()

    assert idem_stat(envoy, "create-order", "unreadable") == 3
    assert shared.upstream.count("POST", path) == 1


# --- what is in Redis (last: it scans what the whole module left behind) -------------------------


def test_every_key_has_a_ttl_and_no_raw_identifier(shared, guard):
    limit = {"name": "per-tenant", "by": ["tenant"], "algorithm": "fixed_window",
             "limit": 100, "window": "1m"}
    envoy = guard(policy(rate_limits=[limit]))
    tenant, key, path = new_tenant(), new_key("customer-email@example.com"), f"/orders/{uid()}"
    assert post(envoy, path, key, tenant=tenant, status=201).status == 201
    assert post(envoy, path, key, tenant=tenant).headers.get("idempotent-replayed") == "true"

    idem_key = re.compile(r"^[!-~]+:idem:\{t\.[0-9a-f]{16}\}:[A-Za-z0-9_-]+:[0-9a-f]{32}$")
    # Identifiers short or hex-only enough to occur inside a hash by chance are not checked.
    raw = [s for s in SENT_TENANTS | SENT_KEYS if len(s) >= 8 and re.search(r"[^0-9a-f]", s)]
    keys = [k.decode() for k in shared.redis.scan_iter(count=1000)]
    assert len([k for k in keys if ":idem:" in k]) >= 10, keys
    assert any(":rl:" in k for k in keys), keys
    for k in keys:
        assert shared.redis.pttl(k) > 0, f"{k} has no TTL"
        leaked = [s for s in raw if s in k]
        assert not leaked, (k, leaked)
        if ":idem:" in k:
            assert idem_key.match(k), k
            if shared.redis.type(k) == b"string":
                value = shared.redis.get(k).decode(errors="replace")
                assert not [s for s in raw if s in value], (k, value)
    assert record_key(envoy.key_prefix, tenant, "create-order", key) in keys

    # Logs name keys by hash: no raw key or tenant in any Envoy's log either.
    for started in STARTED_ENVOYS:
        log = started.log_text()
        leaked = [s for s in raw if s in log]
        assert not leaked, (started.workdir, leaked)
