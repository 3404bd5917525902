"""A model of the Kubernetes API server behind `kubectl`, to run a document's commands without
a cluster (tests/test_istio_walkthrough.py runs docs/istio.md's walkthrough through it).

`ApiModel` keeps objects by kind, namespace and name and takes them in the order the commands
give them. It refuses, with a `ModelError` that says why, what a cluster would refuse and what
would leave a workload broken though the API server took it:

- an object in a namespace that does not exist yet, or one that fails its kind's schema (the
  `validate` callable: deploy/istio/schema through tests/test_istio_manifests.py);
- a workload (Deployment, StatefulSet, Pod) whose pods name a Secret, a key of it, a ConfigMap
  or a service account that does not exist (its pods would not start), or whose template
  carries an `istio-proxy` entry or a bootstrap override in a namespace without sidecar
  injection, or an override naming a missing ConfigMap;
- a WasmPlugin still holding the placeholder digest, selecting no workload, naming a gateway
  cluster no Service backs, or reaching a sidecar whose `istio-proxy` container lacks a
  variable `vmConfig.env` takes from the host (the plugin would fail to load, and with
  FAIL_CLOSE the workload would answer 503); the same check when a patch changes a workload;
- deleting a Secret or ConfigMap a workload still uses, or an object that is not there;
  creating a Secret that exists.

A StatefulSet's volume claims become PersistentVolumeClaims, which outlive it, as in a cluster.

What kubectl computes offline it computes for real: `create ... --dry-run=client -o yaml` for
Secrets and Namespaces, `patch --local -f ... -o yaml` for patches (strategic merge and the
rest). What runs in pods (`exec`, `logs`, istioctl's view of a proxy) goes to hooks the test
registers; `on_admit` hooks see every object taken (e.g. to start what a StatefulSet runs).

`CommandServer` and `write_shims` make the model reachable from a shell: `kubectl` and
`istioctl` executables that send their argv, working directory and stdin to the test process
over a Unix socket and print its answer.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable

import yaml

CLUSTER_SCOPED = {"Namespace"}
WORKLOADS = {"Deployment", "StatefulSet", "Pod"}
# kubectl's names for the kinds the model knows, and the group its messages add.
KIND_OF = {
    "namespace": "Namespace", "namespaces": "Namespace", "ns": "Namespace",
    "secret": "Secret", "secrets": "Secret",
    "configmap": "ConfigMap", "configmaps": "ConfigMap", "cm": "ConfigMap",
    "service": "Service", "services": "Service", "svc": "Service",
    "serviceaccount": "ServiceAccount", "serviceaccounts": "ServiceAccount", "sa": "ServiceAccount",
    "deployment": "Deployment", "deployments": "Deployment", "deploy": "Deployment",
    "statefulset": "StatefulSet", "statefulsets": "StatefulSet", "sts": "StatefulSet",
    "pod": "Pod", "pods": "Pod", "po": "Pod",
    "persistentvolumeclaim": "PersistentVolumeClaim", "persistentvolumeclaims": "PersistentVolumeClaim",
    "pvc": "PersistentVolumeClaim",
    "wasmplugin": "WasmPlugin", "wasmplugins": "WasmPlugin",
}
GROUP = {"Deployment": "apps", "StatefulSet": "apps", "WasmPlugin": "extensions.istio.io",
         "DestinationRule": "networking.istio.io", "EnvoyFilter": "networking.istio.io",
         "PeerAuthentication": "security.istio.io", "AuthorizationPolicy": "security.istio.io"}
PLACEHOLDER_SHA256 = "0" * 64
INJECTION_LABELS = ("istio-injection", "istio.io/rev")
BOOTSTRAP_OVERRIDE = "sidecar.istio.io/bootstrapOverride"


class ModelError(RuntimeError):
    """What the model refuses; the message is what the command prints."""


Key = tuple[str, str, str]  # kind, namespace ("" for cluster-scoped), name
Hook = Callable[[list[str], bytes], tuple[int, bytes, bytes]]


def resource(kind: str, name: str) -> str:
    group = GROUP.get(kind)
    return f"{kind.lower()}{'.' + group if group else ''}/{name}"


def pod_spec(obj: dict) -> dict | None:
    if obj["kind"] == "Pod":
        return obj.get("spec", {})
    if obj["kind"] in WORKLOADS:
        return obj.get("spec", {}).get("template", {}).get("spec", {})
    return None


def pod_metadata(obj: dict) -> dict:
    if obj["kind"] == "Pod":
        return obj.get("metadata", {})
    return obj.get("spec", {}).get("template", {}).get("metadata", {}) or {}


def containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers", []) or []) + list(spec.get("containers", []) or [])


def secret_value(secret: dict, key: str) -> str | None:
    if key in (secret.get("stringData") or {}):
        return secret["stringData"][key]
    if key in (secret.get("data") or {}):
        return base64.b64decode(secret["data"][key]).decode()
    return None


def selects(selector: dict, labels: dict) -> bool:
    wanted = (selector or {}).get("matchLabels") or {}
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


def applies_to_server(plugin: dict) -> bool:
    """istiod's traffic selectors for a sidecar's inbound (SERVER) listeners: no `match`, or
    one whose mode is SERVER, CLIENT_AND_SERVER or unset."""
    match = plugin["spec"].get("match") or []
    return not match or any(m.get("mode", "UNDEFINED") in ("SERVER", "CLIENT_AND_SERVER", "UNDEFINED")
                            for m in match)


class ApiModel:
    def __init__(self, kubectl: str, validate: Callable[[dict], list[str]], workdir: Path):
        self.kubectl_binary = kubectl
        self.validate = validate
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.objects: dict[Key, dict] = {}
        self.log: list[str] = []  # "created Secret orders/x", in order
        self.exec_hooks: dict[tuple[str, str, str], Hook] = {}  # (namespace, "kind/name", container)
        self.logs_hooks: dict[tuple[str, str, str], Callable[[], str]] = {}
        self.istioctl_hook: Callable[[list[str]], tuple[int, bytes, bytes]] | None = None
        self.on_admit: list[Callable[[dict], None]] = []

    # --- the store -------------------------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        return self.objects.get((kind, "" if kind in CLUSTER_SCOPED else namespace, name))

    def list(self, kind: str, namespace: str | None = None) -> list[dict]:
        return [o for (k, ns, _), o in self.objects.items() if k == kind and namespace in (None, ns)]

    def secret(self, namespace: str, name: str, key: str) -> str:
        secret = self.get("Secret", namespace, name)
        if secret is None:
            raise ModelError(f"secret {namespace}/{name} does not exist")
        value = secret_value(secret, key)
        if value is None:
            raise ModelError(f"secret {namespace}/{name} has no key {key!r}")
        return value

    def resolve_env(self, namespace: str, container: dict) -> dict[str, str]:
        """A container's environment as the kubelet gives it (values and secretKeyRefs)."""
        env = {}
        for e in container.get("env", []) or []:
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                env[e["name"]] = self.secret(namespace, ref["name"], ref["key"])
            elif "value" in e:
                env[e["name"]] = str(e["value"])
        return env

    def injected(self, namespace: str, metadata: dict) -> bool:
        ns = self.get("Namespace", "", namespace) or {}
        labels = ns.get("metadata", {}).get("labels") or {}
        pod_labels = metadata.get("labels") or {}
        if pod_labels.get("sidecar.istio.io/inject") == "false":
            return False
        return (labels.get("istio-injection") == "enabled" or "istio.io/rev" in labels
                or pod_labels.get("sidecar.istio.io/inject") == "true")

    # --- admission ---------------------------------------------------------------------------------

    def admit(self, obj: dict, source: str, validate: bool = True) -> str:
        """Check and store `obj` (created or replaced); returns kubectl's word for it."""
        kind, meta = obj.get("kind"), obj.get("metadata") or {}
        name = meta.get("name")
        where = f"{source}: {kind} {meta.get('namespace', '')}/{name}".replace(" /", " ")
        if validate:
            errors = self.validate(obj)
            if errors:
                raise ModelError(f"{where} fails its schema: " + "; ".join(errors))
        namespace = "" if kind in CLUSTER_SCOPED else meta.get("namespace", "")
        if kind not in CLUSTER_SCOPED:
            if not namespace:
                raise ModelError(f"{where} has no namespace")
            if self.get("Namespace", "", namespace) is None:
                raise ModelError(f'{where}: namespaces "{namespace}" not found (create the '
                                 "namespace first)")
        if kind in WORKLOADS:
            self._check_workload(obj, where)
        if kind == "WasmPlugin":
            self._check_wasmplugin(obj, where)
        key = (kind, namespace, name)
        old = self.objects.get(key)
        self.objects[key] = copy.deepcopy(obj)
        if kind == "StatefulSet":
            for template in obj["spec"].get("volumeClaimTemplates", []) or []:
                for i in range(obj["spec"].get("replicas", 1)):
                    claim = f"{template['metadata']['name']}-{name}-{i}"
                    self.objects.setdefault(("PersistentVolumeClaim", namespace, claim), {
                        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                        "metadata": {"name": claim, "namespace": namespace},
                        "spec": copy.deepcopy(template["spec"])})
        word = "created" if old is None else ("unchanged" if old == obj else "configured")
        self.log.append(f"{word} {kind} {namespace}/{name}".replace(" /", " "))
        for hook in self.on_admit:
            hook(obj)
        return word

    def _check_workload(self, obj: dict, where: str) -> None:
        namespace = obj["metadata"]["namespace"]
        spec, metadata = pod_spec(obj), pod_metadata(obj)
        account = spec.get("serviceAccountName")
        if account and account != "default" and self.get("ServiceAccount", namespace, account) is None:
            raise ModelError(f"{where}: its pods run as service account {account!r}, which "
                             f"does not exist in namespace {namespace}")
        for c in containers(spec):
            for e in c.get("env", []) or []:
                source = e.get("valueFrom") or {}
                for ref_kind, field in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                    ref = source.get(field)
                    if ref and not ref.get("optional"):
                        self._need(ref_kind, namespace, ref["name"], ref["key"],
                                   f"{where}: container {c['name']}'s {e['name']}")
            for e in c.get("envFrom", []) or []:
                for ref_kind, field in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                    ref = e.get(field)
                    if ref and not ref.get("optional"):
                        self._need(ref_kind, namespace, ref["name"], None, f"{where}: container {c['name']}")
        for v in spec.get("volumes", []) or []:
            if "secret" in v and not v["secret"].get("optional"):
                self._need("Secret", namespace, v["secret"]["secretName"], None, f"{where}: volume {v['name']}")
            if "configMap" in v and not v["configMap"].get("optional"):
                self._need("ConfigMap", namespace, v["configMap"]["name"], None, f"{where}: volume {v['name']}")
        annotations = metadata.get("annotations") or {}
        has_proxy = any(c["name"] == "istio-proxy" for c in spec.get("containers", []) or [])
        if (has_proxy or BOOTSTRAP_OVERRIDE in annotations) and not self.injected(namespace, metadata):
            raise ModelError(f"{where}: namespace {namespace} has no sidecar injection "
                             f"({' or '.join(INJECTION_LABELS)} label): no sidecar would get the "
                             "istio-proxy settings")
        if BOOTSTRAP_OVERRIDE in annotations:
            self._need("ConfigMap", namespace, annotations[BOOTSTRAP_OVERRIDE], "custom_bootstrap.json",
                       f"{where}: annotation {BOOTSTRAP_OVERRIDE} (the injector mounts it: the pod "
                       "would not start)")
        for plugin in self.list("WasmPlugin", namespace):
            self._check_plugin_reaches(plugin, obj, where)

    def _need(self, kind: str, namespace: str, name: str, key: str | None, who: str) -> None:
        found = self.get(kind, namespace, name)
        if found is None:
            raise ModelError(f"{who} needs {kind} {namespace}/{name}, which does not exist yet "
                             "(its pods would not start)")
        if key is not None:
            value = secret_value(found, key) if kind == "Secret" else (found.get("data") or {}).get(key)
            if value is None:
                raise ModelError(f"{who} needs key {key!r} of {kind} {namespace}/{name}, which has "
                                 f"only {sorted({**(found.get('data') or {}), **(found.get('stringData') or {})})}")

    def _check_plugin_reaches(self, plugin: dict, workload: dict, where: str) -> None:
        """A WasmPlugin that selects `workload` needs the host variables it names on the
        workload's istio-proxy container, else the sidecar cannot load the plugin."""
        if not selects(plugin["spec"].get("selector"), pod_metadata(workload).get("labels") or {}):
            return
        if not applies_to_server(plugin):
            return
        wanted = [e["name"] for e in plugin["spec"].get("vmConfig", {}).get("env", []) or []
                  if e.get("valueFrom") == "HOST"]
        proxy = next((c for c in pod_spec(workload).get("containers", []) or []
                      if c["name"] == "istio-proxy"), {})
        have = {e["name"] for e in proxy.get("env", []) or []}
        missing = [w for w in wanted if w not in have]
        if missing:
            fail = plugin["spec"].get("failStrategy", "FAIL_CLOSE")
            consequence = ("every request of the workload would get 503" if fail == "FAIL_CLOSE"
                           else "the workload would run unguarded")
            raise ModelError(
                f"{where}: WasmPlugin {plugin['metadata']['namespace']}/{plugin['metadata']['name']} "
                f"selects {workload['kind']} {workload['metadata']['name']}, whose istio-proxy "
                f"container has no {', '.join(missing)} (vmConfig.env, valueFrom HOST): the sidecar "
                f"cannot load the plugin and, with {fail}, {consequence}")

    def _check_wasmplugin(self, plugin: dict, where: str) -> None:
        spec = plugin["spec"]
        if not spec.get("url", "").startswith("file://") and spec.get("sha256") == PLACEHOLDER_SHA256:
            raise ModelError(f"{where} still has the placeholder sha256: a proxy refuses the "
                             "module (put the published image's digest in first)")
        namespace = plugin["metadata"]["namespace"]
        selected = [w for kind in WORKLOADS for w in self.list(kind, namespace)
                    if selects(spec.get("selector"), pod_metadata(w).get("labels") or {})]
        if not selected:
            raise ModelError(f"{where} selects no workload in namespace {namespace}")
        for workload in selected:
            self._check_plugin_reaches(plugin, workload, where)
        cluster = ((spec.get("pluginConfig") or {}).get("redis") or {}).get("cluster", "")
        m = re.fullmatch(r"outbound\|(\d+)\|[^|]*\|([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local", cluster)
        if not m:
            raise ModelError(f"{where}: redis.cluster {cluster!r} is not an Istio outbound cluster")
        port, service, service_ns = int(m.group(1)), m.group(2), m.group(3)
        svc = self.get("Service", service_ns, service)
        if svc is None or port not in [p["port"] for p in svc["spec"]["ports"]]:
            raise ModelError(f"{where}: redis.cluster {cluster} has no Service {service_ns}/{service} "
                             f"with port {port} behind it: every guarded request would fail")

    def remove(self, kind: str, namespace: str, name: str, source: str,
               going: frozenset[Key] = frozenset()) -> None:
        """Delete one object; `going` are the others the same command deletes."""
        key = (kind, "" if kind in CLUSTER_SCOPED else namespace, name)
        if key not in self.objects:
            raise ModelError(f'{source}: Error from server (NotFound): {kind} "{name}" not found '
                             f"in namespace {namespace}")
        if kind in ("Secret", "ConfigMap"):
            for w in (w for k in WORKLOADS for w in self.list(k, namespace)):
                if (w["kind"], namespace, w["metadata"]["name"]) in going:
                    continue
                if self._uses(w, kind, name):
                    raise ModelError(f"{source}: {kind} {namespace}/{name} is still used by "
                                     f"{w['kind']} {w['metadata']['name']}: its next pods would "
                                     "not start")
        del self.objects[key]
        self.log.append(f"deleted {kind} {namespace}/{name}".replace(" /", " "))

    def _uses(self, workload: dict, kind: str, name: str) -> bool:
        spec, annotations = pod_spec(workload), pod_metadata(workload).get("annotations") or {}
        if kind == "ConfigMap" and annotations.get(BOOTSTRAP_OVERRIDE) == name:
            return True
        key_ref, from_ref = {"Secret": ("secretKeyRef", "secretRef"),
                             "ConfigMap": ("configMapKeyRef", "configMapRef")}[kind]
        for c in containers(spec):
            for e in c.get("env", []) or []:
                if ((e.get("valueFrom") or {}).get(key_ref) or {}).get("name") == name:
                    return True
            for e in c.get("envFrom", []) or []:
                if (e.get(from_ref) or {}).get("name") == name:
                    return True
        for v in spec.get("volumes", []) or []:
            if kind == "Secret" and (v.get("secret") or {}).get("secretName") == name:
                return True
            if kind == "ConfigMap" and (v.get("configMap") or {}).get("name") == name:
                return True
        return False

    # --- kubectl -----------------------------------------------------------------------------------

    def kubectl(self, argv: list[str], cwd: Path, stdin: bytes = b"") -> tuple[int, bytes, bytes]:
        try:
            return self._kubectl(list(argv), Path(cwd), stdin)
        except ModelError as e:
            return 1, b"", f"error: {e}\n".encode()

    def _kubectl(self, argv: list[str], cwd: Path, stdin: bytes) -> tuple[int, bytes, bytes]:
        namespace, explicit, rest = "default", False, []
        i = 0
        while i < len(argv):
            a = argv[i]
            if a == "--":
                rest += argv[i:]
                break
            if a in ("-n", "--namespace"):
                namespace, explicit, i = argv[i + 1], True, i + 2
                continue
            if a.startswith("--namespace="):
                namespace, explicit, i = a.split("=", 1)[1], True, i + 1
                continue
            rest.append(a)
            i += 1
        if not rest:
            raise ModelError("no command")
        verb, args = rest[0], rest[1:]
        handler = getattr(self, f"_verb_{verb}", None)
        if handler is None:
            raise ModelError(f"the model has no `kubectl {verb}`")
        out = handler(args, namespace, explicit, cwd, stdin)
        if isinstance(out, tuple):
            return out
        return 0, out.encode(), b""

    def _files(self, args: list[str], cwd: Path, stdin: bytes) -> list[tuple[str, dict]]:
        names = []
        i = 0
        while i < len(args):
            if args[i] in ("-f", "--filename"):
                names.append(args[i + 1])
                i += 2
            elif args[i].startswith("--filename="):
                names.append(args[i].split("=", 1)[1])
                i += 1
            else:
                raise ModelError(f"the model does not take {args[i]!r} here")
        if not names:
            raise ModelError("no -f given")
        found = []
        for name in names:
            if name == "-":
                texts = [("stdin", stdin.decode())]
            else:
                path = cwd / name
                if path.is_dir():
                    paths = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
                elif path.is_file():
                    paths = [path]
                else:
                    raise ModelError(f'the path "{name}" does not exist')
                texts = [(str(p.relative_to(cwd) if p.is_relative_to(cwd) else p), p.read_text())
                         for p in paths]
            for source, text in texts:
                found += [(source, d) for d in yaml.safe_load_all(text) if d is not None]
        return found

    def _namespaced(self, obj: dict, namespace: str, explicit: bool, source: str) -> dict:
        obj = copy.deepcopy(obj)
        if obj.get("kind") in CLUSTER_SCOPED:
            return obj
        meta = obj.setdefault("metadata", {})
        if "namespace" in meta and explicit and meta["namespace"] != namespace:
            raise ModelError(f"{source}: the namespace from the provided object {meta['namespace']!r} "
                             f"does not match the namespace {namespace!r}")
        meta.setdefault("namespace", namespace)
        return obj

    def _verb_apply(self, args, namespace, explicit, cwd, stdin) -> str:
        lines = []
        for source, doc in self._files(args, cwd, stdin):
            obj = self._namespaced(doc, namespace, explicit, source)
            lines.append(f"{resource(obj['kind'], obj['metadata']['name'])} {self.admit(obj, source)}")
        return "".join(line + "\n" for line in lines)

    def _verb_create(self, args, namespace, explicit, cwd, stdin) -> str:
        if not args or args[0] not in ("secret", "namespace", "ns"):
            raise ModelError(f"the model has no `kubectl create {' '.join(args[:1])}`")
        real = [self.kubectl_binary, "create", *args, "--dry-run=client", "-o", "yaml"]
        if args[0] == "secret":
            real[1:1] = ["-n", namespace]
        result = subprocess.run(real, cwd=cwd, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            return result.returncode, result.stdout, result.stderr
        obj = yaml.safe_load(result.stdout)
        key = (obj["kind"], "" if obj["kind"] in CLUSTER_SCOPED else namespace, obj["metadata"]["name"])
        if key in self.objects:
            plural = {"Secret": "secrets", "Namespace": "namespaces"}[obj["kind"]]
            raise ModelError(f'Error from server (AlreadyExists): {plural} "{key[2]}" already exists')
        self.admit(obj, "kubectl create")
        return f"{resource(obj['kind'], obj['metadata']['name'])} created\n"

    def _verb_delete(self, args, namespace, explicit, cwd, stdin) -> str:
        lines = []
        if args and (args[0] in ("-f", "--filename") or args[0].startswith("--filename=")):
            found = [(source, self._namespaced(doc, namespace, explicit, source))
                     for source, doc in self._files(args, cwd, stdin)]
            going = frozenset((o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
                              for _, o in found)
            for source, obj in found:
                self.remove(obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"],
                            source, going)
                lines.append(f'{resource(obj["kind"], obj["metadata"]["name"])} deleted')
        else:
            if not args or args[0].lower() not in KIND_OF or len(args) < 2:
                raise ModelError(f"the model cannot delete {' '.join(args)!r}")
            kind = KIND_OF[args[0].lower()]
            for name in args[1:]:
                self.remove(kind, namespace, name, "kubectl delete")
                lines.append(f'{kind.lower()} "{name}" deleted')
        return "".join(line + "\n" for line in lines)

    def _target(self, text: str, namespace: str) -> dict:
        kind_name = text.split("/", 1) if "/" in text else ("pod", text)
        kind = KIND_OF.get(kind_name[0].lower())
        if kind is None:
            raise ModelError(f"unknown resource type {kind_name[0]!r}")
        obj = self.get(kind, namespace, kind_name[1])
        if obj is None:
            raise ModelError(f'Error from server (NotFound): {kind.lower()}s "{kind_name[1]}" not found')
        return obj

    def _verb_patch(self, args, namespace, explicit, cwd, stdin) -> str:
        if len(args) < 2:
            raise ModelError("patch needs a kind and a name")
        kind = KIND_OF.get(args[0].lower())
        if kind is None:
            raise ModelError(f"unknown resource type {args[0]!r}")
        current = self._target(f"{args[0]}/{args[1]}", namespace)
        options = args[2:]
        local = self.workdir / f"patch-{len(self.log)}.yaml"
        local.write_text(yaml.safe_dump(current))
        real = [self.kubectl_binary, "patch", "--local", "-f", str(local), "-o", "yaml", *options]
        result = subprocess.run(real, cwd=cwd, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            return result.returncode, result.stdout, result.stderr
        patched = yaml.safe_load(result.stdout)
        word = self.admit(patched, f"kubectl patch {kind.lower()} {args[1]}")
        return f"{resource(kind, args[1])} {'patched' if word != 'unchanged' else 'patched (no change)'}\n"

    def _verb_rollout(self, args, namespace, explicit, cwd, stdin) -> str:
        if not args or args[0] != "status":
            raise ModelError(f"the model has no `kubectl rollout {' '.join(args[:1])}`")
        obj = self._target(next(a for a in args[1:] if not a.startswith("-")), namespace)
        return f"{resource(obj['kind'], obj['metadata']['name'])} rolled out (model)\n"

    def _verb_run(self, args, namespace, explicit, cwd, stdin) -> str:
        name, image, command, tail = args[0], None, False, []
        for i, a in enumerate(args[1:], start=1):
            if a == "--":
                tail = args[i + 1:]
                break
            if a.startswith("--image="):
                image = a.split("=", 1)[1]
            elif a == "--command":
                command = True
            elif a.startswith("--restart="):
                pass
            else:
                raise ModelError(f"the model does not take {a!r} for `kubectl run`")
        if not image:
            raise ModelError("kubectl run needs --image")
        container = {"name": name, "image": image, ("command" if command else "args"): tail}
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": namespace, "labels": {"run": name}},
               "spec": {"containers": [container], "restartPolicy": "Never"}}
        if self.get("Pod", namespace, name) is not None:
            raise ModelError(f'Error from server (AlreadyExists): pods "{name}" already exists')
        self.admit(pod, "kubectl run", validate=False)
        return f"pod/{name} created\n"

    def _verb_wait(self, args, namespace, explicit, cwd, stdin) -> str:
        targets = [a for a in args if not a.startswith("--")]
        for t in targets:
            self._target(t, namespace)
        return "".join(f"{t} condition met\n" for t in targets)

    def _pod_view(self, args: list[str], namespace: str) -> tuple[str, str, list[str]]:
        """`TARGET [-c CONTAINER] [-i] [-- CMD...]` -> ("kind/name", container, cmd)."""
        target, container, cmd = None, None, []
        i = 0
        while i < len(args):
            a = args[i]
            if a == "--":
                cmd = args[i + 1:]
                break
            if a in ("-c", "--container"):
                container, i = args[i + 1], i + 2
                continue
            if a in ("-i", "--stdin", "-t", "--tty", "-it"):
                i += 1
                continue
            if target is None and not a.startswith("-"):
                target, i = a, i + 1
                continue
            raise ModelError(f"the model does not take {a!r} here")
        if target is None:
            raise ModelError("no pod or workload named")
        obj = self._target(target, namespace)
        spec, metadata = pod_spec(obj), pod_metadata(obj)
        names = [c["name"] for c in spec.get("containers", []) if c["name"] != "istio-proxy"]
        if self.injected(namespace, metadata):
            names.append("istio-proxy")
        container = container or names[0]
        if container not in names:
            raise ModelError(f"container {container} is not valid for {obj['kind'].lower()} "
                             f"{obj['metadata']['name']}: it has {', '.join(names)}")
        return f"{obj['kind'].lower()}/{obj['metadata']['name']}", container, cmd

    def _verb_exec(self, args, namespace, explicit, cwd, stdin):
        target, container, cmd = self._pod_view(args, namespace)
        hook = self.exec_hooks.get((namespace, target, container))
        if hook is None:
            raise ModelError(f"the model cannot run commands in {namespace}/{target} ({container})")
        return hook(cmd, stdin)

    def _verb_logs(self, args, namespace, explicit, cwd, stdin) -> str:
        target, container, _ = self._pod_view(args, namespace)
        hook = self.logs_hooks.get((namespace, target, container))
        if hook is None:
            raise ModelError(f"the model has no logs of {namespace}/{target} ({container})")
        return hook()

    def istioctl(self, argv: list[str], cwd: Path, stdin: bytes = b"") -> tuple[int, bytes, bytes]:
        if self.istioctl_hook is None:
            return 1, b"", b"error: the model has no istioctl\n"
        try:
            return self.istioctl_hook(argv)
        except ModelError as e:
            return 1, b"", f"error: {e}\n".encode()


# --- the shell's way in ------------------------------------------------------------------------------

SHIM = '''#!{python}
# {tool} for a test's shell: sends argv, cwd and stdin to the test process (harness/kube.py).
import base64, json, os, socket, sys
data = b"" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer.read()
request = {{"tool": {tool!r}, "argv": sys.argv[1:], "cwd": os.getcwd(),
           "stdin": base64.b64encode(data).decode()}}
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    s.settimeout(600)
    s.connect({socket_path!r})
    s.sendall(json.dumps(request).encode())
    s.shutdown(socket.SHUT_WR)
    answer = b"".join(iter(lambda: s.recv(65536), b""))
reply = json.loads(answer)
sys.stdout.buffer.write(base64.b64decode(reply["stdout"]))
sys.stderr.buffer.write(base64.b64decode(reply["stderr"]))
sys.exit(reply["rc"])
'''


def write_shims(bin_dir: Path, socket_path: Path, tools=("kubectl", "istioctl")) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        path = bin_dir / tool
        path.write_text(SHIM.format(python=sys.executable, tool=tool, socket_path=str(socket_path)))
        path.chmod(0o755)


class CommandServer:
    """A thread of the test process answering the shims, one command at a time:
    `handler(tool, argv, cwd, stdin) -> (rc, stdout, stderr)`."""

    def __init__(self, socket_path: Path, handler):
        self.socket_path = Path(socket_path)
        self.handler = handler
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._thread = threading.Thread(target=self._run, name="kube-model", daemon=True)
        self.errors: list[str] = []

    def start(self) -> "CommandServer":
        self.socket_path.unlink(missing_ok=True)
        self._listener.bind(str(self.socket_path))
        self._listener.listen(8)
        self._listener.settimeout(0.2)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(600)
                try:
                    request = json.loads(b"".join(iter(lambda: conn.recv(65536), b"")))
                    rc, out, err = self.handler(request["tool"], request["argv"], Path(request["cwd"]),
                                                base64.b64decode(request["stdin"]))
                except Exception:  # reported to the shell and kept for the test to show
                    text = traceback.format_exc()
                    self.errors.append(text)
                    rc, out, err = 70, b"", f"the model failed:\n{text}".encode()
                reply = {"rc": rc, "stdout": base64.b64encode(out).decode(),
                         "stderr": base64.b64encode(err).decode()}
                try:
                    conn.sendall(json.dumps(reply).encode())
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._listener.close()
        self.socket_path.unlink(missing_ok=True)
