"""Failure accounting and compensation end to end: real Envoy running the filter, real webdis and
redis-server, the counting upstream.

- A request that failed closed because Redis was slow (a real `CLIENT PAUSE`, longer than the
  filter's timeout) or whose client left while its acquire was in flight leaves no record and
  no lease behind once Redis recovers, however the late acquire and the release interleave:
  the release writes the owner's cancellation marker (`<prefix>:cancel:{t.<tenant>}:...`)
  and is retried, and a late acquire that finds the marker writes nothing.
- With Redis down (webdis answers 503 at once) no release is sent for calls that never ran:
  the gateway sees exactly one call per request, `complete_failed` stays 0, and the warnings
  are rate-limited. With a gateway that never answers (the outcome is unknown) the release is
  sent, and retried a bounded number of times.
- A request that waits (`in_progress: wait`, `on_busy: wait`) and whose poll fails answers the
  conflict it saw (`idempotency_key_in_use`, `resource_locked`) under either failure mode: it
  is never forwarded beside the request that holds the record or the lease.

Every stack is the test's own (these tests pause or stop Redis). Load is bounded and goes to
loopback only; timing assertions are loose.
"""

from __future__ import annotations

import hashlib
import re
import socket
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.concurrency import wait_for
from harness.envoy import Envoy, Response
from harness.stack import BLACKHOLE_CLUSTER, Stack
from harness.problems import is_problem

TENANT_HEADER = "x-tenant-id"
IDEM_POLICY = "orders"
LEASE_POLICY = "activate"
PAUSE_MS = 1500
PAUSE_TIMEOUT = "200ms"  # the filter gives up long before Redis answers again


def uid() -> str:
    return uuid.uuid4().hex[:10]


def short_hash(domain: str, value: bytes) -> str:
    return hashlib.sha256(domain.encode() + b"\0" + value).hexdigest()[:16]


def tenant_tag(tenant: str) -> str:
    return "t." + short_hash("tenant", tenant.encode())


def record_key(prefix: str, tenant: str, client_key: str) -> str:
    key_hash = hashlib.sha256(client_key.encode()).hexdigest()[:32]
    return f"{prefix}:idem:{{{tenant_tag(tenant)}}}:{IDEM_POLICY}:{key_hash}"


def lease_key(prefix: str, tenant: str, order: str) -> str:
    parts = [("tenant", tenant), ("path_segment:2", order)]
    joined = b"".join(n.encode() + b"=" + v.encode() + b"\x1f" for n, v in parts)
    return f"{prefix}:lease:{{{tenant_tag(tenant)}}}:{LEASE_POLICY}:{short_hash('scope', joined)}"


def policies() -> list:
    return [
        {"name": IDEM_POLICY, "match": {"methods": ["POST"], "path_prefix": "/orders"},
         "failure_mode": "fail_closed",
         "idempotency": {"processing_ttl": "2m", "fingerprint": ["method", "path", "body"]}},
        {"name": LEASE_POLICY, "match": {"methods": ["POST"], "path_prefix": "/leases"},
         "failure_mode": "fail_closed",
         "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "10s", "on_busy": "reject",
                   "extend": False}},
    ]


def plugin(stack: Stack, prefix: str, timeout: str, cluster: str | None = None) -> dict:
    redis = stack.redis_section(key_prefix=prefix, timeout=timeout)
    if cluster:
        redis["cluster"] = cluster
    return {"redis": redis,
            "identity": {"tenant_header": TENANT_HEADER, "missing_tenant": "reject"},
            "policies": policies()}


def post_idem(envoy: Envoy, tenant: str, key: str, path: str, timeout: float = 10.0) -> Response:
    return envoy.request("POST", path, headers={TENANT_HEADER: tenant, "idempotency-key": key,
                                                "content-type": "application/json",
                                                "x-upstream-status": "201"},
                         body=b'{"item":"book"}', timeout=timeout)


def post_lease(envoy: Envoy, tenant: str, order: str, timeout: float = 10.0) -> Response:
    return envoy.request("POST", f"/leases/{order}", headers={TENANT_HEADER: tenant},
                         timeout=timeout)


def assert_503(resp: Response) -> None:
    assert resp.status == 503, resp
    assert resp.json()["type"].endswith("#guard_unavailable"), resp


def redis_stat(envoy: Envoy, name: str) -> int:
    return envoy.stat(f"wasmcustom.cg.redis.{name}")


def policy_stat(envoy: Envoy, policy: str, name: str) -> int:
    return envoy.stat(f"wasmcustom.cg.policy.{policy}.{name}")


def warm_up(stack: Stack, envoy: Envoy, tenant: str) -> None:
    """One request of each kind while Redis is healthy: scripts loaded, gateway connections open."""
    assert post_idem(envoy, tenant, f"warm-{uid()}", f"/orders/warm-{uid()}").status == 201
    assert post_lease(envoy, tenant, f"warm{uid()}").status == 200


def leftovers(stack: Stack, rkeys: list[str], lkeys: list[str]) -> list[str]:
    return [k for k in rkeys + lkeys if stack.redis.exists(k)]


def leftover_report(stack: Stack, envoy: Envoy, prefix: str, rkeys: list[str],
                    lkeys: list[str]) -> str:
    """What a failure needs to be read: each key left (its value and TTL), the cancellation
    markers there are, and the filter's Redis and background-call counters."""
    lines = ["left behind:"]
    for k in leftovers(stack, rkeys, lkeys):
        lines.append(f"  {k} type={stack.redis.type(k)!r} pttl={stack.redis.pttl(k)} "
                     f"value={stack.redis.get(k) if stack.redis.type(k) == b'string' else '-'!r}")
    markers = sorted(m.decode() for m in stack.redis.scan_iter(match=f"{prefix}:cancel:*"))
    lines.append(f"markers ({len(markers)}): {markers}")
    counters = envoy.stats(filter="wasmcustom.cg")
    lines.append("counters: " + ", ".join(f"{k}={v}" for k, v in sorted(counters.items()) if v))
    return "\n".join(lines)


def assert_nothing_left_and_retries_run(stack: Stack, envoy: Envoy, prefix: str, tenant: str,
                                        keys: list[str], paths: list[str], orders: list[str],
                                        pause_started: float) -> None:
    rkeys = [record_key(prefix, tenant, k) for k in keys]
    lkeys = [lease_key(prefix, tenant, o) for o in orders]
    # Redis runs again after the pause; the late acquires and the releases land in some order.
    time.sleep(max(0.0, pause_started + PAUSE_MS / 1000 + 0.2 - time.monotonic()))
    left = wait_for(lambda: not leftovers(stack, rkeys, lkeys), 6.0, 0.05)
    assert left, leftover_report(stack, envoy, prefix, rkeys, lkeys)
    time.sleep(1.0)  # nothing lands later either
    assert not leftovers(stack, rkeys, lkeys), leftover_report(stack, envoy, prefix, rkeys, lkeys)
    # Every cancelled owner has its marker, with a TTL (and the marker shares the tenant's tag).
    markers = list(stack.redis.scan_iter(match=f"{prefix}:cancel:*", count=1000))
    assert len(markers) >= len(keys) + len(orders), markers
    tag = "{" + tenant_tag(tenant) + "}"
    for m in markers:
        assert tag in m.decode() and 0 < stack.redis.pttl(m) <= 120_000, m

    # The client's retries: the idempotent request executes (not 409), the lease is taken.
    for key, path in zip(keys, paths):
        r = post_idem(envoy, tenant, key, path)
        assert r.status == 201 and "idempotent-replayed" not in r.headers, (path, r)
        assert stack.upstream.count("POST", path) == 1, path
    for order in orders:
        r = post_lease(envoy, tenant, order)
        assert r.status == 200, (order, r)
        assert stack.upstream.count("POST", f"/leases/{order}") == 1, order
    assert policy_stat(envoy, LEASE_POLICY, "lease.released") <= policy_stat(
        envoy, LEASE_POLICY, "lease.acquired")


# --- item 5: a late acquire leaves nothing behind -------------------------------------------------


def test_requests_failed_closed_while_redis_is_paused_leave_no_record_or_lease(stack_factory):
    stack = stack_factory(None, envoys=0)
    prefix = f"cg:e2e-fail:{uid()}"
    envoy = stack.add_envoy(plugin(stack, prefix, PAUSE_TIMEOUT))
    tenant = f"tenant-{uid()}"
    warm_up(stack, envoy, tenant)
    keys = [f"key-{uid()}" for _ in range(4)]
    paths = [f"/orders/{uid()}" for _ in range(4)]
    orders = [f"ord{uid()}" for _ in range(4)]

    stack.redis.client_pause(PAUSE_MS)  # every client, webdis's connections included
    paused = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        idem = [pool.submit(post_idem, envoy, tenant, k, p) for k, p in zip(keys, paths)]
        lease = [pool.submit(post_lease, envoy, tenant, o) for o in orders]
        answers = [f.result(timeout=10) for f in idem + lease]
    for r in answers:
        assert_503(r)
        assert r.elapsed < PAUSE_MS / 1000, r  # failed closed at the filter's timeout
    for p in paths:
        assert stack.upstream.count("POST", p) == 0

    assert_nothing_left_and_retries_run(stack, envoy, prefix, tenant, keys, paths, orders, paused)


def _send_and_leave(port: int, request: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(request)
        time.sleep(0.05)  # the acquire is in flight (Redis is paused); the client leaves


def test_clients_that_leave_while_redis_is_paused_leave_no_record_or_lease(stack_factory):
    stack = stack_factory(None, envoys=0)
    prefix = f"cg:e2e-fail:{uid()}"
    # A timeout longer than the client's patience: the stream ends before the watchdog fires.
    envoy = stack.add_envoy(plugin(stack, prefix, "1000ms"))
    tenant = f"tenant-{uid()}"
    warm_up(stack, envoy, tenant)
    keys = [f"key-{uid()}" for _ in range(3)]
    paths = [f"/orders/{uid()}" for _ in range(3)]
    orders = [f"ord{uid()}" for _ in range(3)]
    body = b'{"item":"book"}'

    stack.redis.client_pause(PAUSE_MS)
    paused = time.monotonic()
    requests = [
        (f"POST {p} HTTP/1.1\r\nhost: x\r\n{TENANT_HEADER}: {tenant}\r\nidempotency-key: {k}\r\n"
         f"x-upstream-status: 201\r\ncontent-type: application/json\r\n"
         f"content-length: {len(body)}\r\n\r\n").encode() + body
        for k, p in zip(keys, paths)
    ] + [
        f"POST /leases/{o} HTTP/1.1\r\nhost: x\r\n{TENANT_HEADER}: {tenant}\r\n"
        f"content-length: 0\r\n\r\n".encode()
        for o in orders
    ]
    with ThreadPoolExecutor(6) as pool:
        for f in [pool.submit(_send_and_leave, envoy.port, r) for r in requests]:
            f.result(timeout=10)
    assert time.monotonic() - paused < 1.0, "the clients left while Redis was still paused"

    assert_nothing_left_and_retries_run(stack, envoy, prefix, tenant, keys, paths, orders, paused)


# --- item 6: no compensation for calls that never ran; rate-limited warnings ----------------------

LOG_LINE = re.compile(r"^\[(?P<second>[0-9-]+ [0-9:]+)\.\d+\]\[(?P<thread>\d+)\]\[warning\].*"
                      r"wasm log [^:]*: (?P<message>.*)$")


def warning_kinds(envoy: Envoy) -> Counter:
    """(second, kind) -> number of the filter's warning lines; the kind is the message with its
    numbers, hashes and suppression suffix taken out."""
    counts: Counter = Counter()
    for line in envoy.log_text().splitlines():
        m = LOG_LINE.match(line)
        if not m:
            continue
        kind = re.sub(r" \(and \d+ more like it.*$", "", m["message"])
        kind = re.sub(r"[0-9a-f]{8,}|\d+", "#", kind)
        counts[(m["second"], kind)] += 1
    return counts


def test_redis_down_sends_at_most_one_call_per_request_and_few_warnings(stack_factory):
    stack = stack_factory(None, envoys=0)
    prefix = f"cg:e2e-fail:{uid()}"
    envoy = stack.add_envoy(plugin(stack, prefix, "500ms"))
    tenant = f"tenant-{uid()}"
    warm_up(stack, envoy, tenant)
    stack.stop_redis()
    try:
        before = redis_stat(envoy, "calls")
        per_wave = 100  # 50 idempotent + 50 lease requests per wave, two waves 1.1 s apart

        def one(i: int) -> Response:
            if i % 2:
                return post_idem(envoy, tenant, f"key-{uid()}", f"/orders/{uid()}")
            return post_lease(envoy, tenant, f"ord{uid()}")

        answers = []
        started = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            for wave in range(2):
                answers += list(pool.map(one, range(per_wave), timeout=30))
                if wave == 0:
                    time.sleep(1.1)
        assert time.monotonic() - started < 20
        for r in answers:
            assert_503(r)
        time.sleep(0.5)  # the root's tick: anything queued would go out now
        sent = redis_stat(envoy, "calls") - before
        # No retry of a failed acquire; batching (on by default) may carry the acquires of
        # the four clients' requests in flight together in one call.
        assert 2 * per_wave // 4 <= sent <= 2 * per_wave, (
            f"{sent} gateway calls for {2 * per_wave} requests")
        assert redis_stat(envoy, "retries") == 0
        assert policy_stat(envoy, IDEM_POLICY, "idem.complete_failed") == 0
        assert policy_stat(envoy, LEASE_POLICY, "lease.lost") == 0
        assert policy_stat(envoy, LEASE_POLICY, "lease.released") <= policy_stat(
            envoy, LEASE_POLICY, "lease.acquired")
        assert policy_stat(envoy, IDEM_POLICY, "failed_closed") == per_wave
        assert policy_stat(envoy, LEASE_POLICY, "failed_closed") == per_wave
    finally:
        stack.start_redis()
    counts = warning_kinds(envoy)
    total = sum(counts.values())
    assert total <= 24, f"{total} warning lines for {2 * per_wave} failed requests: {counts}"
    # At most one line per kind per second per worker (2 workers).
    assert max(counts.values()) <= 2, counts
    assert "more like it in the last" in envoy.log_text(), "the suppressed count is reported"


def test_a_gateway_that_never_answers_still_gets_bounded_compensation(stack_factory):
    stack = stack_factory(None, envoys=0)
    prefix = f"cg:e2e-fail:{uid()}"
    # timeout 50 ms: the callout's own timeout is 200 ms, so each send ends within ~0.2 s
    envoy = stack.add_envoy(plugin(stack, prefix, "50ms", cluster=BLACKHOLE_CLUSTER))
    tenant = f"tenant-{uid()}"
    n = 3
    for _ in range(n):
        assert_503(post_idem(envoy, tenant, f"key-{uid()}", f"/orders/{uid()}"))
        assert_503(post_lease(envoy, tenant, f"ord{uid()}"))
    # Outcome unknown: each request's acquire is compensated, and each release (which never
    # gets an answer either) is sent 6 times in all, with backoff, within ~5 s. Releases due
    # in the same turn of the root share a batch call: counted per call sent to the gateway,
    # timeouts and retries per script call in it.
    expected = 2 * n + 2 * n * 6
    assert wait_for(lambda: redis_stat(envoy, "timeouts") >= expected, 12.0, 0.1), \
        redis_stat(envoy, "timeouts")
    time.sleep(2.0)  # and not more
    assert redis_stat(envoy, "timeouts") == expected
    assert redis_stat(envoy, "retries") == 2 * n * 5
    assert 2 * n + 6 <= redis_stat(envoy, "calls") <= expected
    # The records may exist (the outcome is unknown): their release failing is counted.
    assert policy_stat(envoy, IDEM_POLICY, "idem.complete_failed") == n
    assert policy_stat(envoy, LEASE_POLICY, "lease.lost") == 0
    assert policy_stat(envoy, LEASE_POLICY, "lease.released") == 0
    assert stack.blackhole.accepted > 0



# --- a late acquire takes no concurrency slot -----------------------------------------------------

SLOTS_POLICY = "inflight"


def slot_plugin(stack: Stack, prefix: str, timeout: str) -> dict:
    """Two concurrency limits of one policy in two hash slots: the tenant's and the policy's."""
    limits = [{"name": "per-tenant", "by": ["tenant"], "algorithm": "concurrency", "limit": 4,
               "window": "60s"},
              {"name": "global", "by": [], "algorithm": "concurrency", "limit": 4,
               "window": "60s"}]
    redis = stack.redis_section(key_prefix=prefix, timeout=timeout)
    return {"redis": redis,
            "identity": {"tenant_header": TENANT_HEADER, "missing_tenant": "reject"},
            "policies": [{"name": SLOTS_POLICY, "match": {"path_prefix": "/jobs"},
                          "failure_mode": "fail_closed", "rate_limits": limits}]}


def live_slots(stack: Stack, prefix: str) -> int:
    """Every slot held in any of the policy's concurrency keys."""
    keys = list(stack.redis.scan_iter(match=f"{prefix}:rl:*:{SLOTS_POLICY}:*", count=1000))
    return sum(stack.redis.zcard(k) for k in keys)


def test_acquires_given_up_on_take_no_concurrency_slot(stack_factory):
    """Requests that failed closed while Redis was paused, and requests whose clients left
    meanwhile, hold no slot once Redis recovers, in either hash slot, whichever lands first:
    the release removes a slot the late acquire took, or writes the owner's marker (checked
    here in both slots) that the late acquire then finds (that order is pinned by
    test_scripts_quota.py). Then the full cap is free."""
    stack = stack_factory(None, envoys=0)
    prefix = f"cg:e2e-fail:{uid()}"
    envoy = stack.add_envoy(slot_plugin(stack, prefix, PAUSE_TIMEOUT))
    tenant = f"tenant-{uid()}"

    def job(timeout: float = 10.0) -> Response:
        return envoy.request("POST", f"/jobs/{uid()}", headers={TENANT_HEADER: tenant},
                             timeout=timeout)

    assert job().status == 200  # scripts loaded, connections open
    assert live_slots(stack, prefix) == 0

    stack.redis.client_pause(PAUSE_MS)
    paused = time.monotonic()
    leave = (f"POST /jobs/{uid()} HTTP/1.1\r\nhost: x\r\n{TENANT_HEADER}: {tenant}\r\n"
             f"content-length: 0\r\n\r\n").encode()
    with ThreadPoolExecutor(8) as pool:
        failed = [pool.submit(job) for _ in range(4)]
        left = [pool.submit(_send_and_leave, envoy.port, leave) for _ in range(4)]
        for f in left:
            f.result(timeout=10)
        answers = [f.result(timeout=10) for f in failed]
    for r in answers:
        assert_503(r)
    time.sleep(max(0.0, paused + PAUSE_MS / 1000 + 0.2 - time.monotonic()))
    assert wait_for(lambda: live_slots(stack, prefix) == 0, 6.0, 0.05), live_slots(stack, prefix)
    time.sleep(1.0)  # nothing lands later either
    assert live_slots(stack, prefix) == 0
    markers = list(stack.redis.scan_iter(match=f"{prefix}:cancel:*", count=1000))
    tags = {m.decode().split(":cancel:")[1].split("}")[0] + "}" for m in markers}
    assert tags == {"{" + tenant_tag(tenant) + "}", "{p." + SLOTS_POLICY + "}"}, tags

    # The whole cap is free: four slow requests at once are all admitted.
    with ThreadPoolExecutor(4) as pool:
        slow = [pool.submit(lambda: envoy.request(
            "POST", f"/jobs/{uid()}", headers={TENANT_HEADER: tenant, "x-upstream-delay-ms": "300"}))
            for _ in range(4)]
        assert [f.result(timeout=10).status for f in slow] == [200] * 4


# --- a waiter whose poll fails never fails open -------------------------------------------------

WAIT_TIMEOUT = "100ms"
WRITE_PAUSE_MS = 800


def wait_plugin(stack: Stack, prefix: str, failure_mode: str) -> dict:
    """`pay`: duplicates wait for the first request; `act`: requests wait for a busy lease."""
    return {"redis": stack.redis_section(key_prefix=prefix, timeout=WAIT_TIMEOUT),
            "identity": {"tenant_header": TENANT_HEADER, "missing_tenant": "reject"},
            "policies": [
                {"name": "pay", "match": {"methods": ["POST"], "path_prefix": "/pay"},
                 "failure_mode": failure_mode,
                 "idempotency": {"processing_ttl": "2m", "in_progress": "wait",
                                 "max_wait": "10s", "fingerprint": ["method", "path"]}},
                {"name": "act", "match": {"methods": ["POST"], "path_prefix": "/act"},
                 "failure_mode": failure_mode,
                 "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "10s",
                           "on_busy": "wait", "max_wait": "10s"}}]}


def pay(envoy: Envoy, tenant: str, key: str, path: str, delay_ms: int = 0) -> Response:
    return envoy.request("POST", path, headers={TENANT_HEADER: tenant, "idempotency-key": key,
                                                "x-upstream-delay-ms": str(delay_ms)},
                         timeout=20)


def act(envoy: Envoy, tenant: str, path: str, delay_ms: int = 0) -> Response:
    return envoy.request("POST", path, headers={TENANT_HEADER: tenant,
                                                "x-upstream-delay-ms": str(delay_ms)}, timeout=20)


def assert_problem_slug(resp: Response, status: int, slug: str) -> None:
    assert resp.status == status, resp
    assert resp.headers.get("content-type") == "application/problem+json", resp
    assert is_problem(resp.json(), slug), resp


@pytest.mark.parametrize("failure_mode", ["fail_open", "fail_closed"])
def test_a_waiting_duplicate_whose_poll_fails_answers_in_progress_never_runs(stack_factory,
                                                                            failure_mode):
    """`in_progress: wait`: the first request runs 3 s, five duplicates wait for it, then Redis
    refuses writes for 800 ms (`CLIENT PAUSE WRITE`, longer than the 100 ms timeout) and their
    polls fail. Each had seen the record PROCESSING: it answers `409 idempotency_key_in_use`
    (Retry-After: 1) whatever the failure mode; fail_open once forwarded all five into the
    operation that was running (POST /pay ran 6 times for one key). A request that meets the
    pause on its first acquire (it never saw the record) still follows the failure mode."""
    stack = stack_factory(None, envoys=0)
    prefix = f"cg:e2e-fail:{uid()}"
    envoy = stack.add_envoy(wait_plugin(stack, prefix, failure_mode))
    tenant, key, path = f"tenant-{uid()}", f"key-{uid()}", f"/pay/{uid()}"
    assert pay(envoy, tenant, f"warm-{uid()}", f"/pay/{uid()}").status == 200
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(pay, envoy, tenant, key, path, 3000)
        assert wait_for(lambda: len(stack.upstream.in_flight()) == 1, 5.0), "the first never ran"
        waiters = [pool.submit(pay, envoy, tenant, key, path) for _ in range(5)]
        time.sleep(0.5)  # every duplicate found the record PROCESSING and polls
        assert not any(w.done() for w in waiters), [w.result() for w in waiters if w.done()]
        stack.redis.client_pause(WRITE_PAUSE_MS, all=False)  # write commands (every script) wait
        fresh = pay(envoy, tenant, key, path)  # meets the pause on its first acquire
        answers = [w.result(timeout=10) for w in waiters]
        assert first.result(timeout=10).status == 200
    for r in answers:
        assert_problem_slug(r, 409, "idempotency_key_in_use")
        assert r.headers.get("retry-after") == "1", r
        assert r.elapsed < 1.5, r  # answered at the failed poll, not at max_wait
    if failure_mode == "fail_open":
        assert fresh.status == 200, fresh  # never saw the record: fails open, as documented
    else:
        assert_problem_slug(fresh, 503, "guard_unavailable")
    ran = stack.upstream.count("POST", path)
    assert ran == (2 if failure_mode == "fail_open" else 1), ran
    assert policy_stat(envoy, "pay", "failed_closed") == (5 if failure_mode == "fail_open" else 6)
    assert policy_stat(envoy, "pay", "failed_open") == (1 if failure_mode == "fail_open" else 0)
    # The key is still guarded: its stored answer is replayed.
    again = pay(envoy, tenant, key, path)
    assert again.status == 200 and again.headers.get("idempotent-replayed") == "true", again


@pytest.mark.parametrize("failure_mode", ["fail_open", "fail_closed"])
def test_a_lease_waiter_whose_poll_fails_answers_locked_never_runs_beside_the_holder(
        stack_factory, failure_mode):
    """`on_busy: wait`: the holder runs 3 s, four requests for the same resource wait, then
    Redis refuses writes for 800 ms and their polls fail. Each had seen the lease busy: it
    answers `409 resource_locked` whatever the failure mode; fail_open once forwarded all four
    without a lease while the holder ran."""
    stack = stack_factory(None, envoys=0)
    prefix = f"cg:e2e-fail:{uid()}"
    envoy = stack.add_envoy(wait_plugin(stack, prefix, failure_mode))
    tenant, path = f"tenant-{uid()}", f"/act/{uid()}"
    assert act(envoy, tenant, f"/act/{uid()}").status == 200
    with ThreadPoolExecutor(6) as pool:
        holder = pool.submit(act, envoy, tenant, path, 3000)
        assert wait_for(lambda: len(stack.upstream.in_flight()) == 1, 5.0), "the holder never ran"
        waiters = [pool.submit(act, envoy, tenant, path) for _ in range(4)]
        time.sleep(0.5)
        assert not any(w.done() for w in waiters), [w.result() for w in waiters if w.done()]
        stack.redis.client_pause(WRITE_PAUSE_MS, all=False)
        answers = [w.result(timeout=10) for w in waiters]
        assert holder.result(timeout=10).status == 200
    for r in answers:
        assert_problem_slug(r, 409, "resource_locked")
        assert int(r.headers.get("retry-after", "0")) >= 1, r
        assert r.elapsed < 1.5, r
    served = [e for e in stack.upstream.requests() if e["path"] == path]
    assert len(served) == 1, served
    assert policy_stat(envoy, "act", "failed_closed") == 4
    assert policy_stat(envoy, "act", "failed_open") == 0
