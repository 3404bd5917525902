"""The whole system under test: Redis, webdis, the counting upstream and one or more Envoys.

    stack = Stack(tmp_path, plugin_config, envoys=2).start()
    stack.envoy.request("POST", "/orders", headers={"x-tenant-id": "acme"})
    stack.upstream.count("POST", "/orders")
    stack.stop_redis(); ...; stack.start_redis()
    stack.stop()

Every Envoy renders the same template with three gateway clusters, so a plugin config can point
`redis.cluster` at `redis_gateway` (webdis), `redis_gateway_blackhole` (never answers) or
`redis_gateway_dead` (connection refused).

Two topologies: by default a stack starts its own Redis and webdis; `Stack(..., cluster=backend)`
uses a running harness.cluster.ClusterBackend instead (Redis Cluster behind Envoy's redis_proxy
behind two webdis, both endpoints of `redis_gateway`), emptied at `start()` and left running at
`stop()`. `stack.redis` is then a RedisCluster client (harness.cluster.ClusterClient) with the
same calls, `stack.webdis` the first webdis.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from . import readiness
from .cluster import ClusterBackend
from .envoy import DEFAULT_WASM, Envoy
from .proc import RedisServer, reserve_dead_port
from .upstream import Upstream
from .webdis import Webdis

GATEWAY_CLUSTER = "redis_gateway"
BLACKHOLE_CLUSTER = "redis_gateway_blackhole"
DEAD_CLUSTER = "redis_gateway_dead"


class Blackhole:
    """A TCP server that accepts, reads and never answers; runs in a thread of the test process."""

    def __init__(self) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"blackhole-{self.port}", daemon=True)
        self.accepted = 0
        self.bytes_received = 0

    def start(self) -> "Blackhole":
        self._listener.listen(1024)
        self._listener.settimeout(0.1)
        self._thread.start()
        return self

    def _run(self) -> None:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        while not self._stopped.is_set():
            for key, _ in sel.select(timeout=0.1):
                if key.fileobj is self._listener:
                    try:
                        conn, _ = self._listener.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    with self._lock:
                        self._conns.append(conn)
                        self.accepted += 1
                    sel.register(conn, selectors.EVENT_READ)
                else:
                    try:
                        data = key.fileobj.recv(65536)
                    except OSError:
                        data = b""
                    if data:
                        self.bytes_received += len(data)
                    else:
                        sel.unregister(key.fileobj)
        sel.close()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()


def redis_section(authorization: str, cluster: str = GATEWAY_CLUSTER, timeout: str = "50ms",
                  key_prefix: str = "cg:test") -> dict:
    """The plugin's `redis` block for a stack (shape of envoy/demo-plugin.json)."""
    return {"protocol": "webdis", "cluster": cluster, "authority": "redis-gateway",
            "timeout": timeout, "authorization": authorization, "key_prefix": key_prefix}


class Stack:
    """Redis + webdis + upstream + `envoys` Envoys sharing them; `stop()` undoes `start()`."""

    def __init__(self, workdir: Path, plugin_config: dict | str | None = None, envoys: int = 1, *,
                 wasm_path: Path | str | None = None, concurrency: int = 2,
                 local_ratelimit: dict | None = None, direct_response: bool = False,
                 extra_clusters: dict[str, int] | None = None, gateway_key_prefix: str = "cg",
                 cluster: ClusterBackend | None = None):
        self.workdir = Path(workdir).resolve()
        self.plugin_config = plugin_config
        self.envoy_count = envoys
        self.wasm_path = Path(wasm_path) if wasm_path else DEFAULT_WASM
        self.concurrency = concurrency
        self.local_ratelimit = local_ratelimit
        self.direct_response = direct_response
        self.extra_clusters = extra_clusters
        # The gateway's Redis user may touch only `<gateway_key_prefix>:*`: every plugin
        # key_prefix on this stack must be it or start with it and `:`.
        self.gateway_key_prefix = gateway_key_prefix
        self.cluster = cluster
        if cluster is not None and cluster.gateway_key_prefix != gateway_key_prefix:
            raise ValueError(f"the cluster's gateway user has ~{cluster.gateway_key_prefix}:*, "
                             f"this stack wants ~{gateway_key_prefix}:*")
        self.redis_server: RedisServer | None = None  # single topology only
        self.key_prefixes: set[str] = set()  # every key_prefix of redis_section()
        self.redis = None  # redis-py client on the same Redis the filter uses
        self.webdis: Webdis | None = None
        self.upstream: Upstream | None = None
        self.blackhole: Blackhole | None = None
        self.envoys: list[Envoy] = []
        self._dead_socket: socket.socket | None = None
        self.dead_port: int | None = None
        self._failures = 0

    @property
    def envoy(self) -> Envoy:
        return self.envoys[0]

    def start(self, timeout: float = 20.0) -> "Stack":
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            if self.cluster is not None:
                self.cluster.attach(self)
                self.redis = self.cluster.client()
                self.webdis = self.cluster.webdis[0]
            else:
                self.redis_server = RedisServer(self.workdir / "redis",
                                                gateway_key_prefix=self.gateway_key_prefix).start()
                self.redis = self.redis_server.client()
                self.webdis = Webdis(self.workdir / "webdis", self.redis_server.port,
                                     redis_password=self.redis_server.gateway_password).start()
            self.upstream = Upstream(self.workdir / "upstream").start()
            self.blackhole = Blackhole().start()
            self._dead_socket, self.dead_port = reserve_dead_port()
            for i in range(self.envoy_count):
                self.envoys.append(self.new_envoy(self.workdir / f"envoy-{i}"))
                self.envoys[-1].start(timeout)
            # Up means working: a script call from each Envoy through its gateway cluster, to
            # every webdis (in turn on one connection) and Redis as the gateway user.
            gateways = len(self.cluster.webdis) if self.cluster is not None else 1
            for envoy in self.envoys:
                try:
                    readiness.check(readiness.port(envoy.admin_url), self.webdis.authorization,
                                    self.gateway_key_prefix, timeout, calls=2 * gateways)
                except readiness.NotReady as e:
                    raise RuntimeError(f"the stack is not working: {e}\n--- the end of "
                                       f"{e.part}'s log ---\n{self._log_tail(e.part, envoy)}") from e
        except BaseException:
            self.stop()
            raise
        return self

    def _log_tail(self, part: str, envoy: Envoy, lines: int = 20) -> str:
        if part == "envoy":
            text = envoy.log_text()
        elif part == "webdis":
            text = self.webdis.start_log() + self.webdis.log_text()
        elif self.redis_server is not None and self.redis_server.proc is not None:
            text = self.redis_server.proc.log_text()
        else:
            text = "(the cluster's nodes log under their own workdirs)"
        return "\n".join(text.splitlines()[-lines:])

    def new_envoy(self, workdir: Path, plugin_config: dict | str | None = ..., **overrides) -> Envoy:
        """An Envoy wired to this stack (not started); `plugin_config` defaults to the stack's."""
        kwargs = dict(wasm_path=self.wasm_path, blackhole_port=self.blackhole.port,
                      dead_port=self.dead_port, extra_clusters=self.extra_clusters,
                      local_ratelimit=self.local_ratelimit, direct_response=self.direct_response,
                      concurrency=self.concurrency)
        if self.cluster is not None:
            kwargs["extra_gateway_ports"] = [w.port for w in self.cluster.webdis[1:]]
        kwargs.update(overrides)
        config = self.plugin_config if plugin_config is ... else plugin_config
        return Envoy(workdir, config, self.upstream.port, self.webdis.port, **kwargs)

    def add_envoy(self, plugin_config: dict | str | None = ..., **overrides) -> Envoy:
        """Start one more Envoy on this stack (another sidecar); `stop()` stops it too."""
        envoy = self.new_envoy(self.workdir / f"envoy-{len(self.envoys)}", plugin_config, **overrides)
        self.envoys.append(envoy)
        envoy.start()
        return envoy

    def envoy_expect_failure(self, plugin_config: dict | str, timeout: float = 20.0,
                             **overrides) -> tuple[int | None, str]:
        """Start an Envoy that must refuse `plugin_config`: (exit code or None if it stayed up, log)."""
        self._failures += 1
        envoy = self.new_envoy(self.workdir / f"envoy-refused-{self._failures}", plugin_config, **overrides)
        return envoy.start_expect_failure(timeout)

    def redis_section(self, **overrides) -> dict:
        section = redis_section(self.webdis.authorization, **overrides)
        prefix, acl = section["key_prefix"], self.gateway_key_prefix
        if prefix != acl and not prefix.startswith(acl + ":"):
            raise ValueError(f"key_prefix {prefix!r} is outside the gateway user's keys "
                             f"(~{acl}:*): use {acl!r} or {acl + ':...'!r}")
        self.key_prefixes.add(prefix)
        return section

    def stop_redis(self) -> None:
        """Redis goes away; webdis stays and answers 503 until `start_redis()`. (Cluster: the
        redis proxy, webdis's one Redis endpoint, goes away; see harness.cluster.)"""
        if self.cluster is not None:
            self.cluster.stop_redis()
            return
        self.redis_server.stop()

    def start_redis(self, timeout: float = 10.0, wait_gateway: bool = True) -> None:
        """Redis comes back on the same port, empty (no persistence).

        webdis retries its Redis connection about every 100 ms and answers 503 until then;
        each worker thread reconnects on its own, and the filter's pooled connections stay
        with the thread that accepted them. With `wait_gateway` this returns only once
        webdis answered twice as many EVALs in a row as it has threads, each on a new
        connection (handed to the threads in turn), so every thread is back.
        """
        if self.cluster is not None:
            self.cluster.start_redis(timeout, wait_gateway, self.key_prefixes)
            return
        self.redis_server.start(timeout)
        if wait_gateway:
            self.webdis.wait_redis(timeout)

    def stop(self) -> None:
        errors = []
        for envoy in reversed(self.envoys):
            _try(envoy.stop, errors)
        if self.blackhole is not None:
            _try(self.blackhole.stop, errors)
        if self._dead_socket is not None:
            self._dead_socket.close()
            self._dead_socket = None
        for part in (self.upstream, None if self.cluster else self.webdis):
            if part is not None:
                _try(part.stop, errors)
        if self.redis is not None:
            _try(self.redis.close, errors)
        if self.cluster is not None:
            _try(lambda: self.cluster.detach(self, self.key_prefixes), errors)
        if self.redis_server is not None:
            _try(self.redis_server.stop, errors)
        if errors:
            raise errors[0]

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _try(fn, errors: list) -> None:
    try:
        fn()
    except Exception as e:  # keep stopping the rest
        errors.append(e)
