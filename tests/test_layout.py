"""The house's layers import downward only: no module of `src/` reaches, through `crate::`,
`super::` or `self::` paths, a module that reaches it back, nor a module of a layer above its
own (`LAYERS`). Read from the source as text (test modules at a file's end and test files left
out: a test may use anything)."""

from __future__ import annotations

import re
from pathlib import Path

from harness.proc import ROOT

SRC = ROOT / "src"
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
# `use crate::a::{b, c::{d, e}}`: the names inside braces, at any depth, are modules or items
# under the prefix; the opening of such a group is found here, its end by counting braces.
GROUP = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{")


def module_of(path: Path, root: Path) -> tuple[str, ...]:
    parts = path.relative_to(root).with_suffix("").parts
    return parts[:-1] if parts[-1] in ("mod", "lib") else parts


def source_files(root: Path = SRC) -> dict[tuple[str, ...], Path]:
    files = {}
    for path in root.rglob("*.rs"):
        rel = path.relative_to(root)
        if rel.parts[0] == "bin" or path.stem.endswith("tests") or path.stem == "test_support":
            continue
        files[module_of(path, root)] = path
    return files


def without_tests(text: str) -> str:
    """The file's code before its test module (`#[cfg(test)]` followed by `mod`), without its
    comments (a doc link names a module, it does not import it)."""
    m = re.search(r"^\s*#\[cfg\(test\)\]\s*\n\s*(pub(\(crate\))?\s+)?mod\s+\w+\s*\{", text, re.M)
    code = text[:m.start()] if m else text
    return re.sub(r"//[^\n]*", "", code)


def group_paths(prefix: str, text: str, start: int) -> list[str]:
    """The paths of the use group whose text starts at `start` (after its `{`), under
    `prefix`: `a, b::{c, self}` under `::x` is `::x::a`, `::x::b::c` and `::x::b`."""
    depth, end = 1, start
    while end < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        end += 1
    inner = text[start:end - 1]
    items, depth, begin = [], 0, 0
    for i, c in enumerate(inner + ","):
        if c == "," and depth == 0:
            items.append(inner[begin:i].strip())
            begin = i + 1
        elif c in "{}":
            depth += 1 if c == "{" else -1
    paths = []
    for item in items:
        item = item.split(" as ")[0].strip()
        if "{" in item:
            head = item[:item.index("{")].rstrip(":").strip()
            paths += group_paths(f"{prefix}::{head}", item, item.index("{") + 1)
        elif item == "self":
            paths.append(prefix)
        elif item:
            paths.append(f"{prefix}::{item}")
    return paths


def targets(module: tuple[str, ...], is_dir: bool, text: str) -> set[tuple[str, ...]]:
    """The module paths this file names (longest first is resolved by the caller)."""
    found = set()
    base = {"crate": (), "self": module if is_dir else module[:-1],
            "super": (module[:-1] if is_dir else module[:-2])}

    def add(root: str, rest: str) -> None:
        found.add(base[root] + tuple(p for p in rest.split("::") if p))

    for m in GROUP.finditer(text):
        for rest in group_paths(m.group(2), text, m.end()):
            add(m.group(1), rest)
    for root, rest in PATH.findall(text):
        add(root, rest)
    return found


def graph(files: dict[tuple[str, ...], Path]) -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    edges: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for module, path in files.items():
        is_dir = path.stem in ("mod", "lib")
        out = set()
        for target in targets(module, is_dir, without_tests(path.read_text())):
            # The longest prefix that is a module of the house.
            for n in range(len(target), 0, -1):
                if target[:n] in files:
                    if target[:n] != module:
                        out.add(target[:n])
                    break
        edges[module] = out
    return edges


def circles(edges: dict[tuple[str, ...], set[tuple[str, ...]]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append("::".join(w) or "crate")
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_in_a_circle():
    found = circles(graph(source_files()))
    assert not found, f"modules that import one another in a circle: {found}"


def test_the_check_sees_a_circle(tmp_path):
    """A tree shaped like the circle this house had (config -> the record seal -> keys ->
    config, through a `use` group, a `super::` path and a plain path) is found; its test
    module's imports are not counted."""
    files = {
        "lib.rs": "pub mod config;\npub mod idempotency;\npub mod keys;\n",
        "config/mod.rs": "use crate::idempotency::{seal::Keyring, self};\n",
        "idempotency/mod.rs": "pub mod seal;\n",
        "idempotency/seal.rs": "fn f() { crate::keys::short_hash(); }\n",
        "keys.rs": "use crate::config::Policy;\n#[cfg(test)]\nmod tests {\n    use crate::idempotency::seal;\n}\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = circles(graph(source_files(tmp_path)))
    assert found == [["config", "idempotency::seal", "keys"]], found
    (tmp_path / "keys.rs").write_text("use crate::text::push;\n")
    assert circles(graph(source_files(tmp_path))) == []


# The layers, from the bottom: a module imports modules of its own layer and of the layers
# below it, never of a layer above. A layer is a list of module paths; a module is in the
# layer of the longest of them that is a prefix of its path (`guards::lease` is in `guards`).
# The idempotency record and its seal are the guards' domain types the scripts' contracts
# read (acquire.lua answers a completed record), so they sit below `redis`, the guards
# themselves above it.
LAYERS = [
    ["support"],
    ["config"],
    ["http"],
    ["guards::idempotency::record", "guards::idempotency::seal"],
    ["redis"],
    ["guards"],
    ["engine"],
    ["host", "admin"],
]


def layer_of(module: tuple[str, ...], layers: list[list[str]] = LAYERS) -> int | None:
    """The index of the module's layer, or None for a module in none (the crate root)."""
    best, best_len = None, -1
    for i, paths in enumerate(layers):
        for p in paths:
            prefix = tuple(p.split("::"))
            if module[:len(prefix)] == prefix and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def upward(edges: dict[tuple[str, ...], set[tuple[str, ...]]],
           layers: list[list[str]] = LAYERS) -> list[str]:
    """Every import of a module of a higher layer, as `from -> to`."""
    found = []
    for module, targets in edges.items():
        here = layer_of(module, layers)
        for target in targets:
            there = layer_of(target, layers)
            if here is not None and there is not None and there > here:
                found.append(f"{'::'.join(module)} -> {'::'.join(target)}")
    return sorted(found)


# Upward imports known and not removed yet: none. An entry here is a debt that only shrinks.
PENDING: set[str] = set()


def test_layers_import_downward_only():
    found = upward(graph(source_files()))
    new = [f for f in found if f not in PENDING]
    assert not new, f"modules that import a higher layer: {new}"
    gone = sorted(PENDING - set(found))
    assert not gone, f"upward imports that are gone, to take out of PENDING: {gone}"


def test_the_check_sees_an_upward_import(tmp_path):
    """A tree shaped like the configuration this house had (its idempotency section reading
    the key material of the record's seal, a guard) is refused; the seal reading the
    configuration, and a test module's imports, are not."""
    files = {
        "lib.rs": "pub mod config;\npub mod guards;\npub mod support;\n",
        "config/mod.rs": "mod idempotency;\n",
        "config/idempotency.rs": "use crate::{guards::idempotency::{seal::{Keyring, RecordKey}}};\n",
        "guards/mod.rs": "pub mod idempotency;\npub mod lease;\n",
        "guards/idempotency/mod.rs": "pub mod seal;\n",
        "guards/idempotency/seal.rs": "use crate::support::text;\n",
        "guards/lease.rs": "use super::idempotency::seal;\n",
        "support/mod.rs": "pub mod text;\n",
        "support/text.rs": "fn f() {}\n#[cfg(test)]\nmod tests {\n    use crate::config::Config;\n}\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    layers = [["support"], ["config"], ["guards"]]
    found = upward(graph(source_files(tmp_path)), layers)
    assert found == ["config::idempotency -> guards::idempotency::seal"], found
    (tmp_path / "config/idempotency.rs").write_text("pub struct Keyring;\n")
    (tmp_path / "guards/idempotency/seal.rs").write_text("use crate::config::Keyring;\n")
    assert upward(graph(source_files(tmp_path)), layers) == []
    # The longest path names the layer: the record is below the scripts, its guard above.
    record, acquire, guard = (("guards", "idempotency", "record"), ("redis", "scripts", "acquire"),
                              ("guards", "idempotency", "guard"))
    assert layer_of(record) < layer_of(acquire) < layer_of(guard)
