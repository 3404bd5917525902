"""A server of the harness run as a child Python process on a kernel-chosen loopback port.

The child prints one line `<banner><scheme>127.0.0.1:<port>` once it listens; the parent reads
the port from the child's log, waits until the port answers, and stops the child by its pid.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .proc import NotConfigured, Proc, beyond_loopback, wait_for_port


def start_child(name: str, script: str | Path, workdir: Path, banner: str, port: int = 0,
                timeout: float = 10.0) -> tuple[Proc, int]:
    """Starts `python -u script --port <port>` and returns (its Proc, the port it announced).

    The log is appended to across starts in one workdir: only what this start writes counts.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    old_log = workdir / f"{name}.log"
    skip = old_log.stat().st_size if old_log.exists() else 0
    proc = Proc(name, [sys.executable, "-u", str(script), "--port", str(port)], workdir)
    try:
        deadline = time.monotonic() + timeout
        while True:
            announced = [int(line.rsplit(":", 1)[1]) for line in proc.log_text()[skip:].splitlines()
                         if line.startswith(banner)]
            if announced:
                break
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{proc.log_tail()}")
            time.sleep(0.05)
        wait_for_port(announced[0], max(0.1, deadline - time.monotonic()), proc.popen)
        outside = beyond_loopback(proc.pid)
        if outside:
            raise NotConfigured(f"{name} listens on {', '.join(outside)}, beyond loopback")
    except Exception:
        proc.stop()
        raise
    return proc, announced[0]
