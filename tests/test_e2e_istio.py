"""deploy/istio's WasmPlugins in real Envoy, configured the way istiod configures them.

The test reads the WasmPlugin, applies the overrides an operator applies for another
environment (a kustomize patch would do the same), and derives the Envoy filters from it by
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

Where the filter goes follows istiod too: the orders sidecar (namespace orders, app=orders)
gets an inbound listener in front of the workload (what callers reach) and an outbound listener
to another service (payments, a second counting upstream: where the workload's own calls go),
each with the filters istiod gives its listener class. The shipped plugin's `match: [{mode:
SERVER}]` puts the guard on the inbound listener only: a request there is guarded (no tenant:
401; a user's burst ends in 429), a call the workload makes is not (no tenant header, the
payments service's own answer, no metric or gateway call of the guard). Without `match`
(Istio's CLIENT_AND_SERVER) the same outbound call gets the guard's 401: why the match is
shipped.

deploy/istio/gateway/ runs the same way on a gateway listener (class GATEWAY, which Istio counts
as CLIENT): the RequestAuthentication becomes jwt_authn (its keys given inline, as istiod inlines
what it fetched from `jwksUri`), the WasmPlugin the guard after it (phase AUTHZ), reading the
tenant and the user from the verified token's claims; a header a client sets changes nothing.

Observed with Envoy 1.40 (asserted below): the module is fetched once and loads; with a wrong
`sha256` Envoy fetches the module, refuses it (`data is invalid` at debug level), retries once,
logs `Retry limit exceeded for fetching data from remote data source` and `Plugin configured to
fail closed failed to load`, and still starts the listener: every request then gets an empty
`503` and never reaches the service (FAIL_CLOSE); with FAIL_OPEN the same requests pass
unguarded (Envoy logs "Plugin configured to fail closed failed to load" in both cases). At the
gateway, jwt_authn answers a token signed with another key `401 Jwt verification fails` and one
for another audience `403 Audiences in Jwt are not allowed`, before the guard.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
import re
import shutil
import time
import uuid

import pytest
import yaml

from harness import istio
from harness.envoy import DEFAULT_WASM, Envoy, Response
from harness.istio import istiod_wasm_filter, ModuleServer
from harness.proc import ROOT
from harness.upstream import Upstream
from harness.problems import is_problem

ISTIO = ROOT / "deploy" / "istio"
MODULE = "coordination_guard.wasm"
FETCH_CLUSTER = "wasm_modules"
PROBLEM = "application/problem+json"
ORDERS = istio.Proxy("orders", {"app": "orders"})
EDGE = istio.Proxy("istio-ingress", {istio.GATEWAY_NAME_LABEL: "edge"})
PAYMENTS = "payments.payments.svc.cluster.local"
INBOUND = "virtualInbound"
ROUTER = "envoy.filters.http.router"
# The shipped user-burst limit: a token bucket of 20 a second, 40 at once.
RATE, BURST = 20, 40


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


@pytest.fixture
def payments(tmp_path):
    """Another service of the mesh, which the orders workload calls: a counting upstream."""
    upstream = Upstream(tmp_path / "payments").start()
    yield upstream
    upstream.stop()


def module_sha256() -> str:
    return hashlib.sha256(DEFAULT_WASM.read_bytes()).hexdigest()


def proxy(stack, server, name: str, env_name: str, render) -> Envoy:
    """An Envoy on the stack whose listeners are `render(config)` of the harness config."""
    envoy = stack.new_envoy(stack.workdir / name, {"redis": {}}, extra_clusters={FETCH_CLUSTER: server.port},
                            process_env={env_name: stack.webdis.authorization})
    envoy.config = render(envoy.config)
    envoy.config["stats_config"]["stats_tags"] = stats_tags()
    stack.envoys.append(envoy)  # stopped with the stack
    return envoy


def sidecar(stack, server, plugin: dict, name: str, outbound: dict[str, int] | None = None) -> Envoy:
    """The orders workload's sidecar with `plugin` applied as istiod applies it: its inbound
    listener (the Envoy's first: `envoy.request` reaches it) in front of the stack's upstream,
    and an outbound listener per `outbound` service."""
    env_name = plugin["spec"]["pluginConfig"]["redis"]["authorization_env"]
    return proxy(stack, server, name, env_name, lambda config: istio.sidecar_config(
        config, [plugin], ORDERS, FETCH_CLUSTER, stack.upstream.port, outbound or {}))


def burst(send, cap: int = 4 * BURST) -> tuple[list[Response], float]:
    """Sends until the first 429 (at most `cap` requests): the answers, and the seconds taken."""
    start, responses = time.monotonic(), []
    while len(responses) < cap and (not responses or responses[-1].status != 429):
        responses.append(send())
    return responses, time.monotonic() - start


def assert_user_burst(responses: list[Response], elapsed: float) -> int:
    """The user-burst token bucket admitted the burst and what refilled meanwhile, then 429:
    how many it admitted."""
    statuses = [r.status for r in responses]
    allowed = len(statuses) - 1
    assert statuses[-1] == 429 and set(statuses[:-1]) == {200}, statuses
    assert BURST <= allowed <= BURST + RATE * elapsed + 1, (allowed, elapsed)
    rejected = responses[-1]
    assert rejected.headers["content-type"] == PROBLEM and is_problem(rejected.json(), "rate_limited")
    assert rejected.headers["ratelimit"].startswith('"user-burst"'), rejected.headers
    return allowed


def fetches(server: ModuleServer) -> list[str]:
    return re.findall(rf'"GET /{MODULE} HTTP/1.1" (\d+)', server.log_text())


def order(envoy, user: str, **headers):
    return envoy.request("POST", "/orders", headers={"x-tenant-id": "acme", "x-user-id": user,
                                                     "content-type": "application/json", **headers},
                         body=b'{"item": "book"}', timeout=15)


def test_the_wasmplugin_runs_in_envoy_as_istiod_renders_it(mesh):
    stack, server = mesh
    plugin = operator_overrides(wasmplugin(), stack, server.url(MODULE), module_sha256())
    rendered = istiod_wasm_filter(plugin, FETCH_CLUSTER)["typed_config"]["config"]
    assert (rendered["name"], rendered["root_id"], rendered["failure_policy"]) == \
        ("orders.coordination-guard", "coordination-guard", "FAIL_CLOSED")
    assert rendered["vm_config"]["environment_variables"]["host_env_keys"] == ["CG_GATEWAY_AUTHORIZATION"]
    assert "allow_on_headers_stop_iteration" not in rendered

    envoy = sidecar(stack, server, plugin, "sidecar").start()
    assert fetches(server) == ["200"]
    assert envoy.stat("wasm.remote_load_fetch_successes") == 1
    assert "coordination-guard: configuration loaded" in envoy.log_text()

    # The user-burst limit (token bucket, 20 a second, 40 at once): one user's quick orders
    # pass until the burst and what refilled meanwhile are spent, then 429.
    responses, elapsed = burst(lambda: order(envoy, "alice"))
    allowed = assert_user_burst(responses, elapsed)
    assert envoy.stat("wasmcustom.cg.policy.create-order.limit.user-burst.rejected") == 1
    assert stack.upstream.count("POST", "/orders") == allowed

    # Idempotency as the WasmPlugin configures it (no body fingerprint, complete: sync): no
    # request headers held (Envoy would never resume them without
    # allow_on_headers_stop_iteration), the response copied as it passes and only its end held
    # until the record is written: answered at once, and an immediate retry replays it.
    first = order(envoy, "bob", **{"idempotency-key": '"order-1"'})
    assert first.status == 200 and first.elapsed < 5, first
    again = order(envoy, "bob", **{"idempotency-key": '"order-1"'})
    assert again.status == 200 and again.headers.get("idempotent-replayed") == "true", again
    assert again.body == first.body and again.elapsed < 5
    assert stack.upstream.count("POST", "/orders") == allowed + 1

    # The credential only by name in the config; the policy/limit tags reach Prometheus.
    dump = envoy.admin_get("/config_dump")
    assert "CG_GATEWAY_AUTHORIZATION" in dump and stack.webdis.authorization.split()[1] not in dump
    samples = envoy.prometheus_samples()
    assert samples['cg_policy_limit_rejected{cg_policy="create-order",cg_limit="user-burst"}'] >= 1
    assert samples['cg_policy_limit_allowed{cg_policy="create-order",cg_limit="tenant"}'] >= BURST
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


# --- where the guard runs: the listener classes of a sidecar ------------------------------------

def guard_counters(envoy: Envoy) -> dict[str, int]:
    """The guard's own counters and the calls to its gateway cluster (webdis)."""
    stats = envoy.stats(filter=r"^wasmcustom\.cg\.")
    stats["gateway calls"] = envoy.stat("cluster.redis_gateway.upstream_rq_total")
    return stats


def payment(port: int, method: str = "POST") -> Response:
    """A call the orders workload makes to the payments service: no tenant or user header
    (the workload's own call), through its sidecar's outbound listener."""
    return istio.request(port, method, "/payments", headers={"content-type": "application/json"},
                         body=b'{"amount": 5}' if method == "POST" else None, timeout=15)


def test_the_shipped_plugin_guards_inbound_requests_and_not_the_workloads_own_calls(mesh, payments):
    stack, server = mesh
    plugin = operator_overrides(wasmplugin(), stack, server.url(MODULE), module_sha256())
    outbound = f"0.0.0.0_{payments.port}"
    envoy = sidecar(stack, server, plugin, "sidecar-directions", {PAYMENTS: payments.port})
    # istiod's placement: match mode SERVER is the inbound listener's class, not the outbound's.
    assert istio.http_filter_names(envoy.config, INBOUND) == ["orders.coordination-guard", ROUTER]
    assert istio.http_filter_names(envoy.config, outbound) == [ROUTER]
    envoy.start()
    port = istio.listener_port(envoy, outbound)

    # Inbound, what callers send the workload: guarded. No tenant: 401 problem+json.
    missing = envoy.request("POST", "/orders", headers={"content-type": "application/json"},
                            body=b'{"item": "book"}')
    assert missing.status == 401 and missing.headers["content-type"] == PROBLEM, missing
    assert missing.json()["type"].endswith("missing_tenant")
    assert envoy.stat("wasmcustom.cg.policy.create-order.missing_tenant") == 1
    # A user's burst ends in 429.
    responses, elapsed = burst(lambda: order(envoy, "alice"))
    allowed = assert_user_burst(responses, elapsed)
    assert stack.upstream.count("POST", "/orders") == allowed

    # Outbound, the workload's own calls: not guarded. No tenant header, the service's own
    # answer, and nothing of the guard: no counter moves, no call to its gateway.
    before = guard_counters(envoy)
    calls = [payment(port) for _ in range(3)] + [payment(port, "GET")]
    assert [r.status for r in calls] == [200] * 4, calls
    assert [r.json()["path"] for r in calls] == ["/payments"] * 4
    assert "ratelimit-policy" not in calls[0].headers
    assert (payments.count("POST", "/payments"), payments.count("GET", "/payments")) == (3, 1)
    assert guard_counters(envoy) == before
    assert stack.upstream.count("POST", "/orders") == allowed  # nothing went to the workload


def test_without_match_the_guard_refuses_the_workloads_own_calls(mesh, payments):
    """Istio's default for a WasmPlugin without `match` is CLIENT_AND_SERVER: the guard runs
    on the outbound listeners too, and the catch-all policy refuses the workload's calls to
    other services (401: they carry no tenant). What `match: [{mode: SERVER}]` prevents."""
    stack, server = mesh
    plugin = operator_overrides(wasmplugin(), stack, server.url(MODULE), module_sha256())
    del plugin["spec"]["match"]
    outbound = f"0.0.0.0_{payments.port}"
    envoy = sidecar(stack, server, plugin, "sidecar-no-match", {PAYMENTS: payments.port})
    assert istio.http_filter_names(envoy.config, outbound) == ["orders.coordination-guard", ROUTER]
    envoy.start()
    port = istio.listener_port(envoy, outbound)

    refused = [payment(port), payment(port, "GET")]
    for r in refused:
        assert r.status == 401 and r.headers["content-type"] == PROBLEM, r
        assert r.json()["type"].endswith("missing_tenant")
    assert envoy.stat("wasmcustom.cg.policy.default.missing_tenant") == 2
    assert payments.stats()["total"] == 0
    # The inbound listener is guarded as before.
    assert order(envoy, "alice").status == 200


# --- the edge gateway ------------------------------------------------------------------------------

ISSUER = "https://issuer.test"
SIGNING_KEY = b"coordination-guard edge test signing key, 32+ bytes"


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def token(claims: dict, key: bytes = SIGNING_KEY) -> str:
    """An HS256 JWT from the test's issuer, valid for 10 minutes."""
    header = {"alg": "HS256", "typ": "JWT", "kid": "edge"}
    now = int(time.time())
    body = {"iss": ISSUER, "aud": "orders-api", "iat": now, "exp": now + 600, **claims}
    signing = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(body).encode())}"
    return f"{signing}.{b64url(hmac.new(key, signing.encode(), hashlib.sha256).digest())}"


def edge_resources(stack, server) -> list[dict]:
    """Every manifest of deploy/istio/gateway, and the sidecars' WasmPlugin, with the
    operator's overrides: the module and the stack's webdis for the gateway's plugin, and for
    the token's verification this test's issuer and its keys inline (what istiod does with a
    jwksUri: it fetches the keys and inlines them)."""
    resources = [d for p in sorted((ISTIO / "gateway").glob("*.yaml"))
                 for d in yaml.safe_load_all(p.read_text()) if d]
    resources.append(wasmplugin())
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "kid": "edge", "k": b64url(SIGNING_KEY)}]}
    for i, doc in enumerate(resources):
        if doc["kind"] == "WasmPlugin" and doc["metadata"]["namespace"] == EDGE.namespace:
            resources[i] = operator_overrides(doc, stack, server.url(MODULE), module_sha256())
        elif doc["kind"] == "RequestAuthentication":
            rule = doc["spec"]["jwtRules"][0]
            del rule["jwksUri"]
            rule.update(issuer=ISSUER, jwks=json.dumps(jwks))
    return resources


def remaining(response: Response, limit: str) -> int:
    """The `r` the RateLimit header gives `limit` (`"user-burst";r=38;t=1, ...`)."""
    [item] = [i for i in response.headers["ratelimit"].split(", ") if i.startswith(f'"{limit}";')]
    return int(re.search(r";r=(\d+)", item).group(1))


def bearer(jwt: str, **headers) -> dict:
    return {"authorization": f"Bearer {jwt}", **headers}


def test_the_edge_gateway_guards_with_the_verified_tokens_identity(mesh):
    stack, server = mesh
    resources = edge_resources(stack, server)
    gateway = next(d for d in resources if d["kind"] == "Gateway")
    port = gateway["spec"]["listeners"][0]["port"]
    listener = f"0.0.0.0_{port}"
    envoy = proxy(stack, server, "edge-gateway", "CG_GATEWAY_AUTHORIZATION", lambda config: istio.gateway_config(
        config, resources, EDGE, FETCH_CLUSTER, port))
    # The gateway's listener: jwt_authn from the RequestAuthentication, then the guard (phase
    # AUTHZ, mode CLIENT); the sidecars' plugin (selector app=orders) is not the gateway's.
    assert istio.http_filter_names(envoy.config, listener) == \
        [istio.JWT_FILTER, "istio-ingress.coordination-guard", ROUTER]
    envoy.start()
    assert "coordination-guard: configuration loaded" in envoy.log_text()

    def call(headers: dict) -> Response:
        return envoy.request("GET", "/orders/7", headers=headers, timeout=15)

    # No token: no tenant, whatever the headers say (401 from the guard, problem+json).
    for headers in ({}, {"x-tenant-id": "acme", "x-user-id": "alice"}):
        r = call(headers)
        assert r.status == 401 and r.headers["content-type"] == PROBLEM, r
        assert r.json()["type"].endswith("missing_tenant")
    assert envoy.stat("wasmcustom.cg.policy.edge.missing_tenant") == 2
    # A bad token: jwt_authn refuses it before the guard (another key: 401; a token for
    # another audience: 403).
    for bad, status, why in ((token({"tenant_id": "acme", "sub": "alice"}, key=b"x" * 48), 401,
                              b"Jwt verification fails"),
                             (token({"tenant_id": "acme", "sub": "alice", "aud": "billing-api"}), 403,
                              b"Audiences in Jwt are not allowed")):
        r = call(bearer(bad))
        assert (r.status, r.body) == (status, why), r
        assert r.headers["www-authenticate"].startswith("Bearer"), r.headers
    assert stack.upstream.count("GET", "/orders/7") == 0

    # A verified token: the guard counts alice of tenant acme, from its claims.
    alice = token({"tenant_id": "acme", "sub": "alice"})
    responses, elapsed = burst(lambda: call(bearer(alice)))
    allowed = assert_user_burst(responses, elapsed)
    # The edge policy's three limits, as RateLimit-Policy states them (the token bucket: its
    # 40 tokens over the 2 s it takes to fill).
    assert set(responses[0].headers["ratelimit-policy"].split(", ")) == \
        {'"tenant";q=6000;w=60', '"user-burst";q=40;w=2', '"global";q=20000;w=1'}
    # Headers are not read. Bob's token with headers naming acme/alice: bob's own full bucket.
    spent = time.monotonic()
    bob = token({"tenant_id": "acme", "sub": "bob"})
    as_bob = call(bearer(bob, **{"x-tenant-id": "acme", "x-user-id": "alice"}))
    assert as_bob.status == 200 and remaining(as_bob, "user-burst") == BURST - 1, as_bob
    # Alice's token with headers naming another tenant and user: alice's spent bucket (refused,
    # or admitted from what refilled since), not a fresh one.
    as_alice = call(bearer(alice, **{"x-tenant-id": "globex", "x-user-id": "mallory"}))
    if as_alice.status != 429:
        assert as_alice.status == 200, as_alice
        assert remaining(as_alice, "user-burst") <= RATE * (time.monotonic() - spent) + 1, as_alice
    assert stack.upstream.count("GET", "/orders/7") == allowed + 1 + (as_alice.status == 200)
    assert envoy.stat("wasmcustom.cg.policy.edge.limit.user-burst.rejected") == 1 + (as_alice.status == 429)
    prefix = next(d for d in resources if d["kind"] == "WasmPlugin"
                  and d["metadata"]["namespace"] == EDGE.namespace)["spec"]["pluginConfig"]["redis"]["key_prefix"]
    assert stack.redis.keys(f"{prefix}:rl:*"), "the counters are in Redis under the plugin's prefix"
    assert envoy.stat("wasmcustom.cg.redis.errors") == 0
