"""A loopback TCP proxy whose network a chaos run controls: passed, delayed or cut.

The Envoys of a chaos target reach webdis through it (their `redis_gateway` cluster points at
its ports), so a run can make the gateway's network slow or absent without touching webdis or
Redis. It runs as a child process of its own (`python -m chaos.netproxy`), started and stopped
by pid like every other process of the harness, and answers commands on a control port.

Each route is one listening port forwarded to one upstream port. Every connection accepted on
it gets its own connection to the upstream; bytes are copied both ways, in order, as they come.
The modes apply to every route and to the connections already open:

- `pass`: bytes go through at once.
- `delay`: every piece of data (and the end of a stream) is held `delay_ms` (plus up to
  `jitter_ms`, drawn per piece) after it arrived, in order: the latency of a slow network.
- `cut` with `how: reset`: every open connection is reset (RST, both sides) and every new one
  is reset as soon as it is accepted: an unreachable host.
- `cut` with `how: hold`: nothing passes either way; what is sent meanwhile is kept and
  delivered once the cut heals, in order, with the ends of streams that came meanwhile: a
  partition, after which TCP retransmits. A request the filter gave up on during the cut can
  so reach webdis (and Redis) late. A new connection is accepted at once, its connection to
  the upstream made once the cut heals.

The control protocol is one JSON object per line on the control port, answered by one JSON
object per line: `{"mode": "pass"}`, `{"mode": "delay", "delay_ms": 300, "jitter_ms": 20}`,
`{"mode": "cut", "how": "reset"}`, `{"stats": true}`. Every answer carries the mode in force
and the counters (`accepted`, `open`, `refused` upstream connections, `reset` connections,
bytes each way, bytes `held` right now).

`NetProxy` is the harness side: a Service that starts the process on free ports (stopped by
its pid) and sends the commands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct
import sys
import time
from collections import deque
from pathlib import Path

from chaos import ROOT  # also puts tests/ on sys.path
from harness.proc import Proc, Service, free_port, wait_for_port

_CHUNK = 65536


class _State:
    """The mode in force and the counters, shared by every connection of the process."""

    def __init__(self) -> None:
        self.mode = "pass"
        self.how = ""
        self.delay_ms = 0.0
        self.jitter_ms = 0.0
        self.rng = random.Random()
        # Set whenever the mode changes: waiting pumps look again.
        self.changed = asyncio.Event()
        self.links: set[_Link] = set()
        self.counters = {"accepted": 0, "refused": 0, "reset": 0, "bytes_up": 0,
                         "bytes_down": 0}

    def held(self) -> int:
        return sum(link.held() for link in self.links)

    def describe(self) -> dict:
        return {"mode": self.mode, "how": self.how, "delay_ms": self.delay_ms,
                "jitter_ms": self.jitter_ms, "open": len(self.links), "held": self.held(),
                **self.counters}

    def set_mode(self, command: dict) -> None:
        mode = command.get("mode")
        if mode == "pass":
            self.mode, self.how, self.delay_ms, self.jitter_ms = "pass", "", 0.0, 0.0
        elif mode == "delay":
            delay, jitter = float(command.get("delay_ms", 0)), float(command.get("jitter_ms", 0))
            if delay < 0 or jitter < 0:
                raise ValueError("delay_ms and jitter_ms must not be negative")
            self.mode, self.how, self.delay_ms, self.jitter_ms = "delay", "", delay, jitter
        elif mode == "cut":
            how = command.get("how", "reset")
            if how not in ("reset", "hold"):
                raise ValueError(f"cut how must be reset or hold, not {how!r}")
            self.mode, self.how, self.delay_ms, self.jitter_ms = "cut", how, 0.0, 0.0
            if how == "reset":
                for link in list(self.links):
                    link.reset()
        else:
            raise ValueError(f"unknown mode {mode!r} (pass, delay, cut)")
        self.changed.set()
        self.changed = asyncio.Event()

    @property
    def holding(self) -> bool:
        return self.mode == "cut" and self.how == "hold"


def _abort(writer: asyncio.StreamWriter | None) -> None:
    """Close a connection with RST (SO_LINGER 0), not FIN: the peer sees a reset."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class _Pump:
    """One direction of a link: pieces read (with their arrival time) wait here until the mode
    lets them go; an empty piece is the end of the stream."""

    def __init__(self, state: _State, counter: str) -> None:
        self.state = state
        self.counter = counter
        self.queue: deque[tuple[float, bytes]] = deque()
        self.arrived = asyncio.Event()
        self.last_due = 0.0

    def held(self) -> int:
        return sum(len(data) for _, data in self.queue)

    def put(self, data: bytes) -> None:
        self.queue.append((time.monotonic(), data))
        self.arrived.set()

    async def read_into(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                data = await reader.read(_CHUNK)
            except (ConnectionError, OSError):
                data = b""
            self.put(data)
            if not data:
                return

    async def write_from(self, writer: asyncio.StreamWriter) -> None:
        """Deliver the pieces to `writer` as the mode allows, until the end of the stream."""
        while True:
            while not self.queue:
                self.arrived.clear()
                await self.arrived.wait()
            arrival, data = self.queue[0]
            state = self.state
            if state.holding:
                await state.changed.wait()
                continue
            if state.mode == "delay":
                jitter = state.rng.uniform(0, state.jitter_ms) if state.jitter_ms else 0.0
                # In order: a piece never overtakes the one before it.
                due = max(arrival + (state.delay_ms + jitter) / 1000, self.last_due)
                wait = due - time.monotonic()
                if wait > 0:
                    changed = state.changed
                    try:
                        await asyncio.wait_for(changed.wait(), wait)
                        continue  # the mode changed while it waited: look again
                    except asyncio.TimeoutError:
                        pass
                self.last_due = due
            self.queue.popleft()
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            state.counters[self.counter] += len(data)
            await writer.drain()


class _Link:
    """One accepted connection and its connection to the upstream."""

    def __init__(self, state: _State, client_reader, client_writer, upstream_port: int) -> None:
        self.state = state
        self.client_reader, self.client_writer = client_reader, client_writer
        self.upstream_port = upstream_port
        self.upstream_writer: asyncio.StreamWriter | None = None
        self.up = _Pump(state, "bytes_up")
        self.down = _Pump(state, "bytes_down")
        self.closed = False
        self.tasks: list[asyncio.Future] = []

    def held(self) -> int:
        return self.up.held() + self.down.held()

    def reset(self) -> None:
        """Reset both sides (RST) and stop copying."""
        if not self.closed:
            self.closed = True
            self.state.counters["reset"] += 1
            _abort(self.client_writer)
            _abort(self.upstream_writer)
            for task in self.tasks:
                task.cancel()

    async def _connect(self) -> None:
        while self.state.holding:
            await self.state.changed.wait()
        if self.closed:
            return
        reader, self.upstream_writer = await asyncio.open_connection("127.0.0.1",
                                                                     self.upstream_port)
        if self.closed:  # reset while it connected
            _abort(self.upstream_writer)
            return
        await asyncio.gather(self.up.write_from(self.upstream_writer),
                             self.down.read_into(reader))

    async def run(self) -> None:
        self.tasks = [asyncio.ensure_future(self.up.read_into(self.client_reader)),
                      asyncio.ensure_future(self._connect()),
                      asyncio.ensure_future(self.down.write_from(self.client_writer))]
        try:
            done, _ = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_EXCEPTION)
            errors = [t.exception() for t in done if not t.cancelled() and t.exception()]
            if errors:
                # The upstream refused, or a side was reset: the other side is reset too.
                if isinstance(errors[0], ConnectionRefusedError):
                    self.state.counters["refused"] += 1
                self.reset()
        finally:
            for task in self.tasks:
                task.cancel()
            for task in self.tasks:  # collect what they raised (no "never retrieved" noise)
                try:
                    await task
                except BaseException:
                    pass
            self.state.links.discard(self)
            if not self.closed:
                self.closed = True
                for writer in (self.client_writer, self.upstream_writer):
                    if writer is not None:
                        writer.close()


async def _serve(routes: list[tuple[int, int]], control_port: int) -> None:
    state = _State()

    def accept(upstream_port: int):
        async def handle(reader, writer) -> None:
            state.counters["accepted"] += 1
            if state.mode == "cut" and state.how == "reset":
                state.counters["reset"] += 1
                _abort(writer)
                return
            link = _Link(state, reader, writer, upstream_port)
            state.links.add(link)
            await link.run()
        return handle

    async def control(reader, writer) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                try:
                    command = json.loads(line)
                    if not isinstance(command, dict):
                        raise ValueError("a command is a JSON object")
                    if "mode" in command:
                        state.set_mode(command)
                    answer = {"ok": True, **state.describe()}
                except (ValueError, TypeError) as e:
                    answer = {"ok": False, "error": str(e), **state.describe()}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    servers = [await asyncio.start_server(accept(upstream), "127.0.0.1", listen,
                                          reuse_address=True)
               for listen, upstream in routes]
    servers.append(await asyncio.start_server(control, "127.0.0.1", control_port,
                                              reuse_address=True))
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", type=int, required=True, help="the control port")
    parser.add_argument("--route", action="append", required=True, metavar="LISTEN:UPSTREAM",
                        help="a loopback port and the loopback port it forwards to")
    args = parser.parse_args(argv)
    routes = []
    for route in args.route:
        listen, _, upstream = route.partition(":")
        routes.append((int(listen), int(upstream)))
    print(f"netproxy: control 127.0.0.1:{args.control}, routes {routes}", flush=True)
    try:
        asyncio.run(_serve(routes, args.control))
    except KeyboardInterrupt:
        pass
    return 0


# --- the harness side ------------------------------------------------------------------------


class NetProxy(Service):
    """The proxy process in front of `upstream_ports` (one listening port each, `ports`), and
    its control port. `start()` again after `stop()` reuses the same ports."""

    def __init__(self, workdir: Path, upstream_ports: list[int]):
        self.workdir = Path(workdir).resolve()
        self.upstream_ports = list(upstream_ports)
        self.ports = [free_port() for _ in self.upstream_ports]
        self.control_port = free_port()

    def start(self, timeout: float = 10.0) -> "NetProxy":
        argv = [sys.executable, "-m", "chaos.netproxy", "--control", str(self.control_port)]
        for listen, upstream in zip(self.ports, self.upstream_ports):
            argv += ["--route", f"{listen}:{upstream}"]
        name = f"netproxy-{self.control_port}"
        # The repository on the path: the process runs this module (`-m chaos.netproxy`).
        self.proc = Proc(name, argv, self.workdir, env={"PYTHONPATH": str(ROOT)})
        try:
            for port in [self.control_port, *self.ports]:
                wait_for_port(port, timeout, self.proc.popen)
        except Exception as e:
            self.proc.stop()
            raise RuntimeError(f"{name} did not start: {e}\n{self.proc.log_tail(15)}") from e
        self.started = True
        return self

    def command(self, command: dict, timeout: float = 5.0) -> dict:
        """Send one command; its answer (the mode in force and the counters)."""
        with socket.create_connection(("127.0.0.1", self.control_port), timeout=timeout) as s:
            s.sendall(json.dumps(command).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                piece = s.recv(65536)
                if not piece:
                    break
                buf += piece
        answer = json.loads(buf)
        if not answer.get("ok"):
            raise ValueError(f"netproxy refused {command}: {answer.get('error')}")
        return answer

    def passing(self) -> dict:
        return self.command({"mode": "pass"})

    def delay(self, delay_ms: float, jitter_ms: float = 0.0) -> dict:
        return self.command({"mode": "delay", "delay_ms": delay_ms, "jitter_ms": jitter_ms})

    def cut(self, how: str = "reset") -> dict:
        return self.command({"mode": "cut", "how": how})

    def stats(self) -> dict:
        return self.command({"stats": True})


if __name__ == "__main__":
    sys.exit(main())
