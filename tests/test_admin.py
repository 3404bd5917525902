"""`cg-admin`, the operator's tool (docs/admin.md), against the real stack: Envoy running the
filter, webdis, and Redis or Redis Cluster. After real traffic through Envoy the tool shows what
the filter's headers said; its changes (`limits --reset`, `record --delete`, `lease --release`)
take effect for the next request through Envoy, are logged and are idempotent; `explain` says
what Envoy did. Hostile input gets the filter's own answers or a usage error, a cluster node
that does not own a key's slot is followed (MOVED), a wrong password is exit 3.

One stack per topology serves the module (one Envoy, key prefix `cg:adm`); each test calls as a
tenant of its own, so no test sees another's counters, records or leases. The tool runs as a
built binary with a timeout; it reads the plugin JSON the Envoy runs, and in one test the
Envoy config itself.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

from harness.admin import cg_admin_binary, run
from harness.concurrency import in_thread, wait_for
from harness.proc import ADMIN_USER, ROOT
from harness.stack import Stack

pytestmark = pytest.mark.topologies("single", "cluster")

PREFIX = "cg:adm"
TENANT, USER = "x-tenant-id", "x-user-id"
POLICIES = [
    {"name": "run-job", "match": {"methods": ["POST"], "path_prefix": "/jobs/"},
     "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "10s", "on_busy": "reject",
               "extend": True}},
    {"name": "orders", "match": {"methods": ["POST"], "path_prefix": "/orders"},
     "rate_limits": [
         {"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window", "limit": 3,
          "window": "60s"},
         {"name": "user", "by": ["tenant", "principal"], "algorithm": "sliding_log", "limit": 5,
          "window": "60s"},
         {"name": "per-ip", "by": ["client_ip"], "algorithm": "fixed_window", "limit": 100000,
          "window": "1h", "shadow": True}],
     "idempotency": {"header": "idempotency-key", "required": False, "methods": ["POST"],
                     "fingerprint": ["method", "path", "body"]}},
    {"name": "reports", "match": {"methods": ["GET"], "path_prefix": "/reports"},
     "rate_limits": [
         {"name": "bucket", "by": ["tenant"], "algorithm": "token_bucket", "limit": 10,
          "window": "60s", "burst": 4},
         {"name": "sliding", "by": ["tenant"], "algorithm": "sliding_window", "limit": 10,
          "window": "60s"}]},
]
CHANGE_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ cg-admin change by tester: "
                         r"(reset|delete|release) (\S+) \(before: .+\)$", re.M)
STATE_ITEM = re.compile(r'"([A-Za-z0-9_-]+)";r=(\d+);t=(\d+)')


@pytest.fixture(scope="session")
def cg_admin() -> Path:
    return cg_admin_binary()


@pytest.fixture(scope="module")
def shared(tmp_path_factory, topology):
    workdir = tmp_path_factory.mktemp("admin-e2e")
    stack = Stack(workdir, None, envoys=0, **topology.stack_kwargs).start()
    config = {"redis": stack.redis_section(key_prefix=PREFIX, timeout="1s"),
              "identity": {"tenant_header": TENANT, "principal_header": USER,
                           "missing_tenant": "reject"},
              "policies": POLICIES}
    # Envoy hands the filter the path as sent (the filter's own refusal of a path with two
    # readings is what `explain` is compared with).
    stack.add_envoy(config, path_normalization=False)
    stack.plugin_path = workdir / "plugin.json"
    stack.plugin_path.write_text(json.dumps(config))
    yield stack
    stack.stop()


def admin_url(stack: Stack, port: int | None = None, password: str | None = None) -> str:
    """The admin user on the stack's Redis (a cluster's first live node unless `port`)."""
    if stack.cluster is not None:
        node_port, pw = stack.cluster.live_nodes()[0].port, stack.cluster.admin_password
    else:
        node_port, pw = stack.redis_server.port, stack.redis_server.admin_password
    return f"redis://{ADMIN_USER}:{password or pw}@127.0.0.1:{port or node_port}"


def tool(cg_admin: Path, stack: Stack, *args: str, url: str | None = None,
         config: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return run(config or stack.plugin_path, url or admin_url(stack), *args, timeout=timeout)


def tool_json(cg_admin, stack, *args, **kw) -> dict:
    r = tool(cg_admin, stack, "--json", *args, **kw)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout)


def changes(stderr: str) -> list[tuple[str, str]]:
    """The change log lines: (what, key)."""
    return CHANGE_LINE.findall(stderr)


def new_tenant() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def post(stack: Stack, path: str, tenant: str | None, user: str | None = None,
         headers: dict | None = None, body: bytes | None = None, timeout: float = 15.0):
    h = dict(headers or {})
    if tenant is not None:
        h[TENANT] = tenant
    if user is not None:
        h[USER] = user
    return stack.envoy.request("POST", path, headers=h, body=body, timeout=timeout)


def raw(stack: Stack, method: str, path: str, headers: dict) -> tuple[int, dict, dict]:
    """A request with its path exactly as written (no client normalises it)."""
    url = urlparse(stack.envoy.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=15)
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read())
    finally:
        conn.close()


def ratelimit(resp) -> dict[str, tuple[int, int]]:
    """The RateLimit header's items: name -> (remaining, reset s)."""
    return {n: (int(r), int(t)) for n, r, t in STATE_ITEM.findall(resp.headers["ratelimit"])}


def away_from_a_minute_end() -> None:
    """Sliding windows are aligned to Redis time (this machine's clock): a test that compares
    one across a few seconds starts well inside one."""
    left = 60 - time.time() % 60
    if left < 5:
        time.sleep(left + 0.05)


# --- limits ----------------------------------------------------------------------------------


def test_limits_show_what_the_headers_said_and_reset_takes_effect(cg_admin, shared):
    tenant = new_tenant()
    for _ in range(2):
        last = post(shared, "/orders", tenant, "alice")
        assert last.status == 200, last
    said = ratelimit(last)
    assert said["tenant"][0] == 1 and said["user"][0] == 3, said
    got = tool_json(cg_admin, shared, "limits", "--policy", "orders", "--tenant", tenant,
                    "--principal", "alice", "--client-ip", "127.0.0.1")
    limits = {limit["name"]: limit for limit in got["limits"]}
    for name in ("tenant", "user"):
        remaining, reset_s = said[name]
        limit = limits[name]
        assert limit["remaining"] == remaining, (name, limit, said)
        assert reset_s - 1 <= -(-limit["reset_ms"] // 1000) <= reset_s, (name, limit, said)
        assert limit["used"] == limit["limit"] - remaining == 2
        assert limit["ratelimit"].startswith(f'"{name}";r={remaining};t='), limit
        assert shared.redis.exists(limit["key"]) == 1, limit["key"]
    assert limits["per-ip"]["shadow"] and limits["per-ip"]["allowed"]

    # Used up: the next request would be rejected, as the tool says.
    assert post(shared, "/orders", tenant, "alice").status == 200
    got = tool_json(cg_admin, shared, "limits", "--policy", "orders", "--tenant", tenant,
                    "--principal", "alice", "--client-ip", "127.0.0.1")
    tenant_limit = got["limits"][0]
    assert (tenant_limit["remaining"], tenant_limit["allowed"]) == (0, False)
    assert tenant_limit["retry_after_ms"] >= 1

    # --reset deletes the counters of the request (here the two of the tenant; the address's
    # counts every tenant's), logged; a second run finds nothing.
    own = ("limits", "--policy", "orders", "--tenant", tenant, "--principal", "alice",
           "--client-ip", "127.0.0.1", "--limit", "tenant", "--limit", "user", "--reset")
    r = tool(cg_admin, shared, "--json", *own)
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout)
    assert [d["name"] for d in done["reset"]] == ["tenant", "user"], done
    assert done["changed"] and all(d["deleted"] for d in done["reset"]), done
    assert sorted(changes(r.stderr)) == sorted(("reset", d["key"]) for d in done["reset"])
    assert shared.redis.exists(limits["per-ip"]["key"]) == 1
    again = tool(cg_admin, shared, *own)
    assert again.returncode == 0 and changes(again.stderr) == [], again.stderr
    assert "nothing to reset" in again.stdout
    fresh = post(shared, "/orders", tenant, "alice")
    assert fresh.status == 200 and ratelimit(fresh)["tenant"][0] == 2, fresh


def test_limits_of_every_algorithm_read_as_the_headers(cg_admin, shared):
    away_from_a_minute_end()
    tenant = new_tenant()
    for _ in range(2):
        last = shared.envoy.request("GET", "/reports", headers={TENANT: tenant})
        assert last.status == 200, last
    said = ratelimit(last)
    text = tool(cg_admin, shared, "limits", "--policy", "reports", "--tenant", tenant)
    assert text.returncode == 0, text.stderr
    got = tool_json(cg_admin, shared, "limits", "--policy", "reports", "--tenant", tenant)
    for limit in got["limits"]:
        remaining, reset_s = said[limit["name"]]
        assert limit["remaining"] == remaining, (limit, said)
        assert reset_s - 1 <= -(-limit["reset_ms"] // 1000) <= reset_s, (limit, said)
        assert f"remaining  {remaining}\n" in text.stdout
        assert limit["key"] in text.stdout
    assert {limit["algorithm"]: limit["used"] for limit in got["limits"]} == \
        {"token_bucket": 2, "sliding_window": 2}


# --- record ----------------------------------------------------------------------------------


def test_record_shows_the_stored_answer_and_delete_takes_effect(cg_admin, shared):
    tenant, key = new_tenant(), f'"k-{uuid.uuid4().hex[:8]}"'
    headers = {"idempotency-key": key, "content-type": "application/json"}
    body = b'{"item": "book"}'
    first = post(shared, "/orders", tenant, headers=headers, body=body)
    assert first.status == 200, first
    args = ("record", "--policy", "orders", "--tenant", tenant, "--idempotency-key", key)
    got = tool_json(cg_admin, shared, *args)
    assert (got["state"], got["status"], got["sealed"]) == ("COMPLETED", 200, False), got
    assert got["fingerprint"].startswith("sha256:") and 0 < got["ttl_ms"] <= 86_400_000, got
    assert 0 <= got["age_ms"] < 30_000, got
    assert shared.redis.exists(got["key"]) == 1
    replay = post(shared, "/orders", tenant, headers=headers, body=body)
    assert replay.headers.get("idempotent-replayed") == "true", replay
    runs = shared.upstream.count("POST", "/orders")

    r = tool(cg_admin, shared, *args, "--delete")
    assert r.returncode == 0 and changes(r.stderr) == [("delete", got["key"])], r.stderr
    again = tool(cg_admin, shared, *args, "--delete")
    assert again.returncode == 0 and changes(again.stderr) == [], again.stderr
    assert "nothing to delete" in again.stdout
    rerun = post(shared, "/orders", tenant, headers=headers, body=body)
    assert rerun.status == 200 and "idempotent-replayed" not in rerun.headers, rerun
    assert shared.upstream.count("POST", "/orders") == runs + 1


def test_a_processing_record_is_deleted_only_with_force(cg_admin, shared):
    tenant, key = new_tenant(), f"k-{uuid.uuid4().hex[:8]}"
    slow = in_thread(post, shared, "/orders", tenant,
                     headers={"idempotency-key": key, "x-upstream-delay-ms": "3000"})
    args = ("record", "--policy", "orders", "--tenant", tenant, "--idempotency-key", key)
    seen = wait_for(lambda: tool_json(cg_admin, shared, *args)["state"] == "PROCESSING", 5, 0.1)
    assert seen, "the slow request's record never showed as PROCESSING"
    got = tool_json(cg_admin, shared, *args)
    assert len(got["owner"]) == 32 and got["status"] is None, got
    refused = tool(cg_admin, shared, *args, "--delete")
    assert refused.returncode == 1, refused
    assert "PROCESSING" in refused.stderr and "--force" in refused.stderr
    assert changes(refused.stderr) == [] and shared.redis.exists(got["key"]) == 1
    forced = tool(cg_admin, shared, *args, "--delete", "--force")
    assert forced.returncode == 0 and changes(forced.stderr) == [("delete", got["key"])]
    # The retry is no longer told the request is in progress: it runs.
    retry = post(shared, "/orders", tenant, headers={"idempotency-key": key})
    assert retry.status == 200, retry
    assert slow().status == 200


# --- lease -----------------------------------------------------------------------------------


def test_lease_shows_the_holder_and_release_frees_it_for_the_next_request(cg_admin, shared):
    tenant, job = new_tenant(), uuid.uuid4().hex[:8]
    path = f"/jobs/{job}/run"
    slow = in_thread(post, shared, path, tenant, headers={"x-upstream-delay-ms": "3000"})
    args = ("lease", "--policy", "run-job", "--tenant", tenant, "--resource", job)
    assert wait_for(lambda: tool_json(cg_admin, shared, *args)["held"], 5, 0.1)
    held = tool_json(cg_admin, shared, *args)
    assert len(held["owner"]) == 32 and 0 < held["ttl_ms"] <= 10_000, held
    first_token = int(held["fencing_token"])
    # The same lease, found from the request as the client sends it.
    same = tool_json(cg_admin, shared, "lease", "--tenant", tenant, "--method", "POST",
                     "--path", path)
    assert (same["key"], same["owner"]) == (held["key"], held["owner"])
    busy = post(shared, path, tenant)
    assert busy.status == 409, busy

    r = tool(cg_admin, shared, *args, "--release")
    assert r.returncode == 0 and changes(r.stderr) == [("release", held["key"])], r.stderr
    assert "never reset" in r.stdout and shared.redis.exists(held["fence_key"]) == 1
    after = post(shared, path, tenant)
    assert after.status == 200, after
    tokens = [int(e["headers"]["x-fencing-token"]) for e in shared.upstream.requests()
              if e["path"] == path and "x-fencing-token" in e["headers"]]
    assert tokens and tokens[-1] > first_token, tokens
    # The second request gave the lease back: nothing to release.
    again = tool(cg_admin, shared, *args, "--release")
    assert again.returncode == 0 and changes(again.stderr) == [], again.stderr
    assert "nothing to release" in again.stdout
    assert slow().status == 200


# --- explain ---------------------------------------------------------------------------------


def test_explain_names_the_keys_envoy_writes(cg_admin, shared):
    tenant, key = new_tenant(), f"k-{uuid.uuid4().hex[:8]}"
    got = tool_json(cg_admin, shared, "explain", "--method", "POST", "--path", "/orders",
                    "--tenant", tenant, "--principal", "bob", "--client-ip", "127.0.0.1",
                    "--idempotency-key", key)
    assert (got["policy"], got["answer"], got["not_matched"][0]["policy"]) == \
        ("orders", None, "run-job"), got
    resp = post(shared, "/orders", tenant, "bob", headers={"idempotency-key": key})
    assert resp.status == 200, resp
    assert sorted(ratelimit(resp)) == sorted(l["name"] for l in got["limits"] if not l["shadow"])
    for k in [l["key"] for l in got["limits"]] + [got["record"]["key"]]:
        assert shared.redis.exists(k) == 1, k
    job = uuid.uuid4().hex[:8]
    got = tool_json(cg_admin, shared, "explain", "--method", "POST", "--path", f"/jobs/{job}/run",
                    "--tenant", tenant)
    assert got["policy"] == "run-job" and got["limits"] == [], got
    assert post(shared, f"/jobs/{job}/run", tenant).status == 200
    assert shared.redis.exists(got["lease"]["fence_key"]) == 1
    none = tool_json(cg_admin, shared, "explain", "--path", "/elsewhere")
    assert (none["policy"], none["forwarded"]) == (None, True), none


@pytest.mark.parametrize("path,headers,status,problem", [
    ("/orders%2F", {TENANT: "acme"}, 400, "ambiguous_path"),
    ("/orders", {}, 401, "missing_tenant"),
    ("/orders", {TENANT: "acme", "idempotency-key": "a b"}, 400, "idempotency_key_invalid"),
    ("/jobs/", {TENANT: "acme"}, 400, "lease_resource_missing"),
], ids=["two-readings", "no-tenant", "bad-key", "no-resource"])
def test_explain_gives_the_answer_envoy_gives(cg_admin, shared, path, headers, status, problem):
    args = ["explain", "--method", "POST", "--path", path]
    for name, value in headers.items():
        args += ["--header", f"{name}: {value}"]
    got = tool_json(cg_admin, shared, *args)
    answer = got["answer"]
    assert (answer["status"], answer["problem"]) == (status, problem), got
    seen, _, body = raw(shared, "POST", path, headers)
    assert seen == status and body["type"].endswith(f"#{problem}"), body
    assert answer["detail"] == body["detail"]


# --- hostile input, the cluster, credentials -------------------------------------------------


def test_a_wrong_command_line_is_a_usage_error(cg_admin, shared):
    r = tool(cg_admin, shared, "limits", "--tenat", "acme")
    assert r.returncode == 2 and '"--tenat"' in r.stderr, r.stderr
    r = tool(cg_admin, shared, "limits", "--tenant", "a", "--tenant", "b", "--policy", "orders")
    assert r.returncode == 2 and "--tenant is given more than once" in r.stderr, r.stderr
    r = tool(cg_admin, shared, "limits", "--policy", "run-job", "--path", "/orders")
    assert r.returncode == 2 and 'matches policy "orders", not "run-job"' in r.stderr, r.stderr
    r = tool(cg_admin, shared, "limits", "--policy", "orders", "--path", "/orders%2F", "--method",
             "POST", "--tenant", "acme")
    assert r.returncode == 2 and "400 ambiguous_path" in r.stderr, r.stderr
    r = tool(cg_admin, shared, "record", "--policy", "orders", "--idempotency-key", "k")
    assert r.returncode == 2 and "401 missing_tenant" in r.stderr, r.stderr
    r = tool(cg_admin, shared, "limits", "--policy", "orders", "--tenant", "a", "--limit", "x")
    assert r.returncode == 2 and "its limits are tenant, user, per-ip" in r.stderr, r.stderr
    r = tool(cg_admin, shared, "bogus")
    assert r.returncode == 2 and "unknown command" in r.stderr, r.stderr


def test_the_envoy_config_is_read_as_make_check_reads_it(cg_admin, shared):
    tenant = new_tenant()
    from_json = tool_json(cg_admin, shared, "explain", "--policy", "orders", "--tenant", tenant)
    from_envoy = tool_json(cg_admin, shared, "explain", "--policy", "orders", "--tenant", tenant,
                           config=shared.envoy.config_path)
    assert from_json == from_envoy


@pytest.mark.topologies("cluster", reason="a single Redis owns every slot")
def test_a_node_that_does_not_own_the_slot_is_followed(cg_admin, shared):
    tenant = new_tenant()
    assert post(shared, "/orders", tenant, "carol").status == 200
    args = ("limits", "--policy", "orders", "--tenant", tenant, "--principal", "carol",
            "--client-ip", "127.0.0.1")
    key = tool_json(cg_admin, shared, *args)["limits"][0]["key"]
    owner = shared.cluster.master_for_slot(shared.redis.keyslot(key))
    other = next(port for port in shared.cluster.masters() if port != owner)
    got = tool_json(cg_admin, shared, *args, url=admin_url(shared, port=other))
    assert got["limits"][0]["remaining"] == 2, got


def test_a_wrong_password_is_exit_3_with_redis_s_words(cg_admin, shared):
    r = tool(cg_admin, shared, "limits", "--policy", "orders", "--tenant", "acme",
             url=admin_url(shared, password="not-the-password"))
    assert r.returncode == 3, r
    assert "WRONGPASS" in r.stderr and "not-the-password" not in r.stderr, r.stderr


def test_make_admin_runs_the_tool_and_says_when_there_is_no_demo(shared, tmp_path):
    env_base = {k: v for k, v in os.environ.items() if not k.startswith("CG_ADMIN_")}
    missing = subprocess.run(["make", "--no-print-directory", "admin", f"LOGS={tmp_path}",
                              "ARGS=limits --policy orders --tenant acme"], cwd=ROOT,
                             capture_output=True, text=True, timeout=600, env=env_base)
    assert missing.returncode == 2 and "no demo is running" in missing.stdout, missing
    ran = subprocess.run(["make", "--no-print-directory", "admin",
                          "ARGS=explain --policy orders --tenant 'a b' --json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**env_base, "CG_ADMIN_REDIS_URL": admin_url(shared),
                              "CG_ADMIN_CONFIG": str(shared.plugin_path)})
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["tenant"] == "a b"
