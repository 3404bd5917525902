"""Quotas on the Redis side against a real redis-server, every script run as the gateway user
(keys `cg:*`, only the commands the scripts need, as through webdis): concurrency limits
(acquire.lua's algo "cc", slot_release.lua, slot_extend.lua), the per-limit cost of
acquire.lua, and charge.lua, which moves a counter by what the response said it cost.

    acquire (cc) --admitted------> slot held (member: the nonce; score: its expiry in µs)
    slot held    --slot_extend----> held until now + window_ms
    slot held    --slot_release---> free, once; with the owner's marker a late acquire takes none
    slot held    --window passes--> free (a holder that crashed)

Times are Redis TIME read around the call, never the local clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import redis

from harness.scripts import Limit, Script, Verdict, owner, raw_state, redis_now_us

CC = "cg:rl:{q}:cc"
FW = "cg:rl:{q}:fw"
FW2 = "cg:rl:{q}:fw2"
SW = "cg:rl:{q}:sw"
SL = "cg:rl:{q}:sl"
TB = "cg:rl:{q}:tb"
KEYS = {"fw": FW, "sw": SW, "sl": SL, "tb": TB}
LONG = 60_000  # ms: nothing expires or refills during a test
HOUR = 3_600_000  # ms: sw windows a test does not cross (settled_window)
MARKER_TTL = 120_000
SLOT_RETRY_MS = 1000  # a rejected cc limit's retry_after
RELEASED = EXTENDED = 1  # slot_release.lua / slot_extend.lua
MISSING = 0
MARGIN_US = 30_000


def marker(own: str) -> str:
    return f"cg:cancel:{{q}}:op:{own}"


@dataclass(frozen=True)
class Acquired:
    admitted: bool
    verdicts: list[Verdict]


class Quotas:
    """The scripts, each run by the gateway user as the filter runs it (EVAL, then EVALSHA)."""

    def __init__(self, gateway):
        self._acquire = Script(gateway, "acquire.lua")
        self._release = Script(gateway, "slot_release.lua")
        self._extend = Script(gateway, "slot_extend.lua")
        self._charge = Script(gateway, "charge.lua")

    def acquire(self, *limits: tuple[str, Limit, int], nonce: str | None = None,
                cancel: str | None = None) -> Acquired:
        """acquire.lua with (key, limit, cost) per limit, idempotency and lease off; `cancel`:
        the cancellation marker key, passed last."""
        args: list = [len(limits), nonce or owner()]
        for _, lim, cost in limits:
            args += lim.argv(cost)
        keys = [k for k, _, _ in limits] + ([cancel] if cancel else [])
        reply = self._acquire(keys, args + ["0"])
        assert len(reply) == 1 + 4 * len(limits) and reply[0] in (0, 1), reply
        verdicts = [Verdict(bool(reply[i]), *reply[i + 1: i + 4])
                    for i in range(1, len(reply), 4)]
        for v in verdicts:
            assert v.remaining >= 0 and v.reset_ms >= 0, reply
            assert (v.retry_after_ms == 0) if v.allowed else (v.retry_after_ms >= 1), reply
        assert reply[0] == all(v.allowed for v in verdicts), reply  # no shadow limits here
        return Acquired(bool(reply[0]), verdicts)

    def admit(self, key: str, lim: Limit, cost: int = 1, **kw) -> Verdict:
        """acquire.lua with one limit: its verdict."""
        return self.acquire((key, lim, cost), **kw).verdicts[0]

    def release(self, nonce: str, cancel: str | None = None, key: str = CC) -> int:
        if cancel is None:
            return self._release([key], [nonce])
        return self._release([key, cancel], [nonce, MARKER_TTL])

    def extend(self, nonce: str, window_ms: int, key: str = CC) -> int:
        return self._extend([key], [nonce, window_ms])

    def charge(self, *limits: tuple[str, Limit, int]) -> list[int]:
        """charge.lua with (key, limit, delta) per limit: the units each counter moved."""
        args: list = [len(limits)]
        for _, lim, delta in limits:
            args += [lim.algo, lim.limit, lim.window_ms, delta]
        return self._charge([k for k, _, _ in limits], args)


@pytest.fixture
def q(gateway) -> Quotas:
    return Quotas(gateway)


def holders(r, key: str = CC) -> set[bytes]:
    return set(r.zrange(key, 0, -1))


def sleep_until_us(r, target_us: float) -> None:
    """Sleep until Redis TIME is MARGIN_US past `target_us`."""
    time.sleep(max(0.0, (target_us + MARGIN_US - redis_now_us(r)) / 1e6))


def settled_window(r, window_ms: int) -> int:
    """The index of the current aligned sw window, with at least a second of it left."""
    w = window_ms * 1000
    left = w - redis_now_us(r) % w
    if left < 1_000_000:
        time.sleep(left / 1e6 + 0.01)
    return redis_now_us(r) // w


# --- concurrency limits ------------------------------------------------------------------


def test_cc_admits_exactly_limit_holders(q, redis_client):
    lim = Limit("cc", 3, LONG)
    nonces = [owner() for _ in range(5)]
    before = redis_now_us(redis_client)
    got = [q.admit(CC, lim, nonce=n) for n in nonces]
    after = redis_now_us(redis_client)

    assert [v.allowed for v in got] == [True] * 3 + [False] * 2
    assert [v.remaining for v in got] == [2, 1, 0, 0, 0]
    assert [v.reset_ms for v in got[:3]] == [LONG] * 3
    assert [v.retry_after_ms for v in got[3:]] == [SLOT_RETRY_MS] * 2
    assert holders(redis_client) == {n.encode() for n in nonces[:3]}
    # a slot's score is its expiry: Redis TIME + window_ms, in µs
    for n in nonces[:3]:
        assert before + LONG * 1000 <= redis_client.zscore(CC, n) <= after + LONG * 1000


def test_a_call_its_cc_limit_rejects_consumes_nothing_from_its_fw_limit(q, redis_client):
    fw, cc = Limit("fw", 10, LONG), Limit("cc", 1, LONG)
    assert q.acquire((FW, fw, 1), (CC, cc, 1)).admitted
    before = raw_state(redis_client, FW), raw_state(redis_client, CC)

    for _ in range(3):
        got = q.acquire((FW, fw, 1), (CC, cc, 1))
        assert not got.admitted
        assert [v.allowed for v in got.verdicts] == [True, False]
        assert got.verdicts[0].remaining == 9  # as of now: nothing of this call was taken
    assert (raw_state(redis_client, FW), raw_state(redis_client, CC)) == before
    assert redis_client.get(FW) == b"1"


def test_a_call_its_fw_limit_rejects_takes_no_slot(q, redis_client):
    fw, cc = Limit("fw", 10, LONG), Limit("cc", 1, LONG)
    redis_client.set(FW, 10, px=LONG)
    got = q.acquire((FW, fw, 1), (CC, cc, 1))
    assert not got.admitted
    assert got.verdicts[1] == Verdict(True, 1, 0, 0)  # the slot was free, and still is
    assert redis_client.keys("*") == [FW.encode()]


def test_an_expired_slot_no_longer_counts_and_is_swept(q, redis_client):
    crashed, live, n = owner(), owner(), owner()
    now = redis_now_us(redis_client)
    redis_client.zadd(CC, {crashed: now - 1, live: now + LONG * 1000})
    redis_client.pexpire(CC, LONG)

    v = q.admit(CC, Limit("cc", 2, LONG), nonce=n)
    assert v.allowed and v.remaining == 0
    assert holders(redis_client) == {live.encode(), n.encode()}


def test_a_crashed_holders_slot_frees_when_its_window_ends(q, redis_client):
    lim = Limit("cc", 2, 300)
    a, b, c = owner(), owner(), owner()
    assert q.admit(CC, lim, nonce=a).allowed
    time.sleep(0.15)
    assert q.admit(CC, lim, nonce=b).allowed
    assert not q.admit(CC, lim).allowed  # both held

    sleep_until_us(redis_client, redis_client.zscore(CC, a))  # a never gave its slot back
    assert redis_client.exists(CC)  # b's acquire kept the key alive
    assert q.admit(CC, lim, nonce=c).allowed
    assert holders(redis_client) == {b.encode(), c.encode()}
    assert not q.admit(CC, lim).allowed

    sleep_until_us(redis_client, redis_client.zscore(CC, c))
    assert not redis_client.exists(CC)  # the key lives no longer than its last slot
    assert q.admit(CC, lim).remaining == 1


def test_slot_release_frees_exactly_one_slot_once(q, redis_client):
    lim = Limit("cc", 2, LONG)
    a, b, c = owner(), owner(), owner()
    assert q.admit(CC, lim, nonce=a).allowed and q.admit(CC, lim, nonce=b).allowed
    assert not q.admit(CC, lim).allowed

    assert q.release(a) == RELEASED
    assert q.release(a) == MISSING  # given back once, however often it runs
    assert q.release(owner()) == MISSING  # never taken
    assert holders(redis_client) == {b.encode()}
    v = q.admit(CC, lim, nonce=c)
    assert v.allowed and v.remaining == 0
    assert not q.admit(CC, lim).allowed  # the repeated release freed nothing more

    assert q.release(b) == RELEASED and q.release(c) == RELEASED
    assert not redis_client.exists(CC)
    assert q.release(b) == MISSING and not redis_client.exists(CC)  # nothing written


def test_slot_release_removes_an_expired_member_and_only_it(q, redis_client):
    crashed, live = owner(), owner()
    now = redis_now_us(redis_client)
    redis_client.zadd(CC, {crashed: now - 1, live: now + LONG * 1000})
    redis_client.pexpire(CC, LONG)
    assert q.release(crashed) == RELEASED  # still there, not yet swept
    assert holders(redis_client) == {live.encode()}


def test_release_with_marker_makes_a_late_acquire_take_no_slot(q, redis_client):
    fw, cc = Limit("fw", 10, LONG), Limit("cc", 1, LONG)
    own = owner()
    # The filter gave up on the acquire before it ran: the release finds no slot, marks.
    assert q.release(own, cancel=marker(own)) == MISSING
    assert redis_client.get(marker(own)) == b"1"
    assert 0 < redis_client.pttl(marker(own)) <= MARKER_TTL

    late = q.acquire((FW, fw, 1), (CC, cc, 1), nonce=own, cancel=marker(own))
    assert late.admitted
    assert late.verdicts[0].remaining == 9 and redis_client.get(FW) == b"1"  # Redis saw it
    assert late.verdicts[1] == Verdict(True, 1, 0, 0)  # but it holds no slot
    assert not redis_client.exists(CC)

    # The marker is its owner's only: another request takes the slot.
    other = owner()
    got = q.acquire((FW, fw, 1), (CC, cc, 1), nonce=other, cancel=marker(other))
    assert got.admitted and got.verdicts[1].remaining == 0
    assert holders(redis_client) == {other.encode()} and redis_client.get(FW) == b"2"


def test_release_with_marker_after_the_acquire_frees_the_slot_and_marks(q, redis_client):
    lim = Limit("cc", 1, LONG)
    own = owner()
    assert q.admit(CC, lim, nonce=own, cancel=marker(own)).allowed
    assert q.release(own, cancel=marker(own)) == RELEASED
    assert not redis_client.exists(CC) and redis_client.get(marker(own)) == b"1"
    # A retry of the same late call finds the marker: still no slot.
    v = q.admit(CC, lim, nonce=own, cancel=marker(own))
    assert v.allowed and not redis_client.exists(CC)


def test_slot_extend_keeps_a_slot_past_its_window(q, redis_client):
    lim = Limit("cc", 1, 300)
    a = owner()
    assert q.admit(CC, lim, nonce=a).allowed
    first_expiry = redis_client.zscore(CC, a)
    time.sleep(0.2)

    before = redis_now_us(redis_client)
    assert q.extend(a, 300) == EXTENDED
    after = redis_now_us(redis_client)
    expiry = redis_client.zscore(CC, a)
    assert before + 300_000 <= expiry <= after + 300_000
    assert 200 < redis_client.pttl(CC) <= 300  # the key lives as long (it had ~100 ms left)

    sleep_until_us(redis_client, first_expiry)
    assert not q.admit(CC, lim).allowed  # past its first window, the slot is still held
    assert holders(redis_client) == {a.encode()}
    sleep_until_us(redis_client, expiry)
    assert q.admit(CC, lim).allowed


def test_slot_extend_does_not_revive_an_expired_slot(q, redis_client):
    crashed, live = owner(), owner()
    now = redis_now_us(redis_client)
    live_expiry = now + LONG * 1000
    redis_client.zadd(CC, {crashed: now - 1, live: live_expiry})
    redis_client.pexpire(CC, LONG)

    assert q.extend(crashed, LONG) == MISSING
    assert redis_client.zscore(CC, crashed) is None  # removed, not revived
    assert q.extend(owner(), LONG) == MISSING  # never taken: nothing written
    assert holders(redis_client) == {live.encode()}
    assert redis_client.zscore(CC, live) == live_expiry


def test_slot_extend_after_the_key_expired_writes_nothing(q, redis_client):
    a = owner()
    assert q.admit(CC, Limit("cc", 1, 100), nonce=a).allowed
    sleep_until_us(redis_client, redis_client.zscore(CC, a))
    assert q.extend(a, LONG) == MISSING
    assert redis_client.keys("*") == []


@pytest.mark.parametrize("cost", [0, 2])
def test_a_concurrency_limit_costs_exactly_one(q, redis_client, cost):
    with pytest.raises(redis.ResponseError, match="acquire.lua: .*concurrency limit must be 1"):
        q.acquire((FW, Limit("fw", 10, LONG), 1), (CC, Limit("cc", 5, LONG), cost))
    assert redis_client.keys("*") == []


SLOT_BAD_ARGS = {
    "release-member-missing": ("slot_release.lua", [CC], []),
    "release-member-empty": ("slot_release.lua", [CC], [""]),
    "release-marker-ttl-missing": ("slot_release.lua", [CC, marker("n")], ["n"]),
    "release-marker-ttl-zero": ("slot_release.lua", [CC, marker("n")], ["n", 0]),
    "release-marker-is-the-key": ("slot_release.lua", [CC, CC], ["n", MARKER_TTL]),
    "release-key-missing": ("slot_release.lua", [], ["n"]),
    "extend-member-empty": ("slot_extend.lua", [CC], ["", LONG]),
    "extend-window-zero": ("slot_extend.lua", [CC], ["n", 0]),
    "extend-window-missing": ("slot_extend.lua", [CC], ["n"]),
    "extend-key-missing": ("slot_extend.lua", [], ["n", LONG]),
}


@pytest.mark.parametrize("script,keys,args", SLOT_BAD_ARGS.values(), ids=SLOT_BAD_ARGS.keys())
def test_slot_scripts_bad_arguments_fail_before_any_write(gateway, q, redis_client, script,
                                                          keys, args):
    assert q.admit(CC, Limit("cc", 1, LONG), nonce="n").allowed
    before, pttl = raw_state(redis_client, CC), redis_client.pttl(CC)
    with pytest.raises(redis.ResponseError, match=f"{script}: "):
        Script(gateway, script)(keys, args)
    assert raw_state(redis_client, CC) == before
    assert 0 < redis_client.pttl(CC) <= pttl  # not extended
    assert redis_client.keys("*") == [CC.encode()]


def test_every_key_written_has_a_ttl_bounded_by_its_window(q, redis_client):
    fw, cc = Limit("fw", 10, 1000), Limit("cc", 2, 400)
    sw, tb = Limit("sw", 10, 2000), Limit("tb", 10, 3000)  # tb: T = 300 ms
    bounds = {FW: fw.window_ms, CC: cc.window_ms, SW: 2 * sw.window_ms,
              TB: tb.window_ms, marker("b"): MARKER_TTL}
    steps = [
        lambda: q.acquire((FW, fw, 1), (CC, cc, 1), nonce="a"),
        lambda: q.acquire((FW, fw, 1), (CC, cc, 1), nonce="b", cancel=marker("b")),
        lambda: q.acquire((FW, fw, 1), (CC, cc, 1)),  # rejected: both slots held
        lambda: time.sleep(0.1),
        lambda: q.extend("a", cc.window_ms),
        lambda: q.release("b", cancel=marker("b")),
        lambda: q.charge((FW, fw, 5), (SW, sw, 3), (TB, tb, 4)),
        lambda: q.acquire((SW, sw, 2), (TB, tb, 2), (CC, cc, 1), nonce="c"),
        lambda: q.charge((SW, sw, -1), (TB, tb, -1)),
    ]
    for i, step in enumerate(steps):
        step()
        for key in redis_client.keys("*"):
            assert 0 < redis_client.pttl(key) <= bounds[key.decode()], (i, key)
    assert holders(redis_client) == {b"a", b"c"}
    assert sorted(redis_client.keys("*")) == sorted(k.encode() for k in bounds)


# --- per-limit cost ----------------------------------------------------------------------


@pytest.mark.parametrize("algo", KEYS)
def test_two_limits_in_one_call_consume_their_own_costs(q, redis_client, algo):
    a, b = Limit("fw", 10, LONG), Limit(algo, 10, LONG)
    key = KEYS[algo] if algo != "fw" else FW2
    got = q.acquire((FW, a, 1), (key, b, 4))
    assert got.admitted and [v.remaining for v in got.verdicts] == [9, 6]
    got = q.acquire((FW, a, 2), (key, b, 0))
    assert got.admitted and [v.remaining for v in got.verdicts] == [7, 6]
    assert redis_client.get(FW) == b"3"
    if algo == "sl":  # one member per unit
        assert redis_client.zcard(key) == 4

    # 7 > the 6 left: rejected, and the limit that had room consumed nothing either
    got = q.acquire((FW, a, 1), (key, b, 7))
    assert not got.admitted and [v.allowed for v in got.verdicts] == [True, False]
    assert redis_client.get(FW) == b"3"
    assert q.acquire((FW, a, 1), (key, b, 6)).verdicts[1].remaining == 0


@pytest.mark.parametrize("algo", KEYS)
def test_cost_zero_admits_while_below_the_limit_and_consumes_nothing(q, redis_client, algo):
    lim, key = Limit(algo, 3, LONG), KEYS[algo]
    v = q.admit(key, lim, cost=0)
    assert v.allowed and v.remaining == 3 and not redis_client.exists(key)

    assert q.admit(key, lim).allowed and q.admit(key, lim).allowed
    partly = raw_state(redis_client, key)
    v = q.admit(key, lim, cost=0)
    assert v.allowed and v.remaining == 1
    assert raw_state(redis_client, key) == partly

    assert q.admit(key, lim).allowed  # the last unit
    full = raw_state(redis_client, key)
    v = q.admit(key, lim, cost=0)
    assert not v.allowed and v.remaining == 0 and v.retry_after_ms >= 1
    assert raw_state(redis_client, key) == full


def test_a_cost_above_what_is_left_rejects_and_consumes_nothing_anywhere(q, redis_client):
    a, b, cc = Limit("fw", 10, LONG), Limit("fw", 5, LONG), Limit("cc", 2, LONG)
    assert q.acquire((FW, a, 1), (FW2, b, 3), (CC, cc, 1)).admitted
    before = {k: raw_state(redis_client, k) for k in (FW, FW2, CC)}

    got = q.acquire((FW, a, 1), (FW2, b, 3), (CC, cc, 1))
    assert not got.admitted
    assert [v.allowed for v in got.verdicts] == [True, False, True]
    assert [v.remaining for v in got.verdicts] == [9, 2, 1]
    assert {k: raw_state(redis_client, k) for k in before} == before

    got = q.acquire((FW, a, 1), (FW2, b, 2), (CC, cc, 1))  # what is left fits
    assert got.admitted and [v.remaining for v in got.verdicts] == [8, 0, 0]


# --- charge.lua --------------------------------------------------------------------------


def test_charge_fw_adds_a_positive_delta_and_keeps_the_ttl(q, redis_client):
    lim = Limit("fw", 1000, LONG)
    assert q.admit(FW, lim).allowed
    redis_client.pexpire(FW, 30_000)  # so a TTL set again would show
    assert q.charge((FW, lim, 299)) == [299]
    assert redis_client.get(FW) == b"300"
    assert 0 < redis_client.pttl(FW) <= 30_000


def test_charge_fw_subtracts_a_negative_delta_never_below_zero(q, redis_client):
    lim = Limit("fw", 10, LONG)
    assert q.admit(FW, lim, cost=5).allowed
    assert q.charge((FW, lim, -3)) == [-3] and redis_client.get(FW) == b"2"
    assert q.charge((FW, lim, -10)) == [-2] and redis_client.get(FW) == b"0"
    assert q.charge((FW, lim, -1)) == [0] and redis_client.get(FW) == b"0"
    assert 0 < redis_client.pttl(FW) <= LONG
    assert q.admit(FW, lim, cost=10).allowed  # the whole limit is back


def test_charge_fw_on_an_absent_counter(q, redis_client):
    lim = Limit("fw", 10, LONG)
    assert q.charge((FW, lim, -4)) == [0]
    assert q.charge((FW, lim, 0)) == [0]
    assert redis_client.keys("*") == []  # nothing to subtract from, nothing written

    assert q.charge((FW, lim, 7)) == [7]  # opens a window, as a consumption would
    assert redis_client.get(FW) == b"7" and 0 < redis_client.pttl(FW) <= LONG
    v = q.admit(FW, lim, cost=4)
    assert not v.allowed and v.remaining == 3


def test_charge_sw_moves_the_current_windows_count(q, redis_client):
    lim = Limit("sw", 100, HOUR)
    idx = settled_window(redis_client, HOUR)
    redis_client.hset(SW, mapping={"w": idx, "c": 3, "p": 2})
    redis_client.pexpire(SW, HOUR)

    assert q.charge((SW, lim, 4)) == [4]
    assert redis_client.hgetall(SW) == {b"w": b"%d" % idx, b"c": b"7", b"p": b"2"}
    assert q.charge((SW, lim, -100)) == [-7]  # never below zero; prev is not touched
    assert redis_client.hgetall(SW) == {b"w": b"%d" % idx, b"c": b"0", b"p": b"2"}
    assert 0 < redis_client.pttl(SW) <= 2 * HOUR


@pytest.mark.parametrize("stored,prev", [(-1, 5), (-3, 0)], ids=["previous", "stale"])
def test_charge_sw_rolls_an_older_window_over(q, redis_client, stored, prev):
    lim = Limit("sw", 100, HOUR)
    idx = settled_window(redis_client, HOUR)
    redis_client.hset(SW, mapping={"w": idx + stored, "c": 5, "p": 9})
    redis_client.pexpire(SW, HOUR)

    assert q.charge((SW, lim, -3)) == [0]  # this window has nothing to give back
    assert q.charge((SW, lim, 2)) == [2]
    assert redis_client.hgetall(SW) == {b"w": b"%d" % idx, b"c": b"2", b"p": b"%d" % prev}
    assert 0 < redis_client.pttl(SW) <= 2 * HOUR


def test_charge_sw_on_an_absent_counter(q, redis_client):
    lim = Limit("sw", 10, HOUR)
    settled_window(redis_client, HOUR)
    assert q.charge((SW, lim, -4)) == [0]
    assert redis_client.keys("*") == []

    assert q.charge((SW, lim, 8)) == [8]
    assert 0 < redis_client.pttl(SW) <= 2 * HOUR
    assert not q.admit(SW, lim, cost=3).allowed  # acquire.lua counts the charged units
    assert q.admit(SW, lim, cost=2).allowed


def test_charge_tb_a_positive_delta_rejects_until_the_bucket_drains(q, redis_client):
    lim = Limit("tb", 4, 400)  # T = 100 ms, a bucket of 4
    assert q.admit(TB, lim).allowed
    tat = int(redis_client.get(TB))
    assert q.charge((TB, lim, 5)) == [5]
    assert int(redis_client.get(TB)) == tat + 500_000
    assert 0 < redis_client.pttl(TB) <= 600

    v = q.admit(TB, lim)
    # admitted again once TAT + T - tau <= now: 200 ms after the first TAT
    assert not v.allowed and 1 <= v.retry_after_ms <= 300
    sleep_until_us(redis_client, tat + 200_000)
    assert q.admit(TB, lim).allowed


def test_charge_tb_a_negative_delta_never_gives_more_than_a_full_bucket(q, redis_client):
    lim = Limit("tb", 4, LONG)  # T = 15 s, a bucket of 4
    assert q.admit(TB, lim, cost=3).allowed
    tat = int(redis_client.get(TB))
    assert q.charge((TB, lim, -1)) == [-1]
    assert int(redis_client.get(TB)) == tat - 15_000_000
    assert [q.admit(TB, lim).allowed for _ in range(3)] == [True, True, False]

    assert q.charge((TB, lim, -100)) == [-4]  # the 4 units held, no more
    assert not redis_client.exists(TB)  # a full bucket
    assert [q.admit(TB, lim).allowed for _ in range(5)] == [True] * 4 + [False]


def test_charge_tb_on_an_absent_counter(q, redis_client):
    lim = Limit("tb", 4, 400)  # T = 100 ms
    assert q.charge((TB, lim, -2)) == [0]
    assert redis_client.keys("*") == []

    before = redis_now_us(redis_client)
    assert q.charge((TB, lim, 2)) == [2]
    after = redis_now_us(redis_client)
    assert before + 200_000 <= int(redis_client.get(TB)) <= after + 200_000
    assert 0 < redis_client.pttl(TB) <= 200
    assert q.admit(TB, lim).remaining == 1  # two of the four spent, one more now


def test_charge_moves_every_limit_of_one_call(q, redis_client):
    fw, sw, tb = Limit("fw", 10, LONG), Limit("sw", 10, HOUR), Limit("tb", 10, LONG)
    settled_window(redis_client, HOUR)
    assert q.acquire((FW, fw, 2), (SW, sw, 2), (TB, tb, 2)).admitted

    assert q.charge((FW, fw, 3), (SW, sw, -5), (TB, tb, 1)) == [3, -2, 1]
    got = q.acquire((FW, fw, 0), (SW, sw, 0), (TB, tb, 0))
    assert [v.remaining for v in got.verdicts] == [5, 10, 7]


CHARGE_BAD_ARGS = {  # the second limit's values (the first is valid), and how many keys
    "algo-sl": (["sl", 10, LONG, 1], 2),
    "algo-cc": (["cc", 10, LONG, 1], 2),
    "algo-lq": (["lq", 10, LONG, 1], 2),
    "algo-missing": ([], 2),
    "limit-zero": (["fw", 0, LONG, 1], 2),
    "window-zero": (["fw", 10, 0, 1], 2),
    "delta-fraction": (["fw", 10, LONG, "1.5"], 2),
    "delta-word": (["fw", 10, LONG, "x"], 2),
    "delta-nan": (["fw", 10, LONG, "nan"], 2),
    "delta-inf": (["fw", 10, LONG, "-inf"], 2),
    "delta-missing": (["fw", 10, LONG], 2),
    "one-key-for-two": (["fw", 10, LONG, 1], 1),
    "three-keys-for-two": (["fw", 10, LONG, 1], 3),
}


@pytest.mark.parametrize("second,nkeys", CHARGE_BAD_ARGS.values(), ids=CHARGE_BAD_ARGS.keys())
def test_charge_bad_arguments_fail_before_any_write(q, redis_client, second, nkeys):
    keys = [FW, FW2, SW][:nkeys]
    with pytest.raises(redis.ResponseError, match="charge.lua: "):
        q._charge(keys, [2, "fw", 10, LONG, 5, *second])
    assert redis_client.keys("*") == []


@pytest.mark.parametrize("keys,args", [([], [0]), ([FW], [0]), ([FW], []), ([FW], [-1])],
                         ids=["no-limits", "n-zero", "n-missing", "n-negative"])
def test_charge_needs_at_least_one_limit(q, redis_client, keys, args):
    with pytest.raises(redis.ResponseError, match="charge.lua: "):
        q._charge(keys, args)
    assert redis_client.keys("*") == []


@pytest.mark.parametrize("cost", [1, 0], ids=["admitted-at-1", "admitted-at-0"])
def test_a_budget_charged_after_each_response(q, redis_client, cost):
    """A budget of 1000 units a minute; every response reports 300 units used. Admitted at
    `cost`, each request is charged the rest after its response: the 4th is admitted (900
    used), the 5th is not (1200)."""
    lim = Limit("fw", 1000, LONG)
    admitted = []
    for _ in range(5):
        v = q.admit(FW, lim, cost=cost)
        admitted.append(v.allowed)
        if v.allowed:
            assert q.charge((FW, lim, 300 - cost)) == [300 - cost]
    assert admitted == [True] * 4 + [False]
    assert redis_client.get(FW) == b"1200"
    assert v.remaining == 0 and 1 <= v.retry_after_ms <= LONG
    assert 0 < redis_client.pttl(FW) <= LONG
