"""End-to-end per-tenant limits at runtime: `cg-admin override` writes a tenant's (or a
principal's) own limit to Redis, and the filter in real Envoy counts that tenant's next
requests with it, with no configuration change: RateLimit-Policy shows the tenant's quota,
other tenants keep the configuration's, clearing restores it, an expiring override lapses, and
the over-limit cache lets a raised limit through within a refresh.

The tool runs as the operator runs it (the built binary, the plugin JSON the Envoys run, the
Redis admin's credentials), on a single Redis and on Redis Cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from harness.proc import ROOT
from test_e2e_ratelimit import (assert_problem, counters, plugin, post, quota, short_hash,
                                tenant_tag)

pytestmark = pytest.mark.topologies("single", "cluster")

POLICY = "orders"
REFRESH_S = 1.0  # overlimit.rs OVERRIDE_REFRESH_MS


@pytest.fixture(scope="module")
def cg_admin_binary():
    subprocess.run(["cargo", "build", "--quiet", "--bin", "cg-admin"], cwd=ROOT, check=True,
                   timeout=900)
    return ROOT / "target" / "debug" / "cg-admin"


class Admin:
    """cg-admin on `stack`'s Redis, as its admin, with the plugin configuration `config`."""

    def __init__(self, binary, stack, config: dict, workdir):
        path = workdir / "plugin.json"
        path.write_text(json.dumps(config))
        if stack.cluster is not None:
            port = stack.cluster.live_nodes()[0].port
            password = stack.cluster.admin_password
        else:
            port, password = stack.redis_server.port, stack.redis_server.admin_password
        self.binary = binary
        self.env = {**os.environ, "CG_ADMIN_CONFIG": str(path), "CG_ADMIN_ACTOR": "e2e",
                    "CG_ADMIN_REDIS_URL": f"redis://admin:{password}@127.0.0.1:{port}"}

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.binary), "--json", "override", *args], env=self.env,
                              capture_output=True, text=True, timeout=60)

    def limits(self, *args: str) -> dict:
        """`cg-admin limits` of the policy's request, in JSON."""
        r = subprocess.run([str(self.binary), "--json", "limits", "--policy", POLICY, *args],
                           env=self.env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def __call__(self, *args: str) -> dict:
        r = self.run(*args)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def set(self, tenant: str, quota: int, limit: str = "tenant", *more: str) -> dict:
        return self("set", "--policy", POLICY, "--limit", limit, "--tenant", tenant,
                    "--quota", str(quota), *more)

    def clear(self, tenant: str, limit: str = "tenant", *more: str) -> dict:
        return self("clear", "--policy", POLICY, "--limit", limit, "--tenant", tenant, *more)


def stack_with(stack_factory, tmp_path, binary, *limits: dict):
    stack = stack_factory(None, envoys=0)
    config = plugin(stack, [{"name": POLICY, "match": {"path_prefix": "/orders"},
                             "rate_limits": list(limits)}])
    stack.add_envoy(config)
    return stack, Admin(binary, stack, config, tmp_path)


def limit(name: str = "tenant", n: int = 2, window: str = "60s", by=("tenant",), **extra):
    return {"name": name, "by": list(by), "algorithm": "fixed_window", "limit": n,
            "window": window, "overrides": True, **extra}


def policy_of(resp) -> dict[str, tuple[int, int]]:
    """RateLimit-Policy as {name: (quota, window s)}."""
    return {name: (q, w) for name, q, w in quota(resp)[0]}


def statuses(envoy, n: int, **kw) -> list[int]:
    return [post(envoy, **kw).status for _ in range(n)]


def test_an_override_raises_and_lowers_a_tenants_limit(stack_factory, tmp_path, cg_admin_binary):
    stack, admin = stack_with(stack_factory, tmp_path, cg_admin_binary, limit(n=2))
    envoy = stack.envoy
    first = post(envoy)
    assert first.status == 200 and policy_of(first) == {"tenant": (2, 60)}

    raised = admin.set("acme", 5)
    assert raised["changed"] and raised["value"] == "5/60000"
    key = f"cg:e2e:ovr:{{{tenant_tag('acme')}}}:{POLICY}:tenant:t"
    assert raised["key"] == key and stack.redis.get(key) == b"5/60000"
    replies = [post(envoy) for _ in range(5)]
    assert [r.status for r in replies] == [200, 200, 200, 200, 429]
    for r in replies:
        assert policy_of(r) == {"tenant": (5, 60)}, r.headers
    assert_problem(replies[-1], 429, "rate_limited")

    # Another tenant keeps the configuration's limit.
    other = [post(envoy, tenant="globex") for _ in range(3)]
    assert [r.status for r in other] == [200, 200, 429]
    assert all(policy_of(r) == {"tenant": (2, 60)} for r in other)

    # Lowered below what the window counted: rejected with the new quota shown, once the last
    # 429's mark in the over-limit cache (with the quota it was counted with) lapsed.
    admin.set("acme", 1, "tenant", "--window", "2m")
    time.sleep(REFRESH_S + 0.2)
    lowered = post(envoy)
    assert lowered.status == 429 and policy_of(lowered) == {"tenant": (1, 120)}

    # Cleared: the configuration's again (still over it in this window).
    cleared = admin.clear("acme")
    assert cleared["changed"] and cleared["before"] == "1/120000"
    assert stack.redis.exists(key) == 0
    time.sleep(REFRESH_S + 0.2)  # the over-limit cache's marks of the lowered limit lapse
    back = post(envoy)
    assert back.status == 429 and policy_of(back) == {"tenant": (2, 60)}
    assert admin.clear("acme")["changed"] is False, "idempotent"
    assert stack.upstream.count("POST", "/orders") == 1 + 4 + 2


def test_a_principals_override_beats_its_tenants(stack_factory, tmp_path, cg_admin_binary):
    stack, admin = stack_with(stack_factory, tmp_path, cg_admin_binary,
                              limit("user", n=2, by=("tenant", "principal")),
                              limit("tenant", n=100))
    envoy = stack.envoy
    admin.set("acme", 3, "user")
    admin.set("acme", 1, "user", "--principal", "alice")
    assert statuses(envoy, 3, user="alice") == [200, 429, 429]
    assert statuses(envoy, 4, user="bob") == [200, 200, 200, 429]
    assert statuses(envoy, 3, tenant="globex", user="alice") == [200, 200, 429]
    assert policy_of(post(envoy, user="carol"))["user"] == (3, 60)
    listed = admin("list", "--policy", POLICY, "--tenant", "acme", "--principal", "alice")
    alice = "p." + short_hash("principal", b"alice")
    assert sorted((o["limit"], o["who"], o["value"]) for o in listed["overrides"]) == [
        ("user", alice, "1/60000"), ("user", "t", "3/60000")]
    # A limit counted per tenant only has no principal's override: refused, naming the field.
    r = admin.run("set", "--policy", POLICY, "--limit", "tenant", "--tenant", "acme",
                  "--principal", "alice", "--quota", "5")
    assert r.returncode == 1, r.stderr
    assert 'needs "principal" in policies[0].rate_limits[1].by' in r.stderr, r.stderr


def test_cg_admin_limits_shows_the_quota_the_caller_is_counted_with(stack_factory, tmp_path,
                                                                    cg_admin_binary):
    # limits reads the counters with the peek script and passes the override keys the filter
    # would pass: the tenant's for a limit per tenant, the principal's first for one per
    # principal.
    stack, admin = stack_with(stack_factory, tmp_path, cg_admin_binary,
                              limit("user", n=2, window="10s", by=("tenant", "principal"),
                                    algorithm="token_bucket", burst=3),
                              limit("tenant", n=2))
    envoy = stack.envoy
    admin.set("acme", 5)
    admin.set("acme", 4, "user", "--principal", "alice", "--window", "10s", "--burst", "6")
    resp = post(envoy, user="alice")
    assert resp.status == 200 and policy_of(resp) == {"user": (4, 10), "tenant": (5, 60)}
    got = {l["name"]: l for l in admin.limits("--tenant", "acme", "--principal", "alice")["limits"]}
    assert got["tenant"]["override"] == {"limit": 5, "window_ms": 60000, "burst": None}
    assert (got["tenant"]["capacity"], got["tenant"]["used"], got["tenant"]["remaining"]) == \
        (5, 1, 4)
    assert got["user"]["override"] == {"limit": 4, "window_ms": 10000, "burst": 6}
    assert got["user"]["capacity"] == 6 and got["user"]["remaining"] >= 5
    assert not got["user"]["override_unreadable"]
    # The RateLimit item limits shows is the filter's, with the tenant's own quota.
    assert got["tenant"]["ratelimit"].startswith('"tenant";r=4;')
    # Another principal of the tenant: the tenant's override only (the per-principal limit
    # has none for bob); another tenant: the configuration's.
    bob = {l["name"]: l for l in admin.limits("--tenant", "acme", "--principal", "bob")["limits"]}
    assert bob["user"]["override"] is None and bob["user"]["capacity"] == 3
    assert bob["tenant"]["override"]["limit"] == 5
    other = {l["name"]: l for l in admin.limits("--tenant", "globex")["limits"]}
    assert other["tenant"]["override"] is None and other["tenant"]["capacity"] == 2
    text = subprocess.run([str(admin.binary), "limits", "--policy", POLICY, "--tenant", "acme",
                           "--principal", "alice"], env=admin.env, capture_output=True,
                          text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert "4 per 10s, burst 6 (the caller's own, an override)" in text.stdout, text.stdout
    assert "5 per 1m (the caller's own, an override)" in text.stdout, text.stdout


def test_an_expiring_override_lapses(stack_factory, tmp_path, cg_admin_binary):
    stack, admin = stack_with(stack_factory, tmp_path, cg_admin_binary, limit(n=2))
    envoy = stack.envoy
    assert admin.set("acme", 10, "tenant", "--ttl", "1s")["ttl_ms"] == 1000
    assert policy_of(post(envoy)) == {"tenant": (10, 60)}
    time.sleep(1.3)
    assert policy_of(post(envoy)) == {"tenant": (2, 60)}
    listed = admin("list", "--policy", POLICY, "--tenant", "acme")
    assert [o["state"] for o in listed["overrides"]] == ["expired"]
    assert admin("list", "--policy", POLICY, "--tenant", "acme")["overrides"] == [], "pruned"


def test_the_over_limit_cache_lets_a_raised_limit_through_within_a_refresh(
        stack_factory, tmp_path, cg_admin_binary):
    stack, admin = stack_with(stack_factory, tmp_path, cg_admin_binary, limit(n=2))
    envoy = stack.envoy
    assert statuses(envoy, 3) == [200, 200, 429]
    hits = envoy.stat("wasmcustom.cg.over_limit_cache.hits")
    assert statuses(envoy, 4) == [429] * 4
    assert envoy.stat("wasmcustom.cg.over_limit_cache.hits") > hits, "answered locally"
    admin.set("acme", 10)
    raised = time.monotonic()
    while post(envoy).status != 200:
        assert time.monotonic() - raised < REFRESH_S + 1.0, "still rejected past a refresh"
        time.sleep(0.05)

    # A lowered limit's rejections are cached with the tenant's quota, which they show, and
    # with the script's own wait.
    admin.set("globex", 1)
    assert statuses(envoy, 2, tenant="globex") == [200, 429]
    hits = envoy.stat("wasmcustom.cg.over_limit_cache.hits")
    cached = [post(envoy, tenant="globex") for _ in range(6)]
    assert envoy.stat("wasmcustom.cg.over_limit_cache.hits") > hits
    for r in cached:
        assert_problem(r, 429, "rate_limited")
        assert policy_of(r) == {"tenant": (1, 60)}, r.headers
        assert int(r.headers["retry-after"]) > 50, "the window's end, not the refresh's"


def test_a_leased_quota_takes_its_slices_from_the_tenants_limit(
        stack_factory, tmp_path, cg_admin_binary):
    stack, admin = stack_with(stack_factory, tmp_path, cg_admin_binary,
                              limit(n=1000, mode="leased"))
    envoy = stack.envoy
    admin.set("acme", 4)
    replies = [post(envoy) for _ in range(8)]
    assert [r.status for r in replies].count(200) == 4
    for r in replies:
        assert policy_of(r) == {"tenant": (4, 60)}, r.headers
    assert stack.upstream.count("POST", "/orders") == 4


def test_an_unreadable_override_is_ignored_and_counted(stack_factory, tmp_path, cg_admin_binary):
    stack, admin = stack_with(stack_factory, tmp_path, cg_admin_binary, limit(n=2))
    envoy = stack.envoy
    key = f"cg:e2e:ovr:{{{tenant_tag('acme')}}}:{POLICY}:tenant:t"
    stack.redis.set(key, "lots")
    stack.redis.sadd(f"cg:e2e:ovr:{{{tenant_tag('acme')}}}:{POLICY}:index", key)
    replies = [post(envoy) for _ in range(3)]
    assert [r.status for r in replies] == [200, 200, 429]
    assert all(policy_of(r) == {"tenant": (2, 60)} for r in replies)
    assert counters(envoy, f"cg.policy.{POLICY}.limit.tenant")["override_unreadable"] == 3
    listed = admin("list", "--policy", POLICY, "--tenant", "acme")
    assert [o["state"] for o in listed["overrides"]] == ["unreadable"]


def test_a_limit_without_overrides_is_refused(stack_factory, tmp_path, cg_admin_binary):
    plain = {"name": "plain", "by": ["tenant"], "algorithm": "fixed_window", "limit": 2,
             "window": "60s"}
    stack, admin = stack_with(stack_factory, tmp_path, cg_admin_binary, limit(n=2), plain)
    r = admin.run("set", "--policy", POLICY, "--limit", "plain", "--tenant", "acme",
                  "--quota", "5")
    assert r.returncode == 1
    assert "set policies[0].rate_limits[1].overrides to true" in r.stderr, r.stderr
    assert stack.redis.exists(f"cg:e2e:ovr:{{{tenant_tag('acme')}}}:{POLICY}:plain:t") == 0
    # The change log on stderr: who, what, the exact key, what was there.
    r = admin.run("set", "--policy", POLICY, "--limit", "tenant", "--tenant", "acme",
                  "--quota", "5")
    assert r.returncode == 0, r.stderr
    assert "cg-admin change by e2e: override set cg:e2e:ovr:{" in r.stderr, r.stderr
    assert r.stderr.rstrip().endswith("(before: absent)"), r.stderr
    assert policy_of(post(stack.envoy)) == {"tenant": (5, 60), "plain": (2, 60)}
