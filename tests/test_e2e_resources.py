"""What the filter costs an Envoy that serves nothing yet: real Envoy, real Redis and webdis.

The over-limit cache's table (16 bytes a slot) is allocated by a worker on its first use, not
at configure time: Envoy runs one VM on the main thread that serves no requests and one per
worker, so an eager table cost every VM its full size at start (1M slots: about +43 MB with
two workers).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from harness.stack import Stack

TENANT_HEADER = "x-tenant-id"
SLOTS = 1_000_000


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def plugin(stack: Stack, entries: int) -> dict:
    return {"redis": stack.redis_section(key_prefix=f"cg:mem:{uuid.uuid4().hex[:8]}"),
            "identity": {"tenant_header": TENANT_HEADER, "missing_tenant": "reject"},
            "over_limit_cache": {"entries": entries},
            "policies": [{"name": "api", "match": {"path_prefix": "/api"}, "rate_limits": [
                {"name": "t", "by": ["tenant"], "algorithm": "fixed_window", "limit": 1,
                 "window": "1m"}]}]}


def test_the_over_limit_cache_costs_nothing_until_a_worker_uses_it(stack_factory):
    stack = stack_factory(None, envoys=0)
    small = stack.add_envoy(plugin(stack, 0))
    large = stack.add_envoy(plugin(stack, SLOTS))
    # Same binary, same config but the table size: the difference is what the table costs at
    # start. One eager table is 16 MB; three VMs (main thread + two workers) held 48 MB.
    extra = rss_bytes(large.proc.popen.pid) - rss_bytes(small.proc.popen.pid)
    assert extra < 12 * 1024 * 1024, f"{extra / 2**20:.1f} MiB more at start"
    # And the cache still works once a worker needs it.
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    statuses = [large.request("GET", "/api/x", headers={TENANT_HEADER: tenant}).status
                for _ in range(6)]
    assert statuses[0] == 200 and set(statuses[1:]) == {429}, statuses
    assert large.stat("wasmcustom.cg.over_limit_cache.hits") >= 3
