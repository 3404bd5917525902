#!/usr/bin/env python3
"""Wasm instructions per request of the core benchmark's cases, the working tree beside a git
revision: a count, where every timing on a shared 2-core machine moves by 10-30% run to run.

Builds `benches/core.rs` for wasm32-wasip1 (the working tree's, and REV's from `git archive`
under target/bench-compare, as `make bench`'s BENCH_COMPARE extracts it), runs each selected
case in wasmtime with fuel metering (`CORE_COUNT=<n>`: the case runs n times, untimed), and
reports
(fuel after N runs - fuel after none) / N: the Wasm operators one run executes, the filter's
own code as Envoy's V8 runs it, host calls, caches and the JIT's code quality apart. Every
operator costs one unit of fuel except a few structural ones (`nop`, `block`, `loop`, `end`,
`drop`). A run's count moves only where the code reads randomness (hash tables' seeds): by a
few instructions.

Environment: CASES (texts separated by `|`; each selects the cases whose name contains it;
default "request through the worker"), REV (git revision, default HEAD), N (runs per case,
default 200). REV must have `CORE_COUNT` in its benches/core.rs (the first with it says so).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from wasmtime import Config, Engine, ExitTrap, Instance, Linker, Module, Store, WasiConfig

import run  # bench/run.py: a revision's files, as BENCH_COMPARE extracts them

ROOT = Path(__file__).resolve().parents[1]
FUEL = 10**15


def build(manifest: Path, target_dir: Path | None, env: dict[str, str] | None = None) -> Path:
    """The core benchmark's .wasm built from `manifest` (`env` added to cargo's environment),
    as cargo reports it."""
    cmd = ["cargo", "bench", "--bench", "core", "--target", "wasm32-wasip1", "--no-run",
           "--message-format=json", "--manifest-path", str(manifest)]
    env = {**os.environ, **({"CARGO_TARGET_DIR": str(target_dir)} if target_dir else {}),
           **(env or {})}
    print(f"building: {shlex.join(cmd)}", flush=True)
    out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True,
                         timeout=1800, stdin=subprocess.DEVNULL).stdout
    found = [m["executable"] for m in map(json.loads, out.splitlines())
             if m.get("executable") and m.get("target", {}).get("kind") == ["bench"]]
    if not found:
        raise RuntimeError(f"cargo built no core benchmark from {manifest}")
    return Path(found[-1])


def build_rev(rev: str) -> tuple[str, Path]:
    """REV's core benchmark, built from its files where `make bench`'s BENCH_COMPARE puts
    them (target/bench-compare, one cargo target directory for every revision)."""
    sha, src = run.extract_revision(rev)
    return sha, build(src / "Cargo.toml", run.COMPARE / "target")


class Runner:
    """One benchmark module in wasmtime with fuel; its proxy-wasm imports trap if called.
    `profiler` (wasmtime's: "perfmap" names its JIT code for perf) runs it without fuel
    instead (bench/wasm_profile.py)."""

    def __init__(self, wasm: Path | str | bytes, profiler: str | None = None):
        config = Config()
        self.fuel = profiler is None
        config.consume_fuel = self.fuel
        if profiler:
            config.profiler = profiler
        self.engine = Engine(config)
        code = wasm if isinstance(wasm, bytes) else Path(wasm).read_bytes()
        self.module = Module(self.engine, code)

    def run(self, case: str, n: int) -> tuple[int, list[str]]:
        """Fuel used by a run of the module selecting `case` with CORE_COUNT=n (0 without
        fuel), and the names of the cases it ran."""
        store, _, ran = self.start(case, n)
        used = FUEL - store.get_fuel() if self.fuel else 0
        return used, ran

    def start(self, case: str, n: int) -> tuple[Store, Instance, list[str]]:
        """The module run to its end selecting `case` with CORE_COUNT=n: its store and
        instance as it left them, and the names of the cases it ran."""
        store = Store(self.engine)
        linker = Linker(self.engine)
        linker.define_wasi()
        for imp in self.module.imports:
            if imp.module != "wasi_snapshot_preview1":
                linker.define_func(imp.module, imp.name, imp.type, _host_call(imp.name))
        with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
            out = Path(tmp) / "stdout"
            wasi = WasiConfig()
            wasi.argv = ["core", case]
            wasi.env = [("CORE_COUNT", str(n))]
            wasi.stdout_file = str(out)
            wasi.inherit_stderr()
            store.set_wasi(wasi)
            if self.fuel:
                store.set_fuel(FUEL)
            instance = linker.instantiate(store, self.module)
            try:
                instance.exports(store)["_start"](store)
            except ExitTrap as e:
                if e.code != 0:
                    raise RuntimeError(f"{case!r}: exit code {e.code}") from e
            ran = [line.removeprefix("counted: ") for line in out.read_text().splitlines()
                   if line.startswith("counted: ")]
        return store, instance, ran

    def per_run(self, case: str, n: int) -> tuple[float, list[str]]:
        base, _ = self.run(case, 0)
        used, ran = self.run(case, n)
        return (used - base) / n, ran


def _host_call(name: str):
    def trap(*_args):
        raise RuntimeError(f"host call {name} outside a host")
    return trap


def main() -> int:
    rev = os.environ.get("REV", "HEAD")
    n = int(os.environ.get("N", "200"))
    cases = [c.strip() for c in os.environ.get("CASES", "request through the worker").split("|")
             if c.strip()]
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("CASES", "REV", "N")
                   if k in os.environ)
    print(f"reproduce: cd {ROOT} && {env + ' ' if env else ''}make bench-instructions")
    now = Runner(build(ROOT / "Cargo.toml", None))
    sha, rev_wasm = build_rev(rev)
    then = Runner(rev_wasm)
    names: list[str] = []
    for case in cases:
        _, ran = now.run(case, 0)
        if not ran:
            print(f"no case matches {case!r}", file=sys.stderr)
            return 2
        names += [r for r in ran if r not in names]
    print(f"Wasm instructions per run (wasmtime fuel), {n} runs per case; {rev} = {sha}")
    print(f"{'case':<66} {sha + ' instr':>14} {'now instr':>12} {'now / ' + sha:>14}")
    for name in names:
        ours, ran = now.per_run(name, n)
        try:
            theirs, ran_then = then.per_run(name, n)
        except RuntimeError as e:
            print(f"{name:<66} {'-':>14} {ours:>12.0f}   ({sha}: {e})")
            continue
        if ran_then != ran:
            print(f"{name:<66} {'-':>14} {ours:>12.0f}   ({sha} has no such case, or no "
                  "CORE_COUNT)")
            continue
        print(f"{name:<66} {theirs:>14.0f} {ours:>12.0f} {ours / theirs:>13.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
