"""The idempotency state machine of src/redis/scripts/{acquire,complete,release}.lua against a real
redis-server: every transition, the owner checks, unreadable values, the combined rate-limit +
idempotency call and TTLs.

    absent --acquire--> PROCESSING(owner) --complete(owner)--> COMPLETED
                        PROCESSING(owner) --release(owner)---> absent
                        PROCESSING        --lease expires----> absent

Timestamps are checked against Redis TIME read around the call, never the local clock.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from dataclasses import dataclass

import pytest

from harness.scripts import Limit, limits_argv, owner, register, script_source
import redis


SKIPPED, ACQUIRED, IN_PROGRESS, COMPLETED, CONFLICT, UNREADABLE = range(6)
MISSING, NOT_OWNER, DONE = 0, -1, 1  # complete.lua / release.lua replies (DONE: 1)

KEY = "idem:{t1}:op:k1"
FP = "sha256:" + "a" * 64
FP2 = "sha256:" + "b" * 64
PROCESSING_TTL = 30_000
COMPLETED_TTL = 86_400_000
RESPONSE = '{"status":201,"headers":[["location","/o/1"]],"body":"{\\"id\\":1}"}'


@dataclass(frozen=True)
class Acquired:
    admitted: bool
    verdicts: list[tuple[int, int, int, int]]
    code: int
    pttl_ms: int
    record: bytes


class Scripts:
    def __init__(self, client):
        self.r = client
        # redis-py's Script: EVALSHA, falling back to EVAL on NOSCRIPT.
        self._acquire = register(client, script_source("acquire"))
        self._complete = register(client, script_source("complete"))
        self._release = register(client, script_source("release"))

    def acquire(self, key: str = KEY, fp: str = FP, own: str | None = None,
                ttl_ms: int = PROCESSING_TTL, limits: list[tuple[str, Limit]] = (),
                cost: int = 1) -> Acquired:
        argv = limits_argv([lim for _, lim in limits], cost) + ["1", fp, own or owner(), ttl_ms]
        reply = self._acquire(keys=[k for k, _ in limits] + [key], args=argv)
        n = len(limits)
        assert len(reply) == 1 + 4 * n + 3, reply
        assert all(isinstance(v, int) for v in reply[: 3 + 4 * n]), reply
        admitted, code, pttl, record = reply[0], reply[-3], reply[-2], reply[-1]
        assert admitted in (0, 1) and code in range(6) and isinstance(record, bytes), reply
        assert (record != b"") == (code == COMPLETED), reply
        verdicts = [tuple(reply[1 + 4 * i: 5 + 4 * i]) for i in range(n)]
        return Acquired(bool(admitted), verdicts, code, pttl, record)

    def complete(self, own: str, key: str = KEY, fp: str = FP, ttl_ms: int = COMPLETED_TTL,
                 response: str = RESPONSE) -> int:
        return self._complete(keys=[key], args=[own, fp, ttl_ms, response])

    def release(self, own: str, key: str = KEY) -> int:
        return self._release(keys=[key], args=[own])


@pytest.fixture
def s(redis_client) -> Scripts:
    return Scripts(redis_client)


def redis_ms(r) -> int:
    sec, usec = r.time()
    return sec * 1000 + usec // 1000


def snapshot(r, key: str = KEY):
    """The value and TTL under `key`, to show a script left it alone."""
    kind = r.type(key).decode()
    value = {"none": lambda: None, "string": lambda: r.get(key),
             "hash": lambda: r.hgetall(key)}[kind]()
    pttl = r.pttl(key)
    return kind, value, -1 if pttl == -1 else ("ttl" if pttl > 0 else pttl)


def assert_every_key_has_ttl(r) -> None:
    for key in r.keys("*"):
        assert r.pttl(key) > 0, key


def processing(own: str, fp: str = FP, created_ms: int = 1_700_000_000_123) -> bytes:
    """A PROCESSING record exactly as acquire.lua writes it."""
    return (f'{{"schema_version":1,"state":"PROCESSING","fingerprint":"{fp}","owner":"{own}",'
            f'"created_ms":{created_ms},"updated_ms":{created_ms}}}').encode()


# --- acquire -----------------------------------------------------------------------------


def test_acquire_absent_writes_processing_record(s, redis_client):
    a = owner()
    before = redis_ms(redis_client)
    got = s.acquire(own=a)
    after = redis_ms(redis_client)

    assert got.admitted and got.code == ACQUIRED and got.record == b""
    assert 0 < got.pttl_ms <= PROCESSING_TTL
    raw = redis_client.get(KEY)
    rec = json.loads(raw)
    assert rec == {"schema_version": 1, "state": "PROCESSING", "fingerprint": FP, "owner": a,
                   "created_ms": rec["created_ms"], "updated_ms": rec["created_ms"]}
    assert isinstance(rec["created_ms"], int) and before <= rec["created_ms"] <= after
    # compact, in this field order, exact integers
    assert raw == processing(a, created_ms=rec["created_ms"])
    assert 0 < redis_client.pttl(KEY) <= PROCESSING_TTL


def test_duplicate_while_processing_is_in_progress_and_changes_nothing(s, redis_client):
    s.acquire(ttl_ms=5_000)
    before = snapshot(redis_client)
    raw = redis_client.get(KEY)

    time.sleep(0.05)
    same = s.acquire(ttl_ms=PROCESSING_TTL)  # a longer TTL must not extend the lease
    assert same.code == IN_PROGRESS and same.record == b""
    assert 0 < same.pttl_ms <= 5_000 - 40
    other = s.acquire(fp=FP2)
    assert other.code == CONFLICT and other.record == b""
    assert 0 < other.pttl_ms <= 5_000 - 40

    assert redis_client.get(KEY) == raw and snapshot(redis_client) == before
    assert redis_client.pttl(KEY) <= same.pttl_ms


def test_concurrent_acquires_have_exactly_one_owner(s, redis_client):
    codes: list[int] = []
    start = threading.Barrier(16)

    def worker():
        mine = Scripts(redis_client.__class__(connection_pool=redis_client.connection_pool))
        start.wait()
        codes.append(mine.acquire().code)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [ACQUIRED] + [IN_PROGRESS] * 15


# --- complete ----------------------------------------------------------------------------


def test_complete_by_owner_then_replay(s, redis_client):
    a = owner()
    s.acquire(own=a)
    created = json.loads(redis_client.get(KEY))["created_ms"]
    time.sleep(0.01)

    before = redis_ms(redis_client)
    assert s.complete(a) == DONE
    after = redis_ms(redis_client)
    stored = redis_client.get(KEY)
    assert COMPLETED_TTL - 1_000 < redis_client.pttl(KEY) <= COMPLETED_TTL

    replay = s.acquire()
    assert replay.code == COMPLETED
    assert replay.record == stored
    assert COMPLETED_TTL - 1_000 < replay.pttl_ms <= COMPLETED_TTL
    rec = json.loads(replay.record)
    assert rec == {"schema_version": 1, "state": "COMPLETED", "fingerprint": FP,
                   "created_ms": created, "updated_ms": rec["updated_ms"],
                   "response": json.loads(RESPONSE)}
    assert before <= rec["updated_ms"] <= after and rec["updated_ms"] > created
    # the response is inserted verbatim, the owner is gone
    assert replay.record == (f'{{"schema_version":1,"state":"COMPLETED","fingerprint":"{FP}",'
                             f'"created_ms":{created},"updated_ms":{rec["updated_ms"]},'
                             f'"response":{RESPONSE}}}').encode()

    # a different request under the same key: conflict, and the record is not handed out
    conflict = s.acquire(fp=FP2)
    assert conflict.code == CONFLICT and conflict.record == b""
    assert redis_client.get(KEY) == stored


def test_complete_by_another_owner_or_fingerprint_is_refused(s, redis_client):
    a = owner()
    s.acquire(own=a)
    before = snapshot(redis_client)

    assert s.complete(owner()) == NOT_OWNER
    assert s.complete(a, fp=FP2) == NOT_OWNER
    assert snapshot(redis_client) == before

    assert s.complete(a) == DONE
    completed = snapshot(redis_client)
    assert s.complete(a) == NOT_OWNER  # COMPLETED is final: no second completion
    assert snapshot(redis_client) == completed


def test_complete_after_lease_expired_is_missing_and_writes_nothing(s, redis_client):
    a = owner()
    s.acquire(own=a, ttl_ms=100)
    time.sleep(0.15)
    assert redis_client.exists(KEY) == 0

    assert s.complete(a) == MISSING
    assert redis_client.keys("*") == []


def test_stale_owner_cannot_complete_or_release_the_new_lease(s, redis_client):
    a, b = owner(), owner()
    assert s.acquire(own=a, ttl_ms=100).code == ACQUIRED
    time.sleep(0.15)
    assert s.acquire(own=b).code == ACQUIRED
    b_record = snapshot(redis_client)
    assert json.loads(redis_client.get(KEY))["owner"] == b

    assert s.complete(a) == NOT_OWNER
    assert s.release(a) == NOT_OWNER
    assert snapshot(redis_client) == b_record

    assert s.complete(b) == DONE
    assert json.loads(redis_client.get(KEY))["state"] == "COMPLETED"


@pytest.mark.parametrize("created_ms", [1_700_000_000_123, 9_007_199_254_740_991],
                         ids=["now-ish", "2^53-1"])
def test_complete_copies_created_ms_exactly(s, redis_client, created_ms):
    a = owner()
    redis_client.set(KEY, processing(a, created_ms=created_ms), px=PROCESSING_TTL)
    assert s.complete(a) == DONE
    raw = redis_client.get(KEY).decode()
    assert f'"created_ms":{created_ms},' in raw
    rec = json.loads(raw)
    assert rec["created_ms"] == created_ms and rec["updated_ms"] >= created_ms


@pytest.mark.parametrize("value", [
    # acquire.lua's head, then more than it writes: decoded, its fields read
    processing("%s").decode()[:-1] + ',"note":"x"}',
    processing("%s").decode().replace('"updated_ms"', ' "updated_ms"'),
    # the same fields in another order
    ('{"state":"PROCESSING","owner":"%s","schema_version":1,"fingerprint":"' + FP
     + '","created_ms":1700000000123,"updated_ms":1700000000123}'),
], ids=["extra-field", "spacing", "order"])
def test_complete_reads_a_record_not_written_exactly_as_acquire_lua_writes_by_its_fields(
        s, redis_client, value):
    """complete.lua reads acquire.lua's own record by its text; any other PROCESSING record
    of this owner and fingerprint is decoded, and its created_ms copied as before."""
    a = owner()
    redis_client.set(KEY, value.replace("%s", a), px=PROCESSING_TTL)
    assert s.complete(a, fp=FP2) == NOT_OWNER and s.complete(owner()) == NOT_OWNER
    assert s.complete(a) == DONE
    assert json.loads(redis_client.get(KEY))["created_ms"] == 1_700_000_000_123


def test_complete_takes_a_head_of_another_owner_or_fingerprint_for_none_of_its_own(
        s, redis_client):
    """An owner or a fingerprint that starts as the stored one's is another."""
    a = owner()
    redis_client.set(KEY, processing(a), px=PROCESSING_TTL)
    before = snapshot(redis_client)
    assert s.complete(a[:-1]) == NOT_OWNER
    assert s.complete(a, fp=FP[:-1]) == NOT_OWNER
    assert snapshot(redis_client) == before
    assert s.complete(a) == DONE


def test_complete_without_created_ms_uses_completion_time(s, redis_client):
    a = owner()
    redis_client.set(KEY, json.dumps({"state": "PROCESSING", "fingerprint": FP, "owner": a}),
                     px=PROCESSING_TTL)
    before = redis_ms(redis_client)
    assert s.complete(a) == DONE
    after = redis_ms(redis_client)
    rec = json.loads(redis_client.get(KEY))
    assert before <= rec["created_ms"] == rec["updated_ms"] <= after


def completed_with(s: Scripts, response: str) -> Acquired:
    """Acquires, completes with `response`, and acquires again: the replay, which must hold
    the response verbatim."""
    a = owner()
    s.acquire(own=a)
    assert s.complete(a, response=response) == DONE
    replay = s.acquire()
    assert replay.code == COMPLETED
    assert replay.record.endswith(b',"response":' + response.encode() + b"}")
    return replay


@pytest.mark.parametrize("ensure_ascii", [True, False], ids=["escaped", "utf8"])
def test_large_response_round_trips(s, redis_client, ensure_ascii):
    unit = 'q"uote\\back\\\\slash/ é€😀 \n\t\u0001 </script> '
    body = (unit * (64 * 1024 // len(unit) + 1))[: 64 * 1024]  # 64 Ki characters, more bytes
    response = json.dumps({"status": 200, "headers": [["content-type", "text/plain"]],
                           "body": body}, ensure_ascii=ensure_ascii, separators=(",", ":"))
    replay = completed_with(s, response)
    assert json.loads(replay.record)["response"]["body"] == body


def test_a_sealed_response_is_stored_and_handed_out_verbatim(s, redis_client):
    """`idempotency.encryption` hands complete.lua a sealed response object: the scripts store
    it, keep the state machine around it, and give it back as COMPLETED, never looking in."""
    ct = base64.b64encode(os.urandom(96 * 1024)).decode()  # a 64 KiB response, sealed
    sealed = json.dumps({"sealed": {"alg": "A256GCM", "kid": "0123456789abcdef",
                                    "nonce": base64.b64encode(os.urandom(12)).decode(), "ct": ct}},
                        separators=(",", ":"))
    rec = json.loads(completed_with(s, sealed).record)
    assert (rec["state"], rec["fingerprint"]) == ("COMPLETED", FP)
    assert s.acquire(fp=FP2).code == CONFLICT, "the fingerprint is still compared in the clear"


# --- release -----------------------------------------------------------------------------


def test_release_by_owner_deletes_and_frees_the_key(s, redis_client):
    a = owner()
    s.acquire(own=a)
    assert s.release(a) == DONE
    assert redis_client.exists(KEY) == 0
    assert s.acquire().code == ACQUIRED  # a retry may run the request now


def test_release_refuses_other_owner_and_completed(s, redis_client):
    a = owner()
    s.acquire(own=a)
    before = snapshot(redis_client)
    assert s.release(owner()) == NOT_OWNER
    assert snapshot(redis_client) == before

    assert s.complete(a) == DONE
    completed = snapshot(redis_client)
    assert s.release(a) == NOT_OWNER
    assert snapshot(redis_client) == completed


def test_release_missing(s, redis_client):
    assert s.release(owner()) == MISSING
    assert redis_client.keys("*") == []


# --- values that are not our records -----------------------------------------------------

UNREADABLE_VALUES = {
    "garbage": "garbage",
    "no-fingerprint": '{"schema_version":1,"state":"PROCESSING","owner":"%s"}',
    "fingerprint-not-string": '{"state":"PROCESSING","fingerprint":1,"owner":"%s"}',
    "state-done": '{"schema_version":1,"state":"DONE","fingerprint":"' + FP + '","owner":"%s"}',
    "json-array": '["PROCESSING"]',
    "json-number": "42",
    "empty": "",
    "hash": None,
}


@pytest.mark.parametrize("value", UNREADABLE_VALUES.values(), ids=UNREADABLE_VALUES.keys())
def test_unreadable_value_is_reported_and_left_alone(s, redis_client, value):
    a = owner()
    if value is None:
        redis_client.hset(KEY, mapping={"state": "PROCESSING", "fingerprint": FP, "owner": a})
        redis_client.pexpire(KEY, PROCESSING_TTL)
    else:
        redis_client.set(KEY, value.replace("%s", a), px=PROCESSING_TTL)
    before = snapshot(redis_client)

    got = s.acquire(own=a)
    assert got.code == UNREADABLE and got.record == b""
    assert 0 < got.pttl_ms <= PROCESSING_TTL
    assert s.acquire(own=a, fp=FP2).code == UNREADABLE
    assert s.complete(a) == NOT_OWNER
    assert s.release(a) == NOT_OWNER
    assert snapshot(redis_client) == before


def completed_head(fp: str = FP) -> str:
    """What complete.lua writes first: the head acquire.lua reads a replay by."""
    return f'{{"schema_version":1,"state":"COMPLETED","fingerprint":"{fp}","created_ms":'


def test_a_completed_record_is_read_by_its_head_for_this_fingerprint_only(s, redis_client):
    """A value that starts as complete.lua's COMPLETED record of this very fingerprint is
    handed back whole without being decoded (the filter parses it, and reads one it cannot as
    unreadable); any other value is decoded as before: another fingerprint, one that starts
    as this one, or the same fields in another order or spacing."""
    tail = '1,"updated_ms":2,"response":' + RESPONSE + "}"
    redis_client.set(KEY, completed_head() + tail, px=COMPLETED_TTL)
    got = s.acquire()
    assert (got.code, got.record) == (COMPLETED, (completed_head() + tail).encode())
    assert 0 < got.pttl_ms <= COMPLETED_TTL

    # Past the head the script does not look: what follows is the filter's to read.
    redis_client.set(KEY, completed_head() + "not json", px=COMPLETED_TTL)
    assert s.acquire().record == (completed_head() + "not json").encode()

    # The fingerprint ends at its quote: one that starts as the stored one is another.
    redis_client.set(KEY, completed_head(FP + "0") + tail, px=COMPLETED_TTL)
    assert s.acquire().code == CONFLICT
    redis_client.set(KEY, completed_head(FP) + tail, px=COMPLETED_TTL)
    assert s.acquire(fp=FP[:-1]).code == CONFLICT
    assert s.acquire(fp=FP2).code == CONFLICT

    # Not the head complete.lua writes: decoded, and read by its fields as before.
    for text in (completed_head().replace(',"', ', "') + tail,
                 '{"state":"COMPLETED","schema_version":1,"fingerprint":"' + FP
                 + '","created_ms":' + tail):
        redis_client.set(KEY, text, px=COMPLETED_TTL)
        assert (s.acquire().code, s.acquire(fp=FP2).code) == (COMPLETED, CONFLICT), text
    redis_client.set(KEY, completed_head()[:-1], px=COMPLETED_TTL)  # cut inside the head
    assert s.acquire().code == UNREADABLE


def test_a_fingerprint_json_escapes_is_read_by_its_head_as_complete_lua_wrote_it(s,
                                                                                  redis_client):
    """cjson writes `/` as `\\/`: the head is built as complete.lua builds it, so a
    fingerprint with one still replays its own record and conflicts with another's."""
    fp = "sha256:" + "a" * 32 + "/" + "a" * 31
    a = owner()
    assert s.acquire(fp=fp, own=a).code == ACQUIRED
    assert s.complete(a, fp=fp) == DONE
    assert redis_client.get(KEY).startswith(completed_head(fp.replace("/", "\\/")).encode())
    assert s.acquire(fp=fp).code == COMPLETED
    assert s.acquire(fp=FP).code == CONFLICT


def test_record_without_ttl_is_reported_not_repaired(s, redis_client):
    redis_client.set(KEY, processing(owner()))
    got = s.acquire()
    assert got.code == IN_PROGRESS and got.pttl_ms == -1
    assert redis_client.pttl(KEY) == -1


# --- rate limits and idempotency in one call ---------------------------------------------

LIMITS = [("{t1}:rl:fw", Limit("fw", 3, 60_000)), ("{t1}:rl:sl", Limit("sl", 3, 60_000))]


def consumed(r) -> tuple[int, int]:
    return int(r.get("{t1}:rl:fw") or 0), r.zcard("{t1}:rl:sl")


def test_rejected_by_a_limit_writes_nothing(s, redis_client):
    redis_client.set("{t1}:rl:full", 1, px=60_000)
    limits = LIMITS + [("{t1}:rl:full", Limit("fw", 1, 60_000))]
    got = s.acquire(limits=limits)
    assert not got.admitted and got.code == SKIPPED and got.record == b""
    assert got.pttl_ms == -2
    assert [v[0] for v in got.verdicts] == [1, 1, 0]
    assert redis_client.keys("*") == [b"{t1}:rl:full"]
    assert redis_client.get("{t1}:rl:full") == b"1"


def test_admitted_consumes_limits_and_acquires(s, redis_client):
    got = s.acquire(limits=LIMITS, cost=2)
    assert got.admitted and got.code == ACQUIRED
    assert [v[:2] for v in got.verdicts] == [(1, 1), (1, 1)]
    assert consumed(redis_client) == (2, 2)
    assert json.loads(redis_client.get(KEY))["state"] == "PROCESSING"


def test_duplicates_still_consume_rate_limits(s, redis_client):
    """Intended: rate limits first, then idempotency. A retry storm on one key is limited."""
    a = owner()
    assert s.acquire(own=a, limits=LIMITS).code == ACQUIRED
    assert s.acquire(limits=LIMITS).code == IN_PROGRESS
    assert consumed(redis_client) == (2, 2)
    assert s.complete(a) == DONE
    assert s.acquire(limits=LIMITS).code == COMPLETED
    assert consumed(redis_client) == (3, 3)
    completed = snapshot(redis_client)

    # the limits are exhausted now: even a replay or a conflict is skipped, nothing written
    for fp in (FP, FP2):
        got = s.acquire(fp=fp, limits=LIMITS)
        assert not got.admitted and got.code == SKIPPED and got.record == b""
        assert got.pttl_ms > 0  # the record's PTTL is still reported
    assert consumed(redis_client) == (3, 3) and snapshot(redis_client) == completed


def test_conflict_consumes_rate_limits(s, redis_client):
    s.acquire(limits=LIMITS)
    assert s.acquire(fp=FP2, limits=LIMITS).code == CONFLICT
    assert consumed(redis_client) == (2, 2)


def test_no_limits_idempotency_only(s, redis_client):
    reply = s._acquire(keys=[KEY], args=[0, "nonce", "1", FP, owner(), PROCESSING_TTL])
    assert reply[:2] == [1, ACQUIRED] and 0 < reply[2] <= PROCESSING_TTL and reply[3] == b""
    assert redis_client.keys("*") == [KEY.encode()]


def test_idempotency_off_replies_rate_limits_only(s, redis_client):
    fw = LIMITS[0]
    reply = s._acquire(keys=[fw[0]], args=[1, "nonce", *fw[1].argv(), "0"])
    assert len(reply) == 5 and reply[0] == 1
    assert redis_client.keys("*") == [fw[0].encode()]


# --- TTLs and arguments ------------------------------------------------------------------


def test_every_key_has_a_ttl_after_every_script(s, redis_client):
    a, b = owner(), owner()
    steps = [
        lambda: s.acquire(own=a, limits=LIMITS),
        lambda: s.acquire(limits=LIMITS),
        lambda: s.acquire(fp=FP2, limits=LIMITS),
        lambda: s.complete(owner()),
        lambda: s.release(owner()),
        lambda: s.release(a),
        lambda: s.acquire(own=b, key=KEY),
        lambda: s.complete(b),
        lambda: s.acquire(),
        lambda: s.acquire(key="idem:{t1}:op:k2", limits=LIMITS),  # rejected: limits spent
    ]
    for i, step in enumerate(steps):
        step()
        assert_every_key_has_ttl(redis_client)
        assert redis_client.exists(KEY) == (i != 5), i  # released at step 5 only
    assert redis_client.exists("idem:{t1}:op:k2") == 0


ACQUIRE_BAD_ARGS = {
    "ttl-zero": ([0, "n", "1", FP, "o", 0], [KEY]),
    "ttl-not-a-number": ([0, "n", "1", FP, "o", "soon"], [KEY]),
    "ttl-missing": ([0, "n", "1", FP, "o"], [KEY]),
    "flag-missing": ([0, "n"], []),
    "flag-bad": ([0, "n", "yes", FP, "o", 1000], [KEY]),
    "record-key-missing": ([0, "n", "1", FP, "o", 1000], []),
    "extra-key": ([0, "n", "0"], [KEY]),
    "cost-negative": ([1, "n", "fw", 1, 1000, 1, "0", -1, "1", FP, "o", 1000], ["{t1}:c", KEY]),
    "cost-fraction": ([1, "n", "fw", 1, 1000, 1, "0", 0.5, "1", FP, "o", 1000], ["{t1}:c", KEY]),
    "limit-bad": ([1, "n", "fw", "x", 1000, 1, "0", 1, "1", FP, "o", 1000], ["{t1}:c", KEY]),
    "algo-bad": ([1, "n", "zz", 1, 1000, 1, "0", 1, "1", FP, "o", 1000], ["{t1}:c", KEY]),
}


@pytest.mark.parametrize("args,keys", ACQUIRE_BAD_ARGS.values(), ids=ACQUIRE_BAD_ARGS.keys())
def test_acquire_bad_arguments_fail_before_any_write(s, redis_client, args, keys):
    # with a valid counter in front, so a late failure would leave it consumed
    keys = ["{t1}:rl:fw"] + keys
    args = [args[0] + 1, args[1], *LIMITS[0][1].argv(), *args[2:]]
    with pytest.raises(redis.ResponseError, match="acquire.lua: "):
        s._acquire(keys=keys, args=args)
    assert redis_client.keys("*") == []


@pytest.mark.parametrize("ttl,response", [(0, RESPONSE), ("x", RESPONSE), (1000, "[1]"),
                                          (1000, "not json"), (1000, '{"a":1} x')],
                         ids=["ttl-zero", "ttl-nan", "array", "not-json", "trailing"])
def test_complete_bad_arguments_fail_and_leave_record(s, redis_client, ttl, response):
    a = owner()
    s.acquire(own=a)
    before = snapshot(redis_client)
    with pytest.raises(redis.ResponseError, match="complete.lua: "):
        s.complete(a, ttl_ms=ttl, response=response)
    assert snapshot(redis_client) == before


def test_waiting_duplicates_poll_the_record_alone_and_one_takes_it_after_a_release(s, redis_client):
    """`in_progress: wait`: a duplicate asks again for the record only (no limits, so its
    quota is not consumed twice). While the first runs it is IN_PROGRESS; once the first
    releases it, exactly one of the concurrent pollers ACQUIRES it; once that one completes,
    the others read it COMPLETED."""
    limit_key = "rl:{t1}:op:l"
    first = owner()
    got = s.acquire(own=first, limits=[(limit_key, Limit("fw", 100, 60_000))])
    assert (got.admitted, got.code) == (True, ACQUIRED)
    assert redis_client.get(limit_key) == b"1"
    polled = s.acquire(own=owner())
    assert polled.code == IN_PROGRESS and polled.pttl_ms > 0
    assert redis_client.get(limit_key) == b"1", "a poll consumes no quota"

    assert s.release(first) == DONE
    pollers = [owner() for _ in range(12)]
    codes: dict[str, int] = {}
    barrier = threading.Barrier(len(pollers))

    def poll(own: str) -> None:
        client = redis.Redis(connection_pool=redis_client.connection_pool)
        barrier.wait(timeout=5)
        codes[own] = Scripts(client).acquire(own=own).code

    threads = [threading.Thread(target=poll, args=(o,)) for o in pollers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(codes.values()) == [ACQUIRED] + [IN_PROGRESS] * 11, codes
    winner = next(o for o, c in codes.items() if c == ACQUIRED)
    assert s.complete(winner) == DONE
    after = s.acquire(own=owner())
    assert after.code == COMPLETED and json.loads(after.record)["response"]["status"] == 201
