#!/usr/bin/env python3
"""`make bench`: the filter's cost, measured against plain Envoy in the same run.

Starts the stack of the end-to-end tests (tests/harness: Redis, webdis, the release .wasm in
real Envoy) with Envoy answering by a direct response, so no upstream is measured. Every
scenario gets its own Envoy and runs alternately with a plain Envoy (no filter) driven by the
same wrk script: plain, scenario, plain, scenario, ... for BENCH_ROUNDS rounds of
BENCH_SECONDS each. The figures quoted are medians over the rounds and the ratio to plain is
the median of the per-round ratios: on a shared 2-core machine an absolute req/s says little,
the ratio measured a few seconds apart says more, and CPU seconds per 10k requests (from
/proc/<pid>/stat) are steadier still.

Idempotency with fresh keys is the exception: the filter (rightly) releases a record whose
request got Envoy's direct response (it never reached a service), so that scenario's Envoy and
its plain baseline both proxy to a third Envoy that answers directly. Replays never reach it.
`rl_allowed_leased` runs once src/config/mod.rs knows `"mode": "leased"`; before that the
report says "not built yet".

Two anchors have no goal: `local_ratelimit` (Envoy's native filter, in-process) and
`wasm_floor`, a proxy-wasm filter that only reads `:path` and bumps a counter
(bench/floor, a crate of its own, built here with cargo before the stack starts): what any
proxy-wasm filter costs on this machine at the least; `wasm_floor_429` is the same filter
answering every request with a local 429 shaped like ours (the rejected path's floor). Another,
`wasm_naive`, is the same
filter making one webdis callout per request (an EVAL of a one-line INCR) that the request
waits for: the naive design the issue quotes, what one callout per request costs whatever
the script does; the anchor of the exact rate-limit paths. `wasm_pause` and
`wasm_naive_batched` isolate resuming a request from the root and batching callouts per root
turn; `wasm_floor_reads` is the floor plus 20 header reads per request, what one host call that
returns data costs; `wasm_floor_raw` is the floor on the proxy-wasm ABI itself, without the
Rust SDK and exporting only the callbacks it uses, and `wasm_floor_raw_all` the same exporting
every stream callback: what the SDK's dispatch and the callbacks a filter does not use cost. `wasm_naive_rl`, `wasm_floor_429_keyed` and `wasm_floor_rl` are the least a
filter limiting each tenant with the IETF headers does on the exact, rejected and leased paths
(the tenant found in the header map, the headers formatted), reported beside their goals'
anchors; `wasm_naive_script` is `wasm_naive_rl` sending the exact path's own call (acquire.lua by
`EVALSHA`, its arguments and key shape), so the exact path's gap splits into the script call's
part and the filter's own; `wasm_naive_batched_rl` and `wasm_naive_batched_script` do the same
for the batched path (the root's one callout per turn naming each waiting request's tenant,
with the two commands per key or batch.lua's acquire sub-calls). `wasm_naive_code128`, `256`
and `512` are `wasm_naive_script` running that many distinct functions with each request's
headers (20, 41 and 81 KiB of Wasm, arithmetic only): what the code a filter runs costs in
Envoy beyond its instructions, in the exact path's rounds; `wasm_naive_sparse124` runs what
`wasm_naive_code256` runs, with as many bytes interleaved beside it that never run: what code
that shares lines with code that runs costs. `wasm_naive_post` and `wasm_naive_routed` make the naive callout on the idempotency
scenarios' POST requests, answered by Envoy (as replays are) and through the upstream (as
fresh keys are): what one callout costs on those requests. The incumbent, `envoy_rls_exact`
and `envoy_rls_cached`, is no Wasm filter: Envoy's ratelimit filter calling, per request, a
rate limit service (bench/rls, on the Limitador library, built here with cargo) whose counters
are in the same Redis, checked there on every call or cached and flushed. Envoy's ratelimit
filter calls nothing on a direct response, so it runs through the upstream, in the rounds of
the filter's exact, batched, leased and rejected paths run the same way (`*_routed`); pushed
past a limit (`envoy_rls_rejected`), what it admits is recorded, not checked. A scenario with a goal against an
anchor, or with `anchors_in_rounds`, runs that anchor in its own rounds
(plain, anchor, scenario[, compare], and the reverse in every other round, so a drift within a
round favours no one), and its ratio is the median of the per-round ratios.

Output: a table on stdout; bench/results.json, every run's raw numbers (a build output, not
committed); bench/summary.json, the medians the docs and the chart quote (committed, about 20 KiB);
and, rendered from the summary alone, bench/report.svg and the results section of
docs/performance.md. `bench/run.py --summarize [RESULTS] [--revision REV]` writes the summary
from raw results and renders from it; `bench/run.py --render` renders from the committed
summary.
Exit status 1 if a run had socket errors or unexpected statuses, or the correctness check
failed (rl_rejected must admit exactly its limit per run); a missed goal is a finding, not an
error.

Environment: BENCH_ROUNDS (5), BENCH_SECONDS (5), BENCH_WARMUP (1, seconds per Envoy before
a scenario's rounds), BENCH_SCENARIOS (comma list, default all), ENVOY_BIN (another Envoy),
BENCH_COMPARE (a git revision: its .wasm is built from `git archive` under
target/bench-compare and runs in every round of every scenario of the filter, right after the
working tree's, with the same plugin config: plain, scenario, compare, then compare,
scenario, plain, ... so two builds are compared side by side in one run; the table gets a
`<scenario>@<rev>` row each), BENCH_PERF (a directory: `perf record` samples the measured Envoy
through each run into `<envoy>-<n>.data` there; BENCH_PERF_ARGS adds options, `-g` for call
chains, which cross the Wasm JIT's frames, so a sample shows whether it is in the filter's
code, in a host call it made, or in Envoy outside both).
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness.envoy import DEFAULT_WASM, Envoy, envoy_binary  # noqa: E402
from harness.proc import (ADMIN_USER, PrerequisiteMissing, Service, free_port,  # noqa: E402
                          require_binary, stop_all)
from harness.scripts import BATCHED, batch_source, script_source  # noqa: E402
from harness.stack import Stack  # noqa: E402

BENCH = ROOT / "bench"
WORK = BENCH / "work"
LUA = BENCH / "lua"
FLOOR = BENCH / "floor"
FLOOR_WASM = FLOOR / "target" / "wasm32-wasip1" / "release" / "wasm_floor.wasm"
# The floor on the proxy-wasm ABI itself, without the SDK (bench/floor/examples): with only the
# callbacks it uses exported, and with every stream callback exported.
FLOOR_RAW_WASM = FLOOR_WASM.parent / "examples" / "floor_raw.wasm"
FLOOR_RAW_ALL_WASM = FLOOR_WASM.parent / "examples" / "floor_raw_all.wasm"
FLOOR_WASMS = (FLOOR_WASM, FLOOR_RAW_WASM, FLOOR_RAW_ALL_WASM)
FLOOR_BUILD = ["cargo", "build", "--release", "--target", "wasm32-wasip1", "--lib", "--examples",
               "--manifest-path", str((FLOOR / "Cargo.toml").relative_to(ROOT))]
# The incumbent's rate limit service (bench/rls, built natively like bench/floor).
RLS = BENCH / "rls"
RLS_BIN = RLS / "target" / "release" / "cg-bench-rls"
_RLS_MANIFEST = ["--release", "--manifest-path", str((RLS / "Cargo.toml").relative_to(ROOT))]
# Linted as it is built (clippy shares the build's dependencies; `make lint` checks its format
# only, so the tests never wait for RocksDB).
RLS_BUILD = [["cargo", "clippy", *_RLS_MANIFEST, "--", "-D", "warnings"],
             ["cargo", "build", *_RLS_MANIFEST]]
# A full run's raw numbers, every round of every target: a build output (ignored by git).
RESULTS = BENCH / "results.json"
# The committed summary of the last full run (about 20 KiB: the medians quoted), and what is
# rendered from it alone: the chart and docs/performance.md's results section.
SUMMARY = BENCH / "summary.json"
CHART = BENCH / "report.svg"

THREADS = 2
CONNECTIONS = 16
TENANT_HEADER = "x-tenant-id"
REJECTED_LIMIT = 10
HUGE_LIMIT = 1_000_000_000
SETTLE_SECONDS = 0.5  # after wrk ends: completions and lease releases go out on the next tick
IDEM_BODY = b'{"customer":"c-123","items":[{"sku":"SKU-1","qty":2}],"currency":"EUR"}'
CLK_TCK = os.sysconf("SC_CLK_TCK")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return positive_int(name, raw) if raw else default


def positive_int(name: str, raw: str) -> int:
    """`raw`, a setting of `name`, as a whole number of at least 1; exits naming it if not."""
    try:
        value = int(raw)
    except ValueError:
        sys.exit(f"{name}={raw!r} is not an integer")
    if value < 1:
        sys.exit(f"{name}={raw!r} must be at least 1")
    return value


def latency_plan() -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The open loop's scenarios and rates: BENCH_LATENCY_SCENARIOS (a subset of
    LATENCY_SCENARIOS) and BENCH_LATENCY_RATES (requests/s), comma-separated; the defaults
    without them."""
    names = tuple(s.strip() for s in os.environ.get("BENCH_LATENCY_SCENARIOS", "").split(",")
                  if s.strip()) or LATENCY_SCENARIOS
    unknown = sorted(set(names) - set(LATENCY_SCENARIOS))
    if unknown:
        sys.exit(f"BENCH_LATENCY_SCENARIOS: unknown {unknown}; known: "
                 f"{', '.join(LATENCY_SCENARIOS)}")
    rates = tuple(positive_int("BENCH_LATENCY_RATES", r.strip())
                  for r in os.environ.get("BENCH_LATENCY_RATES", "").split(",") if r.strip())
    return names, rates or LATENCY_RATES


# --- scenarios -----------------------------------------------------------------------------------


@dataclass
class Scenario:
    name: str
    title: str
    script: str  # bench/lua/<script>
    plugin: Callable[[Stack], dict] | None = None  # None: no wasm filter
    wasm_path: Path | None = None  # another .wasm than ours (the plugin config goes to it)
    local_ratelimit: dict | None = None
    # The incumbent: Envoy's ratelimit filter calling bench/rls (Limitador on the stack's
    # Redis) for every request, its counters kept "exact" (checked in Redis on every call) or
    # "cached" (counted in memory, flushed to Redis in the background).
    rls: str | None = None
    # The incumbent's limit per tenant (per hour).
    rls_limit: int = HUGE_LIMIT
    goal: float | None = None
    # Anchors measured in the same run, each with the ratio to reach (None: reported only):
    # the scenario's throughput over the anchor's, both as ratios to their plain rounds.
    anchors: tuple[tuple[str, float | None], ...] = ()
    # Its anchors run in its own rounds even without a goal (an anchor doing what it does, on
    # the same requests and routing, where a comparison with another run's rows would not say
    # what bounds it).
    anchors_in_rounds: bool = False
    # Expected answers: None = every response 2xx; N = exactly N admitted (2xx) per run, the
    # rest 429 (counted as the successful outcome of a rejected-path benchmark).
    admitted_exactly: int | None = None
    # Every response is a 429 (an anchor that rejects every request).
    all_rejected: bool = False
    # Responses are 2xx or 429 and what was admitted is recorded, not checked: the incumbent
    # on a limit it is pushed past (what it admits is a finding of the run).
    admission_reported: int | None = None
    # The limit whose filter counters must agree with `admitted_exactly`.
    counted_limit: str = "policy.api.limit.tenant"
    # Script arguments for one run; `nonce` is unique per run.
    args: Callable[["Scenario", str], list[str]] = lambda s, nonce: [nonce]
    prepare: Callable[["Scenario", Envoy], None] | None = None
    # Checks of the filter's own counters for one run: (stats delta, record) -> problems.
    verify: Callable[[dict, dict], list[str]] | None = None
    # The scenario's Envoy routes to an upstream (a plain Envoy answering with a direct
    # response) instead of answering itself; `plain_routed`: its paired plain Envoy too.
    routed: bool = False
    plain_routed: bool = False
    # Headers the scenario's Envoy adds to every response before the filter reads it (the
    # service's answer, e.g. what a request really cost).
    response_headers: dict | None = None
    state: dict = field(default_factory=dict)


# The filter's Redis timeout in the benchmark: wide enough that a neighbour's CPU burst on this
# shared 2-core VM (wrk, Envoy, webdis and Redis saturate it) does not turn slow calls into
# fail-closed 503s, which fail the run; the tests keep 50 ms to exercise the timeout itself.
REDIS_TIMEOUT = "250ms"


# The calibration anchor's extra header reads per request: each is a host call that returns
# data, so the host calls back into the VM to allocate it (one `:path` read is the floor's own).
FLOOR_READS = 20


def plugin_base(stack: Stack, name: str, policies: list[dict]) -> dict:
    return {"redis": stack.redis_section(key_prefix=f"cg:bench:{name}", timeout=REDIS_TIMEOUT),
            "identity": {"tenant_header": TENANT_HEADER, "principal_header": "x-user-id",
                         "missing_tenant": "reject"},
            "failure_mode": "fail_closed",
            "policies": policies}


def rate_limited(name: str, limit: int, batch: dict | bool | None = None,
                 **extra) -> Callable[[Stack], dict]:
    def build(stack: Stack) -> dict:
        rl = {"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window", "limit": limit,
              "window": "1h", **extra}
        config = plugin_base(stack, name, [{"name": "api", "match": {"path_prefix": "/api"},
                                            "rate_limits": [rl]}])
        if batch is not None:
            config["redis"]["batch"] = batch
        return config
    return build


def no_policy(stack: Stack) -> dict:
    # A policy the benchmark's GET /api/items never matches: the filter parses the request and
    # finds nothing to do.
    return plugin_base(stack, "no_policy", [{
        "name": "create-order", "match": {"methods": ["POST"], "path_prefix": "/orders"},
        "rate_limits": [{"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window",
                         "limit": 100, "window": "1m"}]}])


# concurrency: a cap no run reaches; cost_charge: what a request declares (x-request-cost)
# and what its response reports.
CONCURRENCY_CAP = 32
COST, CHARGED = 3, 5

# lease_contended: waiters on one resource, and the time each holds it at the upstream.
# Open-loop latency: fixed request rates a busy sidecar sees, each measured by oha
# (`--latency-correction`: from when a request was due, not when a connection was free) on
# the scenario's Envoy and on plain Envoy at the same rate, alternately. The naive anchors run
# too: what one callout per request adds whatever the filter does (and with the least a
# per-tenant limit does, and with the exact path's own call), beside the callout paths; and so
# does the gateway alone (oha straight to webdis), the round trip a callout cannot beat.
LATENCY_RATES = (500, 1000, 2000)
LATENCY_SCENARIOS = ("no_policy", "wasm_naive", "wasm_naive_rl", "wasm_naive_script",
                     "rl_allowed", "rl_allowed_batched", "rl_allowed_leased", "rl_rejected",
                     # Beside the incumbent, through the upstream as it runs.
                     "envoy_rls_exact", "rl_allowed_routed", "rl_allowed_batched_routed",
                     "envoy_rls_cached", "rl_allowed_leased_routed")
LATENCY_CONNECTIONS = 32
# What each may add over plain Envoy at 1,000 requests/s: (p50, p99) in ms.
LATENCY_GOALS = {"rl_allowed": (0.5, 2.0), "rl_allowed_batched": (0.5, 2.0),
                 "no_policy": (0.1, 0.5), "rl_rejected": (0.1, 0.5), "rl_allowed_leased": (0.1, 0.5)}
CONTENDED_WAITERS = 32
CONTENDED_OP_MS = 20

SCALE_POLICIES = 1000
SCALE_LIMITS = 5


def scale(name: str, matching: int | None) -> Callable[[Stack], dict]:
    """SCALE_POLICIES policies of SCALE_LIMITS tenant limits each; policy `matching` (or none)
    guards the benchmark's GET /api/items, the others other paths: what a request costs when
    the configuration is large, on the no-policy path and on the rejected path of the first
    and the last policy."""
    def build(stack: Stack) -> dict:
        policies = []
        for i in range(SCALE_POLICIES):
            prefix = "/api" if i == matching else f"/other-{i}/"
            limits = [{"name": f"l{j}", "by": ["tenant"], "algorithm": "fixed_window",
                       "limit": REJECTED_LIMIT, "window": f"{j + 1}h"} for j in range(SCALE_LIMITS)]
            policies.append({"name": f"p{i:04d}", "match": {"path_prefix": prefix},
                             "rate_limits": limits})
        return plugin_base(stack, name, policies)
    return build


def idempotent(name: str) -> Callable[[Stack], dict]:
    def build(stack: Stack) -> dict:
        return plugin_base(stack, name, [{
            "name": "create-order", "match": {"methods": ["POST"], "path_prefix": "/orders"},
            "idempotency": {"header": "idempotency-key", "required": True, "methods": ["POST"],
                            "processing_ttl": "2m", "completed_ttl": "10m",
                            "fingerprint": ["method", "path", "body"], "max_request_body": "512KiB",
                            "replay": "full", "max_response_body": "64KiB",
                            "replay_headers": ["content-type"], "complete": "sync"}}])
    return build


def leased(stack: Stack) -> dict:
    return plugin_base(stack, "lease", [{
        "name": "activate-order", "match": {"methods": ["POST"], "path_prefix": "/orders/"},
        "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "10s", "on_busy": "reject",
                  "fencing_header": "x-fencing-token", "extend": True}}])


def prepare_replay(scenario: Scenario, envoy: Envoy) -> None:
    """Store the response the rounds replay: one request with the key, then check a replay."""
    key = f"bench-replay-{uuid.uuid4().hex[:12]}"
    headers = {TENANT_HEADER: "bench", "content-type": "application/json", "idempotency-key": key}
    first = envoy.request("POST", "/orders", headers=headers, body=IDEM_BODY)
    second = envoy.request("POST", "/orders", headers=headers, body=IDEM_BODY)
    if first.status != 200 or second.status != 200 or \
            second.headers.get("idempotent-replayed") != "true":
        raise RuntimeError(f"idem_replay warm-up: expected 200 then a replayed 200, got {first!r} "
                           f"then {second!r}")
    scenario.state["key"] = key


def near(a: int, b: int) -> bool:
    """Counts of one run that may differ by the requests wrk abandoned in flight at its end."""
    return abs(a - b) <= CONNECTIONS


def cg(stats: dict, name: str) -> int:
    return stats.get(f"wasmcustom.cg.{name}", 0)


def per_request(stats: dict, rec: dict, *names: str) -> list[str]:
    """The problem, if any, with the counters `names` (added up) over one run: each request wrk
    counted once, plus at most one per connection still in flight at its end."""
    count = sum(stats.get(name, 0) for name in names)
    if not rec["requests"] <= count <= rec["requests"] + CONNECTIONS:
        return [f"{' + '.join(names)} counted {count} for {rec['requests']} requests at wrk"]
    return []


def verify_floor(stats: dict, rec: dict) -> list[str]:
    """Every request wrk counted went through the floor filter (plus those in flight at its
    end)."""
    return per_request(stats, rec, "wasmcustom.floor.requests")


def verify_naive(stats: dict, rec: dict) -> list[str]:
    """Every request made its callout and got a 200 from webdis."""
    return verify_floor(stats, rec) + per_request(stats, rec, "wasmcustom.floor.callouts")


def verify_rls(stats: dict, rec: dict) -> list[str]:
    """Every request was let through by the rate limit service's answer (a failed call fails
    closed, a 500 the status check reports)."""
    return per_request(stats, rec, RLS_OK)


def verify_rls_decided(stats: dict, rec: dict) -> list[str]:
    """Every request was decided by the rate limit service's answer, under or over the
    limit."""
    return per_request(stats, rec, RLS_OK, RLS_OVER)


def webdis_path(*words: str) -> str:
    """A webdis command's words as its path: each percent-encoded, `.` too (webdis reads the
    last one as the answer's format), `/`-separated; a `{tenant}` in a word stays as it is
    (the floor filter puts each request's tenant there)."""
    return "/".join(urllib.parse.quote(a, safe="").replace(".", "%2E")
                    for a in words).replace("%7Btenant%7D", "{tenant}")


def naive(stack: Stack) -> dict:
    """The floor filter's callout mode: EVAL of a one-line INCRBY on one key, through webdis
    (INCRBY: the gateway's Redis user may run only the commands the filter's scripts use)."""
    script = "return redis.call('INCRBY', KEYS[1], 1)"
    body = webdis_path("EVAL", script, "1", "cg:bench:naive") + ".raw"
    redis = stack.redis_section()
    return {"callout": {"cluster": redis["cluster"], "authority": redis["authority"],
                        "authorization": redis["authorization"], "body": body}}


# The limit the per-tenant anchors act out (the scenarios' own: a fixed window of an hour).
ANCHOR_LIMIT = {"tenant_header": TENANT_HEADER, "window_s": 3600}


def naive_rl(stack: Stack) -> dict:
    """The naive callout as the least shared fixed window with the IETF headers: the tenant
    found in the header map and named in the key, INCRBY then PEXPIRE on a new window or PTTL
    (the two commands acquire.lua's fast path runs), the answer's body read, and the two
    `RateLimit` headers on the response."""
    script = ("local n = redis.call('INCRBY', KEYS[1], 1) "
              "if n == 1 then redis.call('PEXPIRE', KEYS[1], 3600000) return {n, 3600000} end "
              "return {n, redis.call('PTTL', KEYS[1])}")
    body = webdis_path("EVAL", script, "1", "cg:bench:naive_rl:{tenant}") + ".raw"
    callout = naive(stack)["callout"]
    return {"callout": {**callout, "body": body}, "limit": {**ANCHOR_LIMIT, "limit": HUGE_LIMIT}}


# acquire.lua as the filter runs it (its pieces before it: src/redis/scripts/mod.rs).
ACQUIRE_LUA = script_source("acquire")
# acquire.lua's arguments for rl_allowed's one limit (a fixed window of an hour).
ACQUIRE_ARGS = ("1", "-", "fw", str(HUGE_LIMIT), "3600000", str(HUGE_LIMIT), "0", "1", "0", "0")
# The call tag the anchors send before those arguments, as the filter sends one with every call
# (src/redis/tag.rs): 16 hex digits, decimal ones so that the floor reads the reply's values,
# the tag first, as integers.
ANCHOR_TAG = "1000000000000001"
# A key of the exact path's key shape (the tenant in its hash tag, the policy, the limit and
# the scope after it), under `prefix`.
SCRIPT_KEY = "cg:bench:%s:rl:{t.{tenant}}:api:tenant:fw:%d/3600000:{tenant}"


def naive_script(stack: Stack) -> dict:
    """The per-tenant naive callout sending the exact path's own call instead of the two-line
    script: `EVALSHA` of acquire.lua with a call tag and rl_allowed's arguments, a key of its
    key's shape (the tenant in its hash tag, the policy, the limit and the scope after it), its
    answer's remaining and reset read. Beside `wasm_naive_rl`, what the script call costs (Redis, the
    gateway, the bytes both ways); beside rl_allowed, what the filter costs in Envoy."""
    sha = stack.redis.script_load(ACQUIRE_LUA)
    key = SCRIPT_KEY % ("naive_script", HUGE_LIMIT)
    body = webdis_path("EVALSHA", sha, "1", key, ANCHOR_TAG, *ACQUIRE_ARGS)
    callout = naive(stack)["callout"]
    return {"callout": {**callout, "body": body + ".raw"},
            "limit": {**ANCHOR_LIMIT, "limit": HUGE_LIMIT, "acquire_reply": True}}


def naive_batched_rl(stack: Stack) -> dict:
    """The batched anchor per tenant: the root's one callout per turn runs `wasm_naive_rl`'s two
    commands on each waiting request's tenant key (one EVAL looping over its keys), its answer
    split into each request's count and time left for its two `RateLimit` headers."""
    script = ("local out = {} for i, k in ipairs(KEYS) do "
              "local n, t = redis.call('INCRBY', k, 1), 3600000 "
              "if n == 1 then redis.call('PEXPIRE', k, t) else t = redis.call('PTTL', k) end "
              "out[2 * i - 1] = n out[2 * i] = t end return out")
    return {**naive(stack), "batch": True,
            "batch_call": {"head": webdis_path("EVAL", script),
                           "key": webdis_path("cg:bench:naive_batched_rl:{tenant}")},
            "limit": {**ANCHOR_LIMIT, "limit": HUGE_LIMIT}}


def naive_batched_script(stack: Stack) -> dict:
    """The batched anchor per tenant sending the batched exact path's own call: `EVALSHA` of
    batch.lua with a call tag and an acquire.lua sub-call per waiting request (rl_allowed's
    arguments, a key of the exact path's shape), each sub-reply's remaining and reset read. Beside
    `wasm_naive_batched_rl`, what the script call costs; beside rl_allowed_batched, what the
    filter costs in Envoy."""
    sha = stack.redis.script_load(batch_source())
    return {**naive(stack), "batch": True,
            "batch_call": {"head": webdis_path("EVALSHA", sha),
                           "key": webdis_path(SCRIPT_KEY % ("naive_batched_script", HUGE_LIMIT)),
                           "tag": ANCHOR_TAG,
                           "count_arg": True,
                           "args": webdis_path(str(BATCHED.index("acquire") + 1), "1",
                                               str(len(ACQUIRE_ARGS)), *ACQUIRE_ARGS)},
            "limit": {**ANCHOR_LIMIT, "limit": HUGE_LIMIT, "acquire_reply": True}}


def floor_429_keyed(stack: Stack) -> dict:
    """The local 429 as the least per-tenant rejection: the tenant found in the header map and
    its window in a table of the worker, the clock read, and the time left in the 429's
    `Retry-After`, `RateLimit` and body."""
    reply = floor_429(stack)["local_reply"]
    body = reply["body"].replace("retry after 3600 s", "retry after {reset} s")
    return {"local_reply": {**reply, "body": body},
            "limit": {**ANCHOR_LIMIT, "limit": REJECTED_LIMIT}}


def floor_rl(stack: Stack) -> dict:
    """The floor as the least local limit per tenant with the IETF headers: the tenant found in
    the header map and counted in a table of the worker, the clock read, and the two
    `RateLimit` headers on the response."""
    return {"limit": {**ANCHOR_LIMIT, "limit": HUGE_LIMIT}}


def floor_429(stack: Stack) -> dict:
    """The floor filter's local reply mode, answering what the over-limit cache answers: the
    same status, headers and body shape as coordination-guard's 429."""
    body = json.dumps({
        "detail": 'rate limit "tenant" of operation "api" exceeded; retry after 3600 s',
        "status": 429, "title": "Quota Exceeded",
        "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
        "violated-policies": ["tenant"]}, separators=(",", ":"))
    return {"local_reply": {"status": 429, "body": body, "headers": [
        ["content-type", "application/problem+json"], ["retry-after", "3600"],
        ["ratelimit-policy", '"tenant";q=10;w=3600'], ["ratelimit", '"tenant";r=0;t=3600']]}}


def verify_no_calls(stats: dict, rec: dict) -> list[str]:
    calls = cg(stats, "redis.calls")
    return [f"{calls} Redis calls, expected none (no policy matches)"] if calls else []


def verify_allowed(stats: dict, rec: dict) -> list[str]:
    ok2 = stats.get("http.ingress.downstream_rq_2xx", 0)
    allowed = cg(stats, "policy.api.limit.tenant.allowed")
    rejected = cg(stats, "policy.api.limit.tenant.rejected")
    if rejected or not near(allowed, ok2):
        return [f"limit allowed {allowed}, rejected {rejected}, for {ok2} 2xx responses"]
    return []


def aborted(stats: dict) -> int:
    """Requests whose client went away before the answer: wrk drops its in-flight requests
    when it stops. Their settlement races the stream's end and may be counted oddly."""
    return stats.get("http.ingress.downstream_rq_rx_reset", 0)


def verify_in_flight(stats: dict, rec: dict) -> list[str]:
    """Every admitted request took a slot and gave it back (or was charged): an acquire and a
    release (or charge) each, alone or in batches of at most BATCH's max_requests (a request
    wrk abandons in flight at its end took one or may have, and gave it back or handed a
    release with its marker to the root on its reset)."""
    problems = verify_allowed(stats, rec)
    requests = stats.get("http.ingress.downstream_rq_total", 0)
    calls = cg(stats, "redis.calls")
    least = 2 * requests // BATCH["max_requests"]
    if calls < least - CONNECTIONS or calls > 2 * requests + CONNECTIONS:
        problems.append(f"{calls} Redis calls for {requests} requests (expected an acquire "
                        f"and a release or charge each, alone or batched)")
    return problems


def verify_charged(stats: dict, rec: dict) -> list[str]:
    """Every request was charged what its response said: CHARGED units, one charge call each."""
    problems = verify_in_flight(stats, rec)
    allowed = cg(stats, "policy.api.limit.tenant.allowed")
    charged = cg(stats, "policy.api.limit.tenant.charged")
    if abs(charged - CHARGED * allowed) > CHARGED * CONNECTIONS:
        problems.append(f"charged {charged} units for {allowed} allowed requests (expected "
                        f"{CHARGED} each)")
    return problems


def verify_fresh(stats: dict, rec: dict) -> list[str]:
    ok2 = stats.get("http.ingress.downstream_rq_2xx", 0)
    idem = {n: cg(stats, f"policy.create-order.idem.{n}")
            for n in ("acquired", "completed", "released", "replayed", "conflict", "in_progress",
                      "complete_failed", "stale_owner", "outcome_unknown")}
    never = {n: idem[n] for n in ("replayed", "conflict", "in_progress", "complete_failed")
             if idem[n]}
    too_many = {n: idem[n] for n in ("released", "stale_owner", "outcome_unknown")
                if idem[n] > aborted(stats)}
    if never or too_many or not near(idem["acquired"], ok2) or not near(idem["completed"], ok2):
        return [f"idempotency counters {idem} for {ok2} 2xx responses and {aborted(stats)} "
                f"aborted (expected every answered request acquired and completed)"]
    return []


def verify_replay(stats: dict, rec: dict) -> list[str]:
    ok2 = stats.get("http.ingress.downstream_rq_2xx", 0)
    replayed = cg(stats, "policy.create-order.idem.replayed")
    acquired = cg(stats, "policy.create-order.idem.acquired")
    stale = cg(stats, "policy.create-order.idem.stale_owner")
    problems = []
    if acquired or not near(replayed, ok2) or stale > aborted(stats):
        problems.append(f"idempotency replayed {replayed}, acquired {acquired}, stale_owner "
                        f"{stale}, for {ok2} 2xx responses and {aborted(stats)} aborted "
                        f"(expected every request replayed)")
    upstream = rec.get("upstream_envoy", {}).get("requests", 0)
    if upstream:
        problems.append(f"{upstream} requests reached the upstream (expected replays only)")
    return problems


def verify_lease(stats: dict, rec: dict) -> list[str]:
    ok2 = stats.get("http.ingress.downstream_rq_2xx", 0)
    lease = {n: cg(stats, f"policy.activate-order.lease.{n}")
             for n in ("acquired", "released", "busy", "lost", "missing_resource")}
    bad = {n: v for n, v in lease.items() if v and n not in ("acquired", "released")}
    if bad or not near(lease["acquired"], ok2) or not near(lease["released"], ok2):
        return [f"lease counters {lease} for {ok2} 2xx responses (expected every request "
                f"acquired and released)"]
    return []


# The code-footprint anchors: distinct functions run per request, and the KiB of Wasm they
# are (bench/floor/build.rs's functions, measured in a build with names).
CODE_FUNCTIONS = {128: 20, 256: 41, 512: 81}
# The sparse code anchor's functions: each runs about 340 bytes (its steps and the tests of
# its branches) and holds about as many that never run (those branches, interleaved), so 124
# of them run what `wasm_naive_code256` runs with twice the bytes in the same lines.
SPARSE_FUNCTIONS = 124
# The code anchors of the leased path's rounds: the per-tenant floor running that many of the
# same functions (20 KiB and 41 KiB).
LOCAL_CODE_FUNCTIONS = {128: 20, 256: 41}
# The anchors doing the least a filter with the path's features does (the tenant found in the
# header map, its count, the RateLimit headers; on the exact paths also the path's own call),
# and for the batched path the bare batched anchor: what each path's goal is read against.
FEATURE_MINIMAL = {
    "rl_allowed": ("wasm_naive_rl", "wasm_naive_script"),
    "rl_allowed_batched": ("wasm_naive_batched_rl", "wasm_naive_batched_script",
                           "wasm_naive_batched"),
    "rl_rejected": ("wasm_floor_429_keyed",),
    "rl_allowed_leased": ("wasm_floor_rl",),
}
# Callout coalescing in the batched scenarios: the default, spelled out.
BATCH = {"max_delay": "1ms", "max_requests": 32, "cross_slot": True}
# The filter's throughput over the incumbent's on the same path, each a ratio to its plain
# round: at least this (ahead of it).
INCUMBENT_GOAL = 1.0


def scenarios() -> list[Scenario]:
    found = [
        Scenario("local_ratelimit", "Envoy local_ratelimit (native anchor)", "get.lua",
                 local_ratelimit={"max_tokens": HUGE_LIMIT, "fill_interval": "1s"}),
        # The incumbent, exact and cached: Envoy's own global rate limiting (its ratelimit
        # filter and a rate limit service on Limitador, counters in Redis), per tenant. Envoy's
        # ratelimit filter only calls the service on a route to a cluster (not on a direct
        # response), so these run through the upstream, and so do their plain Envoy and the
        # filter's scenarios beside them (the *_routed ones).
        Scenario("envoy_rls_exact", "Envoy ratelimit filter + Limitador on Redis, exact, "
                 "10k tenants, via upstream (incumbent)", "tenants.lua", rls="exact",
                 verify=verify_rls, routed=True, plain_routed=True),
        # Cached on one hot counter: the case leased quota is for.
        Scenario("envoy_rls_cached", "Envoy ratelimit filter + Limitador on Redis, cached, "
                 "1 tenant, via upstream (incumbent)", "get.lua", rls="cached",
                 verify=verify_rls, routed=True, plain_routed=True),
        # Pushed past its limit (rl_rejected_routed's pair): what it admits is recorded.
        Scenario("envoy_rls_rejected", f"Envoy ratelimit filter + Limitador on Redis, exact, "
                 f"1 tenant, limit {REJECTED_LIMIT}/1h, via upstream (incumbent)",
                 "one_tenant.lua", rls="exact", rls_limit=REJECTED_LIMIT,
                 admission_reported=REJECTED_LIMIT, verify=verify_rls_decided, routed=True,
                 plain_routed=True),
        # The floor filter ignores its configuration; the template wants one.
        Scenario("wasm_floor", "minimal proxy-wasm filter (anchor)", "get.lua",
                 lambda stack: {}, wasm_path=FLOOR_WASM, verify=verify_floor),
        # What the SDK's dispatch and the callbacks a filter does not use cost (the floor's
        # work on the ABI itself; it ignores its configuration).
        Scenario("wasm_floor_raw", "minimal filter without the SDK, exporting only the "
                 "callbacks it uses (anchor)", "get.lua", lambda stack: {},
                 wasm_path=FLOOR_RAW_WASM, verify=verify_floor),
        Scenario("wasm_floor_raw_all", "minimal filter without the SDK, exporting every "
                 "stream callback (anchor)", "get.lua", lambda stack: {},
                 wasm_path=FLOOR_RAW_ALL_WASM, verify=verify_floor),
        Scenario("wasm_floor_429", "minimal filter answering 429 locally (anchor)", "get.lua",
                 floor_429, wasm_path=FLOOR_WASM, verify=verify_floor, all_rejected=True),
        # Calibration: what one host call that returns data (a header value) costs.
        Scenario("wasm_floor_reads", f"minimal filter + {FLOOR_READS} header reads per request "
                 "(anchor)", "get.lua", lambda stack: {"reads": FLOOR_READS},
                 wasm_path=FLOOR_WASM, verify=verify_floor),
        Scenario("wasm_naive", "minimal filter + 1 webdis callout per request (anchor)",
                 "get.lua", naive, wasm_path=FLOOR_WASM, verify=verify_naive),
        # What pausing a request and resuming it from the root costs without a callout, and
        # the least one callout per root turn (for all requests since) costs: the anchors of
        # the paths that resume requests from the root (batching).
        Scenario("wasm_pause", "minimal filter, paused and resumed from the root (anchor)",
                 "get.lua", lambda stack: {"pause": True}, wasm_path=FLOOR_WASM,
                 verify=verify_floor),
        Scenario("wasm_naive_batched", "minimal filter + 1 webdis callout per root turn "
                 "(anchor)", "get.lua", lambda stack: {**naive(stack), "batch": True},
                 wasm_path=FLOOR_WASM, verify=verify_naive),
        # The least a filter limiting each tenant with the IETF headers does on each path: what
        # bounds the paths whose goals the bare anchors above put out of reach (see
        # bench/floor).
        Scenario("wasm_naive_rl", "minimal filter + 1 webdis callout per request, per tenant "
                 "with RateLimit headers (anchor)", "tenants.lua", naive_rl,
                 wasm_path=FLOOR_WASM, verify=verify_naive),
        Scenario("wasm_naive_script", "minimal filter + 1 webdis callout per request, per "
                 "tenant with RateLimit headers, sending the exact path's acquire.lua call "
                 "(anchor)", "tenants.lua", naive_script, wasm_path=FLOOR_WASM,
                 verify=verify_naive),
        # What the code a filter runs costs, beyond the instructions: the exact path's call
        # anchor running CODE_FUNCTIONS[n] distinct functions (about 160 bytes of Wasm each).
        *[Scenario(f"wasm_naive_code{n}", f"minimal filter + 1 webdis callout per request, per "
                   f"tenant with RateLimit headers, sending the exact path's acquire.lua call, "
                   f"running {n} distinct functions ({kib} KiB of Wasm) per request (anchor)",
                   "tenants.lua", lambda stack, n=n: {**naive_script(stack), "code": n},
                   wasm_path=FLOOR_WASM, verify=verify_naive)
          for n, kib in CODE_FUNCTIONS.items()],
        # The same as the second code anchor's bytes run, with as many bytes beside them in
        # the same lines that never run: what code that shares lines with code that runs costs.
        Scenario(f"wasm_naive_sparse{SPARSE_FUNCTIONS}", "minimal filter + 1 webdis callout "
                 "per request, per tenant with RateLimit headers, sending the exact path's "
                 f"acquire.lua call, running {SPARSE_FUNCTIONS} distinct functions (41 KiB of "
                 "Wasm run, 41 KiB beside it that never runs) per request (anchor)",
                 "tenants.lua",
                 lambda stack: {**naive_script(stack), "code": SPARSE_FUNCTIONS, "sparse": True},
                 wasm_path=FLOOR_WASM, verify=verify_naive),
        Scenario("wasm_naive_batched_rl", "minimal filter + 1 webdis callout per root turn, "
                 "per tenant with RateLimit headers (anchor)", "tenants.lua", naive_batched_rl,
                 wasm_path=FLOOR_WASM, verify=verify_naive),
        Scenario("wasm_naive_batched_script", "minimal filter + 1 webdis callout per root "
                 "turn, per tenant with RateLimit headers, sending the batched exact path's "
                 "batch.lua call (anchor)", "tenants.lua", naive_batched_script,
                 wasm_path=FLOOR_WASM, verify=verify_naive),
        Scenario("wasm_floor_429_keyed", "minimal filter answering 429 locally per tenant "
                 "(anchor)", "get.lua", floor_429_keyed, wasm_path=FLOOR_WASM,
                 verify=verify_floor, all_rejected=True),
        Scenario("wasm_floor_rl", "minimal filter counting per tenant with RateLimit headers "
                 "(anchor)", "get.lua", floor_rl, wasm_path=FLOOR_WASM, verify=verify_floor),
        *[Scenario(f"wasm_floor_rl_code{n}", "minimal filter counting per tenant with "
                   f"RateLimit headers, running {n} distinct functions ({kib} KiB of Wasm) per "
                   "request (anchor)", "get.lua",
                   lambda stack, n=n: {**floor_rl(stack), "code": n}, wasm_path=FLOOR_WASM,
                   verify=verify_floor)
          for n, kib in LOCAL_CODE_FUNCTIONS.items()],
        # The naive callout on the idempotency scenarios' requests (a POST with a JSON body):
        # answered by Envoy as the replays are, and routed through the upstream as fresh keys
        # are (with a routed plain Envoy), each in the rounds of the scenario it bounds.
        Scenario("wasm_naive_post", "minimal filter + 1 webdis callout per POST with a body "
                 "(anchor)", "idem_replay.lua", naive, wasm_path=FLOOR_WASM,
                 verify=verify_naive),
        Scenario("wasm_naive_routed", "minimal filter + 1 webdis callout per POST with a body, "
                 "via upstream (anchor)", "idem_fresh.lua", naive, wasm_path=FLOOR_WASM,
                 verify=verify_naive, routed=True, plain_routed=True),
        Scenario("no_policy", "filter, no policy matches", "get.lua", no_policy, goal=0.70,
                 anchors=(("wasm_floor", 0.95), ("wasm_floor_raw_all", None),
                          ("wasm_floor_raw", None)),
                 verify=verify_no_calls),
        Scenario("rl_allowed", "rate limit allowed, 10k tenants, unbatched", "tenants.lua",
                 rate_limited("rl_allowed", HUGE_LIMIT, batch=False), goal=0.40,
                 verify=verify_allowed,
                 anchors=(("wasm_naive", 0.90), ("wasm_naive_rl", None),
                          ("wasm_naive_script", None),
                          *((f"wasm_naive_code{n}", None) for n in CODE_FUNCTIONS),
                          (f"wasm_naive_sparse{SPARSE_FUNCTIONS}", None))),
        # Per-tenant limits at runtime: the exact path with `overrides: true` on its limit and
        # no override set (every call reads the tenant's override key and finds nothing),
        # beside the same path without, in the same rounds: what the feature costs when on.
        Scenario("rl_allowed_overrides", "rate limit allowed, 10k tenants, unbatched, "
                 "overrides on (none set)", "tenants.lua",
                 rate_limited("rl_allowed_overrides", HUGE_LIMIT, batch=False, overrides=True),
                 verify=verify_allowed, anchors=(("rl_allowed", None),), anchors_in_rounds=True),
        # Callout coalescing (the default): the same traffic, the acquires of one worker sent
        # together.
        Scenario("rl_allowed_batched", "rate limit allowed, 10k tenants, batched", "tenants.lua",
                 rate_limited("rl_allowed_batched", HUGE_LIMIT, batch=BATCH),
                 goal=0.40, verify=verify_allowed,
                 anchors=(("wasm_naive", 2.0), ("wasm_naive_batched", None),
                          ("wasm_naive_batched_rl", None), ("wasm_naive_batched_script", None))),
        Scenario("rl_rejected", f"rate limit rejected, 1 tenant, limit {REJECTED_LIMIT}/1h",
                 "one_tenant.lua", rate_limited("rl_rejected", REJECTED_LIMIT), goal=0.65,
                 admitted_exactly=REJECTED_LIMIT,
                 anchors=(("wasm_floor_429", 0.95), ("wasm_floor_429_keyed", None))),
        # Envoy's direct response counts as "never reached the service" and releases the
        # record: fresh keys go through an upstream (a direct-response Envoy), and so does
        # their paired plain Envoy, so the ratio is the filter's alone.
        Scenario("idem_fresh", "idempotency, fresh key per request (via upstream)",
                 "idem_fresh.lua", idempotent("idem_fresh"), verify=verify_fresh,
                 routed=True, plain_routed=True, anchors=(("wasm_naive_routed", None),),
                 anchors_in_rounds=True),
        # Only the warm-up request reaches the upstream; every measured request is a replay
        # answered by the filter, compared with plain Envoy's direct response as elsewhere.
        Scenario("idem_replay", "idempotency replay, same key", "idem_replay.lua",
                 idempotent("idem_replay"), goal=0.35, verify=verify_replay, routed=True,
                 args=lambda s, nonce: [s.state["key"]], prepare=prepare_replay,
                 anchors=(("wasm_naive_post", None),), anchors_in_rounds=True),
        Scenario("lease", "lease per request (acquire + release)", "lease.lua", leased,
                 verify=verify_lease, anchors=(("wasm_naive", None),)),
        # Quotas: a slot taken and given back per request (the response waits for the
        # release, so a cap above wrk's 16 connections never rejects), and a cost consumed at
        # admission then corrected by the response's charge (10k tenants).
        Scenario("concurrency", f"concurrency limit {CONCURRENCY_CAP} in flight, 1 tenant "
                 "(take + release)", "get.lua",
                 rate_limited("concurrency", CONCURRENCY_CAP, algorithm="concurrency",
                              window="30s"), verify=verify_in_flight,
                 anchors=(("wasm_naive", None),)),
        Scenario("cost_charge", f"rate limit allowed, cost {COST} then charge {CHARGED} from a "
                 "response header, 10k tenants", "tenants.lua",
                 rate_limited("cost_charge", HUGE_LIMIT,
                              cost={"header": "x-request-cost", "default": 1},
                              charge={"response_header": "x-tokens-used"}),
                 args=lambda s, nonce: [nonce, f"x-request-cost: {COST}"],
                 response_headers={"x-tokens-used": str(CHARGED)}, verify=verify_charged,
                 anchors=(("wasm_naive", None),)),
        # A large configuration: compare with no_policy and rl_rejected of the same run.
        Scenario("scale_no_policy", f"{SCALE_POLICIES} policies x {SCALE_LIMITS} limits, "
                 "none matches", "get.lua", scale("scale_no_policy", None),
                 verify=verify_no_calls),
        Scenario("scale_first_rejected", f"{SCALE_POLICIES} policies, the first matches, "
                 "rejected", "one_tenant.lua", scale("scale_first_rejected", 0),
                 admitted_exactly=REJECTED_LIMIT, counted_limit="policy.p0000.limit.l0"),
        Scenario("scale_last_rejected", f"{SCALE_POLICIES} policies, the last matches, "
                 "rejected", "one_tenant.lua", scale("scale_last_rejected", SCALE_POLICIES - 1),
                 admitted_exactly=REJECTED_LIMIT,
                 counted_limit=f"policy.p{SCALE_POLICIES - 1:04d}.limit.l0"),
    ]
    # One hot counter (like the local_ratelimit anchor): the case leased quota is for.
    after = next(i for i, s in enumerate(found) if s.name == "rl_allowed") + 1
    found.insert(after, Scenario(
        "rl_allowed_leased", "rate limit allowed, leased quota, 1 tenant", "get.lua",
        rate_limited("rl_allowed_leased", HUGE_LIMIT, mode="leased"), goal=0.60,
        verify=verify_allowed,
        anchors=(("local_ratelimit", 0.80), ("wasm_floor", None), ("wasm_floor_rl", None),
                 *((f"wasm_floor_rl_code{n}", None) for n in LOCAL_CODE_FUNCTIONS))))
    # Beside the incumbent: the exact, batched and leased paths through the upstream, as the
    # incumbent runs, each with it in its rounds.
    beside = [
        ("rl_allowed_routed", "rate limit allowed, 10k tenants, unbatched, via upstream",
         "tenants.lua", rate_limited("rl_allowed_routed", HUGE_LIMIT, batch=False),
         "envoy_rls_exact"),
        ("rl_allowed_batched_routed", "rate limit allowed, 10k tenants, batched, via upstream",
         "tenants.lua", rate_limited("rl_allowed_batched_routed", HUGE_LIMIT, batch=BATCH),
         "envoy_rls_exact"),
        ("rl_allowed_leased_routed", "rate limit allowed, leased quota, 1 tenant, via upstream",
         "get.lua", rate_limited("rl_allowed_leased_routed", HUGE_LIMIT, mode="leased"),
         "envoy_rls_cached"),
    ]
    found += [Scenario(name, title, script, plugin, verify=verify_allowed, routed=True,
                       plain_routed=True, anchors=((incumbent, INCUMBENT_GOAL),))
              for name, title, script, plugin, incumbent in beside]
    # One tenant pushed past its limit by 16 connections, a fresh tenant per run: how fast
    # each rejects, and what each admits (ours exactly its limit, checked; the incumbent's
    # is recorded, beside).
    found.append(Scenario("rl_rejected_routed", f"rate limit rejected, 1 tenant, limit "
                          f"{REJECTED_LIMIT}/1h, via upstream", "one_tenant.lua",
                          rate_limited("rl_rejected_routed", REJECTED_LIMIT),
                          admitted_exactly=REJECTED_LIMIT, routed=True, plain_routed=True,
                          anchors=(("envoy_rls_rejected", INCUMBENT_GOAL),)))
    return found


GOALS = {"no_policy": 0.70, "rl_allowed": 0.40, "rl_allowed_batched": 0.40, "rl_rejected": 0.65,
         "rl_allowed_leased": 0.60, "idem_replay": 0.35}


# --- measuring -----------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    fields = data[data.rindex(")") + 2:].split()  # fields[0] is field 3 (state)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy_seconds() -> float:
    """CPU time the whole machine spent busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in parts[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def children_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def self_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


STAT_FILTER = (r"^(http\.ingress\.downstream_rq_|wasmcustom\.(cg|floor)\.|"
               r"cluster\.upstream\.ratelimit\.)")
# Envoy's ratelimit filter counts the rate limit service's answers in the route's cluster.
RLS_OK = "cluster.upstream.ratelimit.ok"
RLS_OVER = "cluster.upstream.ratelimit.over_limit"
# Envoy's counters of the gateway cluster: callouts sent, and connections opened to carry them.
GATEWAY_RQ = "cluster.redis_gateway.upstream_rq_total"
GATEWAY_CX = "cluster.redis_gateway.upstream_cx_total"
GATEWAY_STATS = r"^cluster\.redis_gateway\.upstream_(rq|cx)_total$"


class Bench:
    def __init__(self, stack: Stack, rounds: int, seconds: int, warmup: int,
                 compare: tuple[str, Path] | None = None):
        self.stack = stack
        # (revision, .wasm) of another build to run next to ours in every round.
        self.compare = compare
        self.rounds = rounds
        self.seconds = seconds
        self.warmup = warmup
        self.lua_dir = WORK / "lua"
        self.lua_dir.mkdir(parents=True, exist_ok=True)
        self.errors: list[str] = []
        self.plain = stack.envoy
        self._upstream: Envoy | None = None
        self._plain_proxy: Envoy | None = None
        # The rate limit service of each incumbent Envoy (stopped with it).
        self.rls: dict[Envoy, Service] = {}

    def start_envoy(self, name: str, plugin: dict | None, *, routed: bool = False,
                    local_ratelimit: dict | None = None, wasm_path: Path | None = None,
                    response_headers: dict | None = None, rls: str | None = None,
                    rls_limit: int = HUGE_LIMIT) -> Envoy:
        """An Envoy on this stack; `routed`: it proxies to the upstream Envoy instead of
        answering itself; `wasm_path`: another .wasm than the stack's; `response_headers`:
        added to every response; `rls`: Envoy's ratelimit filter instead of a Wasm filter,
        calling a rate limit service of its own (bench/rls in that mode, started here and
        stopped with it). Registered with the stack, so `stack.stop()` stops it too."""
        workdir = WORK / "stack" / f"envoy-{name}"
        wasm_path = wasm_path or self.stack.wasm_path
        service = self.start_rls(workdir, rls, rls_limit) if rls else None
        variant = {"rate_limit_service": {"port": service.port, "header": TENANT_HEADER}
                   } if service else {}
        try:
            if routed:
                s = self.stack
                envoy = Envoy(workdir, plugin, self.upstream().port, s.webdis.port,
                              wasm_path=wasm_path, blackhole_port=s.blackhole.port,
                              dead_port=s.dead_port, local_ratelimit=local_ratelimit,
                              direct_response=False, concurrency=s.concurrency,
                              response_headers=response_headers, **variant)
            else:
                envoy = self.stack.new_envoy(workdir, plugin, local_ratelimit=local_ratelimit,
                                             wasm_path=wasm_path,
                                             response_headers=response_headers, **variant)
        except BaseException:
            if service:
                service.stop()
            raise
        if service:
            self.rls[envoy] = service
        self.stack.envoys.append(envoy)
        try:
            envoy.start()
        except BaseException:
            self.stop_envoy(envoy)  # by its own pid, and forgotten by the stack
            raise
        return envoy

    def start_rls(self, workdir: Path, mode: str, limit: int) -> Service:
        """bench/rls on a free port in `mode`, its counters in the stack's Redis (as the
        admin user: its keys are Limitador's own), `limit` per tenant per hour."""
        redis = self.stack.redis_server
        url = (f"redis://{ADMIN_USER}:{redis.admin_password}@127.0.0.1:{redis.port}")
        service = Service()
        service.port = free_port()
        service.launch(f"rls-{mode}", [str(RLS_BIN), str(service.port), url, mode,
                                        str(limit), "3600"], workdir, service.port, 20.0)
        return service

    def stop_envoy(self, envoy: Envoy) -> None:
        if envoy in self.stack.envoys:
            self.stack.envoys.remove(envoy)
        envoy.stop()
        service = self.rls.pop(envoy, None)
        if service is not None:
            service.stop()

    def upstream(self) -> Envoy:
        """The service of routed scenarios: a plain Envoy that answers with a direct response."""
        if self._upstream is None:
            self._upstream = self.start_envoy("upstream", None)
        return self._upstream

    def plain_proxy(self) -> Envoy:
        """Plain Envoy (no filter) proxying to the upstream Envoy: the baseline of routed runs."""
        if self._plain_proxy is None:
            self._plain_proxy = self.start_envoy("plain-proxy", None, routed=True)
        return self._plain_proxy

    def plain_for(self, scenario: Scenario) -> Envoy:
        """The plain Envoy a scenario is measured against: routed or answering itself."""
        return self.plain_proxy() if scenario.plain_routed else self.plain

    def script(self, name: str) -> Path:
        """bench/lua/<name> with bench/lua/done.lua appended (the machine-readable summary)."""
        path = self.lua_dir / name
        if not path.exists():
            path.write_text((LUA / name).read_text() + (LUA / "done.lua").read_text())
        return path

    def snapshot(self, envoy: Envoy) -> dict:
        commandstats = self.stack.redis.info("commandstats")
        s = self.stack
        own_pids = [e.proc.pid for e in s.envoys] + [s.webdis.proc.pid,
                                                     s.redis_server.proc.pid,
                                                     s.upstream.proc.pid]
        own_pids += [r.proc.pid for r in self.rls.values() if r.proc]
        snap = {
            "stats": envoy.stats(filter=STAT_FILTER),
            "evals": {name: dict(commandstats.get(f"cmdstat_{name}", {"calls": 0, "usec": 0}))
                      for name in ("evalsha", "eval")},
            "cpu": {"envoy": cpu_seconds(envoy.proc.pid),
                    "webdis": cpu_seconds(s.webdis.proc.pid),
                    "redis": cpu_seconds(s.redis_server.proc.pid)},
            "own_cpu": sum(cpu_seconds(pid) for pid in own_pids) + self_cpu_seconds(),
            "children_cpu": children_cpu_seconds(),
            "machine": machine_busy_seconds(),
            "time": time.monotonic(),
        }
        if envoy in self.rls and self.rls[envoy].proc:
            snap["cpu"]["rls"] = cpu_seconds(self.rls[envoy].proc.pid)
        if self._upstream is not None:
            snap["upstream_requests"] = self._upstream.stat("http.ingress.downstream_rq_total")
            snap["cpu"]["upstream_envoy"] = cpu_seconds(self._upstream.proc.pid)
        return snap

    def wrk(self, envoy: Envoy, script: Path, args: list[str], seconds: int) -> dict:
        argv = ["wrk", f"-t{THREADS}", f"-c{CONNECTIONS}", f"-d{seconds}s", "--latency",
                "-s", str(script), f"{envoy.url}/", "--", *args]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL)
        perf = None
        if os.environ.get("BENCH_PERF") and seconds > 2:
            out_file = (Path(os.environ["BENCH_PERF"])
                        / f"{envoy.workdir.name}-{next(PERF_RUNS)}.data")
            out_file.parent.mkdir(parents=True, exist_ok=True)
            perf = subprocess.Popen(["perf", "record", "-q", "-F", "2000",
                                     *os.environ.get("BENCH_PERF_ARGS", "").split(), "-p",
                                     str(envoy.proc.pid), "-o", str(out_file), "--", "sleep",
                                     str(seconds - 1)], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            out, _ = proc.communicate(timeout=seconds + 30)
            if perf is not None:
                perf.wait(timeout=30)
        except BaseException:
            proc.kill()  # by its own pid
            proc.wait()
            if perf is not None:
                perf.kill()
                perf.wait()
            raise
        line = next((ln for ln in out.splitlines() if ln.startswith("BENCH_RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"wrk failed ({proc.returncode}): {shlex.join(argv)}\n{out}")
        return json.loads(line[len("BENCH_RESULT "):])

    def contended(self, wasm_path: Path, label: str) -> dict:
        """One resource, CONTENDED_WAITERS connections, each request holding its lease for
        CONTENDED_OP_MS at the (Python) upstream: how busy the waiters keep the resource.
        Utilisation = executions x op time / wall time (1.0: never idle between holders)."""
        s = self.stack
        plugin = {"redis": s.redis_section(key_prefix=f"cg:bench:contended:{label}",
                                           timeout=REDIS_TIMEOUT),
                  "identity": {"tenant_header": TENANT_HEADER, "missing_tenant": "reject"},
                  "policies": [{"name": "hot", "match": {"path_prefix": "/hot/"},
                                "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "10s",
                                          "on_busy": "wait", "max_wait": "30s"}}]}
        envoy = Envoy(WORK / "stack" / f"envoy-contended-{label}", plugin, s.upstream.port,
                      s.webdis.port, wasm_path=wasm_path, blackhole_port=s.blackhole.port,
                      dead_port=s.dead_port, concurrency=s.concurrency)
        s.envoys.append(envoy)
        envoy.start()
        try:
            argv = ["wrk", "-t2", f"-c{CONTENDED_WAITERS}", f"-d{self.seconds}s", "--latency",
                    "--timeout", "40s", "-s", str(self.script("contended.lua")), f"{envoy.url}/",
                    "--", uuid.uuid4().hex[:12], str(CONTENDED_OP_MS)]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=self.seconds + 60,
                                 stdin=subprocess.DEVNULL).stdout
            line = next((ln for ln in out.splitlines() if ln.startswith("BENCH_RESULT ")), None)
            if line is None:
                raise RuntimeError(f"wrk failed: {shlex.join(argv)}\n{out}")
            r = json.loads(line[len("BENCH_RESULT "):])
            seconds = r["duration_us"] / 1e6
            ok = r["requests"] - r["non_2xx_3xx"]
            return {"label": label, "waiters": CONTENDED_WAITERS, "op_ms": CONTENDED_OP_MS,
                    "executions_per_second": ok / seconds,
                    "utilisation": ok * CONTENDED_OP_MS / 1000 / seconds,
                    "refused": r["non_2xx_3xx"], "latency_p50_ms": r["latency_p50_us"] / 1000,
                    "latency_p99_ms": r["latency_p99_us"] / 1000}
        finally:
            s.envoys.remove(envoy)
            envoy.stop()

    def oha(self, envoy: Envoy, rate: int, seconds: int, tenant: str) -> dict:
        """One open-loop run: `rate` requests/s for `seconds` s; percentiles in ms."""
        return self.oha_at(f"{envoy.url}/api/items", rate, seconds,
                           ["-H", f"{TENANT_HEADER}: {tenant}"])

    def oha_at(self, url: str, rate: int, seconds: int, request: list[str]) -> dict:
        """[`Bench.oha`] of any URL, `request` saying the rest (oha's method, headers, body)."""
        argv = [require_binary("oha", "make deps-bench"), "-z", f"{seconds}s", "-q", str(rate),
                "-c", str(LATENCY_CONNECTIONS), "--latency-correction", "--no-tui",
                "--output-format", "json", *request, url]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60,
                              stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise RuntimeError(f"oha failed ({proc.returncode}): {shlex.join(argv)}\n"
                               f"{proc.stderr[-2000:]}")
        out = json.loads(proc.stdout)
        pct = out["latencyPercentiles"]
        statuses = {str(k): v for k, v in out.get("statusCodeDistribution", {}).items()}
        errors = out.get("errorDistribution", {})
        return {"rate": rate, "requests_per_second": round(out["summary"]["requestsPerSec"], 1),
                "p50_ms": round(pct["p50"] * 1000, 3), "p99_ms": round(pct["p99"] * 1000, 3),
                "p999_ms": round(pct["p99.9"] * 1000, 3), "statuses": statuses,
                "errors": errors}

    def open_loop(self, scenario: Scenario, rates: tuple[int, ...], seconds: int) -> dict:
        """The latency `scenario` adds over plain Envoy at each rate, p50/p99/p99.9: each rate
        measured on plain Envoy and on the scenario's, alternately (in the order of
        `round_order`), `self.rounds // 2` times (at least once; the medians are reported)."""
        plugin = scenario.plugin(self.stack) if scenario.plugin else None
        envoy = self.start_envoy(f"{scenario.name}-open-loop", plugin,
                                 wasm_path=scenario.wasm_path, routed=scenario.routed,
                                 rls=scenario.rls, rls_limit=scenario.rls_limit)
        plain = self.plain_for(scenario)
        try:
            out = {"scenario": scenario.name, "rates": []}
            for rate in rates:
                runs: dict[str, list[dict]] = {"plain": [], "scenario": []}
                before = envoy.stats(filter=GATEWAY_STATS)
                for round_no in range(max(1, self.rounds // 2)):
                    tenant = f"ol-{scenario.name}-{rate}-{round_no}-{uuid.uuid4().hex[:6]}"
                    pair = [("plain", plain), ("scenario", envoy)]
                    for kind, target in round_order(pair, round_no + 1):
                        runs[kind].append(self.oha(target, rate, seconds, tenant))
                after = envoy.stats(filter=GATEWAY_STATS)
                entry = {"rate": rate, "gateway": {
                    k: after.get(name, 0) - before.get(name, 0)
                    for k, name in (("callouts", GATEWAY_RQ), ("connections", GATEWAY_CX))}}
                for kind, rs in runs.items():
                    entry[kind] = {k: _median([r[k] for r in rs])
                                   for k in ("requests_per_second", "p50_ms", "p99_ms", "p999_ms")}
                    entry[kind]["runs"] = rs
                entry["added_ms"] = {k: round(entry["scenario"][k] - entry["plain"][k], 3)
                                     for k in ("p50_ms", "p99_ms", "p999_ms")}
                out["rates"].append(entry)
                print(f"  open loop {scenario.name} @ {rate}/s: adds "
                      f"{entry['added_ms']['p50_ms']:.2f} / {entry['added_ms']['p99_ms']:.2f} / "
                      f"{entry['added_ms']['p999_ms']:.2f} ms (p50 / p99 / p99.9)", flush=True)
            return out
        finally:
            self.stop_envoy(envoy)

    def gateway_alone(self, rates: tuple[int, ...], seconds: int) -> list[dict]:
        """The naive anchor's callout sent by oha straight to webdis at each rate, no Envoy:
        the gateway's and Redis's round trip, which every callout pays on top of what Envoy
        and the filter add. `self.rounds // 2` runs per rate (at least one), medians."""
        s = self.stack
        callout = naive(s)["callout"]
        request = ["-m", "POST", "-H", f"authorization: {callout['authorization']}",
                   "-H", "content-type: text/plain", "-d", callout["body"]]
        out = []
        for rate in rates:
            runs = [self.oha_at(f"{s.webdis.url}/", rate, seconds, request)
                    for _ in range(max(1, self.rounds // 2))]
            bad = failed_runs(runs)
            if bad:
                raise RuntimeError(f"the gateway answered other than 200: {bad}")
            entry = {k: _median([r[k] for r in runs])
                     for k in ("requests_per_second", "p50_ms", "p99_ms", "p999_ms")}
            out.append({"rate": rate, **entry, "runs": runs})
            print(f"  open loop, the gateway alone @ {rate}/s: {entry['p50_ms']:.2f} / "
                  f"{entry['p99_ms']:.2f} / {entry['p999_ms']:.2f} ms (p50 / p99 / p99.9)",
                  flush=True)
        return out

    def settle(self, envoy: Envoy) -> None:
        """Wait for the filter's background calls (completions, releases) to drain."""
        time.sleep(SETTLE_SECONDS)
        last = envoy.stat("wasmcustom.cg.redis.calls")
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = envoy.stat("wasmcustom.cg.redis.calls")
            if now == last:
                return
            last = now

    def run(self, envoy: Envoy, scenario: Scenario, kind: str, round_no: int,
            seconds: int) -> dict:
        nonce = f"{scenario.name}-{kind}-{round_no}-{uuid.uuid4().hex[:8]}"
        args = scenario.args(scenario, nonce)
        before = self.snapshot(envoy)
        result = self.wrk(envoy, self.script(scenario.script), args, seconds)
        self.settle(envoy)
        after = self.snapshot(envoy)
        return self.record(scenario, kind, round_no, args, before, after, result)

    def record(self, scenario: Scenario, kind: str, round_no: int, args: list[str],
               before: dict, after: dict, w: dict) -> dict:
        stats = {name: value - before["stats"].get(name, 0)
                 for name, value in after["stats"].items()
                 if value - before["stats"].get(name, 0)}
        evals = {name: {k: after["evals"][name].get(k, 0) - before["evals"][name].get(k, 0)
                        for k in ("calls", "usec")} for name in ("evalsha", "eval")}
        cpu = {name: round(after["cpu"][name] - before["cpu"].get(name, 0), 3)
               for name in after["cpu"]}
        cpu["wrk"] = round(after["children_cpu"] - before["children_cpu"], 3)
        machine = after["machine"] - before["machine"]
        own = after["own_cpu"] - before["own_cpu"] + cpu["wrk"]
        wall = after["time"] - before["time"]
        requests = w["requests"]
        per_10k = {name: round(value / requests * 10_000, 4) if requests else None
                   for name, value in cpu.items()}
        rec = {
            "scenario": scenario.name, "kind": kind, "round": round_no, "script_args": args,
            "requests": requests,
            "requests_per_second": round(requests / (w["duration_us"] / 1e6), 1),
            "latency_ms": {"p50": w["latency_p50_us"] / 1000, "p90": w["latency_p90_us"] / 1000,
                           "p99": w["latency_p99_us"] / 1000,
                           "mean": round(w["latency_mean_us"] / 1000, 3),
                           "max": w["latency_max_us"] / 1000},
            "wrk": w,
            "envoy_stats_delta": stats,
            "redis_commandstats_delta": evals,
            "redis_calls_per_request": _per(stats.get("wasmcustom.cg.redis.calls", 0)
                                            + stats.get("wasmcustom.floor.calls", 0), requests),
            "redis_evals_per_request": _per(evals["evalsha"]["calls"] + evals["eval"]["calls"],
                                            requests),
            "cpu_seconds": cpu,
            "cpu_seconds_per_10k_requests": per_10k,
            # CPU that no process of this benchmark used while it ran (other work on the
            # machine), in cores: the noise indicator for this run.
            "foreign_cpu_cores": round(max(0.0, machine - own) / wall, 3) if wall > 0 else None,
        }
        if "upstream_requests" in after:
            rec["upstream_envoy"] = {"requests": after["upstream_requests"]
                                     - before.get("upstream_requests", 0)}
        rec["problems"] = self.check(scenario if kind != "plain" else None, rec)
        for problem in rec["problems"]:
            self.errors.append(f"{scenario.name} {kind} round {round_no}: {problem}")
        return rec

    @staticmethod
    def check(scenario: Scenario | None, rec: dict) -> list[str]:
        """Socket errors and statuses; `scenario` None for a plain run (all 2xx expected)."""
        w, s = rec["wrk"], rec["envoy_stats_delta"]
        problems = []
        sockets = {k: w[k] for k in ("connect_errors", "read_errors", "write_errors", "timeouts")
                   if w[k]}
        if sockets:
            problems.append(f"socket errors {sockets}")
        if w["requests"] == 0:
            problems.append("no request completed")
        ok2, c4, c5 = (s.get(f"http.ingress.downstream_rq_{c}", 0) for c in ("2xx", "4xx", "5xx"))
        other = {c: s[f"http.ingress.downstream_rq_{c}"] for c in ("1xx", "3xx")
                 if s.get(f"http.ingress.downstream_rq_{c}")}
        if c5:
            problems.append(f"{c5} responses 5xx (Envoy downstream_rq_5xx)")
        if other:
            problems.append(f"unexpected status classes {other}")
        limit = scenario.admitted_exactly if scenario else None
        if scenario is not None and scenario.admission_reported is not None:
            rejected = s.get("http.ingress.downstream_rq_4xx", 0)
            # 2xx and 4xx only (5xx and other classes are problems above).
            rec["admission"] = {"limit": scenario.admission_reported, "admitted_2xx": ok2,
                                "rejected_4xx": rejected}
        elif scenario is not None and scenario.all_rejected:
            if ok2 or w["non_2xx_3xx"] != w["requests"]:
                problems.append(f"{ok2} responses 2xx at Envoy, {w['non_2xx_3xx']} non-2xx of "
                                f"{w['requests']} at wrk (expected every response 429)")
        elif limit is None:
            if c4 or w["non_2xx_3xx"]:
                problems.append(f"{c4} responses 4xx at Envoy, {w['non_2xx_3xx']} non-2xx at wrk "
                                f"(expected every response 2xx)")
        else:
            allowed = cg(s, f"{scenario.counted_limit}.allowed")
            rejected = cg(s, f"{scenario.counted_limit}.rejected")
            rec["correctness"] = {"limit": limit, "admitted_2xx": ok2, "rejected_4xx": c4,
                                  "filter_allowed": allowed, "filter_rejected": rejected,
                                  "ok": ok2 == limit and allowed == limit and rejected == c4}
            if not rec["correctness"]["ok"]:
                problems.append(f"correctness: admitted {ok2} (filter allowed {allowed}), "
                                f"expected exactly the limit {limit}; 4xx {c4}, filter "
                                f"rejected {rejected}")
            if w["non_2xx_3xx"] < w["requests"] - limit:
                problems.append(f"wrk saw {w['requests'] - w['non_2xx_3xx']} 2xx responses, "
                                f"more than the limit {limit}")
        if scenario is not None and scenario.verify is not None:
            problems += scenario.verify(s, rec)
        return problems

    def scenario(self, scenario: Scenario) -> dict:
        plugin = scenario.plugin(self.stack) if scenario.plugin else None
        plain = self.plain_for(scenario)
        envoy = self.start_envoy(scenario.name, plugin, routed=scenario.routed,
                                 local_ratelimit=scenario.local_ratelimit,
                                 wasm_path=scenario.wasm_path,
                                 response_headers=scenario.response_headers, rls=scenario.rls,
                                 rls_limit=scenario.rls_limit)
        targets = [(plain, "plain", scenario)]
        compare = None
        compare_refused = None
        anchors: list[Envoy] = []
        try:
            # The anchors a goal is set against run in the same rounds, next to the scenario
            # (see round_order): the ratio is then taken round by round, side by side in time.
            by_name = {s.name: s for s in scenarios()}
            for name in in_round_anchors(scenario):
                a = by_name[name]
                anchor = self.start_envoy(f"{scenario.name}-anchor-{name}",
                                          a.plugin(self.stack) if a.plugin else None,
                                          routed=a.routed, local_ratelimit=a.local_ratelimit,
                                          wasm_path=a.wasm_path, rls=a.rls,
                                          rls_limit=a.rls_limit)
                anchors.append(anchor)
                targets.append((anchor, f"anchor:{name}", a))
            targets.append((envoy, "scenario", scenario))
            if self.compare and plugin is not None and scenario.wasm_path is None:
                try:
                    compare = self.start_envoy(f"{scenario.name}@{self.compare[0]}", plugin,
                                               routed=scenario.routed,
                                               wasm_path=self.compare[1],
                                               response_headers=scenario.response_headers)
                    targets.append((compare, "compare", scenario))
                except (RuntimeError, TimeoutError) as e:
                    # An older build that does not know a feature refuses its configuration:
                    # the scenario runs without it, and the report says so.
                    if "invalid plugin configuration" not in str(e):
                        raise
                    compare_refused = (f"build {self.compare[0]} refuses this configuration "
                                       "(a feature it does not have)")
                    print(f"  {scenario.name}: {compare_refused}", flush=True)
            if scenario.prepare:
                scenario.prepare(scenario, envoy)
            print(f"  {scenario.name}: warm-up {self.warmup}s each", flush=True)
            for target, kind, sc in targets:
                self.wrk(target, self.script(sc.script),
                         sc.args(sc, f"{sc.name}-warmup-{kind}-{uuid.uuid4().hex[:8]}"),
                         self.warmup)
            runs = []
            for r in range(1, self.rounds + 1):
                for target, kind, sc in round_order(targets, r):
                    rec = self.run(target, sc, kind, r, self.seconds)
                    runs.append(rec)
                    flag = "" if not rec["problems"] else "  PROBLEM: " + "; ".join(rec["problems"])
                    print(f"  {scenario.name} round {r} {kind:8} {rec['requests_per_second']:>9.0f}"
                          f" req/s  p99 {rec['latency_ms']['p99']:.2f} ms  callouts/req "
                          f"{rec['redis_calls_per_request']:.2f}{flag}", flush=True)
            warnings = [ln for ln in envoy.log_text().splitlines()
                        if re.search(r"\]\[(warning|error|critical)\]", ln)
                        and "global_downstream_max_connections" not in ln]
        finally:
            self.stop_envoy(envoy)
            if compare is not None:
                self.stop_envoy(compare)
            for anchor in anchors:
                self.stop_envoy(anchor)
        summary = summarize(scenario, runs)
        if compare_refused:
            summary["compare_refused"] = compare_refused
        if compare is not None and self.compare:
            summary["compare"] = {"revision": self.compare[0],
                                  "wasm": str(self.compare[1].relative_to(ROOT)),
                                  **summarize(scenario, runs, "compare")}
        summary["envoy_log_warnings"] = len(warnings)
        if warnings:
            summary["envoy_log_warning_samples"] = warnings[:5]
        wasm = (scenario.wasm_path or self.stack.wasm_path) if plugin is not None else None
        return {"title": scenario.title, "script": f"bench/lua/{scenario.script}",
                "wasm": str(wasm.relative_to(ROOT)) if wasm else None,
                "plugin_config": plugin, "local_ratelimit": scenario.local_ratelimit,
                "rls": scenario.rls,
                "routed": scenario.routed, "plain_routed": scenario.plain_routed,
                "goal": scenario.goal, "summary": summary, "runs": runs}


def failed_runs(runs: list[dict]) -> list[tuple[dict, dict]]:
    """The (statuses, errors) of oha runs that got an answer other than 200 or an error other
    than the requests still in flight when oha's time was up ("aborted due to deadline")."""
    return [(r["statuses"], r["errors"]) for r in runs
            if set(r["statuses"]) - {"200"} or set(r["errors"]) - {"aborted due to deadline"}]


def round_order(targets: list, round_no: int) -> list:
    """The order a scenario's targets (plain, anchors, the scenario, the compared build) run in
    round `round_no`: as listed in odd rounds, reversed in even ones, so a machine that slows
    down or speeds up within a round favours neither the filter nor its anchors."""
    return targets if round_no % 2 else targets[::-1]


def _per(value: float, requests: int) -> float | None:
    return round(value / requests, 4) if requests else None


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def summarize(scenario: Scenario | None, runs: list[dict], kind: str = "scenario") -> dict:
    mine = [r for r in runs if r["kind"] == kind]
    out = {
        "requests_per_second": _median([r["requests_per_second"] for r in mine]),
        "latency_p50_ms": _median([r["latency_ms"]["p50"] for r in mine]),
        "latency_p99_ms": _median([r["latency_ms"]["p99"] for r in mine]),
        "redis_calls_per_request": _median([r["redis_calls_per_request"] for r in mine]),
        "redis_evals_per_request": _median([r["redis_evals_per_request"] for r in mine]),
        "cpu_seconds_per_10k_requests": {
            name: _median([r["cpu_seconds_per_10k_requests"].get(name) for r in mine])
            for name in ("envoy", "webdis", "redis", "wrk", "upstream_envoy", "rls")},
        "foreign_cpu_cores": _median([r["foreign_cpu_cores"] for r in mine]),
    }
    admissions = [r["admission"] for r in mine if "admission" in r]
    if admissions:
        out["admission"] = {"limit": admissions[0]["limit"],
                            "admitted_per_run": [a["admitted_2xx"] for a in admissions]}
    if scenario is not None:
        plain = {r["round"]: r for r in runs if r["kind"] == "plain"}
        ratios = [r["requests_per_second"] / plain[r["round"]]["requests_per_second"]
                  for r in mine if plain.get(r["round"], {}).get("requests_per_second")]
        out["plain"] = summarize(None, runs, "plain")
        out["ratio_to_plain"] = _median(ratios)
        out["ratio_per_round"] = [round(x, 4) for x in ratios]
        if scenario.goal is not None and out["ratio_to_plain"] is not None:
            out["goal"] = scenario.goal
            out["goal_met"] = out["ratio_to_plain"] >= scenario.goal
        checks = [r["correctness"] for r in mine if "correctness" in r]
        if checks:
            out["correctness"] = {"limit": scenario.admitted_exactly,
                                  "admitted_per_run": [c["admitted_2xx"] for c in checks],
                                  "ok": all(c["ok"] for c in checks)}
    return out


def in_round_anchors(scenario: Scenario) -> list[str]:
    """The anchors measured in the scenario's own rounds: every anchor of a scenario with a
    goal on one or `anchors_in_rounds` (the others are compared with the anchor's own
    scenario, below)."""
    if scenario.anchors_in_rounds or any(goal is not None for _, goal in scenario.anchors):
        return [name for name, _ in scenario.anchors]
    return []


def _same_round_ratios(runs: list[dict], kind: str, anchor_kind: str) -> list[float]:
    """`kind`'s throughput over `anchor_kind`'s, round by round."""
    anchor = {r["round"]: r["requests_per_second"] for r in runs if r["kind"] == anchor_kind}
    return [round(r["requests_per_second"] / anchor[r["round"]], 4)
            for r in runs if r["kind"] == kind and anchor.get(r["round"])]


def add_anchor_ratios(scenario_results: dict) -> None:
    """Each scenario's throughput over its anchors'. An anchor measured in the scenario's own
    rounds gives the median of the per-round ratios (the two ran one after the other, in the
    same round); any other, the ratio of the two medians of ratios to their own plain rounds
    in this run (so the machine's drift between them cancels, as far as it does)."""
    goals = {s.name: s.anchors for s in scenarios()}
    for name, sc in scenario_results.items():
        s = sc["summary"]
        runs = sc.get("runs", [])
        out, compared = [], []
        for anchor, goal in goals.get(name, ()):
            kind = f"anchor:{anchor}"
            if any(r["kind"] == kind for r in runs):
                per_round = _same_round_ratios(runs, "scenario", kind)
                entry = {"anchor": anchor, "same_rounds": True, "ratio": _median(per_round),
                         "per_round": per_round,
                         "anchor_in_rounds": summarize(None, runs, kind)}
                theirs = _same_round_ratios(runs, "compare", kind)
                other = {"anchor": anchor, "same_rounds": True, "ratio": _median(theirs)}
            else:
                a = scenario_results.get(anchor, {}).get("summary")
                if not a or not a.get("ratio_to_plain") or s.get("ratio_to_plain") is None:
                    continue
                entry = {"anchor": anchor, "same_rounds": False,
                         "ratio": round(s["ratio_to_plain"] / a["ratio_to_plain"], 4),
                         "per_round": [round(x / y, 4) for x, y in
                                       zip(s["ratio_per_round"], a["ratio_per_round"]) if y]}
                mine = s.get("compare", {}).get("ratio_to_plain")
                other = {"anchor": anchor, "same_rounds": False,
                         "ratio": round(mine / a["ratio_to_plain"], 4) if mine else None}
            for e in (entry, other):
                if goal is not None and e["ratio"] is not None:
                    e["goal"] = goal
                    e["goal_met"] = e["ratio"] >= goal
            if entry["ratio"] is not None:
                out.append(entry)
            if other["ratio"] is not None:
                compared.append(other)
        s["anchors"] = out
        if "compare" in s:
            s["compare"]["anchors"] = compared


def anchor_text(s: dict) -> str:
    """`0.70 x wasm_naive (>= 0.90 missed)`, one per anchor."""
    parts = []
    for e in s.get("anchors", []):
        goal = ""
        if "goal" in e:
            goal = f" (>= {e['goal']:.2f} {'met' if e['goal_met'] else 'missed'})"
        where = ", same rounds" if e.get("same_rounds") else ""
        parts.append(f"{e['ratio']:.2f} x {e['anchor']}{where}{goal}")
    return "; ".join(parts)


# --- reporting -----------------------------------------------------------------------------------


def fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table(results: dict) -> str:
    head = ["scenario", "req/s", "plain req/s", "ratio", "round ratios", "goal", "p50 ms",
            "p99 ms", "callouts/req", "EVAL/req", "CPU s/10k: envoy", "webdis", "redis", "wrk",
            "other load", "vs anchor"]
    rows = [head]
    plain = results["plain"]
    cpu = plain["cpu_seconds_per_10k_requests"]
    rows.append(["plain", fmt(plain["requests_per_second"], ".0f"), "", "1.00", "", "",
                 fmt(plain["latency_p50_ms"], ".2f"), fmt(plain["latency_p99_ms"], ".2f"),
                 "0", "0", fmt(cpu["envoy"], ".3f"), fmt(cpu["webdis"], ".3f"),
                 fmt(cpu["redis"], ".3f"), fmt(cpu["wrk"], ".3f"),
                 fmt(plain["foreign_cpu_cores"], ".2f"), ""])
    for name, sc in results["scenarios"].items():
        s = sc["summary"]
        cpu = s["cpu_seconds_per_10k_requests"]
        goal = ""
        if "goal" in s:
            goal = f">={s['goal']:.2f} {'met' if s['goal_met'] else 'MISSED'}"
        rows.append([name, fmt(s["requests_per_second"], ".0f"),
                     fmt(s["plain"]["requests_per_second"], ".0f"),
                     fmt(s["ratio_to_plain"], ".2f"),
                     " ".join(f"{x:.2f}" for x in s["ratio_per_round"]), goal,
                     fmt(s["latency_p50_ms"], ".2f"), fmt(s["latency_p99_ms"], ".2f"),
                     fmt(s["redis_calls_per_request"], ".2f"),
                     fmt(s["redis_evals_per_request"], ".2f"),
                     fmt(cpu["envoy"], ".3f"), fmt(cpu["webdis"], ".3f"), fmt(cpu["redis"], ".3f"),
                     fmt(cpu["wrk"], ".3f"), fmt(s["foreign_cpu_cores"], ".2f"), anchor_text(s)])
        if "compare" in s:
            c = s["compare"]
            ccpu = c["cpu_seconds_per_10k_requests"]
            rows.append([f"{name}@{c['revision']}", fmt(c["requests_per_second"], ".0f"),
                         fmt(s["plain"]["requests_per_second"], ".0f"),
                         fmt(c["ratio_to_plain"], ".2f"),
                         " ".join(f"{x:.2f}" for x in c["ratio_per_round"]), "",
                         fmt(c["latency_p50_ms"], ".2f"), fmt(c["latency_p99_ms"], ".2f"),
                         fmt(c["redis_calls_per_request"], ".2f"),
                         fmt(c["redis_evals_per_request"], ".2f"),
                         fmt(ccpu["envoy"], ".3f"), fmt(ccpu["webdis"], ".3f"),
                         fmt(ccpu["redis"], ".3f"), fmt(ccpu["wrk"], ".3f"),
                         fmt(c["foreign_cpu_cores"], ".2f"), anchor_text(c)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("-" * len(lines[0]))
    for name, why in results["skipped"].items():
        goal = f" (goal >= {GOALS[name]:.2f})" if name in GOALS else ""
        lines.append(f"{name}: {why}{goal}")
    return "\n".join(lines)


PERF_DOC = ROOT / "docs" / "performance.md"
RESULTS_BEGIN = "<!-- results: written by bench/run.py from bench/summary.json -->"
RESULTS_END = "<!-- end of results -->"
SUMMARY_FORMAT = 1
# The processes whose CPU the summary keeps, per request (the incumbent's rate limit service in
# webdis's place in its rows).
CPU_KEYS = ("envoy", "webdis", "rls", "redis")


# --- the summary ---------------------------------------------------------------------------------


def _cpu_us(summary: dict) -> dict:
    """CPU per request in µs (from seconds per 10k requests), the processes measured."""
    cpu = summary.get("cpu_seconds_per_10k_requests", {})
    return {k: round(cpu[k] * 100, 2) for k in CPU_KEYS if cpu.get(k) is not None}


def _compact(s: dict) -> dict:
    """One scenario's (or its compared build's) medians as the summary keeps them."""
    out = {"rps": s.get("requests_per_second"), "ratio": s.get("ratio_to_plain"),
           "rounds": s.get("ratio_per_round", []), "p50_ms": s.get("latency_p50_ms"),
           "p99_ms": s.get("latency_p99_ms"), "calls": s.get("redis_calls_per_request"),
           "cpu_us": _cpu_us(s)}
    for key in ("goal", "goal_met", "correctness", "admission", "compare_refused"):
        if key in s:
            out[key] = s[key]
    anchors = []
    for e in s.get("anchors", []):
        a = {k: e[k] for k in ("anchor", "same_rounds", "ratio", "goal", "goal_met") if k in e}
        if e.get("per_round"):
            a["range"] = [min(e["per_round"]), max(e["per_round"])]
        theirs = e.get("anchor_in_rounds")
        if theirs:
            a["cpu_us"] = _cpu_us(theirs)
            if "admission" in theirs:
                a["admission"] = theirs["admission"]
        anchors.append(a)
    if anchors:
        out["anchors"] = anchors
    return out


def scenario_summary(sc: dict) -> dict:
    """A scenario of bench/results.json (its summary and raw runs) as the summary keeps it:
    its medians, its anchors' ratios with their rounds' range, and each anchor of its rounds'
    own ratio to plain Envoy in those rounds and CPU per request."""
    s, runs = sc["summary"], sc.get("runs", [])
    out = _compact(s)
    if sc.get("plain_routed"):
        out["plain_routed"] = True
    for a in out.get("anchors", []):
        if a["same_rounds"]:
            theirs = _same_round_ratios(runs, f"anchor:{a['anchor']}", "plain")
            if theirs:
                a["its_ratio"] = _median(theirs)
    if "compare" in s:
        out["compare"] = {"revision": s["compare"]["revision"], **_compact(s["compare"])}
    return out


def feature_minimal(scenario_results: dict) -> dict:
    """Per path with a goal against an anchor of its rounds (FEATURE_MINIMAL): what each anchor
    doing the least a filter with the path's features does reaches against the goal's anchor,
    round by round in the path's rounds: [median, lowest, highest]."""
    out = {}
    for name, minimal in FEATURE_MINIMAL.items():
        sc = scenario_results.get(name)
        if not sc:
            continue
        goal = next((e for e in sc["summary"].get("anchors", [])
                     if "goal" in e and e["same_rounds"]), None)
        if goal is None:
            continue
        found = {}
        for anchor in minimal:
            per_round = _same_round_ratios(sc.get("runs", []), f"anchor:{anchor}",
                                           f"anchor:{goal['anchor']}")
            if per_round:
                found[anchor] = [_median(per_round), min(per_round), max(per_round)]
        if found:
            out[name] = found
    return out


def summary_of(results: dict, revision: str | None = None) -> dict:
    """bench/summary.json from a run's raw results (bench/results.json): the medians the docs
    and the chart quote, per scenario, the plain Envoy baseline, the open loop and the checks,
    tens of KiB where the raw rounds are megabytes. `revision` names the build measured when the
    results do not (runs before they recorded it)."""
    m = results["meta"]
    meta = {k: m[k] for k in ("command", "date", "cpus", "envoy_version_short", "rounds",
                              "seconds", "wrk", "loadavg_at_start", "wasm_size_bytes") if k in m}
    meta["revision"] = m.get("revision") or revision
    if m.get("dirty"):
        meta["dirty"] = True
    if m.get("compare"):
        meta["compare"] = m["compare"]["revision"]
    plain = results["plain"]
    contended: dict[str, list[float]] = {}
    for r in results.get("lease_contended", []):
        contended.setdefault(r["label"], []).append(round(r["utilisation"], 4))
    parts = ("p50_ms", "p99_ms", "p999_ms")
    open_loop = []
    for entry in results.get("open_loop", []):
        rates = []
        for r in entry["rates"]:
            row = {"rate": r["rate"], "added_ms": [r["added_ms"][p] for p in parts],
                   "plain_ms": [r["plain"].get(p) for p in parts]}
            if r.get("gateway"):
                row["gateway"] = [r["gateway"]["callouts"], r["gateway"]["connections"]]
            rates.append(row)
        open_loop.append({"scenario": entry["scenario"], "rates": rates})
    return {
        "format": SUMMARY_FORMAT,
        "meta": meta,
        "plain": {"rps": plain.get("requests_per_second"), "p50_ms": plain.get("latency_p50_ms"),
                  "p99_ms": plain.get("latency_p99_ms"), "cpu_us": _cpu_us(plain),
                  "basis": results.get("plain_basis")},
        "scenarios": {name: scenario_summary(sc) for name, sc in results["scenarios"].items()},
        "feature_minimal": feature_minimal(results["scenarios"]),
        "lease_contended": contended,
        "open_loop": open_loop,
        "open_loop_gateway": [{k: g.get(k) for k in ("rate", *parts)}
                              for g in results.get("open_loop_gateway") or []],
        "correctness": {name: c["ok"] for name, c in results.get("correctness", {}).items()},
        "skipped": results.get("skipped", {}),
        "ok": results.get("ok", not results.get("errors")),
    }


def dump_summary(summary: dict) -> str:
    """The summary as committed: one scenario, open-loop entry or anchor per line, so a run's
    diff reads row by row."""
    def one(value) -> str:
        return json.dumps(value, ensure_ascii=False)

    lines = ["{"]
    keys = list(summary)
    for i, key in enumerate(keys):
        value, comma = summary[key], "," if i < len(keys) - 1 else ""
        if isinstance(value, dict) and value and key in ("scenarios", "feature_minimal"):
            items = list(value.items())
            lines.append(f" {one(key)}: {{")
            lines += [f"  {one(k)}: {one(v)}{',' if j < len(items) - 1 else ''}"
                      for j, (k, v) in enumerate(items)]
            lines.append(f" }}{comma}")
        elif isinstance(value, list) and value:
            lines.append(f" {one(key)}: [")
            lines += [f"  {one(v)}{',' if j < len(value) - 1 else ''}"
                      for j, v in enumerate(value)]
            lines.append(f" ]{comma}")
        else:
            lines.append(f" {one(key)}: {one(value)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


# --- rendering from the summary ------------------------------------------------------------------


def _labels() -> dict[str, str]:
    """How the docs name each scenario: the filter's paths by their title, the anchors and the
    incumbent by their name (docs/performance.md describes each)."""
    return {s.name: s.title if s.plugin is not None and s.wasm_path is None else f"`{s.name}`"
            for s in scenarios()}


def _us(cpu: dict, part: str) -> str:
    v = cpu.get(part)
    return "-" if v is None else f"{v:.0f}"


def _cpu_cells(cpu: dict) -> str:
    """Envoy / webdis (or the incumbent's rate limit service) / Redis, µs per request."""
    gateway = f"RLS {_us(cpu, 'rls')}" if cpu.get("rls") is not None else _us(cpu, "webdis")
    return f"{_us(cpu, 'envoy')} / {gateway} / {_us(cpu, 'redis')}"


def markdown_results(summary: dict) -> str:
    """The results section of docs/performance.md, from the summary alone: what ran where, the
    table, each goal beside the anchors doing the least its path does, the incumbent, the open
    loop and the checks."""
    m = summary["meta"]
    labels = _labels()
    plain = summary["plain"]
    build = f" of {m['revision']}" if m.get("revision") else ""
    if m.get("dirty"):
        build += " (with uncommitted changes)"
    lines = [f"Measured by `{m['command']}`{build} on {m['date'][:10]}: {m['cpus']} cores, "
             f"Envoy {m['envoy_version_short']}, {m['rounds']} rounds of {m['seconds']} s, "
             f"wrk -t{m['wrk']['threads']} -c{m['wrk']['connections']}, load average "
             f"{' '.join(m['loadavg_at_start'])} at the start; `.wasm` {m['wasm_size_bytes']:,} "
             f"bytes. Plain Envoy served {fmt(plain['rps'], ',.0f')} requests/s at "
             f"{_us(plain['cpu_us'], 'envoy')} µs of Envoy CPU per request. Ratios are medians "
             "of per-round ratios to plain Envoy in the same round; CPU is µs per request from "
             "`/proc`; anchors go by their names (above).", "",
             "| scenario | req/s | ratio to plain (rounds) | goal | vs anchor, same run (goal) "
             "| p50 / p99 ms | Redis calls/req | CPU µs/req: Envoy / webdis (or RLS) / Redis |",
             "|---|---|---|---|---|---|---|---|",
             f"| plain Envoy | {fmt(plain['rps'], '.0f')} | 1.00 | | | "
             f"{fmt(plain['p50_ms'], '.2f')} / {fmt(plain['p99_ms'], '.2f')} | 0 "
             f"| {_us(plain['cpu_us'], 'envoy')} / 0 / 0 |"]
    for name, s in summary["scenarios"].items():
        label = labels.get(name, f"`{name}`")
        if "compare_refused" in s:
            label += f" (new: not in build {m.get('compare')})"
        rows = [(label, s)]
        if "compare" in s:
            rows.append((f"same, build {s['compare']['revision']}", s["compare"]))
        for label, row in rows:
            goal = ""
            if "goal" in row:
                goal = f">= {row['goal']:.2f} {'met' if row['goal_met'] else 'missed'}"
            rounds = " ".join(f"{x:.2f}" for x in row["rounds"])
            lines.append(f"| {label} | {fmt(row['rps'], '.0f')} | {fmt(row['ratio'], '.2f')} "
                         f"({rounds}) | {goal} | {anchor_text(row)} | "
                         f"{fmt(row['p50_ms'], '.2f')} / {fmt(row['p99_ms'], '.2f')} | "
                         f"{fmt(row['calls'], '.2f')} | {_cpu_cells(row['cpu_us'])} |")
    lines += goal_lines(summary, labels)
    lines += incumbent_lines(summary, labels)
    lines += open_loop_markdown(summary.get("open_loop", []), labels,
                                summary.get("open_loop_gateway"))
    # The checks and the contended lease: one paragraph, a line each.
    notes = []
    checks = summary.get("correctness", {})
    if checks:
        notes.append(f"Correctness: every limited scenario admitted exactly its limit: "
                     f"{'yes' if all(checks.values()) else 'NO'}.")
    notes += admission_lines(summary["scenarios"])
    for label, values in summary.get("lease_contended", {}).items():
        who = "this build" if label == "ours" else f"build {label}"
        notes.append(f"Contended lease ({who}): {CONTENDED_WAITERS} waiters on one resource, "
                     f"{CONTENDED_OP_MS} ms each: the resource was busy "
                     f"{fmt(_median(values), '.2f')} of the time (rounds "
                     f"{', '.join(f'{v:.2f}' for v in values)}).")
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def goal_lines(summary: dict, labels: dict) -> list[str]:
    """Each path with a goal beside the anchors doing the least a filter with its features
    does (FEATURE_MINIMAL), all in the path's rounds: what those anchors reach against the
    goal's anchor, what the path reaches against each, and their Envoy CPU."""
    rows = []
    for name, minimal in summary.get("feature_minimal", {}).items():
        s = summary["scenarios"].get(name)
        if not s:
            continue
        in_rounds = [e for e in s.get("anchors", []) if e["same_rounds"]]
        goal = next((e for e in in_rounds if "goal" in e), None)
        by_anchor = {e["anchor"]: e for e in in_rounds}
        theirs, ours, cpu = [], [], []
        for anchor, (median, low, high) in minimal.items():
            mine = by_anchor.get(anchor)
            if mine is None:
                continue
            theirs.append(f"`{anchor}` {median:.2f} ({low:.2f}-{high:.2f})")
            ours.append(f"{mine['ratio']:.2f} x `{anchor}`")
            cpu.append(_us(mine.get("cpu_us", {}), "envoy"))
        if goal is None or not theirs:
            continue
        low, high = goal.get("range") or [goal["ratio"]] * 2
        rows.append(f"| {labels.get(name, name)} | {goal['goal']:.2f} x `{goal['anchor']}` | "
                    f"{'; '.join(theirs)} | {goal['ratio']:.2f} ({low:.2f}-{high:.2f}); "
                    f"{', '.join(ours)} | {' / '.join(cpu)} / {_us(s['cpu_us'], 'envoy')} |")
    if not rows:
        return []
    return ["", "Each goal beside the anchors doing the least a filter with the path's features "
            "does, in the path's own rounds: medians of per-round ratios, rounds' range in "
            "brackets; Envoy CPU µs per request.", "",
            "| path | goal | those anchors reach, x the goal's anchor | the path reaches, x the "
            "goal's anchor and x each | Envoy CPU: each anchor / the path |",
            "|---|---|---|---|---|", *rows]


def incumbent_lines(summary: dict, labels: dict) -> list[str]:
    """The paths run beside the incumbent (Envoy's ratelimit filter and its rate limit
    service) in the same rounds: each one's ratio to plain, the two's ratio, their CPU."""
    incumbents = {s.name for s in scenarios() if s.rls}
    rows = []
    for name, s in summary["scenarios"].items():
        for e in s.get("anchors", []):
            if e["anchor"] not in incumbents or not e["same_rounds"]:
                continue
            low, high = e.get("range") or [e["ratio"]] * 2
            rows.append(f"| {labels.get(name, name)} | `{e['anchor']}` | {fmt(s['ratio'], '.2f')} "
                        f"| {fmt(e.get('its_ratio'), '.2f')} | {e['ratio']:.2f} ({low:.2f}-"
                        f"{high:.2f}) | {_cpu_cells(s['cpu_us'])} | "
                        f"{_cpu_cells(e.get('cpu_us', {}))} |")
    if not rows:
        return []
    return ["", "Beside the incumbent in the same rounds, both through the upstream and so is "
            "their plain Envoy: ratios to plain Envoy, ours over the incumbent (rounds' range), "
            "CPU µs per request (Envoy / webdis or RLS / Redis).", "",
            "| path | incumbent | ours | incumbent | ours / incumbent | CPU, ours "
            "| CPU, incumbent |",
            "|---|---|---|---|---|---|---|", *rows]


def admission_lines(scenarios_summary: dict) -> list[str]:
    """What the runs that record their admissions admitted (the incumbent pushed past its
    limit), as its own row and in the rounds of the scenario it ran beside."""
    lines = []
    for name, s in scenarios_summary.items():
        rows = [(name, s)] + [(f"{a['anchor']}, in {name}'s rounds", a)
                              for a in s.get("anchors", [])]
        for label, row in rows:
            if "admission" in row:
                lines.append(f"Admitted, not checked ({label}): "
                             f"{', '.join(map(str, row['admission']['admitted_per_run']))} per "
                             f"run for a limit of {row['admission']['limit']}.")
    return lines


def open_loop_markdown(open_loop: list[dict], labels: dict,
                       gateway: list[dict] | None = None) -> list[str]:
    """The open-loop table, one row per scenario: the latency it adds over plain Envoy at each
    rate, its goal at 1,000/s, plain Envoy's own p99 and the callouts its Envoy sent to the
    gateway with the connections it opened to carry them; then the gateway's own round trip."""
    if not open_loop:
        return []
    rates = list(dict.fromkeys(r["rate"] for e in open_loop for r in e["rates"]))
    lines = ["", f"Open loop (oha `--latency-correction`, {LATENCY_CONNECTIONS} connections, "
             "the scenario and plain Envoy alternately at the same rate): the latency added "
             "over plain Envoy at each rate, p50 / p99 / p99.9 ms; plain Envoy's own p99 and "
             "the callouts the scenario's Envoy sent to the gateway / the connections it opened "
             f"for them, at {', '.join(map(str, rates))}/s.", "",
             "| scenario | " + " | ".join(f"adds at {r}/s" for r in rates)
             + " | goal at 1000/s (p50 / p99) | plain p99 | callouts / connections |",
             "|---|" + "---|" * (len(rates) + 3)]
    for entry in open_loop:
        name = entry["scenario"]
        by_rate = {r["rate"]: r for r in entry["rates"]}
        cells, goal = [], ""
        for rate in rates:
            r = by_rate.get(rate)
            cells.append("-" if r is None else " / ".join(f"{v:.2f}" for v in r["added_ms"]))
            if r and rate == 1000 and name in LATENCY_GOALS:
                g50, g99 = LATENCY_GOALS[name]
                met = r["added_ms"][0] < g50 and r["added_ms"][1] < g99
                goal = f"< {g50} / < {g99} {'met' if met else 'missed'}"
        plain = ", ".join(fmt(by_rate[rate]["plain_ms"][1], ".2f") if rate in by_rate else "-"
                          for rate in rates)
        carried = ", ".join(f"{by_rate[rate]['gateway'][0]} / {by_rate[rate]['gateway'][1]}"
                            if by_rate.get(rate, {}).get("gateway") else "-" for rate in rates)
        lines.append(f"| {labels.get(name, name)} | {' | '.join(cells)} | {goal} | {plain} | "
                     f"{carried} |")
    if gateway:
        each = "; ".join(f"{g['rate']}/s {fmt(g['p50_ms'], '.2f')} / {fmt(g['p99_ms'], '.2f')} / "
                         f"{fmt(g['p999_ms'], '.2f')}" for g in gateway)
        lines += ["", "The gateway alone (oha straight to webdis with the naive anchor's `EVAL`, "
                  f"no Envoy), p50 / p99 / p99.9 ms: {each}. A callout pays this round trip "
                  "on top of what Envoy and the filter add."]
    return lines


def write_perf_doc(summary: dict) -> bool:
    """Replaces the results section of docs/performance.md; False if its markers are missing."""
    if not PERF_DOC.exists():
        return False
    text = PERF_DOC.read_text()
    if RESULTS_BEGIN not in text or RESULTS_END not in text:
        return False
    head, rest = text.split(RESULTS_BEGIN, 1)
    tail = rest.split(RESULTS_END, 1)[1]
    PERF_DOC.write_text(f"{head}{RESULTS_BEGIN}\n{markdown_results(summary)}\n{RESULTS_END}{tail}")
    return True


def perf_doc_results() -> str | None:
    """The results section docs/performance.md holds now (None without its markers)."""
    text = PERF_DOC.read_text()
    if RESULTS_BEGIN not in text or RESULTS_END not in text:
        return None
    return text.split(RESULTS_BEGIN, 1)[1].split(RESULTS_END, 1)[0].strip("\n")


# The incumbent's rate limit service takes webdis's place in its rows.
CPU_PARTS = (("envoy", "#1565c0"), ("webdis", "#ef6c00"), ("rls", "#2e7d32"),
             ("redis", "#6a1b9a"))


def svg_chart(summary: dict) -> str:
    """Two panels: the ratio to plain Envoy per scenario with its goal marked, and the CPU
    seconds per 10k requests of Envoy, webdis (or the incumbent's rate limit service) and Redis
    (stacked); from the summary alone."""
    def per_10k(cpu_us: dict) -> dict:
        return {k: v / 100 for k, v in cpu_us.items()}

    entries = [("plain", 1.0, None, None, per_10k(summary["plain"]["cpu_us"]), "")]
    for name, s in summary["scenarios"].items():
        mark = " *" if s.get("plain_routed") else ""
        entries.append((name, s["ratio"], s.get("goal"), s["rounds"], per_10k(s["cpu_us"]),
                        mark))
    for name in summary["skipped"]:
        entries.append((name, None, GOALS.get(name), None, None, ""))
    left, bar_w, row_h, top = 170, 520, 30, 78
    width = left + bar_w + 110
    panel_h = row_h * len(entries)
    top2 = top + panel_h + 110  # the CPU panel
    height = top2 + panel_h + 90
    top_ratio = max([1.2] + [r for e in entries for r in [e[1] or 0, *(e[3] or [])]])
    top_cpu = max([sum((e[4] or {}).get(n) or 0 for n, _ in CPU_PARTS) for e in entries] + [0.1])
    x = lambda r: left + bar_w * r / top_ratio  # noqa: E731
    xc = lambda c: left + bar_w * c / (top_cpu * 1.1)  # noqa: E731
    meta = summary["meta"]
    rounds = f'{meta["rounds"]} round{"s" if meta["rounds"] != 1 else ""}'
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="24" font-size="15" font-weight="bold">coordination-guard: '
           f'throughput relative to plain Envoy</text>',
           f'<text x="{left}" y="44" fill="#555">median of per-round ratios, {rounds} x '
           f'{meta["seconds"]} s, wrk -t{THREADS} -c{CONNECTIONS}, Envoy '
           f'{_xml(meta["envoy_version_short"])}, {meta["date"][:10]}</text>',
           f'<text x="{left}" y="62" fill="#555">bar: ratio (green: goal met, red: missed, '
           f'grey: no goal); black tick: goal; dots: single rounds</text>']

    def grid(y0: float, ticks: list[float], pos, label: str, fmt_tick: str) -> None:
        for tick in ticks:
            out.append(f'<line x1="{pos(tick):.1f}" y1="{y0 - 6}" x2="{pos(tick):.1f}" '
                       f'y2="{y0 + panel_h}" stroke="#e5e5e5"/>')
            out.append(f'<text x="{pos(tick):.1f}" y="{y0 + panel_h + 16}" text-anchor="middle" '
                       f'fill="#555">{tick:{fmt_tick}}</text>')
        out.append(f'<text x="{left + bar_w / 2}" y="{y0 + panel_h + 36}" text-anchor="middle" '
                   f'fill="#555">{_xml(label)}</text>')

    grid(top, [i / 10 for i in range(0, int(top_ratio * 10) + 1, 2)], x,
         "req/s / plain Envoy req/s (same run)", ".1f")
    for i, (name, ratio, goal, per_round, _cpu, mark) in enumerate(entries):
        y = top + i * row_h
        out.append(f'<text x="{left - 8}" y="{y + row_h / 2 + 4}" text-anchor="end">'
                   f'{_xml(name + mark)}</text>')
        if ratio is None:
            out.append(f'<text x="{left + 6}" y="{y + row_h / 2 + 4}" fill="#999">not built yet'
                       f'</text>')
        else:
            color = "#9e9e9e" if goal is None else ("#2e7d32" if ratio >= goal else "#c62828")
            out.append(f'<rect x="{left}" y="{y + 6}" width="{x(ratio) - left:.1f}" '
                       f'height="{row_h - 12}" fill="{color}"/>')
            out.append(f'<text x="{left + bar_w + 14}" y="{y + row_h / 2 + 4}" '
                       f'font-weight="bold">{ratio:.2f}</text>')
            for r in per_round or []:
                out.append(f'<circle cx="{x(r):.1f}" cy="{y + row_h / 2}" r="2.2" fill="black" '
                           f'fill-opacity="0.45"/>')
        if goal is not None:
            out.append(f'<line x1="{x(goal):.1f}" y1="{y + 2}" x2="{x(goal):.1f}" '
                       f'y2="{y + row_h - 2}" stroke="black" stroke-width="2"/>')
            out.append(f'<text x="{x(goal) + 4:.1f}" y="{y + 11}" font-size="10" '
                       f'stroke="white" stroke-width="3" paint-order="stroke">goal '
                       f'{goal:.2f}</text>')
    if any(e[5] for e in entries):
        out.append(f'<text x="{left}" y="{top + panel_h + 56}" fill="#555" font-size="11">* via an '
                   f'upstream Envoy, and so is its plain baseline (a direct response releases '
                   f'the record)</text>')

    out.append(f'<text x="{left}" y="{top2 - 30}" font-size="15" font-weight="bold">CPU '
               f'seconds per 10k requests (median of rounds)</text>')
    legend_x = left
    for part, color in CPU_PARTS:
        out.append(f'<rect x="{legend_x}" y="{top2 - 20}" width="10" height="10" '
                   f'fill="{color}"/>')
        out.append(f'<text x="{legend_x + 14}" y="{top2 - 11}">{part}</text>')
        legend_x += 80
    step = _nice_step(top_cpu * 1.1)
    grid(top2, [i * step for i in range(int(top_cpu * 1.1 / step) + 1)], xc,
         "CPU seconds (user + system, /proc) per 10k requests", ".1f")
    for i, (name, _r, _g, _p, cpu, mark) in enumerate(entries):
        y = top2 + i * row_h
        out.append(f'<text x="{left - 8}" y="{y + row_h / 2 + 4}" text-anchor="end">'
                   f'{_xml(name + mark)}</text>')
        if cpu is None:
            out.append(f'<text x="{left + 6}" y="{y + row_h / 2 + 4}" fill="#999">not built yet'
                       f'</text>')
            continue
        at = 0.0
        for part, color in CPU_PARTS:
            value = cpu.get(part) or 0.0
            out.append(f'<rect x="{xc(at):.1f}" y="{y + 6}" width="{xc(at + value) - xc(at):.1f}" '
                       f'height="{row_h - 12}" fill="{color}"/>')
            at += value
        out.append(f'<text x="{xc(at) + 6:.1f}" y="{y + row_h / 2 + 4}">{at:.2f}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _nice_step(span: float) -> float:
    """A 1/2/5 x 10^n grid step giving about eight ticks over `span`."""
    raw = span / 8
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for factor in (1, 2, 5, 10):
        if raw <= factor * magnitude:
            return factor * magnitude
    return 10 * magnitude


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def git_revision() -> tuple[str | None, bool]:
    """The short sha of HEAD, and whether tracked files outside the docs and the benchmark's
    committed outputs differ from it (the build measured is then not HEAD's)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=30, stdin=subprocess.DEVNULL).stdout.strip()
    try:
        sha = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs",
                      ":!README.md", f":!{SUMMARY.relative_to(ROOT)}",
                      f":!{CHART.relative_to(ROOT)}")
    except (OSError, subprocess.SubprocessError):
        return None, False
    return sha or None, bool(changed)


def tool_version(argv: list[str]) -> str:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = (result.stdout + result.stderr).strip().splitlines()
    return lines[0] if lines else "unknown"


# --- main ----------------------------------------------------------------------------------------


def build_anchor(what: str, commands: list[list[str]], *outputs: Path) -> bool:
    """Build an anchor's crate with `commands`, one after the other; False, having said why,
    if one failed or left one of `outputs` unbuilt."""
    for argv in commands:
        print(f"bench: {shlex.join(argv)}", flush=True)
        try:
            code = subprocess.run(argv, cwd=ROOT, stdin=subprocess.DEVNULL).returncode
            why = f"exit status {code}"
        except OSError as e:
            code, why = None, str(e)
        if code != 0:
            print(f"bench: building {what} failed ({why}): {shlex.join(argv)} (in {ROOT})",
                  file=sys.stderr)
            return False
    missing = [str(o.relative_to(ROOT)) for o in outputs if not o.exists()]
    if not missing:
        return True
    print(f"bench: building {what} left no {', '.join(missing)}", file=sys.stderr)
    return False


COMPARE = ROOT / "target" / "bench-compare"
PERF_RUNS = itertools.count(1)  # numbers the BENCH_PERF files of one run


def extract_revision(rev: str) -> tuple[str, Path]:
    """Git revision `rev`'s files from `git archive`, in target/bench-compare/<short sha>
    (replaced if there): its short sha and that directory."""
    sha = subprocess.run(["git", "rev-parse", "--short", f"{rev}^{{commit}}"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=30,
                         stdin=subprocess.DEVNULL).stdout.strip()
    src = COMPARE / sha
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True,
                             check=True, timeout=60, stdin=subprocess.DEVNULL).stdout
    # Extracted files dated now (-m), not at the commit: the target directory is shared, and
    # cargo would take an artifact built later from another revision as up to date.
    subprocess.run(["tar", "-x", "-m", "-C", str(src)], input=archive, check=True, timeout=60)
    return sha, src


def build_compare(rev: str) -> tuple[str, Path] | None:
    """The .wasm of git revision `rev`, built from `git archive` under target/bench-compare
    (a cargo target directory shared by every revision built there); None, having said why,
    if that failed."""
    try:
        sha, src = extract_revision(rev)
        build = ["cargo", "build", "--release", "--target", "wasm32-wasip1", "--manifest-path",
                 str(src / "Cargo.toml")]
        print(f"bench: BENCH_COMPARE={rev} ({sha}): {shlex.join(build)}", flush=True)
        subprocess.run(build, cwd=ROOT, check=True, timeout=1800, stdin=subprocess.DEVNULL,
                       env={**os.environ, "CARGO_TARGET_DIR": str(COMPARE / "target")})
    except (OSError, subprocess.SubprocessError) as e:
        print(f"bench: cannot build BENCH_COMPARE={rev}: {e}", file=sys.stderr)
        return None
    built = COMPARE / "target" / "wasm32-wasip1" / "release" / "coordination_guard.wasm"
    wasm = COMPARE / f"{sha}.wasm"
    shutil.copyfile(built, wasm)
    return sha, wasm


def main() -> int:
    rounds = env_int("BENCH_ROUNDS", 5)
    seconds = env_int("BENCH_SECONDS", 5)
    warmup = env_int("BENCH_WARMUP", 1)
    wanted = [s for s in os.environ.get("BENCH_SCENARIOS", "").split(",") if s.strip()]
    latency_names, latency_rates = latency_plan()
    try:
        require_binary("wrk")
        require_binary("redis-server")
        require_binary("webdis")
        envoy_bin = envoy_binary()
    except PrerequisiteMissing as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    if not DEFAULT_WASM.exists():
        print(f"bench: {DEFAULT_WASM} is missing; run `make build`", file=sys.stderr)
        return 2
    chosen = scenarios()
    unknown = set(wanted) - {s.name for s in chosen} - {"lease_contended", "open_loop"}
    if unknown:
        print(f"bench: unknown BENCH_SCENARIOS {sorted(unknown)}; known: "
              f"{', '.join(s.name for s in chosen)}", file=sys.stderr)
        return 2
    if wanted:
        chosen = [s for s in chosen if s.name in wanted]
    # lease_contended runs after the scenarios; its stack needs no plain Envoy round.
    by_name = {s.name: s for s in scenarios()}
    measured = chosen + [by_name[a] for s in chosen for a in in_round_anchors(s)]
    if not wanted or "open_loop" in wanted:
        measured += [by_name[name] for name in latency_names]
    if any(s.wasm_path in FLOOR_WASMS for s in measured) and not build_anchor(
            "the wasm_floor anchors", [FLOOR_BUILD], *FLOOR_WASMS):
        return 2
    if any(s.rls for s in measured) and not build_anchor(
            "the incumbent's rate limit service", RLS_BUILD, RLS_BIN):
        return 2
    compare = None
    if os.environ.get("BENCH_COMPARE", "").strip():
        compare = build_compare(os.environ["BENCH_COMPARE"].strip())
        if compare is None:
            return 2
    skipped: dict[str, str] = {}

    envoy_version = tool_version([envoy_bin, "--version"])
    short = re.search(r"/(\d+\.\d+\.\d+)/", envoy_version)
    revision, dirty = git_revision()
    meta = {
        "command": "make bench" if os.environ.get("MAKELEVEL") else shlex.join(sys.argv),
        "revision": revision,
        "dirty": dirty,
        "argv": sys.argv,
        "env": {k: v for k, v in os.environ.items() if k.startswith("BENCH_") or k == "ENVOY_BIN"},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "envoy_version": envoy_version,
        "envoy_version_short": short.group(1) if short else envoy_version,
        "wrk_version": tool_version(["wrk", "--version"]),
        "redis_version": tool_version(["redis-server", "--version"]),
        "wasm": str(DEFAULT_WASM.relative_to(ROOT)),
        "wasm_size_bytes": DEFAULT_WASM.stat().st_size,
        "floor_wasm": str(FLOOR_WASM.relative_to(ROOT)) if FLOOR_WASM.exists() else None,
        "floor_wasm_size_bytes": FLOOR_WASM.stat().st_size if FLOOR_WASM.exists() else None,
        "compare": ({"revision": compare[0], "wasm": str(compare[1].relative_to(ROOT)),
                     "wasm_size_bytes": compare[1].stat().st_size} if compare else None),
        "rounds": rounds, "seconds": seconds, "warmup_seconds": warmup,
        "wrk": {"threads": THREADS, "connections": CONNECTIONS},
        "envoy_concurrency": 2,
        "cpus": os.cpu_count(),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
    }
    print(f"bench: {len(chosen)} scenarios x {rounds} round(s) x {seconds}s (+ plain Envoy each "
          f"round), wrk -t{THREADS} -c{CONNECTIONS}; {meta['envoy_version_short']}; "
          f"{meta['wasm']} {meta['wasm_size_bytes']} bytes; load average "
          f"{' '.join(meta['loadavg_at_start'])}", flush=True)

    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    stack = Stack(WORK / "stack", None, envoys=1, direct_response=True, concurrency=2)
    scenario_results: dict[str, dict] = {}
    contended_results: list[dict] = []
    open_loop_results: list[dict] = []
    gateway_results: list[dict] = []
    bench: Bench | None = None
    try:
        stack.start()
        bench = Bench(stack, rounds, seconds, warmup, compare)
        for scenario in chosen:
            try:
                scenario_results[scenario.name] = bench.scenario(scenario)
            except (RuntimeError, TimeoutError, OSError) as e:
                bench.errors.append(f"{scenario.name}: {e}")
                print(f"  {scenario.name}: FAILED: {e}", flush=True)
        if not wanted or "open_loop" in wanted:
            latency_seconds = env_int("BENCH_LATENCY_SECONDS", 5)
            for scenario in [s for s in scenarios() if s.name in latency_names]:
                try:
                    open_loop_results.append(bench.open_loop(scenario, latency_rates,
                                                             latency_seconds))
                except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError,
                        PrerequisiteMissing) as e:
                    bench.errors.append(f"open_loop {scenario.name}: {e}")
            try:
                gateway_results = bench.gateway_alone(latency_rates, latency_seconds)
            except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError,
                    PrerequisiteMissing) as e:
                bench.errors.append(f"open_loop, the gateway alone: {e}")
        if not wanted or "lease_contended" in wanted:
            contended = []
            for _ in range(rounds):
                builds = [(DEFAULT_WASM, "ours")] + ([(compare[1], compare[0])] if compare else [])
                for wasm, label in builds:
                    try:
                        contended.append(bench.contended(wasm, label))
                    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
                        bench.errors.append(f"lease_contended ({label}): {e}")
            contended_results = contended
    finally:
        stack.stop()
        leftovers = stop_all()
        if leftovers:
            print(f"bench: stopped leftover processes {', '.join(leftovers)}", file=sys.stderr)

    add_anchor_ratios(scenario_results)
    all_plain = [r for sc in scenario_results.values() for r in sc["runs"] if r["kind"] == "plain"]
    get_plain = [r for name, sc in scenario_results.items() for r in sc["runs"]
                 if r["kind"] == "plain" and sc["script"].endswith("/get.lua")]
    results = {
        "meta": meta,
        # The plain row: plain runs of the GET scenarios (the others send other requests).
        "plain": summarize(None, get_plain or all_plain, "plain"),
        "plain_basis": "plain runs with bench/lua/get.lua" if get_plain else "all plain runs",
        "scenarios": scenario_results,
        "lease_contended": contended_results,
        "open_loop": open_loop_results,
        "open_loop_gateway": gateway_results,
        "skipped": skipped,
        "errors": bench.errors if bench else [],
    }
    results["meta"]["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    results["ok"] = not results["errors"]
    checks = {name: sc["summary"]["correctness"] for name, sc in scenario_results.items()
              if "correctness" in sc["summary"]}
    checks.update({f"{name}@{sc['summary']['compare']['revision']}":
                   sc["summary"]["compare"]["correctness"]
                   for name, sc in scenario_results.items()
                   if "correctness" in sc["summary"].get("compare", {})})
    results["correctness"] = checks

    # A full run writes its raw rounds to bench/results.json (a build output, not committed)
    # and its summary to bench/summary.json (committed), and renders the chart and the docs'
    # results section from the summary. A partial run (BENCH_SCENARIOS) writes all but the docs
    # beside the stack, under bench/work: the committed summary, chart and docs stay those of
    # the last full run.
    out = WORK if wanted else BENCH
    results_path, summary_path = out / RESULTS.name, out / SUMMARY.name
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    summary = summary_of(results)
    summary_path.write_text(dump_summary(summary))
    chart_path = out / CHART.name
    chart_path.write_text(svg_chart(summary))
    if not wanted and write_perf_doc(summary):
        print(f"wrote the results section of {PERF_DOC.relative_to(ROOT)}")

    print()
    print(table(results))
    print()
    print(f".wasm: {meta['wasm_size_bytes']} bytes ({meta['wasm']})")
    if "wasm_floor" in scenario_results:
        print(f"floor .wasm: {meta['floor_wasm_size_bytes']} bytes ({meta['floor_wasm']})")
    for name, c in checks.items():
        verdict = "ok" if c["ok"] else "FAILED"
        print(f"correctness ({name}): admitted per run {c['admitted_per_run']}, "
              f"limit {c['limit']}: {verdict}")
    for line in admission_lines(summary["scenarios"]):
        print(line)
    foreign = _median([r["foreign_cpu_cores"] for sc in scenario_results.values()
                       for r in sc["runs"]])
    print(f"other load: CPU (cores) used by processes outside this benchmark while it measured; "
          f"median {fmt(foreign, '.2f')} of {meta['cpus']}")
    for label in dict.fromkeys(r["label"] for r in contended_results):
        runs = [r for r in contended_results if r["label"] == label]
        print(f"lease_contended ({label}): {CONTENDED_WAITERS} waiters on one resource, "
              f"{CONTENDED_OP_MS} ms each: utilisation median "
              f"{fmt(_median([r['utilisation'] for r in runs]), '.2f')} "
              f"(rounds {', '.join(fmt(r['utilisation'], '.2f') for r in runs)}), "
              f"{sum(r['refused'] for r in runs)} refused")
    print(f"wrote {results_path.relative_to(ROOT)}, {summary_path.relative_to(ROOT)} and "
          f"{chart_path.relative_to(ROOT)}")
    if results["errors"]:
        print("\nbench FAILED:", file=sys.stderr)
        for error in results["errors"]:
            print(f"  {error}", file=sys.stderr)
        return 1
    return 0


def render(summary: dict) -> None:
    """The committed picture of a full run from its summary: bench/report.svg and the results
    section of docs/performance.md."""
    CHART.write_text(svg_chart(summary))
    print(f"wrote {CHART.relative_to(ROOT)}")
    if write_perf_doc(summary):
        print(f"wrote the results section of {PERF_DOC.relative_to(ROOT)}")
    else:
        print(f"{PERF_DOC.relative_to(ROOT)} has no results markers: left alone", file=sys.stderr)


def offline(argv: list[str]) -> int:
    """`--summarize [RESULTS] [--revision REV]`: bench/summary.json from a run's raw results
    (default bench/results.json), then the chart and the docs from it; `--render`: the chart and
    the docs from the committed bench/summary.json alone (a fresh clone has no raw results)."""
    import argparse

    parser = argparse.ArgumentParser(prog="bench/run.py", description=offline.__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--summarize", nargs="?", const=str(RESULTS), metavar="RESULTS",
                      help="a run's raw results (default bench/results.json)")
    mode.add_argument("--render", action="store_true",
                      help="render bench/report.svg and the docs from bench/summary.json")
    parser.add_argument("--revision", help="the build measured, for results that do not "
                        "record it")
    args = parser.parse_args(argv)
    if args.render:
        render(json.loads(SUMMARY.read_text()))
        return 0
    results = json.loads(Path(args.summarize).read_text())
    summary = summary_of(results, args.revision)
    SUMMARY.write_text(dump_summary(summary))
    print(f"wrote {SUMMARY.relative_to(ROOT)} ({SUMMARY.stat().st_size:,} bytes)")
    render(summary)
    return 0


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through main's finally: the stack is stopped


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit(offline(sys.argv[1:]))
    signal.signal(signal.SIGTERM, _terminate)
    sys.exit(main())
