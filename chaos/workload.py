"""The chaos workload: several client processes sending mixed traffic through the Envoys and
writing down every request and answer with its timing (the history).

    python -m chaos.workload --spec spec.json --proc 0 --out history-0.jsonl

The spec (chaos/run.py writes it) names the Envoys' URLs, the schedule's seed and tag, when to
start (wall-clock time, so every process starts together) and for how long. Each process runs
`threads` client threads; each thread draws its operations from its own random generator,
seeded from the schedule's seed, the process and the thread, so a schedule's traffic is the
same on every run (its timing is the machine's).

What a thread sends, by weight (`WEIGHTS`):
- rate-limited requests (`GET /rl/<name>`, each algorithm, the concurrency and the cost
  limit) over a few tenants;
- idempotent POSTs with a small key space, so duplicates collide (`/idem/<variant>/<key>`:
  in_progress reject, wait, async completion, and an event stream stored by reference); a
  few ask the service for a retryable 503; a few keys (`c<n>`) are sent with two bodies, so
  the same key meets a different request;
- lease-guarded operations on a few resources (`/lease/<variant>/<resource>`: on_busy reject,
  wait, and an event stream holding the lease);
- bursts of requests on the leased-quota limit (`/rl/leased`), a few at once so that its
  slices are spent and its counter runs out;
- gRPC calls over h2c (grpcio, one channel and connection per call, no retries): the rate
  limit (`Limited`), the idempotent server-streaming `Create` over the same small key space
  (0 to 3 messages, ending OK, NOT_FOUND or UNAVAILABLE) and the lease (`Lease`);
- a request without a tenant now and then (the filter's 401, or UNAUTHENTICATED over gRPC).

A request is sent on a connection of its own through a raw socket, so a client can reset it
where it wants: in the middle of its body (`mid_request`), after sending it and before the
answer (`before_response`: the acquire may be in flight, or the request at the service), or
in the middle of the answer's body (`mid_body`). A reset closes the socket with SO_LINGER 0
(a TCP RST). A gRPC call is cancelled by its client (RST_STREAM CANCEL) after it was sent
and before the answer (`before_response`), after the first message of a stream (`mid_body`),
or, through a raw HTTP/2 connection (tests/harness/h2.py's frames), in the middle of its
request message (`mid_request`). Each history line is one request: what was sent, `send`
(before the first byte), `headers_at` (the answer's headers read), `recv` (the answer read, or
the reset), the status (a gRPC call's: its gRPC status code, with `grpc: true`), the headers
the checker reads (a gRPC call's metadata, initial and trailing, with `trailers_only` when no
initial metadata came), the body (or its start; a gRPC call's `details` and `messages`), and
`reset` / `error`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import struct
import threading
import time
import urllib.parse
from pathlib import Path

import grpc

from chaos import config
from harness import h2

# What the checker reads of an answer's headers (lower case).
KEPT_HEADERS = ("content-type", "retry-after", "ratelimit", "ratelimit-policy",
                "idempotent-replayed", "x-chaos-service", "x-charge", "etag", "content-length",
                "x-envoy-ratelimited")

WEIGHTS = {
    "rl": 46,
    "idem": 30,
    "lease": 22,
    "leased": 5,
    "grpc": 14,
    "no_tenant": 2,
}
RATE_ROUTES = {"fw": 6, "sw": 6, "sl": 6, "tb": 6, "cc": 6, "cost": 5, "multi": 6, "open": 5}
IDEM_ROUTES = {"reject": 4, "wait": 3, "async": 2, "stream": 2}
LEASE_ROUTES = {"reject": 4, "wait": 3, "stream": 2}
GRPC_ROUTES = {"rl": 4, "idem": 5, "lease": 4}
# What `Create` does for a key, by the key's number: (gRPC status, messages sent first). OK
# with no message (replayed as OK), NOT_FOUND after a message (replayed without it), OK after
# messages (replayed as ALREADY_EXISTS), NOT_FOUND trailers-only.
GRPC_KEY_OUTCOMES = [(0, 0), (5, 1), (0, 2), (5, 0)]
# Requests in a row on the leased-quota route: enough, with a few threads at it, that its
# counter runs out within a window and its slices are spent.
LEASED_BURST = (4, 8)
RESET_PROBABILITY = 0.08
GRPC_NO_TENANT = 0.03
KEYS_PER_TENANT = 4
CONFLICT_KEYS = 2
RESOURCES_PER_TENANT = 2
GRPC_OPTIONS = [
    ("grpc.enable_retries", 0),  # one call, one request: the history is what was sent
    ("grpc.enable_http_proxy", 0),
    ("grpc.use_local_subchannel_pool", 1),  # a connection of its own, as the HTTP requests
]


def _pick(rng: random.Random, weights: dict) -> str:
    names = list(weights)
    return rng.choices(names, [weights[n] for n in names])[0]


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST, as a client that gives up abruptly does."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def exchange(port: int, method: str, path: str, headers: dict, body: bytes, reset: str | None,
             rng: random.Random, timeout: float = 10.0) -> dict:
    """One request on its own connection; what happened, with its times (wall clock)."""
    out: dict = {"reset": reset}
    lines = [f"{method} {path} HTTP/1.1", "Host: chaos", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    out["send"] = time.time()
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError as e:
        out.update(recv=time.time(), error=f"connect: {e.__class__.__name__}")
        return out
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if reset == "mid_request" and body:
            sock.sendall(head + body[: max(1, len(body) // 2)])
            time.sleep(rng.uniform(0.0, 0.05))
            _reset(sock)
            out["recv"] = time.time()
            return out
        sock.sendall(head + body)
        if reset == "before_response":
            time.sleep(rng.uniform(0.0, 0.15))
            _reset(sock)
            out["recv"] = time.time()
            return out
        resp = http.client.HTTPResponse(sock, method=method)
        resp.begin()
        out["headers_at"] = time.time()
        out["status"] = resp.status
        out["headers"] = {k.lower(): v for k, v in resp.getheaders() if k.lower() in KEPT_HEADERS}
        if reset == "mid_body":
            first = resp.read1(64) if hasattr(resp, "read1") else resp.read(1)
            out["body"] = first.decode("utf-8", "replace")
            _reset(sock)
            out["recv"] = time.time()
            return out
        data = resp.read()
        out["recv"] = time.time()
        out["body"] = data[:4096].decode("utf-8", "replace")
        out["body_len"] = len(data)
        return out
    except (OSError, http.client.HTTPException) as e:
        out.update(recv=time.time(), error=f"{e.__class__.__name__}: {e}"[:200])
        return out
    finally:
        try:
            sock.close()
        except OSError:
            pass


def _ident(b: bytes) -> bytes:
    return b


def _metadata(items) -> dict:
    """gRPC metadata as the history keeps it: lower-case names, the checker's and grpc-*."""
    return {k.lower(): v for k, v in (items or ()) if isinstance(v, str)
            and (k.lower() in KEPT_HEADERS or k.lower().startswith("grpc-"))}


def _grpc_outcome(out: dict, code, details, initial, trailing, messages: list,
                  timeout: float) -> None:
    out.update(recv=time.time(), status=code.value[0], details=details or "",
               messages=len(messages), trailers_only=not initial,
               headers={**_metadata(initial), **_metadata(trailing)})
    # No metadata at all (every HTTP answer from Envoy has some, `server` at least): the call
    # never had an answer (Envoy down, the connection reset); nor one the client gave up on
    # at its deadline.
    gave_up = (code == grpc.StatusCode.DEADLINE_EXCEEDED
               and out["recv"] - out["send"] >= timeout - 0.1)
    if (not initial and not trailing) or gave_up:
        out.pop("status")
        out["error"] = f"grpc {code.name}: {details}"[:200]


def grpc_exchange(port: int, path: str, metadata: dict, body: bytes, stream: bool,
                  reset: str | None, rng: random.Random, timeout: float = 10.0) -> dict:
    """One gRPC call (grpcio) on a channel and connection of its own; what happened."""
    out: dict = {"reset": reset, "grpc": True}
    if reset == "mid_request":
        return h2_reset_mid_request(port, path, metadata, body, rng, out)
    md = list(metadata.items())
    out["send"] = time.time()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    messages: list[bytes] = []
    try:
        if stream:
            call = channel.unary_stream(path, request_serializer=_ident,
                                        response_deserializer=_ident)(body, metadata=md,
                                                                      timeout=timeout)
        else:
            call = channel.unary_unary(path, request_serializer=_ident,
                                       response_deserializer=_ident).future(body, metadata=md,
                                                                            timeout=timeout)
        if reset == "before_response":
            time.sleep(rng.uniform(0.0, 0.15))
            if call.cancel():
                out["recv"] = time.time()
                return out
            out.update(reset=None, cancelled_late=True)  # it had ended: an ordinary call
        try:
            if stream:
                for m in call:
                    messages.append(m)
                    if reset == "mid_body":
                        out["headers"] = _metadata(call.initial_metadata())
                        call.cancel()
                        out["recv"] = time.time()
                        out["messages"] = len(messages)
                        return out
                if reset == "mid_body":
                    out["reset"] = None  # it ended before a message: nothing to cut
            else:
                messages.append(call.result())
        except grpc.RpcError:
            pass
        _grpc_outcome(out, call.code(), call.details(), call.initial_metadata(),
                      call.trailing_metadata(), messages, timeout)
        return out
    except Exception as e:  # grpcio's own failures: the call had no answer
        out.update(recv=time.time(), error=f"{e.__class__.__name__}: {e}"[:200])
        return out
    finally:
        channel.close()


def h2_reset_mid_request(port: int, path: str, metadata: dict, body: bytes, rng: random.Random,
                         out: dict) -> dict:
    """A gRPC request whose client resets its stream (RST_STREAM CANCEL) in the middle of the
    request message, then closes the connection: raw HTTP/2 frames (tests/harness/h2.py)."""
    message = b"\x00" + struct.pack(">I", len(body)) + body  # a gRPC length-prefixed message
    headers = {"content-type": "application/grpc", "te": "trailers", **metadata}
    out["send"] = time.time()
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError as e:
        out.update(recv=time.time(), error=f"connect: {e.__class__.__name__}")
        return out
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0)
                     + h2.frame(h2.HEADERS, h2.END_HEADERS, 1,
                                h2.header_block("POST", path, headers))
                     + h2.frame(h2.DATA, 0, 1, message[: max(1, len(message) // 2)]))
        time.sleep(rng.uniform(0.0, 0.05))
        sock.sendall(h2.frame(h2.RST_STREAM, 0, 1, struct.pack(">I", h2.CANCEL)))
    except OSError:
        pass
    finally:
        _reset(sock)
    out["recv"] = time.time()
    return out


class Client:
    """One client thread's traffic."""

    def __init__(self, spec: dict, proc: int, thread: int):
        self.spec = spec
        self.rng = random.Random(f"{spec['seed']}:{proc}:{thread}")
        self.proc, self.thread = proc, thread
        self.tag = spec["tag"]
        self.ports = [urllib.parse.urlsplit(u).port for u in spec["envoy_urls"]]
        self.tenants = [f"{self.tag}-t{i}" for i in range(spec.get("tenants", 3))]
        self.records: list[dict] = []
        self.n = 0

    def _id(self) -> str:
        self.n += 1
        return f"{self.tag}-{self.proc}-{self.thread}-{self.n}"

    def _reset_mode(self, body: bool, stream: bool) -> str | None:
        if self.rng.random() >= RESET_PROBABILITY:
            return None
        modes = ["before_response", "mid_body"] + (["mid_request"] if body else [])
        if stream:
            modes.append("mid_body")
        return self.rng.choice(modes)

    def one(self) -> None:
        op = _pick(self.rng, WEIGHTS)
        tenant = self.rng.choice(self.tenants)
        rid = self._id()
        headers = {"x-chaos-id": rid, config.TENANT_HEADER: tenant,
                   config.PRINCIPAL_HEADER: "u1"}
        record = {"id": rid, "op": op, "tenant": tenant}
        body = b""
        stream = False
        if op == "rl":
            name = _pick(self.rng, RATE_ROUTES)
            method, path = "GET", f"/rl/{name}"
            record["route"] = f"rl/{name}"
            if name == "cc":
                headers["x-chaos-delay-ms"] = str(self.rng.randint(50, 300))
            elif self.rng.random() < 0.3:
                headers["x-chaos-delay-ms"] = str(self.rng.randint(1, 30))
            if name == "cost":
                cost = self.rng.randint(1, 4)
                headers[config.COST_HEADER] = str(cost)
                headers["x-chaos-charge-extra"] = str(self.rng.choice([0, 0, 1, 2]))
                record["cost"] = cost
        elif op == "idem":
            variant = _pick(self.rng, IDEM_ROUTES)
            method = "POST"
            if variant != "stream" and self.rng.random() < 0.15:
                key = f"{self.tag}-c{self.rng.randrange(CONFLICT_KEYS)}"
                shape = self.rng.choice("AB")
                record["conflict_probe"] = True
            else:
                key = f"{self.tag}-k{self.rng.randrange(KEYS_PER_TENANT)}"
                shape = "A"
            path = f"/idem/{variant}/{key}"
            record.update(route=f"idem/{variant}", key=key, shape=shape)
            headers["idempotency-key"] = key
            headers["content-type"] = "application/json"
            body = json.dumps({"key": key, "shape": shape}, sort_keys=True).encode()
            if variant == "stream":
                stream = True
                headers["x-chaos-events"] = str(self.rng.randint(2, 5))
                headers["x-chaos-interval-ms"] = "100"
            else:
                headers["x-chaos-delay-ms"] = str(self.rng.randint(20, 300))
                if self.rng.random() < 0.1:
                    headers["x-chaos-fail"] = "1"
                    record["fail"] = True
        elif op == "lease":
            variant = _pick(self.rng, LEASE_ROUTES)
            resource = f"{self.tag}-r{self.rng.randrange(RESOURCES_PER_TENANT)}"
            path = f"/lease/{variant}/{resource}"
            record.update(route=f"lease/{variant}", resource=resource)
            if variant == "stream":
                method, stream = "GET", True
                headers["x-chaos-events"] = str(self.rng.randint(3, 12))
                headers["x-chaos-interval-ms"] = "150"
            else:
                method = "POST"
                headers["x-chaos-delay-ms"] = str(self.rng.randint(20, 200))
        elif op == "leased":
            return self.leased_burst(headers, record)
        elif op == "grpc":
            return self.grpc_call(headers, record)
        else:  # no_tenant: the filter must answer 401 itself
            method, path = "GET", "/rl/fw"
            record["route"] = "rl/fw"
            del headers[config.TENANT_HEADER]
            record["tenant"] = None
        reset = self._reset_mode(bool(body), stream)
        envoy = self.rng.randrange(len(self.ports))
        record.update(method=method, path=path, envoy=envoy, proc=self.proc, thread=self.thread)
        record.update(exchange(self.ports[envoy], method, path, headers, body, reset, self.rng))
        self.records.append(record)

    def leased_burst(self, headers: dict, record: dict) -> None:
        """A few requests in a row on the leased-quota route, each a history line of its own."""
        for i in range(self.rng.randint(*LEASED_BURST)):
            rid = record["id"] if i == 0 else self._id()
            one = {**record, "id": rid, "op": "rl", "route": "rl/leased", "method": "GET",
                   "path": "/rl/leased"}
            envoy = self.rng.randrange(len(self.ports))
            one.update(envoy=envoy, proc=self.proc, thread=self.thread)
            reset = self._reset_mode(False, False)
            one.update(exchange(self.ports[envoy], "GET", "/rl/leased",
                                {**headers, "x-chaos-id": rid}, b"", reset, self.rng))
            self.records.append(one)

    def grpc_call(self, headers: dict, record: dict) -> None:
        """One gRPC call: the rate limit, an idempotent stream, or the lease."""
        name = _pick(self.rng, GRPC_ROUTES)
        path = config.grpc_path(name)
        metadata = dict(headers)
        body = b""
        stream = False
        record.update(op="grpc", route=f"grpc/{name}", method="POST", path=path)
        if self.rng.random() < GRPC_NO_TENANT:
            del metadata[config.TENANT_HEADER]
            record.update(tenant=None, no_tenant=True)
        if name == "rl":
            if self.rng.random() < 0.3:
                metadata["x-chaos-delay-ms"] = str(self.rng.randint(1, 30))
            body = b"limited"
        elif name == "idem":
            stream = True
            if self.rng.random() < 0.15:
                key = f"{self.tag}-gc{self.rng.randrange(CONFLICT_KEYS)}"
                shape = self.rng.choice("AB")
                record["conflict_probe"] = True
            else:
                key = f"{self.tag}-gk{self.rng.randrange(KEYS_PER_TENANT)}"
                shape = "A"
            metadata["idempotency-key"] = key
            # What the call ends with belongs to the key (a retry is the same request), and
            # now and then the service fails it retryably.
            code, messages = GRPC_KEY_OUTCOMES[int(key[-1]) % len(GRPC_KEY_OUTCOMES)]
            if self.rng.random() < 0.1:
                code = 14
                record["fail"] = True
            metadata.update({"x-chaos-messages": str(messages), "x-chaos-code": str(code),
                             "x-chaos-interval-ms": str(self.rng.randint(10, 80))})
            record.update(key=key, shape=shape)
            body = json.dumps({"key": key, "shape": shape}, sort_keys=True).encode()
        else:
            resource = f"{self.tag}-gr{self.rng.randrange(RESOURCES_PER_TENANT)}"
            metadata[config.GRPC_RESOURCE_HEADER] = resource
            metadata["x-chaos-delay-ms"] = str(self.rng.randint(20, 200))
            record["resource"] = resource
            body = b"lease"
        reset = None
        if self.rng.random() < RESET_PROBABILITY:
            reset = self.rng.choice(["before_response", "mid_request"]
                                    + (["mid_body"] if stream else []))
        envoy = self.rng.randrange(len(self.ports))
        record.update(envoy=envoy, proc=self.proc, thread=self.thread)
        record.update(grpc_exchange(self.ports[envoy], path, metadata, body, stream, reset,
                                    self.rng))
        self.records.append(record)

    def run(self, deadline: float) -> None:
        while time.time() < deadline:
            try:
                self.one()
            except Exception as e:  # a bug of the workload must not stop the others' traffic
                self.records.append({"id": self._id(), "op": "workload_error",
                                     "error": f"{e.__class__.__name__}: {e}"[:300],
                                     "send": time.time(), "recv": time.time()})
            time.sleep(self.rng.uniform(0.0, self.spec.get("think_s", 0.03)))


def run(spec: dict, proc: int, out: Path) -> int:
    clients = [Client(spec, proc, t) for t in range(spec.get("threads", 5))]
    start = spec["start_at"]
    deadline = start + spec["duration_s"]
    time.sleep(max(0.0, start - time.time()))
    threads = [threading.Thread(target=c.run, args=(deadline,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=spec["duration_s"] + 30)
    records = [r for c in clients for r in c.records]
    with open(out, "w") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    return len(records)


def main() -> None:
    parser = argparse.ArgumentParser(description="one chaos client process")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--proc", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    n = run(spec, args.proc, Path(args.out))
    print(f"workload {args.proc}: {n} requests", flush=True)


if __name__ == "__main__":
    main()
