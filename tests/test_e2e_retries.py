"""The guard's own answers are not retried by the caller's sidecar, end to end: a caller's Envoy
(no filter, a mesh's retry policy on its route: tests/harness/caller.py) in front of a guarded
Envoy of a real stack (redis-server, webdis, the counting HTTP upstream and a real gRPC
service).

Every answer the filter gives itself carries `x-envoy-ratelimited: true`. Envoy's router retries
no response that has it, whatever its status or `grpc-status`, unless the route's retry policy
names `envoy-ratelimited`; a response the filter passes on from the service gets no such header,
so the service's own `503` is retried as the mesh retries any. Each test counts what each side
saw, as differences of counters read before and after:

- the caller: `cluster.guarded.upstream_rq_retry` (its retries) and `upstream_rq_total`;
- the guarded Envoy: `http.ingress.downstream_rq_total` (the requests it received) and
  `cluster.redis_gateway.upstream_rq_total` (its gateway calls);
- the service: the requests (or gRPC calls) it executed.

The cases: (1) Redis down under `fail_closed`: the guard's `503` reaches the caller once, with
as many gateway calls as without a caller; (2) the guard's `429` and `409`s under an operator
policy that retries exactly those statuses: not retried, while the service's own `409` and
`429` are; (3) a gRPC caller's fail-closed `UNAVAILABLE` under the default's `unavailable`:
not retried, while the service's own `UNAVAILABLE` is; (4) the service's own `503` is retried
twice (three attempts) and, with `x-envoy-ratelimited` from the service itself, not at all: the
header alone makes the difference between (1) and (4).
"""

from __future__ import annotations

import uuid

import grpc
import pytest

from harness.caller import (ISTIO_124_DEFAULT_RETRY, ISTIO_DEFAULT_RETRY, ISTIO_RETRY_ON, Caller,
                            retry_policy)
from harness.concurrency import in_thread, wait_for
from harness.envoy import Envoy, Response
from harness.grpc_upstream import GrpcUpstream
from harness.stack import Stack
from harness.problems import is_problem

TENANT = "x-tenant-id"
NO_RETRY = "x-envoy-ratelimited"
GUARDED_RPC = "/cg.test.Orders/Guarded"  # guarded, fails closed; never reaches the service
CREATE_RPC = "/cg.test.Orders/Create"  # not guarded: the service's own answers
UNAVAILABLE_DETAIL = "the coordination store cannot decide: Redis is unavailable behind its gateway; retry shortly"
# An operator's policy that retries the statuses the guard answers with, 409 and 429 among them.
RETRY_409_429 = retry_policy(ISTIO_RETRY_ON + ",retriable-4xx", [503, 429, 409])


def uid() -> str:
    return uuid.uuid4().hex[:10]


def _ident(b: bytes) -> bytes:
    return b


def policies() -> list[dict]:
    never = [{"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000,
              "window": "1m"}]
    return [
        {"name": "orders", "match": {"methods": ["POST"], "path_prefix": "/orders"},
         "failure_mode": "fail_closed", "rate_limits": never},
        {"name": "limited", "match": {"path_prefix": "/limited"}, "failure_mode": "fail_closed",
         "rate_limits": [{"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window",
                          "limit": 1, "window": "1m"}]},
        {"name": "payments", "match": {"methods": ["POST"], "path_prefix": "/payments"},
         "failure_mode": "fail_closed",
         "idempotency": {"processing_ttl": "1m", "fingerprint": ["method", "path", "body"]}},
        {"name": "activate", "match": {"methods": ["POST"], "path_prefix": "/leases"},
         "failure_mode": "fail_closed",
         "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "10s", "on_busy": "reject",
                   "extend": False}},
        {"name": "grpc", "match": {"path_exact": GUARDED_RPC}, "failure_mode": "fail_closed",
         "rate_limits": never},
    ]


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Redis, webdis, the HTTP upstream and the gRPC service for the module."""
    workdir = tmp_path_factory.mktemp("retries-e2e")
    stack = Stack(workdir, None, envoys=0).start()
    service = GrpcUpstream(workdir / "grpc-upstream")
    try:
        service.start()
    except BaseException:
        stack.stop()
        raise
    stack.grpc_service = service
    yield stack
    service.stop()
    stack.stop()


@pytest.fixture
def guarded(shared, sidecars) -> Envoy:
    """A guarded Envoy (the service's sidecar) with a key_prefix of its own."""
    prefix = f"cg:e2e-retries:{uid()}"
    plugin = {"redis": shared.redis_section(key_prefix=prefix, timeout="500ms"),
              "identity": {"tenant_header": TENANT, "missing_tenant": "reject"},
              "policies": policies()}
    return sidecars(shared, plugin, prefix, grpc_upstream_port=shared.grpc_service.port)


@pytest.fixture
def caller(tmp_path):
    """`caller(target, policy, **kw) -> Caller`: a caller's Envoy in front of `target`,
    stopped (by its pid) when the test ends."""
    started: list[Caller] = []

    def make(target: Envoy, policy: dict | None, **kw) -> Caller:
        c = Caller(tmp_path / f"caller-{len(started)}", target.port, policy, **kw)
        started.append(c)
        return c.start()

    yield make
    for c in reversed(started):
        c.stop()


@pytest.fixture
def redis_down(shared):
    """Redis stops (webdis stays and answers 503 at once) for the test, and comes back after."""
    shared.stop_redis()
    yield
    shared.start_redis()


# --- counting ------------------------------------------------------------------------------------


def seen(shared: Stack, guarded: Envoy, caller: Caller | None = None) -> dict[str, int]:
    """Every side's counters now."""
    out = {
        "guarded_received": guarded.stat("http.ingress.downstream_rq_total"),
        "gateway_calls": guarded.stat("cluster.redis_gateway.upstream_rq_total"),
        "service_executed": shared.upstream.stats()["total"],
        "grpc_executed": sum(shared.grpc_service.stats()["by_method"].values()),
    }
    if caller is not None:
        out["caller_retries"] = caller.retries()
        out["caller_sent"] = caller.cluster_stat("upstream_rq_total")
    return out


def since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def post(envoy: Envoy, path: str, tenant: str, **headers: str) -> Response:
    hdrs = {TENANT: tenant, "content-type": "application/json"}
    hdrs.update({k.replace("_", "-"): v for k, v in headers.items()})
    return envoy.request("POST", path, headers=hdrs, body=b'{"item":"book"}')


def assert_problem(resp: Response, status: int, slug: str) -> None:
    assert resp.status == status, resp
    assert resp.headers.get("content-type") == "application/problem+json", resp
    assert is_problem(resp.json(), slug), resp
    assert resp.headers.get(NO_RETRY) == "true", resp


def grpc_call(envoy: Envoy, method: str, *, tenant: str, code: int = 0, timeout: float = 10.0):
    """A unary call: (status code, details, metadata of the answer)."""
    metadata = [(TENANT, tenant)]
    if code:
        metadata.append(("x-upstream-grpc-code", str(code)))
    with grpc.insecure_channel(f"127.0.0.1:{envoy.port}") as channel:
        rpc = channel.unary_unary(method, request_serializer=_ident, response_deserializer=_ident)
        try:
            _, c = rpc.with_call(b"x", metadata=metadata, timeout=timeout)
            return c.code(), c.details(), {**dict(c.initial_metadata()), **dict(c.trailing_metadata())}
        except grpc.RpcError as e:
            meta = {**dict(e.initial_metadata() or ()), **dict(e.trailing_metadata() or ())}
            return e.code(), e.details(), meta


# --- (1) fail closed: the guard's 503 reaches the caller once -------------------------------------


def test_fail_closed_503_reaches_the_caller_once_with_one_gateway_call(
        shared, guarded, caller, redis_down, record_property):
    n = 5
    # The baseline: straight to the guarded Envoy, nothing to retry. One gateway call each.
    before = seen(shared, guarded)
    for _ in range(n):
        assert_problem(post(guarded, "/orders", f"t-{uid()}"), 503, "guard_unavailable")
    baseline = since(before, seen(shared, guarded))
    assert baseline == {"guarded_received": n, "gateway_calls": n, "service_executed": 0,
                        "grpc_executed": 0}, baseline
    # Through the caller's sidecar with Istio's default retry policy (503 retriable), as it
    # comes and with Envoy's own headers suppressed: the same counts, and no retry.
    for suppress in (False, True):
        mesh = caller(guarded, ISTIO_DEFAULT_RETRY, suppress_envoy_headers=suppress)
        before = seen(shared, guarded, mesh)
        for _ in range(n):
            resp = post(mesh, "/orders", f"t-{uid()}")
            assert_problem(resp, 503, "guard_unavailable")
            assert resp.headers.get("retry-after") == "1", resp
        got = since(before, seen(shared, guarded, mesh))
        record_property(f"through_caller_suppress_{suppress}", got)
        assert got == {**baseline, "caller_retries": 0, "caller_sent": n}, (suppress, got)


# --- (2) 429 and 409 under a policy that retries them ----------------------------------------------


def test_rate_limited_429_is_not_retried_by_a_policy_that_retries_429(shared, guarded, caller):
    mesh = caller(guarded, RETRY_409_429)
    tenant = f"t-{uid()}"
    assert post(mesh, "/limited", tenant).status == 200
    # Rejected by Redis (one gateway call), then by the over-limit cache (none).
    for calls in (1, 0):
        before = seen(shared, guarded, mesh)
        resp = post(mesh, "/limited", tenant)
        assert_problem(resp, 429, "rate_limited")
        got = since(before, seen(shared, guarded, mesh))
        assert got == {"guarded_received": 1, "gateway_calls": calls, "service_executed": 0,
                       "grpc_executed": 0, "caller_retries": 0, "caller_sent": 1}, got
    # The same policy does retry a 429 without the header: the service's own, twice.
    before = seen(shared, guarded, mesh)
    resp = mesh.request("GET", "/plain", headers={"x-upstream-status": "429"})
    assert resp.status == 429 and NO_RETRY not in resp.headers, resp
    got = since(before, seen(shared, guarded, mesh))
    assert (got["caller_retries"], got["service_executed"], got["guarded_received"]) == (2, 3, 3), got


def test_in_progress_and_lease_busy_409s_are_not_retried_by_a_policy_that_retries_409(
        shared, guarded, caller):
    mesh = caller(guarded, RETRY_409_429)
    tenant = f"t-{uid()}"
    cases = [("/payments/p1", "idempotency_key_in_use", {"idempotency_key": f"k-{uid()}"}),
             (f"/leases/o{uid()}", "resource_locked", {})]
    for path, slug, extra in cases:
        first = in_thread(post, mesh, path, tenant, x_upstream_delay_ms="1500",
                          x_upstream_status="201", **extra)
        assert wait_for(lambda: shared.upstream.in_flight(), 5), "the first reached the service"
        before = seen(shared, guarded, mesh)
        assert_problem(post(mesh, path, tenant, **extra), 409, slug)
        got = since(before, seen(shared, guarded, mesh))
        assert got["caller_retries"] == 0 and got["guarded_received"] == 1, (slug, got)
        assert first().status == 201
        assert got["service_executed"] == 0, (slug, got)
    # The same policy does retry a 409 without the header: the service's own, twice.
    before = seen(shared, guarded, mesh)
    resp = mesh.request("GET", "/plain", headers={"x-upstream-status": "409"})
    assert resp.status == 409 and NO_RETRY not in resp.headers, resp
    got = since(before, seen(shared, guarded, mesh))
    assert (got["caller_retries"], got["service_executed"], got["guarded_received"]) == (2, 3, 3), got


# --- (3) gRPC: UNAVAILABLE from the guard is not retried -------------------------------------------


def test_grpc_fail_closed_unavailable_is_not_retried(shared, guarded, caller, redis_down):
    # Istio 1.24's default retries gRPC UNAVAILABLE still (and so did every release before).
    mesh = caller(guarded, ISTIO_124_DEFAULT_RETRY)
    n = 3
    before = seen(shared, guarded, mesh)
    for _ in range(n):
        code, details, meta = grpc_call(mesh, GUARDED_RPC, tenant=f"t-{uid()}")
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details, meta)
        assert details == UNAVAILABLE_DETAIL
        assert meta.get(NO_RETRY) == "true", meta
        assert meta.get("retry-after") == "1", meta
    got = since(before, seen(shared, guarded, mesh))
    assert got == {"guarded_received": n, "gateway_calls": n, "service_executed": 0,
                   "grpc_executed": 0, "caller_retries": 0, "caller_sent": n}, got
    # The service's own UNAVAILABLE (a trailers-only answer, no header) is retried twice.
    before = seen(shared, guarded, mesh)
    code, _, meta = grpc_call(mesh, CREATE_RPC, tenant=f"t-{uid()}", code=14)
    assert code == grpc.StatusCode.UNAVAILABLE and NO_RETRY not in meta, (code, meta)
    got = since(before, seen(shared, guarded, mesh))
    assert (got["caller_retries"], got["grpc_executed"], got["guarded_received"]) == (2, 3, 3), got


# --- (4) the service's own 503 keeps the mesh's behaviour ------------------------------------------


def test_the_services_own_503_is_retried_twice_and_only_the_header_stops_it(
        shared, guarded, caller, record_property):
    mesh = caller(guarded, ISTIO_DEFAULT_RETRY)
    tenant = f"t-{uid()}"
    # Scripts loaded (a Redis just restarted has none: the first call would be sent twice).
    assert post(guarded, "/orders", tenant).status == 200
    # Guarded (the policy admits each attempt) and answered 503 by the service: retried twice.
    before = seen(shared, guarded, mesh)
    resp = post(mesh, "/orders", tenant, x_upstream_status="503")
    assert resp.status == 503 and resp.json()["path"] == "/orders", resp
    assert NO_RETRY not in resp.headers, "the filter adds nothing of the kind to a passed-on answer"
    assert "ratelimit" in resp.headers, "it did pass the filter"
    got = since(before, seen(shared, guarded, mesh))
    record_property("service_503", got)
    assert got == {"guarded_received": 3, "gateway_calls": 3, "service_executed": 3,
                   "grpc_executed": 0, "caller_retries": 2, "caller_sent": 3}, got
    # The same 503 with the header (the service's own, passed on as it is): not retried.
    before = seen(shared, guarded, mesh)
    resp = post(mesh, "/orders", tenant, x_upstream_status="503",
                x_upstream_header_x_envoy_ratelimited="true")
    assert resp.status == 503 and resp.headers.get(NO_RETRY) == "true", resp
    got = since(before, seen(shared, guarded, mesh))
    record_property("service_503_with_header", got)
    assert got == {"guarded_received": 1, "gateway_calls": 1, "service_executed": 1,
                   "grpc_executed": 0, "caller_retries": 0, "caller_sent": 1}, got
