"""Up means working: the readiness probe through Envoy's gateway cluster names the part that
fails, nothing the project starts listens beyond loopback, and a gateway that cannot read its
configuration is refused. Real Envoy, webdis and Redis; each fault is a real misconfiguration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import readiness
from harness.envoy import Envoy
from harness.proc import ROOT, NotConfigured, RedisServer, Service, free_port
from harness.webdis import Webdis

DEMO_PLUGIN = json.loads((ROOT / "envoy" / "demo-plugin.json").read_text())


class Parts:
    """Redis, webdis and an Envoy (no filter: the probe needs only the gateway cluster)."""

    def __init__(self, tmp: Path, webdis_redis_password: str | None = None):
        self.redis = RedisServer(tmp / "redis").start()
        password = webdis_redis_password or self.redis.gateway_password
        self.webdis = Webdis(tmp / "webdis", self.redis.port, redis_password=password).start()
        self.envoy = Envoy(tmp / "envoy", None, free_port(), self.webdis.port).start()

    def probe(self, authorization: str | None = None, key_prefix: str = "cg") -> None:
        readiness.check(readiness.port(self.envoy.admin_url),
                        authorization or self.webdis.authorization, key_prefix, timeout=1)

    def stop(self) -> None:
        for part in (self.envoy, self.webdis, self.redis):
            part.stop()


@pytest.fixture
def parts(tmp_path):
    made = []

    def make(**kwargs) -> Parts:
        made.append(Parts(tmp_path / f"parts-{len(made)}", **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.stop()


def test_a_working_stack_answers_the_probe_and_keeps_nothing(parts):
    p = parts()
    p.probe()
    assert p.redis.client().keys("cg:*") == [], "the probe deletes its key"


@pytest.mark.parametrize("fault,part,says", [
    # webdis 0.1.9 ignores AUTH's error and answers each call with Redis's NOAUTH.
    ("webdis_redis_password", "webdis", "webdis could not authenticate to Redis: NOAUTH"),
    ("authorization", "webdis", "webdis refused the plugin's credential (redis.authorization)"),
    ("key_prefix", "redis", "Redis refused the gateway user (NOPERM"),
    ("redis_down", "redis", "webdis answered 503: it cannot reach Redis"),
    ("webdis_down", "webdis", "Envoy's gateway cluster could not reach webdis"),
])
def test_the_probe_names_the_part_that_fails(parts, fault, part, says):
    p = parts(**({"webdis_redis_password": "not-the-password"}
                 if fault == "webdis_redis_password" else {}))
    kwargs = {}
    if fault == "authorization":
        kwargs["authorization"] = "Basic bm90OnRoaXM="
    elif fault == "key_prefix":
        kwargs["key_prefix"] = "other"  # outside the gateway user's ~cg:*
    elif fault == "redis_down":
        p.redis.stop()
    elif fault == "webdis_down":
        p.webdis.stop()
    with pytest.raises(readiness.NotReady) as e:
        p.probe(**kwargs)
    assert e.value.part == part and says in e.value.message, e.value


def test_a_process_listening_beyond_loopback_is_refused(tmp_path):
    """A service that listens on 0.0.0.0 (what webdis does with its built-in configuration)
    is stopped and never used."""
    port = free_port()
    script = ("import socket, time; s = socket.socket(); "
              "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
              f"s.bind(('0.0.0.0', {port})); s.listen(); time.sleep(60)")
    service = Service()
    with pytest.raises(NotConfigured, match=rf"listens on 0\.0\.0\.0:{port}, beyond loopback"):
        service.launch("wide", [sys.executable, "-c", script], tmp_path, port, 10)
    assert not service.alive()


def test_webdis_is_handed_its_configuration_by_absolute_path(tmp_path, monkeypatch):
    """From a relative working directory, as `make run`'s default LOGS is: the config path is
    absolute, and webdis runs with it."""
    monkeypatch.chdir(tmp_path)
    redis = RedisServer(Path("redis")).start()
    try:
        webdis = Webdis(Path("logs/webdis"), redis.port, redis_password=redis.gateway_password)
        webdis.start()
        try:
            assert webdis.proc.argv[1] == str(tmp_path / "logs" / "webdis" / "webdis.json")
            assert webdis.proc.workdir.is_absolute()
            assert webdis.eval("return 1")[0] == 200
        finally:
            webdis.stop()
    finally:
        redis.stop()


def test_webdis_that_cannot_read_its_configuration_is_refused(tmp_path, monkeypatch):
    """webdis handed a path it cannot open (the original bug: a relative path from another
    directory) falls back to its built-in configuration; the harness stops it and says so."""
    real = subprocess.run(["which", "webdis"], capture_output=True, text=True).stdout.strip()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "webdis").write_text(f"#!/bin/sh\nexec {real} build/demo/webdis/webdis.json\n")
    (bin_dir / "webdis").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    webdis = Webdis(tmp_path / "webdis", free_port(), redis_password="x")
    with pytest.raises((NotConfigured, RuntimeError), match="unable to open"):
        webdis.start(timeout=3)
    assert not webdis.alive()


def test_make_run_over_a_broken_gateway_says_what_failed_and_never_that_it_is_up(tmp_path):
    """webdis that authenticates to Redis with no credential (as one that fell back to its
    built-in configuration does): `make run` exits non-zero, names webdis and shows the end of
    its log, and never prints the ready line."""
    real = subprocess.run(["which", "webdis"], capture_output=True, text=True).stdout.strip()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "webdis"
    # The wrapper drops redis_auth from the configuration it is handed, then runs webdis.
    wrapper.write_text(
        "#!/bin/sh\n"
        f"{sys.executable} -c 'import json, sys; c = json.load(open(sys.argv[1])); "
        "c.pop(\"redis_auth\"); json.dump(c, open(sys.argv[1] + \".noauth\", \"w\"))' \"$1\"\n"
        f"exec {real} \"$1.noauth\"\n")
    wrapper.chmod(0o755)
    ports = {name: free_port() for name in ("ENVOY", "ADMIN", "UPSTREAM", "WEBDIS", "REDIS")}
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = subprocess.run(["make", "--no-print-directory", "run", f"LOGS={tmp_path / 'logs'}",
                        *[f"{k}_PORT={v}" for k, v in ports.items()]],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "demo is up" not in out, out
    assert "demo: not working: webdis: webdis could not authenticate to Redis: NOAUTH" in out, out
    assert "--- the end of webdis's log ---" in out, out
