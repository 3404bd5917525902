"""Small helpers the end-to-end suites share: run a request in a thread, poll a condition."""

from __future__ import annotations

import threading
import time


def in_thread(fn, *args, **kwargs):
    """Runs fn in a thread; returns a function that joins it and gives back its result."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def result(timeout: float = 20.0):
        t.join(timeout)
        assert not t.is_alive(), f"{fn} did not return within {timeout}s"
        if "error" in out:
            raise out["error"]
        return out["value"]

    return result


def wait_for(predicate, timeout: float, interval: float = 0.01):
    """Polls predicate until it is truthy or timeout passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
