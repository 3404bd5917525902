"""The `peek` script (acquire.lua with its PEEK local true, src/redis/scripts/mod.rs) against a
real redis-server: for each algorithm it says what the next acquire of the same arguments would
say, and it writes nothing (DUMP and PTTL of every key compared before and after; Redis itself
refuses any write under EVAL_RO). `cg-admin limits` reads each limit's state with it.

Windows are long (60 s) so that nothing refills between a peek and the acquire after it; where
a value depends on when the script ran, the two are compared within the Redis time between
them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import pytest
import redis

from harness.scripts import Verdict, new_tag, redis_now_us, script_source, untag

ACQUIRE = script_source("acquire")
PEEK = script_source("peek")
LONG = 60_000


@dataclass(frozen=True)
class Limit:
    algo: str
    limit: int
    window_ms: int
    burst: int | None = None
    shadow: bool = False

    @property
    def capacity(self) -> int:
        return self.burst if self.algo == "tb" and self.burst else self.limit

    def argv(self, cost: int = 1) -> list:
        return [self.algo, self.limit, self.window_ms, self.burst or self.limit,
                "1" if self.shadow else "0", cost]


CASES = {
    "fw": Limit("fw", 4, LONG),
    "lq": Limit("lq", 40, LONG),
    "sw": Limit("sw", 4, LONG),
    "sl": Limit("sl", 4, LONG),
    "tb": Limit("tb", 10, LONG, burst=4),  # T = 6 s: no refill within a test
    "cc": Limit("cc", 3, LONG),
}
ALGOS = pytest.mark.parametrize("lim", CASES.values(), ids=CASES.keys())


def call(r, source: str, limits: list[tuple[str, Limit]], cost: int = 1, ro: bool = False,
         tail: list | None = None) -> tuple[bool, list[Verdict]]:
    argv: list = [len(limits), uuid.uuid4().hex]
    for _, lim in limits:
        argv += lim.argv(cost)
    argv += tail if tail is not None else ["0"]
    keys = [k for k, _ in limits]
    command = "EVAL_RO" if ro else "EVAL"
    tag = new_tag()
    reply = untag(r.execute_command(command, source, len(keys), *keys, tag, *argv), tag)
    assert len(reply) == 1 + 4 * len(limits), reply
    verdicts = [Verdict(bool(reply[1 + 4 * i]), *reply[2 + 4 * i: 5 + 4 * i])
                for i in range(len(limits))]
    return bool(reply[0]), verdicts


def snapshot(r, keys: list[str]) -> dict[str, tuple]:
    """Every key's serialized value and PTTL."""
    return {k: (r.dump(k), r.pttl(k)) for k in keys}


def assert_unchanged(before: dict, after: dict, elapsed_ms: int) -> None:
    """Values byte for byte the same; a TTL only ran down (a write would have set it again)."""
    for key, (value, ttl) in before.items():
        value2, ttl2 = after[key]
        assert value2 == value, key
        if ttl < 0:
            assert ttl2 == ttl, (key, ttl, ttl2)
        else:
            assert ttl - elapsed_ms <= ttl2 <= ttl, (key, ttl, ttl2)


def fill(r, key: str, lim: Limit, n: int) -> None:
    for _ in range(n):
        admitted, _ = call(r, ACQUIRE, [(key, lim)])
        assert admitted


def peek_then_acquire(r, limits: list[tuple[str, Limit]]):
    """peek (checked to write nothing), then acquire; both replies and the Redis time between."""
    keys = [k for k, _ in limits]
    t0 = redis_now_us(r)
    before = snapshot(r, keys)
    peeked = call(r, PEEK, limits)
    after = snapshot(r, keys)
    assert_unchanged(before, after, (redis_now_us(r) - t0) // 1000 + 1)
    acquired = call(r, ACQUIRE, limits)
    t2 = redis_now_us(r)
    return peeked, acquired, (t2 - t0) // 1000 + 1


def assert_says_the_same(lim: Limit, peek: Verdict, acq: Verdict, slack_ms: int,
                         admitted: bool = True) -> None:
    """What peek said of a limit against what the acquire right after said (`admitted`: the
    acquire's call admitted the request, so a limit that allowed it consumed)."""
    assert peek.allowed == acq.allowed
    if not (acq.allowed and admitted):  # nothing written: the same state, a moment later
        assert peek.remaining == acq.remaining
        assert abs(peek.reset_ms - acq.reset_ms) <= slack_ms, (peek, acq)
        assert abs(peek.retry_after_ms - acq.retry_after_ms) <= slack_ms, (peek, acq)
        return
    assert peek.retry_after_ms == 0
    if lim.algo == "lq":  # the acquire answers the slice it took, at most what was left
        assert 1 <= acq.remaining <= peek.remaining
    else:  # the same state less the request's unit
        assert acq.remaining == peek.remaining - 1, (peek, acq)


def away_from_a_window_end(r, window_ms: int, margin_ms: int = 2000) -> None:
    """Sleeps past the end of the current aligned window when it ends within `margin_ms`: a
    sliding window's count would roll over between a peek and the acquire after it."""
    w = window_ms * 1000
    now = redis_now_us(r)
    left_us = (now // w + 1) * w - now
    if left_us < margin_ms * 1000:
        time.sleep(left_us / 1e6 + 0.01)


@ALGOS
def test_peek_says_what_the_next_acquire_says_and_writes_nothing(redis_client, lim):
    key = f"cg:peek:{{t.x}}:{lim.algo}"
    away_from_a_window_end(redis_client, lim.window_ms)
    fresh, _, _ = peek_then_acquire(redis_client, [(key, lim)])
    assert fresh[0] and fresh[1][0].remaining == lim.capacity
    if lim.algo == "lq":
        # The first acquire took a slice of an eighth: the counter is that far on.
        assert call(redis_client, PEEK, [(key, lim)])[1][0].remaining == lim.limit - 5
        return
    # From one used up to over the limit: each peek reads what the acquire after it says.
    for used in range(1, lim.capacity + 2):
        (p_adm, [p]), (a_adm, [a]), slack = peek_then_acquire(redis_client, [(key, lim)])
        assert p_adm == a_adm
        assert_says_the_same(lim, p, a, slack, a_adm)
        assert p.remaining == max(0, lim.capacity - used), (used, p)
        assert p.allowed == (used < lim.capacity)


def test_a_fresh_limit_creates_no_key(redis_client):
    keys = [(f"cg:peek:{{t.x}}:{name}", lim) for name, lim in CASES.items()]
    admitted, verdicts = call(redis_client, PEEK, keys)
    assert admitted
    assert [v.remaining for v in verdicts] == [lim.capacity for _, lim in keys]
    assert redis_client.exists(*[k for k, _ in keys]) == 0


def test_one_rejecting_limit_peeks_as_the_rejected_acquire(redis_client):
    small, big = Limit("fw", 2, LONG), Limit("sl", 10, LONG)
    limits = [("cg:peek:{t.x}:small", small), ("cg:peek:{t.x}:big", big)]
    for _ in range(2):
        assert call(redis_client, ACQUIRE, limits)[0]
    (p_adm, peek), (a_adm, acq), slack = peek_then_acquire(redis_client, limits)
    assert (p_adm, a_adm) == (False, False)
    for lim, p, a in zip((small, big), peek, acq):
        assert_says_the_same(lim, p, a, slack, admitted=False)
    assert [p.remaining for p in peek] == [0, 8]


def test_a_shadow_limit_over_its_limit_still_admits(redis_client):
    lim = Limit("fw", 1, LONG, shadow=True)
    key = "cg:peek:{t.x}:shadow"
    fill(redis_client, key, lim, 2)
    admitted, [v] = call(redis_client, PEEK, [(key, lim)])
    assert admitted and not v.allowed and v.remaining == 0


def test_peek_makes_no_repair_of_a_counter_without_ttl(redis_client):
    key = "cg:peek:{t.x}:fw"
    redis_client.set(key, 3)
    admitted, [v] = call(redis_client, PEEK, [(key, Limit("fw", 5, LONG))])
    assert admitted and v.remaining == 2 and v.reset_ms == LONG  # what the repair would set
    assert redis_client.pttl(key) == -1 and redis_client.get(key) == b"3"
    call(redis_client, ACQUIRE, [(key, Limit("fw", 5, LONG))])
    assert 0 < redis_client.pttl(key) <= LONG  # acquire repairs it


def test_peek_leaves_expired_slots_and_stale_windows_in_place(redis_client):
    cc, sw = Limit("cc", 3, LONG), Limit("sw", 4, 1000)
    cc_key, sw_key = "cg:peek:{t.x}:cc", "cg:peek:{t.x}:sw"
    now = redis_now_us(redis_client)
    # One slot expired a second ago (acquire would remove it), one held; a window long gone.
    redis_client.zadd(cc_key, {"gone": now - 1_000_000, "held": now + 60_000_000})
    redis_client.hset(sw_key, mapping={"w": now // 1_000_000 - 5, "c": 4, "p": 4})
    before = snapshot(redis_client, [cc_key, sw_key])
    assert call(redis_client, PEEK, [(cc_key, cc)])[1][0].remaining == 2
    assert call(redis_client, PEEK, [(sw_key, sw)])[1][0].remaining == 4
    assert_unchanged(before, snapshot(redis_client, [cc_key, sw_key]), 1000)


@ALGOS
def test_redis_runs_peek_as_a_read_only_script(redis_client, lim):
    key = f"cg:peek:{{t.x}}:{lim.algo}"
    fill(redis_client, key, lim, 2)
    ro = call(redis_client, PEEK, [(key, lim)], ro=True)
    assert ro[0] and ro[1][0].remaining == (lim.limit - 5 - 4 if lim.algo == "lq"
                                             else lim.capacity - 2)
    # The same call of acquire writes, which EVAL_RO refuses.
    with pytest.raises(redis.ResponseError, match="[Ww]rite commands are not allowed"):
        call(redis_client, ACQUIRE, [(key, lim)], ro=True)


def test_peek_refuses_the_record_and_the_lease(redis_client):
    lim = Limit("fw", 5, LONG)
    with pytest.raises(redis.ResponseError, match="peek reads rate limits only"):
        redis_client.execute_command(
            "EVAL", PEEK, 2, "cg:peek:{t.x}:fw", "cg:peek:{t.x}:idem", new_tag(),
            1, "n", *lim.argv(), "1", "sha256:" + "a" * 64, "o" * 32, 1000)
    assert redis_client.exists("cg:peek:{t.x}:fw", "cg:peek:{t.x}:idem") == 0
