"""deploy/istio: every manifest parses and matches the schema of its kind (deploy/istio/schema,
written from Istio's, Kubernetes' and the Gateway API's references), the WasmPlugins (the
sidecars' and the edge gateway's) follow the project's policy (schema/policy.json), the
EnvoyFilter variant has the shape Istio needs for a Wasm extension config, and the pieces agree
with each other and with envoy/demo-plugin.json. Mutated manifests check that the schemas reject
what they must. Where istiod attaches each plugin (which proxies, which listeners) is checked
with the harness's rendition of its rules (harness/istio.py); test_e2e_istio.py runs it.
"""

from __future__ import annotations

import copy
import json
import re

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from harness import istio
from harness.proc import ROOT

ISTIO = ROOT / "deploy" / "istio"
SCHEMAS = ISTIO / "schema"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
SCHEMA_OF = {
    "WasmPlugin": "wasmplugin.json",
    "EnvoyFilter": "envoyfilter.json",
    "Gateway": "gateway-api.json",
    **{k: f"security-networking.json#/$defs/{k}"
       for k in ("DestinationRule", "PeerAuthentication", "AuthorizationPolicy", "RequestAuthentication")},
    **{k: f"kubernetes.json#/$defs/{k}" for k in ("Namespace", "ServiceAccount", "Secret", "ConfigMap", "Service", "Deployment", "StatefulSet")},
}
GATEWAY = ISTIO / "gateway"
# The mesh's manifests (what the sidecars use) and the edge gateway's example, apart.
MESH_FILES = sorted(ISTIO.glob("*.yaml")) + sorted((ISTIO / "body-fingerprints").glob("*.yaml"))
GATEWAY_FILES = sorted(GATEWAY.glob("*.yaml"))
MANIFEST_FILES = MESH_FILES + GATEWAY_FILES

_registry = Registry().with_resources(
    (p.name, Resource.from_contents(json.loads(p.read_text()), default_specification=DRAFT202012))
    for p in SCHEMAS.glob("*.json"))


def errors(doc: dict, schema_ref: str) -> list[str]:
    validator = jsonschema.Draft202012Validator({"$ref": schema_ref}, registry=_registry)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def api_errors(doc: dict) -> list[str]:
    ref = SCHEMA_OF.get(doc.get("kind"))
    return errors(doc, ref) if ref else [f"no schema for kind {doc.get('kind')!r}"]


def docs(path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def one(kind: str, path=None, files=MESH_FILES) -> dict:
    found = [d for p in ([path] if path else files) for d in docs(p) if d["kind"] == kind]
    assert len(found) == 1, (kind, len(found))
    return found[0]


def edge(kind: str) -> dict:
    """The one resource of `kind` in deploy/istio/gateway."""
    return one(kind, files=GATEWAY_FILES)


def wasmplugin() -> dict:
    return one("WasmPlugin", ISTIO / "wasmplugin.yaml")


def gateway_plugin() -> dict:
    return one("WasmPlugin", GATEWAY / "wasmplugin.yaml")


def envoyfilter() -> dict:
    return one("EnvoyFilter", ISTIO / "body-fingerprints" / "envoyfilter.yaml")


DEMO = json.loads((ROOT / "envoy" / "demo-plugin.json").read_text())


def test_the_schemas_are_valid_json_schemas():
    for path in SCHEMAS.glob("*.json"):
        jsonschema.Draft202012Validator.check_schema(json.loads(path.read_text()))
    assert set(SCHEMA_OF.values()) and {p.name for p in SCHEMAS.glob("*.json")} >= \
        {ref.split("#")[0] for ref in SCHEMA_OF.values()} | {"common.json", "policy.json"}


@pytest.mark.parametrize("path", MANIFEST_FILES, ids=lambda p: str(p.relative_to(ISTIO)))
def test_every_manifest_matches_its_kinds_schema(path):
    found = docs(path)
    assert found, f"{path} holds no manifest"
    for doc in found:
        assert api_errors(doc) == [], (doc["kind"], doc["metadata"]["name"])


def test_kubectl_apply_of_the_directory_takes_only_manifests():
    """`kubectl apply -f deploy/istio/` reads .yaml/.yml/.json files of the directory itself:
    only the main manifests may be there (the variant, patch and schemas live below it)."""
    top = {p.name for p in ISTIO.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml", ".json")}
    assert top == {"namespaces.yaml", "redis.yaml", "wasmplugin.yaml", "stats-bootstrap.yaml", "webdis.yaml"}
    kinds = sorted(d["kind"] for p in sorted(ISTIO.glob("*.yaml")) for d in docs(p))
    assert "EnvoyFilter" not in kinds and kinds.count("WasmPlugin") == 1
    # The edge gateway's example is a directory of its own, applied on its own (-f gateway/):
    # manifests only, with its one WasmPlugin.
    files = {p.name for p in GATEWAY.iterdir()}
    assert files and all(name.endswith(".yaml") for name in files), files
    assert [d["kind"] for p in GATEWAY_FILES for d in docs(p)].count("WasmPlugin") == 1


@pytest.mark.parametrize("plugin", [wasmplugin, gateway_plugin], ids=["sidecar", "gateway"])
def test_the_wasmplugins_follow_the_project_policy(plugin):
    plugin = plugin()
    assert errors(plugin, "policy.json") == []
    spec = plugin["spec"]
    assert spec["url"].startswith("oci://")
    env = spec["vmConfig"]["env"]
    assert env == [{"name": spec["pluginConfig"]["redis"]["authorization_env"], "valueFrom": "HOST"}]


def test_the_sidecars_plugin_guards_inbound_traffic_only():
    assert wasmplugin()["spec"]["match"] == [{"mode": "SERVER"}]
    assert gateway_plugin()["spec"]["match"] == [{"mode": "CLIENT"}]


def mutate(doc: dict, path: str, value) -> dict:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


DELETE = object()


@pytest.mark.parametrize("path, value, rejected_by", [
    ("spec.phase", "AUTHORIZATION", "api"),            # not a phase
    ("spec.phase", "AUTHN", "policy"),                 # a phase, before JWT authentication
    ("spec.phase", DELETE, "policy"),                  # unset: the control plane picks a place
    ("spec.failStrategy", "FAIL_OPEN", "policy"),
    ("spec.failStrategy", "FAIL_CLOSED", "api"),       # Envoy's spelling, not Istio's
    ("spec.sha256", DELETE, "policy"),                 # an oci url without sha256
    ("spec.sha256", "sha256:" + "a" * 64, "api"),      # digest with its algorithm prefix
    ("spec.sha256", "A" * 64, "api"),                  # upper-case hex
    ("spec.sha256", "a" * 63, "api"),
    ("spec.url", "ftp://example.com/x.wasm", "api"),
    ("spec.url", "file:///opt/x.wasm", "policy"),     # a local file: not pinned, not pulled
    ("spec.pluginName", "", "api"),
    ("spec.pluginName", "other", "policy"),
    ("spec.vmConfig.env.0.valueFrom", "SECRET", "api"),
    ("spec.vmConfig.env.0.value", "Basic abc", "api"),  # a value with valueFrom HOST
    ("spec.imagePullPolicy", "Never", "api"),
    ("spec.pluginConfig.redis.authorization", "Basic Y2c6c2VjcmV0", "policy"),
    ("spec.pluginConfig.redis.cluster", "webdis", "policy"),
    ("spec.phases", "AUTHZ", "api"),                   # unknown field
    ("apiVersion", "extensions.istio.io/v1", "api"),
    ("metadata.namespace", DELETE, "api"),
    # Where it runs: Istio's default (no match, or no mode) is CLIENT_AND_SERVER, which puts
    # the guard on the workload's outbound calls too.
    ("spec.match", DELETE, "policy"),
    ("spec.match", [], "policy"),
    ("spec.match", [{"ports": [{"number": 8080}]}], "policy"),
    ("spec.match.0.mode", "CLIENT_AND_SERVER", "policy"),
    ("spec.match.0.mode", "CLIENT", "policy"),          # the workload's outbound calls only
    ("spec.match.0.mode", "INBOUND", "api"),            # not a mode
    ("spec.match.0.ports", [{"number": 0}], "api"),
    ("spec.selector", DELETE, "policy"),                # every workload of the namespace
    ("spec.targetRefs", [{"kind": "Service", "name": "orders"}], "api"),  # not with selector
])
def test_the_schemas_reject_a_wrong_wasmplugin(path, value, rejected_by):
    doc = mutate(wasmplugin(), path, value)
    api, policy = api_errors(doc), errors(doc, "policy.json")
    assert (api != [], policy != [] or api != []) == (rejected_by == "api", True), (api, policy)


@pytest.mark.parametrize("path, value, rejected_by", [
    ("spec.match.0.mode", "SERVER", "policy"),          # never attaches to a gateway
    ("spec.match", DELETE, "policy"),
    ("spec.match.0.mode", "CLIENT_AND_SERVER", "policy"),
    ("spec.targetRefs.0.kind", "Service", "policy"),
    ("spec.targetRefs.0.group", DELETE, "policy"),
    ("spec.targetRefs", [], "policy"),
    ("spec.targetRefs.0.namespace", "orders", "api"),   # cross-namespace: unsupported
    ("spec.targetRefs.0.group", "gateway.networking.k8s.io/v1", "api"),
    ("spec.targetRefs.0.name", "", "api"),
    ("spec.selector", {"matchLabels": {"app": "edge"}}, "api"),  # with targetRefs
    # At the edge the tenant comes from a verified token, never from a header.
    ("spec.pluginConfig.identity", {"tenant_header": "x-tenant-id"}, "policy"),
    ("spec.pluginConfig.identity.tenant", {"header": "x-tenant-id"}, "policy"),
    ("spec.pluginConfig.identity", DELETE, "policy"),
    ("spec.phase", "AUTHN", "policy"),                  # before jwt_authn: no claims yet
])
def test_the_schemas_reject_a_wrong_gateway_wasmplugin(path, value, rejected_by):
    doc = mutate(gateway_plugin(), path, value)
    api, policy = api_errors(doc), errors(doc, "policy.json")
    assert (api != [], policy != [] or api != []) == (rejected_by == "api", True), (api, policy)


def test_a_gateway_installed_by_helm_is_selected_by_its_labels():
    """The variant wasmplugin.yaml's comment names: istio-ingressgateway's pods, by selector,
    the plugin in istio-system; a gateway still, so CLIENT, and with a header identity refused."""
    doc = mutate(mutate(gateway_plugin(), "spec.targetRefs", DELETE), "spec.selector",
                 {"matchLabels": {"istio": "ingressgateway"}})
    doc = mutate(doc, "metadata.namespace", "istio-system")
    assert api_errors(doc) == [] and errors(doc, "policy.json") == []
    assert errors(mutate(doc, "spec.match.0.mode", "SERVER"), "policy.json") != []
    assert errors(mutate(doc, "spec.pluginConfig.identity", {"tenant_header": "x-tenant-id"}),
                  "policy.json") != []


def test_a_gateway_selected_by_its_gateway_name_label_is_a_gateway():
    """The pods Istio deploys for the Gateway edge, by their label instead of targetRefs
    (istiod applies selector-only policies to them): a gateway to the policy as to istiod, so a
    SERVER plugin, which istiod never puts on a gateway's listener, is refused, CLIENT is not,
    and a header identity is refused."""
    doc = mutate(mutate(gateway_plugin(), "spec.targetRefs", DELETE), "spec.selector",
                 {"matchLabels": {istio.GATEWAY_NAME_LABEL: "edge"}})
    proxy = istio.Proxy(namespace="istio-ingress", labels={istio.GATEWAY_NAME_LABEL: "edge"})
    assert istio.attaches(doc, proxy) and istio.matches_listener(doc, istio.GATEWAY, 443)
    assert api_errors(doc) == [] and errors(doc, "policy.json") == []
    server = mutate(doc, "spec.match.0.mode", "SERVER")
    assert istio.attaches(server, proxy) and not istio.matches_listener(server, istio.GATEWAY, 443)
    assert errors(server, "policy.json") != []
    assert errors(mutate(doc, "spec.pluginConfig.identity", {"tenant_header": "x-tenant-id"}),
                  "policy.json") != []


@pytest.mark.parametrize("kind, path, value", [
    ("RequestAuthentication", "spec.jwtRules.0.jwksUri", "ftp://auth.example.com/jwks.json"),
    ("RequestAuthentication", "spec.jwtRules.0.jwks", '{"keys": []}'),  # with jwksUri: one of them
    ("RequestAuthentication", "spec.jwtRules.0.issuer", ""),
    ("RequestAuthentication", "spec.jwtRules.0.outputClaimToHeaders", [{"header": "x tenant", "claim": "t"}]),
    ("RequestAuthentication", "spec.jwtRules.0.audience", ["orders-api"]),  # audiences
    ("RequestAuthentication", "spec.targetRefs.0.namespace", "orders"),
    ("RequestAuthentication", "spec.selector", {"matchLabels": {"app": "edge"}}),  # with targetRefs
    ("RequestAuthentication", "apiVersion", "security.istio.io/v1alpha1"),
    ("Gateway", "spec.gatewayClassName", DELETE),
    ("Gateway", "spec.listeners", []),
    ("Gateway", "spec.listeners.0.protocol", "HTTP"),   # with tls
    ("Gateway", "spec.listeners.0.tls.mode", "Terminated"),
    ("Gateway", "spec.listeners.0.tls.certificateRefs", []),  # Terminate without a certificate
    ("Gateway", "spec.listeners.0.port", 0),
    ("Gateway", "spec.listeners.0.hostname", "API.example.com"),
    ("Gateway", "spec.listeners.0.allowedRoutes.namespaces.from", "Any"),
    ("Gateway", "spec.infrastructure.parametersRef.group", DELETE),
    ("Gateway", "apiVersion", "gateway.networking.k8s.io/v1alpha1"),
    ("AuthorizationPolicy", "spec.rules.0.from.0.source.principal", ["x"]),  # principals
])
def test_the_schemas_reject_a_wrong_gateway_resource(kind, path, value):
    assert api_errors(mutate(edge(kind), path, value)) != []


def test_an_http_url_without_sha256_is_rejected():
    doc = mutate(mutate(wasmplugin(), "spec.url", "https://modules.example.com/cg.wasm"), "spec.sha256", DELETE)
    assert api_errors(doc) == [] and errors(doc, "policy.json") != []
    doc = mutate(doc, "spec.sha256", "")
    assert api_errors(doc) == [] and errors(doc, "policy.json") != []
    # With its digest it is fine.
    assert errors(mutate(doc, "spec.sha256", "b" * 64), "policy.json") == []


def limits(policy: dict) -> dict:
    return {limit["name"]: limit for limit in policy.get("rate_limits", [])}


def test_the_wasmplugin_guards_the_demos_operations_with_production_limits():
    """The demo's operations (matches, lease, idempotency), except what needs
    allow_on_headers_stop_iteration (which WasmPlugin cannot set): no body in the fingerprint;
    sync completion as in the demo. Its limits are what a real service starts from, not the
    demo's few requests: a tenant a few thousand a minute, a user 20/s with a burst of 40, a
    high global limit leased (no Redis call per request), and no per-client_ip limit (behind a
    sidecar the client address is a hop of the mesh, not reliably the end user's)."""
    config = wasmplugin()["spec"]["pluginConfig"]
    demo = copy.deepcopy(DEMO["policies"])
    next(p for p in demo if "idempotency" in p)["idempotency"]["fingerprint"].remove("body")
    assert [p["name"] for p in config["policies"]] == [p["name"] for p in demo]
    for mine, theirs in zip(config["policies"], demo):
        assert {k: v for k, v in mine.items() if k != "rate_limits"} == \
            {k: v for k, v in theirs.items() if k != "rate_limits"}, mine["name"]
    create, default = limits(config["policies"][1]), limits(config["policies"][2])
    assert create["tenant"] == {"name": "tenant", "by": ["tenant"], "algorithm": "sliding_window",
                                "limit": 3000, "window": "1m"}
    assert create["user-burst"] == {"name": "user-burst", "by": ["tenant", "principal"],
                                    "algorithm": "token_bucket", "limit": 20, "window": "1s", "burst": 40}
    assert set(create) == {"tenant", "user-burst"}
    assert default == {"global": {"name": "global", "by": [], "algorithm": "fixed_window",
                                  "limit": 10000, "window": "1s", "mode": "leased"}}
    assert {k: v for k, v in config.items() if k not in ("redis", "policies")} == \
        {k: v for k, v in DEMO.items() if k not in ("redis", "policies")}


def test_the_envoyfilter_variant_is_an_ecds_wasm_config_and_a_filter_naming_it():
    ef, plugin = envoyfilter(), wasmplugin()
    extension, http_filter = ef["spec"]["configPatches"]
    assert (extension["applyTo"], extension["patch"]["operation"]) == ("EXTENSION_CONFIG", "ADD")
    assert (http_filter["applyTo"], http_filter["patch"]["operation"]) == ("HTTP_FILTER", "ADD")
    assert http_filter["patch"]["filterClass"] == "AUTHN"  # after authn, before authz: phase AUTHZ
    assert extension["match"]["context"] == http_filter["match"]["context"] == "SIDECAR_INBOUND"
    assert http_filter["match"]["listener"]["filterChain"]["filter"]["name"] == \
        "envoy.filters.network.http_connection_manager"
    name = f"{plugin['metadata']['namespace']}.{plugin['metadata']['name']}"
    value = extension["patch"]["value"]
    assert value["name"] == http_filter["patch"]["value"]["name"] == name
    discovery = http_filter["patch"]["value"]["config_discovery"]
    assert discovery["type_urls"] == [WASM_TYPE] and "ads" in discovery["config_source"]
    assert value["typed_config"]["@type"] == WASM_TYPE
    config = value["typed_config"]["config"]
    assert config["allow_on_headers_stop_iteration"] is True
    assert (config["root_id"], config["failure_policy"]) == (plugin["spec"]["pluginName"], "FAIL_CLOSED")
    assert config["vm_config"]["environment_variables"]["host_env_keys"] == \
        [e["name"] for e in plugin["spec"]["vmConfig"]["env"]]
    remote = config["vm_config"]["code"]["remote"]
    assert (remote["http_uri"]["uri"], remote["sha256"]) == (plugin["spec"]["url"], plugin["spec"]["sha256"])
    # The WasmPlugin's policies with the body in the fingerprint (as the demo has it), the
    # mesh's redis block.
    plugin_config = json.loads(config["configuration"]["value"])
    expected = copy.deepcopy(plugin["spec"]["pluginConfig"]["policies"])
    next(p for p in expected if "idempotency" in p)["idempotency"]["fingerprint"].append("body")
    assert plugin_config["policies"] == expected
    assert plugin_config["redis"] == plugin["spec"]["pluginConfig"]["redis"]
    assert ef["spec"]["workloadSelector"]["labels"] == plugin["spec"]["selector"]["matchLabels"]
    assert ef["metadata"]["namespace"] == plugin["metadata"]["namespace"]


@pytest.mark.parametrize("path, value", [
    ("spec.configPatches.0.applyTo", "EXTENSION_CONFIGS"),
    ("spec.configPatches.1.patch.operation", "INSERT"),
    ("spec.configPatches.1.patch.filterClass", "AUTHENTICATION"),
    ("spec.configPatches.0.match.context", "SIDECAR"),
    ("spec.configPatches.1.match.listener.filterChain.filter.subfilter", {"name": "x"}),
    ("spec.workloadSelector.matchLabels", {"app": "orders"}),  # WasmPlugin's spelling
    ("apiVersion", "networking.istio.io/v1"),
])
def test_the_schema_rejects_a_wrong_envoyfilter(path, value):
    assert api_errors(mutate(envoyfilter(), path, value)) != []


def test_the_pieces_agree():
    plugin = wasmplugin()
    redis = plugin["spec"]["pluginConfig"]["redis"]
    service = one("Service", ISTIO / "webdis.yaml")
    port = service["spec"]["ports"][0]
    fqdn = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    # Istio's outbound cluster of the webdis Service, HTTP (webdis speaks HTTP/1.1 only).
    assert redis["cluster"] == f"outbound|{port['port']}||{fqdn}" and redis["authority"] == fqdn
    assert port["appProtocol"] == "http" and port["name"].startswith("http")
    rule = one("DestinationRule")
    assert rule["spec"]["host"] == fqdn
    assert rule["spec"]["trafficPolicy"]["connectionPool"]["http"]["h2UpgradePolicy"] == "DO_NOT_UPGRADE"
    policy = one("AuthorizationPolicy", ISTIO / "webdis.yaml")
    assert policy["spec"]["rules"][0]["from"][0]["source"]["namespaces"] == [plugin["metadata"]["namespace"]]
    assert policy["spec"]["rules"][0]["to"][0]["operation"]["ports"] == [str(port["port"])]
    assert {d["metadata"]["name"]: d["metadata"]["labels"]["istio-injection"]
            for d in docs(ISTIO / "namespaces.yaml")} == {"redis": "enabled", "orders": "enabled"}

    # webdis: pinned release, locked-down config, every "$VAR" provided by the container.
    deployment = one("Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"nicolas/webdis:\d+\.\d+\.\d+(@sha256:[0-9a-f]{64})?", container["image"])
    webdis = json.loads(one("Secret", ISTIO / "webdis.yaml")["stringData"]["webdis.json"])
    assert webdis["acl"][0] == {"disabled": ["*"]}
    assert sorted(webdis["acl"][1]["enabled"]) == ["EVAL", "EVALSHA"] and len(webdis["acl"]) == 2
    assert webdis["http_port"] == port["port"] and webdis["websockets"] is False
    text = json.dumps(webdis)
    needed = set(re.findall(r'"\$([A-Z_]+)"', text))
    provided = {e["name"] for e in container["env"]}
    assert needed and needed <= provided, needed - provided
    # No credential in the manifest: the password and the Basic-auth pair come from the env.
    assert webdis["redis_auth"][1].startswith("$") and webdis["acl"][1]["http_basic_auth"].startswith("$")

    # The workload patch: the credential from a Secret into the sidecar (what vmConfig.env
    # HOST reads), the stats kept and tagged.
    patch = yaml.safe_load((ISTIO / "patches" / "workload.yaml").read_text())
    template = patch["spec"]["template"]
    [proxy] = template["spec"]["containers"]
    assert proxy["name"] == "istio-proxy"
    assert [e["name"] for e in proxy["env"]] == [redis["authorization_env"]]
    assert "secretKeyRef" in proxy["env"][0]["valueFrom"]
    stats = one("ConfigMap", ISTIO / "stats-bootstrap.yaml")
    annotations = template["metadata"]["annotations"]
    assert annotations["sidecar.istio.io/bootstrapOverride"] == stats["metadata"]["name"]
    assert stats["metadata"]["namespace"] == plugin["metadata"]["namespace"]
    matcher = yaml.safe_load(annotations["proxy.istio.io/config"])["proxyStatsMatcher"]
    assert matcher == {"inclusionPrefixes": ["wasmcustom.cg."]}
    template_tags = yaml.safe_load((ROOT / "envoy" / "template.yaml").read_text())["stats_config"]["stats_tags"]
    bootstrap = json.loads(stats["data"]["custom_bootstrap.json"])
    assert bootstrap == {"stats_config": {"stats_tags": template_tags}}


def test_the_gateway_pieces_agree():
    gateway, plugin, authn = edge("Gateway"), gateway_plugin(), edge("RequestAuthentication")
    namespace = gateway["metadata"]["namespace"]
    assert edge("Namespace")["metadata"]["name"] == namespace
    # The plugin and the token's verification attach to this Gateway, from its namespace.
    target = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway["metadata"]["name"]}
    for resource in (plugin, authn):
        assert resource["metadata"]["namespace"] == namespace
        assert resource["spec"]["targetRefs"] == [target]
    assert gateway["spec"]["gatewayClassName"] == "istio"
    # The identity is the verified token's: claims jwt_authn puts in the metadata (istiod's
    # payload_in_metadata "payload"), checked for this issuer and audience.
    identity = plugin["spec"]["pluginConfig"]["identity"]
    assert identity["tenant"] == {"metadata": [istio.JWT_FILTER, "payload", "tenant_id"]}
    assert identity["principal"] == {"metadata": [istio.JWT_FILTER, "payload", "sub"]}
    [rule] = authn["spec"]["jwtRules"]
    assert rule["issuer"] and rule["jwksUri"].startswith("https://") and rule["audiences"]
    # Same webdis as the sidecars, keys of its own within the webdis user's (cg:orders:*).
    sidecar_redis = wasmplugin()["spec"]["pluginConfig"]["redis"]
    redis = plugin["spec"]["pluginConfig"]["redis"]
    assert {k: v for k, v in redis.items() if k != "key_prefix"} == \
        {k: v for k, v in sidecar_redis.items() if k != "key_prefix"}
    assert redis["key_prefix"].startswith(sidecar_redis["key_prefix"] + ":")
    # The credential: Secret -> the gateway Deployment's istio-proxy env (the Gateway's
    # parametersRef overlay) -> vmConfig.env HOST -> authorization_env.
    options = edge("ConfigMap")
    ref = gateway["spec"]["infrastructure"]["parametersRef"]
    assert (ref["group"], ref["kind"], ref["name"]) == ("", "ConfigMap", options["metadata"]["name"])
    assert options["metadata"]["namespace"] == namespace
    overlay = yaml.safe_load(options["data"]["deployment"])["spec"]["template"]
    [proxy] = overlay["spec"]["containers"]
    assert proxy["name"] == "istio-proxy"
    assert [e["name"] for e in proxy["env"]] == [redis["authorization_env"]]
    assert "secretKeyRef" in proxy["env"][0]["valueFrom"]
    matcher = yaml.safe_load(overlay["metadata"]["annotations"]["proxy.istio.io/config"])
    assert matcher == {"proxyStatsMatcher": {"inclusionPrefixes": ["wasmcustom.cg."]}}
    # webdis lets the gateway's proxy in by its identity: service account <Gateway>-<class>,
    # which Istio gives the Deployment it creates; the same one operation as the sidecars.
    access, webdis_policy = edge("AuthorizationPolicy"), one("AuthorizationPolicy", ISTIO / "webdis.yaml")
    service, deployment = one("Service", ISTIO / "webdis.yaml"), one("Deployment", ISTIO / "webdis.yaml")
    assert access["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert access["spec"]["selector"]["matchLabels"] == deployment["spec"]["template"]["metadata"]["labels"]
    account = f"{gateway['metadata']['name']}-{gateway['spec']['gatewayClassName']}"
    assert access["spec"]["rules"][0]["from"] == [{"source": {"principals": [
        f"cluster.local/ns/{namespace}/sa/{account}"]}}]
    assert access["spec"]["rules"][0]["to"] == webdis_policy["spec"]["rules"][0]["to"]


ORDERS = istio.Proxy("orders", {"app": "orders"})
EDGE = istio.Proxy("istio-ingress", {istio.GATEWAY_NAME_LABEL: "edge"})
HELM_GATEWAY = istio.Proxy("istio-system", {"istio": "ingressgateway", "app": "istio-ingressgateway"})


def filters(resources: list[dict], proxy, listener_class: str, port: int = 8080) -> list[str]:
    return [f["name"] for f in istio.istiod_http_filters(resources, proxy, listener_class, port, "_")]


def with_jwks(authn: dict) -> dict:
    """istiod inlines the keys of a jwksUri it fetched; here they are given inline."""
    rule = authn["spec"]["jwtRules"][0]
    return mutate(mutate(authn, "spec.jwtRules.0.jwksUri", DELETE), "spec.jwtRules.0.jwks", '{"keys": []}') \
        if "jwksUri" in rule else authn


def test_istiod_attaches_each_plugin_where_it_belongs():
    """Istio's attachment and matchMode rules (harness/istio.py) on the shipped manifests, all
    applied together: the sidecar plugin on the orders sidecar's inbound listener only, the
    edge plugin (after jwt_authn) on the edge gateway only."""
    sidecar, gateway, authn = wasmplugin(), gateway_plugin(), with_jwks(edge("RequestAuthentication"))
    everything = [sidecar, gateway, authn]
    assert filters(everything, ORDERS, istio.SIDECAR_INBOUND) == ["orders.coordination-guard"]
    assert filters(everything, ORDERS, istio.SIDECAR_OUTBOUND) == []
    assert filters(everything, EDGE, istio.GATEWAY, 443) == \
        [istio.JWT_FILTER, "istio-ingress.coordination-guard"]
    # Without match (Istio's CLIENT_AND_SERVER), the sidecar's own outbound calls are guarded.
    unmatched = mutate(sidecar, "spec.match", DELETE)
    assert filters([unmatched], ORDERS, istio.SIDECAR_OUTBOUND) == ["orders.coordination-guard"]
    # A gateway's listeners are CLIENT: mode SERVER would never put the guard there.
    assert filters([mutate(gateway, "spec.match.0.mode", "SERVER"), authn], EDGE, istio.GATEWAY, 443) == \
        [istio.JWT_FILTER]
    assert filters([mutate(gateway, "spec.match", DELETE)], EDGE, istio.GATEWAY, 443) == \
        ["istio-ingress.coordination-guard"]
    # A plugin selected by targetRefs is not a sidecar's; a Gateway's pods take a selector
    # policy of their namespace too; ports narrow a match.
    moved = mutate(gateway, "metadata.namespace", "orders")
    assert filters([moved], ORDERS, istio.SIDECAR_OUTBOUND) == []
    assert filters([mutate(moved, "spec.targetRefs", DELETE)], ORDERS, istio.SIDECAR_OUTBOUND) == \
        ["orders.coordination-guard"]
    ported = mutate(sidecar, "spec.match.0.ports", [{"number": 8080}])
    assert filters([ported], ORDERS, istio.SIDECAR_INBOUND, 8080) == ["orders.coordination-guard"]
    assert filters([ported], ORDERS, istio.SIDECAR_INBOUND, 9090) == []
    # The Helm-installed gateway: the selector variant, in istio-system.
    helm = mutate(mutate(mutate(gateway, "spec.targetRefs", DELETE), "spec.selector",
                         {"matchLabels": {"istio": "ingressgateway"}}), "metadata.namespace", "istio-system")
    assert filters([helm, sidecar], HELM_GATEWAY, istio.GATEWAY, 443) == ["istio-system.coordination-guard"]
    assert filters([helm], EDGE, istio.GATEWAY, 443) == []
