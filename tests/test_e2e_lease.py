"""Leases with fencing tokens end to end: real Envoy running the filter, real redis-server behind
webdis, and the counting upstream. Every test asserts on what the client sees (status, headers,
problem+json body), on what the upstream executed and when (its ledger records each request's
end time and its `x-fencing-token`), on the lease and fence keys in Redis and on the filter's
`lease.*` metrics.

One Redis/webdis/upstream stack serves the module; each test starts its own Envoy(s) with a
fresh `key_prefix` and uses its own order ids, so ledger entries and keys are its own. Tests that
stop Redis get a stack of their own. Timing assertions are loose: they only separate "ran in
parallel" from "ran one after the other", and "answered at once" from "waited".

Requests carry no body unless a test is about bodies (see `act`).
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.concurrency import in_thread, wait_for
from harness.envoy import Envoy, Response
from harness.stack import Stack
from harness.problems import is_problem

# Every test that builds its stack through `topology` (stack_factory, the module's shared stack)
# runs on a single Redis and on Redis Cluster behind redis_proxy (conftest.py, harness/cluster.py).
pytestmark = pytest.mark.topologies("single", "cluster")

TENANT_HEADER = "x-tenant-id"
# The harness upstream records x-user-id: it labels each request so the ledger can tell them apart.
LABEL_HEADER = "x-user-id"
FENCING_HEADER = "x-fencing-token"
POLICY = "activate"
REDIS_TIMEOUT = "100ms"  # root tick 50 ms: releases and extensions go out within ~50 ms
FENCE_TTL_MS = 7 * 86_400_000
TOKEN_RE = re.compile(r"^[1-9][0-9]{15,18}$")  # ~16 digits: Redis time in µs or just above

SENT_RAW: set[str] = set()  # every tenant and order id sent, for the key hygiene checks


# --- helpers -------------------------------------------------------------------------------------


def uid() -> str:
    return uuid.uuid4().hex[:10]


def new_tenant() -> str:
    tenant = f"tenant-{uid()}"
    SENT_RAW.add(tenant)
    return tenant


def new_order() -> str:
    order = f"ord{uid()}"
    SENT_RAW.add(order)
    return order


def lease_block(resource=("tenant", "path_segment:2"), **overrides) -> dict:
    block = {"resource": list(resource), "ttl": "10s", "on_busy": "reject", "max_wait": "2s",
             "extend": True}
    block.update(overrides)
    return block


def lease_policy(name: str = POLICY, prefix: str = "/orders", *, failure_mode: str = "fail_closed",
                 rate_limits: list | None = None, idempotency: dict | None = None,
                 **lease) -> dict:
    """POST under `prefix` guarded by a lease; `lease` overrides the lease block."""
    resource = lease.pop("resource", ("tenant", "path_segment:2"))
    p = {"name": name, "match": {"methods": ["POST"], "path_prefix": prefix},
         "failure_mode": failure_mode, "lease": lease_block(resource, **lease)}
    if rate_limits:
        p["rate_limits"] = rate_limits
    if idempotency:
        p["idempotency"] = idempotency
    return p


def plugin(stack: Stack, key_prefix: str, *policies: dict, timeout: str = REDIS_TIMEOUT) -> dict:
    return {"redis": stack.redis_section(key_prefix=key_prefix, timeout=timeout),
            "identity": {"tenant_header": TENANT_HEADER, "principal_header": LABEL_HEADER,
                         "missing_tenant": "reject"},
            "policies": list(policies)}


def act(envoy: Envoy, order: str | None, tenant: str, *, delay_ms: int = 0, label: str = "",
        path: str | None = None, headers: dict | None = None, status: int | None = None,
        timeout: float = 15.0) -> Response:
    """POST /orders/<order>/activate (or `path`), steering the upstream's delay and status."""
    h = {TENANT_HEADER: tenant}
    if label:
        h[LABEL_HEADER] = label
    if delay_ms:
        h["x-upstream-delay-ms"] = str(delay_ms)
    if status:
        h["x-upstream-status"] = str(status)
    h.update(headers or {})
    # No body: a body that reaches Envoy after the lease answer crashes the filter (see
    # test_a_body_that_arrives_after_the_lease_answer_does_not_crash_the_filter), and urllib
    # sends the body in a second write, so every test would be exposed to that race.
    return envoy.request("POST", path or f"/orders/{order}/activate", headers=h, body=None,
                         timeout=timeout)


def short_hash(domain: str, value: bytes) -> str:
    """keys.rs `short_hash`: 16 hex digits of SHA-256(domain NUL value)."""
    return hashlib.sha256(domain.encode() + b"\0" + value).hexdigest()[:16]


def scope_hash(parts: list[tuple[str, str]]) -> str:
    joined = b"".join(n.encode() + b"=" + v.encode() + b"\x1f" for n, v in parts)
    return short_hash("scope", joined)


def lease_keys(prefix: str, tenant: str, parts: list[tuple[str, str]],
               policy: str = POLICY) -> tuple[str, str]:
    """The documented keys: <prefix>:{lease,fence}:{t.<16 hex>}:<policy>:<16 hex>."""
    tag = "t." + short_hash("tenant", tenant.encode())
    resource = scope_hash(parts)
    return (f"{prefix}:lease:{{{tag}}}:{policy}:{resource}",
            f"{prefix}:fence:{{{tag}}}:{policy}:{resource}")


def order_keys(envoy: Envoy, tenant: str, order: str, policy: str = POLICY) -> tuple[str, str]:
    """Lease and fence key of /orders/<order>/... under resource ["tenant", "path_segment:2"]."""
    return lease_keys(envoy.key_prefix, tenant, [("tenant", tenant), ("path_segment:2", order)],
                      policy)


def get(stack: Stack, key: str) -> str | None:
    raw = stack.redis.get(key)
    return None if raw is None else raw.decode()


def prefix_keys(stack: Stack, prefix: str) -> set[str]:
    return {k.decode() for k in stack.redis.scan_iter(match=f"{prefix}:*", count=1000)}


def lease_stat(envoy: Envoy, name: str, policy: str = POLICY) -> int:
    return envoy.stat(f"wasmcustom.cg.policy.{policy}.lease.{name}")


def lease_stats(envoy: Envoy, policy: str = POLICY) -> dict[str, int]:
    names = ("acquired", "busy", "waited", "released", "extended", "lost", "missing_resource")
    return {n: lease_stat(envoy, n, policy) for n in names}


def assert_problem(resp: Response, status: int, slug: str) -> dict:
    assert resp.status == status, resp
    assert resp.headers.get("content-type") == "application/problem+json", resp
    body = resp.json()
    assert is_problem(body, slug), body
    assert body["status"] == status, body
    assert isinstance(body["detail"], str) and body["detail"], body
    return body


def assert_locked(resp: Response) -> dict:
    body = assert_problem(resp, 409, "resource_locked")
    assert body["type"].endswith("resource_locked"), body
    assert re.fullmatch(r"[1-9]\d*", resp.headers.get("retry-after", "")), resp
    return body


def executed(stack: Stack, order: str) -> list[dict]:
    """What the upstream ran for /orders/<order>/..., in the order it finished."""
    return sorted((r for r in stack.upstream.requests() if r["path"].split("/")[2:3] == [order]),
                  key=lambda r: r["time"])


def token_of(entry: dict) -> int:
    value = entry["headers"].get(FENCING_HEADER)
    assert value is not None and TOKEN_RE.match(value), entry
    return int(value)


def sleep_until(t0: float, offset: float) -> None:
    time.sleep(max(0.0, t0 + offset - time.monotonic()))


def split_post(envoy: Envoy, path: str, tenant: str, before_body, *, body: bytes = b"{}",
               headers: dict | None = None) -> tuple[str, float]:
    """A POST whose body goes out in a second write, after `before_body()` returns:
    (status line, elapsed seconds)."""
    lines = [f"POST {path} HTTP/1.1", "host: x", f"{TENANT_HEADER}: {tenant}",
             "content-type: application/json", f"content-length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", envoy.port), timeout=10) as conn:
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        before_body()
        conn.sendall(body)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(65536)
            if not chunk:
                break
            head += chunk
    return head.split(b"\r\n", 1)[0].decode(), time.monotonic() - start


def redis_now_us(stack: Stack) -> int:
    sec, usec = stack.redis.time()
    return sec * 1_000_000 + usec


class KeyWrites:
    """Keyspace notifications for `<prefix>:*` while the block runs: what touched which key.

    `with KeyWrites(stack, prefix) as w: ...` then `w.events` is a list of (key, event).
    """

    def __init__(self, stack: Stack, prefix: str):
        self.stack, self.prefix = stack, prefix
        self.events: list[tuple[str, str]] = []

    def __enter__(self) -> "KeyWrites":
        self.stack.redis.config_set("notify-keyspace-events", "KA")
        self.pubsub = self.stack.redis.pubsub()
        self.pubsub.psubscribe(f"__keyspace@0__:{self.prefix}:*")
        confirm = self.pubsub.get_message(timeout=2.0)
        assert confirm and confirm["type"] == "psubscribe", confirm
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.2)  # let the root's background calls land
        while (msg := self.pubsub.get_message(timeout=0.1)) is not None:
            if msg["type"] == "pmessage":
                key = msg["channel"].decode().split(":", 1)[1]
                self.events.append((key, msg["data"].decode()))
        self.pubsub.close()

    def touching(self, *keys: str) -> list[tuple[str, str]]:
        return [(k, e) for k, e in self.events if k in keys]


class EchoUpstream:
    """An upstream in a thread of the test process that records every request header (the
    harness upstream records only a few names)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, str]] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                seen.append({k.lower(): v for k, v in self.headers.items()})
                body = b'{"ok":true}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "EchoUpstream":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory, topology):
    """Redis, webdis and the upstream for the whole module (on its topology); Envoys are
    added per test."""
    stack = Stack(tmp_path_factory.mktemp("lease-e2e"), None, envoys=0, **topology.stack_kwargs).start()
    yield stack
    stack.stop()


@pytest.fixture
def guard(shared):
    """`guard(*policies, sidecars=1, timeout=...) -> Envoy` (or a list of `sidecars` Envoys
    sharing one config) on the shared stack, with a key_prefix of its own (`envoy.key_prefix`).
    Stopped when the test ends."""
    started: list[Envoy] = []

    def make(*policies: dict, sidecars: int = 1, timeout: str = REDIS_TIMEOUT):
        prefix = f"cg:e2e-lease:{uid()}"
        envoys = []
        for _ in range(sidecars):
            envoy = shared.add_envoy(plugin(shared, prefix, *policies, timeout=timeout))
            envoy.key_prefix = prefix
            started.append(envoy)
            envoys.append(envoy)
        return envoys[0] if sidecars == 1 else envoys

    yield make
    for envoy in started:
        envoy.stop()


# --- 1. one resource, two requests ---------------------------------------------------------------


def test_a_second_request_on_a_held_resource_gets_409_resource_locked(shared, guard):
    envoy = guard(lease_policy())
    tenant, order = new_tenant(), new_order()
    lease_key, _ = order_keys(envoy, tenant, order)

    first = in_thread(act, envoy, order, tenant, delay_ms=800, label="first")
    assert wait_for(lambda: shared.redis.exists(lease_key), 2.0), "the first request never acquired"
    second = act(envoy, order, tenant, delay_ms=800, label="second")

    assert_locked(second)
    assert int(second.headers["retry-after"]) >= 1
    assert second.elapsed < 0.6, second  # at once, not after the holder
    assert first().status == 200
    ran = executed(shared, order)
    assert [r["headers"][LABEL_HEADER] for r in ran] == ["first"], ran
    assert wait_for(lambda: lease_stat(envoy, "released") == 1, 1.0)
    assert lease_stats(envoy) == {"acquired": 1, "busy": 1, "waited": 0, "released": 1,
                                  "extended": 0, "lost": 0, "missing_resource": 0}


def test_on_busy_wait_runs_the_second_request_after_the_first_with_a_larger_token(shared, guard):
    envoy = guard(lease_policy(on_busy="wait", max_wait="3s"))
    tenant, order = new_tenant(), new_order()
    lease_key, _ = order_keys(envoy, tenant, order)

    first = in_thread(act, envoy, order, tenant, delay_ms=800, label="first")
    assert wait_for(lambda: shared.redis.exists(lease_key), 2.0), "the first request never acquired"
    second = act(envoy, order, tenant, delay_ms=100, label="second")
    assert first().status == 200
    assert second.status == 200, second
    assert 0.5 < second.elapsed < 2.0, second  # it waited for the first, not for max_wait

    a, b = executed(shared, order)
    assert [a["headers"][LABEL_HEADER], b["headers"][LABEL_HEADER]] == ["first", "second"]
    second_started = b["time"] - 0.1
    assert second_started >= a["time"] - 0.005, (a, b)  # not before the first one ended
    assert token_of(b) > token_of(a)
    assert wait_for(lambda: lease_stat(envoy, "released") == 2, 1.0)
    assert lease_stats(envoy) == {"acquired": 2, "busy": 0, "waited": 1, "released": 2,
                                  "extended": 0, "lost": 0, "missing_resource": 0}


def test_on_busy_wait_gives_up_with_409_after_about_max_wait(shared, guard):
    envoy = guard(lease_policy(on_busy="wait", max_wait="1s"))
    tenant, order = new_tenant(), new_order()
    lease_key, _ = order_keys(envoy, tenant, order)

    first = in_thread(act, envoy, order, tenant, delay_ms=2000, label="first")
    assert wait_for(lambda: shared.redis.exists(lease_key), 2.0), "the first request never acquired"
    second = act(envoy, order, tenant, label="second")

    assert_locked(second)
    # Polls back off up to 400 ms, so it gives up at the last poll before max_wait.
    assert 0.55 <= second.elapsed <= 1.6, second
    assert 9 <= int(second.headers["retry-after"]) <= 10, second  # the lease's remaining TTL
    assert first().status == 200
    assert [r["headers"][LABEL_HEADER] for r in executed(shared, order)] == ["first"]
    stats = lease_stats(envoy)
    assert (stats["acquired"], stats["busy"], stats["waited"]) == (1, 1, 0), stats


def test_a_waiter_polls_once_more_at_max_wait_before_giving_up(shared, guard):
    """`on_busy: wait` polls once more at max_wait before it gives up (README: "poll ... until
    the lease is free or max_wait passes"). With max_wait 1.5 s the backoff polls fall at ~25,
    75, 175, 375, 775, 1175 ms; the last is clamped to 1500 ms, after the holder (1.4 s
    upstream) released the lease. (It once answered 409 at the poll before, up to 400 ms
    early.)"""
    envoy = guard(lease_policy(on_busy="wait", max_wait="1500ms"), timeout="50ms")
    tenant, order = new_tenant(), new_order()
    lease_key, _ = order_keys(envoy, tenant, order)

    first = in_thread(act, envoy, order, tenant, delay_ms=1400, label="first")
    assert wait_for(lambda: shared.redis.exists(lease_key), 2.0, 0.002), "never acquired"
    second = act(envoy, order, tenant, label="second")
    assert first().status == 200
    assert second.status == 200, (
        f"gave up after {second.elapsed:.3f}s of max_wait 1.5s though the lease was free at "
        f"~1.45s: {second}")
    assert [r["headers"][LABEL_HEADER] for r in executed(shared, order)] == ["first", "second"]


# --- 2. other resources and other tenants run in parallel ----------------------------------------


def test_other_resources_and_other_tenants_are_not_serialized(shared, guard):
    envoy = guard(lease_policy())
    tenant, other_tenant = new_tenant(), new_tenant()
    order, other_order = new_order(), new_order()

    for i, (a, b) in enumerate([((order, tenant), (other_order, tenant)),  # other path segment
                                ((order, tenant), (order, other_tenant))]):  # other tenant
        assert wait_for(lambda: lease_stat(envoy, "released") == 2 * i, 1.0)  # the last round's
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=2) as pool:
            one = pool.submit(act, envoy, a[0], a[1], delay_ms=800)
            two = pool.submit(act, envoy, b[0], b[1], delay_ms=800)
            responses = [one.result(), two.result()]
        elapsed = time.monotonic() - start
        assert [r.status for r in responses] == [200, 200], responses
        assert elapsed < 1.6 * 0.8, f"not in parallel: {elapsed:.3f}s for two 0.8 s calls"

    # Tokens strictly increase per resource; two resources may share a value (on a Redis
    # Cluster their fence keys live on different nodes, which can read the same microsecond).
    ran = [(r["path"].split("/")[2], r["headers"][TENANT_HEADER], token_of(r))
           for r in shared.upstream.requests()
           if r["path"].split("/")[2:3] in ([order], [other_order])]
    assert len(ran) == 4, ran
    same = [t for o, who, t in ran if (o, who) == (order, tenant)]
    assert len(same) == 2 and same[0] < same[1], ran
    assert lease_stat(envoy, "acquired") == 4 and lease_stat(envoy, "busy") == 0
    assert wait_for(lambda: lease_stat(envoy, "released") == 4, 1.0)


# --- 3. lease lifetime: extension, release, expiry -----------------------------------------------


def test_extension_keeps_the_lease_while_the_call_runs_and_the_response_releases_it(shared, guard):
    envoy = guard(lease_policy(ttl="1s", extend=True))
    tenant, order = new_tenant(), new_order()
    lease_key, _ = order_keys(envoy, tenant, order)

    t0 = time.monotonic()
    first = in_thread(act, envoy, order, tenant, delay_ms=2500, label="first")
    assert wait_for(lambda: shared.redis.exists(lease_key), 2.0), "never acquired"
    owner = get(shared, lease_key)
    assert owner and re.fullmatch(r"[0-9a-f]{32}", owner), owner

    for at in (1.5, 2.2):  # both past the 1 s TTL: only extensions keep it
        sleep_until(t0, at)
        pttl = shared.redis.pttl(lease_key)
        assert 0 < pttl <= 1000, (at, pttl)
        assert get(shared, lease_key) == owner, at
        if at == 1.5:
            assert_locked(act(envoy, order, tenant, label="intruder"))

    resp = first()
    assert resp.status == 200
    done = time.monotonic()
    assert wait_for(lambda: not shared.redis.exists(lease_key), 0.5, 0.005), "not released"
    assert time.monotonic() - done < 0.3
    assert [r["headers"][LABEL_HEADER] for r in executed(shared, order)] == ["first"]
    assert wait_for(lambda: lease_stat(envoy, "released") == 1, 1.0)
    stats = lease_stats(envoy)
    assert stats["extended"] >= 2 and stats["lost"] == 0 and stats["busy"] == 1, stats
    assert stats["extended"] <= 5, stats  # every half TTL, not every tick


def test_without_extension_the_lease_expires_and_the_stale_release_spares_the_new_holder(shared, guard):
    left, right = guard(lease_policy(ttl="1s", extend=False), sidecars=2)
    tenant, order = new_tenant(), new_order()
    lease_key, _ = order_keys(left, tenant, order)

    t0 = time.monotonic()
    first = in_thread(act, left, order, tenant, delay_ms=1800, label="first")
    assert wait_for(lambda: shared.redis.exists(lease_key), 2.0), "never acquired"
    first_owner = get(shared, lease_key)

    sleep_until(t0, 1.2)  # the first's 1 s lease is gone, its call is not
    assert not shared.redis.exists(lease_key)
    second = in_thread(act, right, order, tenant, delay_ms=1500, label="second")
    assert wait_for(lambda: get(shared, lease_key) not in (None, first_owner), 1.0), "never acquired"
    second_owner = get(shared, lease_key)

    assert first().status == 200  # at ~1.8 s, while the second holds the lease
    assert wait_for(lambda: lease_stat(left, "lost") >= 1, 1.0), lease_stats(left)
    assert get(shared, lease_key) == second_owner, "the stale holder's release deleted the new lease"
    assert 0 < shared.redis.pttl(lease_key) <= 1000
    assert "a lease was lost" in left.log_text()

    assert second().status == 200
    first_ran, second_ran = executed(shared, order)
    assert first_ran["headers"][LABEL_HEADER] == "first"
    assert token_of(second_ran) > token_of(first_ran)
    assert wait_for(lambda: lease_stat(right, "released") + lease_stat(right, "lost") == 1, 1.0)
    assert lease_stat(left, "released") == 0 and lease_stat(left, "extended") == 0
    assert lease_stat(left, "acquired") == 1 and lease_stat(right, "acquired") == 1


def test_extension_keeps_up_when_the_redis_timeout_makes_the_tick_coarse(shared, guard):
    """Extensions keep up with a lease TTL shorter than the Redis timeout makes the root's tick:
    the tick is at most ttl / 4 for leases with `extend`. (With redis.timeout 1s, tick 500 ms,
    and ttl 1s, the extension due at 500 ms once went out at ~1000-1500 ms: the lease had
    expired, a concurrent request got 200 instead of 409 and `lost` counted.)"""
    envoy = guard(lease_policy(ttl="1s", extend=True), timeout="1s")
    tenant, order = new_tenant(), new_order()
    lease_key, _ = order_keys(envoy, tenant, order)

    t0 = time.monotonic()
    first = in_thread(act, envoy, order, tenant, delay_ms=2500, label="first")
    assert wait_for(lambda: shared.redis.exists(lease_key), 2.0), "never acquired"
    owner = get(shared, lease_key)
    samples = []
    while time.monotonic() - t0 < 2.3:
        samples.append((round(time.monotonic() - t0, 2), get(shared, lease_key)))
        time.sleep(0.02)
    intruder = act(envoy, order, tenant, label="intruder")
    assert first().status == 200
    gaps = [at for at, value in samples if value != owner]
    assert not gaps, (f"the lease was not ours from {gaps[0]}s on ({len(gaps)} of {len(samples)} "
                      f"samples); intruder got {intruder.status}; {lease_stats(envoy)}")
    assert_locked(intruder)
    assert lease_stat(envoy, "lost") == 0


def test_a_client_that_goes_away_leaves_the_lease_until_its_ttl(shared, guard):
    """The client leaves before the service answered: the service may still be working, so
    the lease stays its request's (not extended) until its TTL; no second request runs on the
    resource meanwhile. More in test_e2e_hangups.py."""
    envoy = guard(lease_policy(ttl="2s"))
    tenant, order = new_tenant(), new_order()
    lease_key, _ = order_keys(envoy, tenant, order)
    with socket.create_connection(("127.0.0.1", envoy.port), timeout=5) as conn:
        conn.sendall(f"POST /orders/{order}/activate HTTP/1.1\r\nhost: x\r\n"
                     f"{TENANT_HEADER}: {tenant}\r\nx-upstream-delay-ms: 1500\r\n"
                     f"content-length: 0\r\n\r\n".encode())
        assert wait_for(lambda: shared.redis.exists(lease_key), 2.0), "never acquired"
    owner = get(shared, lease_key)
    assert wait_for(lambda: lease_stat(envoy, "orphaned") == 1, 1.0)
    assert_locked(act(envoy, order, tenant))
    assert get(shared, lease_key) == owner
    assert wait_for(lambda: not shared.redis.exists(lease_key), 2.5, 0.02), "never expired"
    assert lease_stat(envoy, "released") == 0 and lease_stat(envoy, "extended") == 0
    assert act(envoy, order, tenant).status == 200


def test_the_next_request_after_a_response_finds_the_resource_free(shared, guard):
    """A client that acts on the same resource right after its previous call finished finds it
    free: the response waits for the lease's release (one round trip). (When the release
    waited for the root's next tick, such a client got 409 resource_locked from its own
    finished request.)"""
    envoy = guard(lease_policy())
    tenant, order = new_tenant(), new_order()
    statuses = [act(envoy, order, tenant, label=f"n{i}").status for i in range(6)]
    assert statuses == [200] * 6, (
        f"back-to-back calls of one client: {statuses}; 409s come from the client's own "
        f"finished requests whose release had not been sent yet")


def test_a_body_that_arrives_after_the_lease_answer_does_not_crash_the_filter(shared, guard):
    """A request whose body reaches Envoy after the acquire answered (the request was already
    resumed) does not crash the filter: the upstream headers are set only when the headers are
    continued, never from the body callback, and no host call panics on a refusal. (Setting
    them again from the body callback once made Envoy refuse, proxy-wasm's wrapper panic and
    the worker's VM die: 503 for this client after the upstream ran, the lease held for its TTL,
    503 for every later request on that worker. urllib/requests send headers and body in two
    writes, so every POST with a body runs this race.)"""
    envoy = guard(lease_policy(ttl="30s"))
    tenant, order = new_tenant(), new_order()
    lease_key, _ = order_keys(envoy, tenant, order)

    def acquired_and_resumed():
        assert wait_for(lambda: shared.redis.exists(lease_key), 2.0), "never acquired"
        time.sleep(0.1)  # the acquire answer has resumed the request by now

    status_line, _ = split_post(envoy, f"/orders/{order}/activate", tenant, acquired_and_resumed)
    panics = [line for line in envoy.log_text().splitlines() if "panicked" in line or "failed:" in line]
    assert not panics, f"{status_line}; the filter's VM died: {panics}"
    assert status_line.startswith("HTTP/1.1 200"), status_line
    assert wait_for(lambda: not shared.redis.exists(lease_key), 1.0), "the lease leaked"
    after = [act(envoy, new_order(), tenant).status for _ in range(6)]
    assert after == [200] * 6, after


def test_a_waiting_request_stays_held_when_its_body_arrives(shared, guard):
    """A request waiting for a busy lease (`on_busy: wait`) whose body arrives meanwhile stays
    held: the body and trailers callbacks answer Wait while the request is held. (They once
    answered Continue outside Buffering and Acquiring, which let the waiter run beside the
    holder, without the lease and without a fencing token.)"""
    envoy = guard(lease_policy(on_busy="wait", max_wait="3s"))
    tenant, order = new_tenant(), new_order()
    lease_key, _ = order_keys(envoy, tenant, order)

    holder = in_thread(act, envoy, order, tenant, delay_ms=800, label="holder")
    assert wait_for(lambda: shared.redis.exists(lease_key), 2.0), "the holder never acquired"
    status_line, elapsed = split_post(envoy, f"/orders/{order}/activate", tenant,
                                      lambda: time.sleep(0.2),  # now it is waiting
                                      headers={LABEL_HEADER: "waiter", "x-upstream-delay-ms": 100})
    assert holder().status == 200
    assert status_line.startswith("HTTP/1.1 200"), status_line
    ran = {r["headers"][LABEL_HEADER]: r for r in executed(shared, order)}
    assert set(ran) == {"holder", "waiter"}, ran
    waiter_started = ran["waiter"]["time"] - 0.1
    assert waiter_started >= ran["holder"]["time"] - 0.005, (
        f"the waiter ran {ran['holder']['time'] - waiter_started:.3f}s before the holder ended, "
        f"with fencing token {ran['waiter']['headers'].get(FENCING_HEADER)}; {lease_stats(envoy)}")
    assert token_of(ran["waiter"]) > token_of(ran["holder"])
    assert elapsed > 0.6


# --- 4. fencing tokens across sidecars -----------------------------------------------------------


def test_tokens_strictly_increase_in_execution_order_across_two_sidecars(shared, guard):
    left, right = guard(lease_policy(on_busy="wait", max_wait="8s"), sidecars=2)
    tenant, order = new_tenant(), new_order()
    _, fence_key = order_keys(left, tenant, order)

    before_us = redis_now_us(shared)
    for i in range(6):  # sequential, alternating sidecars
        assert act((left, right)[i % 2], order, tenant, label=f"seq{i}").status == 200
    sequential = executed(shared, order)
    tokens = [token_of(r) for r in sequential]
    assert all(a < b for a, b in zip(tokens, tokens[1:])), tokens
    assert before_us <= tokens[0] <= redis_now_us(shared) + 1_000, (before_us, tokens)
    assert int(get(shared, fence_key)) == tokens[-1]

    # (The sequential calls may have waited too: each release trails its response.)
    waited_before = lease_stat(left, "waited") + lease_stat(right, "waited")
    n, delay = 8, 150
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait(timeout=10)
        return act((left, right)[i % 2], order, tenant, delay_ms=delay, label=f"con{i}")

    with ThreadPoolExecutor(max_workers=n) as pool:
        responses = list(pool.map(one, range(n)))
    assert [r.status for r in responses] == [200] * n, responses

    ran = [r for r in executed(shared, order) if r["headers"][LABEL_HEADER].startswith("con")]
    assert len(ran) == n
    intervals = [(r["time"] - delay / 1000, r["time"]) for r in ran]
    for (_, end), (start, _) in zip(intervals, intervals[1:]):
        assert start >= end - 0.005, f"two holders ran at once: {intervals}"
    con_tokens = [token_of(r) for r in ran]
    # Strictly increasing in the order the upstream ran them.
    assert all(a < b for a, b in zip(con_tokens, con_tokens[1:])), con_tokens
    all_tokens = tokens + con_tokens
    assert len(set(all_tokens)) == len(all_tokens) and min(con_tokens) > max(tokens)
    assert int(get(shared, fence_key)) == con_tokens[-1]
    total = {k: lease_stat(left, k) + lease_stat(right, k) for k in ("acquired", "busy", "waited")}
    assert total["acquired"] == 6 + n and total["busy"] == 0, total
    # All but the first waited (one may come late; the first may wait for the last release).
    assert n - 2 <= total["waited"] - waited_before <= n, (total, waited_before)


# --- 5. the resource selector is missing ---------------------------------------------------------


def test_a_request_without_the_resource_gets_400_naming_the_selector(shared, guard):
    envoy = guard(lease_policy(),
                  lease_policy("transfer", "/transfers", resource=("tenant", "query:account")))
    tenant = new_tenant()

    cases = [("/orders", "path_segment:2", POLICY),
             ("/orders/", "path_segment:2", POLICY),
             # Slashes merge and dot segments go (`/orders//activate` is `/orders/activate`,
             # whose segment 2 is `activate`): this one still has no segment 2.
             ("/orders/./", "path_segment:2", POLICY),
             ("/transfers/t1", "query:account", "transfer"),
             ("/transfers/t1?accounts=7&x=account", "query:account", "transfer")]
    for path, selector, policy_name in cases:
        resp = act(envoy, None, tenant, path=path)
        body = assert_problem(resp, 400, "lease_resource_missing")
        assert body["missing-selector"] == selector, (path, body)
        assert selector in body["detail"], (path, body)
    assert lease_stat(envoy, "missing_resource") == 3
    assert lease_stat(envoy, "missing_resource", "transfer") == 2
    assert not any(r["headers"].get(TENANT_HEADER) == tenant for r in shared.upstream.requests())
    assert prefix_keys(shared, envoy.key_prefix) == set()

    ok = act(envoy, None, tenant, path="/transfers/t1?account=42")
    assert ok.status == 200, ok
    ran = [r for r in shared.upstream.requests() if r["headers"].get(TENANT_HEADER) == tenant]
    assert [r["path"] for r in ran] == ["/transfers/t1"]
    token_of(ran[0])
    lease_key, _ = lease_keys(envoy.key_prefix, tenant, [("tenant", tenant), ("query:account", "42")],
                              "transfer")
    assert wait_for(lambda: lease_stat(envoy, "released", "transfer") == 1, 1.0)
    assert lease_key.replace(":lease:", ":fence:") in prefix_keys(shared, envoy.key_prefix)
    assert lease_stat(envoy, "acquired", "transfer") == 1


# --- 6. the fencing header's name ----------------------------------------------------------------


def test_the_fencing_header_name_is_configurable_and_the_client_cannot_set_it(shared, tmp_path):
    echo = EchoUpstream().start()
    prefix = f"cg:e2e-lease:{uid()}"
    config = plugin(shared, prefix, lease_policy(fencing_header="x-lease-token"))
    envoy = Envoy(tmp_path / "envoy-echo", config, echo.port, shared.webdis.port)
    try:
        envoy.start()
        tenant, order = new_tenant(), new_order()
        assert act(envoy, order, tenant).status == 200
        assert wait_for(lambda: lease_stat(envoy, "released") == 1, 1.0)
        forged = act(envoy, order, tenant, headers={"x-lease-token": "99999999999999999"})
        assert forged.status == 200
        first, second = echo.requests
        for seen in (first, second):
            assert TOKEN_RE.match(seen.get("x-lease-token", "")), seen
            assert FENCING_HEADER not in seen, seen
        assert int(second["x-lease-token"]) > int(first["x-lease-token"])
        assert second["x-lease-token"] != "99999999999999999", "the client's token reached the service"
    finally:
        envoy.stop()
        echo.stop()


# --- 7. the lease comes after rate limits and idempotency ----------------------------------------


def guarded_policy(limit: int = 10, **lease) -> dict:
    """Rate limit (per tenant) + idempotency (no body in the fingerprint) + lease."""
    return lease_policy(
        rate_limits=[{"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window",
                      "limit": limit, "window": "60s"}],
        idempotency={"header": "idempotency-key", "methods": ["POST"], "fingerprint": ["method", "path"]},
        **lease)


def test_a_replay_takes_no_lease(shared, guard):
    envoy = guard(guarded_policy())
    tenant, order, key = new_tenant(), new_order(), f"key-{uid()}"
    lease_key, fence_key = order_keys(envoy, tenant, order)

    first = act(envoy, order, tenant, headers={"idempotency-key": key})
    assert first.status == 200 and "idempotent-replayed" not in first.headers
    assert wait_for(lambda: not shared.redis.exists(lease_key), 1.0)
    fence = get(shared, fence_key)
    with KeyWrites(shared, envoy.key_prefix) as writes:
        replay = act(envoy, order, tenant, headers={"idempotency-key": key})
    assert replay.status == 200 and replay.headers.get("idempotent-replayed") == "true", replay
    assert writes.touching(lease_key, fence_key) == [], writes.events
    assert get(shared, fence_key) == fence
    assert len(executed(shared, order)) == 1
    assert lease_stat(envoy, "acquired") == 1 and lease_stat(envoy, "released") == 1


def test_a_rate_limited_request_takes_no_lease(shared, guard):
    envoy = guard(guarded_policy(limit=2))
    tenant = new_tenant()
    for _ in range(2):
        assert act(envoy, new_order(), tenant, headers={"idempotency-key": f"k-{uid()}"}).status == 200
    order = new_order()
    lease_key, fence_key = order_keys(envoy, tenant, order)
    with KeyWrites(shared, envoy.key_prefix) as writes:
        limited = act(envoy, order, tenant, headers={"idempotency-key": f"k-{uid()}"})
    assert_problem(limited, 429, "rate_limited")
    assert writes.touching(lease_key, fence_key) == [], writes.events
    assert not shared.redis.exists(lease_key) and not shared.redis.exists(fence_key)
    assert executed(shared, order) == []
    assert lease_stat(envoy, "acquired") == 2 and lease_stat(envoy, "busy") == 0


def test_a_rate_limit_in_another_slot_rejects_before_any_lease_is_taken(shared, guard):
    """A rate-limited request takes no lease (README), even when the limit is not scoped by
    tenant (`by: []`, hash tag {p.<policy>}) and so runs in another script call than the lease
    (tag {t.<tenant>}): the lease-carrying call goes out only once the other calls admitted the
    request. (Both once went out in parallel: a request the global limit rejected had already
    set the lease and burnt a fencing token, and a concurrent legitimate request on that
    resource got 409 meanwhile.)"""
    envoy = guard(lease_policy(rate_limits=[{"name": "global", "by": [], "algorithm": "fixed_window",
                                             "limit": 1, "window": "60s"}]))
    tenant = new_tenant()
    assert act(envoy, new_order(), tenant).status == 200
    assert wait_for(lambda: lease_stat(envoy, "released") == 1, 1.0)
    order = new_order()
    lease_key, fence_key = order_keys(envoy, tenant, order)
    with KeyWrites(shared, envoy.key_prefix) as writes:
        limited = act(envoy, order, tenant)
    assert_problem(limited, 429, "rate_limited")
    assert executed(shared, order) == []
    assert writes.touching(lease_key, fence_key) == [], (
        f"the rejected request took and released the lease: {writes.events}; "
        f"released={lease_stat(envoy, 'released')} for 1 admitted request")


def test_a_duplicate_in_flight_is_in_progress_not_resource_locked(shared, guard):
    envoy = guard(guarded_policy())
    tenant, order, key = new_tenant(), new_order(), f"key-{uid()}"
    lease_key, _ = order_keys(envoy, tenant, order)

    first = in_thread(act, envoy, order, tenant, delay_ms=1000, headers={"idempotency-key": key})
    assert wait_for(lambda: shared.redis.exists(lease_key), 2.0), "never acquired"
    duplicate = act(envoy, order, tenant, headers={"idempotency-key": key})
    assert_problem(duplicate, 409, "idempotency_key_in_use")

    # Another key on the held resource is locked out, and gives its record back.
    other_key = f"key-{uid()}"
    assert_locked(act(envoy, order, tenant, headers={"idempotency-key": other_key}))
    assert first().status == 200
    assert lease_stat(envoy, "busy") == 1 and lease_stat(envoy, "acquired") == 1
    assert envoy.stat(f"wasmcustom.cg.policy.{POLICY}.idem.in_progress") == 1
    assert wait_for(lambda: not shared.redis.exists(lease_key), 1.0)
    retried = act(envoy, order, tenant, headers={"idempotency-key": other_key})
    assert retried.status == 200 and "idempotent-replayed" not in retried.headers, retried
    ran = executed(shared, order)
    assert len(ran) == 2 and token_of(ran[1]) > token_of(ran[0]), ran


# --- 8. Redis is down ----------------------------------------------------------------------------


FAILURE_POLICIES = [lease_policy("closed", "/closed", failure_mode="fail_closed"),
                    lease_policy("open", "/open", failure_mode="fail_open")]


def start_failure_stack(stack_factory) -> Stack:
    stack = stack_factory(None, envoys=0)
    stack.add_envoy(plugin(stack, f"cg:e2e-lease:{uid()}", *FAILURE_POLICIES, timeout="1s"))
    return stack


def test_redis_down_fails_closed_or_forwards_without_a_fencing_token(stack_factory):
    stack = start_failure_stack(stack_factory)
    envoy, tenant = stack.envoy, new_tenant()

    assert act(envoy, None, tenant, path="/open/o1/x", label="up").status == 200
    stack.stop_redis()
    closed = act(envoy, None, tenant, path="/closed/o1/x", label="down")
    assert_problem(closed, 503, "guard_unavailable")
    assert closed.headers.get("retry-after") == "1" and closed.elapsed < 2.0, closed
    opened = act(envoy, None, tenant, path="/open/o1/x", label="down")
    assert opened.status == 200 and opened.elapsed < 2.0, opened

    ran = {(r["path"], r["headers"][LABEL_HEADER]): r["headers"] for r in stack.upstream.requests()}
    assert set(ran) == {("/open/o1/x", "up"), ("/open/o1/x", "down")}, ran
    assert TOKEN_RE.match(ran[("/open/o1/x", "up")][FENCING_HEADER])
    assert FENCING_HEADER not in ran[("/open/o1/x", "down")], ran
    assert envoy.stat("wasmcustom.cg.policy.closed.failed_closed") == 1
    assert envoy.stat("wasmcustom.cg.policy.open.failed_open") == 1
    assert lease_stat(envoy, "acquired", "open") == 1 and lease_stat(envoy, "acquired", "closed") == 0
    assert "failing closed" in envoy.log_text() and "failing open" in envoy.log_text()


def test_fail_open_does_not_forward_a_client_supplied_fencing_token(stack_factory):
    """`fail_open` forwards without a lease and without a fencing header (README): the fencing
    header a client sends is removed from every request the filter sees. (It was once left in,
    so with Redis down the service got a token the client made up; a forged huge one made it
    refuse every later genuine holder.)"""
    stack = start_failure_stack(stack_factory)
    envoy, tenant = stack.envoy, new_tenant()
    stack.stop_redis()
    forged = act(envoy, None, tenant, path="/open/o2/x", label="forged",
                 headers={FENCING_HEADER: "9007199254740991"})
    assert forged.status == 200, forged
    (ran,) = stack.upstream.requests()
    assert FENCING_HEADER not in ran["headers"], f"the client's token reached the service: {ran}"


# --- 9. the key contract -------------------------------------------------------------------------


def test_every_key_has_a_ttl_and_names_no_raw_tenant_or_resource(shared, guard):
    envoy = guard(lease_policy(ttl="30s"), lease_policy("long", "/long", ttl="2h"))
    tenant, order = f"tenant-RAW-{uid()}", f"ORDER-RAW-{uid()}"
    SENT_RAW.update((tenant, order))
    lease_key, fence_key = order_keys(envoy, tenant, order)
    long_lease, long_fence = order_keys(envoy, tenant, order, "long")
    shape = re.compile(rf"^{re.escape(envoy.key_prefix)}:(lease|fence):\{{t\.[0-9a-f]{{16}}\}}:"
                       r"(activate|long):[0-9a-f]{16}$")

    running = [in_thread(act, envoy, order, tenant, delay_ms=700),
               in_thread(act, envoy, None, tenant, path=f"/long/{order}", delay_ms=700)]
    assert wait_for(lambda: shared.redis.exists(lease_key, long_lease) == 2, 2.0), "never acquired"
    keys = prefix_keys(shared, envoy.key_prefix)
    assert keys == {lease_key, fence_key, long_lease, long_fence}, keys
    assert 29_000 < shared.redis.pttl(lease_key) <= 30_000
    assert 7_190_000 < shared.redis.pttl(long_lease) <= 7_200_000
    assert FENCE_TTL_MS - 60_000 < shared.redis.pttl(fence_key) <= FENCE_TTL_MS
    assert 720_000_000 - 60_000 < shared.redis.pttl(long_fence) <= 720_000_000  # 100 x ttl
    assert TOKEN_RE.match(get(shared, fence_key))
    for r in running:
        assert r().status == 200

    assert wait_for(lambda: prefix_keys(shared, envoy.key_prefix) == {fence_key, long_fence}, 1.0)
    # Everything the module wrote: a TTL on every key, no raw tenant or order id in any name.
    lease_shape = re.compile(r"^cg:e2e-lease:[0-9a-f]{10}:(lease|fence):\{t\.[0-9a-f]{16}\}:"
                             r"[a-z]+:[0-9a-f]{16}$")
    module_keys = [k.decode() for k in shared.redis.scan_iter(match="cg:e2e-lease:*", count=1000)]
    assert fence_key in module_keys and shape.match(fence_key) and shape.match(long_lease)
    for key in module_keys:
        if ":lease:" in key or ":fence:" in key:
            assert lease_shape.match(key), key
        assert shared.redis.pttl(key) > 0, key
        for raw in SENT_RAW:
            assert raw not in key, (raw, key)


def test_fence_ttl_setting_sets_the_fence_keys_ttl(shared, guard):
    """`lease.fence_ttl` replaces the default (7 days here): the fence key's PTTL follows it,
    set again at every acquire; the lease's own TTL is unchanged."""
    envoy = guard(lease_policy(ttl="30s", fence_ttl="1h"), lease_policy("default", "/default", ttl="30s"))
    tenant, order = new_tenant(), new_order()
    lease_key, fence_key = order_keys(envoy, tenant, order)
    _, default_fence = order_keys(envoy, tenant, order, "default")

    running = in_thread(act, envoy, order, tenant, delay_ms=500)
    assert wait_for(lambda: shared.redis.exists(lease_key) == 1, 2.0), "never acquired"
    assert 29_000 < shared.redis.pttl(lease_key) <= 30_000
    assert 3_540_000 < shared.redis.pttl(fence_key) <= 3_600_000
    assert running().status == 200
    assert act(envoy, None, tenant, path=f"/default/{order}").status == 200
    assert FENCE_TTL_MS - 60_000 < shared.redis.pttl(default_fence) <= FENCE_TTL_MS

    shared.redis.pexpire(fence_key, 10_000)
    assert wait_for(lambda: lease_stat(envoy, "released") == 1, 1.0)
    assert act(envoy, order, tenant).status == 200  # the next acquire sets it again
    assert 3_540_000 < shared.redis.pttl(fence_key) <= 3_600_000
