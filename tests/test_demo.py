"""`make run` as a new user drives it: their own plugin configuration, other ports, the commands
it prints (derived from the config it runs), Redis taken away and brought back while it runs,
and a configuration mistake reported as just the filter's message.

Each test runs `make run` itself (deps and build are no-ops once done) on free loopback ports
with its own logs directory, and stops it by its pid (SIGINT, as Ctrl-C would).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from harness.proc import ROOT, free_port

DEMO_PLUGIN = json.loads((ROOT / "envoy" / "demo-plugin.json").read_text())
PORT_NAMES = ("envoy", "admin", "upstream", "webdis", "redis")
# A user's own configuration: a lease on /jobs/, a limit on /reports, other identity headers.
USER_PLUGIN = {**DEMO_PLUGIN,
               "identity": {"tenant_header": "x-org", "principal_header": "x-user",
                            "missing_tenant": "reject"},
               "policies": [
                   {"name": "run-job", "match": {"methods": ["PUT"], "path_prefix": "/jobs/"},
                    "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "5s"}},
                   {"name": "reports", "match": {"methods": ["POST"], "path_exact": "/reports"},
                    "rate_limits": [{"name": "org", "by": ["tenant"], "algorithm": "fixed_window",
                                     "limit": 4, "window": "1m"}]}]}


def make_run(tmp_path: Path, plugin: dict | None, *extra: str):
    ports = {name: free_port() for name in PORT_NAMES}
    argv = ["make", "--no-print-directory", "run", f"LOGS={tmp_path / 'logs'}",
            *[f"{name.upper()}_PORT={port}" for name, port in ports.items()], *extra]
    if plugin is not None:
        path = tmp_path / "plugin.json"
        path.write_text(json.dumps(plugin))
        argv.append(f"PLUGIN={path}")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    return proc, ports


def read_until(proc: subprocess.Popen, done, timeout: float = 120) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while not (lines and done(lines[-1])):
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, "".join(lines)
        lines.append(line)
    return lines


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)  # the process group make started: make and the demo
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def post(port: int, path: str, headers: dict, method: str = "POST") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, (json.loads(body) if body.startswith(b"{") else {})
    finally:
        conn.close()


def test_make_run_with_an_own_config_prints_its_examples_and_survives_redis(tmp_path):
    """A user's config with a lease on /jobs/ and a limit on /reports: the printed commands use
    those paths and headers; `make demo-redis-down` gives fail-closed 503s, `-up` recovers."""
    plugin = USER_PLUGIN
    stale = tmp_path / "logs" / "envoy" / "envoy.log"
    stale.parent.mkdir(parents=True)
    stale.write_text("a line of an earlier run\n")
    proc, ports = make_run(tmp_path, plugin)
    try:
        lines = read_until(proc, lambda line: line.startswith("pids: "))
        text = "".join(lines)
        assert "an earlier run" not in stale.read_text(), "every run's logs start fresh"
        envoy = f"http://127.0.0.1:{ports['envoy']}"
        assert f"-X POST -H 'x-org: acme' -H 'x-user: alice' {envoy}/reports" in text, text
        assert "for i in $(seq 1 5)" in text  # limit 4 + 1, then one more shown whole
        # Each example as a caller of its own: none eats into another's limit.
        assert f"-X PUT -H 'x-org: initech' -H 'x-user: carol' -H 'x-upstream-delay-ms: 3000' " \
               f"{envoy}/jobs/1001" in text, text
        assert "Idempotency" not in text, "no idempotency policy, no idempotency example"
        assert "create-order" not in text and "/orders" not in text
        assert f"make demo-redis-down LOGS={tmp_path / 'logs'}" in text, text

        org = {"x-org": "acme", "x-user": "alice"}
        assert [post(ports["envoy"], "/reports", org)[0] for _ in range(5)] == [200] * 4 + [429]
        env = {**os.environ, "LOGS": str(tmp_path / "logs")}
        subprocess.run(["make", "--no-print-directory", "demo-redis-down"], cwd=ROOT, env=env,
                       check=True, timeout=30, capture_output=True)
        read_until(proc, lambda line: line.startswith("demo: Redis stopped"), 30)
        status, body = post(ports["envoy"], "/jobs/7", org, "PUT")
        assert status == 503 and body["type"].endswith("#guard_unavailable"), body
        subprocess.run(["make", "--no-print-directory", "demo-redis-up"], cwd=ROOT, env=env,
                       check=True, timeout=30, capture_output=True)
        read_until(proc, lambda line: line.startswith("demo: Redis is back"), 30)
        deadline = time.monotonic() + 20
        while post(ports["envoy"], "/jobs/8", org, "PUT")[0] != 200:
            assert time.monotonic() < deadline, "the demo did not recover after demo-redis-up"
            time.sleep(0.2)
        assert proc.poll() is None, "the demo survives its Redis going away"
    finally:
        stop(proc)
    assert proc.returncode in (0, 2, -signal.SIGINT), proc.returncode


def test_a_config_mistake_is_reported_as_the_filters_message(tmp_path):
    plugin = {**DEMO_PLUGIN, "policies": [{"name": "x", "rate_limits": [
        {"name": "t", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1, "window": "5x"}]}]}
    proc, _ = make_run(tmp_path, plugin)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        stop(proc)
    assert proc.returncode != 0
    demo_lines = [line for line in out.splitlines() if line.startswith("demo: ")]
    assert demo_lines == [
        f"demo: {tmp_path / 'plugin.json'}: policies[0].rate_limits[0].window: \"5x\" is not a "
        "duration (use e.g. \"250ms\", \"2s\", \"1m\", \"24h\")"], out


@pytest.mark.parametrize("mutate,expect", [
    (lambda p: {**p, "redis": {**p["redis"], "cluster": "redis_gw"}},
     "redis.cluster must be 'redis_gateway' in the demo"),
    (lambda p: {**p, "redis": {**p["redis"], "key_prefix": "app"}},
     "redis.key_prefix 'app' is outside the demo gateway user's keys"),
])
def test_a_plugin_the_demo_cannot_serve_is_refused_before_anything_starts(tmp_path, mutate, expect):
    proc, _ = make_run(tmp_path, mutate(DEMO_PLUGIN))
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        stop(proc)
    assert proc.returncode != 0 and expect in out, out
    assert not (tmp_path / "logs" / "redis").exists(), "nothing was started"


def test_a_busy_port_names_the_make_variable(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        busy = s.getsockname()[1]
        proc, _ = make_run(tmp_path, None, f"REDIS_PORT={busy}")
        try:
            out, _ = proc.communicate(timeout=180)
        finally:
            stop(proc)
    assert proc.returncode != 0
    assert f"redis: 127.0.0.1:{busy} is in use" in out and f"make run REDIS_PORT={busy + 1}" in out, out
