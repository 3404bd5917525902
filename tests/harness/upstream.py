"""The protected service: an HTTP/1.1 server that counts what it executed.

Tests assert on its side effects ("did the second POST /orders reach the service?"), so every
request it serves is recorded; the admin endpoints under /__upstream/ are not.

Run standalone: `python tests/harness/upstream.py --port 8080` (port 0 picks a free one; the
first line on stdout names the address). Import `Upstream` to run it as a child process that a
test stops by pid.

Request headers that steer the answer:
- `x-upstream-delay-ms: N`   sleep N ms before answering
- `x-upstream-status: S`     answer with status S
- `x-upstream-header-<name>: v` add response header `<name>: v`
- `x-upstream-body-bytes: N`  answer with `big_body(N)` (N bytes of text) instead of the JSON
- `x-upstream-chunked: 1`     send that body chunked, without Content-Length
- `x-upstream-reset-after-bytes: M`  send the headers (Content-Length N) and M bytes of the
  body, then reset the connection (TCP RST): a response that never completes
- `x-upstream-sse-events: N`  answer `text/event-stream` (chunked): N events (`data: <i>`),
  one every `x-upstream-sse-interval-ms` (default 300), then end; N < 0: until the client
  leaves. The ledger entry counts `events_sent` and the time of the last (`last_event`).
- `x-upstream-json: <JSON text>`  answer this JSON document (`application/json`) instead of
  the usual one
- `x-upstream-json-raw: <text>`  answer this text as it is, as `application/json` (repeated
  members, numbers spelled `5.0` or `1e30` survive, where `x-upstream-json` re-serialises)
- `x-upstream-json-filler: N`  with either of those (an object), append a member `"x"` holding
  N objects `{"":0}` (7 bytes each) before its closing brace: a big body of many small values
- `x-upstream-content-encoding: gzip`  gzip the JSON body and say so (`Content-Encoding`)
- `x-upstream-sse-data: <text>`  with `x-upstream-sse-events`, every event's data is this text
- `x-upstream-sse-body: <base64>`  answer `text/event-stream` (chunked) with exactly these bytes,
  one HTTP chunk per piece: cut at the byte offsets of `x-upstream-sse-cuts: 10,25` (none: one
  piece), `x-upstream-sse-interval-ms` (default 300) between pieces; with
  `x-upstream-sse-end: reset` the connection is reset (TCP RST) after the last piece instead
  of ending the stream. The ledger entry counts `pieces_sent` and has the request's
  `accept_encoding` (`None` without one).
- `x-upstream-pause-after-bytes: M`, `x-upstream-pause-ms: T`  send the first M bytes of the
  body (big or JSON), flush, wait T ms, then the rest: many responses can be held mid-body at once

Every ledger entry has `started` (when the request reached the service, after its body) and
`time` (when it was recorded, after the delay, just before the answer goes out): the interval
the service was busy with it. `max_overlap(entries)` is the most that ran at once; requests
being served right now are in the stats' `in_flight`.
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import itertools
import json
import socket
import struct
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

RECORDED_HEADERS = ("x-tenant-id", "x-user-id", "x-fencing-token", "x-idempotency-fingerprint",
                    "idempotency-key")
ADMIN_PREFIX = "/__upstream/"
BODY_PATTERN = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_\n"


@functools.lru_cache(maxsize=8)
def big_body(n: int) -> bytes:
    """The body of `x-upstream-body-bytes: n`: n bytes of a 64-byte text pattern (one copy per
    size, however many requests are sending it at once)."""
    return (BODY_PATTERN * (n // len(BODY_PATTERN) + 1))[:n]


@functools.lru_cache(maxsize=8)
def json_body(text: bytes, filler: int, gzipped: bool) -> bytes:
    """`text` (a JSON object) with `filler` objects `{"":0}` in a member "x" appended, gzipped
    if asked (one copy per variant, however many requests are sending it at once)."""
    if filler:
        end = text.rstrip()[:-1]  # the object without its closing brace
        items = b'{"":0},' * filler
        text = end + (b"," if end.strip() != b"{" else b"") + b'"x":[' + items[:-1] + b"]}"
    if gzipped:
        import gzip

        text = gzip.compress(text)
    return text


def max_overlap(entries: list[dict]) -> int:
    """The most requests of `entries` (ledger entries) the service was busy with at once."""
    # At equal times an end comes before a start: back to back is not at once.
    events = sorted([(e["started"], 1) for e in entries] + [(e["time"], -1) for e in entries])
    most = running = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


class Ledger:
    """Everything served, guarded by one lock (the server is threaded)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_path: dict[str, int] = {}
        self.requests: list[dict] = []
        self.in_flight: dict[int, dict] = {}  # by ticket: requests being served now
        self._tickets = itertools.count(1)

    def begin(self, method: str, path: str) -> tuple[int, float]:
        """A request reached the service: (its ticket for `record`, its start time)."""
        started = time.time()
        with self.lock:
            ticket = next(self._tickets)
            self.in_flight[ticket] = {"method": method, "path": path, "started": started}
        return ticket, started

    def record(self, entry: dict, ticket: int | None = None) -> int:
        key = f"{entry['method']} {entry['path']}"
        with self.lock:
            self.in_flight.pop(ticket, None)
            self.by_path[key] = self.by_path.get(key, 0) + 1
            entry["served"] = self.by_path[key]
            self.requests.append(entry)
            return self.by_path[key]

    def snapshot(self) -> dict:
        with self.lock:
            return {"total": len(self.requests), "by_path": dict(self.by_path),
                    "requests": [dict(r) for r in self.requests],
                    "in_flight": [dict(r) for r in self.in_flight.values()]}

    def reset(self) -> None:
        with self.lock:
            self.by_path.clear()
            self.requests.clear()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "cg-upstream"
    ledger: Ledger  # set on the subclass made by `serve`

    def log_message(self, fmt: str, *args) -> None:  # quiet: the ledger is the log
        pass

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, payload: dict, extra: dict | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self) -> None:
        body = self._read_body()
        path = self.path.split("?", 1)[0]
        if path.startswith(ADMIN_PREFIX):
            return self._admin(path)
        ticket, started = self.ledger.begin(self.command, path)
        delay_ms = int(self.headers.get("x-upstream-delay-ms") or 0)
        if delay_ms > 0:
            time.sleep(delay_ms / 1000)
        entry = {
            "method": self.command,
            "path": path,
            "headers": {h: self.headers.get(h) for h in RECORDED_HEADERS if h in self.headers},
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "body_len": len(body),
            "started": started,
            "time": time.time(),
        }
        served = self.ledger.record(entry, ticket)
        status = int(self.headers.get("x-upstream-status") or 200)
        extra = {name[len("x-upstream-header-"):]: value for name, value in self.headers.items()
                 if name.lower().startswith("x-upstream-header-")}
        scripted = self.headers.get("x-upstream-sse-body")
        if scripted is not None:
            interval = int(self.headers.get("x-upstream-sse-interval-ms") or 300) / 1000
            return self._send_stream(status, base64.b64decode(scripted), interval, entry, extra)
        events = self.headers.get("x-upstream-sse-events")
        if events is not None:
            interval = int(self.headers.get("x-upstream-sse-interval-ms") or 300) / 1000
            return self._send_events(status, int(events), interval, entry, extra)
        size = self.headers.get("x-upstream-body-bytes")
        if size is not None:
            return self._send_big(status, int(size), extra)
        raw = self.headers.get("x-upstream-json-raw")
        payload = self.headers.get("x-upstream-json")
        if raw is not None or payload is not None:
            text = raw.encode() if raw is not None else json.dumps(json.loads(payload)).encode()
            return self._send_json(status, text, extra)
        self._send(status, {"served": served, "method": self.command, "path": path}, extra)

    def _send_json(self, status: int, text: bytes, extra: dict) -> None:
        filler = int(self.headers.get("x-upstream-json-filler") or 0)
        gzipped = self.headers.get("x-upstream-content-encoding") == "gzip"
        text = json_body(text, filler, gzipped)
        extra = dict(extra)
        if gzipped:
            extra["Content-Encoding"] = "gzip"
        self._send_big(status, len(text), extra, body=text, content_type="application/json")

    def _send_big(self, status: int, size: int, extra: dict, body: bytes | None = None,
                  content_type: str = "text/plain") -> None:
        body = big_body(size) if body is None else body
        chunked = self.headers.get("x-upstream-chunked") == "1"
        reset_after = self.headers.get("x-upstream-reset-after-bytes")
        pause_after = int(self.headers.get("x-upstream-pause-after-bytes") or -1)
        pause_s = int(self.headers.get("x-upstream-pause-ms") or 0) / 1000
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(len(body)))
        for name, value in extra.items():
            self.send_header(name, value)
        self.end_headers()
        if reset_after is not None:
            body = body[:int(reset_after)]
        pieces = [(0, len(body))]
        if 0 <= pause_after < len(body):
            pieces = [(0, pause_after), (pause_after, len(body))]
        try:
            for n, (start, end) in enumerate(pieces):
                if n:
                    self.wfile.flush()
                    time.sleep(pause_s)
                for i in range(start, end, 16384):
                    piece = body[i:min(i + 16384, end)]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        except OSError:  # the client (or Envoy) left
            self.close_connection = True
            return
        if reset_after is not None:
            self.wfile.flush()
            time.sleep(0.2)  # let the bytes go out before the reset
            # SO_LINGER 0: close() sends a RST instead of a FIN.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _send_events(self, status: int, count: int, interval: float, entry: dict,
                     extra: dict) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        for name, value in extra.items():
            self.send_header(name, value)
        self.end_headers()
        i = 0
        try:
            while count < 0 or i < count:
                if i:
                    time.sleep(interval)
                data = self.headers.get("x-upstream-sse-data")
                event = b"data: %s\n\n" % (data.encode() if data is not None else b"%d" % i)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                i += 1
                with self.ledger.lock:
                    entry["events_sent"] = i
                    entry["last_event"] = time.time()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the client (or Envoy) left
            self.close_connection = True

    def _send_stream(self, status: int, body: bytes, interval: float, entry: dict,
                     extra: dict) -> None:
        """`body` as an event stream, in the pieces `x-upstream-sse-cuts` makes of it."""
        cuts = [int(c) for c in (self.headers.get("x-upstream-sse-cuts") or "").split(",") if c]
        bounds = [0, *sorted(c for c in cuts if 0 < c < len(body)), len(body)]
        with self.ledger.lock:
            entry["accept_encoding"] = self.headers.get("accept-encoding")
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        for name, value in extra.items():
            self.send_header(name, value)
        self.end_headers()
        try:
            for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
                if n:
                    time.sleep(interval)
                piece = body[start:end]
                if piece:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
                with self.ledger.lock:
                    entry["pieces_sent"] = n + 1
            if self.headers.get("x-upstream-sse-end") == "reset":
                time.sleep(0.2)  # let the bytes go out before the reset
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()
                return
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the client (or Envoy) left
            self.close_connection = True

    def _admin(self, path: str) -> None:
        if path == ADMIN_PREFIX + "stats" and self.command == "GET":
            return self._send(200, self.ledger.snapshot())
        if path == ADMIN_PREFIX + "reset" and self.command == "POST":
            self.ledger.reset()
            return self._send(200, {"reset": True})
        self._send(404, {"error": f"no admin endpoint {self.command} {path}"})

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _handle


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024


def serve(port: int) -> None:
    handler = type("BoundHandler", (Handler,), {"ledger": Ledger()})
    server = Server(("127.0.0.1", port), handler)
    print(f"upstream listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


class Upstream:
    """The upstream as a child process on a kernel-chosen port; stopped by its pid."""

    def __init__(self, workdir: Path, port: int = 0):
        self.workdir = Path(workdir).resolve()
        self.requested_port = port
        self.port: int | None = None
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> "Upstream":
        from .child import start_child

        self.proc, self.port = start_child(f"upstream-{self.requested_port or 'any'}", __file__, self.workdir,
                                           "upstream listening on ", self.requested_port, timeout)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def _admin(self, method: str, name: str) -> dict:
        req = urllib.request.Request(f"{self.url}{ADMIN_PREFIX}{name}", method=method,
                                     data=b"" if method == "POST" else None)
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict:
        """`{"total": n, "by_path": {"POST /orders": 3}, "requests": [...]}`"""
        return self._admin("GET", "stats")

    def count(self, method: str, path: str) -> int:
        return self.stats()["by_path"].get(f"{method} {path}", 0)

    def requests(self) -> list[dict]:
        return self.stats()["requests"]

    def in_flight(self) -> list[dict]:
        """The requests the service is busy with now: `{"method", "path", "started"}`."""
        return self.stats()["in_flight"]

    def reset(self) -> None:
        self._admin("POST", "reset")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    serve(parser.parse_args(argv).port)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
