"""The chaos target and its faults (chaos/target.py, chaos/faults.py, chaos/netproxy.py), on
the real stack: each fault is shown to have its effect on the filter's answers while it lasts,
and the target to be healthy again, requests answered by the service, once it healed.

The service behind the Envoys is the harness's counting upstream.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import chaos  # noqa: F401  (tests/ on sys.path, as for the chaos run)
from chaos.faults import FAULTS, kinds_for
from chaos.netproxy import NetProxy
from chaos.target import ECDS_STAT, build_target
from harness.concurrency import wait_for
from harness import problems
from harness.upstream import Upstream

TENANT_HEADER = "x-tenant-id"


def plugin(failure_mode: str = "fail_closed", timeout: str = "100ms") -> dict:
    """A rate limit that is never reached, so every answer but the service's is the fault's."""
    return {"redis": {"timeout": timeout, "key_prefix": "cg:chaos"},
            "identity": {"tenant_header": TENANT_HEADER},
            "policies": [{"name": "limited", "match": {"path_prefix": "/"},
                          "failure_mode": failure_mode,
                          "rate_limits": [{"name": "tenant", "by": ["tenant"],
                                           "algorithm": "fixed_window", "limit": 1_000_000,
                                           "window": "10s"}]}]}


def get(url: str, tenant: str = "acme", timeout: float = 5.0) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url + "/things", headers={TENANT_HEADER: tenant})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def pids(target) -> list[int]:
    procs = [n.proc for n in target.redis_nodes()] + [w.proc for w in target.webdis]
    procs += [target.netproxy.proc] + [e.proc for e in target.envoys]
    if target.cluster is not None:
        procs.append(target.cluster.proxy.proc)
    return [p.pid for p in procs if p is not None]


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def upstream(tmp_path):
    service = Upstream(tmp_path / "upstream").start()
    yield service
    service.stop()


def test_single_target_serves_through_both_envoys_and_stops_everything(tmp_path, upstream):
    target = build_target("single", tmp_path / "target", plugin(), upstream.port)
    started = pids(target)
    try:
        assert target.topology == "single"
        assert len(target.envoy_urls) == 2 and len(set(target.envoy_urls)) == 2
        for url in target.envoy_urls:
            status, headers, _ = get(url)
            # Answered by the service, and decided by Redis (the quota headers).
            assert status == 200 and "ratelimit-policy" in headers, (status, headers)
        assert upstream.count("GET", "/things") == 2
        # Redis holds the rate limit's counter under the target's key prefix.
        client = target.redis_client()
        try:
            assert any(k.startswith(b"cg:chaos:") for k in client.scan_iter(match="cg:chaos:*"))
        finally:
            client.close()
        assert all("panic" not in log for log in target.envoy_logs())
        assert len(started) == 5 and all(running(p) for p in started), started
    finally:
        target.stop()
    assert not [p for p in started if running(p)]



# --- the network proxy on its own --------------------------------------------------------------


class Recorder:
    """A loopback TCP server (a thread) that echoes what it reads and records, per connection,
    the bytes it got and whether the stream ended with a FIN (`eof`)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[dict] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            entry = {"data": b"", "eof": False}
            self.conns.append(entry)
            threading.Thread(target=self._serve, args=(conn, entry), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket, entry: dict) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    entry["eof"] = True
                    return
                entry["data"] += data
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


def round_trip(port: int, data: bytes, timeout: float = 3.0) -> tuple[bytes, float]:
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        while len(got) < len(data):
            piece = s.recv(65536)
            if not piece:
                break
            got += piece
    return got, time.monotonic() - start


def test_netproxy_passes_delays_resets_and_holds(tmp_path):
    echo = Recorder()
    proxy = NetProxy(tmp_path / "netproxy", [echo.port]).start()
    pid = proxy.proc.pid
    try:
        port = proxy.ports[0]
        assert round_trip(port, b"plain")[0] == b"plain"
        # Each way: a round trip takes twice the delay; pieces keep their order.
        proxy.delay(150, jitter_ms=20)
        with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
            start = time.monotonic()
            for i in range(20):
                s.sendall(b"%02d" % i)
            got = b""
            while len(got) < 40:
                got += s.recv(65536)
            elapsed = time.monotonic() - start
        assert got == b"".join(b"%02d" % i for i in range(20))
        assert 0.3 <= elapsed < 2.0, elapsed
        # Reset: an open connection and every new one get RST.
        proxy.passing()
        held_open = socket.create_connection(("127.0.0.1", port), timeout=3)
        held_open.sendall(b"x")
        assert held_open.recv(1) == b"x"
        answer = proxy.cut("reset")
        assert answer["mode"] == "cut" and answer["how"] == "reset"
        with pytest.raises(ConnectionResetError):
            held_open.recv(1)
        held_open.close()
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            round_trip(port, b"refused")
        # Hold: a request and the end of its stream, sent during the cut, reach the upstream
        # only once it heals (the client is gone by then).
        proxy.cut("hold")
        late = socket.create_connection(("127.0.0.1", port), timeout=3)
        late.sendall(b"late request")
        late.shutdown(socket.SHUT_WR)
        time.sleep(0.3)
        assert proxy.stats()["held"] == len(b"late request")
        assert not any(c["data"] == b"late request" for c in echo.conns)
        late.close()
        proxy.passing()
        wait_for(lambda: any(c["data"] == b"late request" and c["eof"] for c in echo.conns), 5)
        assert proxy.stats()["held"] == 0
        assert round_trip(port, b"again")[0] == b"again"
        with pytest.raises(ValueError):
            proxy.command({"mode": "sideways"})
    finally:
        proxy.stop()
        echo.close()
    assert not running(pid)


# --- faults on a single Redis ------------------------------------------------------------------
# One target for these tests, healthy again at the start of each (every fault heals).

TIMEOUT = "200ms"


def guard_unavailable(status: int, headers: dict, body: bytes) -> bool:
    """The filter's fail-closed answer: 503, problem+json, `guard_unavailable`."""
    if status != 503 or not headers.get("content-type", "").startswith("application/problem+json"):
        return False
    try:
        return json.loads(body)["type"] == problems.problem_type("guard_unavailable")
    except (ValueError, KeyError):
        return False


def served(status: int, headers: dict, body: bytes) -> bool:
    """Answered by the service, with the quota headers: Redis decided."""
    return status == 200 and "ratelimit-policy" in headers


def all_served(target, tenant: str = "acme") -> None:
    """A guarded request served through each Envoy."""
    for i, url in enumerate(target.envoy_urls):
        answer = get(url, tenant)
        assert served(*answer), f"envoy {i}: {answer}"


@pytest.fixture(scope="module")
def single_service(tmp_path_factory):
    service = Upstream(tmp_path_factory.mktemp("chaos-upstream")).start()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def single_target(tmp_path_factory, single_service):
    target = build_target("single", tmp_path_factory.mktemp("chaos-single"),
                          plugin(timeout=TIMEOUT), single_service.port)
    yield target
    target.stop()


@pytest.fixture
def single(single_target):
    """The module's single target, healthy and serving."""
    single_target.healthy(30)
    all_served(single_target)
    return single_target


def fault(target, kind: str, seed: int = 1, **fixed):
    return FAULTS[kind](random.Random(seed), target, **fixed)


def timed_get(url: str, tenant: str = "acme") -> tuple[tuple, float]:
    start = time.monotonic()
    answer = get(url, tenant)
    return answer, time.monotonic() - start


def test_every_kind_is_known_and_draws_the_same_from_the_same_seed(single):
    assert set(FAULTS) == {
        "redis_pause_short", "redis_pause_long", "redis_restart_persistent",
        "redis_restart_volatile", "cluster_failover", "webdis_restart", "gateway_delay",
        "gateway_cut", "envoy_restart", "script_flush", "config_reload"}
    assert "cluster_failover" not in kinds_for("single")
    for kind in kinds_for("single"):
        drawn = [fault(single, kind, seed).params for seed in (5, 5, 6, 7, 8, 9)]
        assert drawn[0] == drawn[1], kind
        assert all(FAULTS[kind].kind == kind for _ in drawn)
    with pytest.raises(ValueError):
        fault(single, "cluster_failover")
    with pytest.raises(TypeError):
        fault(single, "gateway_cut", nonsense=1)
    assert fault(single, "redis_restart_volatile").data_loss
    assert not fault(single, "redis_restart_persistent").data_loss
    timeout_ms = single.redis_timeout * 1000
    for seed in range(20):
        assert fault(single, "redis_pause_short", seed).params["pause_ms"] < timeout_ms
        assert fault(single, "redis_pause_long", seed).params["pause_ms"] > 2 * timeout_ms
        delay = fault(single, "gateway_delay", seed).params
        assert (2 * delay["delay_ms"] > timeout_ms) == delay["beyond_timeout"], delay


def test_redis_pause_short_slows_calls_but_none_fails(single):
    f = fault(single, "redis_pause_short", mode="ALL", pause_ms=80)
    f.inject()
    answer, elapsed = timed_get(single.envoy_urls[0])
    f.heal()
    assert served(*answer), answer
    assert elapsed > 0.03, f"the request did not wait for the pause ({elapsed:.3f}s)"
    all_served(single)


@pytest.mark.parametrize("mode", ["ALL", "WRITE"])
def test_redis_pause_long_fails_closed_until_it_ends(single, mode):
    f = fault(single, "redis_pause_long", mode=mode, pause_ms=1500)
    params = f.inject()
    assert params["kind"] == "redis_pause_long" and params["pause_ms"] == 1500
    answers = [timed_get(url) for url in single.envoy_urls]
    healed_at = time.monotonic()
    f.heal()
    for answer, elapsed in answers:
        assert guard_unavailable(*answer), answer
        assert elapsed < 1.0, f"failed closed after {elapsed:.3f}s, not at the timeout"
    if mode == "ALL":  # it cannot be lifted early: heal waited for its end
        assert time.monotonic() - f.started >= 1.5
    else:
        assert time.monotonic() - healed_at < 1.0
    all_served(single)


def redis_key(target, key: str, value: str | None = None):
    client = target.redis_client()
    try:
        if value is not None:
            client.set(key, value)
        return client.get(key)
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["redis_restart_persistent", "redis_restart_volatile"])
def test_redis_restart_fails_closed_while_down_and_keeps_or_loses_the_data(single, kind):
    redis_key(single, "cg:chaos:marker", "kept")
    old = single.redis.proc.pid
    f = fault(single, kind)
    f.inject()
    assert not single.redis.alive()
    answer = get(single.envoy_urls[1])
    assert guard_unavailable(*answer), answer
    f.heal()
    assert single.redis.alive() and single.redis.proc.pid != old
    single.healthy(30)
    kept = redis_key(single, "cg:chaos:marker")
    assert kept == (b"kept" if kind == "redis_restart_persistent" else None), kept
    all_served(single)


def test_webdis_restart_fails_closed_while_down(single):
    old = single.webdis[0].proc.pid
    f = fault(single, "webdis_restart")
    f.inject()
    answer = get(single.envoy_urls[0])
    assert guard_unavailable(*answer), answer
    f.heal()
    f.heal()  # idempotent
    assert single.webdis[0].alive() and single.webdis[0].proc.pid != old
    single.healthy(30)
    all_served(single)


def test_gateway_delay_below_the_timeout_slows_calls_beyond_it_fails_closed(single):
    timeout = single.redis_timeout
    below = fault(single, "gateway_delay", beyond_timeout=False, delay_ms=timeout * 1000 / 5,
                  jitter_ms=0)
    below.inject()
    answer, elapsed = timed_get(single.envoy_urls[0])
    below.heal()
    assert served(*answer), answer
    assert elapsed >= 2 * timeout / 5, f"{elapsed:.3f}s: not delayed"
    beyond = fault(single, "gateway_delay", beyond_timeout=True, delay_ms=timeout * 1000,
                   jitter_ms=5)
    beyond.inject()
    answer = get(single.envoy_urls[1])
    beyond.heal()
    assert guard_unavailable(*answer), answer
    single.healthy(30)
    all_served(single)


@pytest.mark.parametrize("how", ["reset", "hold"])
def test_gateway_cut_fails_closed_and_a_hold_delivers_late(single, how):
    f = fault(single, "gateway_cut", how=how)
    before = single.netproxy.stats()
    f.inject()
    answers = [get(url) for url in single.envoy_urls]
    during = single.netproxy.stats()
    f.heal()
    for answer in answers:
        assert guard_unavailable(*answer), answer
    if how == "hold":
        # The calls the filter gave up on were kept, and sent on once the cut healed.
        assert during["held"] > 0, during
        wait_for(lambda: single.netproxy.stats()["held"] == 0, 5)
        assert single.netproxy.stats()["bytes_up"] >= during["bytes_up"] + during["held"] // 2
    else:
        assert during["reset"] > before["reset"], (before, during)
    assert single.netproxy.stats()["mode"] == "pass"
    single.healthy(30)
    all_served(single)


def test_envoy_restart_takes_one_envoy_away_and_back_on_its_port(single):
    f = fault(single, "envoy_restart", envoy=1)
    url, old = single.envoy_urls[1], single.envoys[1].proc.pid
    f.inject()
    with pytest.raises(OSError):
        get(url, timeout=2)
    assert served(*get(single.envoy_urls[0]))  # the other sidecar serves on
    f.heal()
    assert single.envoys[1].proc.pid != old and single.envoy_urls[1] == url
    all_served(single)
    # Its log holds both starts.
    assert single.envoy_logs()[1].count("starting main dispatch loop") >= 2


def cached_scripts(target) -> int:
    client = target.redis_client()
    try:
        return int(client.info("memory")["number_of_cached_scripts"])
    finally:
        client.close()


def test_script_flush_empties_the_script_cache_and_the_filter_loads_again(single):
    assert cached_scripts(single) > 0
    f = fault(single, "script_flush", mode="SYNC")
    f.inject()
    assert cached_scripts(single) == 0
    f.heal()
    all_served(single)
    assert cached_scripts(single) > 0


@pytest.mark.parametrize("variant", ["reformatted", "new_vm"])
def test_config_reload_is_loaded_without_dropping_the_listener(single, variant):
    listeners = [e.stats(filter="listener_manager") for e in single.envoys]
    reloads = [single.config_reloads(i) for i in range(2)]
    # A connection open across the reload keeps being served.
    conn = http.client.HTTPConnection("127.0.0.1", single.envoys[0].port, timeout=5)
    try:
        conn.request("GET", "/things", headers={TENANT_HEADER: "acme"})
        first = conn.getresponse()
        first.read()
        f = fault(single, "config_reload", variant=variant, envoys=[0, 1])
        params = f.inject()
        assert params["variant"] == variant
        assert [single.config_reloads(i) for i in range(2)] == [r + 1 for r in reloads]
        for i, envoy in enumerate(single.envoys):  # what each Envoy runs now is the new file
            dump = json.loads(envoy.admin_get("/config_dump?resource=ecds_filters"))
            (entry,) = dump["configs"]
            assert entry["version_info"] == str(single.config_versions[i]), entry
            vm_id = entry["ecds_filter"]["typed_config"]["config"]["vm_config"]["vm_id"]
            assert vm_id == (params["vm_id"] if variant == "new_vm" else "coordination-guard")
        conn.request("GET", "/things", headers={TENANT_HEADER: "acme"})
        second = conn.getresponse()
        assert second.status == 200 and second.getheader("ratelimit-policy"), second.status
        second.read()
        f.heal()
    finally:
        conn.close()
    assert [single.config_reloads(i) for i in range(2)] == [r + 2 for r in reloads]
    for envoy, before in zip(single.envoys, listeners):
        after = envoy.stats(filter="listener_manager")
        for name in ("listener_manager.listener_modified", "listener_manager.listener_removed"):
            assert after.get(name, 0) == before.get(name, 0), (name, before, after)
        assert envoy.stat(f"{ECDS_STAT}.config_fail") == 0
    all_served(single)


# --- faults on Redis Cluster -------------------------------------------------------------------
# One cluster target for these tests (3 masters, 3 replicas, the redis proxy, two webdis),
# healthy again at the start of each.


def tenant_slot(tenant: str) -> int:
    """The hash slot of a tenant's keys (keys.rs: the tag `t.<16 hex of SHA-256>`)."""
    tag = "t." + hashlib.sha256(b"tenant\0" + tenant.encode()).hexdigest()[:16]
    return key_slot_of(("{" + tag + "}").encode())


def owner(target, slot: int) -> int:
    return target.cluster.master_for_slot(slot)


def key_slot_of(key: bytes) -> int:
    from redis.crc import key_slot

    return key_slot(key)


def tenant_on(target, port: int, label: str = "t") -> str:
    """A tenant whose keys the master on `port` holds."""
    for i in range(5000):
        tenant = f"{label}-{i}"
        if owner(target, tenant_slot(tenant)) == port:
            return tenant
    raise AssertionError(f"no tenant on :{port}")


def key_on(target, port: int) -> str:
    """A key under the key prefix that the master on `port` holds."""
    for i in range(5000):
        key = f"cg:chaos:marker:{{m{i}}}"
        if owner(target, key_slot_of(key.encode())) == port:
            return key
    raise AssertionError(f"no key on :{port}")


def all_tenants_served(target) -> None:
    """A tenant of every master served through every Envoy."""
    for port in target.cluster.masters():
        tenant = tenant_on(target, port)
        for i, url in enumerate(target.envoy_urls):
            answer = get(url, tenant)
            assert served(*answer), f"envoy {i}, tenant on :{port}: {answer}"


@pytest.fixture(scope="module")
def cluster_target(tmp_path_factory, single_service):
    target = build_target("cluster", tmp_path_factory.mktemp("chaos-cluster"),
                          plugin(timeout=TIMEOUT), single_service.port)
    yield target
    target.stop()


@pytest.fixture
def cluster(cluster_target):
    cluster_target.healthy(60)
    all_tenants_served(cluster_target)
    return cluster_target


def test_cluster_target_spreads_tenants_over_every_master_and_stops_everything(
        tmp_path, single_service):
    target = build_target("cluster", tmp_path / "target", plugin(), single_service.port)
    started = pids(target)
    try:
        assert target.topology == "cluster" and len(target.webdis) == 2
        assert len(target.netproxy.ports) == 2  # one per webdis, both in the gateway cluster
        # A new cluster's first three nodes are its masters: the places a seed draws from.
        masters = set(target.cluster.masters())
        assert {n.port for n in target.redis_nodes()[:3]} == masters
        all_tenants_served(target)
        client = target.redis_client()  # cluster-aware: sees the keys of every master
        try:
            keys = list(client.scan_iter(match="cg:chaos:*"))
        finally:
            client.close()
        slots = {owner(target, key_slot_of(k)) for k in keys}
        assert len(slots) == 3, keys
        assert len(started) == 6 + 1 + 2 + 1 + 2 and all(running(p) for p in started)
    finally:
        target.stop()
    assert not [p for p in started if running(p)]


def test_cluster_pause_of_one_master_fails_closed_for_its_tenants_only(cluster):
    f = fault(cluster, "redis_pause_long", mode="ALL", pause_ms=1500)
    port = f.params["port"]
    other = next(p for p in cluster.cluster.masters() if p != port)
    paused_tenant, other_tenant = tenant_on(cluster, port), tenant_on(cluster, other)
    f.inject()
    paused_answer = get(cluster.envoy_urls[0], paused_tenant)
    other_answer = get(cluster.envoy_urls[0], other_tenant)
    f.heal()
    assert guard_unavailable(*paused_answer), paused_answer
    assert served(*other_answer), other_answer
    cluster.healthy(30)
    all_tenants_served(cluster)


@pytest.mark.parametrize("kind", ["redis_restart_persistent", "redis_restart_volatile"])
def test_cluster_master_restart_keeps_or_loses_its_keys(cluster, kind):
    masters = cluster.cluster.masters()
    place = next(i for i, n in enumerate(cluster.redis_nodes()) if n.port in masters)
    f = fault(cluster, kind, node=place)
    port = f.params["port"]
    assert f.params["role"] == "master" and f.data_loss  # a master: a failover may lose writes
    key = key_on(cluster, port)
    redis_key(cluster, key, "kept")
    # Written to the replica too, so a restart that loses it is the restart's doing.
    node = f.node
    assert _wait_replicated(cluster, port)
    f.inject()
    answer = get(cluster.envoy_urls[0], tenant_on(cluster, port))
    f.heal()
    assert guard_unavailable(*answer), answer
    assert node.alive()
    cluster.healthy(60)
    # Back within the node timeout: no failover, the node is the master it was.
    assert owner(cluster, key_slot_of(key.encode())) == port
    kept = redis_key(cluster, key)
    assert kept == (b"kept" if kind == "redis_restart_persistent" else None), kept
    all_tenants_served(cluster)


def _wait_replicated(target, port: int, timeout: float = 10.0) -> bool:
    """Until the master on `port` and its replica have the same replication offset."""
    node = next(n for n in target.redis_nodes() if n.port == port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        client = node.client()
        try:
            info = client.info("replication")
        finally:
            client.close()
        offset = info.get("master_repl_offset")
        replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        if replicas and all(r.get("offset") == offset for r in replicas):
            return True
        time.sleep(0.05)
    return False


def test_cluster_replica_restart_without_data_loses_nothing(cluster):
    masters = set(cluster.cluster.masters())
    replica = next(i for i, n in enumerate(cluster.redis_nodes()) if n.port not in masters)
    f = fault(cluster, "redis_restart_volatile", node=replica)
    assert f.params["role"] == "replica" and not f.data_loss
    f.inject()
    all_tenants_served(cluster)  # the masters serve on
    f.heal()
    cluster.healthy(60)
    all_tenants_served(cluster)


def test_cluster_failover_promotes_the_replica_and_the_old_master_rejoins(cluster):
    f = fault(cluster, "cluster_failover")
    port = f.params["port"]
    tenant = tenant_on(cluster, port)
    slot = tenant_slot(tenant)
    f.inject()
    answer = get(cluster.envoy_urls[1], tenant)
    assert guard_unavailable(*answer), answer  # before the replica takes over
    f.heal()
    promoted = f.params["promoted"]
    assert promoted is not None and promoted != port
    assert owner(cluster, slot) == promoted
    client = f.node.client()
    try:
        assert client.info("replication")["role"] == "slave"
    finally:
        client.close()
    cluster.healthy(60)
    all_tenants_served(cluster)
    assert served(*get(cluster.envoy_urls[1], tenant))


def test_cluster_script_flush_empties_every_node(cluster):
    f = fault(cluster, "script_flush", mode="ASYNC")
    f.inject()
    wait_for(lambda: all(_cached(n) == 0 for n in cluster.redis_nodes()), 5)
    f.heal()
    all_tenants_served(cluster)
    assert all(_cached(n) > 0 for n in cluster.masters())


def _cached(node) -> int:
    client = node.client()
    try:
        return int(client.info("memory")["number_of_cached_scripts"])
    finally:
        client.close()


@pytest.mark.parametrize("kind", kinds_for("cluster"))
def test_every_cluster_fault_heals_to_a_serving_target(cluster, kind):
    f = fault(cluster, kind, seed=11)
    params = f.inject()
    assert params["kind"] == kind and params["resource"] == f.resource
    time.sleep(0.3)
    f.heal()
    cluster.healthy(60)
    all_tenants_served(cluster)


def test_cluster_faults_draw_the_same_nodes_from_the_same_seed(cluster):
    for kind in kinds_for("cluster"):
        assert fault(cluster, kind, 3).params == fault(cluster, kind, 3).params, kind
    # Nodes are drawn by their place among the nodes; a failover draws one of the masters.
    masters = set(cluster.cluster.masters())
    places = {fault(cluster, "cluster_failover", seed).params["node"] for seed in range(30)}
    assert {cluster.redis_nodes()[i].port for i in places} == masters, (places, masters)
