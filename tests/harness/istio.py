"""What Istio does with deploy/istio/wasmplugin.yaml, redone for a test Envoy.

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
- `ModuleServer`: a real HTTP server process (python -m http.server) serving the module.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .proc import Service, free_port

WASM_FILTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
STRING_VALUE_TYPE = "type.googleapis.com/google.protobuf.StringValue"
FAIL_STRATEGY = {"FAIL_CLOSE": "FAIL_CLOSED", "FAIL_OPEN": "FAIL_OPEN", "FAIL_RELOAD": "FAIL_RELOAD"}


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
