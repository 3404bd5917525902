"""Upgrades and streams through the guard, end to end: real Envoy running the filter, real
redis-server behind webdis, a real WebSocket service (tests/harness/wsupstream.py: echoes, and
records every session with its open/close times and the fencing token it got) and the counting
upstream's `text/event-stream` answers. Clients are real too: the `websockets` package's client,
and raw HTTP/1.1 for event streams (so the test sees when each event arrives).

What the guards do (README, "Upgrades and streams"):
- a lease taken by an upgrade is held while the session is open, extended at half its TTL, and
  released when the session ends: one session per resource;
- an idempotency record of an upgrade is released when its `101` arrives (a session is not
  replayable), and the `101` goes out at once;
- an event stream is never buffered: its events reach the client as they are produced; once it
  has ended the record is stored by reference; a stream that never ended leaves the outcome
  unknown (`PROCESSING` until `processing_ttl`);
- a response reset mid-body is never stored as completed, whatever its size and phase.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from harness.concurrency import wait_for
from harness.envoy import Envoy
from harness.stack import Stack
from harness.upstream import big_body
from harness.wsupstream import WsUpstream
from harness.problems import is_problem
from test_e2e_idempotency import (TENANT_HEADER, assert_problem, idem_stat, new_key, new_tenant,
                                  policy, post, record_key, stored, uid)
from test_e2e_lease import lease_keys, lease_stats

WS_ROUTES = {"/ws/": "ws", "/live/": "ws"}
KiB = 1024


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Redis, webdis, the upstream and the WebSocket service for the module."""
    workdir = tmp_path_factory.mktemp("streams-e2e")
    stack = Stack(workdir, None, envoys=0).start()
    try:
        stack.ws = WsUpstream(workdir / "ws").start()
    except BaseException:
        stack.stop()
        raise
    yield stack
    stack.ws.stop()
    stack.stop()


@pytest.fixture
def guard(shared, sidecars):
    """`guard(*policies, timeout=...) -> Envoy` with its own key_prefix (`envoy.key_prefix`),
    routing /ws/ and /live/ to the WebSocket service; stopped when the test ends. The Redis
    timeout is the idempotency suite's 500 ms: no test here is about it, and at 100 ms a fresh
    Envoy's first call on a loaded two-core machine once came back as a fail-closed 503."""

    def make(*policies: dict, timeout: str = "500ms") -> Envoy:
        prefix = f"cg:e2e-stream:{uid()}"
        config = {"redis": shared.redis_section(key_prefix=prefix, timeout=timeout),
                  "identity": {"tenant_header": TENANT_HEADER, "principal_header": "x-user-id",
                               "missing_tenant": "reject"},
                  "policies": list(policies)}
        return sidecars(shared, config, prefix, extra_clusters={"ws": shared.ws.port},
                        routes=WS_ROUTES)

    return make


def session_policy(ttl: str = "10s", **lease) -> dict:
    """GET /ws/<room>: one session per tenant and room."""
    block = {"resource": ["tenant", "path_segment:2"], "ttl": ttl, "on_busy": "reject",
             "extend": True}
    block.update(lease)
    return {"name": "session", "match": {"methods": ["GET"], "path_prefix": "/ws/"},
            "lease": block}


def live_policy(**idem) -> dict:
    """GET /live/<x> with an Idempotency-Key (GET among the methods; the body fingerprinted)."""
    p = policy("live", "/live/", methods=["GET"], fingerprint=["method", "path", "body"], **idem)
    p["match"]["methods"] = ["GET"]
    return p


def ws_connect(envoy: Envoy, path: str, tenant: str, headers: dict | None = None,
               open_timeout: float = 5.0):
    from websockets.sync.client import connect

    return connect(f"ws://127.0.0.1:{envoy.port}{path}", proxy=None,
                   additional_headers={TENANT_HEADER: tenant, **(headers or {})},
                   open_timeout=open_timeout, close_timeout=3)


def ws_refused(envoy: Envoy, path: str, tenant: str, headers: dict | None = None) -> tuple[int, dict]:
    """A handshake that must be refused: (status, problem+json body)."""
    from websockets.exceptions import InvalidStatus

    try:
        ws = ws_connect(envoy, path, tenant, headers)
    except InvalidStatus as e:
        return e.response.status_code, json.loads(e.response.body or b"{}")
    ws.close()
    raise AssertionError(f"the handshake on {path} got 101; it should have been refused")


def echo(ws, text: str) -> None:
    ws.send(text)
    assert ws.recv(timeout=5) == text


def lease_owner(shared: Stack, key: str) -> str | None:
    raw = shared.redis.get(key)
    return None if raw is None else raw.decode()


def room_keys(envoy: Envoy, tenant: str, room: str) -> tuple[str, str]:
    return lease_keys(envoy.key_prefix, tenant, [("tenant", tenant), ("path_segment:2", room)],
                      "session")


# --- leases and WebSocket sessions --------------------------------------------------------------


def test_a_second_websocket_session_is_refused_while_the_first_is_open(shared, guard):
    envoy = guard(session_policy())
    tenant, room = new_tenant(), f"room{uid()}"
    path = f"/ws/{room}"
    lkey, fkey = room_keys(envoy, tenant, room)

    first = ws_connect(envoy, path, tenant)
    try:
        echo(first, "one")
        owner = lease_owner(shared, lkey)
        assert owner, "the first session holds no lease"
        status, problem = ws_refused(envoy, path, tenant)
        assert status == 409 and is_problem(problem, "resource_locked"), problem
        echo(first, "still open")  # the first session is untouched by the refusal
        assert lease_owner(shared, lkey) == owner
        assert lease_stats(envoy, "session")["released"] == 0
    finally:
        first.close()
    # Released when the session ends, once.
    assert wait_for(lambda: shared.redis.exists(lkey) == 0, 3.0), lease_owner(shared, lkey)
    assert wait_for(lambda: lease_stats(envoy, "session")["released"] == 1, 3.0), \
        lease_stats(envoy, "session")

    third = ws_connect(envoy, path, tenant)
    try:
        echo(third, "three")
    finally:
        third.close()
    assert wait_for(lambda: lease_stats(envoy, "session")["released"] == 2, 3.0)
    stats = lease_stats(envoy, "session")
    assert (stats["acquired"], stats["busy"], stats["released"], stats["lost"]) == (2, 1, 2, 0), stats

    sessions = shared.ws.sessions_on(path)
    assert len(sessions) == 2, sessions  # the refused one never reached the service
    one, two = sessions
    tokens = [int(s["headers"]["x-fencing-token"]) for s in sessions]
    assert tokens[1] > tokens[0], tokens
    assert one["closed"] is not None and two["opened"] >= one["closed"] - 0.05, sessions


def test_the_lease_is_extended_while_a_session_outlives_its_ttl(shared, guard):
    envoy = guard(session_policy(ttl="1s"))
    tenant, room = new_tenant(), f"room{uid()}"
    path = f"/ws/{room}"
    lkey, _ = room_keys(envoy, tenant, room)

    ws = ws_connect(envoy, path, tenant)
    try:
        owner = lease_owner(shared, lkey)
        assert owner
        opened = time.monotonic()
        while time.monotonic() - opened < 3.0:  # three TTLs
            echo(ws, "tick")
            assert lease_owner(shared, lkey) == owner, "the lease changed hands mid-session"
            time.sleep(0.25)
        status, problem = ws_refused(envoy, path, tenant)
        assert status == 409 and is_problem(problem, "resource_locked"), problem
        assert lease_owner(shared, lkey) == owner
        assert 0 < shared.redis.pttl(lkey) <= 1000
        stats = lease_stats(envoy, "session")
        assert stats["extended"] >= 3 and stats["lost"] == 0 and stats["released"] == 0, stats
    finally:
        ws.close()
    assert wait_for(lambda: lease_stats(envoy, "session")["released"] == 1, 3.0), \
        lease_stats(envoy, "session")
    assert shared.redis.exists(lkey) == 0
    assert len(shared.ws.sessions_on(path)) == 1


def test_a_session_the_service_resets_releases_its_lease(shared, guard):
    envoy = guard(session_policy())
    tenant, room = new_tenant(), f"room{uid()}"
    path = f"/ws/{room}"
    lkey, _ = room_keys(envoy, tenant, room)
    ws = ws_connect(envoy, path, tenant)
    try:
        echo(ws, "hello")
        assert ws_refused(envoy, path, tenant)[0] == 409
        ws.send("close-abruptly")  # the service drops the connection, no close frame
        assert wait_for(lambda: shared.redis.exists(lkey) == 0, 3.0), lease_owner(shared, lkey)
    finally:
        ws.close()
    assert wait_for(lambda: lease_stats(envoy, "session")["released"] == 1, 3.0)
    again = ws_connect(envoy, path, tenant)
    again.close()
    stats = lease_stats(envoy, "session")
    assert (stats["acquired"], stats["busy"], stats["lost"]) == (2, 1, 0), stats


# --- idempotency and upgrades -------------------------------------------------------------------


@pytest.mark.parametrize("complete", ["sync", "async"])
def test_an_idempotent_get_upgrade_gets_its_101_at_once_and_leaves_no_record(shared, guard, complete):
    envoy = guard(live_policy(complete=complete))
    tenant, key, path = new_tenant(), new_key(), f"/live/{uid()}"
    rkey = record_key(envoy.key_prefix, tenant, "live", key)

    start = time.monotonic()
    ws = ws_connect(envoy, path, tenant, {"idempotency-key": key}, open_timeout=5)
    try:
        assert time.monotonic() - start < 3.0
        echo(ws, "ping")
        # Released when the 101 arrived (sync: before it went out).
        if complete == "sync":
            assert shared.redis.exists(rkey) == 0, stored(shared, rkey)
        assert wait_for(lambda: shared.redis.exists(rkey) == 0, 2.0), stored(shared, rkey)
        # A retry with the same key opens a session of its own: a session is not replayed.
        again = ws_connect(envoy, path, tenant, {"idempotency-key": key})
        echo(again, "pong")
        again.close()
    finally:
        ws.close()
    assert wait_for(lambda: idem_stat(envoy, "live", "released") == 2, 2.0)
    stats = {n: idem_stat(envoy, "live", n)
             for n in ("acquired", "released", "completed", "outcome_unknown", "replayed")}
    assert stats == {"acquired": 2, "released": 2, "completed": 0, "outcome_unknown": 0,
                     "replayed": 0}, stats
    assert list(shared.redis.scan_iter(match=envoy.key_prefix + ":idem:*")) == []
    sessions = shared.ws.sessions_on(path)
    assert len(sessions) == 2, sessions
    assert all(s["headers"].get("x-idempotency-fingerprint", "").startswith("sha256:")
               for s in sessions), sessions


# --- event streams ------------------------------------------------------------------------------


def read_events(envoy: Envoy, path: str, headers: dict, *, first_within: float = 3.0,
                keep: float | None = None):
    """POST `path` and read its event stream: (status, headers, events, time the first event
    arrived, whether the stream ended). With `keep`, leave after that many seconds."""
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=first_within)
    conn.request("POST", path, body=b"{}", headers={"content-type": "application/json", **headers})
    resp = conn.getresponse()
    events, first_at, ended = [], None, False
    started = time.monotonic()
    try:
        while keep is None or time.monotonic() - started < keep:
            line = resp.readline()
            if not line:
                ended = True
                break
            if line.startswith(b"data: "):
                events.append(line[6:].strip().decode())
                if first_at is None:
                    first_at = time.time()
    finally:
        conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, events, first_at, ended


@pytest.mark.parametrize("complete", ["sync", "async"])
def test_an_event_stream_flows_as_produced_and_is_stored_by_reference(shared, guard, complete):
    envoy = guard(policy(complete=complete))
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    rkey = record_key(envoy.key_prefix, tenant, "create-order", key)
    status, headers, events, first_at, ended = read_events(envoy, path, {
        TENANT_HEADER: tenant, "idempotency-key": key, "x-upstream-sse-events": "4",
        "x-upstream-sse-interval-ms": "500"})
    assert status == 200 and headers.get("content-type") == "text/event-stream", headers
    assert ended and events == ["0", "1", "2", "3"], events
    served = [r for r in shared.upstream.requests() if r["path"] == path]
    assert len(served) == 1 and served[0]["events_sent"] == 4, served
    # The first event reached the client well before the last one was produced.
    assert first_at is not None and first_at < served[0]["last_event"] - 0.5, \
        (first_at, served[0]["last_event"])

    if complete == "sync":  # written before the end of the stream went out
        assert (stored(shared, rkey) or {}).get("state") == "COMPLETED", stored(shared, rkey)
    assert wait_for(lambda: (stored(shared, rkey) or {}).get("state") == "COMPLETED", 2.0)
    response = stored(shared, rkey)["response"]
    assert response["status"] == 200 and response.get("reference") is True, response
    assert "body" not in response and "body_base64" not in response, response

    retry = post(envoy, path, key, b"{}", tenant=tenant, sse_events=4)
    assert retry.status == 200 and retry.headers.get("idempotent-replayed") == "true", retry
    assert retry.body == b"", retry
    assert shared.upstream.count("POST", path) == 1
    assert (idem_stat(envoy, "create-order", "completed"),
            idem_stat(envoy, "create-order", "outcome_unknown")) == (1, 0)


def feed_policy() -> dict:
    """POST /feed/<room>: an idempotency record and a lease (ttl 1s) on one operation."""
    p = policy("feed", "/feed/", processing_ttl="30s")
    p["lease"] = {"resource": ["tenant", "path_segment:2"], "ttl": "1s", "on_busy": "reject",
                  "extend": True}
    return p


def test_an_endless_event_stream_holds_its_lease_until_the_client_leaves(shared, guard):
    envoy = guard(feed_policy())
    tenant, key, room = new_tenant(), new_key(), f"room{uid()}"
    path = f"/feed/{room}"
    rkey = record_key(envoy.key_prefix, tenant, "feed", key)
    lkey, _ = lease_keys(envoy.key_prefix, tenant, [("tenant", tenant), ("path_segment:2", room)],
                         "feed")
    steer = {TENANT_HEADER: tenant, "idempotency-key": key, "x-upstream-sse-events": "-1",
             "x-upstream-sse-interval-ms": "200"}
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=3)
    try:
        conn.request("POST", path, body=b"{}", headers={"content-type": "application/json", **steer})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("content-type") == "text/event-stream"
        assert resp.readline().startswith(b"data: 0"), "the first event did not arrive"
        owner = lease_owner(shared, lkey)
        assert owner
        time.sleep(1.5)  # past the lease TTL: extended while the stream is open
        other = post(envoy, path, new_key(), b"{}", tenant=tenant)
        assert_problem(other, 409, "resource_locked")
        assert lease_owner(shared, lkey) == owner
        lines = [resp.readline() for _ in range(4)]  # the stream goes on
        assert any(line.startswith(b"data: ") for line in lines), lines
    finally:
        conn.close()  # the client leaves mid-stream
    assert wait_for(lambda: idem_stat(envoy, "feed", "outcome_unknown") == 1, 3.0)
    assert wait_for(lambda: shared.redis.exists(lkey) == 0, 3.0), lease_owner(shared, lkey)
    assert stored(shared, rkey)["state"] == "PROCESSING", stored(shared, rkey)
    assert 0 < shared.redis.pttl(rkey) <= 30_000
    stats = lease_stats(envoy, "feed")
    assert wait_for(lambda: lease_stats(envoy, "feed")["released"] == 1, 2.0), stats
    assert stats["lost"] == 0 and stats["extended"] >= 1, stats
    assert idem_stat(envoy, "feed", "completed") == 0
    # The unknown outcome: a retry with the same key waits for the record (409).
    assert_problem(post(envoy, path, key, b"{}", tenant=tenant), 409, "idempotency_key_in_use")


# --- resets mid-body, in every phase ------------------------------------------------------------


def fetch(envoy: Envoy, path: str, headers: dict) -> tuple[int | None, bytes, Exception | None]:
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=10)
    try:
        conn.request("POST", path, body=b"{}", headers={"content-type": "application/json",
                                                         **headers})
        resp = conn.getresponse()
        try:
            return resp.status, resp.read(), None
        except (http.client.IncompleteRead, ConnectionError) as e:
            return resp.status, getattr(e, "partial", b""), e
    except (ConnectionError, http.client.HTTPException, socket.timeout) as e:
        return None, b"", e
    finally:
        conn.close()


@pytest.mark.parametrize("replay", ["full", "reference"])
@pytest.mark.parametrize("size", ["short", "big"])
@pytest.mark.parametrize("complete", ["sync", "async"])
def test_a_reset_mid_body_is_never_stored_and_releases_the_lease(shared, guard, complete, size,
                                                                 replay):
    p = feed_policy()
    p["idempotency"].update(complete=complete, replay=replay)
    envoy = guard(p)
    tenant, key, room = new_tenant(), new_key(), f"room{uid()}"
    path = f"/feed/{room}"
    rkey = record_key(envoy.key_prefix, tenant, "feed", key)
    lkey, _ = lease_keys(envoy.key_prefix, tenant, [("tenant", tenant), ("path_segment:2", room)],
                         "feed")
    # short: 32 KiB declared (under max_response_body, buffered), 8 KiB sent; big: 2 MiB
    # declared (streams), 256 KiB sent.
    declared, sent = (32 * KiB, 8 * KiB) if size == "short" else (2048 * KiB, 256 * KiB)
    status, body, error = fetch(envoy, path, {
        TENANT_HEADER: tenant, "idempotency-key": key, "x-upstream-status": "201",
        "x-upstream-body-bytes": str(declared), "x-upstream-reset-after-bytes": str(sent)})
    # The client never gets a whole 201: a truncated one, or (when the reset found the
    # headers still held) Envoy's own 502 or 503.
    if status == 201:
        assert error is not None or len(body) < declared, (status, len(body))
        assert body == big_body(len(body))
    else:
        assert status in (None, 502, 503), (status, body[:200])
    assert wait_for(lambda: idem_stat(envoy, "feed", "outcome_unknown") == 1, 3.0), \
        envoy.log_text()[-2000:]
    time.sleep(0.2)  # a (wrong) async completion would have been written by now
    assert stored(shared, rkey)["state"] == "PROCESSING", stored(shared, rkey)
    assert idem_stat(envoy, "feed", "completed") == 0
    assert wait_for(lambda: lease_stats(envoy, "feed")["released"] == 1, 3.0), \
        lease_stats(envoy, "feed")
    assert shared.redis.exists(lkey) == 0
    assert lease_stats(envoy, "feed")["lost"] == 0
    assert_problem(post(envoy, path, key, b"{}", tenant=tenant), 409, "idempotency_key_in_use")
    assert shared.upstream.count("POST", path) == 1
