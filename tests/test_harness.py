"""The test frame itself: processes start, talk and stop the way the e2e suite relies on."""

import contextlib
import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.concurrency import in_thread, wait_for
from harness.demo import PORTS, render_demo
from harness.envoy import envoy_binary, validate_config
from harness.proc import ROOT, PrerequisiteMissing, free_port
from harness.stack import BLACKHOLE_CLUSTER, DEAD_CLUSTER, GATEWAY_CLUSTER
from harness.upstream import max_overlap

DEMO_PLUGIN = json.loads((ROOT / "envoy" / "demo-plugin.json").read_text())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A stopped child we have not reaped yet would still be a zombie: treat that as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def stack_pids(stack) -> list[int]:
    parts = [stack.redis_server, stack.webdis, stack.upstream, *stack.envoys]
    return [p.proc.pid for p in parts]


def test_plain_envoy_proxies_to_the_counting_upstream(stack_factory):
    stack = stack_factory()
    first = stack.envoy.request("POST", "/orders", headers={"x-tenant-id": "acme", "idempotency-key": "k1"},
                                body=b"hello")
    second = stack.envoy.request("POST", "/orders", headers={
        "x-upstream-status": "201", "x-upstream-header-x-order-id": "42"})
    stack.envoy.request("GET", "/health")

    assert (first.status, first.json()["served"]) == (200, 1)
    assert (second.status, second.json()["served"], second.headers["x-order-id"]) == (201, 2, "42")
    stats = stack.upstream.stats()
    assert stats["total"] == 3
    assert stats["by_path"] == {"POST /orders": 2, "GET /health": 1}
    recorded = stats["requests"][0]
    assert recorded["headers"] == {"x-tenant-id": "acme", "idempotency-key": "k1"}
    assert recorded["body_sha256"] == hashlib.sha256(b"hello").hexdigest()
    assert stack.envoy.stat("cluster.upstream.upstream_rq_completed") == 3

    stack.upstream.reset()
    assert stack.upstream.stats() == {"total": 0, "by_path": {}, "requests": [], "in_flight": []}

    # When the service was busy with each request, what it is busy with now, and a JSON answer
    # of the caller's choosing.
    slow = [in_thread(stack.envoy.request, "GET", "/slow", headers={"x-upstream-delay-ms": "400"})
            for _ in range(2)]
    assert wait_for(lambda: len(stack.upstream.in_flight()) == 2, 2.0)
    assert [r().status for r in slow] == [200, 200]
    ran = stack.upstream.requests()
    assert max_overlap(ran) == 2 and all(r["time"] - r["started"] >= 0.4 for r in ran), ran
    assert max_overlap(ran[:1]) == 1 and stack.upstream.in_flight() == []
    usage = stack.envoy.request("GET", "/usage", headers={"x-upstream-json": '{"usage": {"n": 3}}'})
    assert usage.json() == {"usage": {"n": 3}}, usage
    assert usage.headers["content-type"] == "application/json"


def test_upstream_delays_and_reads_chunked_bodies(stack_factory):
    stack = stack_factory()
    slow = stack.envoy.request("GET", "/slow", headers={"x-upstream-delay-ms": "300"})
    assert slow.status == 200 and slow.elapsed >= 0.3

    conn = http.client.HTTPConnection("127.0.0.1", stack.envoy.port, timeout=5)
    conn.request("POST", "/chunked", body=iter([b"ab", b"cd"]), encode_chunked=True,
                 headers={"Transfer-Encoding": "chunked"})
    assert conn.getresponse().status == 200
    conn.close()
    assert stack.upstream.requests()[-1]["body_sha256"] == hashlib.sha256(b"abcd").hexdigest()


def test_webdis_allows_only_eval_for_the_filter_user(stack_factory):
    webdis = stack_factory().webdis

    assert webdis.eval("return 1") == (200, b":1\r\n")
    assert webdis.eval("return 1", auth=False) == (403, b"")
    assert webdis.command("GET", "x") == (403, b"")
    assert webdis.command("EVALSHA", "0" * 40, 0)[1].startswith(b"-NOSCRIPT")
    # Arguments are percent-decoded, so any byte survives the trip.
    assert webdis.eval("return ARGV[1]", [], ["a/b%c d"]) == (200, b"$7\r\na/b%c d\r\n")
    assert webdis.authorization == "Basic Y2c6c2VjcmV0"


def test_webdis_reencodes_raw_array_replies(stack_factory):
    """Pins webdis 0.1.9's quirks that the filter's RESP parser and the Lua scripts live with."""
    webdis = stack_factory().webdis

    assert webdis.eval("return {1, 'a', -5}")[1] == b"*3\r\n$1\r\n1\r\n$1\r\na\r\n$2\r\n-5\r\n"
    # nil and nested arrays are dropped, the count is not: scripts must return flat, nil-free arrays.
    assert webdis.eval("return {1, false, 3}")[1] == b"*3\r\n$1\r\n1\r\n$1\r\n3\r\n"
    assert webdis.eval("return {1, {2}, 3}")[1] == b"*3\r\n$1\r\n1\r\n$1\r\n3\r\n"
    assert webdis.eval("return redis.error_reply('boom')") == (200, b"-ERR boom\r\n")


def test_webdis_answers_503_while_redis_is_down(stack_factory):
    stack = stack_factory()
    stack.redis.set("before", "1")
    stack.stop_redis()

    started = time.monotonic()
    assert stack.webdis.eval("return 1") == (503, b"")
    assert time.monotonic() - started < 0.5

    stack.start_redis()  # waits until webdis has reconnected
    assert stack.webdis.eval("return 1") == (200, b":1\r\n")
    assert stack.redis.get("before") is None  # no persistence: a restarted Redis is empty


def test_webdis_restarts_on_the_same_port(stack_factory):
    webdis = stack_factory().webdis
    port, pid = webdis.port, webdis.proc.pid
    webdis.restart()
    assert (webdis.port, webdis.eval("return 2")) == (port, (200, b":2\r\n"))
    assert webdis.proc.pid != pid and not pid_alive(pid)


def test_gateway_clusters_through_envoy(stack_factory):
    stack = stack_factory()
    envoy = stack.add_envoy(None, cluster_header="x-harness-cluster")
    body = b"EVAL/return%201/0.raw"
    headers = {"Authorization": stack.webdis.authorization}

    def via(cluster):
        return envoy.request("POST", "/", headers={**headers, "x-harness-cluster": cluster}, body=body)

    ok = via(GATEWAY_CLUSTER)
    assert (ok.status, ok.body) == (200, b":1\r\n")

    dead = via(DEAD_CLUSTER)
    assert dead.status == 503 and dead.elapsed < 0.5, dead

    hang = via(BLACKHOLE_CLUSTER)  # the harness route times out after 2 s
    assert hang.status == 504 and hang.elapsed >= 1.9, hang
    assert stack.blackhole.accepted >= 1 and stack.blackhole.bytes_received > 0


def test_stack_stops_every_process_it_started(stack_factory):
    stack = stack_factory(envoys=2)
    pids = stack_pids(stack)
    assert len(pids) == 5 and all(pid_alive(p) for p in pids)
    assert stack.envoys[0].port != stack.envoys[1].port

    stack.stop()
    assert [p for p in pids if pid_alive(p)] == []


def test_failed_start_stops_what_was_already_running(tmp_path):
    from harness.stack import Stack

    stack = Stack(tmp_path, {"policies": []}, wasm_path=tmp_path / "missing.wasm")
    with pytest.raises(PrerequisiteMissing, match="make build"):
        stack.start()
    pids = [stack.redis_server.proc.pid, stack.webdis.proc.pid, stack.upstream.proc.pid]
    assert [p for p in pids if pid_alive(p)] == []


def test_envoy_bin_override_must_be_executable(monkeypatch, tmp_path):
    not_executable = tmp_path / "envoy"
    not_executable.write_text("")
    monkeypatch.setenv("ENVOY_BIN", str(not_executable))
    with pytest.raises(PrerequisiteMissing, match="ENVOY_BIN"):
        envoy_binary()
    monkeypatch.delenv("ENVOY_BIN")
    assert os.access(envoy_binary(), os.X_OK)


def test_benchmark_variants_start(stack_factory):
    stack = stack_factory(None, direct_response=True)
    limited = stack.add_envoy(None, local_ratelimit={"max_tokens": 2, "fill_interval": "60s"},
                              direct_response=False)

    assert stack.envoy.request("GET", "/").body == b"ok\n"
    assert stack.upstream.stats()["total"] == 0
    statuses = [limited.request("GET", "/").status for _ in range(3)]
    assert statuses == [200, 200, 429]


def test_the_incumbents_envoy_config_validates(tmp_path):
    """make bench's incumbent: Envoy's ratelimit filter in the Wasm filter's place, one gRPC
    call per request to the rate limit service's cluster (HTTP/2), the tenant descriptor from
    the benchmark's tenant header, failing closed; a config Envoy itself accepts."""
    import yaml

    from harness.envoy import Envoy

    envoy = Envoy(tmp_path, None, free_port(), free_port(),
                  rate_limit_service={"port": 18081, "header": "x-tenant-id"})
    hcm = envoy.config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    assert [f["name"] for f in filters] == ["envoy.filters.http.ratelimit",
                                            "envoy.filters.http.router"]
    rl = filters[0]["typed_config"]
    assert rl["failure_mode_deny"] is True
    assert rl["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"] == \
        "rate_limit_service"
    assert rl["rate_limits"] == [{"actions": [{"request_headers": {
        "header_name": "x-tenant-id", "descriptor_key": "tenant"}}]}]
    cluster = next(c for c in envoy.config["static_resources"]["clusters"]
                   if c["name"] == "rate_limit_service")
    options = cluster["typed_extension_protocol_options"]
    assert "http2_protocol_options" in next(iter(options.values()))["explicit_http_config"]
    path = tmp_path / "incumbent.yaml"
    path.write_text(yaml.safe_dump(envoy.config))
    assert validate_config(path) == (0, f"configuration '{path}' OK\n")


# --- with the real filter (target/wasm32-wasip1/release/coordination_guard.wasm, `make build`) ---


def demo_plugin_for(stack) -> dict:
    return {**DEMO_PLUGIN, "redis": {**DEMO_PLUGIN["redis"], **stack.redis_section(key_prefix="cg:demo")}}


def test_filter_metrics_carry_policy_and_limit_labels(stack_factory):
    stack = stack_factory(None)
    envoy = stack.add_envoy(demo_plugin_for(stack))
    assert envoy.request("POST", "/orders", headers={"x-tenant-id": "acme", "x-user-id": "alice"}).status == 200

    name = "wasmcustom.cg.policy.create-order.limit.tenant.allowed"
    assert envoy.stat(name) == 1
    samples = envoy.prometheus_samples()
    assert samples['cg_policy_limit_allowed{cg_policy="create-order",cg_limit="tenant"}'] == 1
    assert samples['cg_policy_limit_allowed{cg_policy="default",cg_limit="global"}'] == 0


def test_envoy_refuses_a_plugin_config_the_filter_rejects(stack_factory):
    stack = stack_factory(None)
    code, log = stack.envoy_expect_failure({**demo_plugin_for(stack), "no_such_field": 1})
    assert code == 1, log
    assert "Unable to create Wasm plugin coordination-guard" in log


def test_demo_config_validates(tmp_path):
    config = render_demo(tmp_path / "demo.yaml")
    assert validate_config(config) == (0, f"configuration '{config}' OK\n")


def test_demo_cluster_config_renders_and_validates(tmp_path):
    """`make run CLUSTER=1`: the filter's Envoy has both webdis as gateway endpoints, and the
    redis proxy's config (envoy/redis-cluster-proxy.yaml) has the demo's ports and no secret."""
    import yaml

    from harness.cluster import RedisProxy
    from harness.demo import cluster_ports, node_ports, render_cluster_proxy

    ports = cluster_ports(PORTS)
    assert (ports["webdis2"], ports["proxy_admin"], node_ports(ports)[0]) == (7380, 9902, 7001)
    config = render_demo(tmp_path / "demo.yaml", ports, cluster=True)
    assert validate_config(config) == (0, f"configuration '{config}' OK\n")
    clusters = yaml.safe_load(config.read_text())["static_resources"]["clusters"]
    gateway = next(c for c in clusters if c["name"] == "redis_gateway")
    endpoints = [e["endpoint"]["address"]["socket_address"]["port_value"]
                 for e in gateway["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert endpoints == [ports["webdis"], ports["webdis2"]]

    proxy_config = render_cluster_proxy(tmp_path / "redis-cluster-proxy.yaml", ports)
    proxy = yaml.safe_load(proxy_config.read_text())["static_resources"]
    listener = proxy["listeners"][0]["address"]["socket_address"]
    assert (listener["address"], listener["port_value"]) == ("127.0.0.1", ports["redis"])
    seeds = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in proxy["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert set(seeds) <= set(node_ports(ports)) and len(seeds) == 3
    checked = RedisProxy(tmp_path, seeds, "default", "secret-x", port=ports["redis"],
                         admin_port=ports["proxy_admin"])
    checked.config_path = proxy_config
    code, log = checked.validate()
    # Envoy warns that MOVED/ASK targets are not resolved by DNS: the nodes announce IPs.
    assert code == 0 and log.startswith(f"configuration '{proxy_config}' OK\n"), log
    assert "secret-x" not in proxy_config.read_text()


def test_demo_runs_and_stops_on_sigint(tmp_path):
    ports = {name: free_port() for name in PORTS}
    argv = [sys.executable, "-m", "harness.demo", "--out", str(tmp_path / "demo.yaml"),
            "--logs", str(tmp_path / "logs")]
    for name, port in ports.items():
        argv += [f"--{name}-port", str(port)]
    demo = subprocess.Popen(argv, cwd=ROOT / "tests", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 30
        while not lines or not lines[-1].startswith("pids: "):
            line = demo.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        children = [int(kv.split("=")[1]) for kv in lines[-1].split()[1:]]
        conn = http.client.HTTPConnection("127.0.0.1", ports["envoy"], timeout=5)
        conn.request("POST", "/orders", headers={"x-tenant-id": "acme", "x-user-id": "alice"})
        assert conn.getresponse().status == 200
        conn.close()
        # The demo's Redis has the tests' ACL: webdis's `default` user is restricted to cg:*
        # and the scripts' commands; the printed admin line works.
        import redis

        cli = next(line for line in lines if "redis-cli" in line).split()
        admin = redis.Redis(port=ports["redis"], username="admin", password=cli[cli.index("--pass") + 1],
                            socket_timeout=5)
        try:
            assert any(k.startswith(b"cg:demo:") for k in admin.keys("*"))
            rules = admin.acl_getuser("default")
            assert (rules["keys"], rules["categories"], rules["channels"]) == (["~cg:*"], ["-@all"], [])
            assert "+eval" in rules["commands"] and "+keys" not in rules["commands"]
        finally:
            admin.close()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=ports["redis"], socket_timeout=5).get("cg:demo:x")

        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=20) == 0
        assert [p for p in children if pid_alive(p)] == []
    finally:
        if demo.poll() is None:
            demo.terminate()  # the demo stops its children on SIGTERM too
            try:
                demo.wait(timeout=20)
            except subprocess.TimeoutExpired:
                demo.kill()
                demo.wait()


def test_demo_reports_busy_ports(tmp_path):
    stack_ports = {name: free_port() for name in PORTS}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", stack_ports["redis"]))
        busy.listen(1)
        argv = [sys.executable, "-m", "harness.demo", "--out", str(tmp_path / "demo.yaml"),
                "--logs", str(tmp_path / "logs")]
        for name, port in stack_ports.items():
            argv += [f"--{name}-port", str(port)]
        result = subprocess.run(argv, cwd=ROOT / "tests", capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert f"redis: 127.0.0.1:{stack_ports['redis']} is in use by " in result.stderr
    assert f"(pid {os.getpid()})" in result.stderr


def test_upstream_restarts_in_the_same_workdir(tmp_path):
    """The upstream's log is appended to: a second start must read its own port, not the first's."""
    from harness.upstream import Upstream

    first = Upstream(tmp_path).start()
    first.stop()
    second = Upstream(tmp_path).start()
    try:
        # A stale port would point at the stopped first process: connection refused.
        assert second.stats()["total"] == 0
    finally:
        second.stop()


@contextlib.contextmanager
def squatting(port: int):
    """Another process's listener on `port` (here a socket of the test's own)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    try:
        yield port
    finally:
        sock.close()


def refused_on_its_taken_port(service) -> None:
    """`service` (never started, or stopped) does not start while its port is taken."""
    from harness.proc import PortTaken

    try:
        with squatting(service.port), pytest.raises(PortTaken):
            service.start(timeout=5)
    finally:
        service.stop()


def test_a_port_taken_before_a_services_first_start_is_chosen_again_never_on_a_restart(tmp_path):
    """Redis and webdis pick free ports, which a connection may take before they start: then
    they start on another port (a listener that is not theirs is not taken for them). Once
    started, their port is known to others: a restart on a taken port fails at once."""
    from harness.proc import RedisServer, listens
    from harness.webdis import Webdis

    with contextlib.ExitStack() as running:
        redis_server = RedisServer(tmp_path / "redis")
        with squatting(redis_server.port) as taken:
            redis_server.start(timeout=10)
            running.callback(redis_server.stop)
            assert redis_server.port != taken and listens(redis_server.proc.pid, redis_server.port)
            assert not listens(redis_server.proc.pid, taken)
        assert redis_server.client().ping()
        webdis = Webdis(tmp_path / "webdis", redis_server.port,
                        redis_password=redis_server.gateway_password)
        with squatting(webdis.port) as taken:
            webdis.start(timeout=10)
            running.callback(webdis.stop)
            assert webdis.port != taken
        assert json.loads(webdis.config_path.read_text())["http_port"] == webdis.port
        assert webdis.command("EVAL", "return 1", 1, "cg:x") == (200, b":1\r\n")
        # A restart keeps the port; taken meanwhile, it fails loudly.
        webdis.stop()
        refused_on_its_taken_port(webdis)
    # A port given by the caller is never changed.
    refused_on_its_taken_port(RedisServer(tmp_path / "fixed", port=free_port()))


def test_free_ports_come_from_outside_the_ephemeral_range_and_never_twice():
    """The kernel gives connections their local ports from its ephemeral range: a port chosen
    there may be some connection's by the time a process binds it. free_port chooses below
    it (the machine's range leaves ten thousand ports and more there)."""
    from harness.proc import _ephemeral_range

    low, high = _ephemeral_range()
    assert low - 10000 > 10000, f"ephemeral range {low}-{high} leaves no room below it"
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= p < low or p > high for p in ports), sorted(ports)


@pytest.mark.parametrize("service", ["redis", "webdis"])
def test_a_port_bound_without_listening_before_a_services_first_start_is_chosen_again(
        tmp_path, service):
    """A connection's local port is bound but does not listen: nothing answers there, yet
    the service cannot bind it. Its log says so, and it starts on another port."""
    from harness.proc import RedisServer, listens
    from harness.webdis import Webdis

    def bound_only(port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", port))
        return sock

    with contextlib.ExitStack() as running:
        redis_server = RedisServer(tmp_path / "redis")
        if service == "redis":
            target = redis_server
        else:
            redis_server.start(timeout=10)
            running.callback(redis_server.stop)
            target = Webdis(tmp_path / "webdis", redis_server.port,
                            redis_password=redis_server.gateway_password)
        taken = target.port
        squatter = running.enter_context(bound_only(taken))
        target.start(timeout=10)
        running.callback(target.stop)
        assert target.port != taken and listens(target.proc.pid, target.port)
        squatter.close()
        if service == "redis":
            assert target.client().ping()
        else:
            assert target.command("EVAL", "return 1", 1, "cg:x") == (200, b":1\r\n")


def test_a_cluster_nodes_bus_port_taken_before_its_first_start_is_chosen_again(tmp_path):
    from harness.cluster import ClusterNode

    node = ClusterNode(tmp_path / "node", None, "gateway-password", "admin-password")
    taken = node.bus_port
    # Another process takes the bus port between its choice and the node's start.
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", taken))
    squatter.listen()
    try:
        node.start(timeout=10)
        try:
            assert node.bus_port != taken
            assert f"cluster-port {node.bus_port}" in (tmp_path / "node" / "redis.conf").read_text()
            with socket.create_connection(("127.0.0.1", node.bus_port), timeout=5):
                pass
            assert node.client().ping()
            # Once started, a restart keeps the bus port the other nodes know.
            node.stop()
            node.start(timeout=10)
            assert node.client().ping()
        finally:
            node.stop()
    finally:
        squatter.close()
