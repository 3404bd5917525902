"""Start real processes on free loopback ports and stop them by their own pid.

Every process gets a free port, a log file, a start-up deadline and is stopped (SIGTERM, then
SIGKILL) by the pid we started, never by name.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]

# Every Proc that has not been stopped yet, by pid; `stop_all()` is the safety net at exit.
_RUNNING: dict[int, "Proc"] = {}
_PR_SET_PDEATHSIG = 1


class PrerequisiteMissing(RuntimeError):
    """A binary the tests need is not installed; the message names the command that fixes it."""


def require_binary(name: str, fix: str = "make deps") -> str:
    path = shutil.which(name)
    if path is None:
        raise PrerequisiteMissing(f"`{name}` is not installed; run `{fix}`")
    return path


# Where free_port looks first: the ports outside the kernel's ephemeral range, which no
# outgoing connection is ever given. A port from that range (what binding port 0 hands out) may
# become some connection's local port between its choice and the process's bind, and the
# process then fails with "Address already in use" though nothing listens there. And a port
# is handed out once per run: binding port 0 hands out again a port given earlier but not bound
# yet (a Redis Cluster's twelve ports held a repeat in 7 of 2,000 draws on a test machine).
_LOWEST_PORT = 10000
_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nothing is bound to, outside the ephemeral range where the machine
    leaves room for it, and not handed out before by this process. Where it leaves none
    (a range that spans every port), the kernel's choice."""
    low, high = _ephemeral_range()
    spans = [(a, b) for a, b in ((_LOWEST_PORT, low), (high + 1, 65536)) if b > a]
    room = sum(b - a for a, b in spans)
    for _ in range(200 if room else 0):
        n = secrets.randbelow(room)
        for a, b in spans:
            if n < b - a:
                port = a + n
                break
            n -= b - a
        if port not in _HANDED_OUT and _bindable(port):
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve_dead_port() -> tuple[socket.socket, int]:
    """A loopback port that refuses connections for as long as the socket is kept open.

    The socket is bound but never listens: connecting gets RST at once, and no other process
    can take the port in the meantime (a merely "free" port could be reused by anyone).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


def connectable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _listening() -> list[tuple[str, str]]:
    """Every listening socket of the machine, as (its local address in /proc/net/tcp{,6}'s hex
    `ADDR:PORT`, its inode)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A":
                found.append((f[1], f[9]))
    return found


def _listener_inodes(port: int) -> set[str]:
    """The socket inodes listening on `port` (any address)."""
    return {inode for address, inode in _listening() if int(address.rsplit(":", 1)[1], 16) == port}


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (through /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return out


def _socket_inodes(pid: int):
    """The inodes of every socket `pid` (or a process it started) holds open."""
    for p in _tree(pid):
        try:
            fds = list(Path(f"/proc/{p}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                yield link[8:-1]


def listens(pid: int, port: int) -> bool:
    """Whether `pid` (or a process it started) holds a listening socket on `port`: a port
    another process took between its choice and the start answers connections too."""
    inodes = _listener_inodes(port)
    return any(inode in inodes for inode in _socket_inodes(pid))


def _socket_address(hex_address: str) -> str:
    """`/proc/net/tcp{,6}`'s `ADDR:PORT` (hex, the address in host byte order) as text."""
    addr, port = hex_address.rsplit(":", 1)
    raw = bytes.fromhex(addr)
    # Each 32-bit word is stored in the host's (little-endian) byte order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return f"{socket.inet_ntop(family, raw)}:{int(port, 16)}"


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") \
        or host.startswith("::ffff:127.")


def listen_addresses(pid: int) -> list[str]:
    """Every address `pid` (or a process it started) listens on, as `host:port`."""
    by_inode = {inode: _socket_address(address) for address, inode in _listening()}
    return sorted({by_inode[inode] for inode in _socket_inodes(pid) if inode in by_inode})


def beyond_loopback(pid: int) -> list[str]:
    """The addresses outside loopback that `pid`'s process tree listens on: nothing the
    project starts may listen there (a process that did so did not take its configuration)."""
    return [a for a in listen_addresses(pid) if not _is_loopback(a)]


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Until `port` takes connections, and with `proc`, until that process is the one that
    listens there (it may have failed to bind a port another process holds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before listening")
        if connectable(port) and (proc is None or listens(proc.pid, port)):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout}s"
                       + (f" (process {proc.args!r})" if proc is not None else ""))


def wait_http(url: str, timeout: float, proc: "Proc | None" = None, expect: int | None = None) -> int:
    """Poll `url` until it answers (with `expect`, if given); returns the status code."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                last = resp.status
        except urllib.error.HTTPError as e:
            last = e.code
        except OSError as e:
            last = e
        if isinstance(last, int) and (expect is None or last == expect):
            return last
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer {expect or 'at all'} within {timeout}s (last: {last!r})")


def _die_with_parent() -> None:
    """Child side of Popen: get SIGTERM if the test runner dies, so nothing outlives it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def stop_all() -> list[str]:
    """Stop every Proc still running (by pid); returns their names, so callers can complain."""
    leftovers = [f"{p.name} (pid {p.pid})" for p in list(_RUNNING.values())]
    for proc in list(_RUNNING.values()):
        proc.stop()
    return leftovers


class Proc:
    """One child process with its own log file; `stop()` signals exactly its pid.

    The child runs in its own session (a Ctrl-C in the terminal reaches only the harness) and
    gets SIGTERM if the thread that started it dies, so a killed test run leaves nothing behind.
    """

    def __init__(self, name: str, argv: list[str], workdir: Path, env: dict | None = None):
        self.name = name
        self.argv = argv
        # Absolute: the child runs in it, so a path relative to the caller's directory would
        # name another file there (webdis then starts with its built-in defaults).
        workdir = Path(workdir).resolve()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.pid = self.popen.pid
        _RUNNING[self.pid] = self

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code, or None if the process is still running after `timeout` seconds."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 5.0) -> None:
        _RUNNING.pop(self.pid, None)
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.popen.wait(timeout=timeout)
        if not self._log.closed:
            self._log.close()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def _refused_to_bind(log: str, port: int) -> bool:
    """Whether a process's log says it could not bind 127.0.0.1:`port`: a line with the
    system's "Address already in use" that names that address (Redis, Envoy) or none (webdis,
    which listens on one port only). A line naming another address (a cluster node's bus
    port) is not about this one."""
    return any("Address already in use" in line
               and (f"127.0.0.1:{port}" in line or "127.0.0.1:" not in line)
               for line in log.splitlines())


class NotConfigured(RuntimeError):
    """A process started without the configuration it was handed (it listens beyond loopback,
    or says it could not read its configuration): it is stopped, never used."""


class PortTaken(RuntimeError):
    """Another process listens on the port a service was to listen on."""


class Service:
    """A process of the harness: `proc` once started, stopped and checked by its own pid."""

    proc: Proc | None = None
    # Listened once: from then on others may know its port, which then never changes.
    started = False

    def launch(self, name: str, argv: list[str], workdir: Path, port: int,
               timeout: float) -> None:
        """Start `argv` as `self.proc` and wait until it listens on `port`; on failure it is
        stopped again and the error raised with the end of its log: PortTaken if another
        process listens there, or if its log says the port could not be bound (a socket bound
        there that does not listen: a connection's local port)."""
        self.proc = Proc(name, argv, workdir)
        try:
            wait_for_port(port, timeout, self.proc.popen)
            outside = beyond_loopback(self.proc.pid)
            if outside:
                raise NotConfigured(
                    f"{name} listens on {', '.join(outside)}, beyond loopback: it did not run "
                    "with the configuration it was given")
        except NotConfigured as e:
            self.proc.stop()
            tail = "\n".join(self.start_log().splitlines()[-15:])
            raise NotConfigured(f"{e}; the end of its log:\n{tail}") from e
        except Exception as e:
            self.proc.stop()
            log = self.start_log()
            if connectable(port) or _refused_to_bind(log, port):
                raise PortTaken(f"{name}: 127.0.0.1:{port} is taken by another process") from e
            tail = "\n".join(log.splitlines()[-15:])
            raise RuntimeError(f"{e}; the end of its log:\n{tail}") from e
        self.started = True

    def start_log(self) -> str:
        """What the process logged since this start (its output; more where it logs to a
        file of its own)."""
        return self.proc.log_text() if self.proc is not None else ""

    def launch_on_free_port(self, attempt: Callable[[], None], own_port: bool,
                            tries: int = 3) -> None:
        """`attempt()` launches the service on `self.port`. A port the service chose itself
        (`own_port`) that another process took between that choice and its first start (a
        connection's port from the ephemeral range) is chosen again, up to `tries` times."""
        for left in range(tries - 1, -1, -1):
            try:
                attempt()
                return
            except PortTaken:
                if self.started or not own_port or left == 0:
                    raise
                self.port = free_port()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()


# The commands the gateway user may run: EVAL/EVALSHA (all the filter sends through webdis)
# and every command the scripts in src/redis/scripts/ call (tests/test_scripts_acl.py keeps this list
# equal to them), and PEXPIREAT: Redis writes a script's PEXPIRE to its append-only file as
# PEXPIREAT and replays the file as this user (`default`), checking the commands of each
# transaction against its ACL (redis/redis#14541). webdis 0.1.9 sends only AUTH on connect
# (database 0: no SELECT, no PING), which every user may run.
GATEWAY_COMMANDS = (
    "eval", "evalsha",
    "time", "get", "set", "del", "exists", "type", "pttl", "pexpire", "incrby",
    "hmget", "hset", "zadd", "zcount", "zrange", "zrangebyscore", "zremrangebyscore", "zrem",
    "zscore", "pexpireat",
)
# The user webdis authenticates as: Debian's webdis 0.1.9 sends `AUTH <password>` (its
# `redis_auth` takes no user name), which is Redis's `default` user.
GATEWAY_USER = "default"
# The harness's own user (all commands, all keys): redis-py clients, liveness checks, test
# assertions.
ADMIN_USER = "admin"


def gateway_acl_rules(key_prefix: str) -> str:
    """The ACL rules of the gateway user, without the password: keys `<key_prefix>:*` only,
    no channels, only GATEWAY_COMMANDS."""
    return f"~{key_prefix}:* resetchannels -@all " + " ".join(f"+{c}" for c in GATEWAY_COMMANDS)


class RedisServer(Service):
    """A throwaway redis-server on a free port, no persistence unless asked, with two ACL users:

    - `default` (what webdis authenticates as, see GATEWAY_USER): password
      `gateway_password`, keys `<gateway_key_prefix>:*` only, only GATEWAY_COMMANDS; a script
      run by it runs with its permissions, so `KEYS`, `FLUSHALL`, `CONFIG` or a key outside
      the prefix fail with a permission error;
    - `admin`: password `admin_password`, everything (`client()`).

    The rule for a deployment is `~<key_prefix>:*` for the plugin's `redis.key_prefix`; the
    harness's prefix is `cg`, so every test's key_prefix must be `cg` or start with `cg:`
    (Stack.redis_section checks it).
    """

    def __init__(self, workdir: Path, port: int | None = None, gateway_key_prefix: str = "cg",
                 persistent: bool = False):
        self.workdir = Path(workdir).resolve()
        # Persistent: an append-only file in the workdir, so a stop and a start keep the data
        # (the demo's records and fences outlive `make demo-redis-down`); else none.
        self.persistent = persistent
        self.own_port = port is None
        self.port = port or free_port()
        self.gateway_key_prefix = gateway_key_prefix
        self.gateway_password = secrets.token_hex(16)
        self.admin_password = secrets.token_hex(16)
        self.acl_path = self.workdir / "users.acl"
        # More for a subclass (a Redis Cluster node): rules added to the gateway user's, and
        # config lines written to a file of their own (0600: it may hold a password).
        self.gateway_extra_rules = ""
        self.config_lines: list[str] = []

    def acl_file(self) -> str:
        """The `--aclfile` contents (passwords stored as SHA-256, never in clear)."""
        def sha(p: str) -> str:
            return "#" + hashlib.sha256(p.encode()).hexdigest()

        extra = f" {self.gateway_extra_rules}" if self.gateway_extra_rules else ""
        return (f"user {GATEWAY_USER} reset on {sha(self.gateway_password)} "
                f"{gateway_acl_rules(self.gateway_key_prefix)}{extra}\n"
                f"user {ADMIN_USER} reset on {sha(self.admin_password)} ~* &* +@all\n")

    def start(self, timeout: float = 10.0) -> "RedisServer":
        """Start (or restart, on the same port) the server and wait until it listens."""
        binary = require_binary("redis-server")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.acl_path.write_text(self.acl_file())
        self.acl_path.chmod(0o600)
        conf: list[str] = []
        if self.config_lines:
            conf_path = self.workdir / "redis.conf"
            conf_path.write_text("\n".join(self.config_lines) + "\n")
            conf_path.chmod(0o600)
            conf = [str(conf_path.resolve())]  # redis-server wants the file first
        self.launch_on_free_port(lambda: self.launch(
            f"redis-{self.port}",
            [binary, *conf, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.persistent else "no", "--daemonize", "no", "--dir", str(self.workdir.resolve()),
             "--aclfile", str(self.acl_path.resolve())],
            self.workdir, self.port, timeout), self.own_port)
        return self

    def client(self):
        """redis-py as the admin user (everything)."""
        import redis  # installed into .venv by `make deps`

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5,
                           username=ADMIN_USER, password=self.admin_password)

    def gateway_client(self):
        """redis-py as the gateway user, with exactly the permissions webdis has."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5,
                           username=GATEWAY_USER, password=self.gateway_password)
