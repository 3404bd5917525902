"""webdis: the HTTP gateway in front of Redis that the filter calls through Envoy.

The ACL is locked down the way a deployment should be: anonymous clients can run nothing, and
the filter's Basic-auth user can run only EVAL and EVALSHA. webdis itself authenticates to
Redis with `redis_auth` (a password only in 0.1.9: Redis's `default` user), which Redis
restricts to the prefix's keys and the scripts' commands (see RedisServer in proc.py).

Observed with Debian's webdis 0.1.9 (tests/test_harness.py pins these):
- POST `/` with body `EVAL/<script>/<numkeys>/<args...>.raw` answers 200 with raw RESP; path
  segments are percent-decoded.
- Redis errors (`-NOSCRIPT ...`, `-ERR ...`) still come back as HTTP 200 with the error line.
- Anonymous or disallowed command: 403 with an empty body.
- A POST with `Connection: close` sometimes gets no answer at all (webdis bug); Envoy keeps
  upstream connections alive, so only hand-written clients need to care.
- Redis down: 503 with an empty body, answered at once; webdis reconnects by itself within a
  few milliseconds of Redis coming back on the same port.
- Raw replies are re-encoded by webdis: integers inside arrays come back as bulk strings, and
  nil or nested-array elements are dropped while the `*N` count is kept (a malformed reply), so
  scripts must return flat arrays of strings/integers.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import time
import urllib.parse
from pathlib import Path

from .proc import NotConfigured, Service, free_port, require_binary


class Webdis(Service):
    """One webdis process. `start()` again after `stop()` reuses the same port and config."""

    def __init__(self, workdir: Path, redis_port: int, user: str = "cg", password: str = "secret",
                 port: int | None = None, redis_password: str | None = None):
        self.workdir = Path(workdir).resolve()
        self.redis_port = redis_port
        # Sent as `AUTH <password>` on every connection to Redis (the `default` user).
        self.redis_password = redis_password
        self.user = user
        self.password = password
        self.own_port = port is None
        self.port = port or free_port()
        # Worker threads; each holds its own connection to Redis and reconnects on its own.
        self.threads = 2
        self.config_path = self.workdir / "webdis.json"
        self.log_path = self.workdir / "webdis.log"
        self._log_offset = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def authorization(self) -> str:
        """The `Authorization` header value the filter must send (`redis.authorization`)."""
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        return f"Basic {token}"

    def config(self) -> dict:
        return {
            "redis_host": "127.0.0.1",
            "redis_port": self.redis_port,
            "redis_auth": self.redis_password,
            "http_host": "127.0.0.1",
            "http_port": self.port,
            "threads": self.threads,
            "daemonize": False,
            "database": 0,
            "acl": [
                {"disabled": ["*"]},
                {"http_basic_auth": f"{self.user}:{self.password}", "enabled": ["EVALSHA", "EVAL"]},
            ],
            "verbosity": 1,
            "logfile": str(self.log_path),
        }

    def start(self, timeout: float = 10.0) -> "Webdis":
        binary = require_binary("webdis")
        self.workdir.mkdir(parents=True, exist_ok=True)

        def attempt() -> None:
            self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            self.config_path.write_text(json.dumps(self.config(), indent=2) + "\n")
            self.config_path.chmod(0o600)  # holds the Redis password
            # webdis that cannot read its config file starts with its built-in one (0.0.0.0:7379,
            # everything allowed, no Redis credential): always pass one, by its absolute path,
            # and refuse a webdis that says it could not read it.
            if not os.access(self.config_path, os.R_OK):
                raise NotConfigured(f"webdis: cannot read its configuration {self.config_path}")
            self.launch(f"webdis-{self.port}", [binary, str(self.config_path)], self.workdir,
                        self.port, timeout)
            said = next((line for line in self.start_log().splitlines()
                         if "unable to open" in line or "Error:" in line), None)
            if said is not None:
                self.stop()
                raise NotConfigured(f"webdis did not read {self.config_path}: {said.strip()}")

        self.launch_on_free_port(attempt, self.own_port)
        return self

    def start_log(self) -> str:
        """Its output and what it wrote to its own log file since this start (where it says
        that it could not bind its port)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                own = f.read().decode(errors="replace")
        except FileNotFoundError:
            own = ""
        return super().start_log() + own

    def wait_redis(self, timeout: float = 10.0) -> None:
        """Until webdis is back with Redis (after Redis restarted): it retries its connection
        about every 100 ms and answers 503 until then, each worker thread on its own. Returns
        once it answered twice as many EVALs in a row as it has threads, each on a new
        connection (handed to the threads in turn), so every thread is back."""
        deadline = time.monotonic() + timeout
        in_a_row = 0
        while in_a_row < 2 * self.threads:
            try:
                ok = self.eval("return 1")[0] == 200
            except OSError:
                ok = False
            in_a_row = in_a_row + 1 if ok else 0
            if not ok:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"webdis did not reconnect to Redis within {timeout}s")
                time.sleep(0.02)

    def restart(self, timeout: float = 10.0) -> "Webdis":
        self.stop()
        return self.start(timeout)

    def command(self, *parts: str | int | bytes, auth: bool = True, timeout: float = 5.0) -> tuple[int, bytes]:
        """POST one command the way the filter does (raw output); returns (status, body).

        Sent without `Connection: close`: webdis 0.1.9 sometimes drops the answer to a POST
        that carries it (about 1 in 5 here), so clients must keep the connection alive.
        """
        segments = [urllib.parse.quote(p if isinstance(p, bytes) else str(p), safe="") for p in parts]
        body = ("/".join(segments) + ".raw").encode()
        headers = {"Content-Type": "application/x-www-form-urlencoded"}
        if auth:
            headers["Authorization"] = self.authorization
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", "/", body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def eval(self, script: str, keys: list = (), args: list = (), auth: bool = True) -> tuple[int, bytes]:
        return self.command("EVAL", script, len(keys), *keys, *args, auth=auth)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
