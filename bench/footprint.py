#!/usr/bin/env python3
"""`make bench-footprint`: the code one request runs, function by function.

Executed instructions are not what the filter costs in Envoy: between two of a worker's
events, webdis, Redis and wrk run on the same two cores, and whatever code the filter runs must
come back into the caches. So this counts how much distinct code a request touches. It builds
the core benchmark (`benches/core.rs`) for wasm32-wasip1 with its function names (under
target/profile, as `make bench-profile` does), adds to every function a counter of its calls
(a mutable global per function, incremented first thing in its body and exported), runs the
selected case CORE_COUNT=N times and then 0 times in wasmtime, and reports, per request: the
distinct functions called, their code's size in bytes of Wasm (each body as the module stores
it), and the calls. Functions that some requests call and others do not (a key memo's miss)
count with the fraction of requests that call them. The code that ran is also counted in
lines of 64 bytes of each function's Wasm, the size of a cache line: code that does not run
between two pieces that do (a cold path inlined into a hot function) spreads what runs over
more lines, and a line the request touches costs the whole line.

With SOURCES=1 it also prints, per case, the code that did not run but sits in the lines the
code that ran touches, by the source it was compiled from (the innermost function inlined
there, found by Debian's llvm-symbolizer in the build's line tables): what spreads the hot code.

Environment: CASES (texts separated by `|`, each selecting core cases by name, added up when
one text selects several; default the exact path with one request in flight, the cached
rejection and the leased slice), N (runs, default 2000), TOP (functions listed per case, most
code run first, default 25), SOURCES.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import instructions  # bench/instructions.py: the core benchmark run in wasmtime
import wasm_profile  # bench/wasm_profile.py: the core benchmark with its names

DEFAULT_CASES = ("request through the worker, exact, 10k tenants, 1 in flight|"
                 "through the worker, rejected|through the worker, admitted from a leased slice")


def leb(data: bytes, at: int) -> tuple[int, int]:
    """An unsigned LEB128 at `at`: its value and where it ends."""
    value = shift = 0
    while True:
        b = data[at]
        at += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, at
        shift += 7


def put_leb(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def vec_name(data: bytes, at: int) -> tuple[str, int]:
    n, at = leb(data, at)
    return data[at:at + n].decode("utf-8", "replace"), at + n


def sections(wasm: bytes) -> list[tuple[int, bytes]]:
    out, at = [], 8
    while at < len(wasm):
        sid = wasm[at]
        size, body = leb(wasm, at + 1)
        out.append((sid, wasm[body:body + size]))
        at = body + size
    return out


def imports(content: bytes) -> tuple[int, int]:
    """Imported functions and globals."""
    count, at = leb(content, 0)
    funcs = globs = 0
    for _ in range(count):
        _, at = vec_name(content, at)
        _, at = vec_name(content, at)
        kind = content[at]
        at += 1
        if kind == 0:
            _, at = leb(content, at)
            funcs += 1
        elif kind == 1:
            at += 1
            flags, at = leb(content, at)
            _, at = leb(content, at)
            if flags & 1:
                _, at = leb(content, at)
        elif kind == 2:
            flags, at = leb(content, at)
            _, at = leb(content, at)
            if flags & 1:
                _, at = leb(content, at)
        elif kind == 3:
            at += 2
            globs += 1
        else:
            raise ValueError(f"import kind {kind}")
    return funcs, globs


def function_names(content: bytes) -> dict[int, str]:
    """The name section's function names, by function index."""
    _, at = vec_name(content, 0)  # "name"
    names: dict[int, str] = {}
    while at < len(content):
        sub = content[at]
        size, body = leb(content, at + 1)
        if sub == 1:
            count, p = leb(content, body)
            for _ in range(count):
                idx, p = leb(content, p)
                name, p = vec_name(content, p)
                names[idx] = wasm_profile.HASH.sub("", name)
        at = body + size
    return names


def sleb_end(data: bytes, at: int) -> int:
    """Where a signed LEB128 at `at` ends."""
    while data[at] & 0x80:
        at += 1
    return at + 1


# Opcodes whose immediate is one u32, or none (the rest are decoded in `regions`).
U32_IMM = {0x0C, 0x0D, 0x10, 0x12, 0x20, 0x21, 0x22, 0x23, 0x24, 0x25, 0x26, 0xD2}
FC_IMMS = {8: "ub", 9: "u", 10: "bb", 11: "b", 12: "uu", 13: "u", 14: "uu", 15: "u",
           16: "u", 17: "u"}


def regions(expr: bytes) -> list[int]:
    """The offsets in a function's code (after its locals) where straight-line code begins:
    the start, a loop's body, an if's either arm, after a block's end, after a conditional
    branch. Each runs to the next one."""
    starts = [0]
    at, depth = 0, 1
    while at < len(expr):
        op = expr[at]
        at += 1
        if op in (0x02, 0x03, 0x04):
            bt = expr[at]
            at = at + 1 if bt == 0x40 or bt >= 0x6F else sleb_end(expr, at)
            depth += 1
            if op != 0x02:
                starts.append(at)
        elif op == 0x05:
            starts.append(at)
        elif op == 0x0B:
            depth -= 1
            if depth > 0:
                starts.append(at)
        elif op in U32_IMM:
            _, at = leb(expr, at)
            if op == 0x0D:
                starts.append(at)
        elif op == 0x0E:
            n, at = leb(expr, at)
            for _ in range(n + 1):
                _, at = leb(expr, at)
        elif op in (0x11, 0x13):
            _, at = leb(expr, at)
            _, at = leb(expr, at)
        elif op == 0x1C:
            n, at = leb(expr, at)
            at += n
        elif 0x28 <= op <= 0x3E:
            _, at = leb(expr, at)
            _, at = leb(expr, at)
        elif op in (0x3F, 0x40, 0xD0):
            at += 1
        elif op in (0x41, 0x42):
            at = sleb_end(expr, at)
        elif op == 0x43:
            at += 4
        elif op == 0x44:
            at += 8
        elif op == 0xFC:
            sub, at = leb(expr, at)
            for kind in FC_IMMS.get(sub, ""):
                if kind == "u":
                    _, at = leb(expr, at)
                else:
                    at += 1
        elif op in (0x00, 0x01, 0x0F, 0x1A, 0x1B, 0xD1) or 0x45 <= op <= 0xC4:
            pass
        else:
            raise ValueError(f"opcode {op:#x} at {at - 1}")
    return sorted(set(s for s in starts if s < len(expr)))


def instrument(wasm: bytes, blocks: set[int] | None = None
               ) -> tuple[bytes, dict[int, str], dict[int, int],
                          dict[int, list[tuple[int, int, int]]]]:
    """The module with a call counter per defined function (exported as `cnt<i>`, i its
    function index), or with `blocks`, a counter per region of straight-line code of each of
    those functions (`cnt<n>`, the n-th region counted); the functions' names; each body's
    size in bytes; and with `blocks`, each function's regions: (counter, bytes, where the
    region begins in the code section's contents, the address its debug info gives it)."""
    secs = sections(wasm)
    ifuncs = iglobs = 0
    defined_globals = 0
    names: dict[int, str] = {}
    for sid, content in secs:
        if sid == 2:
            ifuncs, iglobs = imports(content)
        elif sid == 6:
            defined_globals, _ = leb(content, 0)
        elif sid == 0 and content[:5] == b"\x04name":
            names = function_names(content)
    code = next(c for sid, c in secs if sid == 10)
    count, at = leb(code, 0)
    first_counter = iglobs + defined_globals
    bodies, sizes = [], {}
    spans: dict[int, list[tuple[int, int, int]]] = {}
    counter = 0

    def bump() -> bytes:
        nonlocal counter
        g = put_leb(first_counter + counter)
        counter += 1
        return b"\x23" + g + b"\x41\x01\x6a\x24" + g

    for i in range(count):
        size, body = leb(code, at)
        raw = code[body:body + size]
        at = body + size
        groups, p = leb(raw, 0)
        for _ in range(groups):
            _, p = leb(raw, p)
            p += 1
        f = ifuncs + i
        sizes[f] = size
        if blocks is None:
            new = raw[:p] + bump() + raw[p:]
        elif f in blocks:
            expr = raw[p:]
            cuts = regions(expr) + [len(expr)]
            parts, spans[f] = [raw[:p]], []
            for a, b in zip(cuts, cuts[1:]):
                spans[f].append((counter, b - a, body + p + a))
                parts += [bump(), expr[a:b]]
            new = b"".join(parts)
        else:
            new = raw
        bodies.append(put_leb(len(new)) + new)
    new_code = put_leb(count) + b"".join(bodies)
    counters = b"".join(b"\x7f\x01\x41\x00\x0b" for _ in range(counter))
    if blocks is None:
        labels = [f"cnt{ifuncs + i}" for i in range(count)]
    else:
        labels = [f"cnt{n}" for n in range(counter)]
    exports = b"".join(put_leb(len(n)) + n + b"\x03" + put_leb(first_counter + i)
                       for i, n in enumerate(x.encode() for x in labels))
    out = bytearray(wasm[:8])
    if not any(sid == 6 for sid, _ in secs):
        # A global section of none, where the order of sections wants it: before the exports
        # (and what follows them).
        at = next(i for i, (sid, _) in enumerate(secs) if sid in (7, 8, 9, 10, 11, 12))
        secs.insert(at, (6, put_leb(0)))
    if not any(sid == 7 for sid, _ in secs):
        at = next(i for i, (sid, _) in enumerate(secs) if sid in (8, 9, 10, 11, 12))
        secs.insert(at, (7, put_leb(0)))
    for sid, content in secs:
        if sid == 0:
            continue  # names and debug info: offsets would be stale
        if sid == 6:
            n, p = leb(content, 0)
            content = put_leb(n + counter) + content[p:] + counters
        elif sid == 7:
            n, p = leb(content, 0)
            content = put_leb(n + len(labels)) + content[p:] + exports
        elif sid == 10:
            content = new_code
        out += bytes([sid]) + put_leb(len(content)) + content
    return bytes(out), names, sizes, spans


LINE = 64


def hot_lines(regions: list[tuple[int, bool]]) -> set[int]:
    """The lines of LINE bytes, from a function's first byte of code, that the regions which
    ran touch: `regions` are (size, ran) in the function's order."""
    lines: set[int] = set()
    at = 0
    for size, ran in regions:
        if ran and size > 0:
            lines.update(range(at // LINE, (at + size - 1) // LINE + 1))
        at += size
    return lines


def lines_touched(regions: list[tuple[int, bool]]) -> int:
    """How many lines `hot_lines` finds."""
    return len(hot_lines(regions))


def cold_in_touched(regions: list[tuple[int, bool, int]]) -> list[tuple[int, int]]:
    """The code that did not run but sits in lines the code that ran touches: `regions` are
    (size, ran, address) in the function's order, lines counted from its first region as in
    `hot_lines`; each cold region that shares a line with code that ran, as (its address,
    its bytes inside such lines)."""
    hot = hot_lines([(size, ran) for size, ran, _ in regions])
    out, at = [], 0
    for size, ran, address in regions:
        if not ran and size > 0:
            inside = sum(min(at + size, (line + 1) * LINE) - max(at, line * LINE)
                         for line in range(at // LINE, (at + size - 1) // LINE + 1)
                         if line in hot)
            if inside:
                out.append((address, inside))
        at += size
    return out


def short_name(name: str) -> str:
    """A function's name without its modules' paths: `Worker<S>::settle`,
    `drop_in_place<Vec<u8, Global>>`."""
    return re.sub(r"\b[a-z_][a-z0-9_]*::", "", name)


def short_path(path: str) -> str:
    """A source file as the table names it: the standard library's from its crate
    (`core/src/...`), a dependency's from its crate directory (`sha2-0.10.9/src/...`), the
    project's from its root (`src/...`, `benches/...`)."""
    if "/library/" in path:
        return path.split("/library/", 1)[1]
    if "/registry/src/" in path:
        return path.split("/registry/src/", 1)[1].split("/", 1)[-1]
    root = str(wasm_profile.ROOT) + "/"
    return path[len(root):] if path.startswith(root) else path


def symbolized(output: str) -> list[tuple[str, str]]:
    """llvm-symbolizer's answers, one per address asked in order (`--inlining`: each answer
    a frame per function the address is inlined into, innermost first, then an empty line):
    each address's innermost frame as (function, file:line), the file as `short_path` names
    it."""
    out = []
    for block in output.strip("\n").split("\n\n"):
        lines = block.splitlines()
        function, where = (lines + ["??", "??:0:0"])[:2]
        path, line = where.rsplit(":", 2)[:2] if where.count(":") >= 2 else (where, "0")
        out.append((wasm_profile.HASH.sub("", function), f"{short_path(path)}:{line}"))
    return out


def symbolize(wasm: Path, addresses: list[int]) -> list[tuple[str, str]]:
    """Where each address of `wasm`'s code section comes from, by its line tables (Debian's
    llvm-symbolizer, `make deps-llvm`)."""
    if not addresses:
        return []
    out = subprocess.run(["llvm-symbolizer", f"--obj={wasm}", "--inlining", "--functions=linkage",
                          "--demangle"],
                         input="\n".join(hex(a) for a in addresses), text=True,
                         capture_output=True, check=True, timeout=600).stdout
    return symbolized(out)


def calls(runner: instructions.Runner, case: str, n: int) -> tuple[dict[int, int], list[str]]:
    """Each counter's count after a run of `case` with CORE_COUNT=n, by the number in its
    name; and the cases that ran."""
    store, instance, ran = runner.start(case, n)
    exports = instance.exports(store)
    return {int(name[3:]): exports[name].value(store) for name in exports
            if name.startswith("cnt")}, ran


def demangle(names: dict[int, str]) -> dict[int, str]:
    """Rust's symbols readable (binutils' c++filt reads both manglings), hashes left out."""
    keys = list(names)
    out = subprocess.run(["c++filt"], input="\n".join(names[k] for k in keys), text=True,
                         capture_output=True, check=True, timeout=60).stdout.splitlines()
    return {k: wasm_profile.HASH.sub("", re.sub(r"\[[0-9a-f]{16}\]", "", v))
            for k, v in zip(keys, out)}


def main() -> int:
    n = int(os.environ.get("N", "2000"))
    top = int(os.environ.get("TOP", "25"))
    cases = [c.strip() for c in os.environ.get("CASES", DEFAULT_CASES).split("|") if c.strip()]
    # SOURCES=1: where the code that did not run in the touched lines comes from.
    sources = os.environ.get("SOURCES", "") not in ("", "0")
    wasm = wasm_profile.build()
    raw = wasm.read_bytes()
    instrumented, names, sizes, _ = instrument(raw)
    names = demangle(names)
    runner = instructions.Runner(instrumented)
    for case in cases:
        base, ran = calls(runner, case, 0)
        if not ran:
            print(f"no case matches {case!r}", file=sys.stderr)
            return 2
        after, _ = calls(runner, case, n)
        per = {f: (after[f] - base.get(f, 0)) / n for f in after if after[f] > base.get(f, 0)}
        # The same functions again, a counter per region of straight-line code.
        blocked, _, _, spans = instrument(raw, set(per))
        blocks = instructions.Runner(blocked)
        bbase, _ = calls(blocks, case, 0)
        bafter, _ = calls(blocks, case, n)
        ran_bytes = {f: sum(size * min((bafter[c] - bbase.get(c, 0)) / n, 1.0)
                            for c, size, _ in spans[f] if bafter[c] > bbase.get(c, 0))
                     for f in per}
        # Regions that ran in at least half the requests, and the lines they touch.
        hot = {f: [(size, 2 * (bafter[c] - bbase.get(c, 0)) >= n, address)
                   for c, size, address in spans[f]]
               for f in per}
        lines = {f: lines_touched([(size, ran) for size, ran, _ in hot[f]]) for f in per}
        funcs = sum(min(c, 1.0) for c in per.values())
        size = sum(min(c, 1.0) * sizes.get(f, 0) for f, c in per.items())
        print(f"\n{', '.join(ran)} ({n} runs):")
        print(f"  per request: {funcs:.0f} functions, {sum(per.values()):.0f} calls; their code "
              f"{size / 1024:.1f} KiB of Wasm, of which {sum(ran_bytes.values()) / 1024:.1f} KiB "
              f"ran, in {sum(lines.values())} lines of {LINE} bytes")
        print(f"  {'ran B':>7} {'lines':>5} {'size B':>7} {'calls':>6}  function")
        for f in sorted(per, key=lambda f: -ran_bytes[f])[:top]:
            print(f"  {ran_bytes[f]:>7.0f} {lines[f]:>5} {sizes.get(f, 0):>7} {per[f]:>6.2f}  "
                  f"{names.get(f, f'#{f}')[:110]}")
        if sources:
            cold_sources(wasm, hot, lines, names, top)
    return 0


def cold_sources(wasm: Path, hot: dict[int, list[tuple[int, bool, int]]],
                 lines: dict[int, int], names: dict[int, str], top: int) -> None:
    """Prints the code that does not run (in half the requests or more) but sits in the lines
    that the code which runs touches, by the source it was compiled from (the innermost
    function inlined there)."""
    cold = [(f, address, inside) for f in hot for address, inside in cold_in_touched(hot[f])]
    where = symbolize(wasm, [address for _, address, _ in cold])
    by_source: dict[tuple[str, str], list] = {}
    for (f, _, inside), (function, place) in zip(cold, where):
        entry = by_source.setdefault((function, place), [0, set()])
        entry[0] += inside
        entry[1].add(short_name(names.get(f, f"#{f}")))
    total = sum(inside for _, _, inside in cold)
    touched = LINE * sum(lines.values())
    print(f"  code that did not run, in those lines: {total} B of {touched} B; by the source "
          "it comes from:")
    print(f"  {'cold B':>7}  source (innermost function)  in")
    for (function, place), (inside, into) in sorted(by_source.items(),
                                                    key=lambda kv: -kv[1][0])[:top]:
        print(f"  {inside:>7}  {place} ({short_name(function)[:60]})  in "
              f"{', '.join(sorted(into))[:80]}")


if __name__ == "__main__":
    sys.exit(main())
