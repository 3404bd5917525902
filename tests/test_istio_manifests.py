"""deploy/istio: every manifest parses and matches the schema of its kind (deploy/istio/schema,
written from Istio's and Kubernetes' API references), the WasmPlugin follows the project's
policy (schema/policy.json), the EnvoyFilter variant has the shape Istio needs for a Wasm
extension config, and the pieces agree with each other and with envoy/demo-plugin.json.
Mutated manifests check that the schemas reject what they must.
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

from harness.proc import ROOT

ISTIO = ROOT / "deploy" / "istio"
SCHEMAS = ISTIO / "schema"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
SCHEMA_OF = {
    "WasmPlugin": "wasmplugin.json",
    "EnvoyFilter": "envoyfilter.json",
    **{k: f"security-networking.json#/$defs/{k}" for k in ("DestinationRule", "PeerAuthentication", "AuthorizationPolicy")},
    **{k: f"kubernetes.json#/$defs/{k}" for k in ("Namespace", "ServiceAccount", "Secret", "ConfigMap", "Service", "Deployment", "StatefulSet")},
}
MANIFEST_FILES = sorted(ISTIO.glob("*.yaml")) + sorted((ISTIO / "body-fingerprints").glob("*.yaml"))

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


def one(kind: str, path=None) -> dict:
    found = [d for p in ([path] if path else MANIFEST_FILES) for d in docs(p) if d["kind"] == kind]
    assert len(found) == 1, (kind, len(found))
    return found[0]


def wasmplugin() -> dict:
    return one("WasmPlugin", ISTIO / "wasmplugin.yaml")


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


def test_the_wasmplugin_follows_the_project_policy():
    plugin = wasmplugin()
    assert errors(plugin, "policy.json") == []
    spec = plugin["spec"]
    assert spec["url"].startswith("oci://")
    env = spec["vmConfig"]["env"]
    assert env == [{"name": spec["pluginConfig"]["redis"]["authorization_env"], "valueFrom": "HOST"}]


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
])
def test_the_schemas_reject_a_wrong_wasmplugin(path, value, rejected_by):
    doc = mutate(wasmplugin(), path, value)
    api, policy = api_errors(doc), errors(doc, "policy.json")
    assert (api != [], policy != [] or api != []) == (rejected_by == "api", True), (api, policy)


def test_an_http_url_without_sha256_is_rejected():
    doc = mutate(mutate(wasmplugin(), "spec.url", "https://modules.example.com/cg.wasm"), "spec.sha256", DELETE)
    assert api_errors(doc) == [] and errors(doc, "policy.json") != []
    doc = mutate(doc, "spec.sha256", "")
    assert api_errors(doc) == [] and errors(doc, "policy.json") != []
    # With its digest it is fine.
    assert errors(mutate(doc, "spec.sha256", "b" * 64), "policy.json") == []


def test_the_wasmplugin_runs_the_demo_policies_without_holding_headers():
    """The demo's policies, except what needs allow_on_headers_stop_iteration (which
    WasmPlugin cannot set): no body in the fingerprint; sync completion as in the demo."""
    config = wasmplugin()["spec"]["pluginConfig"]
    expected = copy.deepcopy(DEMO["policies"])
    idem = next(p for p in expected if "idempotency" in p)["idempotency"]
    idem["fingerprint"].remove("body")
    assert config["policies"] == expected
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
    # The demo's policies as they are (body fingerprint, sync), the mesh's redis block.
    plugin_config = json.loads(config["configuration"]["value"])
    assert plugin_config["policies"] == DEMO["policies"]
    assert "body" in next(p for p in plugin_config["policies"]
                          if "idempotency" in p)["idempotency"]["fingerprint"]
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
