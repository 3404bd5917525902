"""Calendar periods as Python's zoneinfo gives them, for the tests of calendar-aligned limits
(`align: "calendar"`): a zone's POSIX TZ rule as the machine's tzdata ends with it, and the
bounds of the day, ISO week or month that holds a moment in that zone.

A period starts at the first moment the zone's local clock reads its first day's midnight or
later: at a change that skips midnight, the change; where the clock reads midnight twice, the
first time (docs/configuration.md, "Calendar quotas"). zoneinfo reads the same tzdata files,
so for a zone whose listed changes follow its rule the two agree."""

from __future__ import annotations

import bisect
import datetime as dt
import functools
from pathlib import Path
from zoneinfo import ZoneInfo

TZDIR = Path("/usr/share/zoneinfo")
UTC = dt.timezone.utc


def tzdata_rule(name: str) -> str:
    """The POSIX TZ rule at the end of the zone's tzdata file (RFC 8536's footer)."""
    data = (TZDIR / name).read_bytes()
    assert data[:4] == b"TZif" and data[4:5] >= b"2", name
    return data.rstrip(b"\n").rsplit(b"\n", 1)[1].decode()


def zone_object(name: str) -> dict:
    """A limit's `zone` for the zone `name`: its name and rule."""
    return {"name": name, "rule": tzdata_rule(name)}


def first_reading(zone: ZoneInfo, day: dt.date) -> int:
    """The first second (since the epoch) at which the local clock reads `day` 00:00 or later."""
    wall = dt.datetime.combine(day, dt.time())
    read = [int(wall.replace(tzinfo=zone, fold=f).timestamp()) for f in (0, 1)]
    exact = [u for u in read if dt.datetime.fromtimestamp(u, zone).replace(tzinfo=None) == wall]
    if exact:
        return min(exact)
    # A change skipped midnight: the first second that reads later than it.
    lo, hi = min(read) - 4 * 3600, max(read) + 4 * 3600
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if dt.datetime.fromtimestamp(mid, zone).replace(tzinfo=None) >= wall:
            hi = mid
        else:
            lo = mid
    return hi


def period_starts(day: dt.date, period: str) -> bool:
    return {"1d": True, "1w": day.weekday() == 0, "1mo": day.day == 1}[period]


@functools.cache
def boundaries(name: str, period: str, first: dt.date, last: dt.date) -> tuple[int, ...]:
    """The start of every period of `period` in zone `name` whose first day is in
    [first, last], in seconds since the epoch."""
    zone = ZoneInfo(name)
    out, day = [], first
    while day <= last:
        if period_starts(day, period):
            out.append(first_reading(zone, day))
        day += dt.timedelta(days=1)
    return tuple(out)


def period_of(name: str, period: str, t: float) -> tuple[int, int]:
    """(start, end) in seconds of the period that holds the moment `t` (seconds)."""
    year = dt.datetime.fromtimestamp(t, UTC).year
    starts = boundaries(name, period, dt.date(year - 1, 11, 1), dt.date(year + 1, 2, 28))
    i = bisect.bisect_right(starts, t) - 1
    assert 0 <= i < len(starts) - 1, (name, period, t)
    return starts[i], starts[i + 1]


def changes(name: str, first: dt.date, last: dt.date) -> list[int]:
    """Every moment (s) in [first, last] at which the zone's offset changes."""
    zone = ZoneInfo(name)
    offset = lambda u: dt.datetime.fromtimestamp(u, zone).utcoffset()
    found = []
    u = int(dt.datetime.combine(first, dt.time(), UTC).timestamp())
    end = int(dt.datetime.combine(last, dt.time(), UTC).timestamp())
    while u < end:
        if offset(u) != offset(u + 86400):
            lo, hi = u, u + 86400
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if offset(mid) == offset(u):
                    lo = mid
                else:
                    hi = mid
            found.append(hi)
        u += 86400
    return found
