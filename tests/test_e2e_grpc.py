"""gRPC through the guard, end to end: a real gRPC client (grpcio) through real Envoy running the
filter, real webdis and redis-server, and a real gRPC service (tests/harness/grpc_upstream.py)
that counts what it executed. Envoy reaches the service over HTTP/2 (cluster `grpc_upstream`,
routed by the path prefix `/cg.test.`); the client speaks h2c to the listener.

Every test asserts on what the gRPC client sees (status code, message, metadata), on what the
service executed, on the record in Redis and on the filter's metrics. The local-reply tests send
the same request over plain HTTP as well: that answer must stay the problem+json it was.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import grpc
import pytest

from harness.envoy import Envoy
from harness.grpc_upstream import GrpcUpstream
from harness.stack import DEAD_CLUSTER, Stack
from harness.problems import is_problem

TENANT = "x-tenant-id"
CREATE = "/cg.test.Orders/Create"
STREAM = "/cg.test.Orders/Stream"
LIMITED = "/cg.test.Orders/Limited"


def uid() -> str:
    return uuid.uuid4().hex[:10]


def _ident(b: bytes) -> bytes:
    return b


def idem_policy(**overrides) -> dict:
    block = {"header": "idempotency-key", "required": True, "methods": ["POST"],
             "fingerprint": ["method", "path", "body"], "replay": "full",
             "max_response_body": "64KiB", "complete": "sync"}
    block.update(overrides)
    return {"name": "grpc-orders", "match": {"methods": ["POST"], "path_prefix": "/cg.test.Orders/"},
            "failure_mode": "fail_closed", "idempotency": block}


def limited_policies() -> list[dict]:
    """One call per minute per tenant, for gRPC (`/cg.test.Orders/Limited`) and HTTP (`/limited`)."""
    limit = [{"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1,
              "window": "1m"}]
    return [
        {"name": "grpc-limited", "match": {"path_exact": LIMITED}, "rate_limits": limit},
        {"name": "http-limited", "match": {"path_exact": "/limited"}, "rate_limits": limit},
    ]


def plugin(stack: Stack, prefix: str, *policies: dict, cluster: str | None = None) -> dict:
    redis = stack.redis_section(key_prefix=prefix, timeout="500ms")
    if cluster:
        redis["cluster"] = cluster
    return {"redis": redis,
            "identity": {"tenant_header": TENANT, "principal_header": "x-user-id",
                         "missing_tenant": "reject"},
            "policies": list(policies)}


class Outcome:
    """What the client saw: code, details, response message (OK only), metadata."""

    def __init__(self, code, details, message, initial, trailing, messages=None):
        self.code = code
        self.details = details
        self.message = message
        self.messages = messages
        self.initial = dict(initial or ())
        self.trailing = dict(trailing or ())

    def metadata(self, name: str) -> str | None:
        return self.initial.get(name, self.trailing.get(name))

    def __repr__(self) -> str:
        return (f"Outcome({self.code}, {self.details!r}, {self.message!r}, messages={self.messages!r}, "
                f"initial={self.initial}, trailing={self.trailing})")


def call(envoy: Envoy, method: str, body: bytes, *, tenant: str | None, key: str | None = None,
         code: int = 0, message: str = "", delay_ms: int = 0, no_message: bool = False,
         timeout: float = 10.0) -> Outcome:
    metadata = []
    if tenant is not None:
        metadata.append((TENANT, tenant))
    if key is not None:
        metadata.append(("idempotency-key", key))
    if code:
        metadata.append(("x-upstream-grpc-code", str(code)))
    if message:
        metadata.append(("x-upstream-grpc-message", message))
    if delay_ms:
        metadata.append(("x-upstream-delay-ms", str(delay_ms)))
    if no_message:
        metadata.append(("x-upstream-no-message", "1"))
    with grpc.insecure_channel(f"127.0.0.1:{envoy.port}") as channel:
        if method == STREAM:
            rpc = channel.unary_stream(method, request_serializer=_ident, response_deserializer=_ident)
            it = rpc(body, metadata=metadata, timeout=timeout)
            got = []
            try:
                for m in it:
                    got.append(m)
                return Outcome(it.code(), it.details(), None, it.initial_metadata(),
                               it.trailing_metadata(), got)
            except grpc.RpcError as e:
                return Outcome(e.code(), e.details(), None, e.initial_metadata(),
                               e.trailing_metadata(), got)
        rpc = channel.unary_unary(method, request_serializer=_ident, response_deserializer=_ident)
        try:
            response, c = rpc.with_call(body, metadata=metadata, timeout=timeout)
            return Outcome(c.code(), c.details(), response, c.initial_metadata(),
                           c.trailing_metadata())
        except grpc.RpcError as e:
            return Outcome(e.code(), e.details(), None, e.initial_metadata(), e.trailing_metadata())


def records(stack: Stack, prefix: str) -> list[dict]:
    out = []
    for k in stack.redis.scan_iter(f"{prefix}:idem:*"):
        out.append(json.loads(stack.redis.get(k)))
    return out


def stat(envoy: Envoy, name: str) -> int:
    return envoy.stat(f"wasmcustom.cg.policy.grpc-orders.idem.{name}")


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Redis, webdis, the HTTP upstream and the gRPC service for the module."""
    workdir = tmp_path_factory.mktemp("grpc-e2e")
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
def guard(shared, sidecars):
    """`guard(*policies, cluster=None) -> Envoy` with a key_prefix of its own (`.key_prefix`)."""

    def make(*policies: dict, cluster: str | None = None) -> Envoy:
        prefix = f"cg:e2e-grpc:{uid()}"
        return sidecars(shared, plugin(shared, prefix, *policies, cluster=cluster), prefix,
                        grpc_upstream_port=shared.grpc_service.port)

    return make


def executed(shared: Stack, method: str, body: bytes) -> int:
    """How many times the service ran `method` with this request body."""
    return sum(1 for r in shared.grpc_service.stats()["requests"]
               if r["method"] == method and r["body"] == body.hex())


# --- (a) success: completed at the trailers, replayed ---------------------------------------------


def test_a_successful_unary_call_completes_its_record_and_is_not_run_again(shared, guard):
    envoy = guard(idem_policy())
    tenant, key, body = f"t-{uid()}", f"k-{uid()}", f"order-{uid()}".encode()
    first = call(envoy, CREATE, body, tenant=tenant, key=key)
    assert first.code == grpc.StatusCode.OK, first
    assert first.message == b"done:" + body
    # The record was completed when the trailers arrived: COMPLETED, with the status stored.
    recs = records(shared, envoy.key_prefix)
    assert len(recs) == 1 and recs[0]["state"] == "COMPLETED", recs
    response = recs[0]["response"]
    assert ["grpc-status", "0"] in response["trailers"], response
    assert response["status"] == 200
    assert stat(envoy, "completed") == 1
    assert stat(envoy, "outcome_unknown") == 0
    # The retry never reaches the service. Its message cannot be replayed over gRPC (Envoy
    # answers a gRPC request locally trailers-only): the client is told the call completed.
    retry = call(envoy, CREATE, body, tenant=tenant, key=key)
    assert executed(shared, "Create", body) == 1
    assert retry.code == grpc.StatusCode.ALREADY_EXISTS, retry
    assert "already completed with OK" in retry.details
    assert retry.metadata("idempotent-replayed") == "true", retry
    assert stat(envoy, "replayed") == 1


def test_a_trailers_only_ok_is_replayed_exactly(shared, guard):
    """A call that ended OK without a message (a server stream of none): the replay is the
    same answer, OK and no message, and the service ran once."""
    envoy = guard(idem_policy())
    tenant, key, body = f"t-{uid()}", f"k-{uid()}", f"list-{uid()}".encode()
    first = call(envoy, STREAM, body, tenant=tenant, key=key, no_message=True)
    assert first.code == grpc.StatusCode.OK and first.messages == [], first
    assert records(shared, envoy.key_prefix)[0]["state"] == "COMPLETED"
    retry = call(envoy, STREAM, body, tenant=tenant, key=key, no_message=True)
    assert retry.code == grpc.StatusCode.OK and retry.messages == [], retry
    assert retry.metadata("idempotent-replayed") == "true", retry
    assert executed(shared, "Stream", body) == 1
    assert stat(envoy, "replayed") == 1


# --- (b) retryable gRPC codes release the record --------------------------------------------------


def test_b_unavailable_trailers_only_releases_the_record(shared, guard):
    envoy = guard(idem_policy())
    tenant, key, body = f"t-{uid()}", f"k-{uid()}", f"order-{uid()}".encode()
    first = call(envoy, CREATE, body, tenant=tenant, key=key, code=14, message="try later")
    assert first.code == grpc.StatusCode.UNAVAILABLE and first.details == "try later", first
    assert records(shared, envoy.key_prefix) == []
    assert stat(envoy, "released") == 1
    assert stat(envoy, "completed") == 0
    retry = call(envoy, CREATE, body, tenant=tenant, key=key)
    assert retry.code == grpc.StatusCode.OK and retry.message == b"done:" + body, retry
    assert executed(shared, "Create", body) == 2


def test_b_retryable_status_in_trailers_after_a_message_releases_the_record(shared, guard):
    envoy = guard(idem_policy())
    tenant, key, body = f"t-{uid()}", f"k-{uid()}", f"list-{uid()}".encode()
    first = call(envoy, STREAM, body, tenant=tenant, key=key, code=4, message="too slow")
    assert first.messages == [b"done:" + body], first
    assert first.code == grpc.StatusCode.DEADLINE_EXCEEDED and first.details == "too slow", first
    assert records(shared, envoy.key_prefix) == []
    assert stat(envoy, "released") == 1
    retry = call(envoy, STREAM, body, tenant=tenant, key=key, code=4, message="too slow")
    assert retry.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert executed(shared, "Stream", body) == 2


# --- (c) a non-retryable error is completed and replayed -----------------------------------------


def test_c_not_found_is_completed_and_replayed_with_its_code_and_message(shared, guard):
    envoy = guard(idem_policy())
    tenant, key, body = f"t-{uid()}", f"k-{uid()}", f"order-{uid()}".encode()
    text = "order 42 does not exist (100% gone)"
    first = call(envoy, CREATE, body, tenant=tenant, key=key, code=5, message=text)
    assert first.code == grpc.StatusCode.NOT_FOUND and first.details == text, first
    recs = records(shared, envoy.key_prefix)
    assert len(recs) == 1 and recs[0]["state"] == "COMPLETED", recs
    assert ["grpc-status", "5"] in recs[0]["response"]["trailers"]
    assert stat(envoy, "completed") == 1
    retry = call(envoy, CREATE, body, tenant=tenant, key=key, code=5, message=text)
    assert executed(shared, "Create", body) == 1
    assert retry.code == grpc.StatusCode.NOT_FOUND, retry
    assert retry.details == text
    assert retry.metadata("idempotent-replayed") == "true", retry
    assert stat(envoy, "replayed") == 1


# --- (d, e) the filter's own answers --------------------------------------------------------------


def http_post(envoy: Envoy, path: str, tenant: str | None, key: str | None = None,
              body: bytes = b"x"):
    headers = {"content-type": "application/json"}
    if tenant is not None:
        headers[TENANT] = tenant
    if key is not None:
        headers["idempotency-key"] = key
    return envoy.request("POST", path, headers=headers, body=body)


def test_d_rate_limited_call_gets_resource_exhausted_with_the_detail(shared, guard):
    envoy = guard(*limited_policies())
    tenant = f"t-{uid()}"
    first = call(envoy, LIMITED, b"a", tenant=tenant)
    # Not guarded away: the service answers (it has no such method).
    assert first.code == grpc.StatusCode.UNIMPLEMENTED, first
    second = call(envoy, LIMITED, b"b", tenant=tenant)
    assert second.code == grpc.StatusCode.RESOURCE_EXHAUSTED, second
    assert second.details.startswith('rate limit "tenant" of operation "grpc-limited" exceeded; '
                                     "retry after "), second
    assert int(second.metadata("retry-after")) >= 1
    assert second.metadata("ratelimit") is not None
    # The same over HTTP: the problem+json answer as before.
    assert http_post(envoy, "/limited", tenant).status == 200
    http = http_post(envoy, "/limited", tenant)
    assert http.status == 429
    assert http.headers["content-type"] == "application/problem+json"
    problem = http.json()
    assert is_problem(problem, "rate_limited"), problem
    assert problem["detail"].startswith('rate limit "tenant" of operation "http-limited" exceeded')
    assert problem["violated-policies"] == ["tenant"]


def test_d_in_progress_duplicate_gets_aborted(shared, guard):
    envoy = guard(idem_policy())
    tenant, key, body = f"t-{uid()}", f"k-{uid()}", f"order-{uid()}".encode()
    results = {}
    slow = threading.Thread(target=lambda: results.update(
        first=call(envoy, CREATE, body, tenant=tenant, key=key, delay_ms=1500)))
    slow.start()
    deadline = time.monotonic() + 5
    while executed(shared, "Create", body) == 0 and not records(shared, envoy.key_prefix):
        assert time.monotonic() < deadline, "the first call never took its record"
        time.sleep(0.02)
    dup = call(envoy, CREATE, body, tenant=tenant, key=key)
    slow.join(10)
    assert dup.code == grpc.StatusCode.ABORTED, dup
    assert dup.details == "a request with this Idempotency-Key is still being processed; retry later"
    assert dup.metadata("retry-after") == "1"
    assert results["first"].code == grpc.StatusCode.OK, results
    assert executed(shared, "Create", body) == 1
    # Over HTTP: the 409 problem+json.
    hkey = f"k-{uid()}"
    http_first = {}
    t = threading.Thread(target=lambda: http_first.update(r=envoy.request(
        "POST", "/cg.test.Orders/http", headers={TENANT: tenant, "idempotency-key": hkey,
                                                 "x-upstream-delay-ms": "1500",
                                                 "content-type": "application/json"},
        body=b"{}")))
    t.start()
    time.sleep(0.5)
    http = http_post(envoy, "/cg.test.Orders/http", tenant, hkey, body=b"{}")
    t.join(10)
    assert http.status == 409 and http.headers["content-type"] == "application/problem+json", http
    assert is_problem(http.json(), "idempotency_key_in_use"), http


def test_d_fail_closed_is_unavailable_with_the_detail(shared, guard):
    envoy = guard(idem_policy(), cluster=DEAD_CLUSTER)
    out = call(envoy, CREATE, b"x", tenant=f"t-{uid()}", key=f"k-{uid()}")
    assert out.code == grpc.StatusCode.UNAVAILABLE, out
    assert out.details == "the coordination store cannot decide: its gateway is unreachable; retry shortly"
    assert out.metadata("retry-after") == "1"
    assert executed(shared, "Create", b"x") == 0
    http = http_post(envoy, "/cg.test.Orders/http", f"t-{uid()}", f"k-{uid()}")
    assert http.status == 503 and is_problem(http.json(), "guard_unavailable"), http


def test_d_missing_tenant_is_unauthenticated(shared, guard):
    envoy = guard(idem_policy())
    out = call(envoy, CREATE, b"y", tenant=None, key=f"k-{uid()}")
    assert out.code == grpc.StatusCode.UNAUTHENTICATED, out
    assert out.details == f"this operation requires the {TENANT} header"
    assert out.metadata("www-authenticate") == f'Tenant header="{TENANT}"'
    assert executed(shared, "Create", b"y") == 0
    http = http_post(envoy, "/cg.test.Orders/http", None, f"k-{uid()}")
    assert http.status == 401 and is_problem(http.json(), "missing_tenant"), http
    assert http.json()["detail"] == f"this operation requires the {TENANT} header"
