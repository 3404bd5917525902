"""Stored responses sealed at rest (`idempotency.encryption`), end to end: real Envoy running
the filter with record keys in its Wasm VM's environment, real webdis and redis-server, and the
counting upstream. The tests read the records raw with the admin Redis client: what an operator
(or an attacker with a copy of Redis) sees.

One Redis/webdis/upstream stack serves the module; each test starts its own Envoys with a
fresh `key_prefix`, and its own request paths.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os

import pytest

from harness.envoy import Envoy
from harness.stack import Stack
from test_e2e_idempotency import (assert_problem, assert_replay_of, idem_stat, new_key, new_tenant,
                                  plugin, policy, post, record_key, uid, upstream_requests,
                                  wasm_warnings)

KEY_ENV, OLD_ENV = "CG_E2E_RECORD_KEY", "CG_E2E_RECORD_KEY_OLD"
REPLAY_HEADERS = ["content-type", "location", "etag", "x-order-ref"]


def new_record_key(size: int = 32) -> str:
    return base64.b64encode(os.urandom(size)).decode()


KEY_A, KEY_B = new_record_key(), new_record_key()


def kid(key: str) -> str:
    """The documented key id: 16 hex digits of SHA-256("cg.record-key.id" NUL key bytes)."""
    return hashlib.sha256(b"cg.record-key.id\0" + base64.b64decode(key)).hexdigest()[:16]


def encryption(current: str | None, previous: str | None = None) -> tuple[dict, dict]:
    """The `encryption` block and the environment that holds its keys."""
    block, env = {"key_env": KEY_ENV}, {}
    if current is not None:
        env[KEY_ENV] = current
    if previous is not None:
        block["previous_key_env"] = OLD_ENV
        env[OLD_ENV] = previous
    return block, env


def plugin_with(stack: Stack, prefix: str, block: dict | None) -> dict:
    idem = {"replay_headers": REPLAY_HEADERS}
    if block is not None:
        idem["encryption"] = block
    return plugin(stack, prefix, policy(**idem))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("sealed-e2e"), None, envoys=0).start()
    yield stack
    stack.stop()


@pytest.fixture
def guard(shared):
    """`guard(prefix, current, previous=None) -> Envoy` keeping records under `prefix`, its
    record keys passed from Envoy's environment to the VM (`current=None`: no encryption).
    Every Envoy is stopped when the test ends; `envoy.stop()` earlier is a restart's first half."""
    started: list[Envoy] = []

    def make(prefix: str, current: str | None, previous: str | None = None) -> Envoy:
        block, env = encryption(current, previous) if current else (None, {})
        envoy = shared.add_envoy(plugin_with(shared, prefix, block),
                                 vm_env={"host_env_keys": sorted(env)} if env else None,
                                 process_env=env or None)
        started.append(envoy)
        return envoy

    yield make
    for envoy in started:
        envoy.stop()


def sealed_of(stack: Stack, key: str) -> tuple[bytes, dict]:
    raw = stack.redis.get(key)
    assert raw is not None, f"no record at {key}"
    return raw, json.loads(raw)


def order(envoy: Envoy, path: str, key: str, tenant: str, marker: str = "", **upstream):
    """A POST whose response carries `marker` in its body (the upstream echoes the path) and
    in two stored headers."""
    return post(envoy, path, key, tenant=tenant, status=201,
                header_location=f"/orders/{marker or 'o-1'}", header_x_order_ref=marker or "ref",
                **upstream)


# --- (a) nothing readable in Redis, and the replay is the same ---------------------------------


def test_redis_holds_no_plaintext_and_the_replay_is_exact(shared, guard):
    prefix = f"cg:e2e-seal:{uid()}"
    envoy = guard(prefix, KEY_A)
    tenant, key = new_tenant(), new_key()
    body_marker, header_marker = f"BODYMARK{uid()}", f"HDRMARK{uid()}"
    path = f"/orders/{body_marker}"
    first = post(envoy, path, key, tenant=tenant, status=201,
                 header_location=f"/orders/{header_marker}", header_x_order_ref=header_marker,
                 header_etag='"v7"')
    assert first.status == 201, first
    assert body_marker in first.body.decode(), first.body  # the marker is in the response
    assert first.headers["x-order-ref"] == header_marker

    rkey = record_key(prefix, tenant, "create-order", key)
    raw, record = sealed_of(shared, rkey)
    everything = b"".join(shared.redis.get(k) for k in shared.redis.scan_iter(match=prefix + ":*")
                          if shared.redis.type(k) == b"string")
    assert raw in everything
    for marker in (body_marker, header_marker):
        assert marker.encode() not in raw, raw
        assert marker.encode() not in everything
    for clear in (b"location", b"x-order-ref", b"application/json", b'"status"', b"served"):
        assert clear not in raw, (clear, raw)
    # What stays readable: the state machine and the fingerprint.
    fingerprint = upstream_requests(shared, path)[0]["headers"]["x-idempotency-fingerprint"]
    assert (record["state"], record["fingerprint"], record["schema_version"]) == \
        ("COMPLETED", fingerprint, 1)
    assert record["updated_ms"] >= record["created_ms"] > 0
    assert list(record["response"]) == ["sealed"], record
    sealed = record["response"]["sealed"]
    assert sealed["alg"] == "A256GCM" and sealed["kid"] == kid(KEY_A), sealed
    assert len(base64.b64decode(sealed["nonce"], validate=True)) == 12
    assert len(base64.b64decode(sealed["ct"], validate=True)) > len(first.body) + 16

    retry = post(envoy, path, key, tenant=tenant, status=500, header_x_order_ref="other")
    assert_replay_of(retry, first, headers=REPLAY_HEADERS)
    assert shared.upstream.count("POST", path) == 1
    assert {n: idem_stat(envoy, "create-order", n) for n in ("completed", "replayed", "unreadable")} \
        == {"completed": 1, "replayed": 1, "unreadable": 0}

    # Another record: another nonce, the same key id.
    other_key, other_path = new_key(), f"/orders/{uid()}"
    assert order(envoy, other_path, other_key, tenant).status == 201
    _, other = sealed_of(shared, record_key(prefix, tenant, "create-order", other_key))
    assert other["response"]["sealed"]["kid"] == kid(KEY_A)
    assert other["response"]["sealed"]["nonce"] != sealed["nonce"]

    # The configuration shows the variable's name, never the key.
    dump = envoy.admin_get("/config_dump")
    assert KEY_ENV in dump and KEY_A not in dump
    assert KEY_A not in envoy.log_text()


# --- (b) rotation without downtime --------------------------------------------------------------


def test_rotation_replays_old_records_and_seals_new_ones_with_the_new_key(shared, guard):
    prefix = f"cg:e2e-seal:{uid()}"
    tenant = new_tenant()
    old_key, old_path = new_key(), f"/orders/{uid()}"
    before = guard(prefix, KEY_A)
    first = order(before, old_path, old_key, tenant, marker=f"M{uid()}")
    assert first.status == 201
    before.stop()

    rotated = guard(prefix, KEY_B, previous=KEY_A)
    assert_replay_of(order(rotated, old_path, old_key, tenant), first, headers=REPLAY_HEADERS)
    new_key_, new_path = new_key(), f"/orders/{uid()}"
    second = order(rotated, new_path, new_key_, tenant, marker=f"M{uid()}")
    assert second.status == 201 and "idempotent-replayed" not in second.headers
    _, old_record = sealed_of(shared, record_key(prefix, tenant, "create-order", old_key))
    _, new_record = sealed_of(shared, record_key(prefix, tenant, "create-order", new_key_))
    assert old_record["response"]["sealed"]["kid"] == kid(KEY_A), "replays never rewrite"
    assert new_record["response"]["sealed"]["kid"] == kid(KEY_B)
    assert_replay_of(order(rotated, new_path, new_key_, tenant), second, headers=REPLAY_HEADERS)
    assert idem_stat(rotated, "create-order", "replayed") == 2
    rotated.stop()

    # Once the previous key is dropped, its records no longer replay: a conflict until they
    # expire, never a second execution.
    dropped = guard(prefix, KEY_B)
    assert_problem(order(dropped, old_path, old_key, tenant), 422, "idempotency_key_conflict")
    assert_replay_of(order(dropped, new_path, new_key_, tenant), second, headers=REPLAY_HEADERS)
    assert shared.upstream.count("POST", old_path) == 1
    assert shared.upstream.count("POST", new_path) == 1
    stats = {n: idem_stat(dropped, "create-order", n)
             for n in ("unreadable", "sealed_unreadable", "conflict", "replayed")}
    assert stats == {"unreadable": 1, "sealed_unreadable": 1, "conflict": 1, "replayed": 1}
    assert f"sealed with key id {kid(KEY_A)}" in wasm_warnings(dropped), wasm_warnings(dropped)


# --- (c) a record that does not open is refused -------------------------------------------------


def flip_ct_byte(record: dict, at: int = 0) -> str:
    sealed = record["response"]["sealed"]
    ct = bytearray(base64.b64decode(sealed["ct"]))
    ct[at] ^= 0x01
    return json.dumps({**record, "response": {"sealed": {**sealed, "ct": base64.b64encode(ct).decode()}}},
                      separators=(",", ":"))


def test_a_tampered_or_moved_record_is_refused_and_counted(shared, guard):
    prefix = f"cg:e2e-seal:{uid()}"
    envoy = guard(prefix, KEY_A)
    tenant, key, path = new_tenant(), new_key(), f"/orders/{uid()}"
    assert order(envoy, path, key, tenant, marker=f"M{uid()}").status == 201
    rkey = record_key(prefix, tenant, "create-order", key)
    _, record = sealed_of(shared, rkey)
    tampered = flip_ct_byte(record)
    assert shared.redis.set(rkey, tampered, keepttl=True)

    refused = order(envoy, path, key, tenant)
    assert_problem(refused, 422, "idempotency_key_conflict")
    assert shared.redis.get(rkey) == tampered.encode(), "a refused record is left alone"
    assert shared.upstream.count("POST", path) == 1, "never executed again"
    assert "authentication tag does not verify" in wasm_warnings(envoy), wasm_warnings(envoy)

    # A sealed response copied into another record (same request, another key) does not open
    # there: the record's key is part of the additional data.
    genuine = json.dumps(record, separators=(",", ":"))
    moved_key = new_key()
    mkey = record_key(prefix, tenant, "create-order", moved_key)
    shared.redis.set(mkey, genuine, ex=600)
    assert_problem(order(envoy, path, moved_key, tenant), 422, "idempotency_key_conflict")
    assert shared.upstream.count("POST", path) == 1

    stats = {n: idem_stat(envoy, "create-order", n)
             for n in ("unreadable", "sealed_unreadable", "conflict", "replayed")}
    assert stats == {"unreadable": 2, "sealed_unreadable": 2, "conflict": 2, "replayed": 0}
    stats_text = envoy.admin_get("/stats?filter=sealed_unreadable")
    assert "wasmcustom.cg.policy.create-order.idem.sealed_unreadable: 2" in stats_text, stats_text

    # The genuine record, put back where it belongs, still replays.
    shared.redis.set(rkey, genuine, keepttl=True)
    replay = order(envoy, path, key, tenant)
    assert replay.status == 201 and replay.headers.get("idempotent-replayed") == "true", replay


# --- turning encryption on and off ---------------------------------------------------------------


def test_plain_records_replay_after_encryption_is_turned_on_and_sealed_ones_never_without_it(
        shared, guard):
    prefix = f"cg:e2e-seal:{uid()}"
    tenant = new_tenant()
    plain_key, plain_path = new_key(), f"/orders/{uid()}"
    plain_envoy = guard(prefix, None)
    plain = order(plain_envoy, plain_path, plain_key, tenant, marker=f"M{uid()}")
    _, record = sealed_of(shared, record_key(prefix, tenant, "create-order", plain_key))
    assert record["response"]["status"] == 201, "without encryption the response is plain"
    plain_envoy.stop()

    sealing = guard(prefix, KEY_A)
    assert_replay_of(order(sealing, plain_path, plain_key, tenant), plain, headers=REPLAY_HEADERS)
    sealed_key, sealed_path = new_key(), f"/orders/{uid()}"
    assert order(sealing, sealed_path, sealed_key, tenant).status == 201
    sealing.stop()

    # Back without encryption: the sealed record is unreadable, never replayed as garbage.
    unsealing = guard(prefix, None)
    assert_problem(order(unsealing, sealed_path, sealed_key, tenant), 422, "idempotency_key_conflict")
    assert shared.upstream.count("POST", sealed_path) == 1
    assert (idem_stat(unsealing, "create-order", "unreadable"),
            idem_stat(unsealing, "create-order", "sealed_unreadable")) == (1, 1)
    assert "has no idempotency.encryption" in wasm_warnings(unsealing)


# --- (d) a missing or malformed key refuses the configuration -----------------------------------


@pytest.mark.parametrize("case", ["unset", "empty", "short", "long", "not_base64", "previous_short"])
def test_a_missing_or_malformed_key_refuses_the_plugin(shared, case):
    field = "policies[0].idempotency.encryption.key_env"
    current, previous = KEY_A, None
    if case == "unset":
        current, problem = None, f"environment variable {KEY_ENV} is not set in the Wasm VM"
    elif case == "empty":
        current, problem = "", f"environment variable {KEY_ENV} is empty"
    elif case == "short":
        current, problem = new_record_key(16), f"environment variable {KEY_ENV} holds 16 bytes, not 32"
    elif case == "long":
        current, problem = new_record_key(64), f"environment variable {KEY_ENV} holds 64 bytes, not 32"
    elif case == "not_base64":
        current, problem = "not-a-key!", f"environment variable {KEY_ENV} is not base64"
    else:
        field = "policies[0].idempotency.encryption.previous_key_env"
        previous, problem = new_record_key(31), f"environment variable {OLD_ENV} holds 31 bytes, not 32"
    block, env = encryption(current, previous)
    code, log = shared.envoy_expect_failure(
        plugin_with(shared, f"cg:e2e-seal:{uid()}", block),
        vm_env={"host_env_keys": [KEY_ENV] + ([OLD_ENV] if previous else [])},
        process_env=env)
    assert code == 1, log[-3000:]
    assert f"invalid plugin configuration: {field}: {problem}" in log, log[-3000:]
    assert "Unable to create Wasm plugin coordination-guard" in log
    for value in (current, previous):
        if value:
            assert value not in log, "a key value reached the log"
