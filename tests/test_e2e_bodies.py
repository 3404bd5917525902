"""Bodies larger than what the filter stores or Envoy buffers, end to end: real Envoy running the
filter, real redis-server behind webdis, and the counting upstream (which answers with
`x-upstream-body-bytes: N` bytes of text, chunked or not, and can reset mid-body).

The filter never buffers more than it stores: a response over `max_response_body` streams to
the client intact and is stored by reference once its end of stream is seen; a response that
never completes is never stored as completed; a request body over `max_request_body` gets the
filter's own 413 problem+json. `max_request_body` / `max_response_body` must stay below
`envoy_buffer_limit` (Envoy's `per_connection_buffer_limit_bytes`, 1 MiB by default).
"""

from __future__ import annotations

import hashlib
import http.client
import time

import pytest

from harness.concurrency import wait_for
from harness.envoy import Envoy
from harness.stack import Stack
from harness.upstream import big_body
from test_e2e_idempotency import (TENANT_HEADER, assert_problem, idem_stat, new_key, new_tenant,
                                  plugin, policy, post, raw_request, record_key, stored, uid)

MiB = 1 << 20


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Redis, webdis and the upstream for the whole module; Envoys are added per test."""
    stack = Stack(tmp_path_factory.mktemp("bodies-e2e"), None, envoys=0).start()
    yield stack
    stack.stop()


@pytest.fixture
def guard(shared, sidecars):
    """`guard(*policies, timeout=..., buffer_limit=None, **top_level) -> Envoy` with a
    key_prefix of its own (`envoy.key_prefix`); stopped when the test ends."""

    def make(*policies: dict, timeout: str = "500ms", buffer_limit: int | None = None, **top):
        prefix = f"cg:e2e-body:{uid()}"
        config = plugin(shared, prefix, *policies, timeout=timeout)
        config.update(top)
        return sidecars(shared, config, prefix, buffer_limit=buffer_limit)

    return make


def default_sizes(**idem) -> dict:
    """policy() with the filter's default max_request_body / max_response_body."""
    p = policy(**idem)
    for field in ("max_request_body", "max_response_body"):
        if field not in idem:
            p["idempotency"].pop(field)
    return p


def fetch(envoy: Envoy, path: str, headers: dict, body: bytes = b"{}", timeout: float = 10.0,
          method: str = "POST") -> tuple[int, dict, bytes, Exception | None]:
    """One request; (status, headers, body read, the error that cut the body short or None)."""
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        got, error = b"", None
        try:
            got = resp.read()
        except (http.client.IncompleteRead, ConnectionError) as e:
            error = e
            got = getattr(e, "partial", b"")
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, got, error
    finally:
        conn.close()


# --- responses over max_response_body ------------------------------------------------------------


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("complete", ["sync", "async"])
def test_a_2mib_response_streams_intact_and_is_replayed_by_reference(shared, guard, complete, framing):
    # Default max_response_body (64 KiB), Envoy's default buffer limit (1 MiB).
    envoy = guard(default_sizes(complete=complete), timeout="50ms" if complete == "async" else "500ms")
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    steer = {"body_bytes": 2 * MiB, "status": 201, "header_location": "/orders/o-big"}
    if framing == "chunked":
        steer["chunked"] = 1
    first = post(envoy, path, key, tenant=tenant, **steer)
    assert first.status == 201, first
    assert len(first.body) == 2 * MiB and first.body == big_body(2 * MiB), len(first.body)
    assert first.headers.get("location") == "/orders/o-big"
    assert "idempotent-replayed" not in first.headers

    rkey = record_key(envoy.key_prefix, tenant, "create-order", key)
    if complete == "sync":  # written before the client saw the end of the response
        assert (stored(shared, rkey) or {}).get("state") == "COMPLETED", stored(shared, rkey)
    assert wait_for(lambda: (stored(shared, rkey) or {}).get("state") == "COMPLETED", 2.0), \
        stored(shared, rkey)
    response = stored(shared, rkey)["response"]
    assert response["status"] == 201 and response.get("reference") is True, response
    assert "body" not in response and "body_base64" not in response, response
    assert ["location", "/orders/o-big"] in response["headers"], response
    assert ["content-type", "text/plain"] in response["headers"], response

    # By reference: the stored status and replay headers, an empty body (Envoy sends no
    # content-type with an empty local reply).
    retry = post(envoy, path, key, tenant=tenant, status=500)
    assert retry.status == 201 and retry.headers.get("idempotent-replayed") == "true", retry
    assert retry.headers.get("location") == "/orders/o-big"
    assert retry.body == b"" and retry.headers.get("content-length") == "0", retry
    assert "content-type" not in retry.headers, retry
    assert shared.upstream.count("POST", path) == 1
    assert idem_stat(envoy, "create-order", "completed") == 1
    assert idem_stat(envoy, "create-order", "outcome_unknown") == 0


@pytest.mark.parametrize("framing", ["content-length", "chunked-buffering", "chunked-streaming"])
@pytest.mark.parametrize("complete", ["sync", "async"])
def test_a_response_reset_mid_body_is_never_stored_completed(shared, guard, complete, framing):
    envoy = guard(default_sizes(complete=complete, processing_ttl="30s"),
                  timeout="50ms" if complete == "async" else "500ms")
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    # Over max_response_body before the reset (streaming, known from content-length or found
    # out mid-body), or chunked and still under it (the filter is buffering it when the
    # upstream goes away).
    sent = 16 * 1024 if framing == "chunked-buffering" else 256 * 1024
    headers = {TENANT_HEADER: tenant, "content-type": "application/json", "idempotency-key": key,
               "x-upstream-status": "201", "x-upstream-body-bytes": str(2 * MiB),
               "x-upstream-reset-after-bytes": str(sent)}
    if framing.startswith("chunked"):
        headers["x-upstream-chunked"] = "1"
    try:
        status, _, body, error = fetch(envoy, path, headers)
        # The client never gets a whole 2 MiB response.
        assert error is not None or status != 201 or len(body) < 2 * MiB, (status, len(body))
        if framing == "content-length":
            assert status == 201 and body == big_body(len(body)), (status, len(body))
    except (ConnectionError, http.client.HTTPException):
        pass  # reset before the status line reached the client
    assert wait_for(lambda: idem_stat(envoy, "create-order", "outcome_unknown") == 1, 3.0), \
        envoy.log_text()[-2000:]
    time.sleep(0.2)  # a (wrong) async completion would have been written by now
    rkey = record_key(envoy.key_prefix, tenant, "create-order", key)
    assert stored(shared, rkey)["state"] == "PROCESSING", stored(shared, rkey)
    assert idem_stat(envoy, "create-order", "completed") == 0
    # The README's rule for an unknown outcome: the record stays PROCESSING until its TTL.
    assert_problem(post(envoy, path, key, b"{}", tenant=tenant, status=201), 409,
                   "idempotency_key_in_use")
    assert shared.upstream.count("POST", path) == 1
    assert "the response ended before its end of stream" in envoy.log_text()


# --- request bodies over max_request_body --------------------------------------------------------


def test_a_2mib_request_body_gets_the_filters_413_and_leaves_no_record(shared, guard):
    envoy = guard(default_sizes())  # max_request_body: half of Envoy's 1 MiB buffer limit
    tenant, path = new_tenant(), f"/orders/{uid()}"
    big = b'{"blob":"' + b"x" * (2 * MiB - 11) + b'"}'
    assert len(big) == 2 * MiB
    headers = [(TENANT_HEADER, tenant), ("content-type", "application/json")]

    with_length = raw_request(envoy, "POST", path, headers + [("idempotency-key", new_key())], big)
    problem = assert_problem(with_length, 413, "request_body_too_large", "content-length")
    assert "524288 bytes" in problem["detail"], problem
    chunked = raw_request(envoy, "POST", path, headers + [("idempotency-key", new_key())], big,
                          chunked=True)
    # Chunked, 2 MiB: the filter answers when it sees the body pass its limit. Envoy's codec
    # hands the filter what one socket read brought (up to Envoy's 1 MiB buffer limit), and
    # when a single read carries the buffered body past that limit too, Envoy buffers it
    # before the filter sees it and answers its own plain-text 413. Either way a 413, and
    # (below) no record and nothing upstream.
    answered_by_filter = chunked.headers.get("content-type") == "application/problem+json"
    if answered_by_filter:
        assert_problem(chunked, 413, "request_body_too_large", "chunked")
    else:
        assert (chunked.status, chunked.body) == (413, b"Payload Too Large"), chunked
    # Just over the default, chunked: no read can carry it past Envoy's limit, so the filter's
    # limit decides, always.
    over = raw_request(envoy, "POST", path, headers + [("idempotency-key", new_key())],
                       b"y" * (512 * 1024 + 1), chunked=True)
    assert_problem(over, 413, "request_body_too_large", "just over, chunked")

    # The filter counts each body it saw over its limit: Envoy may hand it the 2 MiB body
    # after answering it.
    assert 2 + answered_by_filter <= idem_stat(envoy, "create-order", "body_too_large") <= 3
    assert shared.upstream.count("POST", path) == 0
    assert list(shared.redis.scan_iter(match=envoy.key_prefix + ":*")) == []
    # At the default limit it goes through, chunked too.
    fits = raw_request(envoy, "POST", path, headers + [("idempotency-key", new_key())],
                       b"z" * (512 * 1024), chunked=True)
    assert fits.status == 200, fits
    assert shared.upstream.count("POST", path) == 1


# --- the configuration must fit Envoy's buffer limit ---------------------------------------------


@pytest.mark.parametrize("field,value", [("max_response_body", "1MiB"), ("max_request_body", "2MiB")])
def test_buffers_not_below_envoy_buffer_limit_are_refused_at_load(shared, field, value):
    config = plugin(shared, "cg:e2e-body:refused", policy(**{field: value}))
    code, log = shared.envoy_expect_failure(config)
    assert code is not None and code != 0, log[-3000:]
    size = {"1MiB": MiB, "2MiB": 2 * MiB}[value]
    expected = (f"invalid plugin configuration: policies[0].idempotency.{field}: "
                f"{size} bytes is not below envoy_buffer_limit (1048576 bytes)")
    assert expected in log, log[-3000:]
    assert "per_connection_buffer_limit_bytes" in log

    # Raised together with Envoy's setting, the same value loads.
    raised = dict(config, envoy_buffer_limit="4MiB")
    envoy = shared.add_envoy(raised, buffer_limit=4 * MiB)
    try:
        assert envoy.alive()
    finally:
        envoy.stop()


# --- bodies over 1 MiB where they are allowed ----------------------------------------------------


def test_bodies_over_1mib_pass_with_a_raised_buffer_limit(shared, guard):
    envoy = guard(policy(max_request_body="3MiB"), buffer_limit=4 * MiB, envoy_buffer_limit="4MiB")
    tenant, path = new_tenant(), f"/orders/{uid()}"
    big = b'{"blob":"' + b"q" * (2 * MiB - 11) + b'"}'
    headers = [(TENANT_HEADER, tenant), ("content-type", "application/json")]
    for chunked in (False, True):
        key = new_key()
        r = raw_request(envoy, "POST", path, headers + [("idempotency-key", key),
                                                        ("x-upstream-status", "201")], big,
                        chunked=chunked)
        assert r.status == 201 and "idempotent-replayed" not in r.headers, (chunked, r)
        replay = raw_request(envoy, "POST", path, headers + [("idempotency-key", key)], big,
                             chunked=chunked)
        assert replay.status == 201 and replay.headers.get("idempotent-replayed") == "true", replay
        assert replay.body == r.body
    served = [q for q in shared.upstream.requests() if q["path"] == path]
    assert [q["body_len"] for q in served] == [2 * MiB, 2 * MiB], served
    # 2 MiB back down the same route, stored by reference.
    key = new_key()
    down = post(envoy, path, key, tenant=tenant, body_bytes=2 * MiB, status=201)
    assert down.status == 201 and down.body == big_body(2 * MiB), len(down.body)


def test_bodies_over_1mib_pass_both_ways_where_the_filter_holds_nothing(shared, guard):
    # The guarded POSTs under /orders hold nothing else; a GET there is not idempotent.
    envoy = guard(policy(), {"name": "reads", "match": {"path_prefix": "/catalog"}})
    tenant = new_tenant()
    body = big_body(3 * MiB)
    paths = []
    for method, path in (("GET", f"/orders/{uid()}"), ("PUT", f"/catalog/{uid()}")):
        for chunked in ("0", "1"):
            status, headers, got, error = fetch(envoy, path, {
                TENANT_HEADER: tenant, "content-type": "text/plain",
                "x-upstream-body-bytes": str(3 * MiB), "x-upstream-chunked": chunked}, body,
                method=method)
            assert error is None and status == 200 and got == body, (path, status, len(got), error)
        paths.append(path)
    served = [q for q in shared.upstream.requests() if q["path"] in paths]
    assert [q["body_len"] for q in served] == [3 * MiB] * 4, served
    assert {q["body_sha256"] for q in served} == {hashlib.sha256(body).hexdigest()}
    assert list(shared.redis.scan_iter(match=envoy.key_prefix + ":*")) == []
