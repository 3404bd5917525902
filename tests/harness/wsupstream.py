"""A WebSocket service: echoes every message and records every session.

Each session is recorded with its path, the `x-fencing-token` and `x-idempotency-fingerprint`
it was opened with, and its open and close times (`time.time()`). Plain HTTP
`GET /__ws/sessions` answers the record as JSON; `GET /__ws/reset` clears it.

A text message `close-abruptly` makes the server drop the TCP connection without a close
handshake (the stream is reset, as when the service dies mid-session).

Run standalone: `python tests/harness/wsupstream.py --port 0` (the first line on stdout names
the address). Import `WsUpstream` to run it as a child process that a test stops by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
import urllib.request
from http import HTTPStatus
from pathlib import Path

RECORDED_HEADERS = ("x-fencing-token", "x-idempotency-fingerprint", "x-tenant-id",
                    "idempotency-key")
ADMIN_PREFIX = "/__ws/"


async def serve(port: int) -> None:
    from websockets.asyncio.server import serve as ws_serve

    sessions: list[dict] = []
    ids = itertools.count(1)

    def admin(connection, request):
        if not request.path.startswith(ADMIN_PREFIX):
            return None  # a WebSocket handshake: go on
        if request.path == ADMIN_PREFIX + "sessions":
            return connection.respond(HTTPStatus.OK, json.dumps(sessions) + "\n")
        if request.path == ADMIN_PREFIX + "reset":
            sessions.clear()
            return connection.respond(HTTPStatus.OK, "{}\n")
        return connection.respond(HTTPStatus.NOT_FOUND, "no such admin endpoint\n")

    async def session(ws) -> None:
        headers = ws.request.headers
        entry = {"id": next(ids), "path": ws.request.path, "opened": time.time(), "closed": None,
                 "messages": 0,
                 "headers": {h: headers[h] for h in RECORDED_HEADERS if h in headers}}
        sessions.append(entry)
        try:
            async for message in ws:
                entry["messages"] += 1
                if message == "close-abruptly":
                    ws.transport.abort()  # TCP RST, no close frame
                    break
                await ws.send(message)
        except Exception:  # a reset connection ends the session like a close
            pass
        finally:
            entry["closed"] = time.time()

    async with ws_serve(session, "127.0.0.1", port, process_request=admin,
                        ping_interval=None) as server:
        bound = next(iter(server.sockets)).getsockname()[1]
        print(f"wsupstream listening on ws://127.0.0.1:{bound}", flush=True)
        await asyncio.Future()


class WsUpstream:
    """The WebSocket service as a child process on a kernel-chosen port; stopped by its pid."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir).resolve()
        self.port: int | None = None
        self.proc = None

    def start(self, timeout: float = 10.0) -> "WsUpstream":
        from .child import start_child

        self.proc, self.port = start_child("wsupstream", __file__, self.workdir,
                                           "wsupstream listening on ", 0, timeout)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def sessions(self) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}{ADMIN_PREFIX}sessions"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())

    def sessions_on(self, path: str) -> list[dict]:
        return [s for s in self.sessions() if s["path"] == path]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    try:
        asyncio.run(serve(parser.parse_args(argv).port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
