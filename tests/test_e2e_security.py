"""The gateway's credentials: what the filter's Redis user may do through webdis, and the
credential read from the Wasm VM's environment (`redis.authorization_env`) in real Envoy.

The Redis ACL (tests/harness/proc.py RedisServer): webdis authenticates as Redis's `default`
user, which may run only EVAL/EVALSHA and the scripts' commands, on `cg:*` keys only. Scripts
run with their caller's permissions, so this is checked the way the filter reaches Redis: an
EVAL through webdis's HTTP interface with the filter's Basic credential.
"""

from __future__ import annotations

import json
import uuid

import pytest

from harness.proc import ADMIN_USER, GATEWAY_USER
from harness.stack import Stack, redis_section

COMMAND_DENIED = b"-ERR The user executing the script can't run this command"
KEY_DENIED_IN_SCRIPT = b"-ERR The user executing the script can't access at least one of the keys"
KEY_DENIED = b"-NOPERM this user has no permissions to access one of the keys"


@pytest.fixture
def stack(stack_factory) -> Stack:
    stack = stack_factory(None, envoys=0)
    stack.redis.set("other:key", "kept")
    stack.redis.set("cg:kept", "kept")
    return stack


def acl_log(stack: Stack) -> list[dict]:
    return stack.redis.acl_log()


@pytest.mark.parametrize("script", [
    "return redis.call('KEYS', '*')",
    "return redis.call('FLUSHALL')",
    "return redis.call('FLUSHDB')",
    "return redis.call('SCAN', '0')",
    "return redis.call('SELECT', '1')",
    "return redis.call('INFO')",
    "return redis.call('INCR', 'cg:x')",  # not one of the scripts' commands, even on a cg key
    "return redis.call('EXPIRE', 'cg:kept', 1)",
])
def test_gateway_scripts_cannot_run_other_commands(stack, script):
    """Commands a script may run in Redis 7 (the admin's scripts can): refused by the ACL."""
    status, body = stack.webdis.eval(script)
    assert status == 200 and body.startswith(COMMAND_DENIED), body
    assert stack.redis.dbsize() == 2 and stack.redis.get("other:key") == b"kept"
    assert stack.redis.ttl("cg:kept") == -1
    entry = acl_log(stack)[0]
    assert (entry["reason"], entry["context"], entry["username"]) == ("command", "lua", GATEWAY_USER)


@pytest.mark.parametrize("script", [
    "return redis.call('CONFIG', 'GET', '*')",
    "return redis.call('CONFIG', 'SET', 'maxmemory', '1')",
    "return redis.call('SCRIPT', 'FLUSH')",
    "return redis.call('ACL', 'SETUSER', 'default', '+@all')",
])
def test_gateway_cannot_run_admin_commands(stack, script):
    """Redis 7 refuses these inside any script; the gateway user cannot run them directly
    either (webdis allows it only EVAL/EVALSHA, and Redis's ACL refuses them too)."""
    status, body = stack.webdis.eval(script)
    assert status == 200 and body.startswith(b"-ERR This Redis command is not allowed from script"), body
    gateway = stack.redis_server.gateway_client()
    try:
        import redis

        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway.execute_command(*script.split("redis.call(", 1)[1].rstrip(")").replace("'", "").split(", "))
    finally:
        gateway.close()
    assert stack.redis.config_get("maxmemory") == {"maxmemory": "0"}
    assert "+@all" not in " ".join(stack.redis.acl_getuser(GATEWAY_USER)["commands"])


@pytest.mark.parametrize("how, script, keys, denied", [
    ("declared key", "return redis.call('GET', KEYS[1])", ["other:key"], KEY_DENIED),
    ("key in the script", "return redis.call('GET', 'other:key')", [], KEY_DENIED_IN_SCRIPT),
    ("write", "return redis.call('SET', 'other:key', 'x')", [], KEY_DENIED_IN_SCRIPT),
    ("delete", "return redis.call('DEL', 'other:key')", [], KEY_DENIED_IN_SCRIPT),
    ("prefix without colon", "return redis.call('SET', 'cgx', 'x')", [], KEY_DENIED_IN_SCRIPT),
    ("one key outside among others", "return redis.call('DEL', KEYS[1], KEYS[2])",
     ["cg:kept", "other:key"], KEY_DENIED),
])
def test_gateway_scripts_cannot_touch_keys_outside_the_prefix(stack, how, script, keys, denied):
    status, body = stack.webdis.eval(script, keys)
    assert status == 200 and body.startswith(denied), (how, body)
    assert stack.redis.get("other:key") == b"kept" and stack.redis.get("cg:kept") == b"kept"
    assert not stack.redis.exists("cgx")
    assert acl_log(stack)[0]["reason"] == "key"


def test_gateway_scripts_work_on_prefixed_keys(stack):
    webdis = stack.webdis
    assert webdis.eval("return redis.call('SET', KEYS[1], ARGV[1], 'PX', 60000)",
                       ["cg:test:x"], ["v1"]) == (200, b"+OK\r\n")
    assert webdis.eval("return redis.call('GET', KEYS[1])", ["cg:test:x"]) == (200, b"$2\r\nv1\r\n")
    assert webdis.eval("return redis.call('INCRBY', 'cg:{t}:n', 5)") == (200, b":5\r\n")
    assert webdis.eval("return redis.call('DEL', KEYS[1])", ["cg:kept"]) == (200, b":1\r\n")
    assert stack.redis.get("cg:test:x") == b"v1" and not stack.redis.exists("cg:kept")
    assert acl_log(stack) == []


def test_gateway_user_is_what_webdis_runs_as_and_admin_is_separate(stack):
    gateway = stack.redis_server.gateway_client()
    try:
        assert gateway.get("cg:kept") == b"kept"
        for denied in (lambda: gateway.keys("*"), gateway.flushall, lambda: gateway.get("other:key"),
                       lambda: gateway.config_get("*"), gateway.acl_whoami):
            with pytest.raises(Exception, match="NOPERM|no permissions"):
                denied()
    finally:
        gateway.close()
    assert stack.redis.acl_whoami() == ADMIN_USER
    # Without a password (as webdis without redis_auth would connect) nothing runs.
    import redis

    anonymous = redis.Redis(host="127.0.0.1", port=stack.redis_server.port, socket_timeout=5)
    try:
        with pytest.raises(redis.AuthenticationError):
            anonymous.get("cg:kept")
    finally:
        anonymous.close()
    # webdis's fresh connections authenticate as the gateway user, and nothing it sends on
    # its own (on connect) is refused.
    assert len(acl_log(stack)) == 5
    stack.redis.acl_log_reset()
    stack.webdis.restart()
    assert stack.webdis.eval("return redis.call('GET', KEYS[1])", ["cg:kept"]) == (200, b"$4\r\nkept\r\n")
    users = {c["user"] for c in stack.redis.client_list() if c["id"] != str(stack.redis.client_id())}
    assert users == {GATEWAY_USER}
    assert acl_log(stack) == []


def test_a_key_prefix_outside_the_acl_fails_closed(stack):
    """A plugin whose key_prefix the gateway user may not touch gets Redis errors: fail-closed
    503s, counted, and Redis's ACL LOG names the key."""
    with pytest.raises(ValueError, match="outside the gateway user's keys"):
        stack.redis_section(key_prefix="other")
    section = redis_section(stack.webdis.authorization, key_prefix="other", timeout="1s")
    envoy = stack.add_envoy({"redis": section, "policies": LIMITED})
    response = envoy.request("POST", "/orders", headers={"x-tenant-id": "acme"})
    assert response.status == 503 and response.json()["type"].endswith("guard_unavailable")
    assert envoy.stat("wasmcustom.cg.redis.errors") >= 1
    assert envoy.stat("wasmcustom.cg.policy.orders.failed_closed") == 1
    entry = acl_log(stack)[0]
    assert entry["reason"] == "key" and entry["object"].startswith("other:rl:")
    assert stack.redis.keys("other:rl:*") == []


# --- redis.authorization_env: the credential from the Wasm VM's environment ----------------

ENV_NAME = "CG_TEST_GATEWAY_AUTHORIZATION"
LIMITED = [{"name": "orders", "match": {"path_prefix": "/orders"},
            "rate_limits": [{"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window",
                             "limit": 2, "window": "60s"}]}]


def env_plugin(stack: Stack, **redis) -> dict:
    section = stack.redis_section(key_prefix=f"cg:e2e-env:{uuid.uuid4().hex[:8]}", timeout="1s")
    section.pop("authorization")
    section.update(redis)
    return {"redis": section, "policies": LIMITED}


def test_authorization_from_the_vm_environment(stack):
    secret = stack.webdis.authorization
    envoy = stack.add_envoy(env_plugin(stack, authorization_env=ENV_NAME),
                            vm_env={"host_env_keys": [ENV_NAME]},
                            process_env={ENV_NAME: secret})
    statuses = [envoy.request("POST", "/orders", headers={"x-tenant-id": "acme"}).status
                for _ in range(3)]
    # Decisions from Redis (an unauthenticated callout gets webdis's 403: fail-closed 503s).
    assert statuses == [200, 200, 429]
    assert envoy.stat("wasmcustom.cg.redis.errors") == 0
    dump = envoy.admin_get("/config_dump")
    token = secret.split(" ", 1)[1]
    assert ENV_NAME in dump and "authorization_env" in dump
    assert token not in dump and secret not in dump
    assert token not in envoy.log_text()
    assert acl_log(stack) == []


def test_authorization_env_unset_refuses_the_plugin(stack):
    # The variable is forwarded to the VM but Envoy's own environment lacks it.
    code, log = stack.envoy_expect_failure(env_plugin(stack, authorization_env=ENV_NAME),
                                           vm_env={"host_env_keys": [ENV_NAME]})
    assert code == 1, log
    assert (f"invalid plugin configuration: redis.authorization_env: environment variable "
            f"{ENV_NAME} is not set in the Wasm VM") in log
    assert "Unable to create Wasm plugin coordination-guard" in log


def test_authorization_env_empty_refuses_the_plugin(stack):
    code, log = stack.envoy_expect_failure(env_plugin(stack, authorization_env=ENV_NAME),
                                           vm_env={"host_env_keys": [ENV_NAME]},
                                           process_env={ENV_NAME: ""})
    assert code == 1, log
    assert f"redis.authorization_env: environment variable {ENV_NAME} is empty" in log


def test_authorization_and_authorization_env_together_are_refused(stack):
    secret = stack.webdis.authorization
    code, log = stack.envoy_expect_failure(
        env_plugin(stack, authorization=secret, authorization_env=ENV_NAME),
        vm_env={"host_env_keys": [ENV_NAME]}, process_env={ENV_NAME: secret})
    assert code == 1, log
    assert ("invalid plugin configuration: redis.authorization_env: cannot be combined with "
            "redis.authorization") in log


def test_envoy_config_dump_shows_an_inline_authorization(stack):
    """Why authorization_env exists: the inline credential is in every config dump."""
    envoy = stack.add_envoy(env_plugin(stack, authorization=stack.webdis.authorization))
    assert envoy.request("POST", "/orders", headers={"x-tenant-id": "acme"}).status == 200
    assert json.dumps(stack.webdis.authorization)[1:-1] in envoy.admin_get("/config_dump")
