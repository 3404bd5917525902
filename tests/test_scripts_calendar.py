"""Calendar-aligned windows (`align: "calendar"`) in the scripts, against a real redis-server:
piece_calendar.lua's period against Python's zoneinfo for zones of every kind of rule, and
acquire.lua, charge.lua and peek counting in calendar days, weeks and months across a month's
end, a daylight saving change and February 29.

Redis TIME is under the test's control: each call runs the script as the filter runs it behind
a test-only first line that moves what `redis.call('TIME')` reads by an offset
(harness/scripts.py, clock_shifted), so the script sees 2025-01-31 23:59:58 in Berlin while
keys expire on Redis's own clock, which moves at the same rate. The specs the scripts are
called with are the filter's own: `cg-admin explain` writes them into the keys it prints.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import time
import uuid
from zoneinfo import ZoneInfo

import pytest
import redis

from harness.admin import run
from harness.calendar import boundaries, changes, period_of, zone_object
from harness.scripts import LUA, clock_shifted, new_tag, redis_now_us, script_source, untag

ANY_REDIS = "redis://127.0.0.1:1"  # explain reads no key

# Zones of every kind of rule: fixed offsets (whole, half and three-quarter hours, +14, -11),
# northern and southern daylight saving, a negative one (Dublin), changes at 24:00 (Santiago,
# Cairo), at midnight (Havana, Beirut: midnight skipped; Beirut's autumn repeats 23:00), at
# -1:00 (Nuuk), at 26:00 (Jerusalem), half-hour daylight saving (Lord Howe), +12:45 (Chatham).
ZONES = ("UTC", "Europe/Berlin", "America/New_York", "Australia/Sydney", "Europe/Dublin",
         "America/Santiago", "America/Havana", "Asia/Beirut", "America/Nuuk", "Asia/Jerusalem",
         "Pacific/Chatham", "Australia/Lord_Howe", "Asia/Kathmandu", "America/St_Johns",
         "Africa/Cairo", "Pacific/Kiritimati", "Pacific/Pago_Pago")
PERIODS = ("1d", "1w", "1mo")
FIRST, LAST = dt.date(2024, 1, 1), dt.date(2030, 12, 31)  # two February 29ths
BERLIN = "Europe/Berlin"
S = 1_000_000  # µs per second


# --- the filter's specs --------------------------------------------------------------------------


def limit_name(zone: str, period: str) -> str:
    return f"{zone.replace('/', '-').replace('_', '-')}-{period}"


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> dict[tuple[str, str], str]:
    """The spec of every (zone, period), as the filter writes it: the window part of the keys
    `cg-admin explain` prints for a configuration with one limit each."""
    limits = [{"name": limit_name(zone, period), "by": [], "algorithm": "fixed_window",
               "limit": 1, "window": period, "align": "calendar", "zone": zone_object(zone)}
              for zone in ZONES for period in PERIODS]
    config = tmp_path_factory.mktemp("calendar") / "plugin.json"
    config.write_text(json.dumps({"redis": {"cluster": "gw", "key_prefix": "cg"},
                                  "policies": [{"name": "p", "rate_limits": limits}]}))
    r = run(config, ANY_REDIS, "--json", "explain", "--tenant", "t", "--method", "GET",
            "--path", "/")
    assert r.returncode == 0, r.stderr
    keys = {l["name"]: l["key"] for l in json.loads(r.stdout)["limits"]}
    out = {}
    for zone in ZONES:
        for period in PERIODS:
            # cg:rl:{p.p}:p:<name>:fw:1/<spec>:_
            window = keys[limit_name(zone, period)].split(":fw:1/", 1)[1]
            out[zone, period] = window.removesuffix(":_")
    assert out[BERLIN, "1mo"] == "1mo@3600,7200,M3.5.0/7200,M10.5.0/10800", out[BERLIN, "1mo"]
    assert out["UTC", "1d"] == "1d@0"
    return out


# --- piece_calendar.lua against zoneinfo ---------------------------------------------------------


PERIOD_SCRIPT = LUA.joinpath("piece_calendar.lua").read_text() + """
local z = calendar_zone(ARGV[1])
if not z then return redis.error_reply('not a calendar spec: ' .. tostring(ARGV[1])) end
local out = {}
for i = 2, #ARGV do
  local start, stop = calendar_period(z, tonumber(ARGV[i]))
  out[#out + 1] = start
  out[#out + 1] = stop
end
return out
"""


def lua_periods(r, spec: str, moments_us: list[int]) -> list[tuple[int, int]]:
    reply = r.eval(PERIOD_SCRIPT, 0, spec, *moments_us)
    return list(zip(reply[0::2], reply[1::2]))


@pytest.mark.parametrize("zone", ZONES)
def test_the_period_is_the_zones_calendar_day_week_and_month(redis_client, specs, zone):
    """Every period start from 2024 to 2030, a second either side of it, a second either side of
    every offset change, and random moments: the script's period is zoneinfo's."""
    rng = random.Random(zone)
    shifts = changes(zone, FIRST, LAST)
    if zone in ("UTC", "Asia/Kathmandu", "Pacific/Kiritimati", "Pacific/Pago_Pago"):
        assert shifts == [], shifts
    else:
        assert len(shifts) >= 10, shifts  # the rule's changes, twice a year
    for period in PERIODS:
        starts = boundaries(zone, period, FIRST, LAST)
        moments = {b + d for b in starts[1:-1] for d in (-1, 0, 1)}
        moments |= {c + d for c in shifts for d in (-1, 0, 1) if starts[1] <= c + d < starts[-1]}
        moments |= {rng.randrange(starts[1], starts[-1]) for _ in range(300)}
        moments = sorted(moments)
        # µs inside a second: the period of 12:00:00.999999 is the one of 12:00:00
        got = lua_periods(redis_client, specs[zone, period],
                          [m * S + rng.randrange(S) for m in moments])
        for m, (start, stop) in zip(moments, got):
            want = period_of(zone, period, m)
            assert (start // S, stop // S) == want, (zone, period, m, start, stop, want)
            assert start % S == 0 and stop % S == 0


def test_the_days_that_clocks_change_on(redis_client, specs):
    """Berlin's spring day lasts 23 hours and its autumn day 25; February 29 is a day of its
    own; Havana's spring day starts at 01:00 (its change skips midnight)."""
    berlin = ZoneInfo(BERLIN)

    def day(spec, y, m, d, zone=berlin):
        noon = dt.datetime(y, m, d, 12, tzinfo=zone)
        ((start, stop),) = lua_periods(redis_client, spec, [int(noon.timestamp()) * S])
        return (dt.datetime.fromtimestamp(start // S, zone), (stop - start) // S / 3600)

    assert day(specs[BERLIN, "1d"], 2025, 3, 30) == (dt.datetime(2025, 3, 30, tzinfo=berlin), 23)
    assert day(specs[BERLIN, "1d"], 2025, 10, 26) == (dt.datetime(2025, 10, 26, tzinfo=berlin), 25)
    assert day(specs[BERLIN, "1d"], 2028, 2, 29) == (dt.datetime(2028, 2, 29, tzinfo=berlin), 24)
    assert day(specs[BERLIN, "1mo"], 2028, 2, 29) == (dt.datetime(2028, 2, 1, tzinfo=berlin),
                                                      29 * 24)
    assert day(specs[BERLIN, "1mo"], 2025, 3, 10) == (dt.datetime(2025, 3, 1, tzinfo=berlin),
                                                      31 * 24 - 1)
    assert day(specs[BERLIN, "1w"], 2025, 3, 30) == (dt.datetime(2025, 3, 24, tzinfo=berlin),
                                                     7 * 24 - 1)
    havana = ZoneInfo("America/Havana")
    start, hours = day(specs["America/Havana", "1d"], 2025, 3, 9, havana)
    assert (start.isoformat(), hours) == ("2025-03-09T01:00:00-04:00", 23)


def test_time_repeated_across_midnight_belongs_to_the_new_day(redis_client):
    """A rule no zone has today: daylight time ends at 00:30, so the clock reads October 26,
    00:00-00:30 and then October 25, 23:30-24:00 again. The day of October 26 starts at the
    first midnight; the repeated half hour is already in it, and it ends 25 hours later."""
    spec = "1d@3600,7200,M3.5.0/7200,M10.5.0/1800"
    first_midnight = int(dt.datetime(2025, 10, 25, 22, tzinfo=dt.timezone.utc).timestamp())
    repeated = first_midnight + 45 * 60  # the clock reads October 25, 23:45 again
    got = [(start // S, stop // S) for start, stop in lua_periods(
        redis_client, spec, [(first_midnight - 1) * S, repeated * S, (first_midnight + 3600) * S])]
    oct_27 = int(dt.datetime(2025, 10, 26, 23, tzinfo=dt.timezone.utc).timestamp())
    assert got == [(first_midnight - 86400, first_midnight),
                   (first_midnight, oct_27), (first_midnight, oct_27)], got
    assert (oct_27 - first_midnight) / 3600 == 25


@pytest.mark.parametrize("spec", [
    "1y@0", "2d@0", "1d", "1d@", "1mo@x", "1mo@99999", "1mo@3600,7200", "1mo@3600,7200,M3.5.0",
    "1mo@3600,7200,M13.5.0/0,M10.5.0/0", "1mo@3600,7200,M3.6.0/0,M10.5.0/0",
    "1mo@3600,7200,J0/0,M10.5.0/0", "1mo@3600,7200,366/0,M10.5.0/0",
    "1mo@3600,7200,M3.5.0/601201,M10.5.0/0", "1mo@3600,7200,M3.5.0,M10.5.0", "60000"])
def test_what_is_not_a_calendar_spec_is_refused(redis_client, spec):
    with pytest.raises(redis.ResponseError, match="not a calendar spec"):
        redis_client.eval(PERIOD_SCRIPT, 0, spec, 0)


# --- acquire.lua, charge.lua and peek with Redis TIME moved ------------------------------------


class Scripts:
    """acquire, peek and charge as the filter runs them, at a moment the test picks."""

    def __init__(self, r):
        self.r = r
        self.offset_us = 0
        self.sources = {name: script_source(name) for name in ("acquire", "peek", "charge")}

    def set(self, when: dt.datetime) -> None:
        """From now on the scripts' clock reads `when` (and moves on from there)."""
        self.offset_us = int(when.timestamp() * S) - redis_now_us(self.r)

    def now_us(self) -> int:
        return redis_now_us(self.r) + self.offset_us

    def call(self, name: str, keys: list, args: list):
        tag = new_tag()
        return untag(self.r.eval(clock_shifted(self.sources[name], self.offset_us), len(keys),
                                 *keys, tag, *args), tag)

    def acquire(self, key: str, spec: str, limit: int, cost: int = 1, algo: str = "fw",
                script: str = "acquire") -> tuple[int, int, int, int, int]:
        """(admitted, allowed, remaining, reset_ms, retry_after_ms) of one calendar limit."""
        reply = self.call(script, [key], [1, uuid.uuid4().hex, algo, limit, spec, limit, "0",
                                          cost, "0"])
        assert len(reply) == 5, reply
        return tuple(reply)


@pytest.fixture
def s(redis_client) -> Scripts:
    return Scripts(redis_client)


def key() -> str:
    return f"cg:cal:{{t.{uuid.uuid4().hex[:8]}}}:k"


def ms_until(end_s: int, before_us: int, after_us: int) -> tuple[int, int]:
    """The range a script's "ms until end" falls in when it ran between before and after."""
    return (end_s * S - after_us) // 1000, -(-(end_s * S - before_us) // 1000)


def test_a_monthly_quota_starts_again_at_the_first_midnight_of_the_month_in_its_zone(s, specs):
    berlin, k, spec = ZoneInfo(BERLIN), key(), specs[BERLIN, "1mo"]
    feb = int(dt.datetime(2025, 2, 1, tzinfo=berlin).timestamp())
    mar = int(dt.datetime(2025, 3, 1, tzinfo=berlin).timestamp())
    s.set(dt.datetime(2025, 1, 31, 23, 59, 58, tzinfo=berlin))  # 22:59:58 UTC: not UTC's end
    before = s.now_us()
    replies = [s.acquire(k, spec, 3) for _ in range(4)]
    after = s.now_us()
    lo, hi = ms_until(feb, before, after)
    assert [r[:3] for r in replies] == [(1, 1, 2), (1, 1, 1), (1, 1, 0), (0, 0, 0)], replies
    for _, _, _, reset_ms, _ in replies:
        assert lo <= reset_ms <= hi, (reset_ms, lo, hi)
    assert lo <= replies[3][4] <= hi, replies[3]  # retry after: the month's end
    assert s.r.get(k) == b"3" and 0 < s.r.pttl(k) <= hi

    time.sleep((feb * S - s.now_us()) / S + 0.3)  # Redis TIME passes February 1, 00:00 Berlin
    before = s.now_us()
    assert before >= feb * S
    admitted, allowed, remaining, reset_ms, retry = s.acquire(k, spec, 3)
    after = s.now_us()
    lo, hi = ms_until(mar, before, after)
    assert (admitted, allowed, remaining, retry) == (1, 1, 2, 0)
    assert lo <= reset_ms <= hi and reset_ms > 27 * 86_400_000, reset_ms
    # The counter is February's, and lives until March 1, 00:00 Berlin.
    assert s.r.get(k) == b"1" and hi - 5_000 <= s.r.pttl(k) <= hi


def test_a_daily_quota_crosses_into_february_29(s, specs):
    zone, k, spec = ZoneInfo("America/New_York"), key(), specs["America/New_York", "1d"]
    leap_day = int(dt.datetime(2028, 2, 29, tzinfo=zone).timestamp())
    s.set(dt.datetime(2028, 2, 28, 23, 59, 59, tzinfo=zone))
    assert s.acquire(k, spec, 1)[:3] == (1, 1, 0)
    rejected = s.acquire(k, spec, 1)
    assert rejected[:2] == (0, 0) and 1 <= rejected[4] <= 1000, rejected
    time.sleep((leap_day * S - s.now_us()) / S + 0.3)
    before = s.now_us()
    admitted, _, remaining, reset_ms, _ = s.acquire(k, spec, 1)
    lo, hi = ms_until(leap_day + 86400, before, s.now_us())
    assert (admitted, remaining) == (1, 0) and lo <= reset_ms <= hi, reset_ms
    # The month of February 29: until March 1, 00:00 New York, from its noon 12 hours later.
    s.set(dt.datetime(2028, 2, 29, 12, tzinfo=zone))
    before = s.now_us()
    reset_ms = s.acquire(key(), specs["America/New_York", "1mo"], 5)[3]
    lo, hi = ms_until(leap_day + 86400, before, s.now_us())
    assert lo <= reset_ms <= hi and abs(reset_ms - 12 * 3_600_000) < 5_000, reset_ms


@pytest.mark.parametrize("day,hours", [((2025, 3, 30), 23), ((2025, 10, 26), 25)])
def test_a_day_when_clocks_change_lasts_as_long_as_it_does(s, specs, day, hours):
    berlin = ZoneInfo(BERLIN)
    start = dt.datetime(*day, tzinfo=berlin)
    s.set(start + dt.timedelta(seconds=10))
    before = s.now_us()
    k = key()
    reply = s.acquire(k, specs[BERLIN, "1d"], 2)
    end = int(start.timestamp()) + hours * 3600
    lo, hi = ms_until(end, before, s.now_us())
    assert reply[:3] == (1, 1, 1) and lo <= reply[3] <= hi, reply
    assert hi - 5_000 <= s.r.pttl(k) <= hi


def test_a_week_ends_on_sunday_night_in_the_zone(s, specs):
    zone = ZoneInfo("Asia/Kathmandu")
    s.set(dt.datetime(2025, 3, 30, 23, 59, 50, tzinfo=zone))  # a Sunday
    before = s.now_us()
    reset_ms = s.acquire(key(), specs["Asia/Kathmandu", "1w"], 9)[3]
    monday = int(dt.datetime(2025, 3, 31, tzinfo=zone).timestamp())
    lo, hi = ms_until(monday, before, s.now_us())
    assert lo <= reset_ms <= hi and reset_ms <= 10_000, reset_ms


def test_a_leased_calendar_quota_hands_out_slices_until_the_period_ends(s, specs):
    berlin = ZoneInfo(BERLIN)
    s.set(dt.datetime(2025, 6, 30, 18, tzinfo=berlin))
    k = key()
    admitted, allowed, granted, reset_ms, _ = s.acquire(k, specs[BERLIN, "1mo"], 800, algo="lq")
    assert (admitted, allowed, granted) == (1, 1, 100)  # an eighth of what is left
    assert abs(reset_ms - 6 * 3_600_000) < 5_000, reset_ms
    assert s.r.get(k) == b"100" and abs(s.r.pttl(k) - 6 * 3_600_000) < 5_000


def test_peek_answers_the_periods_end_and_writes_nothing(s, specs):
    berlin, k = ZoneInfo(BERLIN), key()
    s.set(dt.datetime(2025, 12, 31, 23, 0, tzinfo=berlin))
    reply = s.acquire(k, specs[BERLIN, "1mo"], 5, script="peek")
    assert reply[:3] == (1, 1, 5) and abs(reply[3] - 3_600_000) < 5_000, reply
    assert s.r.exists(k) == 0
    # A counter without a TTL is reported, not repaired, by a peek; acquire gives it one that
    # ends with the period.
    s.r.set(k, 2)
    assert s.acquire(k, specs[BERLIN, "1mo"], 5, script="peek")[2] == 3
    assert s.r.pttl(k) == -1
    assert s.acquire(k, specs[BERLIN, "1mo"], 5)[2] == 2
    assert abs(s.r.pttl(k) - 3_600_000) < 5_000


def test_a_charge_opens_a_calendar_window_until_the_period_ends(s, specs):
    berlin, k = ZoneInfo(BERLIN), key()
    s.set(dt.datetime(2025, 1, 31, 12, tzinfo=berlin))
    assert s.call("charge", [k], [1, "fw", 1000, specs[BERLIN, "1d"], 40]) == [40]
    assert s.r.get(k) == b"40" and abs(s.r.pttl(k) - 12 * 3_600_000) < 5_000
    # Then counted by acquire in the same period.
    assert s.acquire(k, specs[BERLIN, "1d"], 1000)[2] == 959


@pytest.mark.parametrize("args", [
    ["sw", 10, "1mo@0", 10, "0", 1],  # a calendar window on another algorithm
    ["fw", 10, "1mo@3600,7200,M13.5.0/0,M10.5.0/0", 10, "0", 1],
    ["fw", 10, "1y@0", 10, "0", 1],
])
def test_a_bad_calendar_argument_fails_before_any_write(s, args):
    k = key()
    with pytest.raises(redis.ResponseError, match=r"acquire.lua: ARGV\[5\]"):
        s.call("acquire", [k], [1, "n", *args, "0"])
    assert s.r.exists(k) == 0
    with pytest.raises(redis.ResponseError, match=r"charge.lua: ARGV\[4\]"):
        s.call("charge", [k], [1, *args[:3], 5])
    assert s.r.exists(k) == 0


def test_a_calendar_limit_cannot_be_counted_with_an_override(s):
    k, ovr = key(), key()
    s.r.set(ovr, "5/1000")
    with pytest.raises(redis.ResponseError, match="has a calendar window"):
        s.call("acquire", [k, ovr], [1, "n", "fw", 10, "1d@0", 10, "0", 1, "0", "0", 1, 1, 1])
    assert s.r.exists(k) == 0
