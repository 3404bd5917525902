"""The system a chaos run attacks: the real stack, built so that every part can fail and return.

    target = build_target("single", workdir, plugin_config, service_port)
    target.envoy_urls              # the two Envoys' listeners, what the clients call
    target.reload_config(config)   # the filter's configuration, replaced at runtime (ECDS)
    target.healthy(30)             # every part answers, a script call works through each Envoy
    target.stop()

Two topologies, as in the test suite (tests/conftest.py):

- `single`: one redis-server with an append-only file written and flushed before each reply
  (`appendfsync always`), so a restart keeps every acknowledged write; a restart "without
  persistence" removes the file first. One webdis in front of it.
- `cluster`: the harness's Redis Cluster (tests/harness/cluster.py: 3 masters, 3 replicas,
  Envoy's redis_proxy, two webdis), its nodes with the same append-only file.

Between the Envoys and webdis sits the chaos network proxy (chaos/netproxy.py), one port per
webdis: the Envoys' `redis_gateway` cluster points at it, so a run can delay or cut the
gateway's network. Two Envoys run the built filter, both in front of the service the run
starts on `service_port`; each has fixed listener and admin ports, so an Envoy killed and
started again is where its clients expect it. With `grpc_port`, each Envoy also has the
cluster `grpc_upstream` (HTTP/2 with prior knowledge) to the service's gRPC port and routes
every path under `/cg.test.` to it (harness.envoy), so gRPC clients call the same listener
over h2c.

The filter's configuration reaches each Envoy through extension config discovery (ECDS) from a
file of its own (`filter.json` in the Envoy's directory, read through `path_config_source`):
replacing the file by an atomic rename makes Envoy load the new configuration into its
listener without dropping it, as istiod's ECDS update of a WasmPlugin does in a mesh.

The plugin configuration handed to `build_target` supplies the policies and the `redis` fields
`timeout`, `key_prefix` (default `cg:chaos`; it must be `cg` or start with `cg:`, the keys the
gateway's Redis user may touch) and `batch`; the gateway's own fields (`protocol`, `cluster`,
`authority`, `authorization`) are the target's and replace any given.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import threading
import time
import urllib.parse
from pathlib import Path

import chaos  # noqa: F401  (puts tests/ on sys.path)
from harness import readiness
from harness.cluster import NODE_TIMEOUT_MS, ClusterBackend
from harness.envoy import DEFAULT_WASM, FILTER_NAME, Envoy, plugin_json
from harness.proc import PrerequisiteMissing, RedisServer, free_port, reserve_dead_port, wait_http
from harness.stack import GATEWAY_CLUSTER, Blackhole
from harness.webdis import Webdis

from chaos.netproxy import NetProxy

TOPOLOGIES = ("single", "cluster")
ENVOYS = 2
DEFAULT_KEY_PREFIX = "cg:chaos"
# The keys the gateway's Redis user may touch: `cg:*` (harness.proc.RedisServer).
GATEWAY_KEY_PREFIX = "cg"
WASM_TYPE_URL = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
EXTENSION_CONFIG_TYPE = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
# Envoy's counters of the filter's ECDS subscription (`extension_config_discovery.<stat
# prefix>.<filter name>.<counter>`): a configuration loaded, and one refused.
ECDS_STAT = f"extension_config_discovery.http_filter.{FILTER_NAME}"
# Written before each reply: a Redis killed with SIGKILL and started again has every write it
# acknowledged.
DURABLE_REDIS_LINES = ["appendfsync always"]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration_seconds(text: str) -> float:
    """A configuration duration (`"50ms"`, `"2s"`) in seconds."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"not a duration: {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


class Target:
    """The running stack of one topology; made by `build_target`, undone by `stop()`."""

    def __init__(self, topology: str, workdir: Path, plugin_config: dict, service_port: int,
                 wasm_path: Path | None = None, node_timeout_ms: int = NODE_TIMEOUT_MS,
                 grpc_port: int | None = None):
        if topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {topology!r}; known: {TOPOLOGIES}")
        self.topology = topology
        self.workdir = Path(workdir).resolve()
        self.service_port = service_port
        self.grpc_port = grpc_port
        self.wasm_path = Path(wasm_path) if wasm_path else DEFAULT_WASM
        # The cluster's: how long a master may be unreachable before its replica takes over.
        self.node_timeout_ms = node_timeout_ms
        self.redis: RedisServer | None = None  # single
        self.cluster: ClusterBackend | None = None  # cluster
        self.webdis: list[Webdis] = []
        self.netproxy: NetProxy | None = None
        self.envoys: list[Envoy] = []
        self._blackhole: Blackhole | None = None
        self._dead_socket = None
        self._lock = threading.RLock()
        redis = dict(plugin_config.get("redis") or {})
        self.key_prefix = redis.get("key_prefix", DEFAULT_KEY_PREFIX)
        if self.key_prefix != GATEWAY_KEY_PREFIX and not self.key_prefix.startswith(
                GATEWAY_KEY_PREFIX + ":"):
            raise ValueError(f"key_prefix {self.key_prefix!r} is outside the gateway user's keys "
                             f"(~{GATEWAY_KEY_PREFIX}:*)")
        self._caller_config = copy.deepcopy(plugin_config)
        self.plugin_config: dict = {}  # the configuration in force, filled in by `start`
        # Per Envoy: how many times its ECDS file was written (the file's version_info).
        self.config_versions = [0] * ENVOYS
        # Other full plugin configurations the run counts as equivalent for what it checks
        # (the config_reload fault may hand one of them to an Envoy); none by default.
        self.config_variants: list[dict] = []

    # --- the parts ---------------------------------------------------------------------------

    @property
    def redis_timeout(self) -> float:
        """The filter's Redis timeout in seconds (`redis.timeout` of the configuration)."""
        return duration_seconds(self.plugin_config["redis"].get("timeout", "50ms"))

    @property
    def envoy_urls(self) -> list[str]:
        return [envoy.url for envoy in self.envoys]

    @property
    def authorization(self) -> str:
        return self.webdis[0].authorization

    def redis_client(self):
        """redis-py as the admin user (every command, every key): a RedisCluster client on the
        live nodes for the cluster (`scan_iter` walks every master). A new client per call,
        made from the topology as it is now (after a failover too); the caller closes it."""
        if self.cluster is not None:
            return self.cluster.client()
        return self.redis.client()

    def redis_nodes(self) -> list[RedisServer]:
        """Every Redis process: the server, or the cluster's six nodes."""
        return list(self.cluster.nodes) if self.cluster is not None else [self.redis]

    def masters(self) -> list[RedisServer]:
        """The Redis processes that serve keys now: the server, or the cluster's live masters."""
        if self.cluster is None:
            return [self.redis]
        return [self.cluster.node_by_port(port) for port in self.cluster.masters()]

    def envoy_logs(self) -> list[str]:
        """Each Envoy's log, every start of it (the file is appended to)."""
        return [envoy.log_text() for envoy in self.envoys]

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> "Target":
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            if not self.wasm_path.exists():
                raise PrerequisiteMissing(f"{self.wasm_path} is missing; run `make build`")
            if self.topology == "single":
                self.redis = RedisServer(self.workdir / "redis",
                                         gateway_key_prefix=GATEWAY_KEY_PREFIX, persistent=True)
                self.redis.config_lines = list(DURABLE_REDIS_LINES)
                self.redis.start()
                self.webdis = [Webdis(self.workdir / "webdis", self.redis.port,
                                      redis_password=self.redis.gateway_password).start()]
            else:
                self.cluster = ClusterBackend(self.workdir / "cluster",
                                              gateway_key_prefix=GATEWAY_KEY_PREFIX,
                                              node_timeout_ms=self.node_timeout_ms)
                for node in self.cluster.nodes:
                    node.persistent = True
                self.cluster.start(timeout)
                for node in self.cluster.nodes:
                    # From the next start on (the bus port is fixed once the cluster is made);
                    # the running nodes get it now.
                    node.config_lines = [*node.config_lines, *DURABLE_REDIS_LINES]
                    client = node.client()
                    try:
                        client.config_set("appendfsync", "always")
                    finally:
                        client.close()
                self.webdis = list(self.cluster.webdis)
            self.netproxy = NetProxy(self.workdir / "netproxy",
                                     [w.port for w in self.webdis]).start()
            self.plugin_config = self._with_gateway(self._caller_config)
            self._blackhole = Blackhole().start()
            self._dead_socket, dead_port = reserve_dead_port()
            for i in range(ENVOYS):
                envoy = Envoy(self.workdir / f"envoy-{i}", self.plugin_config, self.service_port,
                              self.netproxy.ports[0], wasm_path=self.wasm_path,
                              blackhole_port=self._blackhole.port, dead_port=dead_port,
                              listener_port=free_port(), admin_port=free_port(),
                              extra_gateway_ports=self.netproxy.ports[1:],
                              grpc_upstream_port=self.grpc_port)
                self._discover_filter_config(envoy, i)
                self.envoys.append(envoy)
                self._write_filter_config(i, self.plugin_config)
                envoy.start(timeout)
            self.healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _with_gateway(self, plugin_config: dict) -> dict:
        """The caller's configuration with the gateway's fields of this target."""
        config = copy.deepcopy(plugin_config)
        redis = dict(config.get("redis") or {})
        redis.update({"protocol": "webdis", "cluster": GATEWAY_CLUSTER,
                      "authority": "redis-gateway", "authorization": self.authorization,
                      "key_prefix": self.key_prefix})
        redis.pop("authorization_env", None)
        redis.setdefault("timeout", "50ms")
        config["redis"] = redis
        return config

    def stop(self) -> None:
        """Stop every process this target started (by pid), also the ones a fault left down."""
        errors: list[Exception] = []
        for envoy in reversed(self.envoys):
            _try(envoy.stop, errors)
        if self._blackhole is not None:
            _try(self._blackhole.stop, errors)
            self._blackhole = None
        if self._dead_socket is not None:
            self._dead_socket.close()
            self._dead_socket = None
        if self.netproxy is not None:
            _try(self.netproxy.stop, errors)
        if self.cluster is not None:
            _try(self.cluster.stop, errors)
        else:
            for w in self.webdis:
                _try(w.stop, errors)
            if self.redis is not None:
                _try(self.redis.stop, errors)
        if errors:
            raise errors[0]

    def __enter__(self) -> "Target":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- the filter's configuration (ECDS) ---------------------------------------------------

    def filter_config_path(self, index: int) -> Path:
        """Envoy `index`'s ECDS file: the filter's configuration it loads."""
        return self.workdir / f"envoy-{index}" / "filter.json"

    def _discover_filter_config(self, envoy: Envoy, index: int) -> None:
        """Swap the Wasm filter of the rendered config for its discovery from a file; keep the
        filter's own settings (VM, failure policy) as the template for every file written."""
        # A subscription (ECDS from a file too) wants the node's name and cluster.
        envoy.config["node"] = {"id": f"chaos-envoy-{index}", "cluster": "chaos"}
        hcm = envoy.config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"]
        filters = hcm["http_filters"]
        at = next(i for i, f in enumerate(filters) if f["name"] == FILTER_NAME)
        self._wasm_template = copy.deepcopy(filters[at]["typed_config"])
        filters[at] = {
            "name": FILTER_NAME,
            "config_discovery": {
                "config_source": {
                    "path_config_source": {"path": str(self.filter_config_path(index))},
                    "resource_api_version": "V3",
                },
                "type_urls": [WASM_TYPE_URL],
            },
        }

    def _write_filter_config(self, index: int, plugin_config: dict | str, *,
                             vm_id: str | None = None) -> None:
        """Replace Envoy `index`'s ECDS file (a temporary file renamed over it)."""
        wasm = copy.deepcopy(self._wasm_template)
        wasm["config"]["configuration"]["value"] = plugin_json(plugin_config)
        if vm_id is not None:
            wasm["config"]["vm_config"]["vm_id"] = vm_id
        self.config_versions[index] += 1
        resource = {"version_info": str(self.config_versions[index]),
                    "resources": [{"@type": EXTENSION_CONFIG_TYPE, "name": FILTER_NAME,
                                   "typed_config": wasm}]}
        path = self.filter_config_path(index)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".filter.{secrets.token_hex(4)}.json")
        tmp.write_text(json.dumps(resource, indent=1) + "\n")
        os.replace(tmp, path)

    def config_reloads(self, index: int) -> int:
        """How many configurations Envoy `index` loaded from its ECDS file (its first too)."""
        return self.envoys[index].stat(f"{ECDS_STAT}.config_reload")

    def reload_config(self, plugin_config: dict | str | None = None,
                      envoys: list[int] | None = None, *, vm_id: str | None = None,
                      wait: float = 10.0) -> None:
        """Hand `envoys` (default all) a new filter configuration at runtime: `plugin_config`
        (the configuration in force if None; a string goes to the filter as it is, e.g. the
        same JSON spelled otherwise), in a new VM if `vm_id` is given (as a new image of the
        plugin would get). Returns once each live Envoy loaded it (its ECDS counter moved), or
        raises after `wait` seconds; an Envoy that is down reads the file when it starts."""
        config = self.plugin_config if plugin_config is None else plugin_config
        if isinstance(config, dict):
            config = self._with_gateway(config)
        with self._lock:
            targets = list(range(len(self.envoys)) if envoys is None else envoys)
            before = {}
            for i in targets:
                count = self._reloads_if_up(i)
                if count is not None:
                    before[i] = (self.envoys[i].proc.pid, count)
            for i in targets:
                self._write_filter_config(i, config, vm_id=vm_id)
        deadline = time.monotonic() + wait
        for i, (pid, count) in before.items():
            while True:
                now = self._reloads_if_up(i)
                # Loaded; or killed (another fault), or started again since: a new Envoy reads
                # the file as it is when it starts.
                if now is None or now > count or self.envoys[i].proc.pid != pid:
                    break
                if time.monotonic() > deadline:
                    failed = self.envoys[i].stat(f"{ECDS_STAT}.config_fail")
                    raise TimeoutError(f"envoy {i} did not load its new filter configuration "
                                       f"within {wait}s (config_fail={failed})")
                time.sleep(0.05)

    def _reloads_if_up(self, index: int) -> int | None:
        """`config_reloads(index)`, or None if that Envoy is down (its admin does not answer)."""
        if not self.envoys[index].alive():
            return None
        try:
            return self.config_reloads(index)
        except OSError:
            return None

    # --- processes that faults take away -----------------------------------------------------

    def kill_envoy(self, index: int) -> None:
        """SIGKILL Envoy `index` (by its pid)."""
        envoy = self.envoys[index]
        if envoy.alive():
            os.kill(envoy.proc.pid, signal.SIGKILL)
            envoy.proc.wait_exit(10)
        envoy.stop()

    def start_envoy(self, index: int, timeout: float = 30.0) -> None:
        """Start Envoy `index` again on its ports (nothing if it runs)."""
        envoy = self.envoys[index]
        if not envoy.alive():
            envoy.start(timeout)

    def kill_webdis(self, index: int) -> None:
        w = self.webdis[index]
        if w.alive():
            os.kill(w.proc.pid, signal.SIGKILL)
            w.proc.wait_exit(10)
        w.stop()

    def start_webdis(self, index: int, timeout: float = 10.0) -> None:
        w = self.webdis[index]
        if not w.alive():
            w.start(timeout)

    def kill_redis(self, node: RedisServer) -> None:
        """SIGKILL one Redis process (the server, or a cluster node)."""
        if node.alive():
            os.kill(node.proc.pid, signal.SIGKILL)
            node.proc.wait_exit(10)
        node.stop()

    def start_redis(self, node: RedisServer, keep_data: bool = True, timeout: float = 10.0) -> None:
        """Start a killed Redis process again on its port (nothing if it runs). Without
        `keep_data` its append-only file is removed first: it comes back empty, as a Redis
        without persistence does. A cluster node keeps its cluster state (nodes.conf) either
        way: it is the same node, and rejoins."""
        if node.alive():
            return
        if not keep_data:
            shutil.rmtree(node.workdir / "appendonlydir", ignore_errors=True)
            (node.workdir / "dump.rdb").unlink(missing_ok=True)
        node.start(timeout)

    # --- health ------------------------------------------------------------------------------

    def healthy(self, timeout: float = 60.0) -> None:
        """Until every part answers again: each Redis process runs (the cluster: every slot
        served, every replica linked), each webdis reaches Redis, the network proxy passes,
        and a script call on a key of every master works through each Envoy. Raises
        TimeoutError naming what is still wrong after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        left = lambda: max(0.1, deadline - time.monotonic())  # noqa: E731
        down = [f"redis :{n.port}" for n in self.redis_nodes() if not n.alive()]
        down += [f"webdis :{w.port}" for w in self.webdis if not w.alive()]
        down += [f"envoy {i}" for i, e in enumerate(self.envoys) if not e.alive()]
        if self.netproxy is None or not self.netproxy.alive():
            down.append("the network proxy")
        if down:
            raise RuntimeError(f"not running: {', '.join(down)}")
        mode = self.netproxy.stats()["mode"]
        if mode != "pass":
            raise RuntimeError(f"the gateway's network is still faulted ({mode})")
        if self.cluster is not None:
            self.cluster.wait_healthy(left())
            self.cluster.wait_gateway(left())
        else:
            _wait_ping(self.redis, left())
            self.webdis[0].wait_redis(left())
        keys = self._probe_keys()
        for i, envoy in enumerate(self.envoys):
            wait_http(f"{envoy.admin_url}/ready", left(), envoy.proc, expect=200)
            port = readiness.port(envoy.admin_url)
            # Every probe on a connection of its own, twice per gateway endpoint (Envoy takes
            # them in turn): every webdis, through the proxy, to every master.
            for key in keys:
                for _ in range(2 * len(self.webdis)):
                    _probe(port, self.authorization, key, deadline, f"envoy {i}")

    def _probe_keys(self) -> list[str]:
        """A key under the key prefix for each master (by hash slot), or one for a single Redis."""
        base = f"{self.key_prefix}:ready"
        if self.cluster is None:
            return [f"{base}:{secrets.token_hex(6)}"]
        from redis.crc import key_slot

        masters = self.cluster.masters()
        keys: dict[int, str] = {}
        for n in range(10000):
            key = f"{base}:{{p{n}}}"
            slot = key_slot(key.encode())
            port = next((p for p, ranges in masters.items()
                         if any(lo <= slot <= hi for lo, hi in ranges)), None)
            if port is not None and port not in keys:
                keys[port] = key
            if len(keys) == len(masters):
                break
        return list(keys.values())


def _wait_ping(node: RedisServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        client = node.client()
        try:
            if client.ping():
                return
        except Exception as e:  # loading, paused, restarting
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis :{node.port} did not answer PING within {timeout}s: {e}")
            time.sleep(0.05)
        finally:
            client.close()


def _probe(port: int, authorization: str, key: str, deadline: float, name: str) -> None:
    """One script call through an Envoy's probe listener (harness.readiness's script), on a
    connection of its own, again until it works or `deadline`."""
    last = ""
    while True:
        nonce = secrets.token_hex(8)
        words = ["EVAL", readiness.SCRIPT, "1", key, nonce]
        body = "/".join(urllib.parse.quote(w, safe="") for w in words) + ".raw"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
        try:
            conn.request("POST", "/", body=body.encode(), headers={
                "Authorization": authorization,
                "Content-Type": "application/x-www-form-urlencoded"})
            resp = conn.getresponse()
            status, text = resp.status, resp.read().decode(errors="replace")
            if status == 200 and text == f"${len(nonce)}\r\n{nonce}\r\n":
                return
            last = f"HTTP {status} {text.strip()[:120]!r}"
        except OSError as e:
            last = str(e)
        finally:
            conn.close()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: a script call on {key} through its gateway cluster did "
                               f"not work (last: {last})")
        time.sleep(0.05)


def _try(fn, errors: list) -> None:
    try:
        fn()
    except Exception as e:  # keep stopping the rest
        errors.append(e)


def build_target(topology: str, workdir: Path, plugin_config: dict, service_port: int, *,
                 wasm_path: Path | None = None, node_timeout_ms: int = NODE_TIMEOUT_MS,
                 grpc_port: int | None = None, timeout: float = 90.0) -> Target:
    """Start the stack of `topology` ("single" or "cluster") under `workdir`, its two Envoys in
    front of the service on `service_port` (and its gRPC port `grpc_port`, if given) with
    `plugin_config` (see the module's docstring); returns once it is healthy. On failure
    everything it started is stopped again.

    `wasm_path`: another build of the filter (default: the release build, or $CG_WASM).
    `node_timeout_ms`: the cluster's node timeout (the harness's 3 s by default, generous for a
    busy machine: a node that is slow but alive must not be failed over, which would lose
    writes no fault was drawn to lose)."""
    return Target(topology, workdir, plugin_config, service_port, wasm_path,
                  node_timeout_ms, grpc_port).start(timeout)
