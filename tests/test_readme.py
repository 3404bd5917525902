"""The README's first command, run the way a user runs it.

A copy of the tree as a clone has it (the files git tracks or would track) in
build/readme-clone/coordination-guard; from its root, with no variable but the one a user
would set, `make run` starts in the background. Once it prints its ready line, every command it
printed runs in the order printed, in one shell, as pasted (parsed from its output, never
rewritten), and each outcome the README and the captions promise is checked.

The copy keeps its `target/` between runs (a build, not a difference a user would see) and
shares this checkout's `.venv` (the same `make deps` made it). It uses the default ports, as a
user's `make run` does: a port in use fails the test with the demo's own message.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from harness.proc import ROOT, beyond_loopback
from test_demo import USER_PLUGIN

CLONE = ROOT / "build" / "readme-clone" / "coordination-guard"
def pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def fresh_clone() -> Path:
    """The tree as `git clone` of it would have it, plus the work tree's changes."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    CLONE.mkdir(parents=True, exist_ok=True)
    for entry in CLONE.iterdir():
        if entry.name != "target":
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            dst = CLONE / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)  # the times too: make sees the shared .venv as up to date
    (CLONE / ".venv").symlink_to(ROOT / ".venv")
    return CLONE


@pytest.fixture(scope="module")
def clone() -> Path:
    return fresh_clone()


def user_env() -> dict[str, str]:
    """A user's shell: none of the outer make's or pytest's variables."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("MAKE", "MFLAGS", "PYTEST", "CG_", "LOGS", "PLUGIN", "CLUSTER"))
            and not k.endswith("_PORT")}


class Shell:
    """One bash, fed one pasted line at a time; each line's output comes back on its own."""

    def __init__(self, cwd: Path):
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=cwd, env=user_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def run(self, command: str, timeout: float = 60) -> str:
        marker = f"__pasted_{secrets.token_hex(6)}__"
        self.proc.stdin.write(f"{command}\necho; echo {marker}\n")
        self.proc.stdin.flush()
        out, deadline = [], time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{command!r} still running after {timeout}s: {''.join(out)}")
            if line.strip() == marker:
                return "".join(out)
            out.append(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Demo:
    """`make run ARGS...` in the background, from the clone's root, until its ready line."""

    def __init__(self, cwd: Path, *args: str):
        self.proc = subprocess.Popen(["make", "run", *args], cwd=cwd, env=user_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.output: list[str] = []

    def ready(self, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while not (self.output and self.output[-1].startswith("pids: ")):
            line = self.proc.stdout.readline()
            assert line, f"make run ended before its ready line:\n{''.join(self.output)}"
            assert time.monotonic() < deadline, "".join(self.output)
            self.output.append(line)
        return "".join(self.output)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # Ctrl-C
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def tour(printed: str) -> list[tuple[str, list[str]]]:
    """The captions (lines ending in `:`) and the commands under each (indented by two), from
    the tour to the end of the output."""
    body = printed.split("coordination-guard demo is up\n", 1)[1].split("\n\n", 1)[1]
    steps: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("  ") and steps:
            steps[-1][1].append(line[2:])
        elif line.endswith(":") and not line.startswith(" "):
            steps.append((line, []))
    return steps


def paste(cwd: Path, steps: list[tuple[str, list[str]]], pause: float = 0) -> dict[str, list[str]]:
    """Every command, in order, in one shell, `pause` seconds apart (a human's pace): their
    outputs by caption."""
    shell = Shell(cwd)
    outputs: dict[str, list[str]] = {}
    try:
        for caption, commands in steps:
            for command in commands:
                time.sleep(pause)
                outputs.setdefault(caption, []).append(shell.run(command))
        return outputs
    finally:
        shell.close()


def step(outputs: dict[str, list[str]], start: str) -> list[str]:
    found = [v for k, v in outputs.items() if k.startswith(start)]
    assert len(found) == 1, (start, list(outputs))
    return found[0]


def status(output: str) -> int:
    m = re.search(r"^HTTP/1\.1 (\d{3})", output, re.M)
    assert m, output
    return int(m.group(1))


def check_rate_limit(out: list[str]) -> None:
    (both,) = out
    loop, last = both.split("\n", 1)
    codes = loop.split()
    assert codes[0] == "200" and codes[-1] == "429", loop
    assert status(last) == 429, last
    for header in ("retry-after: ", "ratelimit-policy: ", "ratelimit: "):
        assert header in last.lower(), last
    assert "application/problem+json" in last and "#quota-exceeded" in last, last


def check_lease(out: list[str], header: str = "x-fencing-token") -> None:
    second, fence = out
    assert status(second) == 409 and "resource_locked" in second, second
    assert re.search(rf'"{header}": "\d+"', fence), fence


def check_redis_gone(out: list[str]) -> None:
    down, while_down, up, after = out
    assert "Redis is down" in down, down
    assert status(while_down) == 503 and "guard_unavailable" in while_down, while_down
    assert "retry-after: 1" in while_down.lower(), while_down
    assert "Redis is up" in up, up
    assert status(after) == 200, after


def check_observability(outputs: dict[str, list[str]], prefix: str) -> None:
    (keys,) = step(outputs, "The keys in Redis")[:1]
    assert f"{prefix}:" in keys, keys
    stats, prometheus = step(outputs, "The filter's metrics")
    assert "wasmcustom.cg.redis.calls: " in stats, stats
    assert re.search(r"^cg_policy_limit_allowed\{cg_policy=", prometheus, re.M), prometheus
    (executed,) = step(outputs, "What the service actually executed")
    assert json.loads(executed)["total"] > 0, executed


def outputs_text(outputs: list[str]) -> str:
    return "".join(outputs)


def run_readme(cwd: Path, *args: str, again: str | None = None,
               pause: float = 0) -> tuple[str, dict[str, list[str]]]:
    """`make run ARGS`, then the tour as pasted; with `again`, the commands of the step whose
    caption starts so are pasted once more at the end (under the caption `again:`)."""
    demo = Demo(cwd, *args)
    try:
        printed = demo.ready()
        pids = [int(p.split("=")[1]) for p in printed.splitlines()[-1].split()[1:]]
        assert pids and all(pid_alive(p) for p in pids), printed
        wide = {pid: beyond_loopback(pid) for pid in pids}
        assert not any(wide.values()), f"listening beyond loopback: {wide}"
        steps = tour(printed)
        if again is not None:
            steps.append(("again:", next(cmds for caption, cmds in steps
                                         if caption.startswith(again))))
        return printed, paste(cwd, steps, pause)
    finally:
        demo.stop()


@pytest.mark.parametrize("args,pause", [((), 0), ((), 2.0), (("CLUSTER=1",), 0)],
                         ids=["at-once", "a-human's-pace", "cluster"])
def test_make_run_then_every_printed_command_as_pasted(clone, args, pause):
    """Pasted at once, or 2 s apart (every limit of the demo refills in that time)."""
    printed, outputs = run_readme(clone, *args, again="Idempotency", pause=pause)
    assert "LOGS=" not in printed, "the default needs no variable in what a user pastes"
    check_rate_limit(step(outputs, "Rate limit (create-order"))
    first, replay, other, executed = step(outputs, "Idempotency (create-order)")
    assert status(first) == 200 and "idempotent-replayed" not in first.lower(), first
    assert status(replay) == 200 and "idempotent-replayed: true" in replay.lower(), replay
    assert status(other) == 422 and "idempotency_key_conflict" in other, other
    assert executed.split() == ["1"], f"the service ran the key's request {executed!r} times"
    check_lease(step(outputs, "Lease (activate-order)"))
    check_redis_gone(step(outputs, "Redis gone (activate-order is fail_closed"))
    check_observability(outputs, "cg:demo")
    # The record and the fence were written before Redis went away and came back: the keys
    # are still there, and the idempotency step pasted again replays all three answers (the
    # first request's too) with the service still run once.
    keys = outputs_text(step(outputs, "The keys in Redis"))
    assert ":idem:" in keys and ":fence:" in keys, keys
    first, replay, other, executed = outputs["again:"]
    assert status(first) == 200 and "idempotent-replayed: true" in first.lower(), first
    assert status(replay) == 200 and "idempotent-replayed: true" in replay.lower(), replay
    assert status(other) == 422, other
    assert executed.split() == ["1"], executed


def test_make_run_with_a_users_plugin_file(clone):
    (clone / "my-plugin.json").write_text(json.dumps(USER_PLUGIN, indent=2))
    printed, outputs = run_readme(clone, "PLUGIN=my-plugin.json")
    assert "Idempotency" not in printed and "/orders" not in printed, printed
    check_rate_limit(step(outputs, "Rate limit (reports"))
    check_lease(step(outputs, "Lease (run-job)"))
    check_redis_gone(step(outputs, "Redis gone (run-job is fail_closed"))
    check_observability(outputs, "cg:demo")


def test_make_help_lists_every_variable_the_targets_take():
    """Every variable a target reads (the Makefile's own knobs, the demo's ports, what the
    benchmark and harness scripts read from the environment) is in `make help`."""
    makefile = (ROOT / "Makefile").read_text()
    defined = set(re.findall(r"^([A-Z][A-Z0-9_]*) *:?=", makefile, re.M))
    knobs = set(re.findall(r"^([A-Z][A-Z0-9_]*) *\?=", makefile, re.M))
    used = set(re.findall(r"\$\(([A-Z][A-Z0-9_]*)\)", makefile)) - defined - {"MAKEFILE_LIST"}
    ports = {f"{p}_PORT" for p in re.search(r"\$\(foreach p,([A-Z ]+),", makefile).group(1).split()}
    scripts = [*ROOT.glob("bench/*.py"), *ROOT.glob("tests/harness/*.py")]
    read = {name for path in scripts
            for name in re.findall(r"environ(?:\.get\(|\[)\"([A-Z][A-Z0-9_]*)\"", path.read_text())}
    wanted = used | knobs | ports | (read - {"MAKELEVEL"})
    shown = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, check=True).stdout
    listed = set(re.findall(r"^  (?:\x1b\[36m)?([A-Z][A-Z0-9_]*) ", shown, re.M))
    assert wanted <= listed, f"not in make help: {sorted(wanted - listed)}"
    assert {"LOGS", "PLUGIN", "CLUSTER", "ENVOY_BIN", "BENCH_ROUNDS"} <= listed


def test_the_readme_is_short_and_points_nowhere_a_clone_lacks():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"the README links to {target}, which is missing"
