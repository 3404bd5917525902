"""Every Lua script runs under the gateway's restricted Redis user (tests/harness/proc.py:
keys `cg:*`, only GATEWAY_COMMANDS), and that command list is exactly what the scripts call.

Scripts run with their caller's permissions in Redis 7: a command or key the ACL lacks fails
the script with a permission error, so each script runs here once as the gateway user, on
every path that reaches a different command.
"""

from __future__ import annotations

import os
import re
import signal
import uuid

import pytest
import redis

from harness.proc import GATEWAY_COMMANDS, RedisServer, gateway_acl_rules
from harness.scripts import LUA, Script, batch_source

TAG = "{t.acl}"
FP = "sha256:" + "a" * 64
RESPONSE = '{"status":201,"headers":[],"body":"ok"}'


def script_commands() -> set[str]:
    """Every command the scripts pass to redis.call / redis.pcall (always a string literal)."""
    found = set()
    for path in LUA.glob("*.lua"):
        text = path.read_text()
        calls = re.findall(r"redis\.p?call\(([^,)]*)", text)
        for first in calls:
            literal = re.fullmatch(r"\s*'([A-Za-z]+)'\s*", first)
            assert literal, f"{path.name}: a command that is not a literal: {first!r}"
            found.add(literal.group(1).lower())
    return found


# Granted beyond the scripts' own commands: what Redis writes to its append-only file for one
# of them and replays as the gateway user (see the last test).
REPLAYED = {"pexpireat"}


def test_gateway_commands_are_exactly_the_scripts_commands():
    assert set(GATEWAY_COMMANDS) == script_commands() | {"eval", "evalsha"} | REPLAYED
    assert gateway_acl_rules("cg:demo") == (
        "~cg:demo:* resetchannels -@all +eval +evalsha +time +get +set +del +exists +type +pttl "
        "+pexpire "
        "+incrby +hmget +hset +zadd +zcount +zrange +zrangebyscore +zremrangebyscore +zrem "
        "+zscore +pexpireat")


def acquire_args(prefix: str, own: str, fence_ttl_ms: int = 600_000):
    """acquire.lua with one limit of every algorithm, an idempotency record and a lease; the
    owner token is the nonce too (the concurrency slot's member)."""
    limits = [("fw", 1, 60_000, 1), ("sw", 1, 60_000, 1), ("sl", 1, 60_000, 1),
              ("tb", 1, 60_000, 1), ("lq", 2, 60_000, 2), ("cc", 1, 60_000, 1)]
    keys = [f"{prefix}:rl:{TAG}:{algo}" for algo, *_ in limits]
    args: list = [len(limits), own]
    for algo, limit, window, burst in limits:
        args += [algo, limit, window, burst, "0", 1]
    keys.append(f"{prefix}:idem:{TAG}:op:k")
    args += ["1", FP, own, 30_000]
    keys += [f"{prefix}:lease:{TAG}:op:r", f"{prefix}:fence:{TAG}:op:r"]
    args += ["1", own, 30_000, fence_ttl_ms]
    return keys, args


def test_every_script_runs_as_the_gateway_user(gateway, redis_client, prefix="cg:scripts-acl"):
    acquire = Script(gateway, "acquire.lua")
    own = uuid.uuid4().hex
    redis_client.config_resetstat()

    # Only the gateway user runs commands until the stats are read.
    keys, args = acquire_args(prefix, own)
    first = acquire(keys, args)
    # Again, by EVALSHA: every limit now rejects (the over-limit paths), nothing is written.
    second = acquire(keys, acquire_args(prefix, uuid.uuid4().hex)[1])
    complete = Script(gateway, "complete.lua")
    completed = complete([keys[6]], [own, FP, 60_000, RESPONSE])
    # A completed record is read back (and decoded) by the next acquire of the same key.
    replay = acquire([keys[6]], [0, "n", "1", FP, uuid.uuid4().hex, 30_000])
    release = Script(gateway, "release.lua")
    idem2, own2 = f"{prefix}:idem:{TAG}:op:k2", uuid.uuid4().hex
    # With the owner's cancellation marker (EXISTS): not cancelled, so it takes the record.
    taken2 = acquire([idem2, f"{prefix}:cancel:{TAG}:op:{own2}"], [0, "n", "1", FP, own2, 30_000])
    released = release([idem2], [own2])
    extended = Script(gateway, "lease_extend.lua")([keys[7]], [own, 45_000])
    lease_released = Script(gateway, "lease_release.lua")([keys[7]], [own])
    # The concurrency slot the first acquire took (member: its nonce, the owner token):
    # extended, then released with the owner's cancellation marker.
    cc_key, cancel = keys[5], f"{prefix}:cancel:{TAG}:op:{own}"
    slot_extended = Script(gateway, "slot_extend.lua")([cc_key], [own, 60_000])
    slot_released = Script(gateway, "slot_release.lua")([cc_key, cancel], [own, 120_000])
    # charge.lua on every algorithm it takes: up on fw and tb, down (to zero) on sw.
    charge = Script(gateway, "charge.lua")
    charged = charge(keys[:2] + [keys[3]], [3, "fw", 1, 60_000, 2, "sw", 1, 60_000, -5,
                                            "tb", 1, 60_000, 1])
    batch = Script(gateway, source=batch_source())
    sub = ["1", "n", "fw", "5", "60000", "5", "0", "1", "0"]
    batch_key = f"{prefix}:rl:{TAG}:batch"
    batched = batch([batch_key, batch_key], ["2", "1", "1", str(len(sub)), *sub, "1", "1", str(len(sub)), *sub])

    stats = redis_client.info("commandstats")
    ran = {name.removeprefix("cmdstat_") for name, s in stats.items() if s["calls"] > 0}
    refused = {name for name, s in stats.items() if s.get("rejected_calls") or s.get("failed_calls")}
    # Every granted command was needed on these paths, and none was refused.
    handshake = {"hello", "auth", "client|setinfo"}  # redis-py's own, on connect
    assert ran - {"config|resetstat", "info"} - handshake == set(GATEWAY_COMMANDS) - REPLAYED
    assert refused == set()
    assert redis_client.acl_log() == []

    assert first[0] == 1 and first[-2] == 1, first  # admitted, lease acquired
    assert redis_client.get(keys[-1]) == first[-1]  # the fencing token
    assert second[0] == 0, second
    assert completed == 1
    assert replay[1] == 3 and b"COMPLETED" in replay[3], replay
    assert (taken2[1], released) == (1, 1) and not redis_client.exists(idem2)
    assert (extended, lease_released) == (1, 1) and not redis_client.exists(keys[7])
    assert (slot_extended, slot_released) == (1, 1) and not redis_client.exists(cc_key)
    assert redis_client.get(cancel) == b"1"
    assert charged == [2, -1, 1] and redis_client.get(keys[0]) == b"3"
    n = int(batched[0])
    assert [int(v) for v in batched[1:4]] == [1, 1, 4] and int(batched[2 + n]) > 0, batched
    assert redis_client.get(batch_key) == b"2"


def test_scripts_refuse_keys_outside_the_prefix(gateway, redis_client):
    keys, args = acquire_args("other", uuid.uuid4().hex)
    with pytest.raises(redis.exceptions.NoPermissionError):
        Script(gateway, "acquire.lua")(keys, args)
    assert redis_client.keys("other:*") == []


def test_a_restart_from_the_append_only_file_keeps_every_ttl(tmp_path):
    """Redis writes what a script did to its append-only file as a transaction (MULTI/EXEC),
    a PEXPIRE as PEXPIREAT, and at start replays the file as the `default` user, which the
    gateway is (webdis 0.1.9 authenticates as no other). Redis 7.0 and 7.2 check every
    command of a replayed EXEC against that user's ACL again (redis/redis#14541): without
    `pexpireat` among its commands, each TTL a script set by PEXPIRE was refused at the
    replay and its key came back without one (found by the chaos run: rate-limit counters
    that never expired after a Redis restart with its data)."""
    server = RedisServer(tmp_path / "redis", persistent=True)
    server.config_lines = ["appendfsync always"]  # every acknowledged write is in the file
    server.start()
    try:
        gateway, admin = server.gateway_client(), server.client()
        own = uuid.uuid4().hex
        keys, args = acquire_args("cg:aof", own)
        first = Script(gateway, "acquire.lua")(keys, args)
        assert first[0] == 1 and first[-2] == 1, first
        # The lease's extension is a PEXPIRE too.
        assert Script(gateway, "lease_extend.lua")([keys[7]], [own, 45_000]) == 1
        before = {k: admin.pttl(k) for k in keys}
        assert all(ttl > 0 for ttl in before.values()), before
        gateway.close()
        admin.close()
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait_exit(10)
        server.stop()
        server.start()
        admin = server.client()
        after = {k: admin.pttl(k) for k in keys}
        admin.close()
        assert all(0 < after[k] <= before[k] for k in keys), (before, after)
        assert after[keys[7]] > 30_000  # the extended lease, not its first 30 s
        assert "NOPERM" not in server.proc.log_text()
    finally:
        server.stop()
