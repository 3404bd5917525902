"""What Istio does with the WasmPlugins of deploy/istio, redone for a test Envoy.

- `istiod_wasm_filter(plugin, ...)`: the Envoy Wasm HTTP filter istiod generates from a
  WasmPlugin (istio/istio pilot/pkg/model/extensions.go, and the listener builder for the
  failure policy): name `<namespace>.<name>`, `root_id` = `pluginName`, `configuration` = a
  StringValue holding the JSON of `pluginConfig`, runtime V8, `vmConfig.env` ->
  `environment_variables` (INLINE -> key_values, HOST -> host_env_keys, plus the
  `ISTIO_META_WASM_*` values istiod adds), `failStrategy` -> `failure_policy` (default
  FAIL_CLOSE), and the module as `vm_config.code.remote` (`http_uri` + `sha256`). istiod has
  no `allow_on_headers_stop_iteration` to set, so the filter carries none.
  In a mesh, istio-agent downloads the module and rewrites `remote` to a local file; here Envoy
  fetches it itself through `fetch_cluster`.
- Which proxies and listeners get it: `attaches(resource, proxy)` is istiod's choice of the
  proxies a WasmPlugin or RequestAuthentication applies to (pilot/pkg/model/policyattachment.go:
  the proxy's namespace or the root namespace; `selector` for sidecars; `targetRefs` to a
  Gateway API `Gateway` for that gateway's pods, whose `selector`-only policies also apply).
  `matches_listener(plugin, listener_class, port)` is its `match` (matchTrafficSelectors,
  matchMode, matchPorts): each listener has a class, and each class one workload mode:
  a sidecar's inbound listener (what callers reach) is SERVER, its outbound listeners (the
  workload's own calls to other services) are CLIENT, and a gateway's listeners are CLIENT
  too. A plugin without `match`, or with a mode unset, UNDEFINED or CLIENT_AND_SERVER, matches
  every class; `ports` (if any) must hold the listener's port.
- `istiod_jwt_filter(request_authentications)`: Envoy's jwt_authn as istiod renders the
  `jwtRules` of RequestAuthentications (pilot/pkg/security/authn/policy_applier.go): one
  provider per rule (`origins-<i>`), the verified payload in the request's metadata at
  `envoy.filters.http.jwt_authn` -> `payload`, a token optional but refused if bad. A rule's
  keys must be inline (`jwks`): istiod fetches a `jwksUri` itself and inlines the keys, which
  a test replaces by its own.
- `istiod_http_filters(...)`: a listener's HTTP filters in istiod's order: WasmPlugins of
  phase AUTHN, jwt_authn, phase AUTHZ, phase STATS, then unspecified; each phase by priority.
  (Istio's own istio_authn and RBAC filters, which are not in upstream Envoy, are left out.)
- `sidecar_config(...)` and `gateway_config(...)`: a harness Envoy config turned into a
  sidecar's listeners (inbound in front of the workload, one outbound listener per other
  service) or a gateway's listener, each with the filters istiod gives its class.
- `ModuleServer`: a real HTTP server process (python -m http.server) serving the module.
"""
from __future__ import annotations

import copy
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .envoy import Response
from .proc import Service, free_port

WASM_FILTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
STRING_VALUE_TYPE = "type.googleapis.com/google.protobuf.StringValue"
FAIL_STRATEGY = {"FAIL_CLOSE": "FAIL_CLOSED", "FAIL_OPEN": "FAIL_OPEN", "FAIL_RELOAD": "FAIL_RELOAD"}
JWT_FILTER = "envoy.filters.http.jwt_authn"
JWT_TYPE = "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication"
ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}

# Istio's listener classes and the workload mode each is (workloadModeForListenerClass).
SIDECAR_INBOUND, SIDECAR_OUTBOUND, GATEWAY = "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"
CLASS_MODE = {SIDECAR_INBOUND: "SERVER", SIDECAR_OUTBOUND: "CLIENT", GATEWAY: "CLIENT"}
# The phases in the order istiod places them on a listener; unset comes last.
PHASES = ("AUTHN", "AUTHZ", "STATS", "UNSPECIFIED_PHASE")
ROOT_NAMESPACE = "istio-system"
GATEWAY_NAME_LABEL = "gateway.networking.k8s.io/gateway-name"
GATEWAY_API_GROUP = "gateway.networking.k8s.io"
# The claims jwt_authn turns from space-delimited strings into lists (istiod's defaults).
SPACE_DELIMITED_CLAIMS = ["scope", "permission"]


@dataclass
class Proxy:
    """A proxy as istiod sees it: its namespace and its pod's labels. A Gateway API gateway's
    pods carry `gateway.networking.k8s.io/gateway-name: <Gateway>`."""

    namespace: str
    labels: dict = field(default_factory=dict)

    @property
    def gateway_name(self) -> str | None:
        return self.labels.get(GATEWAY_NAME_LABEL)


def attaches(resource: dict, proxy: Proxy, root_namespace: str = ROOT_NAMESPACE) -> bool:
    """Whether istiod applies a WasmPlugin or RequestAuthentication to `proxy`."""
    namespace, spec = resource["metadata"]["namespace"], resource.get("spec", {})
    if namespace not in (proxy.namespace, root_namespace):
        return False
    refs = spec.get("targetRefs") or ([spec["targetRef"]] if spec.get("targetRef") else [])
    wanted = spec.get("selector", {}).get("matchLabels", {})
    selected = all(proxy.labels.get(k) == v for k, v in wanted.items())
    if proxy.gateway_name is None:
        return not refs and selected  # a sidecar ignores a policy with targetRefs
    if not refs:
        return selected  # ENABLE_SELECTOR_BASED_K8S_GATEWAY_POLICY, on by default
    return any(namespace == proxy.namespace and ref.get("namespace", "") in ("", proxy.namespace)
               and ref.get("group") == GATEWAY_API_GROUP and ref.get("kind") == "Gateway"
               and ref.get("name") == proxy.gateway_name for ref in refs)


def matches_listener(plugin: dict, listener_class: str, port: int) -> bool:
    """Whether a WasmPlugin's `match` selects a listener of this class and port."""
    selectors = plugin["spec"].get("match") or []
    if not selectors:
        return True
    for selector in selectors:
        mode = selector.get("mode", "UNDEFINED")
        mode_fits = mode in ("UNDEFINED", "CLIENT_AND_SERVER") or mode == CLASS_MODE[listener_class]
        ports = [p.get("number", 0) for p in selector.get("ports", [])]
        if mode_fits and (not ports or port in ports):
            return True
    return False


def istiod_jwt_filter(request_authentications: list[dict]) -> dict | None:
    rules = [r for ra in request_authentications for r in ra["spec"].get("jwtRules", [])]
    if not rules:
        return None
    providers, each, any_of = {}, [], []
    for i, rule in enumerate(rules):
        if "jwks" not in rule:
            raise ValueError(f"jwtRules[{i}] ({rule['issuer']}): give its keys inline (jwks) in a "
                             "test; istiod fetches jwksUri itself")
        provider = {"issuer": rule["issuer"], "payload_in_metadata": "payload",
                    "normalize_payload_in_metadata": {"space_delimited_claims": SPACE_DELIMITED_CLAIMS
                                                      + rule.get("spaceDelimitedClaims", [])},
                    "local_jwks": {"inline_string": rule["jwks"]}}
        if rule.get("audiences"):
            provider["audiences"] = rule["audiences"]
        if rule.get("forwardOriginalToken"):
            provider["forward"] = True
        if rule.get("outputPayloadToHeader"):
            provider["forward_payload_header"] = rule["outputPayloadToHeader"]
        if rule.get("outputClaimToHeaders"):
            provider["claim_to_headers"] = [{"header_name": h["header"], "claim_name": h["claim"]}
                                            for h in rule["outputClaimToHeaders"]]
        if rule.get("fromHeaders"):
            provider["from_headers"] = [{"name": h["name"], "value_prefix": h.get("prefix", "")}
                                        for h in rule["fromHeaders"]]
        for key, envoy_key in (("fromParams", "from_params"), ("fromCookies", "from_cookies")):
            if rule.get(key):
                provider[envoy_key] = rule[key]
        name = f"origins-{i}"
        providers[name] = provider
        # A token, if there is one, must be valid; none is allowed (RBAC may require one).
        each.append({"requires_any": {"requirements": [{"provider_name": name}, {"allow_missing": {}}]}})
        any_of.append({"provider_name": name})
    requires = each[0] if len(each) == 1 else \
        {"requires_any": {"requirements": any_of + [{"requires_all": {"requirements": each}}]}}
    return {"name": JWT_FILTER, "typed_config": {
        "@type": JWT_TYPE, "providers": providers, "bypass_cors_preflight": True,
        "rules": [{"match": {"prefix": "/"}, "requires": requires}]}}


def istiod_http_filters(resources: list[dict], proxy: Proxy, listener_class: str, port: int,
                        fetch_cluster: str) -> list[dict]:
    """The HTTP filters istiod puts on a listener of `proxy` (without the router), from the
    WasmPlugins and RequestAuthentications among `resources` that attach to it."""
    attached = [r for r in resources if r.get("kind") in ("WasmPlugin", "RequestAuthentication")
                and attaches(r, proxy)]
    plugins = [r for r in attached if r["kind"] == "WasmPlugin"
               and r["spec"].get("type", "HTTP") in ("HTTP", "UNSPECIFIED_PLUGIN_TYPE")
               and matches_listener(r, listener_class, port)]
    jwt = istiod_jwt_filter([r for r in attached if r["kind"] == "RequestAuthentication"])

    def phase(name: str) -> list[dict]:
        chosen = [p for p in plugins if p["spec"].get("phase", "UNSPECIFIED_PHASE") == name]
        chosen.sort(key=lambda p: -p["spec"].get("priority", -2**31))  # stable: by priority
        return [istiod_wasm_filter(p, fetch_cluster) for p in chosen]

    filters = phase("AUTHN") + ([jwt] if jwt else [])
    for name in PHASES[1:]:
        filters += phase(name)
    return filters


def istiod_wasm_filter(plugin: dict, fetch_cluster: str, resource_version: str = "1") -> dict:
    meta, spec = plugin["metadata"], plugin["spec"]
    name = f"{meta['namespace']}.{meta['name']}"
    key_values = {}
    if spec.get("imagePullPolicy"):
        key_values["ISTIO_META_WASM_IMAGE_PULL_POLICY"] = spec["imagePullPolicy"]
    key_values["ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION"] = resource_version
    host_env_keys = []
    for env in spec.get("vmConfig", {}).get("env", []):
        if env.get("valueFrom", "INLINE") == "HOST":
            host_env_keys.append(env["name"])
        else:
            key_values[env["name"]] = env.get("value", "")
    environment = {"key_values": key_values}
    if host_env_keys:
        environment["host_env_keys"] = host_env_keys
    url = spec["url"] if "://" in spec["url"] else "oci://" + spec["url"]
    if url.startswith("file://"):
        code = {"local": {"filename": url[len("file://"):]}}
    else:
        code = {"remote": {"http_uri": {"uri": url, "cluster": fetch_cluster, "timeout": "30s"},
                           "sha256": spec.get("sha256", "")}}
    config = {
        "name": name,
        "root_id": spec.get("pluginName", ""),
        "failure_policy": FAIL_STRATEGY[spec.get("failStrategy", "FAIL_CLOSE")],
        "vm_config": {"runtime": "envoy.wasm.runtime.v8", "code": code,
                      "environment_variables": environment},
    }
    if spec.get("pluginConfig"):
        config["configuration"] = {"@type": STRING_VALUE_TYPE, "value": json.dumps(spec["pluginConfig"])}
    return {"name": name, "typed_config": {"@type": WASM_FILTER_TYPE, "config": config}}


def _hcm(listener: dict) -> dict:
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def _listener(template: dict, name: str, filters: list[dict], cluster: str) -> dict:
    """The harness template's listener as `name` (on a port the kernel picks), routing
    everything to `cluster` through `filters` and the router."""
    listener = copy.deepcopy(template)
    listener["name"] = name
    listener["address"]["socket_address"]["port_value"] = 0
    hcm = _hcm(listener)
    hcm["stat_prefix"] = name
    hcm["http_filters"] = [*filters, ROUTER]
    hcm["route_config"] = {"name": name, "virtual_hosts": [{"name": name, "domains": ["*"], "routes": [
        {"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "15s"}}]}]}
    return listener


def _static_cluster(name: str, port: int) -> dict:
    return {"name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}


def sidecar_config(config: dict, resources: list[dict], proxy: Proxy, fetch_cluster: str,
                   app_port: int, outbound: dict[str, int]) -> dict:
    """`config` (a harness Envoy config, its first listener in front of the `upstream`
    cluster) as the sidecar of `proxy`: `virtualInbound`, what callers reach, in front of the
    workload (`upstream`, nominally listening on `app_port`), with the filters of class
    SIDECAR_INBOUND; and for each `outbound` service (`name.namespace.svc.cluster.local` ->
    the port of the process standing for it, also its Service port) an outbound listener
    `0.0.0.0_<port>` to the cluster `outbound|<port>||<name>`, with the filters of class
    SIDECAR_OUTBOUND: where the workload's own calls to that service go."""
    config = copy.deepcopy(config)
    listeners = config["static_resources"]["listeners"]
    template, rest = listeners[0], listeners[1:]
    derived = [_listener(template, "virtualInbound", istiod_http_filters(
        resources, proxy, SIDECAR_INBOUND, app_port, fetch_cluster), "upstream")]
    for host, port in outbound.items():
        cluster = f"outbound|{port}||{host}"
        derived.append(_listener(template, f"0.0.0.0_{port}", istiod_http_filters(
            resources, proxy, SIDECAR_OUTBOUND, port, fetch_cluster), cluster))
        config["static_resources"]["clusters"].append(_static_cluster(cluster, port))
    config["static_resources"]["listeners"] = derived + rest
    return config


def gateway_config(config: dict, resources: list[dict], proxy: Proxy, fetch_cluster: str,
                   port: int) -> dict:
    """`config` as the gateway `proxy`: one listener of class GATEWAY (nominally on `port`, the
    Gateway listener's) routing to the service behind it (`upstream`)."""
    config = copy.deepcopy(config)
    listeners = config["static_resources"]["listeners"]
    listeners[0] = _listener(listeners[0], f"0.0.0.0_{port}", istiod_http_filters(
        resources, proxy, GATEWAY, port, fetch_cluster), "upstream")
    return config


def http_filter_names(config: dict, listener: str) -> list[str]:
    found = next(x for x in config["static_resources"]["listeners"] if x["name"] == listener)
    return [f["name"] for f in _hcm(found)["http_filters"]]


def listener_port(envoy, name: str) -> int:
    """The port the kernel gave the running Envoy's listener `name`."""
    statuses = json.loads(envoy.admin_get("/listeners?format=json"))["listener_statuses"]
    status = next(s for s in statuses if s["name"] == name)
    return int(status["local_address"]["socket_address"]["port_value"])


def request(port: int, method: str = "GET", path: str = "/", headers: dict | None = None,
            body: bytes | None = None, timeout: float = 10.0) -> Response:
    """One request to a loopback listener; never raises on HTTP error statuses."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method,
                                 headers=headers or {})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Response(resp.status, dict(resp.headers.items()), resp.read(), time.monotonic() - start)
    except urllib.error.HTTPError as e:
        return Response(e.code, dict(e.headers.items()), e.read(), time.monotonic() - start)


class ModuleServer(Service):
    """`python3 -m http.server` on a free loopback port, serving `directory`; its log (one
    line per request) is `log_text()`."""

    def __init__(self, workdir: Path, directory: Path, port: int | None = None):
        self.workdir = Path(workdir).resolve()
        self.directory = Path(directory)
        self.port = port or free_port()

    def start(self, timeout: float = 10.0) -> "ModuleServer":
        self.launch(f"modules-{self.port}",
                    [sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1",
                     "--directory", str(self.directory), str(self.port)],
                    self.workdir, self.port, timeout)
        return self

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def log_text(self) -> str:
        return self.proc.log_text() if self.proc else ""
