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
- a request without a tenant now and then (the filter's 401).

A request is sent on a connection of its own through a raw socket, so a client can reset it
where it wants: in the middle of its body (`mid_request`), after sending it and before the
answer (`before_response`: the acquire may be in flight, or the request at the service), or
in the middle of the answer's body (`mid_body`). A reset closes the socket with SO_LINGER 0
(a TCP RST). Each history line is one request: what was sent, `send` (before the first
byte), `headers_at` (the answer's headers read), `recv` (the answer read, or the reset), the
status, the headers the checker reads, the body (or its start), and `reset` / `error`.
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

from chaos import config

# What the checker reads of an answer's headers (lower case).
KEPT_HEADERS = ("content-type", "retry-after", "ratelimit", "ratelimit-policy",
                "idempotent-replayed", "x-chaos-service", "x-charge", "etag", "content-length")

WEIGHTS = {
    "rl": 46,
    "idem": 30,
    "lease": 22,
    "no_tenant": 2,
}
RATE_ROUTES = {"fw": 6, "sw": 6, "sl": 6, "tb": 6, "cc": 6, "cost": 5, "multi": 6, "open": 5}
IDEM_ROUTES = {"reject": 4, "wait": 3, "async": 2, "stream": 2}
LEASE_ROUTES = {"reject": 4, "wait": 3, "stream": 2}
RESET_PROBABILITY = 0.08
KEYS_PER_TENANT = 4
CONFLICT_KEYS = 2
RESOURCES_PER_TENANT = 2


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
