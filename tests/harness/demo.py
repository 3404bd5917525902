"""`make run`: Redis, webdis, the counting upstream and Envoy with the filter, on fixed ports.

    PYTHONPATH=tests .venv/bin/python -m harness.demo            # start, print curl lines, wait
    PYTHONPATH=tests .venv/bin/python -m harness.demo --render-only  # just write build/demo.yaml
    PYTHONPATH=tests .venv/bin/python -m harness.demo --cluster  # on Redis Cluster (make run CLUSTER=1)

With --cluster, Redis is a Redis Cluster of six nodes (:7001-7006, 3 masters + 3 replicas) behind
Envoy's redis_proxy on the Redis port (:6379, admin :9902; envoy/redis-cluster-proxy.yaml,
written to build/redis-cluster-proxy.yaml), behind two webdis (:7379 and :7380), both endpoints
of the filter's gateway cluster (tests/harness/cluster.py).

Ctrl-C or SIGTERM stops every process it started, by pid. A busy port is reported with the
process holding it (Debian may start its own redis-server/webdis services on 6379/7379); the
demo never stops processes it did not start.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .cluster import NODES, ClusterBackend, RedisProxy
from .envoy import DEFAULT_WASM, spawn_envoy, substitute
from .proc import ROOT, PrerequisiteMissing, RedisServer, wait_for_port, wait_http
from .upstream import Upstream
from .webdis import Webdis

DEMO_TEMPLATE = ROOT / "envoy" / "demo.yaml"
DEMO_PLUGIN = ROOT / "envoy" / "demo-plugin.json"
BUILD = ROOT / "build"
# The ports written in envoy/demo.yaml (and demo-plugin.json's world); --*-port overrides them.
PORTS = {"envoy": 10000, "admin": 9901, "upstream": 8080, "webdis": 7379, "redis": 6379}
# --cluster adds these: the second webdis, the redis proxy's admin, the six nodes from node_base.
CLUSTER_PORTS = {"webdis2": 7380, "proxy_admin": 9902, "node_base": 7001}


def node_ports(ports: dict[str, int]) -> list[int]:
    return [ports["node_base"] + i for i in range(NODES)]


def render_demo(out: Path, ports: dict[str, int] = PORTS, wasm_path: Path = DEFAULT_WASM,
                cluster: bool = False) -> Path:
    """Write the runnable demo config: demo.yaml with the wasm path and plugin JSON filled in
    (with `cluster`, both webdis as endpoints of the gateway cluster)."""
    text = DEMO_TEMPLATE.read_text()
    for name in ("envoy", "admin", "upstream", "webdis"):
        if ports[name] != PORTS[name]:
            text = text.replace(f"port_value: {PORTS[name]} }}", f"port_value: {ports[name]} }}")
    if cluster:
        # The gateway endpoint's three lines again, for the second webdis.
        lines = text.splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if f"port_value: {ports['webdis']} }}" in line)
        endpoint = lines[at - 2:at + 1]
        assert endpoint[0].strip() == "- endpoint:", endpoint
        second = [line.replace(f"port_value: {ports['webdis']} }}", f"port_value: {ports['webdis2']} }}")
                  for line in endpoint]
        text = "".join(lines[:at + 1] + second + lines[at + 1:])
    plugin = DEMO_PLUGIN.read_text()
    prefix = json.loads(plugin)["redis"]["key_prefix"]  # fail here, not in Envoy, if not JSON
    if not prefix.startswith("cg:"):
        raise ValueError(f"{DEMO_PLUGIN}: key_prefix {prefix!r} is outside the gateway user's keys (~cg:*)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(substitute(text, {"WASM_PATH": str(wasm_path)}, plugin.strip()))
    return out


def port_holder(port: int) -> str | None:
    """Who listens on 127.0.0.1:port (None if nobody): `name (pid N)` when ss can tell."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return None
        except OSError:
            pass
    try:
        out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True,
                             timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        if 'users:(("' in line:
            name = line.split('users:(("', 1)[1].split('"', 1)[0]
            pid = line.split("pid=", 1)[1].split(",", 1)[0] if "pid=" in line else "?"
            return f"{name} (pid {pid})"
    return "another process"


def render_cluster_proxy(out: Path, ports: dict[str, int]) -> Path:
    """Write the demo's redis proxy config (envoy/redis-cluster-proxy.yaml, ports filled in)."""
    nodes = node_ports(ports)
    proxy = RedisProxy(out.parent, nodes[0::2], "default", "", port=ports["redis"],
                       admin_port=ports["proxy_admin"])
    return proxy.render(out)


def check_ports(ports: dict[str, int]) -> None:
    if "node_base" in ports:
        ports = {**{k: v for k, v in ports.items() if k != "node_base"},
                 **{f"node-{i + 1}": p for i, p in enumerate(node_ports(ports))}}
    busy = {name: (port, port_holder(port)) for name, port in ports.items()}
    busy = {name: v for name, v in busy.items() if v[1] is not None}
    if busy:
        lines = [f"  {name}: 127.0.0.1:{port} is in use by {holder}" for name, (port, holder) in busy.items()]
        hint = ("Stop it yourself (e.g. `service redis-server stop`, `service webdis stop` for "
                "Debian's services) or pass other ports (--redis-port, --webdis-port, ...); "
                "the demo does not stop processes it did not start.")
        raise SystemExit("demo: ports busy:\n" + "\n".join(lines) + "\n" + hint)


def instructions(ports: dict[str, int], config: Path, logs: Path, redis_admin: str = "<password>",
                 cluster: bool = False) -> str:
    envoy = f"http://127.0.0.1:{ports['envoy']}"
    admin = f"http://127.0.0.1:{ports['admin']}"
    order = f"curl -i -X POST -H 'x-tenant-id: acme' -H 'x-user-id: alice' {envoy}/orders"
    burst = ("for i in $(seq 1 8); do curl -s -o /dev/null -w '%{http_code}\\n' -X POST "
             f"-H 'x-tenant-id: acme' -H 'x-user-id: alice' {envoy}/orders; done")
    idem = (f"curl -i -X POST -H 'x-tenant-id: acme' -H 'x-user-id: bob' "
            f"-H 'content-type: application/json' -H 'idempotency-key: \"order-0001\"' {envoy}/orders")
    redis_cli = (f"redis-cli -p {ports['redis']} --user admin --pass {redis_admin} --no-auth-warning "
                 "--scan --pattern 'cg:demo:*'")
    backend = f"  webdis    http://127.0.0.1:{ports['webdis']} -> Redis 127.0.0.1:{ports['redis']}"
    if cluster:
        nodes = node_ports(ports)
        redis_cli = (f"redis-cli --user admin --pass {redis_admin} --no-auth-warning --cluster call "
                     f"127.0.0.1:{nodes[0]} KEYS 'cg:demo:*'\n"
                     f"  redis-cli -p {nodes[0]} --user admin --pass {redis_admin} --no-auth-warning "
                     "cluster nodes")
        backend = (f"  webdis    http://127.0.0.1:{ports['webdis']} and :{ports['webdis2']}"
                   f" -> redis_proxy 127.0.0.1:{ports['redis']} (admin :{ports['proxy_admin']})"
                   f" -> Redis Cluster 127.0.0.1:{nodes[0]}-{nodes[-1]} (3 masters, 3 replicas)")
    return f"""
coordination-guard demo is up
  Envoy     {envoy}  (admin {admin})
  upstream  http://127.0.0.1:{ports['upstream']}
{backend}
  config    {config}
  logs      {logs}/

An allowed request:
  {order}
A burst that exceeds the user-burst limit (2/s, burst 3) and gets 429s:
  {burst}
An idempotent request, sent twice: the second is replayed (Idempotent-Replayed: true) and the
service runs it once; the same key with another body gets 422:
  {idem} -d '{{"item": "book", "qty": 1}}'
  {idem} -d '{{"qty": 1, "item": "book"}}'
  {idem} -d '{{"item": "pen", "qty": 2}}'
Redis as the harness's admin user (webdis's own user may run only the scripts' commands on cg:* keys):
  {redis_cli}
The filter's metrics:
  curl -s '{admin}/stats?filter=wasmcustom'
  curl -s {admin}/stats/prometheus | grep '^cg_'
What the service actually executed:
  curl -s http://127.0.0.1:{ports['upstream']}/__upstream/stats

Ctrl-C stops everything.
""".strip("\n")


def run(ports: dict[str, int], wasm_path: Path, out: Path, logs: Path, timeout: float = 20.0,
        cluster: bool = False) -> int:
    if not wasm_path.exists():
        raise PrerequisiteMissing(f"{wasm_path} is missing; run `make build`")
    check_ports(ports)
    config = render_demo(out, ports, wasm_path, cluster)
    started: dict[str, object] = {}  # label -> RedisServer | Webdis | Upstream | Proc

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        # The same restricted gateway user as the tests: keys `cg:*` (the demo's key_prefix
        # is cg:demo), only the scripts' commands.
        if cluster:
            backend = ClusterBackend(logs / "cluster", node_ports=node_ports(ports),
                                     proxy_port=ports["redis"], proxy_admin_port=ports["proxy_admin"],
                                     webdis_ports=[ports["webdis"], ports["webdis2"]])
            backend.proxy.config_path = out.parent / "redis-cluster-proxy.yaml"
            started["cluster"] = redis = backend.start(timeout=60)
        else:
            started["redis"] = redis = RedisServer(logs / "redis", ports["redis"]).start(timeout)
            started["webdis"] = Webdis(logs / "webdis", ports["redis"], port=ports["webdis"],
                                       redis_password=redis.gateway_password).start(timeout)
        started["upstream"] = Upstream(logs / "upstream", ports["upstream"]).start(timeout)
        started["envoy"] = envoy = spawn_envoy(logs / "envoy", config)
        wait_http(f"http://127.0.0.1:{ports['admin']}/ready", timeout, envoy, expect=200)
        wait_for_port(ports["envoy"], timeout, envoy.popen)
        print(instructions(ports, config, logs, redis.admin_password, cluster), flush=True)
        print("pids: " + " ".join(f"{label}={pid}" for label, pid in _pids(started)), flush=True)
        while all(p.alive() for p in started.values()):
            time.sleep(0.5)
        dead = [label for label, p in started.items() if not p.alive()]
        print(f"demo: {', '.join(dead)} exited unexpectedly; logs in {logs}/", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping demo", flush=True)
        return 0
    except Exception as e:
        print(f"demo: start-up failed: {e}\nlogs in {logs}/", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not abort the clean-up
        for part in reversed(list(started.values())):
            part.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _pid(part) -> int:
    return part.pid if hasattr(part, "pid") else part.proc.pid


def _pids(started: dict[str, object]) -> list[tuple[str, int]]:
    out = []
    for label, part in started.items():
        if isinstance(part, ClusterBackend):
            out += [(f"redis-{n.port}", n.proc.pid) for n in part.nodes]
            out += [("redis-proxy", part.proxy.proc.pid)]
            out += [(f"webdis-{w.port}", w.proc.pid) for w in part.webdis]
        else:
            out.append((label, _pid(part)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the coordination-guard demo on fixed ports.")
    for name, port in PORTS.items():
        parser.add_argument(f"--{name}-port", type=int, default=port)
    parser.add_argument("--wasm", type=Path, default=DEFAULT_WASM)
    parser.add_argument("--out", type=Path, default=BUILD / "demo.yaml", help="rendered Envoy config")
    parser.add_argument("--logs", type=Path, default=BUILD / "demo")
    for name, port in CLUSTER_PORTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}-port", type=int, default=port,
                            help="with --cluster")
    parser.add_argument("--cluster", action="store_true",
                        help="Redis Cluster (6 nodes) behind redis_proxy behind two webdis")
    parser.add_argument("--render-only", action="store_true", help="write the config and exit")
    args = parser.parse_args(argv)
    ports = {name: getattr(args, f"{name}_port") for name in PORTS}
    if args.cluster:
        ports.update({name: getattr(args, f"{name}_port") for name in CLUSTER_PORTS})
    if args.render_only:
        print(render_demo(args.out, ports, args.wasm, args.cluster))
        if args.cluster:
            print(render_cluster_proxy(args.out.parent / "redis-cluster-proxy.yaml", ports))
        return 0
    try:
        return run(ports, args.wasm, args.out, args.logs, cluster=args.cluster)
    except PrerequisiteMissing as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
