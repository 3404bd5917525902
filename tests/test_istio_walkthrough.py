"""docs/istio.md's walkthrough, run as written.

The numbered steps' `sh` blocks are read from the page in order (a changed page is what runs)
and run in bash from a directory that mirrors the repository with its own copy of `deploy/`
(so step 6 edits a copy of wasmplugin.yaml). Only the page's own variables get other values:
`IMAGE` (a real registry on loopback, Debian's docker-registry: `make publish` pushes there,
with `PLAIN_HTTP=1` in the environment as the page says for such a registry) and `ORDERS_URL`
(the sidecar below). An `output` block after a `sh` block is what that block must print (`...`
is any text; a line of it, any lines).

There is no cluster: `kubectl` and `istioctl` are a model (harness/kube.py) that takes objects
in order and refuses a namespace, Secret, key, ConfigMap or service account named before it
exists, a manifest that fails its schema, a WasmPlugin that would reach a sidecar without its
host variables, a Secret deleted while a workload uses it. What the cluster would run is run
for real from the model's objects:

- the Redis of redis.yaml: its init container's script with the Secret's passwords, then
  redis-server with its redis.conf (the pod's volumes are directories here); its ACL is checked
  against the gateway commands the scripts need (harness.proc.GATEWAY_COMMANDS);
- webdis: the stack's, with the Basic-auth pair of the Secret webdis-credentials;
- the sidecar of Deployment orders: Envoy on the test stack, its Wasm filter istiod's mapping
  of the applied WasmPlugin (harness.istio), the module pulled from the registry by tag and
  checked against `sha256` as istio-agent does, then served to Envoy by a module server; its
  environment from the Secret the patched pod template names; the stats tags from the ConfigMap
  its bootstrap override names; Istio's stats inclusion list with the annotation's prefixes.
  When the objects change (WasmPlugin applied or deleted, template patched), the next request
  finds a sidecar configured from the new ones.
"""

from __future__ import annotations

import base64
import copy
import gzip
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis as redispy
import yaml

from harness.istio import ModuleServer, istiod_wasm_filter
from harness.kube import (BOOTSTRAP_OVERRIDE, ApiModel, CommandServer, ModelError, applies_to_server,
                          pod_metadata, pod_spec, selects, write_shims)
from harness.proc import ROOT, Service, free_port, gateway_acl_rules, require_binary
from harness.registry import OCI_MANIFEST, Registry
from test_istio_manifests import api_errors
from test_redis_acl_restart import scripts_survive_a_kill

DOC = ROOT / "docs" / "istio.md"
WASM = ROOT / "target" / "wasm32-wasip1" / "release" / "coordination_guard.wasm"
FETCH_CLUSTER = "wasm_modules"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
# Mirrored into the walkthrough's directory (cargo and make find the same sources and build).
LINKED = ("Makefile", "Cargo.toml", "Cargo.lock", ".cargo", "src", "benches", "bench", "target",
          "envoy", "tests")
# The operator's workload before the walkthrough: what the patch changes and the rollback restores.
WORKLOAD = {
    "apiVersion": "apps/v1", "kind": "Deployment",
    "metadata": {"name": "orders", "namespace": "orders"},
    "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "orders"}},
             "template": {"metadata": {"labels": {"app": "orders"}},
                          "spec": {"containers": [{"name": "orders", "image": "example.com/orders:1",
                                                   "ports": [{"containerPort": 8080}]}]}}},
}
SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "orders", "namespace": "orders"},
           "spec": {"selector": {"app": "orders"}, "ports": [{"name": "http", "port": 8080}]}}
# Istio's stats inclusion list (pilot-agent's bootstrap): these prefixes, the proxy config's
# inclusionPrefixes, and these suffixes; every other stat is not created.
ISTIO_STATS_PREFIXES = ("reporter=", "cluster_manager", "listener_manager", "server", "cluster.xds-grpc",
                        "wasm", "component", "istio")
ISTIO_STATS_SUFFIXES = ("rbac.allowed", "rbac.denied", "shadow_allowed", "shadow_denied",
                        "downstream_cx_active")


# --- the page ----------------------------------------------------------------------------------------

@dataclass
class Block:
    code: str
    expected: str | None = None


@dataclass
class Step:
    number: int
    title: str
    blocks: list[Block] = field(default_factory=list)


def walkthrough(text: str) -> list[Step]:
    section = re.search(r"^## Walkthrough\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "docs/istio.md has no '## Walkthrough' section followed by another section"
    parts = re.split(r"^### (\d+)\. (.+)$", section.group(1), flags=re.M)
    steps = []
    for number, title, body in zip(parts[1::3], parts[2::3], parts[3::3]):
        step = Step(int(number), title.strip())
        for lang, code in re.findall(r"^```(\w*)\n(.*?)^```$", body, re.S | re.M):
            if lang == "sh":
                step.blocks.append(Block(code))
            elif lang == "output":
                assert step.blocks and step.blocks[-1].expected is None, \
                    f"step {number}: an output block must follow a sh block"
                step.blocks[-1].expected = code
        steps.append(step)
    assert [s.number for s in steps] == list(range(1, 11)), [s.number for s in steps]
    assert all(s.blocks for s in steps), [s.number for s in steps if not s.blocks]
    return steps


def substitute(steps: list[Step], values: dict[str, str]) -> dict[str, str]:
    """Give the page's variables (`NAME=value` lines) the test's values, in the commands and in
    the outputs they appear in; returns the page's own values."""
    defaults: dict[str, str] = {}
    for step in steps:
        for block in step.blocks:
            lines = block.code.split("\n")
            for i, line in enumerate(lines):
                m = re.fullmatch(r"([A-Z_]+)=(\S+)", line)
                if m and m.group(1) in values:
                    assert m.group(1) not in defaults, f"{m.group(1)} is set twice"
                    defaults[m.group(1)] = m.group(2)
                    lines[i] = f"{m.group(1)}={shlex.quote(values[m.group(1)])}"
            block.code = "\n".join(lines)
    assert set(defaults) == set(values), f"the page sets {sorted(defaults)}, not {sorted(values)}"
    for step in steps:
        for block in step.blocks:
            if block.expected is not None:
                for name, default in defaults.items():
                    block.expected = block.expected.replace(default, values[name])
    return defaults


def _normal(text: str) -> list[str]:
    return [re.sub(r"[ \t]+", " ", line).rstrip() for line in text.splitlines()]


def matches(expected: str, actual: str) -> bool:
    pattern = ""
    for line in _normal(expected):
        if line.strip() == "...":
            pattern += r"(?:[^\n]*\n)*?"
        else:
            pattern += r"[^\n]*".join(re.escape(p) for p in line.split("...")) + r"\n"
    text = "".join(line + "\n" for line in _normal(actual))
    return re.fullmatch(pattern, text) is not None


# --- the shell ---------------------------------------------------------------------------------------

class Shell:
    """bash in the walkthrough's directory, one block at a time; the variables a block sets
    (all exported: `set -a`) are there for the next."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root = root
        self.env = env
        self.state = root.parent / "shell.env"

    def run(self, code: str, timeout: float = 180) -> subprocess.CompletedProcess:
        script = f"set -euo pipefail\nset -a\n{code}\nenv -0 > {shlex.quote(str(self.state))}\n"
        result = subprocess.run(["bash", "-c", script], cwd=self.root, env=self.env, capture_output=True,
                                text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if result.returncode == 0:
            self.env = dict(item.split("=", 1) for item in self.state.read_text().split("\0") if "=" in item)
        return result


def user_env(bin_dir: Path) -> dict[str, str]:
    """An operator's shell with the model's kubectl and istioctl first on PATH: none of the
    outer make's or pytest's variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MAKE", "MFLAGS", "PYTEST", "CG_")) and k not in ("PLAIN_HTTP", "IMAGE")}
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def mirror(root: Path) -> Path:
    root.mkdir(parents=True)
    for name in LINKED:
        (root / name).symlink_to(ROOT / name)
    shutil.copytree(ROOT / "deploy", root / "deploy")
    return root


# --- the cluster's side ------------------------------------------------------------------------------

def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` references in a container's command: a defined variable is
    replaced, `$$` is a `$`, anything else stays."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


class ManifestRedis(Service):
    """The pod of redis.yaml's StatefulSet as a kubelet would run it, on a free loopback port:
    the init container's command with its environment from the Secrets, then the redis
    container's command. Each volume is a directory of `workdir` (a ConfigMap's files written
    there), and a path under a mount, in a command or a ConfigMap file, is read as that
    directory: the pod's file system, here."""

    def __init__(self, model: ApiModel, statefulset: dict, workdir: Path):
        self.model = model
        self.statefulset = copy.deepcopy(statefulset)
        self.workdir = Path(workdir)
        self.port = free_port()
        self.namespace = statefulset["metadata"]["namespace"]
        self.mounts: dict[str, Path] = {}

    def host(self, text: str) -> str:
        for mount in sorted(self.mounts, key=len, reverse=True):
            text = re.sub(rf"(?<![\w/]){re.escape(mount)}(?=/|\b|$)", str(self.mounts[mount]), text)
        return text

    def start(self, timeout: float = 15.0) -> "ManifestRedis":
        spec = pod_spec(self.statefulset)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for template in self.statefulset["spec"].get("volumeClaimTemplates", []):
            volumes[template["metadata"]["name"]] = {"name": template["metadata"]["name"]}
        [init] = spec["initContainers"]
        [main] = spec["containers"]
        for container in (init, main):
            for mount in container.get("volumeMounts", []):
                path = self.workdir / "volumes" / mount["name"]
                path.mkdir(parents=True, exist_ok=True)
                self.mounts[mount["mountPath"]] = path
        for name, volume in volumes.items():
            if "configMap" in volume:
                data = self.model.get("ConfigMap", self.namespace, volume["configMap"]["name"])["data"]
                for file, text in data.items():
                    (self.workdir / "volumes" / name / file).write_text(self.host(text))
        env = self.model.resolve_env(self.namespace, init)
        command = [self.host(k8s_expand(part, env)) for part in init["command"] + init.get("args", [])]
        result = subprocess.run(command, cwd=self.host(init.get("workingDir", "/")), capture_output=True,
                                text=True, timeout=30, env={"PATH": os.environ["PATH"], **env},
                                stdin=subprocess.DEVNULL)
        assert result.returncode == 0, f"redis.yaml's init container failed:\n{result.stderr}"
        argv = [self.host(part) for part in main["command"] + main.get("args", [])]
        argv[0] = require_binary(argv[0])
        argv += ["--port", str(self.port), "--bind", "127.0.0.1", "--daemonize", "no"]
        self.launch(f"manifest-redis-{self.port}", argv, self.workdir, self.port, timeout)
        return self

    def client(self, username: str | None = None, password: str | None = None):
        return redispy.Redis(host="127.0.0.1", port=self.port, socket_timeout=5,
                             username=username, password=password)


def istio_stats_matcher(prefixes: list[str]) -> dict:
    patterns = [{"prefix": ISTIO_STATS_PREFIXES[0]}] + [{"prefix": p} for p in prefixes]
    patterns += [{"prefix": p} for p in ISTIO_STATS_PREFIXES[1:]]
    patterns += [{"suffix": s} for s in ISTIO_STATS_SUFFIXES]
    return {"inclusion_list": {"patterns": patterns}}


class Mesh:
    """What Istio runs for the model's objects: the sidecar of Deployment orders (real Envoy on
    the stack, listening on one port for the whole walkthrough: ORDERS_URL), and webdis with the
    credential of its Secret."""

    def __init__(self, model: ApiModel, stack, registry: Registry, workdir: Path):
        self.model, self.stack, self.registry = model, stack, registry
        self.workdir = Path(workdir)
        self.port = free_port()
        (self.workdir / "modules").mkdir(parents=True)
        self.modules = ModuleServer(self.workdir / "module-server", self.workdir / "modules").start()
        self.envoy = None
        self.current: str | None = None
        self.generation = 0
        self.pulled: list[bytes] = []
        self.redis: ManifestRedis | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def desired(self) -> dict:
        workload = self.model.get("Deployment", "orders", "orders")
        if workload is None:
            raise ModelError("deployment orders/orders does not exist")
        metadata, spec = pod_metadata(workload), pod_spec(workload)
        if not self.model.injected("orders", metadata):
            raise ModelError("the pods of orders have no sidecar (namespace orders has no injection label)")
        labels = metadata.get("labels") or {}
        plugins = sorted((p for p in self.model.list("WasmPlugin", "orders")
                          if selects(p["spec"].get("selector"), labels) and applies_to_server(p)),
                         key=lambda p: p["metadata"]["name"])
        proxy = next((c for c in spec["containers"] if c["name"] == "istio-proxy"), {})
        annotations = metadata.get("annotations") or {}
        tags = []
        if BOOTSTRAP_OVERRIDE in annotations:
            configmap = self.model.get("ConfigMap", "orders", annotations[BOOTSTRAP_OVERRIDE])
            bootstrap = json.loads(configmap["data"]["custom_bootstrap.json"])
            tags = bootstrap.get("stats_config", {}).get("stats_tags", [])
        proxy_config = yaml.safe_load(annotations.get("proxy.istio.io/config", "")) or {}
        webdis = self.model.get("Deployment", "redis", "webdis")
        basic = None
        if webdis is not None:
            basic = self.model.resolve_env("redis", pod_spec(webdis)["containers"][0]).get("CG_GATEWAY_BASIC_AUTH")
        return {"plugins": plugins, "env": self.model.resolve_env("orders", proxy), "tags": tags,
                "prefixes": proxy_config.get("proxyStatsMatcher", {}).get("inclusionPrefixes", []),
                "webdis": basic}

    def agent(self, plugin: dict) -> dict:
        """istio-agent's part: pull the image the url names, check its manifest digest against
        `sha256`, take plugin.wasm from its last layer; then istiod's filter, its module served
        to Envoy from here with the .wasm's own SHA-256."""
        spec = plugin["spec"]
        reference = spec["url"].removeprefix("oci://")
        host, path = reference.split("/", 1)
        repository, tag = path.rsplit(":", 1)
        if host != self.registry.address:
            raise ModelError(f"istio-agent: cannot fetch Wasm module {spec['url']}: no registry at {host}")
        request = urllib.request.Request(f"http://{host}/v2/{repository}/manifests/{tag}",
                                         headers={"Accept": OCI_MANIFEST})
        with urllib.request.urlopen(request, timeout=10) as response:
            raw = response.read()
        digest = hashlib.sha256(raw).hexdigest()
        if digest != spec.get("sha256"):
            raise ModelError(f"istio-agent: cannot fetch Wasm module {spec['url']}: its manifest "
                             f"digest is {digest}, the WasmPlugin's sha256 {spec.get('sha256')}")
        layer = json.loads(raw)["layers"][-1]
        with urllib.request.urlopen(f"http://{host}/v2/{repository}/blobs/{layer['digest']}", timeout=10) as r:
            blob = r.read()
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob))) as tar:
            wasm = next(tar.extractfile(m).read() for m in tar if Path(m.name).name == "plugin.wasm")
        self.pulled.append(wasm)
        name = f"{digest}.wasm"
        (self.workdir / "modules" / name).write_bytes(wasm)
        wasm_filter = istiod_wasm_filter(plugin, FETCH_CLUSTER)
        remote = wasm_filter["typed_config"]["config"]["vm_config"]["code"]["remote"]
        remote["http_uri"]["uri"] = self.modules.url(name)
        remote["sha256"] = hashlib.sha256(wasm).hexdigest()
        return wasm_filter

    def sync(self):
        want = self.desired()
        key = json.dumps(want, sort_keys=True)
        if key == self.current and self.envoy is not None and self.envoy.alive():
            return self.envoy
        webdis = self.stack.webdis
        if want["webdis"] and want["webdis"] != f"{webdis.user}:{webdis.password}":
            webdis.user, webdis.password = want["webdis"].split(":", 1)
            webdis.restart()
        if self.envoy is not None:
            self.envoy.stop()
            self.stack.envoys.remove(self.envoy)
            self.envoy = None
        self.generation += 1
        clusters = {FETCH_CLUSTER: self.modules.port}
        service = self.model.get("Service", "redis", "webdis")
        if service is not None:
            for port in service["spec"]["ports"]:
                clusters[f"outbound|{port['port']}||webdis.redis.svc.cluster.local"] = webdis.port
        envoy = self.stack.new_envoy(self.workdir / f"sidecar-{self.generation}",
                                     {"redis": {}} if want["plugins"] else None, extra_clusters=clusters,
                                     process_env=want["env"], listener_port=self.port)
        filters = envoy.config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"]["http_filters"]
        if want["plugins"]:
            index = next(i for i, f in enumerate(filters) if f["name"] == "coordination-guard")
            filters[index:index + 1] = [self.agent(p) for p in want["plugins"]]
        envoy.config["stats_config"]["stats_tags"] = want["tags"]
        envoy.config["stats_config"]["stats_matcher"] = istio_stats_matcher(want["prefixes"])
        self.stack.envoys.append(envoy)  # stopped with the stack
        self.envoy = envoy
        envoy.start()
        self.current = key
        return envoy

    # The hooks of the model: what runs in the pods.

    def curl_in_client_pod(self, argv: list[str], stdin: bytes):
        if not argv or argv[0] != "curl":
            raise ModelError(f"the model runs only curl in the client pod, not {argv[:1]}")
        self.sync()  # the request goes to the orders sidecar as the objects now configure it
        result = subprocess.run([require_binary("curl"), *argv[1:]], capture_output=True, timeout=60,
                                stdin=subprocess.DEVNULL)
        return result.returncode, result.stdout, result.stderr

    def pilot_agent(self, argv: list[str], stdin: bytes):
        if argv[:3] != ["pilot-agent", "request", "GET"] or len(argv) != 4:
            raise ModelError(f"the model runs only `pilot-agent request GET <path>` in istio-proxy, not {argv}")
        return 0, self.sync().admin_get("/" + argv[3].lstrip("/")).encode(), b""

    def proxy_logs(self) -> str:
        return self.sync().log_text()

    def istioctl(self, argv: list[str]):
        """`istioctl proxy-config ecds deployment/orders.orders`: the Wasm HTTP filters of the
        proxy's configuration, in istioctl's two columns (NAME, type without its type URL
        prefix)."""
        if argv not in (["proxy-config", "ecds", "deployment/orders.orders"],
                        ["proxy-config", "ecds", "deployment/orders", "-n", "orders"]):
            raise ModelError(f"the model has no `istioctl {' '.join(argv)}`")
        dump = json.loads(self.sync().admin_get("/config_dump"))
        names = []

        def walk(node):
            if isinstance(node, dict):
                for f in node.get("http_filters", []) or []:
                    if (f.get("typed_config") or {}).get("@type") == WASM_TYPE:
                        names.append(f["name"])
                for value in node.values():
                    walk(value)
            elif isinstance(node, list):
                for value in node:
                    walk(value)

        walk(dump)
        width = max([len("ECDS NAME"), *map(len, names)]) + 5
        rows = [("ECDS NAME", "Type")] + [(n, WASM_TYPE.split("/", 1)[1]) for n in sorted(set(names))]
        return 0, "".join(f"{a.ljust(width)}{b}\n" for a, b in rows).encode(), b""

    def start_redis(self, obj: dict) -> None:
        if (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]) == ("StatefulSet", "redis", "redis"):
            if self.redis is not None:
                self.redis.stop()
            self.redis = ManifestRedis(self.model, obj, self.workdir / "redis-pod").start()

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        if self.redis is not None:
            self.redis.stop()
        self.modules.stop()


def new_model(workdir: Path) -> ApiModel:
    kubectl = require_binary("kubectl", fix="make deps-kubectl")
    return ApiModel(kubectl, api_errors, workdir)


# --- the walkthrough ---------------------------------------------------------------------------------

def fail_with(result: subprocess.CompletedProcess, what: str) -> str:
    return f"{what} failed (exit {result.returncode}):\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr[-6000:]}"


@pytest.fixture
def world(stack_factory, tmp_path):
    require_binary("openssl", fix="make deps-kubectl")
    require_binary("skopeo", fix="make deps-oci")
    assert WASM.exists(), f"{WASM} is missing: run `make build`"
    registry = Registry(tmp_path / "registry").start()
    stack = stack_factory(None, envoys=0)
    model = new_model(tmp_path / "model")
    mesh = Mesh(model, stack, registry, tmp_path / "mesh")
    model.on_admit.append(mesh.start_redis)
    model.exec_hooks[("orders", "pod/curl", "curl")] = mesh.curl_in_client_pod
    model.exec_hooks[("orders", "deployment/orders", "istio-proxy")] = mesh.pilot_agent
    model.logs_hooks[("orders", "deployment/orders", "istio-proxy")] = mesh.proxy_logs
    model.istioctl_hook = mesh.istioctl
    server = CommandServer(tmp_path / "kube.sock",
                           lambda tool, argv, cwd, stdin: getattr(model, tool)(argv, cwd, stdin)).start()
    write_shims(tmp_path / "bin", tmp_path / "kube.sock")
    try:
        yield model, mesh, stack, registry, tmp_path
    finally:
        server.stop()
        mesh.stop()
        registry.stop()
    assert server.errors == [], server.errors[0]


def check_redis_acl(model: ApiModel, redis, key_prefix: str) -> None:
    """redis.yaml's Redis as the Secret of step 2 configured it: the cg-gateway line is the
    gateway ACL of docs/security.md for the WasmPlugin's key_prefix, nothing else works."""
    gateway = model.secret("redis", "redis-users", "gateway-password")
    admin = model.secret("redis", "redis-users", "admin-password")
    sha = lambda p: hashlib.sha256(p.encode()).hexdigest()  # noqa: E731
    acl = (redis.mounts["/acl"] / "users.acl").read_text().splitlines()
    assert acl == [f"user default reset off {gateway_acl_rules(key_prefix)}",
                   f"user cg-gateway reset on #{sha(gateway)} {gateway_acl_rules(key_prefix)}",
                   f"user admin reset on #{sha(admin)} ~* &* +@all"], acl
    with pytest.raises(redispy.exceptions.AuthenticationError):  # NOAUTH: default is off
        redis.client().ping()
    with pytest.raises(redispy.exceptions.AuthenticationError):  # and has no password
        redis.client("default", "").ping()
    with pytest.raises(redispy.exceptions.AuthenticationError):
        redis.client("cg-gateway", "not the password").ping()
    gw = redis.client("cg-gateway", gateway)
    key = f"{key_prefix}:walkthrough"
    assert gw.eval("return redis.call('SET', KEYS[1], ARGV[1])", 1, key, "x") == b"OK"
    for denied in (lambda: gw.eval("return redis.call('GET', KEYS[1])", 1, "elsewhere"),
                   lambda: gw.keys("*"), lambda: gw.execute_command("CONFIG", "GET", "maxmemory"),
                   lambda: gw.flushall()):
        with pytest.raises(redispy.exceptions.ResponseError, match="(?i)noperm|permission|can't access"):
            denied()
    root = redis.client("admin", admin)
    assert root.get(key) == b"x"
    assert root.config_get("appendonly") == {"appendonly": "yes"}
    assert root.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert gw.close() is None and root.close() is None


def replays(output: str) -> list[tuple[str, str, str]]:
    """(body, status, idempotent-replayed) of each answer step 9's idempotent requests printed."""
    return re.findall(r"^(.*)\n(\d{3}) replayed=(\S*)$", output, re.M)


def test_the_walkthrough_runs_as_written(world):
    model, mesh, stack, registry, tmp_path = world
    steps = walkthrough(DOC.read_text())
    image = f"{registry.address}/coordination-guard:walkthrough"
    defaults = substitute(steps, {"IMAGE": image, "ORDERS_URL": mesh.url})
    # The page's service address is the workload's Service as the walkthrough's example has it.
    assert defaults["ORDERS_URL"] == "http://orders.orders.svc.cluster.local:8080"
    root = mirror(tmp_path / "checkout" / "coordination-guard")
    env = user_env(tmp_path / "bin")
    env["PLAIN_HTTP"] = "1"  # the page: PLAIN_HTTP=1 for a registry that speaks plain HTTP
    shell = Shell(root, env)
    outputs: dict[int, list[str]] = {}

    def run(step: Step, timeout: float = 180) -> list[str]:
        printed = []
        for i, block in enumerate(step.blocks):
            result = shell.run(block.code, timeout)
            assert result.returncode == 0, fail_with(result, f"step {step.number} ({step.title}), block {i + 1}")
            if block.expected is not None:
                assert matches(block.expected, result.stdout), \
                    (f"step {step.number}, block {i + 1} printed:\n{result.stdout}\n"
                     f"the page says:\n{block.expected}")
            printed.append(result.stdout)
        outputs[step.number] = printed
        return printed

    s = {step.number: step for step in steps}

    # 1. Namespaces; then the operator's workload, which the walkthrough assumes.
    run(s[1])
    for name in ("redis", "orders"):
        assert model.injected(name, {}), name
    model.admit(copy.deepcopy(WORKLOAD), "the operator's workload")
    model.admit(copy.deepcopy(SERVICE), "the operator's workload")

    # 2. Secrets: one credential in webdis's form and in the sidecar's.
    run(s[2])
    basic = model.secret("redis", "webdis-credentials", "CG_GATEWAY_BASIC_AUTH")
    authorization = model.secret("orders", "coordination-guard-gateway", "authorization")
    assert authorization == "Basic " + base64.b64encode(basic.encode()).decode()
    assert re.fullmatch(r"cg:[0-9a-f]{48}", basic), basic

    # 3. Redis: the pod of redis.yaml runs, with the ACL of docs/security.md.
    run(s[3])
    assert mesh.redis is not None and mesh.redis.alive()
    plugin_file = root / "deploy" / "istio" / "wasmplugin.yaml"
    key_prefix = yaml.safe_load(plugin_file.read_text())["spec"]["pluginConfig"]["redis"]["key_prefix"]
    check_redis_acl(model, mesh.redis, key_prefix)
    assert ("PersistentVolumeClaim", "redis", "data-redis-0") in model.objects

    # 4. webdis logs in to Redis as cg-gateway with the password Redis has.
    run(s[4])
    [container] = pod_spec(model.get("Deployment", "redis", "webdis"))["containers"]
    webdis_env = model.resolve_env("redis", container)
    assert webdis_env["REDIS_GATEWAY_PASSWORD"] == model.secret("redis", "redis-users", "gateway-password")
    assert webdis_env["CG_GATEWAY_BASIC_AUTH"] == basic

    # 5. make publish pushed the built module; DIGEST is the registry's manifest digest.
    run(s[5], timeout=900)
    digest = shell.env["DIGEST"]
    raw, header_digest, _ = registry.manifest("coordination-guard", "walkthrough")
    assert header_digest == f"sha256:{digest}" == "sha256:" + hashlib.sha256(raw).hexdigest()

    # 6. The copy of wasmplugin.yaml names that image and digest, and nothing else changed.
    run(s[6], timeout=300)
    edited = yaml.safe_load(plugin_file.read_text())
    assert (edited["spec"]["url"], edited["spec"]["sha256"]) == (f"oci://{image}", digest)
    original = yaml.safe_load((ROOT / "deploy" / "istio" / "wasmplugin.yaml").read_text())
    original["spec"].update(url=edited["spec"]["url"], sha256=digest)
    assert edited == original

    # 7. The patched template: the credential from the Secret, the stats annotations.
    run(s[7])
    patched = model.get("Deployment", "orders", "orders")
    metadata = pod_metadata(patched)
    proxy = next(c for c in pod_spec(patched)["containers"] if c["name"] == "istio-proxy")
    assert model.resolve_env("orders", proxy) == {"CG_GATEWAY_AUTHORIZATION": authorization}
    assert metadata["annotations"][BOOTSTRAP_OVERRIDE] == "coordination-guard-stats"
    assert "wasmcustom.cg." in metadata["annotations"]["proxy.istio.io/config"]
    assert [c["name"] for c in pod_spec(patched)["containers"]] == ["istio-proxy", "orders"]

    # 8. The WasmPlugin is applied as edited.
    run(s[8])
    assert model.get("WasmPlugin", "orders", "coordination-guard")["spec"]["sha256"] == digest

    # 9. The page's requests through the sidecar, its metrics, its log and istioctl's view.
    before = stack.upstream.count("POST", "/orders")
    client, tenantless, idempotent, metrics, logs = run(s[9])
    assert mesh.pulled == [WASM.read_bytes()]  # the module the agent pulled is the one built
    assert mesh.envoy.stat("wasm.remote_load_fetch_successes") == 1
    answers = replays(idempotent)
    assert len(answers) == 2 and answers[0][0] == answers[1][0] and answers[0][1] == answers[1][1], answers
    assert [a[2] for a in answers] == ["", "true"]
    # The 401 never reached the service; the replay did not either.
    assert stack.upstream.count("POST", "/orders") == before + 1
    samples = mesh.envoy.prometheus_samples()
    allowed = [v for k, v in samples.items() if k.startswith('cg_policy_limit_allowed{cg_policy="create-order",')]
    assert allowed and all(v >= 1 for v in allowed), samples
    assert "configuration loaded" in logs

    # 10. Roll back: the same request now reaches the service, then everything goes.
    run(s[10])
    status = outputs[10][0].strip().splitlines()[-1]
    assert status == "200", outputs[10][0]  # the service's own answer, no longer the filter's 401
    assert stack.upstream.count("POST", "/orders") == before + 2
    assert not any(f["typed_config"].get("@type") == WASM_TYPE for f in
                   mesh.envoy.config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
                       "typed_config"]["http_filters"])
    restored = model.get("Deployment", "orders", "orders")
    template = copy.deepcopy(restored["spec"]["template"])
    if template["metadata"].get("annotations") == {}:
        del template["metadata"]["annotations"]
    assert template == WORKLOAD["spec"]["template"]
    left = sorted(f"{k} {ns}/{n}" for k, ns, n in model.objects)
    assert left == ["Deployment orders/orders", "Namespace /orders", "Namespace /redis",
                    "PersistentVolumeClaim redis/data-redis-0", "Service orders/orders"], left


# --- the model refuses the steps out of order ---------------------------------------------------------

def test_the_model_refuses_what_the_walkthrough_must_not_do(tmp_path):
    """The order the page keeps is the one the model lets through; the other orders fail with
    the reason, before anything of the failing object is stored."""
    model = new_model(tmp_path)

    def kubectl(*argv: str, ok: bool = True, says: str = "") -> str:
        rc, out, err = model.kubectl(list(argv), ROOT)
        text = (out + err).decode()
        assert (rc == 0) == ok, text
        assert says in text, text
        return text

    kubectl("apply", "-f", "deploy/istio/webdis.yaml", ok=False, says='namespaces "redis" not found')
    kubectl("apply", "-f", "deploy/istio/namespaces.yaml")
    kubectl("apply", "-f", "deploy/istio/redis.yaml", ok=False, says="Secret redis/redis-users, which does not exist")
    assert model.get("StatefulSet", "redis", "redis") is None
    kubectl("-n", "redis", "create", "secret", "generic", "redis-users", "--from-literal=gateway-password=g")
    kubectl("apply", "-f", "deploy/istio/redis.yaml", ok=False, says="key 'admin-password'")
    kubectl("-n", "redis", "delete", "secret", "redis-users")
    kubectl("-n", "redis", "create", "secret", "generic", "redis-users", "--from-literal=gateway-password=g",
            "--from-literal=admin-password=a")
    kubectl("-n", "redis", "create", "secret", "generic", "redis-users", "--from-literal=x=y", ok=False,
            says="already exists")
    kubectl("apply", "-f", "deploy/istio/redis.yaml")
    kubectl("apply", "-f", "deploy/istio/webdis.yaml", ok=False, says="Secret redis/webdis-credentials")
    kubectl("-n", "redis", "create", "secret", "generic", "webdis-credentials", "--from-literal=CG_GATEWAY_BASIC_AUTH=cg:p")
    kubectl("apply", "-f", "deploy/istio/webdis.yaml")
    model.admit(copy.deepcopy(WORKLOAD), "the operator's workload")

    plugin = yaml.safe_load((ROOT / "deploy" / "istio" / "wasmplugin.yaml").read_text())
    placeholder = tmp_path / "placeholder.yaml"
    placeholder.write_text(yaml.safe_dump(plugin))
    kubectl("apply", "-f", str(placeholder), ok=False, says="placeholder sha256")
    plugin["spec"]["sha256"] = "a" * 64
    published = tmp_path / "published.yaml"
    published.write_text(yaml.safe_dump(plugin))
    # Before the workload patch: the sidecar would not have the credential's variable.
    kubectl("apply", "-f", str(published), ok=False, says="has no CG_GATEWAY_AUTHORIZATION")
    kubectl("-n", "orders", "patch", "deployment", "orders", "--patch-file", "deploy/istio/patches/workload.yaml",
            ok=False, says="Secret orders/coordination-guard-gateway")
    kubectl("-n", "orders", "create", "secret", "generic", "coordination-guard-gateway",
            "--from-literal=authorization=Basic Y2c6cA==")
    kubectl("-n", "orders", "patch", "deployment", "orders", "--patch-file", "deploy/istio/patches/workload.yaml",
            ok=False, says="ConfigMap orders/coordination-guard-stats")
    kubectl("apply", "-f", "deploy/istio/stats-bootstrap.yaml")
    kubectl("-n", "orders", "patch", "deployment", "orders", "--patch-file", "deploy/istio/patches/workload.yaml")
    wrong = copy.deepcopy(plugin)
    wrong["spec"]["failStrategy"] = "FAIL_CLOSED"  # Envoy's spelling, not Istio's
    (tmp_path / "wrong.yaml").write_text(yaml.safe_dump(wrong))
    kubectl("apply", "-f", str(tmp_path / "wrong.yaml"), ok=False, says="fails its schema")
    kubectl("apply", "-f", str(published))
    # Rolling back in the wrong order: the credential or the patch while the plugin still selects the pods.
    kubectl("-n", "orders", "delete", "secret", "coordination-guard-gateway", ok=False,
            says="still used by Deployment orders")
    kubectl("-n", "orders", "patch", "deployment", "orders", "--patch-file",
            "deploy/istio/patches/workload-undo.yaml", ok=False, says="has no CG_GATEWAY_AUTHORIZATION")
    kubectl("delete", "-f", str(published))
    kubectl("-n", "orders", "patch", "deployment", "orders", "--patch-file", "deploy/istio/patches/workload-undo.yaml")
    kubectl("delete", "-f", "deploy/istio/stats-bootstrap.yaml")
    kubectl("-n", "orders", "delete", "secret", "coordination-guard-gateway")
    kubectl("-n", "orders", "delete", "secret", "coordination-guard-gateway", ok=False, says="NotFound")


def test_the_page_points_in_no_circle():
    """docs/istio.md is the walkthrough (the README points to it): neither it nor the
    walkthrough's manifests point back to a README section for it, and every step has its
    commands."""
    text = DOC.read_text()
    assert "README" not in text
    istio = ROOT / "deploy" / "istio"
    for path in [*istio.glob("*.yaml"), *(istio / "patches").glob("*.yaml")]:
        assert "README" not in path.read_text(), path
    steps = walkthrough(text)
    assert [s.title for s in steps][:2] == ["Namespaces", "Passwords and Secrets"]


def test_the_pages_acl_lines_are_the_scripts_commands():
    """The cg-gateway and default lines docs/istio.md and docs/security.md show are the gateway
    ACL the scripts and the replay of the append-only file need (GATEWAY_COMMANDS, which
    tests/test_scripts_acl.py keeps equal to them), default switched off."""
    plugin = yaml.safe_load((ROOT / "deploy" / "istio" / "wasmplugin.yaml").read_text())
    key_prefix = plugin["spec"]["pluginConfig"]["redis"]["key_prefix"]
    istio = DOC.read_text().splitlines()
    assert f"user cg-gateway reset on #<sha256 of gateway-password> {gateway_acl_rules(key_prefix)}" in istio
    assert f"user default reset off {gateway_acl_rules(key_prefix)}" in istio
    security = (ROOT / "docs" / "security.md").read_text().splitlines()
    rules = gateway_acl_rules("<key_prefix>")
    assert f"ACL SETUSER cg-gateway reset on >GATEWAY_PASSWORD {rules}" in security
    assert f"ACL SETUSER default reset off {rules}" in security


def test_redis_yaml_keeps_every_script_write_across_a_kill(tmp_path):
    """redis.yaml's Redis, as its init container and redis.conf make it, killed (SIGKILL) and
    started again from its append-only file, has every key, value and TTL the scripts wrote as
    cg-gateway. Redis replays that file as `default`, checking every command of a replayed
    transaction (each script's writes) against default's rules, switched off or not
    (redis/redis#14541, Redis 7.0 to 7.4): with `user default reset` every such write was
    refused at the restart (tests/test_redis_acl_restart.py shows the loss)."""
    model = new_model(tmp_path / "model")

    def kubectl(*argv: str) -> None:
        rc, out, err = model.kubectl(list(argv), ROOT)
        assert rc == 0, (out + err).decode()

    kubectl("apply", "-f", "deploy/istio/namespaces.yaml")
    gateway_password, admin_password = os.urandom(12).hex(), os.urandom(12).hex()
    kubectl("-n", "redis", "create", "secret", "generic", "redis-users",
            f"--from-literal=gateway-password={gateway_password}",
            f"--from-literal=admin-password={admin_password}")
    kubectl("apply", "-f", "deploy/istio/redis.yaml")
    server = ManifestRedis(model, model.get("StatefulSet", "redis", "redis"), tmp_path / "redis-pod")
    server.start()
    try:
        plugin = yaml.safe_load((ROOT / "deploy" / "istio" / "wasmplugin.yaml").read_text())
        key_prefix = plugin["spec"]["pluginConfig"]["redis"]["key_prefix"]
        admin = server.client("admin", admin_password)
        assert admin.config_get("appendonly") == {"appendonly": "yes"}
        admin.close()
        scripts_survive_a_kill(server, server.client("cg-gateway", gateway_password),
                               lambda: server.client("admin", admin_password), key_prefix)
    finally:
        server.stop()


def test_output_blocks_match_as_the_page_says():
    assert matches("a\n...\nc ... e\n", "a\nb\nb2\nc d  e\n")
    assert matches("...\nx", "x\n")
    assert not matches("a\nc ... e\n", "a\nb\nc d e\n")
    assert not matches("401 application/problem+json\n", "200 application/json\n")
