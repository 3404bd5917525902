"""deploy/istio/wasmplugin.yaml in real Envoy, configured the way istiod configures it.

The test reads the WasmPlugin, applies the overrides an operator applies for another
environment (a kustomize patch would do the same), and derives the Envoy filter from it by
istiod's mapping (harness/istio.py), not by hand:

- `url` / `sha256`: the module served over HTTP by a real server process started here, and the
  SHA-256 of the .wasm (what `sha256` means for an http(s) url; for `oci://` it is the
  manifest digest `make oci` prints). Envoy fetches the module itself through
  `vm_config.code.remote` and an extra static cluster (in a mesh, istio-agent fetches it).
- `pluginConfig.redis`: `cluster` / `authority` of this test stack's webdis (in the mesh:
  `outbound|7379||webdis.redis.svc.cluster.local`), a fresh `key_prefix` under the stack's
  ACL, and the credential variable named by `authorization_env` set in Envoy's environment
  (in the mesh: the istio-proxy container's, from a Secret).
- Prometheus tags: the `stats_tags` of deploy/istio/stats-bootstrap.yaml replace the
  template's, as Istio's bootstrap override adds them to the sidecar's bootstrap.

Observed with Envoy 1.40 (asserted below): the module is fetched once and loads; with a wrong
`sha256` Envoy fetches the module, refuses it (`data is invalid` at debug level), retries once,
logs `Retry limit exceeded for fetching data from remote data source` and `Plugin configured to
fail closed failed to load`, and still starts the listener: every request then gets an empty
`503` and never reaches the service (FAIL_CLOSE); with FAIL_OPEN the same requests pass
unguarded (Envoy logs "Plugin configured to fail closed failed to load" in both cases).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
import time
import uuid

import pytest
import yaml

from harness.envoy import DEFAULT_WASM, Envoy
from harness.istio import istiod_wasm_filter, ModuleServer
from harness.proc import ROOT

ISTIO = ROOT / "deploy" / "istio"
MODULE = "coordination_guard.wasm"
FETCH_CLUSTER = "wasm_modules"


def wasmplugin() -> dict:
    return yaml.safe_load((ISTIO / "wasmplugin.yaml").read_text())


def stats_tags() -> list[dict]:
    configmap = yaml.safe_load((ISTIO / "stats-bootstrap.yaml").read_text())
    return json.loads(configmap["data"]["custom_bootstrap.json"])["stats_config"]["stats_tags"]


def operator_overrides(plugin: dict, stack, url: str, sha256: str, **spec) -> dict:
    plugin = copy.deepcopy(plugin)
    plugin["spec"].update(url=url, sha256=sha256, **spec)
    redis = plugin["spec"]["pluginConfig"]["redis"]
    target = stack.redis_section(key_prefix=f"cg:istio:{uuid.uuid4().hex[:8]}")
    redis.update(cluster=target["cluster"], authority=target["authority"], key_prefix=target["key_prefix"])
    return plugin


@pytest.fixture
def mesh(stack_factory, tmp_path):
    """The stack (Redis, ACL'd webdis, counting upstream) and a module server."""
    stack = stack_factory(None, envoys=0)
    modules = tmp_path / "modules"
    modules.mkdir()
    shutil.copy(DEFAULT_WASM, modules / MODULE)
    server = ModuleServer(tmp_path / "module-server", modules).start()
    yield stack, server
    server.stop()


def sidecar(stack, server, plugin: dict, name: str) -> Envoy:
    """An Envoy on the stack whose guard filter is istiod's rendering of `plugin`."""
    env_name = plugin["spec"]["pluginConfig"]["redis"]["authorization_env"]
    envoy = stack.new_envoy(stack.workdir / name, {"redis": {}}, extra_clusters={FETCH_CLUSTER: server.port},
                            process_env={env_name: stack.webdis.authorization})
    hcm = envoy.config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    index = next(i for i, f in enumerate(filters) if f["name"] == "coordination-guard")
    filters[index] = istiod_wasm_filter(plugin, FETCH_CLUSTER)
    envoy.config["stats_config"]["stats_tags"] = stats_tags()
    stack.envoys.append(envoy)  # stopped with the stack
    return envoy


def fetches(server: ModuleServer) -> list[str]:
    return re.findall(rf'"GET /{MODULE} HTTP/1.1" (\d+)', server.log_text())


def order(envoy, user: str, **headers):
    return envoy.request("POST", "/orders", headers={"x-tenant-id": "acme", "x-user-id": user,
                                                     "content-type": "application/json", **headers},
                         body=b'{"item": "book"}', timeout=15)


def test_the_wasmplugin_runs_in_envoy_as_istiod_renders_it(mesh):
    stack, server = mesh
    sha = hashlib.sha256(DEFAULT_WASM.read_bytes()).hexdigest()
    plugin = operator_overrides(wasmplugin(), stack, server.url(MODULE), sha)
    rendered = istiod_wasm_filter(plugin, FETCH_CLUSTER)["typed_config"]["config"]
    assert (rendered["name"], rendered["root_id"], rendered["failure_policy"]) == \
        ("orders.coordination-guard", "coordination-guard", "FAIL_CLOSED")
    assert rendered["vm_config"]["environment_variables"]["host_env_keys"] == ["CG_GATEWAY_AUTHORIZATION"]
    assert "allow_on_headers_stop_iteration" not in rendered

    envoy = sidecar(stack, server, plugin, "sidecar").start()
    assert fetches(server) == ["200"]
    assert envoy.stat("wasm.remote_load_fetch_successes") == 1
    assert "coordination-guard: configuration loaded" in envoy.log_text()

    # The demo's user-burst limit (token bucket, 2/s, burst 3): the 4th quick request of one
    # user is over it (refills within these few ms are at most one token: allow 3 or 4).
    responses = [order(envoy, "alice") for _ in range(6)]
    statuses = [r.status for r in responses]
    assert statuses[:3] == [200, 200, 200] and 429 in statuses[3:], statuses
    rejected = responses[statuses.index(429)]
    assert rejected.json()["type"].endswith("rate_limited")
    assert rejected.headers["ratelimit"].startswith('"user-burst"')
    assert envoy.stat("wasmcustom.cg.policy.create-order.limit.user-burst.rejected") == statuses.count(429)
    assert stack.upstream.count("POST", "/orders") == statuses.count(200)

    # Idempotency as the WasmPlugin configures it (no body fingerprint, complete: sync): no
    # request headers held (Envoy would never resume them without
    # allow_on_headers_stop_iteration), the response copied as it passes and only its end held
    # until the record is written: answered at once, and an immediate retry replays it.
    first = order(envoy, "bob", **{"idempotency-key": '"order-1"'})
    assert first.status == 200 and first.elapsed < 5, first
    again = order(envoy, "bob", **{"idempotency-key": '"order-1"'})
    assert again.status == 200 and again.headers.get("idempotent-replayed") == "true", again
    assert again.body == first.body and again.elapsed < 5
    assert stack.upstream.count("POST", "/orders") == statuses.count(200) + 1

    # The credential only by name in the config; the policy/limit tags reach Prometheus.
    dump = envoy.admin_get("/config_dump")
    assert "CG_GATEWAY_AUTHORIZATION" in dump and stack.webdis.authorization.split()[1] not in dump
    samples = envoy.prometheus_samples()
    assert samples['cg_policy_limit_rejected{cg_policy="create-order",cg_limit="user-burst"}'] >= 1
    assert samples['cg_policy_limit_allowed{cg_policy="create-order",cg_limit="tenant"}'] >= 3
    assert envoy.stat("wasmcustom.cg.redis.errors") == 0


@pytest.mark.parametrize("fail_strategy, expected", [("FAIL_CLOSE", 503), ("FAIL_OPEN", 200)])
def test_a_wrong_sha256_keeps_the_module_out(mesh, fail_strategy, expected):
    stack, server = mesh
    wrong = hashlib.sha256(b"not the module").hexdigest()
    plugin = operator_overrides(wasmplugin(), stack, server.url(MODULE), wrong, failStrategy=fail_strategy)
    envoy = sidecar(stack, server, plugin, f"sidecar-{fail_strategy}").start()

    # Envoy fetched the right bytes (200, once plus one retry) and refused them for the hash.
    assert fetches(server) == ["200", "200"]
    log = envoy.log_text()
    assert "Retry limit exceeded for fetching data from remote data source" in log
    assert "Plugin orders.coordination-guard failed to load" in log
    assert "configuration loaded" not in log
    assert envoy.stat("wasm.remote_load_fetch_failures") == 1
    assert envoy.stat("wasm.remote_load_fetch_successes") == 0

    responses = [order(envoy, "alice") for _ in range(3)]
    assert [r.status for r in responses] == [expected] * 3
    # Envoy 1.40 logs "Plugin configured to fail closed failed to load" with FAIL_OPEN too:
    # the status of the requests, not that line, tells which policy applied.
    if fail_strategy == "FAIL_CLOSE":
        assert all(r.body == b"" for r in responses)
        assert stack.upstream.count("POST", "/orders") == 0
    else:
        # Unguarded: no policy ran, nothing in Redis.
        assert stack.upstream.count("POST", "/orders") == 3
        assert "ratelimit-policy" not in responses[0].headers
    assert stack.redis.keys("cg:istio:*") == []


def test_the_envoyfilter_variant_fingerprints_bodies(mesh):
    """body-fingerprints/envoyfilter.yaml's extension config (what ECDS hands the sidecar) in
    real Envoy, with the same operator overrides: with allow_on_headers_stop_iteration the
    demo's body fingerprint and sync completion work (no 408, no held response)."""
    stack, server = mesh
    envoyfilter = yaml.safe_load((ISTIO / "body-fingerprints" / "envoyfilter.yaml").read_text())
    value = copy.deepcopy(envoyfilter["spec"]["configPatches"][0]["patch"]["value"])
    config = value["typed_config"]["config"]
    remote = config["vm_config"]["code"]["remote"]
    remote["http_uri"].update(uri=server.url(MODULE), cluster=FETCH_CLUSTER)
    remote["sha256"] = hashlib.sha256(DEFAULT_WASM.read_bytes()).hexdigest()
    plugin_config = json.loads(config["configuration"]["value"])
    target = stack.redis_section(key_prefix=f"cg:istio:{uuid.uuid4().hex[:8]}")
    plugin_config["redis"].update(cluster=target["cluster"], authority=target["authority"],
                                  key_prefix=target["key_prefix"])
    config["configuration"]["value"] = json.dumps(plugin_config)
    idem = next(p for p in plugin_config["policies"] if "idempotency" in p)["idempotency"]
    assert idem["fingerprint"][-1] == "body"

    env_name = plugin_config["redis"]["authorization_env"]
    envoy = stack.new_envoy(stack.workdir / "sidecar-ef", {"redis": {}}, extra_clusters={FETCH_CLUSTER: server.port},
                            process_env={env_name: stack.webdis.authorization})
    filters = envoy.config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    index = next(i for i, f in enumerate(filters) if f["name"] == "coordination-guard")
    filters[index] = {"name": value["name"], "typed_config": value["typed_config"]}
    stack.envoys.append(envoy)
    envoy.start()

    key = {"idempotency-key": '"order-7"'}
    first = order(envoy, "carol", **key)
    again = order(envoy, "carol", **key)  # sync: the record is written before the response
    other_body = envoy.request("POST", "/orders", body=b'{"item": "pen"}', headers={
        "x-tenant-id": "acme", "x-user-id": "carol", "content-type": "application/json", **key})
    assert first.status == 200 and first.elapsed < 5, first
    assert again.status == 200 and again.headers.get("idempotent-replayed") == "true"
    assert other_body.status == 422 and other_body.json()["type"].endswith("idempotency_key_conflict")
    assert stack.upstream.count("POST", "/orders") == 1
