"""Every write a script makes survives a Redis killed (SIGKILL) and started again from its
append-only file, under each ACL the documents give the gateway's Redis user: docs/security.md's
two forms (the gateway as `default`; the gateway as `cg-gateway` with `default` switched off),
docs/redis-cluster.md's (a node's, with `+cluster|slots`), and deploy/istio/redis.yaml's ACL
file as its init container writes it (tests/test_istio_walkthrough.py runs that one).

Redis writes what a script did to its append-only file as one transaction (`MULTI` ... `EXEC`,
a `PEXPIRE` as `PEXPIREAT`, a `SET ... PX` as `SET ... PXAT`; a script that wrote one command
gets no transaction) and replays the file at start as its `default` user. Redis 7.0 to 7.4 check
every command of a replayed `EXEC` against that user's ACL again (redis/redis#14541, fixed by
redis/redis#14545; valkey-io/valkey#3983), whether or not the user is switched on: one command
`default` may not run fails the whole transaction, and the restarted Redis holds none of its
writes (a counter, a lease, a fence, a slot set, a TTL), logging `NOPERM` for its AOF-loading
client. Each test runs every script on every path (tests/test_scripts_acl.py), kills Redis,
starts it again from the file, and finds every key with the same value and a TTL no longer than
before.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import time
from pathlib import Path

import pytest
import redis as redispy

from harness.proc import ROOT, Service, free_port, require_binary
from test_scripts_acl import test_every_script_runs_as_the_gateway_user as run_every_script

SECURITY = ROOT / "docs" / "security.md"
REDIS_CLUSTER = ROOT / "docs" / "redis-cluster.md"


# --- the documents' ACL lines ------------------------------------------------------------------


def acl_blocks(path: Path) -> list[list[str]]:
    """The `ACL SETUSER` lines of each fenced block of `path` that holds any, in order."""
    blocks = re.findall(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", path.read_text(), re.S | re.M)
    out = []
    for block in blocks:
        lines = [line.strip() for line in block.splitlines() if line.strip().startswith("ACL SETUSER ")]
        if lines:
            out.append(lines)
    return out


def documented_forms() -> dict[str, list[str]]:
    """Each form a document gives, as the lines an operator runs (security.md: the admin user
    first, then the gateway's lines, as `admin`)."""
    security = acl_blocks(SECURITY)
    cluster = acl_blocks(REDIS_CLUSTER)
    assert len(security) == 2 and len(cluster) == 1, (security, cluster)
    admin = [line for line in security[0] if line.startswith("ACL SETUSER admin ")]
    assert len(admin) == 1, security[0]
    return {
        "security.md, the gateway as default": security[0],
        "security.md, the gateway as cg-gateway": admin + security[1],
        "redis-cluster.md, a node": admin + cluster[0],
    }


# --- a Redis the lines are run against --------------------------------------------------------


class AclRedis(Service):
    """redis-server with an ACL file (empty at first: `default` is on, without a password, with
    every right, until the lines change it), an append-only file flushed before each reply, and
    nothing else; started again on the same port with the same files."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir).resolve()
        self.port = free_port()
        self.acl_path = self.workdir / "users.acl"

    def start(self, timeout: float = 10.0) -> "AclRedis":
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.acl_path.exists():
            self.acl_path.write_text("")
        argv = [require_binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                "--daemonize", "no", "--dir", str(self.workdir), "--save", "",
                "--appendonly", "yes", "--appendfsync", "always",
                "--aclfile", str(self.acl_path)]
        self.launch(f"acl-redis-{self.port}", argv, self.workdir, self.port, timeout)
        return self

    def client(self, username: str | None = None, password: str | None = None):
        return redispy.Redis(host="127.0.0.1", port=self.port, socket_timeout=5,
                             username=username, password=password)


def apply_lines(server: AclRedis, lines: list[str], key_prefix: str) -> dict[str, str]:
    """Run the document's lines with fresh passwords and `key_prefix`: the first (the admin
    user) on the connection that has not logged in, the rest as `admin`; then `ACL SAVE`, as the
    document says. Returns each user's password by name."""
    passwords = {"GATEWAY_PASSWORD": secrets.token_hex(12), "ADMIN_PASSWORD": secrets.token_hex(12)}
    users: dict[str, str] = {}
    commands = []
    for line in lines:
        words = line.split()
        assert words[:2] == ["ACL", "SETUSER"], line
        args = []
        for word in words[2:]:
            word = word.replace("<key_prefix>", key_prefix)
            for name, value in passwords.items():
                if word == f">{name}":
                    word = f">{value}"
                    users[words[2]] = value
            args.append(word)
        commands.append(args)
    assert commands[0][0] == "admin", lines
    first = server.client()
    first.execute_command("ACL", "SETUSER", *commands[0])
    first.close()
    admin = server.client("admin", users["admin"])
    for args in commands[1:]:
        admin.execute_command("ACL", "SETUSER", *args)
    admin.execute_command("ACL", "SAVE")
    admin.close()
    return users


def gateway_user(users: dict[str, str]) -> str:
    [name] = [u for u in users if u != "admin"]
    return name


# --- the check ---------------------------------------------------------------------------------


def snapshot(admin, key_prefix: str) -> dict[bytes, tuple[bytes, bytes, int]]:
    """Every key under the prefix: its type, its value (DUMP) and its TTL in ms."""
    out = {}
    for key in admin.scan_iter(match=f"{key_prefix}:*", count=1000):
        out[key] = (admin.type(key), admin.dump(key), admin.pttl(key))
    return out


def written(admin, timeout: float = 10.0) -> None:
    """Until Redis has written its append-only buffer to the file (with `appendfsync
    everysec` a write may wait for a background fsync): a SIGKILL loses nothing then."""
    deadline = time.monotonic() + timeout
    while int(admin.info("persistence")["aof_buffer_length"]) != 0:
        assert time.monotonic() < deadline, "the append-only buffer was not written"
        time.sleep(0.05)


def scripts_survive_a_kill(server, gateway, admin_client, key_prefix: str) -> None:
    """Run every script as the gateway user, SIGKILL `server` (a harness Service), start it again
    from its files (`admin_client()` connects anew), and compare every key of the prefix."""
    admin = admin_client()
    run_every_script(gateway, admin, prefix=f"{key_prefix}:acl-restart")
    gateway.close()
    written(admin)
    before = snapshot(admin, key_prefix)
    admin.close()
    # Keys of each kind the scripts write: counters of every algorithm, a record, a fence, a
    # cancellation marker (each from a transaction but the record's).
    prefix = f"{key_prefix}:acl-restart:".encode()
    kinds = {k.removeprefix(prefix).split(b":")[0] for k in before}
    assert kinds == {b"rl", b"idem", b"fence", b"cancel"}, sorted(before)
    assert all(ttl > 0 for _, _, ttl in before.values()), before
    log_before = len(server.proc.log_text())
    os.kill(server.proc.pid, signal.SIGKILL)
    assert server.proc.wait_exit(10) is not None
    server.stop()
    server.start()
    admin = admin_client()
    after = snapshot(admin, key_prefix)
    admin.close()
    replay_log = server.proc.log_text()[log_before:]
    lost = sorted(k.decode() for k in before if k not in after)
    assert not lost, f"lost at the restart: {lost}\n{replay_log[-3000:]}"
    assert set(after) == set(before)
    for key, (kind, value, ttl) in before.items():
        got = after[key]
        assert (got[0], got[1]) == (kind, value), (key, before[key], got)
        assert 0 < got[2] <= ttl, (key, ttl, got[2])
    assert "NOPERM" not in replay_log, replay_log[-3000:]


FORMS = documented_forms()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", list(FORMS))
def test_the_documented_acl_keeps_every_script_write_across_a_kill(tmp_path, form):
    server = AclRedis(tmp_path / "redis").start()
    try:
        key_prefix = "cg:acl"
        users = apply_lines(server, FORMS[form], key_prefix)
        name = gateway_user(users)
        gateway = server.client(name, users[name])
        scripts_survive_a_kill(server, gateway, lambda: server.client("admin", users["admin"]),
                               key_prefix)
        # The users came back from the ACL file as they were.
        admin = server.client("admin", users["admin"])
        assert admin.acl_getuser(name)["enabled"] is True
        assert admin.acl_getuser("default")["enabled"] is (name == "default")
        admin.close()
        if name != "default":
            # default is switched off: a connection that does not log in runs nothing, and no
            # password logs in as it.
            with pytest.raises(redispy.exceptions.AuthenticationError):
                server.client().ping()
            with pytest.raises(redispy.exceptions.AuthenticationError):
                server.client("default", "").ping()
    finally:
        server.stop()


def test_without_the_replayed_rights_the_restart_loses_the_writes(tmp_path):
    """The check finds what it is for: security.md's cg-gateway form with `default reset` (no
    rights, as redis.yaml had it) loses every transaction's keys at the restart."""
    lines = FORMS["security.md, the gateway as cg-gateway"]
    broken = [("ACL SETUSER default reset" if line.startswith("ACL SETUSER default ") else line)
              for line in lines]
    assert broken != lines
    server = AclRedis(tmp_path / "redis").start()
    try:
        users = apply_lines(server, broken, "cg:acl")
        gateway = server.client("cg-gateway", users["cg-gateway"])
        with pytest.raises(AssertionError, match="lost at the restart"):
            scripts_survive_a_kill(server, gateway,
                                   lambda: server.client("admin", users["admin"]), "cg:acl")
        assert "NOPERM" in server.proc.log_text()
    finally:
        server.stop()
