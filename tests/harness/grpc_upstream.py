"""A gRPC service (grpcio, generic handlers, raw bytes in and out: no protoc) that counts
what it executed, as the HTTP upstream does.

Every unary method under the service `cg.test.Orders` answers by the request's metadata:
- `x-upstream-grpc-code: N`       end with status N (default 0, OK)
- `x-upstream-grpc-message: text` the status message
- `x-upstream-delay-ms: N`        sleep N ms first
- `x-upstream-no-message: 1`      send no response message (with a non-OK code grpcio sends a
                                  trailers-only answer: the status in the headers)
- `x-upstream-trailer-<name>: v`  add the trailer `<name>: v` (beside grpc-status)
With code 0 it answers the message `b"done:" + request`; with another code and no
`x-upstream-no-message`, it sends that message first and then the status in the trailers
(a server-streaming method, `Stream`, is used for that: a unary method cannot send a
message and fail).

Run standalone: `python tests/harness/grpc_upstream.py --port 0`; the first stdout line names
the port. `GrpcUpstream` runs it as a child process stopped by its pid; its counts are read
with the method `cg.test.Admin/Stats` (not counted).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

SERVICE = "cg.test.Orders"
ADMIN = "cg.test.Admin"
TRAILER_PREFIX = "x-upstream-trailer-"


def _ident(b: bytes) -> bytes:
    return b


class Ledger:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_method: dict[str, int] = {}
        self.requests: list[dict] = []

    def record(self, method: str, metadata: dict, body: bytes) -> None:
        with self.lock:
            self.by_method[method] = self.by_method.get(method, 0) + 1
            self.requests.append({"method": method, "metadata": metadata, "body": body.hex()})

    def snapshot(self) -> bytes:
        with self.lock:
            return json.dumps({"by_method": self.by_method, "requests": self.requests}).encode()


def _metadata(context) -> dict:
    return {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}


def _handlers(ledger: Ledger):
    def run(method: str, request: bytes, context):
        md = _metadata(context)
        delay = int(md.get("x-upstream-delay-ms") or 0)
        if delay:
            time.sleep(delay / 1000)
        ledger.record(method, md, request)
        trailers = [(name[len(TRAILER_PREFIX):], value) for name, value in md.items()
                    if name.startswith(TRAILER_PREFIX)]
        if trailers:
            context.set_trailing_metadata(trailers)
        code = int(md.get("x-upstream-grpc-code") or 0)
        message = md.get("x-upstream-grpc-message", "")
        return md, code, message

    def unary(request: bytes, context) -> bytes:
        md, code, message = run("Create", request, context)
        if code == 0:
            return b"done:" + request
        context.abort(grpc.StatusCode(_status_tuple(code)), message)

    def stream(request: bytes, context):
        md, code, message = run("Stream", request, context)
        if md.get("x-upstream-no-message") != "1":
            yield b"done:" + request
        if code != 0:
            context.abort(grpc.StatusCode(_status_tuple(code)), message)

    def stats(request: bytes, context) -> bytes:
        return ledger.snapshot()

    orders = grpc.method_handlers_generic_handler(SERVICE, {
        "Create": grpc.unary_unary_rpc_method_handler(unary, _ident, _ident),
        "Stream": grpc.unary_stream_rpc_method_handler(stream, _ident, _ident),
    })
    admin = grpc.method_handlers_generic_handler(ADMIN, {
        "Stats": grpc.unary_unary_rpc_method_handler(stats, _ident, _ident),
    })
    return [orders, admin]


def _status_tuple(code: int):
    for sc in grpc.StatusCode:
        if sc.value[0] == code:
            return sc.value
    raise ValueError(f"no gRPC status {code}")


def serve(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    for h in _handlers(Ledger()):
        server.add_generic_rpc_handlers((h,))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"grpc upstream listening on 127.0.0.1:{bound}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(0)


class GrpcUpstream:
    """The service as a child process on a kernel-chosen port; stopped by its pid."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir).resolve()
        self.port: int | None = None
        self.proc = None

    def start(self, timeout: float = 20.0) -> "GrpcUpstream":
        from .child import start_child

        self.proc, self.port = start_child("grpc-upstream", __file__, self.workdir,
                                           "grpc upstream listening on ", 0, timeout)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def stats(self) -> dict:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            call = channel.unary_unary(f"/{ADMIN}/Stats", request_serializer=_ident,
                                       response_deserializer=_ident)
            return json.loads(call(b"", timeout=5))

    def count(self, method: str) -> int:
        return self.stats()["by_method"].get(method, 0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    serve(parser.parse_args().port)
