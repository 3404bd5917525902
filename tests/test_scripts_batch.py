"""batch.lua (batch_head.lua, each script it runs as a local function, batch_tail.lua) against
a real redis-server: sub-calls answer exactly as separate calls would."""

import pytest

from harness.scripts import batch_source, register, script_source


@pytest.fixture
def scripts(redis_client):
    return (register(redis_client, script_source("acquire")),
            register(redis_client, batch_source()))


def fw_call(key, limit, nonce):
    """One fixed-window limit, no idempotency, no lease."""
    return [key], ["1", nonce, "fw", str(limit), "60000", str(limit), "0", "1", "0"]


def batch_args(calls, script="1"):
    """Every call of `script` (1: acquire.lua)."""
    keys, args = [], [str(len(calls))]
    for k, a in calls:
        keys += k
        args += [script, str(len(k)), str(len(a)), *a]
    return keys, args


def split(reply):
    out, i = [], 0
    while i < len(reply):
        n = int(reply[i])
        i += 1
        if n == -2:
            out.append(int(reply[i]))
            i += 1
        elif n < 0:
            out.append(("error", reply[i]))
            i += 1
        else:
            out.append([int(v) for v in reply[i:i + n]])
            i += n
    return out


def test_sub_calls_answer_like_separate_calls(scripts, redis_client):
    single, batched = scripts
    calls = [fw_call("cg:{a}:k", 2, f"n{i}") for i in range(3)] + [fw_call("cg:{b}:k", 1, "x")]
    keys, args = batch_args(calls)
    got = split(batched(keys=keys, args=args))
    assert [g[0] for g in got] == [1, 1, 0, 1]  # admitted, admitted, rejected, other key
    assert [g[2] for g in got] == [1, 0, 0, 0]  # remaining after each
    assert redis_client.get("cg:{a}:k") == b"2"  # the rejected sub-call consumed nothing
    # The same sequence as separate calls on fresh keys gives the same answers.
    redis_client.flushall()
    separate = [single(keys=k, args=a) for k, a in calls]
    assert [[int(v) for v in s][:3] for s in separate] == [g[:3] for g in got]


def test_a_failing_sub_call_does_not_take_the_others_down(scripts, redis_client):
    _, batched = scripts
    bad = (["cg:{a}:bad"], ["1", "n", "xx", "5", "1000", "5", "0", "1", "0"])  # unknown algo
    keys, args = batch_args([fw_call("cg:{a}:k", 5, "n1"), bad, fw_call("cg:{a}:k", 5, "n2")])
    got = split(batched(keys=keys, args=args))
    assert got[0][:3] == [1, 1, 4]
    assert got[1][0] == "error" and b"acquire.lua" in got[1][1]
    assert got[2][:3] == [1, 1, 3]
    assert not redis_client.exists("cg:{a}:bad")
    assert redis_client.pttl("cg:{a}:k") > 0


def test_the_probe_an_empty_batch_across_two_slots_runs_on_a_single_redis(scripts, redis_client):
    """batch.rs's probe: no sub-calls, two keys in different hash slots. A single Redis runs it
    and answers an empty array (a Redis Cluster refuses it: tests/test_e2e_ratelimit.py)."""
    _, batched = scripts
    keys = ["cg:probe:{a}", "cg:probe:{b}"]
    assert batched(keys=keys, args=["0"]) == []
    assert not any(redis_client.exists(k) for k in keys), "the probe writes nothing"
