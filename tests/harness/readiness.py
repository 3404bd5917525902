"""Readiness means working: one real script call through Envoy's gateway cluster.

A stack is "up" only after a script has run the way the filter's calls run: from Envoy, through
its gateway cluster (`redis_gateway`), to webdis with the plugin's credential, to Redis as the
gateway user, and back with the right answer. An open port proves none of that (webdis that
could not read its configuration listens too, and every guarded request then gets `503`).

The probe goes through a listener of its own (`gateway_probe`, loopback, a port the kernel
picks) that routes to the gateway cluster: the rendered configs of `make run` and of the test
harness carry it; envoy/demo.yaml, the config users copy, does not. The script writes, reads and
deletes one key under the plugin's `key_prefix`, so it runs with the gateway user's ACL and
leaves nothing behind.
"""

from __future__ import annotations

import http.client
import json
import secrets
import time
import urllib.parse
import urllib.request

LISTENER = "gateway_probe"
GATEWAY_CLUSTER = "redis_gateway"
# SET, GET and DEL of one key: the gateway user may run them on `<key_prefix>:*` only.
SCRIPT = ("redis.call('SET', KEYS[1], ARGV[1], 'PX', 10000) "
          "local v = redis.call('GET', KEYS[1]) redis.call('DEL', KEYS[1]) return v")


class NotReady(RuntimeError):
    """The probe failed: `part` is the process whose log says why (envoy, webdis, redis)."""

    def __init__(self, part: str, message: str):
        super().__init__(f"{part}: {message}")
        self.part = part
        self.message = message


def listener(cluster: str = GATEWAY_CLUSTER) -> dict:
    """The probe's listener, for a config built as a dict."""
    return {
        "name": LISTENER,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network."
                         "http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": LISTENER,
                "route_config": {"virtual_hosts": [{
                    "name": LISTENER, "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"},
                                "route": {"cluster": cluster, "timeout": "2s"}}]}]},
                "http_filters": [{
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters."
                                              "http.router.v3.Router"}}],
            }}]}],
    }


def listener_yaml(indent: int = 4) -> str:
    """The probe's listener as a YAML list item (JSON is YAML), for a config kept as text."""
    pad = " " * indent
    return (f"{pad}# make run's readiness probe: a script call through the gateway cluster.\n"
            f"{pad}- {json.dumps(listener())}\n")


def port(admin_url: str, timeout: float = 5.0) -> int:
    """The port the kernel gave the probe's listener, from Envoy's admin."""
    with urllib.request.urlopen(f"{admin_url}/listeners?format=json", timeout=timeout) as resp:
        statuses = json.loads(resp.read())["listener_statuses"]
    for status in statuses:
        if status["name"] == LISTENER:
            return int(status["local_address"]["socket_address"]["port_value"])
    raise NotReady("envoy", f"its config has no `{LISTENER}` listener")


def _call(port: int, authorization: str, key: str, nonce: str,
          conn: http.client.HTTPConnection) -> None:
    """One probe on `conn`; raises NotReady naming the part that failed."""
    words = ["EVAL", SCRIPT, "1", key, nonce]
    body = "/".join(urllib.parse.quote(w, safe="") for w in words) + ".raw"
    try:
        conn.request("POST", "/", body=body.encode(), headers={
            "Authorization": authorization, "Content-Type": "application/x-www-form-urlencoded"})
        resp = conn.getresponse()
        status, text = resp.status, resp.read().decode(errors="replace")
    except OSError as e:
        raise NotReady("envoy", f"its probe listener on 127.0.0.1:{port} did not answer ({e})") from e
    line = text.split("\r\n", 1)[0]
    if status == 200 and text == f"${len(nonce)}\r\n{nonce}\r\n":
        return
    if status in (502, 503, 504) and ("upstream" in text or "no healthy" in text):
        raise NotReady("webdis", f"Envoy's gateway cluster could not reach webdis ({status}: "
                                 f"{text.strip()[:120]})")
    if status in (401, 403):
        raise NotReady("webdis", f"webdis refused the plugin's credential (redis.authorization): "
                                 f"HTTP {status}")
    if status == 503:
        raise NotReady("redis", "webdis answered 503: it cannot reach Redis")
    if line.startswith(("-NOAUTH", "-WRONGPASS")):
        raise NotReady("webdis", f"webdis could not authenticate to Redis: {line[1:]}")
    if line.startswith("-NOPERM"):
        raise NotReady("redis", f"Redis refused the gateway user ({line[1:]}): its ACL must "
                                f"allow the keys `{key.rsplit(':', 2)[0]}:*` and the scripts' "
                                "commands")
    raise NotReady("redis" if line.startswith("-") else "webdis",
                   f"the probe script came back wrong: HTTP {status}, {text.strip()[:160]!r}")


def check(port: int, authorization: str, key_prefix: str, timeout: float = 10.0,
          calls: int = 1) -> None:
    """Until `calls` probes in a row have come back right on one connection (which Envoy
    spreads over the gateway's endpoints in turn); NotReady with the last failure after
    `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
        try:
            for _ in range(calls):
                nonce = secrets.token_hex(8)
                _call(port, authorization, f"{key_prefix}:ready:{nonce}", nonce, conn)
            return
        except NotReady:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
        finally:
            conn.close()
