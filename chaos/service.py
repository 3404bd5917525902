"""The guarded service of the chaos run: an HTTP/1.1 server that records everything it does.

The checker (chaos/checker.py) judges the filter by what this service saw, so every request
that reaches it leaves one ledger entry with its timing: `begin` (the request, with its body,
has arrived) and `end` (the handler is done: written just before the response's headers, or,
for an event stream, before its last chunk or when the client was found gone). Envoy in front
of it is the only client; the workload names each request with `x-chaos-id`.

Routes (the chaos configuration, chaos/config.py, guards each with a policy):

- `GET /rl/<name>`: a rate-limited operation; answers 200 at once or after
  `x-chaos-delay-ms`. `/rl/cost` also answers `x-charge: <cost + x-chaos-charge-extra>`,
  the units the request really used (never below the cost it announced).
- `POST /idem/<variant>/<key>`: an idempotent operation. Each execution gets an id and the
  service's own count for (variant, tenant, key); it answers 201 with a JSON body naming the
  execution, or 503 when `x-chaos-fail: 1` asks for a retryable failure. The ledger keeps the
  status and body it answered, so the checker can compare every replay with it. The variant
  `stream` answers an event stream instead (`x-chaos-events` events, one every
  `x-chaos-interval-ms`).
- `POST /lease/<variant>/<resource>`: a lease-guarded operation. The service checks the
  fencing token as a real one must: a token not above the last one it accepted for
  (variant, tenant, resource) is refused (409, `{"stale": true}`, recorded as stale); an
  accepted one makes the request the resource's holder until its end. `GET
  /lease/stream/<resource>` holds the resource for an event stream.
- `GET /__chaos/ledger?from=N`: the ledger's entries from the N-th; `GET /__chaos/state`:
  the last accepted token per resource.

The same process serves gRPC (HTTP/2, grpcio, raw bytes in and out) on a port of its own, the
service `cg.test.Chaos` (Envoy routes every path under `/cg.test.` to it), into the same ledger
(routes `grpc/...`; `status` is the gRPC status code, `grpc: true`):

- `Limited` (unary): a rate-limited call, as `GET /rl/<name>` (`x-chaos-delay-ms`).
- `Create` (server streaming): an idempotent call, keyed by its `idempotency-key`: it sends
  `x-chaos-messages` messages (0 to 3), then ends with the status `x-chaos-code` (0 OK, 5
  NOT_FOUND, 14 UNAVAILABLE, which releases the record) and, for a status other than OK, the
  message `exec <n>`: a replay of it names the execution it replays. With no message and a
  status other than OK grpcio answers trailers-only.
- `Lease` (unary): a lease-guarded call on the resource `x-chaos-resource`, fencing tokens
  checked as for HTTP; a stale token ends the call with FAILED_PRECONDITION.

Every answer carries `x-chaos-service: 1` (a gRPC one in its trailers, which a trailers-only
answer has too), so a client tells the service's answers from the filter's and Envoy's own.
Run standalone: `python chaos/service.py --port 0`; stdout names the gRPC address, then the
HTTP address (the line `start_child` waits for).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import select
import socket
import threading
import time
import urllib.parse
import urllib.request
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc

BANNER = "chaos service listening on "
GRPC_BANNER = "chaos grpc service listening on "
FENCING_HEADER = "x-fencing-token"
FINGERPRINT_HEADER = "x-idempotency-fingerprint"
GRPC_SERVICE = "cg.test.Chaos"
# The gRPC status codes `Create` may be asked to end with: OK, NOT_FOUND (completes the
# record), UNAVAILABLE (a retryable code: releases it).
GRPC_CODES = (0, 5, 14)
GRPC_WORKERS = 64


class Ledger:
    """What the service did, guarded by one lock (the server is threaded)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: list[dict] = []
        self.executions: dict[tuple, int] = {}  # (variant, tenant, key) -> count
        self.accepted: dict[tuple, int] = {}  # (variant, tenant, resource) -> last token
        self.holders: dict[tuple, int] = {}  # (variant, tenant, resource) -> holders now
        self.in_flight: dict[tuple, int] = {}  # (route, tenant) -> requests now
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        with self.lock:
            return next(self._ids)

    def add(self, entry: dict) -> None:
        with self.lock:
            self.entries.append(entry)

    def fence(self, res_key: tuple, raw: str | None, entry: dict) -> tuple[bool, int]:
        """The service's own fencing check, as a real service makes it: a token (`raw`, the
        header's text) above the last one accepted for the resource is accepted and its request
        counted among the holders (`entry["holders"]`); anything else is stale. Returns (stale,
        the last token accepted before this one) and records the latter in the entry."""
        try:
            token = int(raw) if raw is not None else None
        except ValueError:
            token = None
        with self.lock:
            last = self.accepted.get(res_key, 0)
            stale = token is None or token <= last
            if not stale:
                self.accepted[res_key] = token
                holders = self.holders.get(res_key, 0) + 1
                self.holders[res_key] = holders
                entry["holders"] = holders
        entry["last_accepted"] = last
        return stale, last

    def since(self, start: int) -> list[dict]:
        with self.lock:
            return [dict(e) for e in self.entries[start:]]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "chaos-service"
    ledger: Ledger  # set on the subclass `serve` makes

    def log_message(self, fmt: str, *args) -> None:  # the ledger is the log
        pass

    # --- reading -------------------------------------------------------------------------

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _int_header(self, name: str, default: int = 0) -> int:
        try:
            return int(self.headers.get(name) or default)
        except ValueError:
            return default

    # --- writing -------------------------------------------------------------------------

    def _answer(self, status: int, payload: dict, extra: dict | None = None) -> bytes:
        body = json.dumps(payload, sort_keys=True).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("x-chaos-service", "1")
            for name, value in (extra or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # Envoy reset the request (its client left, or it was killed)
            self.close_connection = True
        return body

    def _gone(self, wait: float) -> bool:
        """Waits up to `wait` seconds; whether the connection was closed or reset meanwhile
        (Envoy sends nothing else on a connection whose response is being streamed)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], wait)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _stream(self, events: int, interval: float) -> tuple[int, bool, float]:
        """An event stream of `events` events: (events written, whether it ended normally,
        the time the handler was done: before the last chunk, or when the client was gone)."""
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("x-chaos-service", "1")
            self.end_headers()
            self.wfile.flush()
        except OSError:
            self.close_connection = True
            return 0, False, time.time()
        sent = 0
        for i in range(events):
            if i and self._gone(interval):
                self.close_connection = True
                return sent, False, time.time()
            event = b"data: %d\n\n" % i
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            except OSError:
                self.close_connection = True
                return sent, False, time.time()
            sent += 1
        end = time.time()
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True
            return sent, False, end
        return sent, True, end

    # --- routes --------------------------------------------------------------------------

    def _handle(self) -> None:
        body = self._body()
        url = urllib.parse.urlsplit(self.path)
        parts = [p for p in url.path.split("/") if p]
        if parts[:1] == ["__chaos"]:
            return self._admin(parts, urllib.parse.parse_qs(url.query))
        begin = time.time()
        entry = {
            "n": self.ledger.next_id(),
            "id": self.headers.get("x-chaos-id"),
            "method": self.command,
            "path": url.path,
            "tenant": self.headers.get("x-tenant-id"),
            "begin": begin,
        }
        try:
            if len(parts) == 2 and parts[0] == "rl":
                return self._rate_limited(entry, parts[1])
            if len(parts) == 3 and parts[0] == "idem":
                return self._idempotent(entry, parts[1], parts[2], body)
            if len(parts) == 3 and parts[0] == "lease":
                return self._leased(entry, parts[1], parts[2])
            entry.update(route="unknown", end=time.time(), status=404)
            self._answer(404, {"error": f"no route {url.path}"})
        finally:
            self.ledger.add(entry)

    def _delay(self) -> None:
        delay = self._int_header("x-chaos-delay-ms")
        if delay > 0:
            time.sleep(min(delay, 5000) / 1000)

    def _rate_limited(self, entry: dict, name: str) -> None:
        route = f"rl/{name}"
        key = (route, entry["tenant"])
        with self.ledger.lock:
            running = self.ledger.in_flight.get(key, 0) + 1
            self.ledger.in_flight[key] = running
        entry.update(route=route, running=running)
        try:
            self._delay()
        finally:
            with self.ledger.lock:
                self.ledger.in_flight[key] -= 1
            entry["end"] = time.time()
        extra = {}
        if name == "cost":
            cost = self._int_header("x-cost", 1)
            charge = cost + max(0, self._int_header("x-chaos-charge-extra"))
            entry.update(cost=cost, charge=charge)
            extra["x-charge"] = str(charge)
        entry["status"] = 200
        self._answer(200, {"route": route, "n": entry["n"]}, extra)

    def _idempotent(self, entry: dict, variant: str, key: str, body: bytes) -> None:
        route = f"idem/{variant}"
        exec_key = (variant, entry["tenant"], key)
        with self.ledger.lock:
            count = self.ledger.executions.get(exec_key, 0) + 1
            self.ledger.executions[exec_key] = count
        entry.update(route=route, key=key, count=count,
                     fingerprint=self.headers.get(FINGERPRINT_HEADER),
                     body=body.decode("utf-8", "replace"))
        if variant == "stream":
            events = max(1, self._int_header("x-chaos-events", 3))
            interval = self._int_header("x-chaos-interval-ms", 100) / 1000
            sent, complete, end = self._stream(events, interval)
            entry.update(status=200, events=sent, complete=complete, end=end, stream=True)
            return
        self._delay()
        status = 503 if self.headers.get("x-chaos-fail") == "1" else 201
        entry.update(status=status, end=time.time())
        payload = {"exec": entry["n"], "key": key, "count": count, "body": entry["body"]}
        sent = self._answer(status, payload, {"etag": f'"{entry["n"]}"'})
        entry["response"] = sent.decode()

    def _leased(self, entry: dict, variant: str, resource: str) -> None:
        route = f"lease/{variant}"
        res_key = (variant, entry["tenant"], resource)
        raw = self.headers.get(FENCING_HEADER)
        entry.update(route=route, resource=resource, token=raw)
        stale, last = self.ledger.fence(res_key, raw, entry)
        if stale:
            entry.update(accepted=False, status=409, end=time.time())
            self._answer(409, {"stale": True, "token": raw, "last": str(last)})
            return
        entry["accepted"] = True
        try:
            if variant == "stream":
                events = max(1, self._int_header("x-chaos-events", 3))
                interval = self._int_header("x-chaos-interval-ms", 100) / 1000
                sent, complete, end = self._stream(events, interval)
                entry.update(status=200, events=sent, complete=complete, end=end, stream=True)
                return
            self._delay()
            entry.update(status=200, end=time.time())
        finally:
            with self.ledger.lock:
                self.ledger.holders[res_key] -= 1
        self._answer(200, {"token": raw, "n": entry["n"]})

    def _admin(self, parts: list[str], query: dict) -> None:
        if parts[1:] == ["ledger"]:
            start = int((query.get("from") or ["0"])[0])
            self._answer(200, {"entries": self.ledger.since(start)})
            return
        if parts[1:] == ["state"]:
            with self.ledger.lock:
                accepted = {"/".join(k): str(v) for k, v in self.ledger.accepted.items()}
            self._answer(200, {"accepted": accepted})
            return
        self._answer(404, {"error": "no such admin endpoint"})

    do_GET = do_POST = do_PUT = do_DELETE = _handle


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024


# --- gRPC --------------------------------------------------------------------------------------


def _ident(b: bytes) -> bytes:
    return b


def _status(code: int) -> grpc.StatusCode:
    return next(s for s in grpc.StatusCode if s.value[0] == code)


class GrpcHandlers:
    """The gRPC methods of `cg.test.Chaos`, writing into the HTTP server's ledger."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def _begin(self, context, method: str) -> tuple[dict, dict]:
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        entry = {
            "n": self.ledger.next_id(),
            "id": md.get("x-chaos-id"),
            "method": "POST",
            "path": f"/{GRPC_SERVICE}/{method}",
            "tenant": md.get("x-tenant-id"),
            "begin": time.time(),
            "grpc": True,
        }
        # The service's mark, in the trailers: a trailers-only answer carries it too.
        context.set_trailing_metadata([("x-chaos-service", "1")])
        return md, entry

    @staticmethod
    def _int(md: dict, name: str, default: int = 0) -> int:
        try:
            return int(md.get(name) or default)
        except ValueError:
            return default

    def limited(self, request: bytes, context) -> bytes:
        md, entry = self._begin(context, "Limited")
        route = "grpc/rl"
        key = (route, entry["tenant"])
        with self.ledger.lock:
            running = self.ledger.in_flight.get(key, 0) + 1
            self.ledger.in_flight[key] = running
        entry.update(route=route, running=running)
        try:
            delay = self._int(md, "x-chaos-delay-ms")
            if delay > 0:
                time.sleep(min(delay, 5000) / 1000)
        finally:
            with self.ledger.lock:
                self.ledger.in_flight[key] -= 1
            entry.update(status=0, end=time.time())
            self.ledger.add(entry)
        return b"ok:%d" % entry["n"]

    def create(self, request: bytes, context):
        md, entry = self._begin(context, "Create")
        route = "grpc/idem"
        key = md.get("idempotency-key") or ""
        exec_key = ("grpc", entry["tenant"], key)
        with self.ledger.lock:
            count = self.ledger.executions.get(exec_key, 0) + 1
            self.ledger.executions[exec_key] = count
        messages = min(3, max(0, self._int(md, "x-chaos-messages", 1)))
        code = self._int(md, "x-chaos-code")
        code = code if code in GRPC_CODES else 0
        entry.update(route=route, key=key, count=count, messages=messages, status=code,
                     fingerprint=md.get(FINGERPRINT_HEADER),
                     body=request.decode("utf-8", "replace"),
                     message="" if code == 0 else f"exec {entry['n']}")
        sent = 0
        try:
            for i in range(messages):
                if i:
                    time.sleep(self._int(md, "x-chaos-interval-ms", 50) / 1000)
                if not context.is_active():
                    break
                yield b"exec %d part %d" % (entry["n"], i)
                sent += 1
            entry["complete"] = sent == messages and context.is_active()
        finally:
            entry.update(sent=sent, end=time.time())
            self.ledger.add(entry)
        if code != 0:
            context.abort(_status(code), entry["message"])

    def lease(self, request: bytes, context) -> bytes:
        md, entry = self._begin(context, "Lease")
        route = "grpc/lease"
        resource = md.get("x-chaos-resource") or ""
        res_key = ("grpc", entry["tenant"], resource)
        raw = md.get(FENCING_HEADER)
        entry.update(route=route, resource=resource, token=raw)
        stale, last = self.ledger.fence(res_key, raw, entry)
        if stale:
            entry.update(accepted=False, status=9, end=time.time())
            self.ledger.add(entry)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stale token {raw}, last {last}")
        entry["accepted"] = True
        try:
            delay = self._int(md, "x-chaos-delay-ms")
            if delay > 0:
                time.sleep(min(delay, 5000) / 1000)
        finally:
            with self.ledger.lock:
                self.ledger.holders[res_key] -= 1
            entry.update(status=0, end=time.time())
            self.ledger.add(entry)
        return (raw or "").encode()

    def handler(self):
        return grpc.method_handlers_generic_handler(GRPC_SERVICE, {
            "Limited": grpc.unary_unary_rpc_method_handler(self.limited, _ident, _ident),
            "Create": grpc.unary_stream_rpc_method_handler(self.create, _ident, _ident),
            "Lease": grpc.unary_unary_rpc_method_handler(self.lease, _ident, _ident),
        })


def serve(port: int) -> None:
    ledger = Ledger()
    handler = type("BoundHandler", (Handler,), {"ledger": ledger})
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=GRPC_WORKERS))
    grpc_server.add_generic_rpc_handlers((GrpcHandlers(ledger).handler(),))
    grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    server = Server(("127.0.0.1", port), handler)
    print(f"{GRPC_BANNER}127.0.0.1:{grpc_port}", flush=True)
    print(f"{BANNER}http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        grpc_server.stop(0)


class Service:
    """The service as a child process on a kernel-chosen port, stopped by its pid."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir).resolve()
        self.proc = None
        self.port: int | None = None
        self.grpc_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> "Service":
        from harness.child import start_child

        self.proc, self.port = start_child("chaos-service", __file__, self.workdir, BANNER, 0,
                                           timeout)
        # This start's gRPC line, printed before the HTTP one start_child waited for.
        found = re.findall(rf"^{re.escape(GRPC_BANNER)}127\.0\.0\.1:(\d+)$",
                           self.proc.log_text(), re.M)
        if not found:
            self.proc.stop()
            raise RuntimeError(f"the chaos service named no gRPC port:\n{self.proc.log_tail()}")
        self.grpc_port = int(found[-1])
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def ledger(self, start: int = 0) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/__chaos/ledger?from={start}", timeout=30) as r:
            return json.loads(r.read())["entries"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    serve(parser.parse_args().port)
