"""Overrides in src/redis/scripts/acquire.lua against a real redis-server: a tenant's or a
principal's own limit, window and burst, stored under its override keys, replace a limit's
arguments for the call that counts it, on every algorithm; an unreadable one is ignored and
counted, never an error; a call without override keys is the call it always was.
"""

from __future__ import annotations

import time
import uuid

import pytest

from harness.scripts import Script, batch_source, limits_argv, register, script_source

SCRIPT = script_source("acquire")
TAG = "{t.ovr}"


class Limit:
    """One limit's six arguments (burst defaults to the limit, as the filter passes it)."""

    def __init__(self, algo: str, limit: int, window_ms: int, burst: int | None = None):
        self.algo, self.limit, self.window_ms = algo, limit, window_ms
        self.burst = burst or limit

    def argv(self, cost: int = 1) -> list:
        return [self.algo, self.limit, self.window_ms, self.burst, "0", cost]


def counter(name: str) -> str:
    return f"cg:rl:{TAG}:op:{name}:{uuid.uuid4().hex[:8]}"


def tenant_key(limit: str = "l") -> str:
    return f"cg:ovr:{TAG}:op:{limit}:t"


def principal_key(limit: str = "l", principal: str = "p1") -> str:
    return f"cg:ovr:{TAG}:op:{limit}:p.{principal}"


class Acquire:
    """acquire.lua with limits and their override keys, no record, no lease."""

    def __init__(self, client):
        self.script = Script(client, source=SCRIPT)

    def args(self, limits, overrides=()):
        """`limits`: (counter key, Limit); `overrides`: (position from 1, [override keys])."""
        keys = [k for k, _ in limits]
        argv = limits_argv([lim for _, lim in limits], nonce=uuid.uuid4().hex) + ["0", "0"]
        if overrides:
            argv.append(len(overrides))
            for position, okeys in overrides:
                argv += [position, len(okeys)]
                keys += okeys
        return keys, argv

    def __call__(self, limits, overrides=()):
        keys, argv = self.args(limits, overrides)
        reply = [int(v) for v in self.script(keys, argv)]
        base = 1 + 4 * len(limits)
        assert len(reply) == base + 4 * len(overrides), reply
        counted = [tuple(reply[i:i + 4]) for i in range(base, len(reply), 4)]
        return reply[:base], counted


@pytest.fixture
def acquire(redis_client) -> Acquire:
    return Acquire(redis_client)


def admitted_in_a_row(acquire, key, lim, okeys, tries):
    """How many of `tries` calls in a row admit, and the last call's counted values."""
    got, counted = 0, None
    for _ in range(tries):
        head, [counted] = acquire([(key, lim)], [(1, okeys)])
        got += head[0]
    return got, counted


# Each algorithm with a configured limit of 5 in a minute (a concurrency limit: 5 slots).
ALGOS = {algo: Limit(algo, 5, 60_000) for algo in ("fw", "sw", "sl", "tb", "cc")}


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("own", [2, 8])
def test_every_algorithm_counts_with_the_tenants_own_limit(acquire, redis_client, algo, own):
    lim = ALGOS[algo]
    redis_client.set(tenant_key(), f"{own}/60000")
    got, counted = admitted_in_a_row(acquire, counter(algo), lim, [tenant_key()], own + 3)
    assert got == own
    assert counted == (1, own, 60_000, 0)


def test_a_leased_quota_cuts_its_slices_from_the_tenants_own_limit(acquire, redis_client):
    lim, key = Limit("lq", 1000, 60_000), counter("lq")
    redis_client.set(tenant_key(), "16/60000")
    slices = []
    for _ in range(40):
        head, [counted] = acquire([(key, lim)], [(1, [tenant_key()])])
        assert counted == (1, 16, 60_000, 0)
        if head[0]:
            slices.append(head[2])  # an admitted lq call's remaining: the slice granted
    assert slices[0] == 2, "an eighth of 16"
    assert sum(slices) == 16, slices
    assert redis_client.get(key) == b"16"


def test_a_token_bucket_takes_the_overrides_burst(acquire, redis_client):
    lim = Limit("tb", 10, 60_000, burst=10)
    redis_client.set(tenant_key(), "6/60000/3")
    got, counted = admitted_in_a_row(acquire, counter("tb"), lim, [tenant_key()], 8)
    assert got == 3
    assert counted == (1, 6, 60_000, 0)


def test_a_principals_override_beats_its_tenants(acquire, redis_client):
    lim, okeys = Limit("fw", 5, 60_000), [principal_key(), tenant_key()]
    redis_client.set(tenant_key(), "3/60000")
    redis_client.set(principal_key(), "7/30000")
    got, counted = admitted_in_a_row(acquire, counter("fw"), lim, okeys, 10)
    assert (got, counted) == (7, (1, 7, 30_000, 0))
    # Another principal of the tenant: the tenant's.
    other = [principal_key(principal="p2"), tenant_key()]
    got, counted = admitted_in_a_row(acquire, counter("fw"), lim, other, 10)
    assert (got, counted) == (3, (1, 3, 60_000, 0))


def test_an_override_that_expires_lapses(acquire, redis_client):
    lim, key = Limit("fw", 5, 60_000), counter("fw")
    redis_client.set(tenant_key(), "1/60000", px=200)
    head, [counted] = acquire([(key, lim)], [(1, [tenant_key()])])
    assert head[0] == 1 and counted == (1, 1, 60_000, 0)
    assert acquire([(key, lim)], [(1, [tenant_key()])])[0][0] == 0
    time.sleep(0.3)
    head, [counted] = acquire([(key, lim)], [(1, [tenant_key()])])
    assert head[0] == 1 and counted == (1, 5, 60_000, 0), "the configuration's again"


def test_a_fixed_windows_new_limit_applies_at_once_its_window_from_the_next(
        acquire, redis_client):
    lim, key = Limit("fw", 2, 60_000), counter("fw")
    for _ in range(2):
        assert acquire([(key, lim)], [(1, [tenant_key()])])[0][0] == 1
    assert acquire([(key, lim)], [(1, [tenant_key()])])[0][0] == 0
    redis_client.set(tenant_key(), "3/1000")
    head, _ = acquire([(key, lim)], [(1, [tenant_key()])])
    assert head[0] == 1, "the raised limit admits in the open window"
    assert redis_client.pttl(key) > 1000, "the open window keeps its end"
    redis_client.delete(key)
    acquire([(key, lim)], [(1, [tenant_key()])])
    assert 0 < redis_client.pttl(key) <= 1000, "the next window is the override's"


UNREADABLE = ["", "abc", "0/1000", "5/0", "5", "5/1000/", "-5/1000", "5.5/1000", "5/1000/2",
              "2000000000/1000", "5/8640000001", " 5/1000", "5/1000\n"]


@pytest.mark.parametrize("value", UNREADABLE)
def test_an_unreadable_override_is_ignored_and_counted(acquire, redis_client, value):
    lim = Limit("fw", 2, 60_000)
    redis_client.set(tenant_key(), value)
    got, counted = admitted_in_a_row(acquire, counter("fw"), lim, [tenant_key()], 4)
    assert (got, counted) == (2, (1, 2, 60_000, 1))


def test_unreadable_values_fall_through_to_the_next(acquire, redis_client):
    lim, okeys = Limit("tb", 10, 1_000), [principal_key(), tenant_key()]
    redis_client.hset(principal_key(), "x", "1")  # not a string
    redis_client.set(tenant_key(), "5/1")  # a token bucket needs window >= limit ms
    head, [counted] = acquire([(counter("tb"), lim)], [(1, okeys)])
    assert head[0] == 1 and counted == (1, 10, 1_000, 2)
    redis_client.set(tenant_key(), "4/1000")
    head, [counted] = acquire([(counter("tb"), lim)], [(1, okeys)])
    assert counted == (1, 4, 1_000, 1)


def test_only_the_listed_limits_read_overrides(acquire, redis_client):
    a, b = Limit("fw", 5, 60_000), Limit("sw", 5, 60_000)
    redis_client.set(tenant_key("b"), "1/60000")
    redis_client.set(tenant_key("a"), "9/60000")  # not listed: never read
    limits = [(counter("a"), a), (counter("b"), b)]
    head, counted = acquire(limits, [(2, [tenant_key("b")])])
    assert head[:2] == [1, 1] and counted == [(2, 1, 60_000, 0)]
    head, counted = acquire(limits, [(2, [tenant_key("b")])])
    assert head[0] == 0 and head[1] == 1 and head[5] == 0, "b rejects, a counted nothing"
    assert redis_client.get(limits[0][0]) == b"1"


def test_overrides_ride_with_the_record_lease_and_marker(redis_client):
    """The override keys sit after the lease's keys and before the owner's marker."""
    acquire = Script(redis_client, source=SCRIPT)
    own = uuid.uuid4().hex
    redis_client.set(tenant_key(), "1/60000")
    key = counter("fw")
    keys = [key, f"cg:idem:{TAG}:op:k", f"cg:lease:{TAG}:op:r", f"cg:fence:{TAG}:op:r",
            tenant_key(), f"cg:cancel:{TAG}:op:{own}"]
    args = ["1", own, "fw", "5", "60000", "5", "0", "1",
            "1", "sha256:" + "a" * 64, own, "30000", "1", own, "30000", "60000", "1", "1", "1"]
    reply = acquire(keys, args)
    assert [int(v) for v in reply[:5]] == [1, 1, 0, 60000, 0]
    assert int(reply[5]) == 1 and int(reply[8]) == 1  # record and lease acquired
    assert [int(v) for v in reply[10:]] == [1, 1, 60000, 0]
    # Marked cancelled: the marker is found where it is, last.
    redis_client.set(keys[-1], "1")
    keys[1], keys[2], keys[3] = f"cg:idem:{TAG}:op:k2", f"cg:lease:{TAG}:op:r2", f"cg:fence:{TAG}:op:r2"
    redis_client.delete(key)
    reply = acquire(keys, args)
    assert int(reply[5]) == 6 and int(reply[8]) == 3, reply


def test_bad_override_arguments_are_script_errors(acquire, redis_client):
    import redis
    lim, key = Limit("fw", 5, 60_000), counter("fw")
    base_keys, base = acquire.args([(key, lim)])
    for extra, okeys in [([1, 2, 1], [tenant_key()]),       # past the limits
                         ([1, 1, 3], [tenant_key()] * 3),    # 3 keys
                         ([1, 1, 2], [tenant_key()]),        # a key short
                         ([0], []),                          # none listed
                         ([2, 1, 1, 1, 1], [tenant_key()] * 2)]:  # positions must increase
        with pytest.raises(redis.exceptions.ResponseError, match="acquire.lua"):
            acquire.script(base_keys + okeys, base + extra)
    assert redis_client.get(key) is None, "nothing was counted"


def test_the_exact_paths_call_takes_the_fast_path_with_or_without_override_keys(
        acquire, redis_client):
    """The exact path's usual call is what it was: the fast path's INCRBY and PEXPIRE, no GET;
    with override keys it reads them (one GET each) and takes the same fast path."""
    lim = Limit("fw", 5, 60_000)

    def commands(limits, overrides=()):
        redis_client.config_resetstat()
        acquire(limits, overrides)
        stats = redis_client.info("commandstats")
        return {name.removeprefix("cmdstat_"): s["calls"] for name, s in stats.items()
                if name not in ("cmdstat_config|resetstat", "cmdstat_evalsha", "cmdstat_eval")}

    keys, argv = acquire.args([(counter("fw"), lim)])
    assert argv[-2:] == ["0", "0"] and len(argv) == 10, "the lease flag is the last argument"
    assert commands([(counter("fw"), lim)]) == {"incrby": 1, "pexpire": 1}
    with_keys = commands([(counter("fw"), lim)], [(1, [principal_key(), tenant_key()])])
    assert with_keys == {"get": 2, "incrby": 1, "pexpire": 1}, with_keys
    # A principal's readable override spares reading the tenant's.
    redis_client.set(principal_key(), "3/60000")
    with_keys = commands([(counter("fw"), lim)], [(1, [principal_key(), tenant_key()])])
    assert with_keys == {"get": 1, "incrby": 1, "pexpire": 1}, with_keys


def test_batched_acquires_read_their_overrides(redis_client):
    batch = register(redis_client, batch_source())
    redis_client.set(tenant_key(), "1/60000")
    a = Acquire(redis_client)
    k1, a1 = a.args([(counter("fw"), Limit("fw", 5, 60_000))], [(1, [tenant_key()])])
    k2, a2 = a.args([(counter("fw"), Limit("fw", 5, 60_000))])
    keys, args = k1 + k1 + k2, ["3"]
    for k, argv in [(k1, a1), (k1, a1), (k2, a2)]:
        args += ["1", len(k), len(argv), *argv]
    reply = [int(v) for v in batch(keys=keys, args=args)]
    assert reply[:10] == [9, 1, 1, 0, 60000, 0, 1, 1, 60000, 0]
    assert reply[10:20] == [9, 0, 0, 0, reply[14], reply[14], 1, 1, 60000, 0]
    assert reply[20:26] == [5, 1, 1, 4, 60000, 0]


def test_the_gateway_user_may_read_overrides(gateway, redis_client):
    """Overrides add no command to the gateway's ACL: GET is the record's already."""
    redis_client.set(tenant_key(), "1/60000")
    a = Acquire(gateway)
    head, [counted] = a([(counter("fw"), Limit("fw", 5, 60_000))], [(1, [tenant_key()])])
    assert head[0] == 1 and counted == (1, 1, 60_000, 0)


def test_peek_reads_the_overrides_and_writes_nothing(acquire, redis_client):
    # The peek script (acquire.lua with PEEK true, what cg-admin limits runs) reads the
    # override keys as acquire does, so it answers with the caller's own quota; it writes
    # nothing, so an override of a window only shows, never starts one.
    lim, key = Limit("fw", 2, 60_000), counter("fw")
    redis_client.set(tenant_key(), "5/30000")
    peek = Script(redis_client, source=script_source("peek"))
    keys, argv = acquire.args([(key, lim)], [(1, [tenant_key()])])
    reply = [int(v) for v in peek(keys, argv)]
    assert reply[:5] == [1, 1, 5, 30_000, 0] and reply[5:] == [1, 5, 30_000, 0], reply
    assert redis_client.exists(key) == 0
    for _ in range(3):
        acquire([(key, lim)], [(1, [tenant_key()])])
    reply = [int(v) for v in peek(keys, argv)]
    assert reply[:3] == [1, 1, 2] and reply[5:] == [1, 5, 30_000, 0], reply
    # An unreadable override is ignored and counted as unreadable under PEEK too: the
    # configuration's 2 are used up.
    redis_client.set(tenant_key(), "five")
    reply = [int(v) for v in peek(keys, argv)]
    assert reply[:3] == [0, 0, 0] and reply[5:] == [1, 2, 60_000, 1], reply
