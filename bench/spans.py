#!/usr/bin/env python3
"""`make bench-spans`: where the filter's time goes inside Envoy, span by span.

Builds the filter with the cargo feature `spans` (under target/spans, so the release build the
tests and `make bench` use is left alone), runs `bench/run.py` on it for the scenarios in
BENCH_SCENARIOS (default `rl_allowed,rl_rejected,rl_allowed_leased`; BENCH_ROUNDS and
BENCH_SECONDS default to 1 and 5) and prints, per scenario, the median over its reports of each
span's mean wall time in µs. The filter logs one report per worker every 10,000 guarded
requests (`spans:` warnings in the scenario Envoy's log, under bench/work/stack), and how many
times each span ran per guarded request (`x1.00`: once each). The partial
run writes under bench/work, never the committed summary, chart or docs.

Wall time, not CPU time: a span a worker was descheduled in counts the wait too, and the spans'
own clock reads (about 0.5 µs per span) are in them. Compare spans of one run.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "target" / "spans"
WASM = TARGET / "wasm32-wasip1" / "release" / "coordination_guard.wasm"
STACK = ROOT / "bench" / "work" / "stack"
DEFAULT_SCENARIOS = "rl_allowed,rl_rejected,rl_allowed_leased"
LINE = re.compile(r"spans: (.*)$")
ORDER = ("headers", "headers_map", "headers_match", "headers_parse", "decide", "send", "answer",
         "answer_read", "resume", "response_headers", "done", "create", "idle", "drop")


def reports(log: Path) -> dict[str, list[tuple[float, int]]]:
    """Every `spans:` report in `log`: span -> (mean µs, count) of each report."""
    found: dict[str, list[tuple[float, int]]] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = LINE.search(line)
        if not m:
            continue
        for part in m.group(1).split():
            name, _, rest = part.partition("=")
            mean, _, count = rest.partition("/")
            try:
                found.setdefault(name, []).append((float(mean), int(count)))
            except ValueError:
                continue
    return found


def cell(found: dict[str, list[tuple[float, int]]], name: str) -> str:
    """The median mean of a span, and how often it ran per guarded request."""
    if name not in found:
        return f"{'-':>16}"
    mean = statistics.median(m for m, _ in found[name])
    per = sum(n for _, n in found[name]) / max(1, sum(n for _, n in found.get("headers", [])))
    return f"{mean:9.2f} x{per:<5.2f}"


def main() -> int:
    scenarios = [s for s in os.environ.get("BENCH_SCENARIOS", DEFAULT_SCENARIOS).split(",")
                 if s.strip()]
    subprocess.run(["cargo", "build", "--release", "--target", "wasm32-wasip1", "--features",
                    "spans", "--target-dir", str(TARGET)], cwd=ROOT, check=True)
    env = {**os.environ, "CG_WASM": str(WASM), "BENCH_SCENARIOS": ",".join(scenarios),
           "BENCH_ROUNDS": os.environ.get("BENCH_ROUNDS", "1"),
           "BENCH_SECONDS": os.environ.get("BENCH_SECONDS", "5")}
    env.pop("BENCH_COMPARE", None)
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py")], cwd=ROOT, env=env,
                         timeout=3600)
    if run.returncode != 0:
        print(f"bench-spans: bench/run.py exited {run.returncode}", file=sys.stderr)
        return run.returncode
    failed = False
    print("\nspans: median of the reports' means, wall µs per span, and how many times it ran per "
          "guarded request (bench/work/stack/*/envoy.log)")
    print(f"{'scenario':20} " + " ".join(f"{n:>16}" for n in ORDER))
    for name in scenarios:
        log = STACK / f"envoy-{name}" / "envoy.log"
        found = reports(log) if log.exists() else {}
        if not found:
            print(f"bench-spans: no spans report in {log} (fewer than 10,000 guarded requests "
                  "per worker?)", file=sys.stderr)
            failed = True
            continue
        cells = [cell(found, n) for n in ORDER]
        print(f"{name:20} " + " ".join(cells))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
