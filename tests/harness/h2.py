"""A minimal HTTP/2 client (h2c, prior knowledge) that can do what a well-behaved client library
hides: open streams and cancel them with RST_STREAM at a chosen moment, many per connection.

    conn = H2(envoy.port)
    sid = conn.request("POST", "/jobs/1", {"x-tenant-id": "acme"})
    conn.wait_headers(sid, 5.0)        # the response's HEADERS frame arrived (not decoded)
    conn.reset(sid)                    # RST_STREAM(CANCEL)
    conn.close()

Requests carry no body (HEADERS with END_STREAM). Header blocks are sent as HPACK literals
without indexing (no Huffman, no dynamic table), which every decoder reads; responses are not
decoded: a test reads what the service and Redis saw, or `wait_headers`/`wait_data` says when the
response began. The connection's SETTINGS and PINGs are acknowledged by a reader thread.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
CANCEL = 0x8


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """HPACK integer (RFC 7541 5.1) with a `prefix_bits` prefix on a first byte of `first`."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """A literal header field without indexing, new name (RFC 7541 6.2.2), no Huffman."""
    n, v = name.lower().encode(), value.encode()
    return b"\x00" + _int(len(n), 7) + n + _int(len(v), 7) + v


def header_block(method: str, path: str, headers: dict[str, str], authority: str = "x") -> bytes:
    fields = [(":method", method), (":scheme", "http"), (":path", path), (":authority", authority)]
    fields += list(headers.items())
    return b"".join(_literal(n, v) for n, v in fields)


class H2:
    """One h2c connection to 127.0.0.1:`port`."""

    def __init__(self, port: int, timeout: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()
        self._seen = threading.Condition()
        self.frames: dict[int, list[tuple[int, int]]] = {}  # stream -> [(type, flags)]
        self.goaway = False
        self.closed = False
        self._next = 1
        self._send(PREFACE + frame(SETTINGS, 0, 0))
        self._reader = threading.Thread(target=self._read, name=f"h2-{port}", daemon=True)
        self._reader.start()

    def _send(self, data: bytes) -> None:
        with self._send_lock:
            self.sock.sendall(data)

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                with self._seen:
                    self.closed = True
                    self._seen.notify_all()
                return
            buf += data
            while len(buf) >= 9:
                length = int.from_bytes(buf[:3], "big")
                if len(buf) < 9 + length:
                    break
                kind, flags = buf[3], buf[4]
                stream = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                payload, buf = buf[9:9 + length], buf[9 + length:]
                try:
                    if kind == SETTINGS and not flags & ACK:
                        self._send(frame(SETTINGS, ACK, 0))
                    elif kind == PING and not flags & ACK:
                        self._send(frame(PING, ACK, 0, payload))
                except OSError:
                    pass
                with self._seen:
                    if kind == GOAWAY:
                        self.goaway = True
                    if stream:
                        self.frames.setdefault(stream, []).append((kind, flags))
                    self._seen.notify_all()

    def request(self, method: str, path: str, headers: dict[str, str] | None = None) -> int:
        """Opens a stream with a request of no body; its id."""
        return self.requests([(method, path, headers or {})])[0]

    def requests(self, reqs: list[tuple[str, str, dict[str, str]]], reset: bool = False) -> list[int]:
        """Opens a stream for each request in one write; with `reset`, each is followed at once by
        its RST_STREAM(CANCEL) (a client that hangs up right after sending). Their ids."""
        ids, out = [], []
        for method, path, headers in reqs:
            sid, self._next = self._next, self._next + 2
            ids.append(sid)
            out.append(frame(HEADERS, END_HEADERS | END_STREAM, sid, header_block(method, path, headers)))
            if reset:
                out.append(frame(RST_STREAM, 0, sid, struct.pack(">I", CANCEL)))
        self._send(b"".join(out))
        return ids

    def reset(self, *streams: int) -> None:
        """RST_STREAM(CANCEL) on each stream, in one write."""
        self._send(b"".join(frame(RST_STREAM, 0, s, struct.pack(">I", CANCEL)) for s in streams))

    def _wait(self, stream: int, kind: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._seen:
            while not any(k == kind for k, _ in self.frames.get(stream, [])):
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return False
                self._seen.wait(left)
            return True

    def wait_headers(self, stream: int, timeout: float) -> bool:
        """Whether the response's HEADERS frame arrived on `stream` within `timeout`."""
        return self._wait(stream, HEADERS, timeout)

    def wait_data(self, stream: int, timeout: float) -> bool:
        """Whether a DATA frame arrived on `stream` within `timeout`."""
        return self._wait(stream, DATA, timeout)

    def answered(self, stream: int) -> bool:
        """Whether the stream got its response's headers (so far)."""
        with self._seen:
            return any(k == HEADERS for k, _ in self.frames.get(stream, []))

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv
        except OSError:
            pass
        self.sock.close()
        self._reader.join(timeout=2)

    def __enter__(self) -> "H2":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
