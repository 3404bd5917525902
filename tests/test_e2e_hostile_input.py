"""Hostile spellings end to end: real Envoy running the filter, real redis-server behind webdis,
and the counting upstream.

A client that spells a guarded path, a selector input or an identity header another way must
not slip past a guard, and a header only the filter may set must never come from the client.
Most Envoys here run without Envoy's own path normalisation (`path_normalization=False`), as an
Istio mesh with the default `pathNormalization` or a hand-written listener may: what is
asserted is what the filter does on its own. The last test runs the shipped listener settings.

Every request that must not run is checked against the upstream's ledger, and nothing may be
left in Redis for it.
"""

from __future__ import annotations

import http.client
import json
import time
import uuid

import pytest

from harness.concurrency import in_thread
from harness.envoy import Envoy, Response
from harness.stack import DEAD_CLUSTER, Stack
from harness.problems import is_problem

TENANT_HEADER = "x-tenant-id"
PRINCIPAL_HEADER = "x-user-id"
FENCING_HEADER = "x-fencing-token"
FINGERPRINT_HEADER = "x-idempotency-fingerprint"
PROBLEM = "application/problem+json"


def uid() -> str:
    return uuid.uuid4().hex[:10]


def policies() -> list[dict]:
    """POST /orders needs a tenant and an Idempotency-Key; POST /lease/<id>/act holds a lease on
    the id; POST /by-query holds a lease on `?id=`; GET /limited is rate limited by a header."""
    return [
        {"name": "orders", "match": {"methods": ["POST"], "path_exact": "/orders"},
         "idempotency": {"required": True, "fingerprint": ["method", "path"]}},
        {"name": "lease", "match": {"methods": ["POST"], "path_prefix": "/lease/"},
         "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "10s", "on_busy": "reject"}},
        {"name": "by-query", "match": {"methods": ["POST"], "path_exact": "/by-query"},
         "lease": {"resource": ["tenant", "query:id"], "ttl": "10s", "on_busy": "reject",
                   "fencing_header": "x-query-token"}},
        {"name": "limited", "match": {"methods": ["GET"], "path_prefix": "/limited"},
         "rate_limits": [{"name": "by-client", "by": ["header:x-client"],
                          "algorithm": "fixed_window", "limit": 1000, "window": "1m"}]},
    ]


def plugin(stack: Stack, key_prefix: str, *, cluster: str | None = None,
           failure_mode: str = "fail_closed", policy_list: list | None = None) -> dict:
    redis = stack.redis_section(key_prefix=key_prefix, timeout="500ms")
    if cluster:
        redis["cluster"] = cluster
    return {"redis": redis, "failure_mode": failure_mode,
            "identity": {"tenant_header": TENANT_HEADER, "principal_header": PRINCIPAL_HEADER,
                         "missing_tenant": "reject"},
            "policies": policy_list if policy_list is not None else policies()}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("hostile"), None, envoys=0).start()
    yield stack
    stack.stop()


@pytest.fixture
def guard(shared, sidecars):
    """`guard(normalise=False, **plugin kwargs) -> Envoy` with a key prefix of its own."""

    def make(normalise: bool = False, **kwargs) -> Envoy:
        prefix = f"cg:hostile:{uid()}"
        return sidecars(shared, plugin(shared, prefix, **kwargs), prefix,
                        path_normalization=normalise)

    return make


def raw(envoy: Envoy, method: str, path: str, headers: list[tuple[str, str]] = (),
        body: bytes = b"", timeout: float = 10.0) -> Response:
    """One request with the path and header lines exactly as given (no client normalisation,
    repeated names kept)."""
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=timeout)
    start = time.monotonic()
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("host", "api.test")
        for name, value in headers:
            conn.putheader(name, value)
        conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return Response(resp.status, dict(resp.getheaders()), resp.read(),
                        time.monotonic() - start)
    finally:
        conn.close()


def ledger_since(stack: Stack, mark: int) -> list[dict]:
    return stack.upstream.requests()[mark:]


def keys(stack: Stack, envoy: Envoy) -> list[str]:
    return sorted(k.decode() for k in stack.redis.scan_iter(match=f"{envoy.key_prefix}:*"))


def problem(resp: Response, status: int, slug: str) -> dict:
    assert resp.status == status, (resp.status, resp.body)
    assert resp.headers.get("content-type") == PROBLEM, resp.headers
    body = json.loads(resp.body)
    assert is_problem(body, slug), body
    assert body["status"] == status, body
    return body


# --- 1. one path, many spellings -------------------------------------------------------------


@pytest.mark.parametrize("path", ["//orders", "/%6Frders", "/%6frders", "/x/../orders",
                                  "/orders//", "/orders/", "/./orders", "/%2E%2E/orders",
                                  "/orders?x=1", "/ord%65rs"])
def test_every_spelling_of_a_guarded_path_is_guarded(shared, guard, path):
    """Each spelling of POST /orders without tenant or key gets the guard's 401, not the
    service: before, policies matched the raw :path and these reached the upstream."""
    envoy = guard()
    mark = len(shared.upstream.requests())
    problem(raw(envoy, "POST", path), 401, "missing_tenant")
    resp = raw(envoy, "POST", path, [(TENANT_HEADER, "acme")])
    problem(resp, 400, "idempotency_key_missing")
    assert ledger_since(shared, mark) == [], "a guarded path reached the service unguarded"


@pytest.mark.parametrize("path", ["/orders%2F", "/x%2F..%2Forders", "/orders%2f",
                                  "/orders;jsessionid=1", "/orders%00", "/orders\\",
                                  "/orders%5C", "/lease/1%zz/act", "/a//../orders",
                                  "/orders%252F", "/lease/1%2F2/act", "/lease/1;v=2/act"])
def test_ambiguous_spellings_of_a_guarded_path_are_refused(shared, guard, path):
    """A path services read more than one way, one of them guarded: 400 problem+json, the
    request never runs and nothing is written to Redis."""
    envoy = guard()
    mark = len(shared.upstream.requests())
    resp = raw(envoy, "POST", path, [(TENANT_HEADER, "acme"), ("idempotency-key", f'"{uid()}"')])
    problem(resp, 400, "ambiguous_path")
    assert ledger_since(shared, mark) == []
    assert keys(shared, envoy) == []
    assert envoy.stat("wasmcustom.cg.policy.orders.ambiguous_input") \
        + envoy.stat("wasmcustom.cg.policy.lease.ambiguous_input") == 1


def test_ambiguous_paths_no_policy_guards_pass_untouched(shared, guard):
    """The filter refuses only what it guards: an odd path elsewhere is the service's."""
    envoy = guard()
    mark = len(shared.upstream.requests())
    for path in ["/other%2Fthing", "/other;x=1", "/static/a%zz"]:
        assert raw(envoy, "GET", path).status == 200, path
    assert [r["path"] for r in ledger_since(shared, mark)] == \
        ["/other%2Fthing", "/other;x=1", "/static/a%zz"]


# --- reserved headers ------------------------------------------------------------------------


def test_reserved_headers_never_reach_the_service_from_the_client(shared, guard):
    """A client-supplied fencing token or fingerprint is removed from every request the filter
    sees, guarded or not: before, an unguarded (or differently spelled) route forwarded
    `x-fencing-token: 9999999999999999999`, and a service comparing tokens then refuses every
    real holder."""
    envoy = guard()
    forged = [(FENCING_HEADER, "9999999999999999999"), ("x-query-token", "9999999999999999999"),
              (FINGERPRINT_HEADER, "sha256:" + "0" * 64), (TENANT_HEADER, "acme")]
    mark = len(shared.upstream.requests())
    assert raw(envoy, "GET", "/unguarded", forged).status == 200
    assert raw(envoy, "GET", "/limited/x", forged + [("x-client", "c1")]).status == 200
    # Every copy of a repeated one, in any spelling of its name (the filter looks a reserved
    # header up before removing it, on a route it does not guard).
    repeated = forged + [("X-Fencing-Token", "1"), ("X-IDEMPOTENCY-FINGERPRINT", "sha256:1")]
    assert raw(envoy, "GET", "/unguarded", repeated).status == 200
    resp = raw(envoy, "POST", f"/lease/{uid()}/act", forged)
    assert resp.status == 200, resp.body
    served = ledger_since(shared, mark)
    assert len(served) == 4
    for entry in served[:3]:
        assert FENCING_HEADER not in entry["headers"], entry
        assert FINGERPRINT_HEADER not in entry["headers"], entry
    # The lease route gets the filter's own token, never the client's.
    token = served[3]["headers"][FENCING_HEADER]
    assert token != "9999999999999999999" and int(token) < 9999999999999999999
    assert FINGERPRINT_HEADER not in served[3]["headers"]


# --- 2. one resource, many names -------------------------------------------------------------


def hold_then_race(envoy: Envoy, first: str, second: str, tenant: str) -> tuple[Response, Response]:
    """`first` holds its lease for ~1.5 s; `second` is sent while it does."""
    slow = in_thread(lambda: raw(envoy, "POST", first, [(TENANT_HEADER, tenant),
                                                          ("x-upstream-delay-ms", "1500")]))
    time.sleep(0.5)
    other = raw(envoy, "POST", second, [(TENANT_HEADER, tenant)])
    return slow(timeout=15), other


@pytest.mark.parametrize("spelling", ["/lease/%31%32%33/act", "/lease//123/act",
                                      "/lease/x/../123/act", "/lease/12%33/act/"])
def test_one_resource_has_one_name_in_the_path(shared, guard, spelling):
    """`/lease/123/act` and `/lease/%31%32%33/act` are one resource: the second waits its turn
    (409 resource_locked). Before, both got 200 and ran at once."""
    envoy = guard()
    first, second = hold_then_race(envoy, "/lease/123/act", spelling, f"t-{uid()}")
    assert first.status == 200, first.body
    problem(second, 409, "resource_locked")


@pytest.mark.parametrize("spelling", ["/by-query?id=%38", "/by-query?i%64=8", "/by-query?id=8&x=1"])
def test_one_resource_has_one_name_in_the_query(shared, guard, spelling):
    envoy = guard()
    first, second = hold_then_race(envoy, "/by-query?id=8", spelling, f"t-{uid()}")
    assert first.status == 200, first.body
    problem(second, 409, "resource_locked")


def test_form_encoded_spaces_name_one_resource(shared, guard):
    """`+` is read as a space, as form decoding does: `a+b` and `a%20b` are one resource."""
    envoy = guard()
    first, second = hold_then_race(envoy, "/by-query?id=a+b", "/by-query?id=a%20b", f"t-{uid()}")
    assert first.status == 200, first.body
    problem(second, 409, "resource_locked")


# --- 2. repeated inputs ----------------------------------------------------------------------


@pytest.mark.parametrize("path,headers,slug,member", [
    ("/by-query?id=1&id=2", [], "ambiguous_selector", "query:id"),
    ("/by-query?id=1&i%64=1", [], "ambiguous_selector", "query:id"),
    ("/lease/7/act", [(PRINCIPAL_HEADER, "alice"), (PRINCIPAL_HEADER, "mallory")],
     "ambiguous_principal", None),
    ("/lease/7/act", [(TENANT_HEADER, "globex")], "ambiguous_tenant", None),
])
def test_repeated_inputs_are_refused(shared, guard, path, headers, slug, member):
    """A repeated query parameter or header a guard reads is ambiguous (a service may read the
    first, another the last): 400, and the request never runs. Before, the first value was used
    silently."""
    envoy = guard()
    mark = len(shared.upstream.requests())
    resp = raw(envoy, "POST", path, [(TENANT_HEADER, "acme"), *headers])
    body = problem(resp, 400, slug)
    if member:
        assert body["selector"] == member, body
    assert ledger_since(shared, mark) == []
    assert keys(shared, envoy) == []


@pytest.mark.parametrize("query", ["id=8;", "id=8;id=9", "x=1;id=9", "id=8;x=1", "id=8&x=1;id=9"])
def test_a_semicolon_that_changes_what_a_selector_reads_is_refused(shared, guard, query):
    """A service that also splits the query on `;` (HTML 4, older frameworks) reads `?id=8;` as
    `id=8`, where the filter reads the value `8;`, another resource (and `?x=1;id=9` has an id
    only there): the same ambiguity as `;` in a path. 400 ambiguous_selector naming the
    selector; the request never runs and nothing is written. Before, the lease was taken on
    `8;` and the request ran."""
    envoy = guard()
    mark = len(shared.upstream.requests())
    resp = raw(envoy, "POST", f"/by-query?{query}", [(TENANT_HEADER, "acme")])
    body = problem(resp, 400, "ambiguous_selector")
    assert body["selector"] == "query:id", body
    assert "';'" in body["detail"], body
    assert ledger_since(shared, mark) == []
    assert keys(shared, envoy) == []
    assert envoy.stat("wasmcustom.cg.policy.by-query.ambiguous_input") == 1


def test_a_semicolon_that_changes_no_selector_passes(shared, guard):
    """`;` elsewhere in the query reads the same `id` either way, and an encoded `%3B` is data
    to every service: guarded as usual."""
    envoy = guard()
    for query in ("x=a;b&id=8", "id=8&x=a;b", "id=8%3B"):
        resp = raw(envoy, "POST", f"/by-query?{query}", [(TENANT_HEADER, "acme")])
        assert resp.status == 200, (query, resp.status, resp.body)
        assert resp.headers.get("content-type") != PROBLEM, query


def test_a_repeated_header_a_rate_limit_reads_is_refused(shared, guard):
    envoy = guard()
    mark = len(shared.upstream.requests())
    resp = raw(envoy, "GET", "/limited/x", [("x-client", "a"), ("x-client", "b"),
                                             (TENANT_HEADER, "acme")])
    assert problem(resp, 400, "ambiguous_selector")["selector"] == "header:x-client"
    assert ledger_since(shared, mark) == []
    assert raw(envoy, "GET", "/limited/x", [("x-client", "a"), (TENANT_HEADER, "acme")]).status == 200


def test_header_bytes_that_are_not_utf8_are_read_not_fatal(shared, guard):
    """Envoy passes header values with bytes that are not UTF-8 (obs-text). The filter reads
    them lossily: the request is guarded as any other, a repeated one is still refused, a
    reserved header so spelled is still removed, and the worker lives on."""
    envoy = guard()
    mark = len(shared.upstream.requests())
    weird = "caf\xe9"  # http.client sends str header values as latin-1: one byte 0xE9
    resp = raw(envoy, "GET", "/limited/x", [("x-client", weird), (TENANT_HEADER, "acme\xff"),
                                             (FINGERPRINT_HEADER, "forged\xe9")])
    assert resp.status == 200, (resp.status, resp.body)
    assert resp.headers.get("ratelimit"), resp.headers
    seen = ledger_since(shared, mark)
    assert len(seen) == 1, seen
    assert FINGERPRINT_HEADER not in {k.lower() for k in seen[0]["headers"]}, seen[0]
    assert len(keys(shared, envoy)) == 1, keys(shared, envoy)
    resp = raw(envoy, "GET", "/limited/x", [("x-client", weird), ("x-client", "caf\xe8"),
                                             (TENANT_HEADER, "acme")])
    assert problem(resp, 400, "ambiguous_selector")["selector"] == "header:x-client"
    assert len(ledger_since(shared, mark)) == 1
    assert raw(envoy, "GET", "/limited/x", [("x-client", "a"), (TENANT_HEADER, "acme")]).status == 200


# --- 7. fail_open forwards no fingerprint ----------------------------------------------------


def test_fail_open_forwards_no_fingerprint(shared, guard):
    """With Redis unreachable and `fail_open`, the request goes on without a record, so it
    must not carry `x-idempotency-fingerprint` (the service would take it as a held record)."""
    envoy = guard(cluster=DEAD_CLUSTER, failure_mode="fail_open",
                  policy_list=[{"name": "orders", "match": {"path_prefix": "/orders"},
                                "idempotency": {"fingerprint": ["method", "path"]}}])
    mark = len(shared.upstream.requests())
    resp = raw(envoy, "POST", "/orders", [(TENANT_HEADER, "acme"),
                                          ("idempotency-key", f'"{uid()}"')])
    assert resp.status == 200, resp.body
    served = ledger_since(shared, mark)
    assert len(served) == 1
    assert FINGERPRINT_HEADER not in served[0]["headers"], served[0]
    assert envoy.stat("wasmcustom.cg.policy.orders.failed_open") == 1


# --- the shipped listener settings ------------------------------------------------------------


def test_shipped_listener_normalises_and_refuses_encoded_slashes(shared, guard):
    """envoy/template.yaml (like envoy/demo.yaml) sets normalize_path, merge_slashes and
    path_with_escaped_slashes_action: REJECT_REQUEST: Envoy refuses an encoded slash itself,
    and the service sees one spelling of every path."""
    envoy = guard(normalise=True)
    mark = len(shared.upstream.requests())
    assert raw(envoy, "POST", "/orders%2Fx", [(TENANT_HEADER, "acme")]).status == 400
    problem(raw(envoy, "POST", "//x/../orders"), 401, "missing_tenant")
    assert raw(envoy, "GET", "//elsewhere/./a").status == 200
    assert [r["path"] for r in ledger_since(shared, mark)] == ["/elsewhere/a"]
