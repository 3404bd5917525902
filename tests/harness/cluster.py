"""Redis Cluster behind Envoy's redis_proxy behind two webdis: the cluster topology.

    backend = ClusterBackend(workdir).start()   # 6 nodes, the proxy, 2 webdis
    backend.client()          # redis-py RedisCluster as the admin user (ClusterClient)
    backend.webdis            # [Webdis, Webdis], both -> the proxy
    backend.masters()         # {port: [(first slot, last slot), ...]} from CLUSTER NODES
    backend.stop()

Six `redis-server --cluster-enabled yes` on free loopback ports (3 masters, 3 replicas, made by
`redis-cli --cluster create --cluster-replicas 1`), each with the single-node harness's ACL
users (proc.RedisServer): the restricted `default` gateway user, which here may also run
`CLUSTER SLOTS` (the proxy discovers the topology with it), and `admin`. Replicas replicate as
`admin` (masteruser/masterauth in a 0600 config file). The proxy (envoy/redis-cluster-proxy.yaml)
authenticates to the nodes as `default` and asks its own clients for a password of its own,
which webdis sends as `redis_auth`.

The cluster is started once (per test module) and shared: `reset()` empties it for the next
stack. `stop_redis()` / `start_redis()` stop and start the proxy, the one Redis endpoint
webdis has: webdis answers 503 at once, as with a single Redis down; `start_redis()` then
empties the cluster, as a restarted Redis without persistence would be, unless `save` points
are configured (a Redis with persistence keeps its data). Restarting the six nodes instead
would take over 2 s (a restarted master waits CLUSTER_WRITABLE_DELAY before serving), longer
than some of the records the suites keep over an outage; losing a node is what
tests/test_e2e_cluster.py does, with SIGKILL.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

from .envoy import spawn_envoy, substitute, validate_config
from .proc import (ADMIN_USER, GATEWAY_USER, ROOT, RedisServer, Service, free_port,
                   require_binary, wait_for_port, wait_http)
from .webdis import Webdis

PROXY_TEMPLATE = ROOT / "envoy" / "redis-cluster-proxy.yaml"
# What the gateway user needs on a cluster node beyond GATEWAY_COMMANDS: the proxy's topology
# discovery. (tests/test_scripts_acl.py keeps GATEWAY_COMMANDS equal to the scripts' commands.)
CLUSTER_GATEWAY_RULES = "+cluster|slots"
# How long a master may be unreachable before its replica takes over. Generous for a busy
# 2-core machine (a stalled but live node must not be failed over); failover takes about this
# plus a second.
NODE_TIMEOUT_MS = 3000
MASTERS = 3
NODES = 2 * MASTERS
SLOTS = 16384


class ClusterNode(RedisServer):
    """One cluster node: RedisServer's ACL users and start/stop, cluster mode on."""

    def __init__(self, workdir: Path, port: int | None, gateway_password: str, admin_password: str,
                 gateway_key_prefix: str = "cg", node_timeout_ms: int = NODE_TIMEOUT_MS):
        super().__init__(workdir, port, gateway_key_prefix)
        self.gateway_password = gateway_password
        self.admin_password = admin_password
        self.gateway_extra_rules = CLUSTER_GATEWAY_RULES
        self.node_timeout_ms = node_timeout_ms
        # The cluster bus port, chosen like the client port (the default, port + 10000, may be
        # taken or above 65535).
        self.bus_port = free_port()
        self.config_lines = self.cluster_config()

    def cluster_config(self) -> list[str]:
        return [
            "cluster-enabled yes",
            f"cluster-port {self.bus_port}",
            "cluster-config-file nodes.conf",
            f"cluster-node-timeout {self.node_timeout_ms}",
            # A shard without a master fails its own slots only; the other masters keep serving.
            "cluster-require-full-coverage no",
            f"masteruser {ADMIN_USER}",
            f"masterauth {self.admin_password}",
        ]

    def start(self, timeout: float = 10.0) -> "ClusterNode":
        """Start (or restart) the node. At its first start only, a bus port that another
        process took between its choice and now (a connection's port from the ephemeral range)
        is chosen again: nothing refers to it before the cluster is made. Once it is, a
        restarted node keeps its bus port, as the other nodes know it."""
        retries = 2
        while True:
            try:
                super().start(timeout)
                return self
            except RuntimeError:
                taken = f"Failed listening on port {self.bus_port} (cluster)"
                log = self.proc.log_text() if self.proc is not None else ""
                if self.started or retries == 0 or taken not in log:
                    raise
                retries -= 1
                self.bus_port = free_port()
                self.config_lines = self.cluster_config()


class RedisProxy(Service):
    """Envoy with envoy/redis-cluster-proxy.yaml: the Redis endpoint in front of the cluster.

    `start()` again after `stop()` reuses the same port (webdis keeps pointing at it)."""

    def __init__(self, workdir: Path, seed_ports: list[int], username: str, password: str,
                 port: int | None = None, admin_port: int = 0, client_password: str | None = None):
        self.workdir = Path(workdir).resolve()
        self.port = port or free_port()
        self.admin_port = admin_port
        self.seed_ports = list(seed_ports)
        self.username, self.password = username, password
        # What its clients (webdis) must send with `AUTH <password>`.
        self.client_password = client_password or secrets.token_hex(16)
        self.config_path = self.workdir / "redis-proxy.yaml"
        self.admin_address_path = self.workdir / "admin.address"

    def env(self) -> dict[str, str]:
        return {"CG_PROXY_PASSWORD": self.client_password, "CG_REDIS_USERNAME": self.username,
                "CG_REDIS_PASSWORD": self.password}

    def render(self, out: Path | None = None) -> Path:
        """Write the proxy config (the template with ports filled in); no secret in it."""
        out = out or self.config_path
        values = {"PROXY_PORT": self.port, "ADMIN_PORT": self.admin_port}
        values.update({f"SEED_PORT_{i}": p for i, p in enumerate(self.seed_ports)})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(substitute(PROXY_TEMPLATE.read_text(), values))
        return out

    def validate(self) -> tuple[int, str]:
        """`envoy --mode validate` on the rendered config (with the variables set)."""
        self.render()
        return validate_config(self.config_path, env=self.env())

    def start(self, timeout: float = 30.0) -> "RedisProxy":
        self.render()
        self.admin_address_path.unlink(missing_ok=True)
        self.proc = spawn_envoy(self.workdir, self.config_path, concurrency=1,
                                admin_address_path=self.admin_address_path, env=self.env())
        self.proc.name = f"redis-proxy-{self.port}"
        try:
            deadline = time.monotonic() + timeout
            while not self.admin_address_path.exists() or not self.admin_address_path.read_text().strip():
                if not self.proc.alive():
                    raise RuntimeError(f"redis proxy exited with {self.proc.popen.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis proxy: no admin address within {timeout}s")
                time.sleep(0.02)
            admin = int(self.admin_address_path.read_text().strip().rsplit(":", 1)[1])
            self.admin_url = f"http://127.0.0.1:{admin}"
            # Ready once the cluster is initialised: the first CLUSTER SLOTS was answered.
            wait_http(f"{self.admin_url}/ready", max(0.1, deadline - time.monotonic()), self.proc,
                      expect=200)
            wait_for_port(self.port, max(0.1, deadline - time.monotonic()), self.proc.popen)
        except Exception as e:
            tail = self.proc.log_tail(40)
            self.proc.stop()
            raise RuntimeError(f"redis proxy did not start: {e}\n{tail}") from e
        return self


class ClusterBackend:
    """Six nodes, the redis proxy and two webdis; what a cluster-topology Stack uses."""

    def __init__(self, workdir: Path, gateway_key_prefix: str = "cg",
                 node_timeout_ms: int = NODE_TIMEOUT_MS, node_ports: list[int] | None = None,
                 proxy_port: int | None = None, proxy_admin_port: int = 0,
                 webdis_ports: list[int] | None = None, webdis_threads: int = 2,
                 keep_data: bool = False):
        self.workdir = Path(workdir).resolve()
        self.gateway_key_prefix = gateway_key_prefix
        # `start_redis` keeps the data (the demo: only the proxy went away) instead of acting
        # out a restart without persistence (the tests).
        self.keep_data = keep_data
        self.gateway_password = secrets.token_hex(16)
        self.admin_password = secrets.token_hex(16)
        ports = node_ports or [free_port() for _ in range(NODES)]
        if len(ports) != NODES:
            raise ValueError(f"a cluster here has {NODES} nodes, got {len(ports)} ports")
        self.nodes = [ClusterNode(self.workdir / f"node-{p}", p, self.gateway_password,
                                  self.admin_password, gateway_key_prefix, node_timeout_ms)
                      for p in ports]
        for node in self.nodes:  # a port chosen here is chosen again if taken before its start
            node.own_port = node_ports is None
        # Seeds: three nodes; the proxy learns the rest from CLUSTER SLOTS.
        self.proxy = RedisProxy(self.workdir / "proxy", ports[0::2], GATEWAY_USER,
                                self.gateway_password, port=proxy_port, admin_port=proxy_admin_port)
        webdis_ports = webdis_ports or [None, None]
        self.webdis = [Webdis(self.workdir / f"webdis-{i}", self.proxy.port, port=p,
                              redis_password=self.proxy.client_password)
                       for i, p in enumerate(webdis_ports)]
        for w in self.webdis:
            w.threads = webdis_threads
        self._client = None
        self._attached: list[object] = []

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> "ClusterBackend":
        try:
            for node in self.nodes:
                node.start(timeout=10)
            self.proxy.seed_ports = [n.port for n in self.nodes[0::2]]  # as they started
            self._create(timeout)
            self.wait_healthy(timeout)
            self.proxy.start(timeout=30)
            for w in self.webdis:
                w.start(timeout=10)
            self.wait_gateway(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self, timeout: float) -> None:
        cli = require_binary("redis-cli")
        argv = [cli, "--user", ADMIN_USER, "--no-auth-warning", "--cluster", "create",
                *[f"127.0.0.1:{n.port}" for n in self.nodes],
                "--cluster-replicas", "1", "--cluster-yes"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL,
                                env={**os.environ, "REDISCLI_AUTH": self.admin_password})
        if result.returncode != 0 or "[OK] All 16384 slots covered" not in result.stdout:
            raise RuntimeError(f"redis-cli --cluster create failed ({result.returncode}):\n"
                               f"{result.stdout[-3000:]}\n{result.stderr[-2000:]}")

    def stop(self) -> None:
        errors = []
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None
        for part in [*self.webdis, self.proxy, *self.nodes]:
            try:
                part.stop()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def alive(self) -> bool:
        """Every process of it still runs (the demo watches this)."""
        return all(part.alive() for part in [*self.nodes, self.proxy, *self.webdis])

    # --- state -------------------------------------------------------------------------------

    def live_nodes(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive()]

    def node_by_port(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    def cluster_nodes(self, via: ClusterNode | None = None) -> list[dict]:
        """CLUSTER NODES as seen by `via` (a live node): id, port, role, flags, slot ranges."""
        text = _raw(via or self.live_nodes()[0], "CLUSTER NODES")
        out = []
        for line in text.strip().splitlines():
            parts = line.split()
            flags = parts[2].split(",")
            slots = []
            for s in parts[8:]:
                if s.startswith("["):
                    continue  # a slot being migrated
                lo, _, hi = s.partition("-")
                slots.append((int(lo), int(hi or lo)))
            out.append({"id": parts[0], "port": int(parts[1].split("@")[0].rsplit(":", 1)[1]),
                        "flags": flags, "master_id": parts[3], "slots": slots,
                        "connected": parts[7] == "connected"})
        return out

    def masters(self, via: ClusterNode | None = None) -> dict[int, list[tuple[int, int]]]:
        """{port: slot ranges} of every master that serves slots and is not failed."""
        return {n["port"]: n["slots"] for n in self.cluster_nodes(via)
                if "master" in n["flags"] and n["slots"] and "fail" not in n["flags"]}

    def master_for_slot(self, slot: int, via: ClusterNode | None = None) -> int:
        for port, ranges in self.masters(via).items():
            if any(lo <= slot <= hi for lo, hi in ranges):
                return port
        raise LookupError(f"no master serves slot {slot}")

    def wait_healthy(self, timeout: float = 60.0, replicas: int = MASTERS) -> None:
        """Until every live node says cluster_state:ok, all slots are served by live masters
        and `replicas` replicas have their link to their master up."""
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            try:
                last = self._health(replicas)
                if last is True:
                    return
            except Exception as e:  # a node still starting or just gone
                last = e
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not healthy within {timeout}s: {last}")
            time.sleep(0.1)

    def _health(self, replicas: int):
        live = {n.port for n in self.live_nodes()}
        for node in self.live_nodes():
            if "cluster_state:ok" not in _raw(node, "CLUSTER INFO"):
                return f"{node.port}: not ok"
        masters = self.masters()
        if any(p not in live for p in masters):
            return f"a dead node still serves slots: {masters}"
        covered = sum(hi - lo + 1 for ranges in masters.values() for lo, hi in ranges)
        if covered != SLOTS:
            return f"{covered} slots covered"
        up = 0
        for node in self.live_nodes():
            client = node.client()
            try:
                repl = client.info("replication")
            finally:
                client.close()
            if repl.get("role") == "slave" and repl.get("master_link_status") == "up":
                up += 1
        return True if up >= replicas else f"{up} replicas linked"

    # --- clients -----------------------------------------------------------------------------

    def client(self) -> "ClusterClient":
        """redis-py RedisCluster as the admin user, on the live nodes."""
        from redis.cluster import ClusterNode as Seed

        return ClusterClient(startup_nodes=[Seed("127.0.0.1", n.port) for n in self.live_nodes()],
                             username=ADMIN_USER, password=self.admin_password,
                             socket_timeout=5, admin_password=self.admin_password)

    def gateway_eval(self, webdis: Webdis, key: str = "cg:probe") -> tuple[int, bytes]:
        """A keyed EVAL through `webdis` (the proxy cannot route an EVAL without keys)."""
        return webdis.eval("return 1", keys=[key])

    def wait_gateway(self, timeout: float = 30.0) -> None:
        """Until each webdis answered twice as many keyed EVALs in a row as it has threads
        (each on a new connection, so every thread reconnected to the proxy)."""
        deadline = time.monotonic() + timeout
        for w in self.webdis:
            in_a_row, last = 0, None
            while in_a_row < 2 * w.threads:
                try:
                    last = self.gateway_eval(w)
                except OSError as e:
                    last = e
                in_a_row = in_a_row + 1 if last == (200, b":1\r\n") else 0
                if in_a_row == 0:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"webdis :{w.port} -> redis proxy -> cluster did not "
                                           f"answer within {timeout}s (last: {last!r})")
                    time.sleep(0.02)

    # --- what a Stack does with it -----------------------------------------------------------
    # On a single Redis every stack has a Redis of its own; here stacks share the cluster (a
    # module's shared stack and the stacks its other tests make, one at a time). So the first
    # stack attached finds the cluster empty, and every other one leaves behind none of the keys
    # under the key prefixes it used (Stack.redis_section records them), without touching the
    # keys of the stacks still attached.

    def attach(self, stack: object) -> None:
        if not self._attached:
            self.reset()
        else:
            self._reset_config()
        self._attached.append(stack)

    def detach(self, stack: object, prefixes: set[str]) -> None:
        if stack in self._attached:
            self._attached.remove(stack)
        if not self.proxy.alive():
            self.proxy.start()  # a test stopped "Redis" and did not start it again
        if self._attached:
            self.delete_prefixes(prefixes)

    def reset(self) -> None:
        """Empty, as a fresh Redis: no keys, no scripts, no persistence, no notifications."""
        self._reset_config()
        client = self.client()
        try:
            client.flushall()
            client.script_flush()
        finally:
            client.close()

    def _reset_config(self) -> None:
        client = self.client()
        try:
            client.config_set("save", "")
            client.config_set("notify-keyspace-events", "")
        finally:
            client.close()

    def delete_prefixes(self, prefixes: set[str]) -> None:
        """Delete every key under `<prefix>:*` for each prefix, on every master."""
        client = self.client()
        try:
            for prefix in prefixes:
                for key in list(client.scan_iter(match=f"{prefix}:*", count=1000)):
                    client.delete(key)
        finally:
            client.close()

    def stop_redis(self) -> None:
        """Redis goes away for the gateway: the proxy stops; webdis answers 503."""
        self.proxy.stop()

    def start_redis(self, timeout: float = 30.0, wait_gateway: bool = True,
                    prefixes: set[str] | None = None) -> None:
        """Redis comes back: scripts gone; data gone unless `save` points are configured or
        `keep_data` is set (as a restarted Redis without / with persistence): everything if only one stack is attached,
        else the keys under `prefixes` (the stack's own). The proxy starts on the same port."""
        client = self.client()
        try:
            persistent = self.keep_data or any(v.get("save")
                                               for v in client.config_get("save").values())
            if not persistent and len(self._attached) <= 1:
                client.flushall()
            client.script_flush()
        finally:
            client.close()
        if not persistent and len(self._attached) > 1:
            self.delete_prefixes(prefixes or set())
        self.proxy.start(timeout)
        if wait_gateway:
            self.wait_gateway(timeout)

    def kill(self, port: int) -> None:
        """SIGKILL one node by its pid (nothing else gets a signal)."""
        node = self.node_by_port(port)
        os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait_exit(10)
        node.stop()


def _raw(node: ClusterNode, command: str) -> str:
    """A reply as Redis sent it (redis-py parses CLUSTER NODES / INFO into dicts)."""
    client = node.client()
    client.set_response_callback(command, lambda response, **_: response)
    try:
        raw = client.execute_command(command)
    finally:
        client.close()
    return raw.decode() if isinstance(raw, bytes) else raw


def _redis_cluster_class():
    from redis.cluster import RedisCluster

    return RedisCluster


class ClusterClient(_redis_cluster_class()):
    """redis-py's RedisCluster with the admin user, and the commands the e2e suites use on
    `stack.redis` made cluster-wide where redis-py sends them to one node only: KEYS (every
    master), CONFIG SET / GET (every node), SCRIPT FLUSH (every node, replicas too: one may be
    promoted), and `pubsub()` for keyspace notifications (every master: each node notifies only
    about its own keys)."""

    def __init__(self, *args, admin_password: str, **kwargs):
        super().__init__(*args, **kwargs)
        self._admin_password = admin_password

    def keys(self, pattern="*", **kwargs):
        return self.execute_command("KEYS", pattern, target_nodes=self.PRIMARIES, **kwargs)

    def config_set(self, name, value, *args, **kwargs):
        kwargs.setdefault("target_nodes", self.ALL_NODES)
        return super().config_set(name, value, *args, **kwargs)

    def config_get(self, pattern="*", *args, **kwargs):
        kwargs.setdefault("target_nodes", self.ALL_NODES)
        return super().config_get(pattern, *args, **kwargs)

    def script_flush(self, *args, **kwargs):
        return self.execute_command("SCRIPT FLUSH", *args, target_nodes=self.ALL_NODES)

    def pubsub(self, **kwargs):
        import redis

        clients = [redis.Redis(host=n.host, port=n.port, username=ADMIN_USER,
                               password=self._admin_password, socket_timeout=5)
                   for n in self.get_primaries()]
        return _AllNodesPubSub(clients)


class _AllNodesPubSub:
    """One PubSub per master behind the PubSub calls the suites make."""

    def __init__(self, clients) -> None:
        self.clients = clients
        self.subs = [c.pubsub() for c in clients]

    def psubscribe(self, *patterns) -> None:
        for sub in self.subs:
            sub.psubscribe(*patterns)

    def subscribe(self, *channels) -> None:
        for sub in self.subs:
            sub.subscribe(*channels)

    def get_message(self, timeout: float = 0.0, **kwargs):
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
            for sub in self.subs:
                msg = sub.get_message(timeout=0.0, **kwargs)
                if msg is not None:
                    return msg
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)

    def close(self) -> None:
        for sub in self.subs:
            sub.close()
        for c in self.clients:
            c.close()

