"""The cancellation marker against a real redis-server: release.lua / lease_release.lua with
the marker key (KEYS[2]) set it, and acquire.lua (alone and inside batch.lua) that finds the
marker of its owner token writes no record and takes no lease.

    the filter gives up on an acquire (timeout, client gone) -> release(owner, marker)
      release runs first:   marker set; the late acquire finds it, writes nothing  (CANCELLED)
      acquire runs first:   record / lease written; the release deletes them, marker set

The marker key shares the hash tag of the record and the lease ({t1} here), as the filter's
keys do (`<prefix>:cancel:{t.<tenant hash>}:<policy>:<owner>`).
"""

from __future__ import annotations

import pytest

from harness.scripts import Limit, batch_source, limits_argv, owner, register, script_source

IDEM = "idem:{t1}:op:k1"
LEASE = "lease:{t1}:op:r1"
FENCE = "fence:{t1}:op:r1"
FP = "sha256:" + "a" * 64
MARKER_TTL = 120_000

# acquire.lua codes
IDEM_ACQUIRED, IDEM_CANCELLED = 1, 6
LEASE_SKIPPED, LEASE_ACQUIRED, LEASE_CANCELLED = 0, 1, 3
RELEASED, MISSING = 1, 0


def marker(own: str) -> str:
    return f"cancel:{{t1}}:op:{own}"


def load(r, name):
    return register(r, script_source(name))


class S:
    def __init__(self, r):
        self.r = r
        self.acquire_s = load(r, "acquire.lua")
        self.batch_s = register(r, batch_source())
        self.release_s = load(r, "release.lua")
        self.lease_release_s = load(r, "lease_release.lua")

    @staticmethod
    def acquire_call(own: str, idem: bool = True, lease: bool = True, with_marker: bool = True,
                     limits: list = ()):
        keys = [k for k, _ in limits]
        args = [str(a) for a in limits_argv([lim for _, lim in limits])]
        if idem:
            keys.append(IDEM)
            args += ["1", FP, own, "60000"]
        else:
            args.append("0")
        if lease:
            keys += [LEASE, FENCE]
            args += ["1", own, "30000", "600000"]
        else:
            args.append("0")
        if with_marker:
            keys.append(marker(own))
        return keys, args

    def acquire(self, own: str, **kw) -> list:
        keys, args = self.acquire_call(own, **kw)
        return self.acquire_s(keys=keys, args=args)

    def release(self, own: str, ttl: int | None = MARKER_TTL) -> int:
        if ttl is None:
            return self.release_s(keys=[IDEM], args=[own])
        return self.release_s(keys=[IDEM, marker(own)], args=[own, ttl])

    def lease_release(self, own: str, ttl: int | None = MARKER_TTL) -> int:
        if ttl is None:
            return self.lease_release_s(keys=[LEASE], args=[own])
        return self.lease_release_s(keys=[LEASE, marker(own)], args=[own, ttl])


@pytest.fixture
def s(redis_client) -> S:
    return S(redis_client)


def test_release_then_late_acquire_writes_nothing(s):
    own = owner()
    assert s.release(own) == MISSING
    assert s.lease_release(own) == MISSING
    fence_before = s.r.get(FENCE)
    reply = s.acquire(own)
    # admitted, idem: CANCELLED, its PTTL (-2: absent), no record; lease: CANCELLED, 0
    assert reply == [1, IDEM_CANCELLED, -2, b"", LEASE_CANCELLED, 0], reply
    assert not s.r.exists(IDEM) and not s.r.exists(LEASE)
    assert s.r.get(FENCE) == fence_before  # no fencing token spent
    # The marker is the owner's only: another request acquires as usual.
    other = owner()
    reply = s.acquire(other)
    assert reply[1] == IDEM_ACQUIRED and reply[4] == LEASE_ACQUIRED, reply
    assert b'"owner":"%s"' % other.encode() in s.r.get(IDEM)
    assert s.r.get(LEASE) == other.encode()


def test_a_lease_only_or_record_only_acquire_honours_the_marker(s):
    own = owner()
    s.lease_release(own)
    assert s.acquire(own, idem=False) == [1, LEASE_CANCELLED, 0]
    own2 = owner()
    s.release(own2)
    assert s.acquire(own2, lease=False) == [1, IDEM_CANCELLED, -2, b""]
    assert not s.r.exists(IDEM) and not s.r.exists(LEASE)


def test_rate_limits_still_count_a_cancelled_acquire(s):
    own = owner()
    s.release(own)
    reply = s.acquire(own, limits=[("rl:{t1}:fw", Limit("fw", 5, 60_000))])
    assert reply[:5] == [1, 1, 4, 60_000, 0], reply  # one unit consumed: Redis saw the request
    assert reply[5:] == [IDEM_CANCELLED, -2, b"", LEASE_CANCELLED, 0], reply


def test_acquire_then_release_deletes_and_marks(s):
    own = owner()
    reply = s.acquire(own)
    assert reply[1] == IDEM_ACQUIRED and reply[4] == LEASE_ACQUIRED, reply
    assert s.release(own) == RELEASED
    assert s.lease_release(own) == RELEASED
    assert not s.r.exists(IDEM) and not s.r.exists(LEASE)
    assert s.r.get(marker(own)) == b"1"
    # A duplicate of the same late call (a retry of the same owner) still writes nothing.
    assert s.acquire(own)[1] == IDEM_CANCELLED


def test_marker_ttl(s):
    own = owner()
    s.release(own, ttl=MARKER_TTL)
    assert 0 < s.r.pttl(marker(own)) <= MARKER_TTL
    own2 = owner()
    s.lease_release(own2, ttl=1500)
    assert 0 < s.r.pttl(marker(own2)) <= 1500
    # A later release (a retry) sets the full TTL again.
    s.r.pexpire(marker(own), 1000)
    s.release(own, ttl=MARKER_TTL)
    assert s.r.pttl(marker(own)) > 1000


def test_marker_ttl_is_validated_and_the_marker_is_optional(s):
    import redis

    own = owner()
    for bad in ("0", "-1", "1.5", "x"):
        with pytest.raises(redis.ResponseError, match="marker_ttl_ms"):
            s.release_s(keys=[IDEM, marker(own)], args=[own, bad])
        with pytest.raises(redis.ResponseError, match="marker_ttl_ms"):
            s.lease_release_s(keys=[LEASE, marker(own)], args=[own, bad])
    assert not s.r.exists(marker(own))
    # Without KEYS[2]: the old contract, no marker.
    s.acquire(own)
    assert s.release(own, ttl=None) == RELEASED and s.lease_release(own, ttl=None) == RELEASED
    assert not s.r.exists(marker(own))
    # Without the marker key, acquire.lua works as before (the marker is not consulted).
    s.release(own)
    reply = s.acquire(own, with_marker=False)
    assert reply[1] == IDEM_ACQUIRED and reply[4] == LEASE_ACQUIRED, reply


def test_the_marker_must_be_a_key_of_its_own(s):
    import redis

    own = owner()
    keys, args = S.acquire_call(own)
    keys[-1] = IDEM
    with pytest.raises(redis.ResponseError, match="cancellation marker"):
        s.acquire_s(keys=keys, args=args)
    keys, args = S.acquire_call(own, idem=False, lease=False, limits=[("rl:{t1}:x", Limit("fw", 5, 1000))])
    with pytest.raises(redis.ResponseError, match="keys for"):
        s.acquire_s(keys=keys + ["extra"], args=args)


def test_batch_sub_calls_honour_the_marker(s):
    cancelled, fresh = owner(), owner()
    s.release(cancelled)
    s.lease_release(cancelled)
    k1, a1 = S.acquire_call(cancelled)
    # The second sub-call uses other keys of the same slot.
    k2 = [IDEM + "b", LEASE + "b", FENCE + "b", marker(fresh)]
    _, a2 = S.acquire_call(fresh)
    keys, args = k1 + k2, ["2", "1", str(len(k1)), str(len(a1)), *a1,
                           "1", str(len(k2)), str(len(a2)), *a2]
    reply = s.batch_s(keys=keys, args=args)
    assert reply[:7] == [6, 1, IDEM_CANCELLED, -2, b"", LEASE_CANCELLED, 0], reply
    assert reply[7] == 6 and reply[9] == IDEM_ACQUIRED and reply[12] == LEASE_ACQUIRED, reply
    assert not s.r.exists(IDEM) and not s.r.exists(LEASE)
    assert s.r.exists(IDEM + "b") and s.r.get(LEASE + "b") == fresh.encode()


def test_a_batch_of_settlements_answers_like_separate_calls(s):
    """The root's settlements share a batch.lua call: each sub-call runs one of the batched
    scripts (by its number) after the ones before it, and an integer reply comes back as -2
    then the value. A failing sub-call does not take the others down."""
    own = owner()
    k, a = S.acquire_call(own)
    calls = [
        ("1", k, a),                                                    # acquire: record + lease
        ("3", [IDEM, marker(own)], [own, MARKER_TTL]),                  # release.lua
        ("4", [LEASE, marker(own)], [own, MARKER_TTL]),                 # lease_release.lua
        ("3", [IDEM], [own]),                                           # release.lua: gone now
        ("5", [], []),                                                  # slot_release.lua: bad
    ]
    keys, args = [], [str(len(calls))]
    for script, ck, ca in calls:
        keys += ck
        args += [script, str(len(ck)), str(len(ca)), *[str(x) for x in ca]]
    reply = s.batch_s(keys=keys, args=args)
    assert reply[0] == 6 and reply[2] == IDEM_ACQUIRED and reply[5] == LEASE_ACQUIRED, reply
    assert reply[7:13] == [-2, RELEASED, -2, RELEASED, -2, MISSING], reply
    assert reply[13] == -1 and b"slot_release.lua" in reply[14] and len(reply) == 15, reply
    assert not s.r.exists(IDEM) and not s.r.exists(LEASE) and s.r.exists(marker(own))
    # The same calls one by one give the same answers.
    s.r.flushall()
    separate = [s.acquire_s(keys=k, args=a)[1], s.release(own), s.lease_release(own),
                s.release(own, ttl=None)]
    assert separate == [IDEM_ACQUIRED, RELEASED, RELEASED, MISSING], separate
