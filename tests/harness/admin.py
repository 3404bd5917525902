"""cg-admin, the operator's tool, as the suites run it: built once, called with a timeout."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

from .proc import ROOT


@functools.cache
def cg_admin_binary() -> Path:
    """The tool, built once per run (cargo prints where it put it)."""
    out = subprocess.run(["cargo", "build", "--quiet", "--bin", "cg-admin",
                          "--message-format=json"], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, check=True).stdout
    exes = [m["executable"] for m in map(json.loads, out.splitlines())
            if m.get("executable") and m["target"]["name"] == "cg-admin"]
    if not exes:
        raise RuntimeError(f"cargo built no cg-admin: {out[-2000:]}")
    return Path(exes[-1])


def run(config: Path, redis_url: str, *args: str, actor: str = "tester",
        timeout: float = 60) -> subprocess.CompletedProcess:
    """`cg-admin ARGS` on `config` and Redis at `redis_url`, with nothing else of this
    process's environment."""
    env = {"PATH": "/usr/bin:/bin", "CG_ADMIN_ACTOR": actor, "CG_ADMIN_CONFIG": str(config),
           "CG_ADMIN_REDIS_URL": redis_url}
    return subprocess.run([str(cg_admin_binary()), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
