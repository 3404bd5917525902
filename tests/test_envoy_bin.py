"""`ENVOY_BIN` (e.g. `ENVOY_BIN=$(func-e which)`) is the Envoy that `make run`, `make test`
and `make bench` start: all of them go through harness.envoy.envoy_binary(). A wrapper
script stands in for func-e's binary here (func-e itself cannot be installed offline): it
records that it ran and execs the real Envoy.
"""

from __future__ import annotations

import os
import re
import stat

from harness import envoy as envoy_module
from harness.proc import ROOT


def test_envoy_bin_is_the_envoy_the_harness_starts(stack_factory, tmp_path, monkeypatch):
    real = envoy_module.envoy_binary()
    marker = tmp_path / "ran"
    wrapper = tmp_path / "envoy"
    wrapper.write_text(f'#!/bin/sh\necho "$@" > {marker}\nexec {real} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("ENVOY_BIN", str(wrapper))
    assert envoy_module.envoy_binary() == str(wrapper)

    stack = stack_factory(None, envoys=1)
    assert stack.envoy.request("GET", "/health").status == 200
    assert "--disable-hot-restart" in marker.read_text()
    assert os.path.realpath(f"/proc/{stack.envoy.proc.pid}/exe") == os.path.realpath(real)


def test_run_test_and_bench_all_start_envoy_through_envoy_binary():
    for path in ("tests/harness/demo.py", "bench/run.py"):
        source = (ROOT / path).read_text()
        assert re.search(r"from harness\.envoy import .*\b(spawn_envoy|envoy_binary|Envoy)\b", source) or \
            re.search(r"from \.envoy import .*\bspawn_envoy\b", source), path
        assert "get_envoy_path" not in source, path  # no path discovery of its own
