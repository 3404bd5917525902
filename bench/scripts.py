#!/usr/bin/env python3
"""Micro-benchmark of src/redis/scripts/acquire.lua and complete.lua inside Redis: the working tree's
version against the one at git HEAD, case by case, side by side. Each is the script as the
filter runs it, assembled by the recipe src/redis/scripts/mod.rs holds at that version
(tests/harness/scripts.py: sources).

Starts its own redis-server on a free port (tests/harness/proc.py; stopped by its pid on exit,
also on failure), loads both scripts and, for every case, runs N pipelined EVALSHA calls of
each version after FLUSHALL + CONFIG RESETSTAT and reads `usec_per_call` of `evalsha` from
INFO commandstats: the time Redis spent in the script, the redis.call()s inside included,
without the network or the client. Head and current alternate within every round; the table
shows the median over the rounds of each, and the median of the per-round ratios (runs a
second apart share the machine's load, so the ratio is steadier than either figure). Every
reply is checked (admitted or rejected as the case expects, idempotency / lease code ACQUIRED
where on), so a case measures what it says.

Environment: N (calls per case and version, default 20000), ROUNDS (default 5),
CASES (comma list of case names, default all), REV (the git revision to compare with, HEAD).
"""

from __future__ import annotations

import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness.proc import RedisServer, stop_all  # noqa: E402
from harness.scripts import LUA, new_tag, script_source, sources, takes_tag, untag  # noqa: E402

SCRIPTS = ("acquire", "complete")  # by name, as src/redis/scripts/mod.rs loads them
PIPELINE = 1000  # calls per round trip
HOUR_MS = 3_600_000
BIG = 1_000_000_000  # a limit no case reaches


@dataclass(frozen=True)
class Case:
    name: str
    about: str
    call: Callable[[int], tuple[list, list]]  # call number -> (KEYS, ARGV)
    admitted: int = 1
    setup: Callable[[object, str, bool], None] | None = None  # (client, sha, tagged) before RESETSTAT
    acquired: tuple[int, ...] = ()  # reply indexes (from the end) that must be 1 ACQUIRED
    expect: tuple[tuple[int, object], ...] = ()  # (reply index, value) pairs it must hold
    script: str = "acquire"  # the script measured
    # complete.lua's reply instead of acquire.lua's: this integer
    returns: int | None = None
    max_calls: int | None = None  # at most this many calls, whatever N (one record each)


def limit(algo: str, lim: int = BIG, window_ms: int = HOUR_MS) -> list:
    """One limit's six ARGV values at cost 1; burst only matters to tb, which gets
    burst = limit."""
    return [algo, lim, window_ms, lim if algo == "tb" else 1, "0", 1]


def one(algo: str) -> Callable[[int], tuple[list, list]]:
    return lambda i: (["{b}:" + algo], [1, f"n{i}", *limit(algo), "0"])


def fw_two(i: int) -> tuple[list, list]:
    return ["{b}:fw1", "{b}:fw2"], [2, "-", *limit("fw"), *limit("fw", window_ms=60_000), "0"]


FINGERPRINT = "sha256:" + "ab" * 32
OWNER = uuid.uuid4().hex


def idem(i: int) -> tuple[list, list]:
    return (["{b}:fw", f"{{b}}:idem:{i}"],
            [1, "-", *limit("fw"), "1", FINGERPRINT, OWNER, 60_000])


def idem_only(i: int) -> tuple[list, list]:
    """An idempotent request on a policy with no limit (make bench's idem_fresh and
    idem_replay): the record and the owner's cancellation marker, no counter."""
    return ([f"{{b}}:idem:{i}", f"{{b}}:cancel:{i}"],
            [0, "-", "1", FINGERPRINT, OWNER, 60_000, "0"])


# The stored response of make bench's replay: a 201 with its content-type and a small JSON body.
RESPONSE = '{"status":201,"headers":[["content-type","application/json"]],"body":"{\\"id\\":1}"}'


def call(client, sha: str, tagged: bool, keys: list, argv: list):
    """One EVALSHA of `sha` and the body's reply: with a call tag first among the arguments
    (and the reply untagged) when the version `tagged` takes one, as the filter calls it."""
    if not tagged:
        return client.evalsha(sha, len(keys), *keys, *argv)
    tag = new_tag()
    return untag(client.evalsha(sha, len(keys), *keys, tag, *argv), tag)


def completed(client, sha: str, tagged: bool) -> None:
    """One COMPLETED record that every call of the replay case finds (its key is call 0's):
    acquired by acquire.lua, completed by complete.lua, as the filter does."""
    keys, argv = idem_only(0)
    if call(client, sha, tagged, keys, argv)[-3] != 1:
        raise AssertionError("idem_replay: the record was not acquired")
    complete = client.script_load(script_source("complete"))
    if call(client, complete, True, keys[:1], [OWNER, FINGERPRINT, 600_000, RESPONSE]) != 1:
        raise AssertionError("idem_replay: the record was not completed")


def replay(i: int) -> tuple[list, list]:
    return idem_only(0)


def processing_records(client, sha: str, tagged: bool) -> None:
    """A PROCESSING record for each call of the complete case, acquired by acquire.lua (by
    EVAL: only complete.lua's EVALSHA calls are counted)."""
    acquire = script_source(SCRIPTS[0])
    pipe = client.pipeline(transaction=False)
    tags = [new_tag() for _ in range(COMPLETE_N)]
    for i, tag in enumerate(tags):
        keys, argv = idem_only(i)
        pipe.eval(acquire, len(keys), *keys, tag, *argv)
    if any(untag(reply, tag)[-3] != 1 for reply, tag in zip(pipe.execute(), tags)):
        raise AssertionError("complete: a record was not acquired")


def complete(i: int) -> tuple[list, list]:
    return [idem_only(i)[0][0]], [OWNER, FINGERPRINT, 600_000, RESPONSE]


# The complete case's calls (each completes a record of its own, so N is capped to this).
COMPLETE_N = 5000


def lease(i: int) -> tuple[list, list]:
    return (["{b}:fw", f"{{b}}:lease:{i}", f"{{b}}:fence:{i}"],
            [1, "-", *limit("fw"), "0", "1", OWNER, 30_000, 86_400_000])


def rejected(i: int) -> tuple[list, list]:
    return ["{b}:full"], [1, "-", *limit("fw", lim=1), "0"]


def fill(client, sha: str, tagged: bool) -> None:
    keys, argv = rejected(0)
    if call(client, sha, tagged, keys, argv)[0] != 1:
        raise AssertionError("fw_rej: the call that fills the limit was not admitted")


CASES = [
    Case("fw", "fixed_window, 1 limit, admitted", one("fw")),
    Case("sw", "sliding_window, 1 limit, admitted", one("sw")),
    Case("sl", "sliding_log, 1 limit, admitted", one("sl")),
    Case("tb", "token_bucket, 1 limit, admitted", one("tb")),
    Case("cc", "concurrency, 1 limit, admitted", one("cc")),
    Case("fw2", "fixed_window, 2 limits, admitted", fw_two),
    Case("idem", "fw + idempotency on, fresh record key", idem, acquired=(-3,)),
    Case("idem0", "idempotency only (no limit), fresh record key", idem_only, acquired=(-3,)),
    Case("replay", "idempotency only, the COMPLETED record with the same fingerprint", replay,
         setup=completed, expect=((-3, 3),)),
    Case("complete", "complete.lua: PROCESSING -> COMPLETED", complete, setup=processing_records,
         script=SCRIPTS[1], returns=1, max_calls=COMPLETE_N),
    Case("lease", "fw + lease on, fresh lease/fence keys", lease, acquired=(-2,)),
    Case("fw_rej", "fixed_window, 1 limit, rejected", rejected, admitted=0, setup=fill),
]


def run_case(client, sha: str, case: Case, n: int, tagged: bool) -> float:
    """`case` run `n` times by EVALSHA of `sha` (a version that takes a call tag when
    `tagged`): Redis's time per call."""
    if case.max_calls is not None:
        n = min(n, case.max_calls)
    client.flushall()
    if case.setup:
        case.setup(client, sha, tagged)
    client.config_resetstat()
    done = 0
    while done < n:
        pipe = client.pipeline(transaction=False)
        batch = range(done, min(n, done + PIPELINE))
        tags = [new_tag() if tagged else None for _ in batch]
        for i, tag in zip(batch, tags):
            keys, argv = case.call(i)
            pipe.evalsha(sha, len(keys), *keys, *([tag] if tagged else []), *argv)
        replies = pipe.execute()
        for reply, tag in zip(replies, tags):
            reply = untag(reply, tag) if tagged else reply
            if case.returns is not None:
                if reply != case.returns:
                    raise AssertionError(f"{case.name}: unexpected reply {reply!r}")
            elif (reply[0] != case.admitted or any(reply[j] != 1 for j in case.acquired)
                    or any(reply[j] != v for j, v in case.expect)):
                raise AssertionError(f"{case.name}: unexpected reply {reply!r}")
        done += len(batch)
    stats = client.info("commandstats")["cmdstat_evalsha"]
    if stats["calls"] != n:
        raise AssertionError(f"{case.name}: {stats['calls']} EVALSHA calls counted, expected {n}")
    return float(stats["usec_per_call"])


def main() -> int:
    n = int(os.environ.get("N", "20000"))
    rounds = int(os.environ.get("ROUNDS", "5"))
    rev = os.environ.get("REV", "HEAD")
    wanted = os.environ.get("CASES")
    cases = [c for c in CASES if not wanted or c.name in wanted.split(",")]
    if not cases:
        print(f"no case matches CASES={wanted!r}; cases: {', '.join(c.name for c in CASES)}")
        return 2

    env = " ".join(f"{k}={shlex.quote(os.environ[k])}"
                   for k in ("N", "ROUNDS", "CASES", "REV") if k in os.environ)
    print(f"reproduce: cd {ROOT} && {env + ' ' if env else ''}.venv/bin/python bench/scripts.py")
    lua = LUA.relative_to(ROOT).as_posix()
    # Revisions before the scripts moved under src/redis/ kept them in src/lua/.
    at_rev = subprocess.run(["git", "cat-file", "-e", f"{rev}:{lua}/mod.rs"], cwd=ROOT,
                            capture_output=True).returncode == 0
    rev_lua = lua if at_rev else "src/lua"
    head_all = sources(lambda name: subprocess.run(
        ["git", "show", f"{rev}:{rev_lua}/{name}"], cwd=ROOT, check=True, capture_output=True,
        text=True).stdout)
    head_src = {name: head_all[name] for name in SCRIPTS}
    cur_src = {name: script_source(name) for name in SCRIPTS}
    for name in SCRIPTS:
        same = " (identical)" if head_src[name] == cur_src[name] else ""
        print(f"{lua}/{name}.lua as run: {rev} vs working tree{same}")
    print(f"{n} pipelined EVALSHA per case and version (complete: at most {COMPLETE_N}), "
          f"{rounds} rounds")
    print(f"us = INFO commandstats usec_per_call, median of the rounds; ratio = {rev} / now, "
          f"median of the per-round ratios; load average {os.getloadavg()[0]:.2f}")

    with tempfile.TemporaryDirectory(prefix="bench-scripts-") as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            client = server.client()
            version = client.info("server")["redis_version"]
            head_sha = {p: client.script_load(head_src[p]) for p in SCRIPTS}
            cur_sha = {p: client.script_load(cur_src[p]) for p in SCRIPTS}
            print(f"redis-server {version} on 127.0.0.1:{server.port}\n")
            # Whether each version takes a call tag (the working tree's does; a revision's
            # from before the tags does not).
            head_tagged = {p: takes_tag(head_src[p]) for p in SCRIPTS}
            cur_tagged = {p: takes_tag(cur_src[p]) for p in SCRIPTS}
            first = SCRIPTS[0]
            run_case(client, head_sha[first], CASES[0], min(n, 2000), head_tagged[first])
            run_case(client, cur_sha[first], CASES[0], min(n, 2000), cur_tagged[first])
            print(f"{'case':<8} {'what':<40} {rev + ' us':>9} {'now us':>9} {'ratio':>7}")
            for case in cases:
                head, cur = [], []
                for _ in range(rounds):
                    head.append(run_case(client, head_sha[case.script], case, n,
                                         head_tagged[case.script]))
                    cur.append(run_case(client, cur_sha[case.script], case, n,
                                        cur_tagged[case.script]))
                ratio = statistics.median(h / c for h, c in zip(head, cur))
                print(f"{case.name:<8} {case.about:<40} {statistics.median(head):>9.2f} "
                      f"{statistics.median(cur):>9.2f} {ratio:>6.2f}x", flush=True)
            client.close()
        finally:
            server.stop()
            stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
