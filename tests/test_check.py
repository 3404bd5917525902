"""`make check PLUGIN=...`: the filter's own validation, natively, without Envoy.

Exit 0 with a summary for a valid configuration; exit 1 with exactly the error the filter logs
in Envoy (checked against real Envoy for the same file); exit 2 for a file it cannot read.
"""

from __future__ import annotations

import json
import subprocess

from harness.proc import ROOT

DEMO_PLUGIN = ROOT / "envoy" / "demo-plugin.json"


def make_check(plugin: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "check", f"PLUGIN={plugin}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def cg_check(plugin: str) -> subprocess.CompletedProcess:
    """The checker itself (make's own exit status is 2 for any failure)."""
    return subprocess.run(["cargo", "run", "--quiet", "--bin", "cg-check", "--", plugin], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_the_demo_config_is_valid_and_summarised():
    r = make_check(str(DEMO_PLUGIN))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith(f"{DEMO_PLUGIN}: valid\n"), out
    for want in ("redis: cluster redis_gateway", "policy 1 activate-order: POST, path /orders/*",
                 "lease on tenant + path_segment:2 (per tenant) for 10s, busy: 409",
                 "policy 2 create-order: POST, path /orders*",
                 "limit user-burst: 2 per 1s by tenant + principal (token bucket, burst 3)",
                 "idempotency: idempotency-key on POST (optional)",
                 "credential inline (shown in /config_dump: prefer authorization_env)"):
        assert want in out, (want, out)
    assert len(out.splitlines()) <= 30, "one screen"


def test_a_mistake_gives_the_filters_own_error_and_exit_1(tmp_path, stack_factory):
    plugin = json.loads(DEMO_PLUGIN.read_text())
    plugin["policies"][1]["rate_limits"][0]["window"] = "5x"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(plugin))
    r = cg_check(str(path))
    assert r.returncode == 1, (r.stdout, r.stderr)
    error = 'policies[1].rate_limits[0].window: "5x" is not a duration (use e.g. "250ms", "2s", "1m", "24h")'
    assert r.stderr.strip() == f"{path}: invalid plugin configuration: {error}", r.stderr
    made = make_check(str(path))
    assert made.returncode != 0 and f"invalid plugin configuration: {error}" in made.stderr
    # Envoy running the filter logs the same words.
    stack = stack_factory(None, envoys=0)
    plugin["redis"] = {**plugin["redis"], **stack.redis_section(key_prefix="cg:check")}
    code, log = stack.envoy_expect_failure(plugin)
    assert f"invalid plugin configuration: {error}" in log, log[-2000:]


def test_an_unreadable_file_is_exit_2(tmp_path):
    r = cg_check(str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "cannot read" in r.stderr, r.stderr
    r = subprocess.run(["make", "--no-print-directory", "check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "usage: make check PLUGIN=" in r.stdout + r.stderr
