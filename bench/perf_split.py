"""Where an Envoy spent its samples, from `perf record -g` files that `make bench` wrote with
BENCH_PERF=<dir> BENCH_PERF_ARGS=-g: in the filter's Wasm (V8's JIT code, which perf sees as
anonymous memory, since the Envoy binary is stripped and its V8 writes no perf map), in a host
call the Wasm made (native code below a JIT frame: the proxy-wasm ABI, and what Envoy does for
the call, such as a local reply's encoding), or in Envoy outside the filter (native code or the
kernel with no JIT frame in the chain).

    python3 bench/perf_split.py <file.data> [<requests> ...]

With the number of requests each file's run served (wrk's count over the sampled seconds), the
shares are also printed as CPU µs per request, at the sampling frequency the bench uses.
"""

from __future__ import annotations

import collections
import subprocess
import sys

# bench/run.py samples at this frequency (perf record -F).
FREQUENCY_HZ = 2000


def split(path: str) -> tuple[int, collections.Counter]:
    """The file's sample count, and its samples per category."""
    out = subprocess.run(["perf", "script", "-i", path, "-F", "ip,dso"], capture_output=True,
                         text=True, check=True, timeout=600).stdout
    return classify(out)


def classify(script: str) -> tuple[int, collections.Counter]:
    """[`split`] of `perf script -F ip,dso` output: samples separated by blank lines, one
    `<address> (<object>)` line per frame, innermost first."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for sample in script.split("\n\n"):
        frames = [line.split(None, 1) for line in sample.strip().splitlines() if line.strip()]
        dsos = [f[1] if len(f) > 1 else "" for f in frames]
        if not dsos:
            continue
        total += 1
        jit = ["perf-" in d and ".map" in d for d in dsos]
        if jit[0]:
            counts["Wasm (JIT)"] += 1
        elif any(jit):
            counts["host calls from the Wasm"] += 1
        elif "kernel" in dsos[0]:
            counts["outside the filter: kernel"] += 1
        else:
            counts["outside the filter: Envoy"] += 1
    return total, counts


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    files = [a for a in sys.argv[1:] if not a.isdigit()]
    requests = [int(a) for a in sys.argv[1:] if a.isdigit()]
    for i, path in enumerate(files):
        total, counts = split(path)
        served = requests[i] if i < len(requests) else None
        print(f"{path}: {total} samples")
        for name, n in counts.most_common():
            line = f"  {name:32s} {n:7d}  {100 * n / max(total, 1):5.1f}%"
            if served:
                line += f"  {n / FREQUENCY_HZ / served * 1e6:7.2f} µs/request"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
