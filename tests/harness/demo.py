"""`make run`: Redis, webdis, the counting upstream and Envoy with the filter, on fixed ports.

    PYTHONPATH=tests .venv/bin/python -m harness.demo            # start, print curl lines, wait
    PYTHONPATH=tests .venv/bin/python -m harness.demo --render-only  # just write build/demo.yaml
    ... -m harness.demo --plugin my-plugin.json --redis-port 6380     # own config, other ports
    ... -m harness.demo --cluster                                      # on Redis Cluster (make run CLUSTER=1)

With --cluster, Redis is a Redis Cluster of six nodes (:7001-7006, 3 masters + 3 replicas) behind
Envoy's redis_proxy on the Redis port (admin on the admin port + 1; envoy/redis-cluster-proxy.yaml,
written next to the Envoy config as redis-cluster-proxy.yaml), behind two webdis (the webdis port
and the next one), both endpoints of the filter's gateway cluster (tests/harness/cluster.py).
"Redis down" (SIGUSR1) then stops the proxy.

The commands it prints are derived from the plugin configuration it runs: one example per
kind of policy in it (rate limit, idempotency, lease) and fail-closed. While it runs, SIGUSR1
stops its Redis and SIGUSR2 starts it again (`make demo-redis-down` / `make demo-redis-up`,
through the pid in <logs>/demo.pid), so fail-closed answers can be watched.

Ctrl-C or SIGTERM stops every process it started, by pid. A busy port is reported with the
process holding it (Debian may start its own redis-server/webdis services on 6379/7379); the
demo never stops processes it did not start. Its logs start fresh at every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from . import readiness
from .cluster import NODES, ClusterBackend, RedisProxy
from .envoy import DEFAULT_WASM, spawn_envoy, substitute
from .proc import (ADMIN_USER, ROOT, PrerequisiteMissing, RedisServer, beyond_loopback,
                   wait_for_port, wait_http)
from .upstream import Upstream
from .webdis import Webdis

DEMO_TEMPLATE = ROOT / "envoy" / "demo.yaml"
DEMO_PLUGIN = ROOT / "envoy" / "demo-plugin.json"
BUILD = ROOT / "build"
# The ports written in envoy/demo.yaml (and demo-plugin.json's world); --*-port overrides them.
PORTS = {"envoy": 10000, "admin": 9901, "upstream": 8080, "webdis": 7379, "redis": 6379}
# --cluster adds these (defaults: the webdis port + 1, the admin port + 1, 7001).
CLUSTER_PORTS = ("webdis2", "proxy_admin", "node_base")


def cluster_ports(ports: dict[str, int], webdis2: int | None = None, proxy_admin: int | None = None,
                  node_base: int = 7001) -> dict[str, int]:
    return {**ports, "webdis2": webdis2 or ports["webdis"] + 1,
            "proxy_admin": proxy_admin or ports["admin"] + 1, "node_base": node_base}


def node_ports(ports: dict[str, int]) -> list[int]:
    return [ports["node_base"] + i for i in range(NODES)]


class PluginError(ValueError):
    """The plugin configuration cannot run in the demo; the message says why and what to do."""


def load_plugin(path: Path) -> dict:
    """The plugin JSON, checked for what the demo's stack needs (the filter checks the rest)."""
    try:
        plugin = json.loads(path.read_text())
    except OSError as e:
        raise PluginError(f"{path}: cannot read it ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise PluginError(f"{path}:{e.lineno}:{e.colno}: not JSON: {e.msg}") from e
    redis = plugin.get("redis") if isinstance(plugin, dict) else None
    if not isinstance(redis, dict):
        raise PluginError(f"{path}: redis: is required (copy the block of {DEMO_PLUGIN.name})")
    demo = json.loads(DEMO_PLUGIN.read_text())["redis"]
    prefix = redis.get("key_prefix", "cg")
    if not (prefix == "cg" or str(prefix).startswith("cg:")):
        raise PluginError(f"{path}: redis.key_prefix {prefix!r} is outside the demo gateway "
                          "user's keys (~cg:*): use \"cg:<something>\"")
    for field in ("cluster", "authorization"):
        if redis.get(field) != demo[field]:
            raise PluginError(f"{path}: redis.{field} must be {demo[field]!r} in the demo (the "
                              f"demo's Envoy and webdis use it), not {redis.get(field)!r}")
    return plugin


def render_demo(out: Path, ports: dict[str, int] = PORTS, wasm_path: Path = DEFAULT_WASM,
                plugin_path: Path = DEMO_PLUGIN, cluster: bool = False) -> Path:
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
    # make run's readiness probe (harness.readiness): its own listener, a port the kernel picks.
    text = text.replace("\n  listeners:\n", "\n  listeners:\n" + readiness.listener_yaml(), 1)
    plugin = load_plugin(plugin_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(substitute(text, {"WASM_PATH": str(wasm_path)}, json.dumps(plugin)))
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
        flags = " ".join(f"{name.upper()}_PORT={port + 1}" for name, (port, _) in busy.items())
        hint = ("Stop it yourself (e.g. `service redis-server stop`, `service webdis stop` for "
                f"Debian's services) or choose other ports: `make run {flags}` (ENVOY_PORT, "
                "ADMIN_PORT, UPSTREAM_PORT, WEBDIS_PORT, REDIS_PORT); the demo does not stop "
                "processes it did not start.")
        raise SystemExit("demo: ports busy:\n" + "\n".join(lines) + "\n" + hint)


def _example_path(policy: dict, segment: str) -> tuple[str, str]:
    """A method and path the policy's match fits, with `segment` where a lease resource reads a
    path segment."""
    match = policy.get("match", {})
    method = (match.get("methods") or ["GET"])[0]
    path = match.get("path_exact") or match.get("path_prefix") or "/demo"
    if path.endswith("/"):
        path += segment
    segments = [p for p in path.split("/") if p]
    for sel in (policy.get("lease") or {}).get("resource", []):
        if sel.startswith("path_segment:"):
            n = int(sel.split(":")[1])
            while len(segments) < n:
                segments.append(segment if len(segments) == n - 1 else "x")
    path = "/" + "/".join(segments)
    queries = [sel.split(":", 1)[1] for sel in (policy.get("lease") or {}).get("resource", [])
               if sel.startswith("query:")]
    if queries:
        path += "?" + "&".join(f"{q}={segment}" for q in queries)
    return method, path


# Each example calls as a tenant and principal of its own, so that none eats into a limit that
# another example (pasted at once, or a minute later) counts on.
CALLERS = {"rate": ("acme", "alice"), "idem": ("globex", "bob"), "lease": ("initech", "carol"),
           "down": ("umbrella", "dave")}
# A burst longer than this is no demo: a smallest limit above it gets no rate-limit example.
MAX_BURST = 200


def capacity(limit: dict) -> int:
    """How many requests a fresh limit admits at once (a token bucket: its burst)."""
    if limit.get("algorithm") == "token_bucket":
        return max(limit["limit"], limit.get("burst", limit["limit"]))
    return limit["limit"]


def examples(plugin: dict, envoy: str, upstream: str, make_logs: str) -> list[str]:
    """One example per kind of policy in `plugin`: a caption ending in `:`, then the commands
    to paste, each on a line of its own indented by two spaces (tests run them as printed)."""
    identity = plugin.get("identity", {})
    tenant_h = identity.get("tenant_header", "x-tenant-id")
    user_h = identity.get("principal_header", "x-user-id")

    def who(kind: str) -> str:
        tenant, user = CALLERS[kind]
        return f"-H '{tenant_h}: {tenant}' -H '{user_h}: {user}'"

    policies = plugin.get("policies", [])
    out = []
    limited = [(p, min(capacity(l) for l in p["rate_limits"]
                       if not l.get("shadow") and l.get("algorithm") != "concurrency"))
               for p in policies
               if any(not l.get("shadow") and l.get("algorithm") != "concurrency"
                      for l in p.get("rate_limits", []))
               and not p.get("lease")]
    if limited:
        policy, smallest = min(limited, key=lambda pl: pl[1])
        method, path = _example_path(policy, "1")
        if smallest + 2 <= MAX_BURST:
            call = f"-X {method} {who('rate')} {envoy}{path}"
            out.append(f"Rate limit ({policy['name']}, {smallest} at once): {smallest + 1} requests, "
                       f"the last ones get 429; one more, shown whole, has Retry-After and the "
                       f"RateLimit headers (one line, so that it runs at once):\n"
                       f"  for i in $(seq 1 {smallest + 1}); do curl -s -o /dev/null -w '%{{http_code}} ' "
                       f"{call}; done; echo; curl -s -i -w '\\n' {call}")
    idem = next((p for p in policies if p.get("idempotency")), None)
    if idem:
        cfg = idem["idempotency"]
        method, path = _example_path(idem, "1")
        method = (cfg.get("methods") or ["POST"])[0]
        key = cfg.get("header", "idempotency-key")
        base = (f"curl -s -i -w '\\n' -X {method} {who('idem')} -H 'content-type: application/json' "
                f"-H '{key}: \"order-0001\"' {envoy}{path}")
        out.append(f"Idempotency ({idem['name']}): the second is replayed (Idempotent-Replayed: "
                   f"true); another body with the key gets "
                   f"{cfg.get('conflict_status', 422)}; the service ran it once:\n"
                   f"  {base} -d '{{\"item\": \"book\", \"qty\": 1}}'\n"
                   f"  {base} -d '{{\"qty\": 1, \"item\": \"book\"}}'\n"
                   f"  {base} -d '{{\"item\": \"pen\", \"qty\": 2}}'\n"
                   f"  curl -s {upstream}/__upstream/stats | grep -o 'order-0001' | wc -l")
    lease = next((p for p in policies if p.get("lease")), None)
    if lease:
        method, path = _example_path(lease, "1001")
        header = lease["lease"].get("fencing_header", "x-fencing-token")
        out.append(f"Lease ({lease['name']}): a slow request holds the resource, a second one on "
                   f"it gets 409 resource_locked; once the first is done, the fencing token the "
                   f"service got in {header}:\n"
                   f"  curl -s -o /dev/null -X {method} {who('lease')} -H 'x-upstream-delay-ms: 3000' {envoy}{path} & "
                   f"sleep 0.5; curl -s -i -w '\\n' -X {method} {who('lease')} {envoy}{path}\n"
                   f"  wait; curl -s {upstream}/__upstream/stats | grep -o '\"{header}\": \"[0-9]*\"'")
    guarded = next((p for p in policies if p.get("rate_limits") or p.get("lease")), None)
    if guarded:
        method, path = _example_path(guarded, "1002")
        mode = guarded.get("failure_mode", plugin.get("failure_mode", "fail_closed"))
        seen = "503 guard_unavailable" if mode == "fail_closed" else "the request forwarded"
        call = f"curl -s -i -w '\\n' -X {method} {who('down')} {envoy}{path}"
        out.append(f"Redis gone ({guarded['name']} is {mode}: {seen}), then back (200); Redis "
                   f"keeps its data across the two (records, leases' fences, counters):\n"
                   f"  make demo-redis-down{make_logs}\n"
                   f"  {call}\n"
                   f"  make demo-redis-up{make_logs}\n"
                   f"  {call}")
    return out


def instructions(ports: dict[str, int], config: Path, logs: Path, redis_admin: str = "<password>",
                 plugin: dict | None = None, cluster: bool = False, make_logs: str = "") -> str:
    """What `make run` prints once the stack works: where everything is, then captions (ending
    in `:`) each followed by the commands to paste, indented by two spaces."""
    envoy = f"http://127.0.0.1:{ports['envoy']}"
    admin = f"http://127.0.0.1:{ports['admin']}"
    upstream = f"http://127.0.0.1:{ports['upstream']}"
    plugin = plugin if plugin is not None else json.loads(DEMO_PLUGIN.read_text())
    tour = "\n".join(examples(plugin, envoy, upstream, make_logs))
    prefix = plugin["redis"].get("key_prefix", "cg")
    redis_cli = (f"redis-cli -p {ports['redis']} --user admin --pass {redis_admin} --no-auth-warning "
                 f"--scan --pattern '{prefix}:*'")
    backend = f"  webdis    http://127.0.0.1:{ports['webdis']} -> Redis 127.0.0.1:{ports['redis']}"
    if cluster:
        nodes = node_ports(ports)
        redis_cli = (f"redis-cli --user admin --pass {redis_admin} --no-auth-warning --cluster call "
                     f"127.0.0.1:{nodes[0]} KEYS '{prefix}:*'\n"
                     f"  redis-cli -p {nodes[0]} --user admin --pass {redis_admin} --no-auth-warning "
                     "cluster nodes")
        backend = (f"  webdis    http://127.0.0.1:{ports['webdis']} and :{ports['webdis2']}"
                   f" -> redis_proxy 127.0.0.1:{ports['redis']} (admin :{ports['proxy_admin']})"
                   f" -> Redis Cluster 127.0.0.1:{nodes[0]}-{nodes[-1]} (3 masters, 3 replicas)")
    return f"""
coordination-guard demo is up
  Envoy     {envoy}  (admin {admin})
  upstream  {upstream}
{backend}
  config    {config}
  logs      {logs}/
  decisions {logs}/envoy/access.log  (one line per request: tail -f it)

{tour}
The keys in Redis, as the harness's admin user (webdis's own user may run only the scripts' commands on {prefix}:* keys):
  {redis_cli}
The filter's metrics:
  curl -s '{admin}/stats?filter=wasmcustom'
  curl -s {admin}/stats/prometheus | grep '^cg_'
What the service actually executed:
  curl -s {upstream}/__upstream/stats

Ctrl-C stops everything.
""".strip("\n")


def config_error(envoy_log: str) -> str | None:
    """The filter's own line about an invalid configuration, from Envoy's start-up log."""
    for line in envoy_log.splitlines():
        if "invalid plugin configuration" in line:
            return line.split("invalid plugin configuration: ", 1)[-1].strip()
    return None


def log_of(part: str, started: dict[str, object], envoy_log: str) -> str:
    """The end of one part's log (envoy, webdis, redis), for a start-up that did not work."""
    if part == "envoy":
        text = envoy_log
    elif isinstance(started.get("cluster"), ClusterBackend):
        backend = started["cluster"]
        procs = {"webdis": [w.proc for w in backend.webdis],
                 "redis": [backend.proxy.proc] + [n.proc for n in backend.nodes]}[part]
        text = "\n".join(p.log_tail(10) for p in procs if p is not None)
    else:
        service = started.get(part)
        text = service.start_log() if service is not None else ""
        if part == "webdis" and service is not None:
            text += service.log_text()
    return "\n".join(text.splitlines()[-20:]) or "(empty)"


def write_admin_url(path: Path, password: str, port: int) -> None:
    """Where `make admin` finds Redis as the admin user (a Redis Cluster node: cg-admin follows
    MOVED), readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"redis://{ADMIN_USER}:{password}@127.0.0.1:{port}\n")


def set_redis_state(path: Path, state: str) -> None:
    """What `make demo-redis-down` / `-up` wait for: `down` once Redis is gone, `up` once the
    gateway answers again."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state + "\n")
    tmp.replace(path)


def run(ports: dict[str, int], wasm_path: Path, out: Path, logs: Path,
        plugin_path: Path = DEMO_PLUGIN, timeout: float = 20.0, cluster: bool = False,
        make_logs: str = "") -> int:
    if not wasm_path.exists():
        raise PrerequisiteMissing(f"{wasm_path} is missing; run `make build`")
    try:
        plugin = load_plugin(plugin_path)
    except PluginError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 1
    check_ports(ports)
    config = render_demo(out, ports, wasm_path, plugin_path, cluster)
    if logs.exists():
        shutil.rmtree(logs)  # every run's logs start fresh
    logs.mkdir(parents=True)
    pid_file = logs / "demo.pid"
    state_file = logs / "redis.state"
    admin_url = logs / "redis-admin.url"
    started: dict[str, object] = {}  # label -> RedisServer | Webdis | Upstream | Proc
    redis_wanted = {"up": True}  # SIGUSR1 takes Redis away, SIGUSR2 brings it back

    def stop(*_):
        raise KeyboardInterrupt

    # Ctrl-C too, even where the shell that started it in the background ignores SIGINT.
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, lambda *_: redis_wanted.update(up=False))
    signal.signal(signal.SIGUSR2, lambda *_: redis_wanted.update(up=True))
    try:
        # The same restricted gateway user as the tests: keys `cg:*` (the demo's key_prefix
        # is cg:demo), only the scripts' commands.
        if cluster:
            backend = ClusterBackend(logs / "cluster", node_ports=node_ports(ports),
                                     proxy_port=ports["redis"], proxy_admin_port=ports["proxy_admin"],
                                     webdis_ports=[ports["webdis"], ports["webdis2"]],
                                     keep_data=True)
            backend.proxy.config_path = out.parent / "redis-cluster-proxy.yaml"
            started["cluster"] = redis = backend.start(timeout=60)
            redis_up = backend.proxy.alive
            redis_down, redis_back = backend.stop_redis, lambda: backend.start_redis(timeout)
        else:
            # Persistent: taking Redis away (make demo-redis-down) loses none of its data.
            started["redis"] = redis = RedisServer(logs / "redis", ports["redis"],
                                                   persistent=True).start(timeout)
            started["webdis"] = webdis = Webdis(logs / "webdis", ports["redis"], port=ports["webdis"],
                                                redis_password=redis.gateway_password).start(timeout)
            redis_up = redis.alive
            redis_down = redis.stop

            def redis_back():
                redis.start(timeout)
                webdis.wait_redis(timeout)
        started["upstream"] = Upstream(logs / "upstream", ports["upstream"]).start(timeout)
        started["envoy"] = envoy = spawn_envoy(logs / "envoy", config)
        try:
            wait_http(f"http://127.0.0.1:{ports['admin']}/ready", timeout, envoy, expect=200)
        except (RuntimeError, TimeoutError):
            problem = config_error(envoy.log_text())
            if problem is None:
                raise
            print(f"demo: {plugin_path}: {problem}", file=sys.stderr)
            return 1
        wait_for_port(ports["envoy"], timeout, envoy.popen)
        outside = beyond_loopback(envoy.pid)
        if outside:
            raise RuntimeError(f"envoy listens on {', '.join(outside)}, beyond loopback")
        # Up means working: a script call through Envoy's gateway cluster, webdis (each of
        # them, in turn) and Redis as the gateway user.
        try:
            readiness.check(readiness.port(f"http://127.0.0.1:{ports['admin']}"),
                            plugin["redis"]["authorization"], plugin["redis"].get("key_prefix", "cg"),
                            timeout, calls=4 if cluster else 1)
        except readiness.NotReady as e:
            print(f"demo: not working: {e}\n--- the end of {e.part}'s log ---\n"
                  f"{log_of(e.part, started, envoy.log_text())}\nlogs in {logs}/", file=sys.stderr)
            return 1
        pid_file.write_text(f"{os.getpid()}\n")
        write_admin_url(admin_url, redis.admin_password,
                        node_ports(ports)[0] if cluster else ports["redis"])
        set_redis_state(state_file, "up")
        print(instructions(ports, config, logs, redis.admin_password, plugin, cluster, make_logs),
              flush=True)
        print("pids: " + " ".join(f"{label}={pid}" for label, pid in _pids(started)), flush=True)
        while True:
            if redis_wanted["up"] != redis_up():
                if redis_wanted["up"]:
                    redis_back()
                    set_redis_state(state_file, "up")
                    print("demo: Redis is back", flush=True)
                else:
                    redis_down()
                    set_redis_state(state_file, "down")
                    print("demo: Redis stopped (make demo-redis-up brings it back)", flush=True)
            dead = [label for label, p in started.items()
                    if not p.alive() and not (label in ("redis", "cluster") and not redis_wanted["up"])]
            if dead:
                print(f"demo: {', '.join(dead)} exited unexpectedly; logs in {logs}/",
                      file=sys.stderr)
                return 1
            time.sleep(0.1)
    except KeyboardInterrupt:
        print("\nstopping demo", flush=True)
        return 0
    except Exception as e:
        print(f"demo: start-up failed: {e}\nlogs in {logs}/", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not abort the clean-up
        for part in reversed(list(started.values())):
            part.stop()
        pid_file.unlink(missing_ok=True)
        state_file.unlink(missing_ok=True)
        admin_url.unlink(missing_ok=True)
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
    parser.add_argument("--render-only", action="store_true", help="write the config and exit")
    parser.add_argument("--plugin", type=Path, default=DEMO_PLUGIN,
                        help=f"the plugin configuration (default {DEMO_PLUGIN.relative_to(ROOT)})")
    parser.add_argument("--cluster", action="store_true",
                        help="Redis Cluster (6 nodes) behind redis_proxy behind two webdis")
    for name in CLUSTER_PORTS:
        parser.add_argument(f"--{name.replace('_', '-')}-port", type=int, help="with --cluster")
    args = parser.parse_args(argv)
    # Every path handed on is absolute: the processes run in directories of their own.
    logs, out, wasm, plugin = (p.resolve() for p in (args.logs, args.out, args.wasm, args.plugin))
    # The printed `make demo-redis-down` needs LOGS= only where the logs are not the default.
    make_logs = "" if logs == (BUILD / "demo").resolve() else f" LOGS={args.logs}"
    ports = {name: getattr(args, f"{name}_port") for name in PORTS}
    if args.cluster:
        ports = cluster_ports(ports, args.webdis2_port, args.proxy_admin_port,
                              args.node_base_port or 7001)
    if args.render_only:
        try:
            print(render_demo(out, ports, wasm, plugin, args.cluster))
        except PluginError as e:
            print(f"demo: {e}", file=sys.stderr)
            return 1
        if args.cluster:
            print(render_cluster_proxy(out.parent / "redis-cluster-proxy.yaml", ports))
        return 0
    try:
        return run(ports, wasm, out, logs, plugin, cluster=args.cluster, make_logs=make_logs)
    except PrerequisiteMissing as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
