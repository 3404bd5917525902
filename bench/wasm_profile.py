#!/usr/bin/env python3
"""`make bench-profile`: where one request's Wasm time goes, function by function.

Envoy's binary is stripped and its V8 writes no perf map, so `perf` sees the filter's Wasm in
Envoy as anonymous JIT code. The same code can be named elsewhere: this builds the core
benchmark (`benches/core.rs`) for wasm32-wasip1 with its function names (under
target/profile, so the stripped builds stay as they are), runs one case in wasmtime (Cranelift,
not V8: the same Wasm, another compiler) with wasmtime's perf map, and samples it with
`perf record -e cpu-clock` (a software clock: no hardware counters needed). It runs the case
CORE_COUNT=N times and then 0 times (the setup alone), and prints each Wasm function's share
of the difference: one request's JIT time, the module's start and the benchmark's setup left
out. Samples, less those of a setup that allocates and hashes too: at N=20000 a function's
share moved by up to 4 points between two runs here; compare builds at the default N or more.

Environment: CASE (a text that selects core cases by name, default the exact path with one
request in flight), N (runs, default 100000), TOP (functions listed, default 30).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import instructions  # bench/instructions.py: the core benchmark's build

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "target" / "profile"
DEFAULT_CASE = "request through the worker, exact, 10k tenants, 1 in flight"
# perf report's line for a symbol: its samples' period, the shared object, the symbol.
LINE = re.compile(r"^\s*(\d+)\s+(\S.*?)\s+\[\.\]\s+(.+?)\s*$")
# Rust's symbol hash suffix, which differs between builds.
HASH = re.compile(r"::h[0-9a-f]{16}$")

# Run in a child under perf: the module in wasmtime with its perf map, the case run n times;
# its pid (whose map wasmtime writes, /tmp/perf-<pid>.map), then the cases that ran, one a line.
CHILD = """
import os, sys
sys.path.insert(0, sys.argv[1])
from instructions import Runner
print(os.getpid(), flush=True)
_, ran = Runner(sys.argv[2], profiler="perfmap").run(sys.argv[3], int(sys.argv[4]))
print("\\n".join(ran))
"""


def build() -> Path:
    """The core benchmark's .wasm with its name section (not stripped) and its line tables
    (`make bench-footprint SOURCES=1` reads them; the code is the same without), under
    target/profile."""
    return instructions.build(ROOT / "Cargo.toml", TARGET,
                              {"CARGO_PROFILE_BENCH_STRIP": "false",
                               "CARGO_PROFILE_BENCH_DEBUG": "line-tables-only"})


def jit_samples(wasm: Path, case: str, n: int, workdir: Path) -> tuple[dict[str, int], str]:
    """Per Wasm function, the cpu-clock period perf sampled in JIT code while the case ran
    `n` times (setup included); and what the module printed."""
    data = workdir / f"perf-{n}.data"
    run = subprocess.run(
        ["perf", "record", "-q", "-e", "cpu-clock", "-F", "4999", "-o", str(data), "--",
         sys.executable, "-c", CHILD, str(Path(__file__).parent), str(wasm), case, str(n)],
        capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    if run.returncode != 0:
        raise RuntimeError(f"perf record failed ({run.returncode}): {run.stderr[-2000:]}")
    pid, _, printed = run.stdout.partition("\n")
    perf_map = Path(f"/tmp/perf-{pid.strip()}.map")
    try:
        report = subprocess.run(
            ["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym",
             "-F", "period,dso,sym", "--stdio"],
            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, check=True)
    finally:
        perf_map.unlink(missing_ok=True)
    found: dict[str, int] = {}
    for line in report.stdout.splitlines():
        m = LINE.match(line)
        if m and m.group(2).startswith("[JIT]"):
            name = HASH.sub("", m.group(3))
            found[name] = found.get(name, 0) + int(m.group(1))
    return found, printed


def profile(wasm: Path, case: str, n: int) -> tuple[list[tuple[str, float]], list[str]]:
    """Each function's share of the case's JIT time (largest first), and the cases that ran."""
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        runs, printed = jit_samples(wasm, case, n, Path(tmp))
        setup, _ = jit_samples(wasm, case, 0, Path(tmp))
    ran = [ln for ln in printed.splitlines() if ln]
    diff = {name: runs[name] - setup.get(name, 0) for name in runs}
    total = sum(v for v in diff.values() if v > 0)
    if total <= 0:
        return [], ran
    shares = sorted(((name, v / total) for name, v in diff.items() if v > 0),
                    key=lambda kv: -kv[1])
    return shares, ran


def main() -> int:
    case = os.environ.get("CASE", DEFAULT_CASE)
    n = int(os.environ.get("N", "100000"))
    top = int(os.environ.get("TOP", "30"))
    wasm = build()
    shares, ran = profile(wasm, case, n)
    if not ran:
        print(f"no core case matches {case!r}", file=sys.stderr)
        return 2
    print(f"Wasm time by function (wasmtime, perf cpu-clock), {n} runs of: {', '.join(ran)}")
    for name, share in shares[:top]:
        print(f"{100 * share:6.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
