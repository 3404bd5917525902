"""The lease section of src/redis/scripts/acquire.lua and src/redis/scripts/lease_{release,extend}.lua against a
real redis-server: owner checks, fencing tokens, expiry, the combined rate-limit + idempotency
+ lease call, arguments and TTLs.

    absent --acquire(owner)--> held(owner), fencing token issued
    held(owner) --release(owner)--> absent
    held(owner) --extend(owner)---> held(owner), PTTL = lease_ttl_ms
    held(owner) --lease expires---> absent (owner's release/extend: MISSING, or NOT_OWNER once
                                    another owner holds it)

Times are checked against Redis TIME read around the call, never the local clock.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import pytest

from harness.scripts import Limit, limits_argv, owner, register, script_source
import redis


SKIPPED, ACQUIRED, BUSY = 0, 1, 2  # acquire.lua, lease section
RELEASED = EXTENDED = 1  # lease_release.lua / lease_extend.lua
MISSING, NOT_OWNER = 0, -1
IDEM_SKIPPED, IDEM_ACQUIRED, IN_PROGRESS, COMPLETED, CONFLICT, UNREADABLE = range(6)

LEASE = "lease:{t1}:op:k1"
FENCE = "fence:{t1}:op:k1"
IDEM = "idem:{t1}:op:k1"
LEASE_TTL = 30_000
FENCE_TTL = 600_000
PROCESSING_TTL = 30_000
FP = "sha256:" + "a" * 64
FP2 = "sha256:" + "b" * 64


LIMITS = [("{t1}:rl:fw", Limit("fw", 3, 60_000)), ("{t1}:rl:sl", Limit("sl", 3, 60_000))]


@dataclass(frozen=True)
class Idem:
    own: str
    fp: str = FP
    ttl_ms: int = PROCESSING_TTL
    key: str = IDEM


@dataclass(frozen=True)
class Got:
    admitted: bool
    verdicts: list
    idem: tuple | None  # (code, pttl_ms, record) iff the idempotency section was on
    code: int
    value: int


def lease_argv(own: str, ttl_ms=LEASE_TTL, fence_ttl_ms=FENCE_TTL) -> list:
    return ["1", own, ttl_ms, fence_ttl_ms]


class Scripts:
    def __init__(self, client):
        self.r = client
        # redis-py's Script: EVALSHA, falling back to EVAL on NOSCRIPT.
        self._acquire = register(client, script_source("acquire"))
        self._release = register(client, script_source("lease_release"))
        self._extend = register(client, script_source("lease_extend"))

    def acquire(self, own: str | None = None, ttl_ms: int = LEASE_TTL,
                fence_ttl_ms: int = FENCE_TTL, lease: str = LEASE, fence: str = FENCE,
                limits: list = (), idem: Idem | None = None, cost: int = 1) -> Got:
        n = len(limits)
        keys = [k for k, _ in limits]
        argv = limits_argv([lim for _, lim in limits], cost)
        if idem:
            keys.append(idem.key)
            argv += ["1", idem.fp, idem.own, idem.ttl_ms]
        else:
            argv.append("0")
        keys += [lease, fence]
        argv += lease_argv(own or owner(), ttl_ms, fence_ttl_ms)
        reply = self._acquire(keys=keys, args=argv)
        return parse(reply, n, idem is not None)

    def release(self, own: str, lease: str = LEASE) -> int:
        return self._release(keys=[lease], args=[own])

    def extend(self, own: str, ttl_ms: int = LEASE_TTL, lease: str = LEASE) -> int:
        return self._extend(keys=[lease], args=[own, ttl_ms])


def parse(reply: list, n: int, idem: bool) -> Got:
    """acquire.lua's reply with the lease section on; checks its shape (no nil anywhere)."""
    assert len(reply) == 1 + 4 * n + (3 if idem else 0) + 2, reply
    assert None not in reply, reply
    ints = reply[:-3] + reply[-2:-1] if idem else reply[:-1]  # all but the record and value
    assert all(isinstance(v, int) for v in ints), reply
    code, value = reply[-2:]
    assert code in (SKIPPED, ACQUIRED, BUSY), reply
    if code == ACQUIRED:
        # The token travels as a decimal string: webdis crashes on integers of more than
        # 10 digits inside an array reply.
        assert isinstance(value, bytes) and value.isdigit(), reply
        value = int(value)
    else:
        assert isinstance(value, int), reply
    if code == SKIPPED:
        assert value == 0, reply
    else:
        assert value >= 1, reply
    idem_part = tuple(reply[-5:-2]) if idem else None
    verdicts = [tuple(reply[1 + 4 * i: 5 + 4 * i]) for i in range(n)]
    return Got(bool(reply[0]), verdicts, idem_part, code, value)


@pytest.fixture
def s(redis_client) -> Scripts:
    return Scripts(redis_client)


def redis_us(r) -> int:
    sec, usec = r.time()
    return sec * 1_000_000 + usec


def snapshot(r, key: str):
    """The value under `key` and whether it has a TTL, to show a script left it alone."""
    kind = r.type(key).decode()
    value = {"none": lambda: None, "string": lambda: r.get(key),
             "hash": lambda: r.hgetall(key)}[kind]()
    pttl = r.pttl(key)
    return kind, value, pttl if pttl < 0 else "ttl"


def fence_value(r) -> int | None:
    v = r.get(FENCE)
    return None if v is None else int(v)


def assert_every_key_has_ttl(r) -> None:
    for key in r.keys("*"):
        assert r.pttl(key) > 0, key


def consumed(r) -> tuple[int, int]:
    return int(r.get("{t1}:rl:fw") or 0), r.zcard("{t1}:rl:sl")


# --- acquire -----------------------------------------------------------------------------


def test_acquire_free_lease(s, redis_client):
    a = owner()
    before = redis_us(redis_client)
    got = s.acquire(a)
    after = redis_us(redis_client)

    assert got.admitted and got.code == ACQUIRED and got.idem is None
    assert before <= got.value <= after  # no fence yet: the token is Redis TIME in µs
    assert redis_client.get(LEASE) == a.encode()
    assert 0 < redis_client.pttl(LEASE) <= LEASE_TTL
    assert fence_value(redis_client) == got.value
    assert redis_client.get(FENCE) == str(got.value).encode()  # an integer, no exponent
    assert 0 < redis_client.pttl(FENCE) <= FENCE_TTL
    assert sorted(redis_client.keys("*")) == sorted([FENCE.encode(), LEASE.encode()])


def test_second_owner_is_busy_and_changes_nothing(s, redis_client):
    a = owner()
    first = s.acquire(a, ttl_ms=5_000, fence_ttl_ms=5_000)
    assert first.code == ACQUIRED
    lease_before, fence_before = snapshot(redis_client, LEASE), snapshot(redis_client, FENCE)
    time.sleep(0.05)

    other = s.acquire(owner(), ttl_ms=LEASE_TTL, fence_ttl_ms=FENCE_TTL)
    assert other.code == BUSY and 1 <= other.value <= 5_000 - 40  # the lease's own PTTL
    same = s.acquire(a)  # no re-entrancy
    assert same.code == BUSY and 1 <= same.value <= 5_000 - 40

    assert snapshot(redis_client, LEASE) == lease_before
    assert snapshot(redis_client, FENCE) == fence_before
    assert redis_client.pttl(LEASE) <= other.value  # not extended
    assert redis_client.pttl(FENCE) <= 5_000 - 40  # not refreshed
    assert fence_value(redis_client) == first.value


def test_busy_lease_without_ttl_reports_1_and_is_not_repaired(s, redis_client):
    redis_client.set(LEASE, owner())
    got = s.acquire()
    assert got.code == BUSY and got.value == 1
    assert redis_client.pttl(LEASE) == -1
    assert redis_client.exists(FENCE) == 0


def test_busy_when_the_lease_key_holds_another_type(s, redis_client):
    redis_client.hset(LEASE, mapping={"owner": "x"})
    redis_client.pexpire(LEASE, 5_000)
    got = s.acquire()
    assert got.code == BUSY and 1 <= got.value <= 5_000
    assert redis_client.type(LEASE) == b"hash" and redis_client.exists(FENCE) == 0


def test_tokens_strictly_increase_across_acquisitions_and_a_lost_fence(s, redis_client):
    tokens = []
    for _ in range(20):
        a = owner()
        got = s.acquire(a)
        assert got.code == ACQUIRED
        tokens.append(got.value)
        assert fence_value(redis_client) == got.value
        assert s.release(a) == RELEASED
    assert all(x < y for x, y in zip(tokens, tokens[1:])), tokens

    redis_client.delete(FENCE)  # expired or evicted
    before = redis_us(redis_client)
    got = s.acquire()
    after = redis_us(redis_client)
    assert got.code == ACQUIRED and got.value > max(tokens)
    assert before <= got.value <= after
    assert fence_value(redis_client) == got.value


def test_token_is_stored_plus_one_when_the_fence_is_ahead_of_the_clock(s, redis_client):
    ahead = redis_us(redis_client) + 3_600_000_000  # one hour ahead (e.g. a clock step back)
    redis_client.set(FENCE, ahead, px=1_000)
    a = owner()
    assert s.acquire(a).value == ahead + 1
    assert 1_000 < redis_client.pttl(FENCE) <= FENCE_TTL  # refreshed to fence_ttl_ms
    assert s.release(a) == RELEASED
    assert s.acquire().value == ahead + 2
    assert redis_client.get(FENCE) == str(ahead + 2).encode()


@pytest.mark.parametrize("value", ["garbage", "-5", "1.5", "1e300", "9007199254740993", None],
                         ids=["garbage", "negative", "fraction", "huge", "2^53+1", "hash"])
def test_unreadable_fence_counts_as_lost(s, redis_client, value):
    if value is None:
        redis_client.hset(FENCE, mapping={"token": 1})
    else:
        redis_client.set(FENCE, value)
    before = redis_us(redis_client)
    got = s.acquire()
    after = redis_us(redis_client)
    assert got.code == ACQUIRED and before <= got.value <= after
    assert redis_client.get(FENCE) == str(got.value).encode()
    assert 0 < redis_client.pttl(FENCE) <= FENCE_TTL


def test_expired_lease_goes_to_the_next_owner_with_a_larger_token(s, redis_client):
    a, b = owner(), owner()
    first = s.acquire(a, ttl_ms=150)
    assert first.code == ACQUIRED
    time.sleep(0.2)
    assert redis_client.exists(LEASE) == 0

    second = s.acquire(b, ttl_ms=5_000)
    assert second.code == ACQUIRED and second.value > first.value
    time.sleep(0.03)
    b_lease = snapshot(redis_client, LEASE)
    pttl = redis_client.pttl(LEASE)

    assert s.release(a) == NOT_OWNER
    assert s.extend(a, ttl_ms=60_000) == NOT_OWNER
    assert snapshot(redis_client, LEASE) == b_lease
    assert redis_client.get(LEASE) == b.encode()
    assert redis_client.pttl(LEASE) <= pttl  # not extended by the stale owner
    assert fence_value(redis_client) == second.value


def test_expired_lease_release_and_extend_are_missing(s, redis_client):
    a = owner()
    s.acquire(a, ttl_ms=100)
    time.sleep(0.15)
    assert s.extend(a) == MISSING
    assert s.release(a) == MISSING
    assert redis_client.exists(LEASE) == 0  # extend did not revive it


# --- release -----------------------------------------------------------------------------


def test_release_by_owner_deletes_and_frees_the_lease(s, redis_client):
    a = owner()
    first = s.acquire(a)
    assert s.release(a) == RELEASED
    assert redis_client.exists(LEASE) == 0
    assert fence_value(redis_client) == first.value  # the fence stays
    again = s.acquire()
    assert again.code == ACQUIRED and again.value > first.value


def test_release_by_another_owner_is_refused(s, redis_client):
    a = owner()
    s.acquire(a)
    before = snapshot(redis_client, LEASE), snapshot(redis_client, FENCE)
    assert s.release(owner()) == NOT_OWNER
    assert (snapshot(redis_client, LEASE), snapshot(redis_client, FENCE)) == before


def test_release_missing(s, redis_client):
    assert s.release(owner()) == MISSING
    assert redis_client.keys("*") == []


# --- extend ------------------------------------------------------------------------------


def test_extend_by_owner_resets_the_pttl(s, redis_client):
    a = owner()
    s.acquire(a, ttl_ms=1_000)
    fence = snapshot(redis_client, FENCE)
    time.sleep(0.3)
    assert redis_client.pttl(LEASE) < 750

    assert s.extend(a, ttl_ms=1_000) == EXTENDED
    assert 950 < redis_client.pttl(LEASE) <= 1_000
    assert redis_client.get(LEASE) == a.encode()
    assert snapshot(redis_client, FENCE) == fence

    assert s.extend(a, ttl_ms=200) == EXTENDED  # the new TTL also when it is shorter
    assert 0 < redis_client.pttl(LEASE) <= 200


def test_extend_by_another_owner_is_refused(s, redis_client):
    a = owner()
    s.acquire(a, ttl_ms=1_000)
    time.sleep(0.05)
    pttl = redis_client.pttl(LEASE)
    assert s.extend(owner(), ttl_ms=60_000) == NOT_OWNER
    assert redis_client.get(LEASE) == a.encode() and redis_client.pttl(LEASE) <= pttl


def test_extend_missing_creates_nothing(s, redis_client):
    assert s.extend(owner()) == MISSING
    assert redis_client.keys("*") == []


def test_release_and_extend_leave_other_types_alone(s, redis_client):
    redis_client.hset(LEASE, mapping={"owner": "x"})
    redis_client.pexpire(LEASE, 5_000)
    before = snapshot(redis_client, LEASE)
    assert s.release("x") == NOT_OWNER
    assert s.extend("x", ttl_ms=60_000) == NOT_OWNER
    assert snapshot(redis_client, LEASE) == before and redis_client.pttl(LEASE) <= 5_000


@pytest.mark.parametrize("args", [[], [""], ["o", 0], ["o", "soon"], ["o"], ["o", 1.5]],
                         ids=["owner-missing", "owner-empty", "ttl-zero", "ttl-nan",
                              "ttl-missing", "ttl-fraction"])
def test_extend_bad_arguments_fail_and_leave_the_lease(s, redis_client, args):
    redis_client.set(LEASE, "o", px=1_000)
    with pytest.raises(redis.ResponseError, match="lease_extend.lua: "):
        s._extend(keys=[LEASE], args=args)
    assert redis_client.get(LEASE) == b"o" and redis_client.pttl(LEASE) <= 1_000


@pytest.mark.parametrize("args,keys", [([], [LEASE]), ([""], [LEASE]), (["o"], [])],
                         ids=["owner-missing", "owner-empty", "key-missing"])
def test_release_bad_arguments_fail_and_leave_the_lease(s, redis_client, args, keys):
    redis_client.set(LEASE, "o", px=1_000)
    with pytest.raises(redis.ResponseError, match="lease_release.lua: "):
        s._release(keys=keys, args=args)
    assert redis_client.get(LEASE) == b"o"


# --- rate limits, idempotency and lease in one call --------------------------------------


def test_rejected_by_a_limit_skips_idempotency_and_lease(s, redis_client):
    redis_client.set("{t1}:rl:full", 1, px=60_000)
    limits = LIMITS + [("{t1}:rl:full", Limit("fw", 1, 60_000))]
    got = s.acquire(limits=limits, idem=Idem(owner()))
    assert not got.admitted and [v[0] for v in got.verdicts] == [1, 1, 0]
    assert got.idem == (IDEM_SKIPPED, -2, b"")
    assert (got.code, got.value) == (SKIPPED, 0)
    assert redis_client.keys("*") == [b"{t1}:rl:full"]
    assert redis_client.get("{t1}:rl:full") == b"1"


def test_rejected_by_a_limit_without_idempotency_skips_the_lease(s, redis_client):
    redis_client.set("{t1}:rl:full", 1, px=60_000)
    got = s.acquire(limits=[("{t1}:rl:full", Limit("fw", 1, 60_000))])
    assert not got.admitted and (got.code, got.value) == (SKIPPED, 0)
    assert redis_client.keys("*") == [b"{t1}:rl:full"]


def processing(own: str, fp: str = FP) -> str:
    return (f'{{"schema_version":1,"state":"PROCESSING","fingerprint":"{fp}","owner":"{own}",'
            f'"created_ms":1700000000123,"updated_ms":1700000000123}}')


COMPLETED_RECORD = (f'{{"schema_version":1,"state":"COMPLETED","fingerprint":"{FP}",'
                    f'"created_ms":1700000000123,"updated_ms":1700000000456,'
                    f'"response":{{"status":201,"headers":[],"body":""}}}}')
PREPARED = {
    "in-progress": (processing(owner()), IN_PROGRESS),
    "completed": (COMPLETED_RECORD, COMPLETED),
    "conflict": (processing(owner(), fp=FP2), CONFLICT),
    "unreadable": ("garbage", UNREADABLE),
}


@pytest.mark.parametrize("record,idem_code", PREPARED.values(), ids=PREPARED.keys())
@pytest.mark.parametrize("fence", [True, False], ids=["fence", "no-fence"])
def test_idempotency_not_acquired_takes_no_lease(s, redis_client, record, idem_code, fence):
    redis_client.set(IDEM, record, px=60_000)
    if fence:
        redis_client.set(FENCE, 1_234, px=5_000)
    fence_before = snapshot(redis_client, FENCE)
    record_before = snapshot(redis_client, IDEM)

    got = s.acquire(limits=LIMITS, idem=Idem(owner()))
    assert got.admitted and got.idem[0] == idem_code
    assert (got.code, got.value) == (SKIPPED, 0)
    assert redis_client.exists(LEASE) == 0
    assert snapshot(redis_client, FENCE) == fence_before
    assert not fence or redis_client.pttl(FENCE) <= 5_000  # not refreshed
    assert snapshot(redis_client, IDEM) == record_before
    assert consumed(redis_client) == (1, 1)  # duplicates still consume rate limits


def test_idempotency_acquired_takes_the_lease_in_the_same_call(s, redis_client):
    a, la = owner(), owner()
    before = redis_us(redis_client)
    got = s.acquire(la, limits=LIMITS, idem=Idem(a), cost=2)
    after = redis_us(redis_client)
    assert got.admitted and [v[:2] for v in got.verdicts] == [(1, 1), (1, 1)]
    code, pttl, record = got.idem
    assert code == IDEM_ACQUIRED and 0 < pttl <= PROCESSING_TTL and record == b""
    assert got.code == ACQUIRED and before <= got.value <= after
    assert json.loads(redis_client.get(IDEM))["owner"] == a
    assert redis_client.get(LEASE) == la.encode()
    assert fence_value(redis_client) == got.value
    assert consumed(redis_client) == (2, 2)

    # a duplicate of the same request: in progress, no lease, nothing new written
    dup = s.acquire(la, limits=LIMITS, idem=Idem(owner()))
    assert dup.idem[0] == IN_PROGRESS and (dup.code, dup.value) == (SKIPPED, 0)
    assert fence_value(redis_client) == got.value


def test_idempotency_acquired_but_lease_busy(s, redis_client):
    holder = owner()
    s.acquire(holder, lease=LEASE, ttl_ms=5_000)
    got = s.acquire(idem=Idem(owner()))
    assert got.idem[0] == IDEM_ACQUIRED  # the record is still taken: the caller releases it
    assert got.code == BUSY and 1 <= got.value <= 5_000
    assert redis_client.get(LEASE) == holder.encode()


def test_lease_with_limits_without_idempotency(s, redis_client):
    got = s.acquire(limits=LIMITS)
    assert got.admitted and got.idem is None and got.code == ACQUIRED
    assert consumed(redis_client) == (1, 1)
    assert redis_client.exists(IDEM) == 0


def test_lease_only(s, redis_client):
    a = owner()
    reply = s._acquire(keys=[LEASE, FENCE], args=[0, "nonce", "0", *lease_argv(a)])
    assert len(reply) == 3 and reply[:2] == [1, ACQUIRED] and int(reply[2]) > 0
    assert redis_client.get(LEASE) == a.encode()


@pytest.mark.parametrize("flag", [["0"], []], ids=["flag-0", "flag-absent"])
def test_lease_off_keeps_the_reply_shape(s, redis_client, flag):
    fw = LIMITS[0]
    reply = s._acquire(keys=[fw[0]], args=[1, "nonce", *fw[1].argv(), "0", *flag])
    assert len(reply) == 5 and reply[0] == 1
    reply = s._acquire(keys=[fw[0], IDEM],
                       args=[1, "nonce", *fw[1].argv(), "1", FP, owner(), 1_000, *flag])
    assert len(reply) == 8 and reply[5] == IDEM_ACQUIRED
    assert sorted(redis_client.keys("*")) == sorted([fw[0].encode(), IDEM.encode()])


# --- TTLs and arguments ------------------------------------------------------------------


def test_every_key_has_a_ttl_after_every_script(s, redis_client):
    a, b = owner(), owner()
    steps = [
        lambda: s.acquire(a, limits=LIMITS, idem=Idem(owner())),
        lambda: s.acquire(b, limits=LIMITS),  # busy
        lambda: s.extend(a),
        lambda: s.extend(b),
        lambda: s.release(b),
        lambda: s.release(a),
        lambda: s.acquire(b, lease="lease:{t1}:op:k2", fence="fence:{t1}:op:k2"),
        lambda: s.acquire(b, limits=LIMITS),  # the limits' last unit
        lambda: s.acquire(limits=LIMITS, idem=Idem(owner(), key="idem:{t1}:op:k3")),  # spent
        lambda: s.acquire(a, idem=Idem(owner())),  # in progress: skipped
    ]
    codes = []
    for step in steps:
        got = step()
        codes.append(got if isinstance(got, int) else got.code)
        assert_every_key_has_ttl(redis_client)
    assert codes == [ACQUIRED, BUSY, EXTENDED, NOT_OWNER, NOT_OWNER, RELEASED, ACQUIRED,
                     ACQUIRED, SKIPPED, SKIPPED]
    assert redis_client.get(LEASE) == b.encode()
    assert redis_client.exists("lease:{t1}:op:k2", "fence:{t1}:op:k2") == 2
    assert redis_client.exists("idem:{t1}:op:k3") == 0


IDEM_ARGS = ["1", FP, "o", 1_000]
ACQUIRE_BAD_ARGS = {
    "lease-ttl-zero": (IDEM_ARGS + ["1", "o", 0, FENCE_TTL], [IDEM, LEASE, FENCE]),
    "lease-ttl-nan": (IDEM_ARGS + ["1", "o", "soon", FENCE_TTL], [IDEM, LEASE, FENCE]),
    "fence-ttl-zero": (IDEM_ARGS + ["1", "o", LEASE_TTL, 0], [IDEM, LEASE, FENCE]),
    "fence-ttl-missing": (IDEM_ARGS + ["1", "o", LEASE_TTL], [IDEM, LEASE, FENCE]),
    "owner-missing": (IDEM_ARGS + ["1"], [IDEM, LEASE, FENCE]),
    "owner-empty": (IDEM_ARGS + ["1", "", LEASE_TTL, FENCE_TTL], [IDEM, LEASE, FENCE]),
    "flag-bad": (IDEM_ARGS + ["yes", "o", LEASE_TTL, FENCE_TTL], [IDEM, LEASE, FENCE]),
    "lease-keys-missing": (IDEM_ARGS + ["1", "o", LEASE_TTL, FENCE_TTL], [IDEM]),
    "fence-key-missing": (IDEM_ARGS + ["1", "o", LEASE_TTL, FENCE_TTL], [IDEM, LEASE]),
    "lease-keys-but-off": (IDEM_ARGS + ["0"], [IDEM, LEASE, FENCE]),
    "lease-is-fence": (IDEM_ARGS + ["1", "o", LEASE_TTL, FENCE_TTL], [IDEM, LEASE, LEASE]),
    "lease-is-record": (IDEM_ARGS + ["1", "o", LEASE_TTL, FENCE_TTL], [IDEM, IDEM, FENCE]),
    "no-idem-ttl-zero": (["0", "1", "o", 0, FENCE_TTL], [LEASE, FENCE]),
    "no-idem-owner-missing": (["0", "1"], [LEASE, FENCE]),
}


@pytest.mark.parametrize("args,keys", ACQUIRE_BAD_ARGS.values(), ids=ACQUIRE_BAD_ARGS.keys())
def test_acquire_bad_lease_arguments_fail_before_any_write(s, redis_client, args, keys):
    # with a valid counter in front, so a late failure would leave it consumed
    fw_key, fw = LIMITS[0]
    with pytest.raises(redis.ResponseError, match="acquire.lua: "):
        s._acquire(keys=[fw_key, *keys], args=[1, "nonce", *fw.argv(), *args])
    assert redis_client.keys("*") == []


# --- concurrency -------------------------------------------------------------------------


def run_threads(count: int, target) -> None:
    start = threading.Barrier(count)
    errors: list[BaseException] = []

    def worker(i: int):
        try:
            start.wait()
            target(i)
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def client_like(r):
    return r.__class__(connection_pool=r.connection_pool)


def test_racing_acquires_have_exactly_one_holder(s, redis_client):
    owners = [owner() for _ in range(16)]
    results: list[tuple[str, Got]] = []
    run_threads(16, lambda i: results.append(
        (owners[i], Scripts(client_like(redis_client)).acquire(owners[i]))))

    winners = [(o, g) for o, g in results if g.code == ACQUIRED]
    assert len(winners) == 1 and len(results) == 16
    assert all(g.code == BUSY and g.value >= 1 for _, g in results if g.code != ACQUIRED)
    (winner, won), = winners
    assert redis_client.get(LEASE) == winner.encode()
    assert fence_value(redis_client) == won.value


def test_racing_acquire_release_loops_are_exclusive_and_fenced(s, redis_client):
    """16 threads acquire, hold briefly and release, over and over. While one holds the lease
    nobody else does (its release still finds it), and the tokens, in the order the holders
    got them, strictly increase."""
    held: list[int] = []  # appended only while holding the lease, so in acquisition order
    rounds = 25

    def worker(i: int):
        mine = Scripts(client_like(redis_client))
        got_it = 0
        while got_it < rounds // 5:
            o = owner()
            g = mine.acquire(o, ttl_ms=10_000)
            if g.code == ACQUIRED:
                held.append(g.value)
                got_it += 1
                assert mine.release(o) == RELEASED
            else:
                assert g.code == BUSY

    run_threads(16, worker)
    assert len(held) == 16 * (rounds // 5)
    assert len(set(held)) == len(held)
    assert all(x < y for x, y in zip(held, held[1:])), held
    assert fence_value(redis_client) == held[-1]
