"""A chaos run: random schedules of faults under concurrent clients, each checked.

    python -m chaos.run --schedules 100 [--seed 1234] [--topologies single,cluster]
    python -m chaos.run --schedule-seed 1234-17 --topologies cluster    # one schedule again

Each schedule has a seed of its own (`<run seed>-<index>`, printed with its result), from
which everything it does is drawn: its length, its faults (kinds, parameters, when each
starts and heals) and every client's traffic. A schedule:

1. starts the workload's client processes (chaos/workload.py) against the two Envoys;
2. injects and heals its faults on their timeline while the clients run (faults on one
   resource never overlap; faults on different resources may);
3. heals whatever is still faulted once the clients stopped and waits until the target is
   healthy (a target that does not heal is stopped, counted, and built again);
4. waits for the longest TTL the configuration names (chaos/config.py, SETTLE_MS) after the
   last request and the last heal, reads every key under the key prefix, and
5. checks the history, the service's ledger, the keys and the Envoys' logs
   (chaos/checker.py).

The target of a topology stays up for all its schedules; the schedules are split between the
topologies, the first part on `single`. The report goes to `<out>/report.json` and
`<out>/report.md` (schedules, faults by kind, requests, how often the documented weaker cases
happened, every violation with its schedule's seed and the history around it); a schedule's
history, ledger and keys stay in `<out>/schedules/<index>/` when it found a violation. The
last line printed is `<N> schedules, <M> violations`; the exit status is 1 when M > 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import chaos  # noqa: F401  (tests/ on sys.path)
from chaos import config
from chaos.checker import Schedule, check
from chaos.faults import FAULTS, kinds_for
from chaos.service import Service
from chaos.target import build_target

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "build" / "chaos"
PROCS = 3
THREADS = 4
# A schedule's traffic lasts this many seconds (drawn); its faults start within it.
DURATION_S = (3.0, 4.5)
FAULT_S = (0.3, 3.0)
FAULTS_PER_SCHEDULE = (1, 1, 2, 2, 3)


@dataclass
class Outcome:
    index: int
    seed: str
    topology: str
    faults: list[dict] = field(default_factory=list)
    requests: int = 0
    violations: list[dict] = field(default_factory=list)
    weaker: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    seconds: float = 0.0
    restarted: bool = False
    # The run's own troubles (a fault that could not be injected or healed, a client process
    # that did not finish): reported, not violations of the filter.
    run_errors: list[str] = field(default_factory=list)


def config_variants(base: dict) -> list[dict]:
    """Configurations the config_reload fault may hand an Envoy: each changes how the filter
    reaches Redis, none what it guarantees (no batching; no over-limit cache)."""
    no_batch = json.loads(json.dumps(base))
    no_batch["redis"]["batch"] = False
    no_cache = json.loads(json.dumps(base))
    no_cache["over_limit_cache"] = {"entries": 0}
    return [no_batch, no_cache]


def plan_faults(rng: random.Random, target, duration: float) -> list[dict]:
    """The schedule's faults: each with its start and heal (seconds from the traffic's
    start); two on one resource never at once."""
    kinds = kinds_for(target.topology)
    planned: list[dict] = []
    for _ in range(rng.choice(FAULTS_PER_SCHEDULE)):
        kind = rng.choice(kinds)
        fault = FAULTS[kind](rng, target)
        start = rng.uniform(0.2, max(0.3, duration - 1.0))
        length = rng.uniform(*FAULT_S)
        if any(p["fault"].resource == fault.resource and start < p["heal"] + 0.5
               and p["start"] < start + length + 0.5 for p in planned):
            continue
        planned.append({"fault": fault, "start": start, "heal": start + length})
    return planned


def _snapshot_keys(target) -> tuple[list[dict], float]:
    """Every key under the key prefix: its TTL, a record's state, a slot set's members."""
    client = target.redis_client()
    out = []
    try:
        for raw in client.scan_iter(match=f"{target.key_prefix}:*", count=1000):
            key = raw.decode() if isinstance(raw, bytes) else raw
            entry = {"key": key, "pttl": client.pttl(key)}
            if entry["pttl"] == -2:
                continue  # expired between SCAN and PTTL
            if ":idem:" in key:
                try:
                    value = client.get(key)
                    entry["state"] = json.loads(value).get("state") if value else None
                except Exception as e:  # not a string, not JSON: the checker names it
                    entry["state"] = f"unreadable: {e.__class__.__name__}"
            elif ":rl:" in key and ":cc:" in key:
                entry["members"] = [[m.decode() if isinstance(m, bytes) else m, s]
                                    for m, s in client.zrange(key, 0, -1, withscores=True)]
            out.append(entry)
    finally:
        client.close()
    return out, time.time()


def _spawn_workload(spec_path: Path, proc: int, out: Path) -> subprocess.Popen:
    log = open(out.with_suffix(".log"), "wb")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "chaos.workload", "--spec", str(spec_path),
                             "--proc", str(proc), "--out", str(out)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def run_schedule(index: int, seed: str, target, service: Service, workdir: Path,
                 log_offsets: list[int], ledger_offset: list[int]) -> Outcome:
    began = time.monotonic()
    rng = random.Random(seed)
    outcome = Outcome(index, seed, target.topology)
    duration = rng.uniform(*DURATION_S)
    planned = plan_faults(rng, target, duration)
    tag = f"s{index}x{secrets.token_hex(2)}"
    sdir = workdir / "schedules" / str(index)
    sdir.mkdir(parents=True, exist_ok=True)
    start_at = time.time() + 0.6
    spec = {"seed": seed, "tag": tag, "envoy_urls": target.envoy_urls, "start_at": start_at,
            "duration_s": duration, "threads": THREADS, "tenants": 2}
    spec_path = sdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    outs = [sdir / f"history-{p}.jsonl" for p in range(PROCS)]
    procs = [_spawn_workload(spec_path, p, out) for p, out in enumerate(outs)]

    # The faults' timeline, in this thread: inject and heal at their times.
    events = sorted([(p["start"], "inject", p) for p in planned]
                    + [(p["heal"], "heal", p) for p in planned], key=lambda e: e[0])
    records: list[dict] = []
    errors: list[str] = []
    for at, what, p in events:
        time.sleep(max(0.0, start_at + at - time.time()))
        fault = p["fault"]
        try:
            if what == "inject":
                p["record"] = {"kind": fault.kind, "injected_at": time.time()}
                p["record"].update(fault.inject())
                records.append(p["record"])
            elif "record" in p:
                fault.heal()
                p["record"]["healed_at"] = time.time()
        except Exception as e:
            errors.append(f"{what} {fault!r}: {e.__class__.__name__}: {e}")
    deadline = start_at + duration + 60
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            errors.append(f"workload process {proc.pid} did not finish; killed")
    last_request = time.time()
    for p in planned:  # whatever the timeline left faulted
        try:
            p["fault"].heal()
        except Exception as e:
            errors.append(f"heal {p['fault']!r}: {e.__class__.__name__}: {e}")
        if "record" in p and "healed_at" not in p["record"]:
            p["record"]["healed_at"] = time.time()
    try:
        target.healthy(120)
    except Exception as e:
        outcome.restarted = True
        errors.append(f"the target did not heal: {e}")
    last_heal = max([r.get("healed_at", 0) for r in records] + [last_request])
    time.sleep(max(0.0, last_heal + config.SETTLE_MS / 1000 + 0.5 - time.time()))

    history = []
    for out in outs:
        if out.exists():
            history += [json.loads(line) for line in out.read_text().splitlines() if line]
    ledger_all = service.ledger(ledger_offset[0])
    ledger_offset[0] += len(ledger_all)
    ledger = [e for e in ledger_all if str(e.get("id") or "").startswith(tag + "-")]
    keys, now = (None, time.time()) if outcome.restarted else _snapshot_keys(target)
    logs = target.envoy_logs()
    new_logs = [log[log_offsets[i]:] if i < len(log_offsets) else log for i, log in enumerate(logs)]
    log_offsets[:] = [len(log) for log in logs]

    result = check(Schedule(history=history, ledger=ledger, faults=records, redis_keys=keys,
                            envoy_logs=new_logs, seed=seed, now=now))
    outcome.run_errors = errors
    for v in result.violations:
        v["seed"], v["topology"], v["schedule"] = seed, target.topology, index
    outcome.faults = records
    outcome.requests = len(history)
    outcome.violations = result.violations
    outcome.weaker = dict(result.weaker)
    outcome.stats = dict(result.stats)
    outcome.seconds = time.monotonic() - began
    if result.violations:
        (sdir / "ledger.json").write_text(json.dumps(ledger))
        (sdir / "keys.json").write_text(json.dumps(keys))
        (sdir / "faults.json").write_text(json.dumps(records, default=str))
    else:
        for out in outs:
            out.unlink(missing_ok=True)
    return outcome


def run(seed: str, schedules: int, topologies: list[str], out: Path,
        schedule_seeds: list[str] | None = None, echo=print) -> dict:
    """Run `schedules` schedules (or exactly `schedule_seeds`), split between `topologies`;
    write the report; return it."""
    out.mkdir(parents=True, exist_ok=True)
    seeds = schedule_seeds or [f"{seed}-{i}" for i in range(schedules)]
    per = math.ceil(len(seeds) / len(topologies))
    plan = [(topologies[min(i // per, len(topologies) - 1)], s) for i, s in enumerate(seeds)]
    echo(f"chaos: seed {seed}, {len(seeds)} schedules on {', '.join(topologies)}")
    service = Service(out / "service").start()
    outcomes: list[Outcome] = []
    restarts = 0
    started = time.monotonic()
    try:
        for topology in topologies:
            mine = [(i, s) for i, (t, s) in enumerate(plan) if t == topology]
            if not mine:
                continue
            base = config.plugin_config()
            target = None
            try:
                log_offsets: list[int] = []
                ledger_offset = [len(service.ledger())]
                for index, s in mine:
                    if target is None:
                        target = build_target(topology, out / f"target-{topology}-{restarts}",
                                              base, service.port, grpc_port=service.grpc_port)
                        target.config_variants = config_variants(target.plugin_config)
                        log_offsets = [0] * len(target.envoys)
                    o = run_schedule(index, s, target, service, out, log_offsets, ledger_offset)
                    outcomes.append(o)
                    kinds = ",".join(f["kind"] for f in o.faults) or "none"
                    echo(f"schedule {index} seed {s} {topology}: faults {kinds}; "
                         f"{o.requests} requests, {len(o.violations)} violations "
                         f"({o.seconds:.1f}s)")
                    for v in o.violations:
                        echo(f"  VIOLATION {v['invariant']}: {v['detail']}")
                    for e in o.run_errors:
                        echo(f"  run: {e}")
                    if o.restarted:
                        restarts += 1
                        target.stop()
                        target = None
            finally:
                if target is not None:
                    target.stop()
    finally:
        service.stop()
    report = summarise(seed, outcomes, restarts, time.monotonic() - started)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(markdown(report))
    return report


def summarise(seed: str, outcomes: list[Outcome], restarts: int, seconds: float) -> dict:
    faults = Counter(f["kind"] for o in outcomes for f in o.faults)
    losing = Counter(f["kind"] for o in outcomes for f in o.faults if f.get("data_loss"))
    weaker: dict = defaultdict(int)
    stats: dict = defaultdict(int)
    for o in outcomes:
        for k, v in o.weaker.items():
            weaker[k] += v
        for k, v in o.stats.items():
            stats[k] += v
    violations = [v for o in outcomes for v in o.violations]
    return {
        "seed": seed,
        "schedules": len(outcomes),
        "by_topology": dict(Counter(o.topology for o in outcomes)),
        "seconds": round(seconds, 1),
        "requests": sum(o.requests for o in outcomes),
        "faults": dict(sorted(faults.items())),
        "faults_with_data_loss": dict(sorted(losing.items())),
        "weaker": dict(sorted(weaker.items())),
        "stats": dict(sorted(stats.items())),
        "target_restarts": restarts,
        "run_errors": [f"schedule {o.index} ({o.seed}): {e}" for o in outcomes for e in o.run_errors],
        "violations": violations,
        "outcomes": [o.__dict__ | {"violations": len(o.violations)} for o in outcomes],
    }


def markdown(report: dict) -> str:
    lines = [f"# Chaos run, seed {report['seed']}", "",
             f"{report['schedules']} schedules ({', '.join(f'{k}: {v}' for k, v in report['by_topology'].items())}), "
             f"{report['requests']} requests, {report['seconds']} s, "
             f"{report['target_restarts']} target restarts, "
             f"**{len(report['violations'])} violations**.", "",
             "| fault | injected | of which may lose writes |", "|---|---|---|"]
    for kind, n in report["faults"].items():
        lines.append(f"| {kind} | {n} | {report['faults_with_data_loss'].get(kind, 0)} |")
    lines += ["", "Documented weaker cases that happened (only the weaker bound held):", ""]
    lines += [f"- {k}: {v}" for k, v in report["weaker"].items()] or ["- none"]
    lines += ["", "The run's own troubles (not violations):", ""]
    lines += [f"- {e}" for e in report["run_errors"]] or ["- none"]
    lines += ["", "Answers and counts:", ""]
    lines += [f"- {k}: {v}" for k, v in report["stats"].items()]
    lines += ["", "## Violations", ""]
    if not report["violations"]:
        lines.append("None.")
    for v in report["violations"]:
        lines += [f"### {v['invariant']}: schedule {v.get('schedule')} ({v.get('topology')}), "
                  f"seed {v.get('seed')}", "", v["detail"], "", "```json"]
        lines += [json.dumps(h, sort_keys=True) for h in v.get("history", [])[:20]]
        lines += ["```", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="chaos schedules against the real stack")
    parser.add_argument("--schedules", type=int,
                        default=int(os.environ.get("CHAOS_SCHEDULES") or 100))
    parser.add_argument("--seed", default=os.environ.get("CHAOS_SEED") or None)
    parser.add_argument("--schedule-seed", action="append", default=None,
                        help="run exactly this schedule seed (repeatable), e.g. 1234-17")
    parser.add_argument("--topologies", default="single,cluster")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    seed = args.seed or str(secrets.randbelow(10 ** 9))
    topologies = [t for t in args.topologies.split(",") if t]
    report = run(seed, args.schedules, topologies, args.out, args.schedule_seed)
    print(f"report: {args.out / 'report.md'}")
    print(f"faults: {', '.join(f'{k} {v}' for k, v in report['faults'].items()) or 'none'}")
    if report["weaker"]:
        print(f"weaker cases: {', '.join(f'{k} {v}' for k, v in report['weaker'].items())}")
    print(f"{report['schedules']} schedules, {len(report['violations'])} violations", flush=True)
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
