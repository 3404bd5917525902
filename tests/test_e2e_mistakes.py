"""The most common set-up mistakes, each answered with a message that names its cause:
real Envoy running the filter, real webdis and Redis (with the gateway's ACL user).

A mistake in the plugin configuration itself is the filter's own field-path message at start
(`tests/test_check.py`, `tests/test_demo.py`); these are the ones that only show once requests
flow: the client's `503` problem detail names the failing part, and the Envoy log says more.
Except the limits a field has for the sake of Redis's load (`max_wait`), refused by real Envoy
at start here too.
"""

from __future__ import annotations

import re
import time
import uuid

import pytest

from harness.concurrency import wait_for
from harness.stack import BLACKHOLE_CLUSTER, Stack

TENANT = {"x-tenant-id": "acme"}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("mistakes"), None, envoys=0).start()
    yield stack
    stack.stop()


def plugin(redis: dict) -> dict:
    return {"redis": redis, "failure_mode": "fail_closed",
            "policies": [{"name": "api", "match": {"path_prefix": "/api"}, "rate_limits": [
                {"name": "t", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100,
                 "window": "1m"}]}]}


def answer(envoy) -> tuple[int, str]:
    r = envoy.request("GET", "/api/x", headers=TENANT)
    return r.status, (r.json().get("detail", "") if r.status == 503 else "")


def redis_block(stack: Stack, **overrides) -> dict:
    block = stack.redis_section(key_prefix=f"cg:mistakes:{uuid.uuid4().hex[:8]}")
    block.update(overrides)
    return block


@pytest.mark.parametrize("case", ["misspelt_cluster", "wrong_credential", "prefix_outside_acl",
                                  "gateway_never_answers", "redis_down"])
def test_each_mistake_names_its_cause(shared, sidecars, case):
    if case == "misspelt_cluster":
        redis = redis_block(shared, cluster="redis_gatway")
        cause = "the proxy has no route to it (its gateway cluster is not configured)"
        logged = "cannot dispatch to cluster redis_gatway (BadArgument): redis.cluster is not a cluster of this proxy"
    elif case == "wrong_credential":
        redis = redis_block(shared, authorization="Basic d3Jvbmc6d3Jvbmc=")
        cause = "its gateway refused the proxy's credentials"
        logged = "gateway answered HTTP 403"
    elif case == "prefix_outside_acl":
        redis = redis_block(shared)
        redis["key_prefix"] = "app"  # the gateway user may touch only cg:* keys
        cause = "Redis refused the command (its ACL does not allow the proxy's keys)"
        logged = "NOPERM"
    elif case == "gateway_never_answers":
        redis = redis_block(shared, cluster=BLACKHOLE_CLUSTER, timeout="80ms")
        cause = "it did not answer within 80 ms"
        logged = "no answer within the timeout"
    else:
        redis = redis_block(shared)
        cause = "Redis is unavailable behind its gateway"
        logged = "gateway answered HTTP 503"
    envoy = sidecars(shared, plugin(redis), redis["key_prefix"])
    if case == "redis_down":
        shared.stop_redis()
    try:
        status, detail = answer(envoy)
    finally:
        if case == "redis_down":
            shared.start_redis()
    assert status == 503, (status, detail)
    assert detail == f"the coordination store cannot decide: {cause}; retry shortly"
    assert logged in envoy.log_text(), envoy.log_text()[-3000:]


def test_a_gateway_that_cannot_authenticate_to_redis_is_named_in_words(tmp_path):
    """webdis sends Redis a wrong password: Redis refuses every command (webdis passes the
    error on as HTTP 200). The client's 503 and Envoy's log say so, the log in words with what
    to check, once per worker per second however many requests fail."""
    stack = Stack(tmp_path, None, envoys=0).start()
    try:
        stack.webdis.stop()
        stack.webdis.redis_password = "wrong-" + stack.redis_server.gateway_password
        stack.webdis.start()
        assert stack.webdis.eval("return 1") == (200, b"-NOAUTH Authentication required.\r\n")
        envoy = stack.add_envoy(plugin(redis_block(stack)))
        started = time.monotonic()
        answers = [answer(envoy) for _ in range(6)]
        elapsed = time.monotonic() - started
        # Redis closes a connection it refused a long command on, and webdis answers 503 until
        # it has connected again: some requests see that instead.
        assert all(status == 503 for status, _ in answers), answers
        cause = "its gateway could not authenticate to Redis"
        assert (503, f"the coordination store cannot decide: {cause}; retry shortly") in answers, answers
        # A short command gets `-NOAUTH`; a long one (a script's source) `-ERR Protocol error:
        # unauthenticated multibulk length`: the same words for both.
        said = re.compile(
            r"redis call for policy api failed \(the gateway could not authenticate to Redis: "
            r"(NOAUTH Authentication required\.|ERR Protocol error: unauthenticated [a-z ]+); "
            r"check the gateway's Redis credential \(webdis: redis_auth\) against Redis's "
            r"password or ACL user\); failing closed")
        assert wait_for(lambda: said.search(envoy.log_text()), 5), envoy.log_text()[-3000:]
        lines = [line for line in envoy.log_text().splitlines() if said.search(line)]
        if elapsed < 0.9:  # within one interval: at most one line per worker
            assert len(lines) <= stack.concurrency, lines
    finally:
        stack.stop()


@pytest.mark.parametrize("block,field", [
    ({"idempotency": {"in_progress": "wait", "max_wait": "31s"}}, "idempotency.max_wait"),
    ({"lease": {"resource": ["tenant"], "on_busy": "wait", "max_wait": "1h"}}, "lease.max_wait"),
])
def test_a_max_wait_over_30s_is_refused_at_load(shared, block, field):
    """Every waiting request polls Redis several times a second: `max_wait` is capped at
    30 s, and Envoy refuses the plugin with the field named (it once took any duration). 30 s
    itself loads."""
    policy = {"name": "api", "match": {"path_prefix": "/api"}, **block}
    config = {"redis": redis_block(shared), "policies": [policy]}
    code, log = shared.envoy_expect_failure(config)
    assert code is not None, "Envoy started with the plugin"
    want = f"invalid plugin configuration: policies[0].{field}: "
    assert want in log and "longer than the maximum of 30s" in log, log[-2000:]
    inner = next(iter(block.values()))
    inner["max_wait"] = "30s"
    envoy = shared.add_envoy(config)
    try:
        assert envoy.request("GET", "/other").status == 200
    finally:
        envoy.stop()
        shared.envoys.remove(envoy)
