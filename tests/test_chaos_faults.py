"""The chaos target and its faults (chaos/target.py, chaos/faults.py, chaos/netproxy.py), on
the real stack: each fault is shown to have its effect on the filter's answers while it lasts,
and the target to be healthy again, requests answered by the service, once it healed.

The service behind the Envoys is the harness's counting upstream.
"""

from __future__ import annotations

import os
import urllib.request

import pytest

import chaos  # noqa: F401  (tests/ on sys.path, as for the chaos run)
from chaos.target import build_target
from harness.upstream import Upstream

TENANT_HEADER = "x-tenant-id"


def plugin(failure_mode: str = "fail_closed", timeout: str = "100ms") -> dict:
    """A rate limit that is never reached, so every answer but the service's is the fault's."""
    return {"redis": {"timeout": timeout, "key_prefix": "cg:chaos"},
            "identity": {"tenant_header": TENANT_HEADER},
            "policies": [{"name": "limited", "match": {"path_prefix": "/"},
                          "failure_mode": failure_mode,
                          "rate_limits": [{"name": "tenant", "by": ["tenant"],
                                           "algorithm": "fixed_window", "limit": 1_000_000,
                                           "window": "10s"}]}]}


def get(url: str, tenant: str = "acme", timeout: float = 5.0) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url + "/things", headers={TENANT_HEADER: tenant})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def pids(target) -> list[int]:
    procs = [n.proc for n in target.redis_nodes()] + [w.proc for w in target.webdis]
    procs += [target.netproxy.proc] + [e.proc for e in target.envoys]
    if target.cluster is not None:
        procs.append(target.cluster.proxy.proc)
    return [p.pid for p in procs if p is not None]


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def upstream(tmp_path):
    service = Upstream(tmp_path / "upstream").start()
    yield service
    service.stop()


def test_single_target_serves_through_both_envoys_and_stops_everything(tmp_path, upstream):
    target = build_target("single", tmp_path / "target", plugin(), upstream.port)
    started = pids(target)
    try:
        assert target.topology == "single"
        assert len(target.envoy_urls) == 2 and len(set(target.envoy_urls)) == 2
        for url in target.envoy_urls:
            status, headers, _ = get(url)
            # Answered by the service, and decided by Redis (the quota headers).
            assert status == 200 and "ratelimit-policy" in headers, (status, headers)
        assert upstream.count("GET", "/things") == 2
        # Redis holds the rate limit's counter under the target's key prefix.
        client = target.redis_client()
        try:
            assert any(k.startswith(b"cg:chaos:") for k in client.scan_iter(match="cg:chaos:*"))
        finally:
            client.close()
        assert all("panic" not in log for log in target.envoy_logs())
        assert len(started) == 5 and all(running(p) for p in started), started
    finally:
        target.stop()
    assert not [p for p in started if running(p)]
