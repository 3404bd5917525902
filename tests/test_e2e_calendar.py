"""Calendar quotas end to end (`align: "calendar"`): real Envoy running the filter, webdis,
redis-server (single and Cluster), the counting upstream. A quota per calendar day, week or
month in a zone answers `RateLimit` with `t` counting to the real end of that day, week or
month in the zone, and `Retry-After` on its `429` likewise; `RateLimit-Policy` gives no `w` for
it. Expectations come from Redis TIME read around each request and Python's zoneinfo.

Redis TIME is the real one here (the script tests move it: test_scripts_calendar.py), so the
daily quota's zone is picked for the moment the test runs: the fixed offset whose local time
is nearest to noon, so its midnight is hours away either side.
"""

from __future__ import annotations

import datetime as dt
import math
import re

import pytest

from harness.calendar import period_of, zone_object
from harness.envoy import Response
from harness.stack import Stack
from test_e2e_lease import redis_now_us, uid

pytestmark = pytest.mark.topologies("single", "cluster")

TENANT = "x-tenant-id"
BERLIN = "Europe/Berlin"
ITEM = re.compile(r'"([A-Za-z0-9_-]+)";r=(\d+);t=(\d+)')


@pytest.fixture(scope="module")
def shared(tmp_path_factory, topology):
    stack = Stack(tmp_path_factory.mktemp("calendar-e2e"), None, envoys=0,
                  **topology.stack_kwargs).start()
    yield stack
    stack.stop()


def noon_offset(now_us: int) -> tuple[str, int]:
    """The fixed offset (a multiple of 15 minutes, within -12:00..+14:00) whose local time is
    nearest to noon now: its spelling and its seconds east of UTC."""
    minutes = (now_us // 60_000_000) % 1440
    offset = round((720 - minutes) / 15) * 15
    if offset > 14 * 60:
        offset -= 1440
    if offset < -12 * 60:
        offset += 1440
    sign = "-" if offset < 0 else "+"
    return f"{sign}{abs(offset) // 60:02d}:{abs(offset) % 60:02d}", offset * 60


def day_end(now_s: float, offset_s: int) -> int:
    """The next local midnight after now_s in a fixed offset, in seconds."""
    return (math.floor((now_s + offset_s) / 86400) + 1) * 86400 - offset_s


def t_range(ends, before_us: int, after_us: int) -> range:
    """The `t` (whole seconds, rounded up) of a reset at `ends(now_s)` seen by a script that
    ran between before_us and after_us."""
    lo = math.ceil((ends(before_us / 1e6) * 1e6 - after_us) / 1e6)
    hi = math.ceil((ends(after_us / 1e6) * 1e6 - before_us) / 1e6)
    return range(lo, hi + 1)


def items(resp: Response, header: str = "ratelimit") -> dict[str, tuple[int, int]]:
    found = {name: (int(r), int(t)) for name, r, t in ITEM.findall(resp.headers.get(header, ""))}
    assert found, resp
    return found


def test_calendar_quotas_reset_at_the_end_of_their_day_week_and_month(shared):
    offset, offset_s = noon_offset(redis_now_us(shared))
    prefix = f"cg:e2e-cal:{uid()}"
    limits = [
        {"name": "daily", "by": ["tenant"], "algorithm": "fixed_window", "limit": 2,
         "window": "1d", "align": "calendar", "zone": offset},
        {"name": "monthly", "by": ["tenant"], "algorithm": "fixed_window", "limit": 50,
         "window": "1mo", "align": "calendar", "zone": zone_object(BERLIN)},
        {"name": "weekly", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100,
         "window": "1w", "align": "calendar"},
    ]
    config = {"redis": shared.redis_section(key_prefix=prefix, timeout="1s"),
              "identity": {"tenant_header": TENANT},
              "policies": [{"name": "cal", "match": {"path_prefix": "/cal/"},
                            "rate_limits": limits}]}
    envoy = shared.add_envoy(config)
    ends = {"daily": lambda s: day_end(s, offset_s),
            "monthly": lambda s: period_of(BERLIN, "1mo", s)[1],
            "weekly": lambda s: period_of("UTC", "1w", s)[1]}
    tenant, path = f"tenant-{uid()}", f"/cal/{uid()}"
    try:
        for sent in (1, 2, 3):
            before = redis_now_us(shared)
            resp = envoy.request("POST", path, headers={TENANT: tenant})
            after = redis_now_us(shared)
            state = items(resp)
            if sent < 3:
                assert resp.status == 200, resp
                # No `w` for a calendar period: its length is the calendar's.
                assert resp.headers["ratelimit-policy"] == \
                    '"daily";q=2, "monthly";q=50, "weekly";q=100', resp
                want = {"daily": 2 - sent, "monthly": 50 - sent, "weekly": 100 - sent}
            else:
                assert resp.status == 429, resp
                assert resp.headers["content-type"] == "application/problem+json", resp
                assert resp.json()["violated-policies"] == ["daily"], resp.json()
                retry = int(resp.headers["retry-after"])
                assert retry in t_range(ends["daily"], before, after), (retry, offset)
                assert retry > 3 * 3600, retry  # local noon: midnight is hours away
                want = {"daily": 0}
            for name, remaining in want.items():
                r, t = state[name]
                assert r == remaining, (name, state)
                assert t in t_range(ends[name], before, after), (name, t, offset)
        assert shared.upstream.count("POST", path) == 2
        # The counter lives until the local midnight, under a key that names the period and
        # the zone (seconds east of UTC).
        keys = [k.decode() for k in shared.redis.scan_iter(
            match=f"{prefix}:rl:*:cal:daily:fw:2/1d@{offset_s}:*", count=1000)]
        assert len(keys) == 1, keys
        now = redis_now_us(shared)
        ttl_ms = shared.redis.pttl(keys[0])
        assert abs(ttl_ms - (day_end(now / 1e6, offset_s) * 1000 - now / 1000)) < 5_000, ttl_ms
        monthly = [k.decode() for k in shared.redis.scan_iter(
            match=f"{prefix}:rl:*:cal:monthly:fw:50/1mo@3600,7200,M3.5.0/7200,M10.5.0/10800:*",
            count=1000)]
        assert len(monthly) == 1, monthly
    finally:
        envoy.stop()


def test_a_zone_given_by_its_bare_name_is_refused_at_load(shared):
    config = {"redis": shared.redis_section(key_prefix="cg:e2e-cal:refused"),
              "policies": [{"name": "cal", "rate_limits": [
                  {"name": "monthly", "by": [], "algorithm": "fixed_window", "limit": 5,
                   "window": "1mo", "align": "calendar", "zone": BERLIN}]}]}
    code, log = shared.envoy_expect_failure(config)
    assert code is not None and code != 0, log[-3000:]
    assert ('invalid plugin configuration: policies[0].rate_limits[0].zone: "Europe/Berlin" is '
            'a time-zone name, and the filter carries no time-zone database') in log, log[-3000:]
