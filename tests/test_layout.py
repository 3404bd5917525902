"""The house's layers import downward only: no module of `src/` reaches, through `crate::`,
`super::` or `self::` paths, a module that reaches it back. Read from the source as text
(test modules at a file's end and test files left out: a test may use anything)."""

from __future__ import annotations

import re
from pathlib import Path

from harness.proc import ROOT

SRC = ROOT / "src"
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
# `use crate::a::{b, c::d}`: the names inside braces are modules or items under the prefix.
GROUP = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^{}]*)\}")


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


def targets(module: tuple[str, ...], is_dir: bool, text: str) -> set[tuple[str, ...]]:
    """The module paths this file names (longest first is resolved by the caller)."""
    found = set()
    base = {"crate": (), "self": module if is_dir else module[:-1],
            "super": (module[:-1] if is_dir else module[:-2])}

    def add(root: str, rest: str) -> None:
        found.add(base[root] + tuple(p for p in rest.split("::") if p))

    for root, prefix, inner in GROUP.findall(text):
        for item in inner.split(","):
            item = item.strip().split(" as ")[0].strip()
            if item and item != "self":
                add(root, f"{prefix}::{item}")
            elif item == "self":
                add(root, prefix)
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
