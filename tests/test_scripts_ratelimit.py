"""The rate-limit part of src/redis/scripts/acquire.lua against a real redis-server (idempotency off;
the idempotency section is tested in test_scripts_idempotency.py).

Timing tests use short windows, generous margins and, where an exact expectation depends on
when the script ran, Redis TIME read right before/after the call instead of the local clock.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest

from harness.scripts import (Verdict, limits_argv, raw_state, redis_now_us, register,
                             script_source)

SCRIPT = script_source("acquire")  # as the filter runs it (src/redis/scripts/mod.rs)
MARGIN_S = 0.03  # added to every sleep the script told us to take


@dataclass(frozen=True)
class Limit:
    algo: str
    limit: int
    window_ms: int
    burst: int | None = None  # tb capacity; the caller passes `limit` when not configured
    shadow: bool = False

    @property
    def capacity(self) -> int:
        return self.burst if self.algo == "tb" and self.burst else self.limit

    @property
    def t_ms(self) -> float:
        """tb emission interval."""
        return self.window_ms / self.limit

    def ttl_bound_ms(self) -> float:
        return {
            "fw": self.window_ms,
            "sl": self.window_ms,
            "sw": 2 * self.window_ms,
            "tb": self.capacity * self.t_ms + 1,
        }[self.algo]

    def argv(self, cost: int = 1) -> list:
        return [self.algo, self.limit, self.window_ms, self.burst or self.limit,
                "1" if self.shadow else "0", cost]


class RateLimitScript:
    def __init__(self, client):
        self.client = client
        # redis-py's Script: EVALSHA, falling back to EVAL (and caching) on NOSCRIPT.
        self.script = register(client, SCRIPT)

    def call(self, limits: list[tuple[str, Limit]], cost: int = 1) -> tuple[bool, list[Verdict]]:
        argv = limits_argv([lim for _, lim in limits], cost) + ["0"]  # idempotency off
        reply = self.script(keys=[k for k, _ in limits], args=argv)
        assert len(reply) == 1 + 4 * len(limits)
        assert all(isinstance(v, int) for v in reply), reply
        assert reply[0] in (0, 1)
        verdicts = []
        for i in range(len(limits)):
            allowed, remaining, reset_ms, retry = reply[1 + 4 * i: 5 + 4 * i]
            assert allowed in (0, 1) and remaining >= 0 and reset_ms >= 0
            assert (retry == 0) if allowed else (retry >= 1), reply
            verdicts.append(Verdict(bool(allowed), remaining, reset_ms, retry))
        return bool(reply[0]), verdicts

    def one(self, key: str, lim: Limit, cost: int = 1) -> Verdict:
        admitted, (v,) = self.call([(key, lim)], cost)
        assert admitted == (v.allowed or lim.shadow)
        return v


@pytest.fixture
def rl(redis_client) -> RateLimitScript:
    return RateLimitScript(redis_client)


def sleep_ms(ms: float) -> None:
    time.sleep(ms / 1000 + MARGIN_S)


def align_to_window_start(r, window_ms: int, offset_ms: int = 10) -> None:
    """Sleep until `offset_ms` into the next Redis-time window (sw windows are aligned)."""
    w = window_ms * 1000
    now = redis_now_us(r)
    time.sleep(((now // w + 1) * w - now) / 1e6 + offset_ms / 1000)


def assert_ms_until(got_ms: int, target_us: float, before_us: int, after_us: int) -> None:
    """`got_ms` is the script's rounded-up wait until `target_us`, taken at a Redis time
    between `before_us` and `after_us` (1 ms of slack for float rounding)."""
    assert math.ceil((target_us - after_us) / 1000) - 1 <= got_ms, (got_ms, target_us)
    assert got_ms <= math.ceil((target_us - before_us) / 1000) + 1, (got_ms, target_us)


LONG = 60_000  # ms; nothing refills during a burst
BURST_CASES = {
    "fw": Limit("fw", 5, LONG),
    "sw": Limit("sw", 5, LONG),
    "sl": Limit("sl", 5, LONG),
    "tb": Limit("tb", 10, LONG, burst=4),  # T = 6 s, capacity 4
}
ALGOS = pytest.mark.parametrize("lim", BURST_CASES.values(), ids=BURST_CASES.keys())


@ALGOS
def test_burst_admits_exactly_capacity(rl, lim):
    verdicts = [rl.one("{u}:k", lim) for _ in range(lim.capacity + 5)]

    assert [v.allowed for v in verdicts] == [True] * lim.capacity + [False] * 5
    assert [v.remaining for v in verdicts[: lim.capacity]] == list(range(lim.capacity - 1, -1, -1))
    for v in verdicts[lim.capacity:]:
        assert v.remaining == 0
        assert 1 <= v.retry_after_ms <= lim.ttl_bound_ms()
        assert v.reset_ms > 0


@ALGOS
def test_rejected_requests_do_not_consume(rl, redis_client, lim):
    for _ in range(lim.capacity):
        assert rl.one("{u}:k", lim).allowed
    before = raw_state(redis_client, "{u}:k")
    assert before is not None

    for _ in range(3):
        assert not rl.one("{u}:k", lim).allowed
    assert raw_state(redis_client, "{u}:k") == before


@ALGOS
def test_cost_consumes_that_many_units(rl, redis_client, lim):
    cost = 3
    first = rl.one("{u}:k", lim, cost=cost)
    assert first.allowed and first.remaining == lim.capacity - cost
    second = rl.one("{u}:k", lim, cost=cost)
    assert not second.allowed and second.remaining == lim.capacity - cost
    assert rl.one("{u}:k", lim, cost=lim.capacity - cost).allowed
    if lim.algo == "sl":  # one unique member per unit
        assert redis_client.zcard("{u}:k") == lim.capacity


def test_one_rejecting_limit_consumes_nothing_anywhere(rl, redis_client):
    limits = [
        ("{u}:fw", Limit("fw", 10, LONG)),
        ("{u}:sw", Limit("sw", 10, LONG)),
        ("{u}:sl", Limit("sl", 10, LONG)),
        ("{u}:tb", Limit("tb", 10, LONG, burst=10)),
        ("{u}:shadow", Limit("fw", 10, LONG, shadow=True)),
        ("{u}:tight", Limit("fw", 1, LONG)),
    ]
    admitted, _ = rl.call(limits)
    assert admitted
    before = {k: raw_state(redis_client, k) for k, _ in limits}
    assert all(v is not None for v in before.values())

    for _ in range(3):
        admitted, verdicts = rl.call(limits)
        assert not admitted
        *others, tight = verdicts
        assert not tight.allowed and tight.retry_after_ms >= 1
        assert [v.allowed for v in others] == [True] * 5
        # remaining as of now: nothing of this request was taken
        assert [v.remaining for v in others] == [9] * 5
    assert {k: raw_state(redis_client, k) for k, _ in limits} == before


def test_nothing_is_written_when_first_request_is_rejected(rl, redis_client):
    limits = [
        ("{u}:fw", Limit("fw", 10, LONG)),
        ("{u}:sw", Limit("sw", 10, LONG)),
        ("{u}:sl", Limit("sl", 10, LONG)),
        ("{u}:tb", Limit("tb", 10, LONG)),
        ("{u}:full", Limit("fw", 1, LONG)),
    ]
    redis_client.set("{u}:full", 1, px=LONG)
    admitted, _ = rl.call(limits)
    assert not admitted
    assert redis_client.keys("*") == [b"{u}:full"]


@ALGOS
def test_shadow_limit_over_never_rejects_and_is_reported(rl, redis_client, lim):
    shadow = Limit(lim.algo, lim.limit, lim.window_ms, lim.burst, shadow=True)
    limits = [("{u}:enforced", Limit("fw", 100, LONG)), ("{u}:shadow", shadow)]

    for _ in range(shadow.capacity):
        admitted, (_, s) = rl.call(limits)
        assert admitted and s.allowed
    state_when_full = raw_state(redis_client, "{u}:shadow")

    for _ in range(3):
        admitted, (enforced, s) = rl.call(limits)
        assert admitted and enforced.allowed
        assert not s.allowed and s.remaining == 0 and s.retry_after_ms >= 1
    # an over shadow limit is not consumed; the enforced one took every request
    assert raw_state(redis_client, "{u}:shadow") == state_when_full
    assert int(redis_client.get("{u}:enforced")) == shadow.capacity + 3


# --- windows and refill (short windows, real sleeps) -------------------------------------


def test_fw_resets_after_window(rl):
    lim = Limit("fw", 3, 200)
    assert all(rl.one("{u}:k", lim).allowed for _ in range(3))
    rejected = rl.one("{u}:k", lim)
    assert not rejected.allowed and rejected.reset_ms <= 200

    sleep_ms(200)
    fresh = rl.one("{u}:k", lim)
    assert fresh.allowed and fresh.remaining == 2 and fresh.reset_ms == 200


def sw_expected_admits(prev: int, cur: int, limit: int, elapsed_fraction: float) -> int:
    """How many cost-1 requests the weighted estimate admits at this instant."""
    n = 0
    while prev * (1 - elapsed_fraction) + cur + n + 1 <= limit:
        n += 1
    return n


def test_sw_previous_window_decays_progressively(rl, redis_client):
    lim = Limit("sw", 10, 400)
    w_us = lim.window_ms * 1000
    align_to_window_start(redis_client, lim.window_ms)
    assert all(rl.one("{u}:k", lim).allowed for _ in range(10))
    assert not rl.one("{u}:k", lim).allowed
    filled_idx = redis_now_us(redis_client) // w_us

    cur = 0
    for fraction in (0.25, 0.75):  # of the next window: prev weighs 0.75, then 0.25
        target_us = (filled_idx + 1 + fraction) * w_us
        time.sleep(max(0.0, (target_us - redis_now_us(redis_client)) / 1e6))
        t0 = redis_now_us(redis_client)
        admitted = 0
        while rl.one("{u}:k", lim).allowed:
            admitted += 1
            assert admitted <= 10
        assert t0 // w_us == filled_idx + 1, "test slept past the next window"
        expected = sw_expected_admits(10, cur, 10, (t0 % w_us) / w_us)
        assert abs(admitted - expected) <= 1, (fraction, admitted, expected)
        cur += admitted
    # 10 * 0.75 leaves room for ~2, then 10 * 0.25 + 2 leaves room for ~5 more
    assert 6 <= cur <= 8


def test_sl_frees_slots_as_oldest_entries_age_out(rl, redis_client):
    lim = Limit("sl", 2, 300)
    assert rl.one("{u}:k", lim).allowed
    time.sleep(0.15)
    assert rl.one("{u}:k", lim).allowed
    oldest, newest = (s for _, s in redis_client.zrange("{u}:k", 0, -1, withscores=True))

    before = redis_now_us(redis_client)
    rejected = rl.one("{u}:k", lim)
    after = redis_now_us(redis_client)
    assert not rejected.allowed
    # exactly when the oldest entry leaves the window: a unit comes back then (reset_ms, the
    # header's t) and a request of cost 1 fits (retry_after_ms)
    assert_ms_until(rejected.retry_after_ms, oldest + 300_000, before, after)
    assert_ms_until(rejected.reset_ms, oldest + 300_000, before, after)

    # cost 2 needs both entries gone: the wait is until the newest leaves
    before = redis_now_us(redis_client)
    rejected2 = rl.one("{u}:k", lim, cost=2)
    after = redis_now_us(redis_client)
    assert not rejected2.allowed
    assert_ms_until(rejected2.retry_after_ms, newest + 300_000, before, after)

    sleep_ms(rejected.retry_after_ms)
    before = redis_now_us(redis_client)
    freed = rl.one("{u}:k", lim)
    after = redis_now_us(redis_client)
    assert freed.allowed and freed.remaining == 0  # one slot back, the newer entry still counts
    # the set's first entry had left the window: the next unit is the newer entry's
    assert_ms_until(freed.reset_ms, newest + 300_000, before, after)
    assert not rl.one("{u}:k", lim).allowed
    assert redis_client.zcard("{u}:k") == 2  # the aged-out entry was trimmed


def test_tb_refills_one_token_per_interval(rl, redis_client):
    lim = Limit("tb", 4, 400, burst=3)  # T = 100 ms, tau = 300 ms
    assert all(rl.one("{u}:k", lim).allowed for _ in range(3))
    time.sleep(0.03)  # so the exact wait differs clearly from a whole T
    tat = int(redis_client.get("{u}:k"))
    before = redis_now_us(redis_client)
    rejected = rl.one("{u}:k", lim)
    after = redis_now_us(redis_client)
    assert not rejected.allowed and 1 <= rejected.retry_after_ms <= 100
    # admitted once TAT + T - tau <= now; the next token (reset_ms) comes then too
    assert_ms_until(rejected.retry_after_ms, tat + 100_000 - 300_000, before, after)
    assert_ms_until(rejected.reset_ms, tat + 100_000 - 300_000, before, after)

    sleep_ms(rejected.retry_after_ms)
    one = rl.one("{u}:k", lim)
    assert one.allowed and one.remaining == 0
    # the next token is at most a whole T away
    assert 1 <= one.reset_ms <= 100, one
    again = rl.one("{u}:k", lim)
    assert not again.allowed and again.remaining == 0

    # the bucket is full again tau (300 ms) after it was empty: then a whole burst passes
    sleep_ms(300)
    assert [rl.one("{u}:k", lim).allowed for _ in range(4)] == [True, True, True, False]


# --- TTLs --------------------------------------------------------------------------------


def test_every_written_key_has_a_bounded_ttl(rl, redis_client):
    limits = [
        ("{u}:fw", Limit("fw", 3, 1000)),
        ("{u}:sw", Limit("sw", 3, 2000)),
        ("{u}:sl", Limit("sl", 3, 3000)),
        ("{u}:tb", Limit("tb", 8, 4000, burst=2)),  # T = 500 ms, capacity 2
        ("{u}:shadow", Limit("sl", 1, 1000, shadow=True)),
    ]
    outcomes = []
    for _ in range(5):  # admitted twice, then tb (capacity 2) rejects; the shadow is over
        admitted, _ = rl.call(limits)
        outcomes.append(admitted)
        for key, lim in limits:
            ttl = redis_client.pttl(key)
            assert 0 < ttl <= lim.ttl_bound_ms(), (key, ttl)
    assert outcomes == [True, True, False, False, False]


# --- retry_after is honest ---------------------------------------------------------------

SHORT_CASES = {
    "fw": Limit("fw", 3, 150),
    "sw": Limit("sw", 3, 300),
    "sl": Limit("sl", 3, 200),
    "tb": Limit("tb", 3, 300, burst=2),
}


@pytest.mark.parametrize("lim", SHORT_CASES.values(), ids=SHORT_CASES.keys())
def test_waiting_retry_after_is_enough(rl, lim):
    for _ in range(3):  # later rounds start from partly drained / decayed state
        while (v := rl.one("{u}:k", lim)).allowed:
            pass
        assert 1 <= v.retry_after_ms <= lim.ttl_bound_ms()
        sleep_ms(v.retry_after_ms)
        assert rl.one("{u}:k", lim).allowed


@pytest.mark.parametrize(
    "stored_window,admit_at_window",
    [
        # the previous window is full, the current empty: wait until prev has decayed enough
        # (4 * (1 - e/W) + 1 <= 4 at e = W/4)
        pytest.param(-1, 0, id="prev_decays_in_this_window"),
        # the current window is full: it becomes prev next window and decays from there
        pytest.param(0, 1, id="cur_carries_into_next_window"),
    ],
)
def test_sw_retry_after_is_exact(rl, redis_client, stored_window, admit_at_window):
    lim = Limit("sw", 4, 400)
    w_us = lim.window_ms * 1000
    align_to_window_start(redis_client, lim.window_ms, offset_ms=20)
    before = redis_now_us(redis_client)
    idx = before // w_us
    redis_client.hset("{u}:k", mapping={"w": idx + stored_window, "c": 4, "p": 0})
    redis_client.pexpire("{u}:k", 800)

    v = rl.one("{u}:k", lim)
    after = redis_now_us(redis_client)
    assert after // w_us == idx, "test slept past the window it set up"
    assert not v.allowed and v.remaining == 0
    assert_ms_until(v.retry_after_ms, (idx + admit_at_window) * w_us + w_us // 4, before, after)
    # nothing remains: the next unit comes back when a request of cost 1 fits
    assert_ms_until(v.reset_ms, (idx + admit_at_window) * w_us + w_us // 4, before, after)
    sleep_ms(v.retry_after_ms)
    assert rl.one("{u}:k", lim).allowed


# --- odd stored state --------------------------------------------------------------------


@ALGOS
def test_missing_key_is_a_fresh_limit(rl, lim):
    v = rl.one("{u}:nothing-here", lim)
    assert v.allowed and v.remaining == lim.capacity - 1 and v.retry_after_ms == 0
    expected_reset = {
        "fw": lim.window_ms,
        "sl": lim.window_ms,
        "tb": math.ceil(lim.t_ms),
    }.get(lim.algo)
    if expected_reset is not None:
        assert v.reset_ms == expected_reset
    else:  # sw: the one hit comes back as it fades, by the end of the next aligned window
        assert lim.window_ms < v.reset_ms <= 2 * lim.window_ms


@pytest.mark.parametrize("lim", SHORT_CASES.values(), ids=SHORT_CASES.keys())
def test_reset_is_when_remaining_grows(rl, redis_client, lim):
    """reset_ms (the RateLimit header's `t`) is when the limit has more room than `remaining`
    says: a request right away leaves one unit less, one after reset_ms leaves at least as
    many as before. It is never later than the quota's window (two for a sliding window,
    whose hits fade over the next one), and 0 only when nothing is used."""
    fresh = rl.one("{u}:unused", lim, cost=0)
    assert fresh.allowed and fresh.remaining == lim.capacity and fresh.reset_ms in (0, lim.window_ms)
    first = rl.one("{u}:k", lim)
    assert first.allowed and first.remaining == lim.capacity - 1
    assert 0 < first.reset_ms <= (2 if lim.algo == "sw" else 1) * lim.window_ms, first
    sleep_ms(first.reset_ms)
    later = rl.one("{u}:k", lim)
    assert later.allowed and later.remaining >= first.remaining, (first, later)


@pytest.mark.parametrize("lim", SHORT_CASES.values(), ids=SHORT_CASES.keys())
def test_expired_key_is_a_fresh_limit(rl, redis_client, lim):
    while rl.one("{u}:k", lim).allowed:
        pass
    sleep_ms(lim.ttl_bound_ms())
    assert redis_client.exists("{u}:k") == 0
    v = rl.one("{u}:k", lim)
    assert v.allowed and v.remaining == lim.capacity - 1


@pytest.mark.parametrize("stored,allowed,after", [(5, False, b"5"), (2, True, b"3")],
                         ids=["over", "under"])
def test_fw_counter_without_ttl_is_repaired(rl, redis_client, stored, allowed, after):
    lim = Limit("fw", 5, 1000)
    redis_client.set("{u}:k", stored)  # e.g. written by hand or by an old buggy client
    assert redis_client.pttl("{u}:k") == -1

    v = rl.one("{u}:k", lim)
    assert v.allowed is allowed
    assert redis_client.get("{u}:k") == after
    assert 0 < redis_client.pttl("{u}:k") <= 1000
    if not allowed:
        assert 1 <= v.retry_after_ms <= 1000


def test_sw_stale_window_is_ignored(rl, redis_client):
    lim = Limit("sw", 5, LONG)
    redis_client.hset("{u}:k", mapping={"w": 1, "c": 100, "p": 100})
    redis_client.pexpire("{u}:k", LONG)
    v = rl.one("{u}:k", lim)
    assert v.allowed and v.remaining == 4


def test_tb_tat_in_the_past_is_a_full_bucket(rl, redis_client):
    lim = Limit("tb", 10, LONG, burst=4)
    redis_client.set("{u}:k", redis_now_us(redis_client) - 3_600_000_000, px=LONG)
    v = rl.one("{u}:k", lim)
    assert v.allowed and v.remaining == 3


def test_leased_quota_slices_never_exceed_the_limit(redis_client):
    """algo "lq": each admitted call takes an eighth of what is left (at least the cost), and
    reports the slice as `remaining`; the slices of a window add up to at most the limit."""
    script = register(redis_client, SCRIPT)
    key = "cg:{t}:lq"
    slices = []
    for i in range(40):
        reply = [int(v) for v in script(keys=[key], args=[
            "1", f"n{i}", "lq", "50", "60000", "50", "0", "1", "0"])]
        if reply[0] == 0:
            assert reply[1] == 0 and reply[4] >= 1, reply  # rejected: retry after the window
            break
        slices.append(reply[2])
    assert slices[:3] == [6, 5, 4], slices  # 50 // 8, 44 // 8, 39 // 8
    assert sum(slices) == 50, slices
    assert int(redis_client.get(key)) == 50
    assert 0 < redis_client.pttl(key) <= 60000


# --- the fixed-window fast path says and writes what the general code does ----------------------


def general_only() -> str:
    """acquire.lua without its fast path: every call through the general code."""
    src = SCRIPT
    start = src.index("-- Fast path:")
    end = src.index("local function bad")
    assert "redis.call('INCRBY'" in src[start:end]
    return src[:start] + src[end:]


# (stored value or None, stored TTL ms or None, limit, cost), each run once by each script
FAST_PATH_CASES = {
    "new counter": (None, None, 5, 1),
    "new counter, cost 3": (None, None, 5, 3),
    "new counter, cost over the limit": (None, None, 5, 6),
    "room left": (2, LONG, 5, 1),
    "exactly fills it": (4, LONG, 5, 1),
    "full": (5, LONG, 5, 1),
    "cost does not fit": (3, LONG, 5, 3),
    "over the limit already": (9, LONG, 5, 1),
    "no TTL, room left": (2, None, 5, 1),
    "no TTL, full": (5, None, 5, 1),
    "negative (refunded)": (-2, LONG, 5, 1),
}


@pytest.mark.parametrize("case", FAST_PATH_CASES.values(), ids=FAST_PATH_CASES.keys())
def test_fw_fast_path_replies_and_writes_as_the_general_code(redis_client, case):
    stored, ttl_ms, limit, cost = case
    lim = Limit("fw", limit, LONG)
    scripts = {"fast": register(redis_client, SCRIPT),
               "general": register(redis_client, general_only())}
    seen = {}
    for name, script in scripts.items():
        key = f"{{u}}:{name}"
        if stored is not None:
            redis_client.set(key, stored, px=ttl_ms)
        reply = script(keys=[key], args=[1, "n", *lim.argv(cost), "0", "0"])
        value, pttl = redis_client.get(key), redis_client.pttl(key)
        seen[name] = (reply, value, pttl)
    (fast, f_value, f_pttl), (general, g_value, g_pttl) = seen["fast"], seen["general"]
    # reset_ms and the PTTL may differ by the few ms between the two calls
    assert fast[:3] == general[:3] and abs(fast[3] - general[3]) <= 50, seen
    assert (fast[4] == 0) == (general[4] == 0) and abs(fast[4] - general[4]) <= 50, seen
    # a counter the rejection took back to nothing is deleted by the fast path, left at 0 by
    # the general code (which never wrote it): the same window either way
    if g_value == b"0" and stored in (None, 0):
        assert f_value is None, seen
    else:
        assert f_value == g_value and abs(f_pttl - g_pttl) <= 50, seen
    assert f_pttl <= LONG


def test_fw_fast_path_leaves_other_calls_to_the_general_code(redis_client):
    """A cost of 0, a shadow limit or a bad argument is not the fast path's: the general code
    answers (and rejects a bad argument with its own message)."""
    script = register(redis_client, SCRIPT)
    zero = script(keys=["{u}:z"], args=[1, "n", *Limit("fw", 5, LONG).argv(0), "0", "0"])
    assert zero == [1, 1, 5, LONG, 0] and redis_client.exists("{u}:z") == 0
    redis_client.set("{u}:s", 5, px=LONG)
    shadow = script(keys=["{u}:s"], args=[1, "n", *Limit("fw", 5, LONG, shadow=True).argv(1),
                                          "0", "0"])
    assert shadow[:3] == [1, 0, 0] and redis_client.get("{u}:s") == b"5"
    for bad in (["fw", 5, LONG, 1, "0", 1.5], ["fw", 5, "inf", 1, "0", 1],
                ["fw", 0, LONG, 1, "0", 1], ["fw", 5, LONG, "x", "0", 1]):
        with pytest.raises(Exception, match="acquire.lua: ARGV"):
            script(keys=["{u}:b"], args=[1, "n", *bad, "0", "0"])
        assert redis_client.exists("{u}:b") == 0


def test_fw_fast_path_reads_a_cost_as_the_general_code_does(redis_client):
    """A cost spelled "02" is 2 to both paths (Redis's INCRBY would refuse the string)."""
    script = register(redis_client, SCRIPT)
    reply = script(keys=["{u}:c"], args=[1, "n", "fw", 5, LONG, 1, "0", "02", "0", "0"])
    assert reply[:3] == [1, 1, 3] and redis_client.get("{u}:c") == b"2"
