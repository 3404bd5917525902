"""Token budgets for streamed LLM answers end to end: a rate limit charged from an event stream
(`charge: {"response_sse_json": "<pointer>"}`). Real Envoy running the filter, real redis-server
behind webdis, and the counting upstream streaming exactly the bytes a test gives it
(`x-upstream-sse-body`), in the HTTP chunks the test cuts it into, with a pause between them.

What is checked: the stream reaches the client untouched (the same bytes) and unbuffered (its
first event arrives while the upstream has not sent the rest); events split across chunks,
CR/LF/CRLF line ends, comments, data lines joined and OpenAI's `[DONE]` are read as the
WHATWG rules say; each limit reads its own pointer from the same stream (prompt and completion
tokens counted apart); the last event carrying the pointer is the charge, and the counter (and
the next request's `RateLimit`) shows it; a stream cut before its usage (the client leaves, the
upstream resets, the stream ends without it) is charged `missing` (by default the admitted
cost), counted `charge_missing`; a stream compressed before the filter is unreadable, and with
Envoy's compressor after the filter the client gets gzip while the filter reads plain text.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
import time
import zlib

import pytest

from harness.concurrency import wait_for
from harness.envoy import Envoy
from harness.stack import Stack
from test_e2e_lease import uid

pytestmark = pytest.mark.topologies("single", "cluster")

TENANT = "x-tenant-id"
COST = "x-request-cost"
POLICY = "chat"
SINGLE_ONLY = pytest.mark.topologies("single", reason="the topology changes nothing the test "
                                     "looks at (how the stream is read)")
RATELIMIT_ITEM = re.compile(r'"([A-Za-z0-9_-]+)";r=(\d+);t=(\d+)')


# --- the streams ---------------------------------------------------------------------------------


def chunk(content: str) -> str:
    """An OpenAI chat completion chunk: a piece of the answer, no usage yet."""
    return json.dumps({"id": "c1", "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": {"content": content}}], "usage": None})


def usage(prompt: int, completion: int) -> str:
    """OpenAI's last chunk with `stream_options.include_usage`: no choices, the usage."""
    return json.dumps({"id": "c1", "object": "chat.completion.chunk", "choices": [],
                       "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}})


def llm_stream(prompt: int = 120, completion: int = 35) -> bytes:
    """An answer streamed as OpenAI does, with what else the WHATWG rules allow: CRLF and CR
    line ends, a comment, an `event` and an `id` field, the usage split over two data lines."""
    text = usage(prompt, completion)
    half = text.index('"usage"')
    return (f"data: {chunk('Hel')}\n\n"
            ": keep-alive\r\n\r\n"
            f"event: message\rid: 2\rdata: {chunk('lo')}\r\r"
            f"data: {text[:half]}\r\ndata: {text[half:]}\r\n\r\n"
            "data: [DONE]\n\n").encode()


def cuts_inside(stream: bytes) -> list[int]:
    """Cut points that split what a reader must put together again: a field name, a CRLF, a
    data line's JSON, the blank line ending the usage event."""
    usage_at = stream.index(b'"usage": {')
    return [stream.index(b"data") + 2,                  # "da|ta: ..."
            stream.index(b"\r\n") + 1,                  # "\r|\n"
            usage_at + 12,                              # inside the usage object
            stream.index(b"\r\n\r\n", usage_at) + 2]    # between the two line ends


def steer(stream: bytes, cuts: list[int] | None = None, interval_ms: int = 100,
          end: str | None = None) -> dict:
    """The upstream headers that make it stream `stream`."""
    h = {"x-upstream-sse-body": base64.b64encode(stream).decode(),
         "x-upstream-sse-interval-ms": str(interval_ms)}
    if cuts:
        h["x-upstream-sse-cuts"] = ",".join(map(str, cuts))
    if end:
        h["x-upstream-sse-end"] = end
    return h


# --- the configuration ---------------------------------------------------------------------------


def limit(name: str, pointer: str, *, limit_: int = 100000, cost: dict | None = None,
          **charge) -> dict:
    return {"name": name, "by": ["tenant"], "algorithm": "fixed_window", "limit": limit_,
            "window": "1h", "cost": cost or {"header": COST, "default": 1, "max": 10000},
            "charge": {"response_sse_json": pointer, **charge}}


def plugin(stack: Stack, key_prefix: str, *limits: dict) -> dict:
    return {"redis": stack.redis_section(key_prefix=key_prefix, timeout="250ms"),
            "identity": {"tenant_header": TENANT, "missing_tenant": "reject"},
            "policies": [{"name": POLICY, "match": {"path_prefix": "/v1/"},
                          "rate_limits": list(limits)}]}


# Envoy's compressor in front of the filter: responses pass the filter first (plain text), then
# the compressor (gzip for a client that asked); it takes accept-encoding off the request so the
# service never compresses what the filter must read.
COMPRESSOR = {
    "name": "envoy.filters.http.compressor",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.compressor.v3.Compressor",
        "response_direction_config": {
            "common_config": {"content_type": ["text/event-stream", "application/json"]},
            "remove_accept_encoding_header": True,
        },
        "compressor_library": {
            "name": "gzip",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.compression.gzip.compressor.v3.Gzip",
            },
        },
    },
}


# --- helpers -------------------------------------------------------------------------------------


class Run:
    """One test's tenant and path, so its ledger entries and keys are its own."""

    def __init__(self) -> None:
        self.tenant = f"tenant-{uid()}"
        self.path = f"/v1/chat/{uid()}"

    def headers(self, cost: int | None, extra: dict | None = None) -> dict:
        h = {TENANT: self.tenant, "content-type": "application/json"}
        if cost is not None:
            h[COST] = str(cost)
        return {**h, **(extra or {})}

    def stream(self, envoy: Envoy, upstream: dict, *, cost: int | None = None,
               extra: dict | None = None, leave_after: int | None = None,
               on_first=None) -> tuple[int, dict, bytes, bool]:
        """POST <path>, reading the answer as it comes: (status, headers, body bytes as they
        arrived, whether the stream ended whole). `leave_after`: the client closes its
        connection once it has that many bytes. `on_first()` runs when the first bytes
        arrive."""
        conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=15)
        try:
            conn.request("POST", self.path, body=b'{"stream": true}',
                         headers=self.headers(cost, {**upstream, **(extra or {})}))
            resp = conn.getresponse()
            got = b""
            whole = False
            while True:
                try:
                    piece = resp.read1(65536)
                except (http.client.IncompleteRead, ValueError, OSError):
                    break  # cut: a chunk never ended, or the connection is gone
                if not piece:
                    whole = True
                    break
                if not got and on_first is not None:
                    on_first()
                got += piece
                if leave_after is not None and len(got) >= leave_after:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    break
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, got, whole
        finally:
            conn.close()

    def executed(self, stack: Stack) -> list[dict]:
        return [r for r in stack.upstream.requests() if r["path"] == self.path]


def counter(stack: Stack, prefix: str, name: str) -> int:
    """The fixed-window count of limit `name` (0 before its key exists)."""
    keys = list(stack.redis.scan_iter(match=f"{prefix}:rl:*:{POLICY}:{name}:fw:*", count=1000))
    assert len(keys) <= 1, keys
    return int(stack.redis.get(keys[0]) or 0) if keys else 0


def stat(envoy: Envoy, name: str, metric: str) -> int:
    return envoy.stat(f"wasmcustom.cg.policy.{POLICY}.limit.{name}.{metric}")


def remaining(headers: dict) -> dict[str, int]:
    """`r` of each item of the RateLimit header."""
    return {m.group(1): int(m.group(2))
            for m in RATELIMIT_ITEM.finditer(headers.get("ratelimit", ""))}


def settles(stack: Stack, prefix: str, want: dict[str, int], timeout: float = 3.0) -> None:
    """Waits until each limit's counter holds what `want` says (charges go out from the root
    once the stream is over)."""
    got = {}

    def check() -> bool:
        got.update({name: counter(stack, prefix, name) for name in want})
        return got == want

    assert wait_for(check, timeout), f"counters {got}, expected {want}"


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory, topology):
    """Redis, webdis and the upstream for the module (on its topology); Envoys per test."""
    stack = Stack(tmp_path_factory.mktemp("sse-charge-e2e"), None, envoys=0,
                  **topology.stack_kwargs).start()
    yield stack
    stack.stop()


@pytest.fixture
def guard(shared, sidecars):
    """`guard(*limits, **variant) -> Envoy` with a key_prefix of its own (`envoy.key_prefix`)."""

    def make(*limits: dict, **variant) -> Envoy:
        prefix = f"cg:e2e-sse:{uid()}"
        return sidecars(shared, plugin(shared, prefix, *limits), prefix, **variant)

    return make


# --- 1. the usage in the stream spends the budget ------------------------------------------------


def test_each_limit_is_charged_its_own_number_from_the_last_event(shared, guard):
    """Prompt, completion and total tokens, each a limit reading its own pointer from the same
    stream in one pass. Admitted at the declared estimate (40), corrected to the usage once the
    stream ended; the next request's RateLimit shows it. The stream reaches the client as the
    upstream sent it, piece by piece."""
    envoy = guard(limit("prompt", "/usage/prompt_tokens"),
                  limit("completion", "/usage/completion_tokens"),
                  limit("total", "/usage/total_tokens"))
    run = Run()
    stream = llm_stream(prompt=120, completion=35)
    cuts = cuts_inside(stream)
    sent_at_first = []

    def first_bytes() -> None:
        (entry,) = run.executed(shared)
        sent_at_first.append(entry.get("pieces_sent", 0))

    status, headers, body, whole = run.stream(envoy, steer(stream, cuts, interval_ms=250),
                                              cost=40, on_first=first_bytes)
    assert status == 200 and whole, (status, headers)
    assert headers["content-type"] == "text/event-stream"
    assert body == stream, "the client gets the upstream's bytes untouched"
    assert sent_at_first and sent_at_first[0] < len(cuts) + 1, \
        f"the first bytes reached the client only after {sent_at_first} of {len(cuts) + 1} " \
        "pieces were sent: the stream was held back"
    assert remaining(headers) == {"prompt": 99960, "completion": 99960, "total": 99960}, headers
    settles(shared, envoy.key_prefix, {"prompt": 120, "completion": 35, "total": 155})

    # The next request is admitted against what was charged.
    status, headers, _, _ = run.stream(envoy, steer(llm_stream(prompt=7, completion=3)), cost=1)
    assert status == 200
    assert remaining(headers) == {"prompt": 100000 - 121, "completion": 100000 - 36,
                                  "total": 100000 - 156}, headers
    settles(shared, envoy.key_prefix, {"prompt": 127, "completion": 38, "total": 165})
    assert stat(envoy, "prompt", "charged") == 127
    assert stat(envoy, "completion", "charged") == 38
    assert stat(envoy, "total", "charged") == 165
    for name in ("prompt", "completion", "total"):
        assert stat(envoy, name, "charge_missing") == 0, name
        assert stat(envoy, name, "charge_unreadable") == 0, name


def test_a_usage_beyond_the_budget_turns_the_next_request_away(shared, guard):
    """A budget of 1000 tokens: one answer of 1200 leaves nothing, so the next is `429`."""
    envoy = guard(limit("total", "/usage/total_tokens", limit_=1000,
                        cost={"header": COST, "default": 1, "max": 1000}))
    run = Run()
    status, _, body, _ = run.stream(envoy, steer(llm_stream(prompt=200, completion=1000)))
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    settles(shared, envoy.key_prefix, {"total": 1200})
    status, headers, body, _ = run.stream(envoy, steer(llm_stream()))
    assert status == 429, (status, body)
    assert json.loads(body)["violated-policies"] == ["total"]
    assert remaining(headers) == {"total": 0}, headers
    assert len(run.executed(shared)) == 1


# --- 2. a stream without its usage ---------------------------------------------------------------


def test_a_stream_cut_before_its_usage_is_charged_its_estimate(shared, guard):
    """The client leaves after the first event, the upstream resets the connection before the
    usage, the stream ends without one: each is charged its admitted estimate (40) on one
    limit, and `missing: 500` on another, counted `charge_missing`; never silently."""
    envoy = guard(limit("estimate", "/usage/total_tokens"),
                  limit("fixed", "/usage/total_tokens", missing=500))
    stream = llm_stream()
    before_usage = stream.index(b"data: {", stream.index(b"\r\r")) + 10
    endings = {
        "the client leaves": dict(upstream=steer(stream, [before_usage], interval_ms=1500),
                                  leave_after=20),
        "the upstream resets": dict(upstream=steer(stream[:before_usage], end="reset")),
        "the stream ends without it": dict(upstream=steer(
            f"data: {chunk('no usage')}\n\ndata: [DONE]\n\n".encode())),
    }
    run = Run()
    estimate = fixed = 0
    for n, (how, ending) in enumerate(endings.items(), start=1):
        status, _, body, whole = run.stream(envoy, ending["upstream"], cost=40,
                                            leave_after=ending.get("leave_after"))
        assert status == 200, how
        assert whole == (how == "the stream ends without it"), (how, body)
        estimate += 40
        fixed += 500
        settles(shared, envoy.key_prefix, {"estimate": estimate, "fixed": fixed})
        assert wait_for(lambda: stat(envoy, "estimate", "charge_missing") == n, 3.0), how
        assert stat(envoy, "fixed", "charge_missing") == n, how
        assert stat(envoy, "estimate", "charged") == estimate, how
        assert stat(envoy, "fixed", "charged") == fixed, how
    assert stat(envoy, "estimate", "charge_unreadable") == 0


def test_a_stream_cut_after_its_usage_is_charged_the_usage(shared, guard):
    """The usage arrived; the stream was cut before `[DONE]`: the usage stands."""
    envoy = guard(limit("total", "/usage/total_tokens"))
    run = Run()
    stream = llm_stream(prompt=300, completion=200)
    done = stream.index(b"data: [DONE]")
    status, _, body, whole = run.stream(envoy, steer(stream[:done], end="reset"), cost=40)
    assert status == 200 and not whole and body == stream[:done]
    settles(shared, envoy.key_prefix, {"total": 500})
    assert stat(envoy, "total", "charge_missing") == 0


# --- 3. hostile and odd streams ------------------------------------------------------------------


HOSTILE = {
    # Not the field `data` (names are case-sensitive, no space before them): not data.
    "Data: instead of data:": (b'Data: {"usage":{"total_tokens":900}}\n\n', "missing"),
    "a space before the name": (b' data: {"usage":{"total_tokens":900}}\n\n', "missing"),
    # The stream ends in the middle of the event: never dispatched.
    "no blank line after the usage": (b'data: {"usage":{"total_tokens":900}}\n', "missing"),
    # Not one JSON document.
    "two documents in one event": (b'data: {"a":1}\ndata: {"usage":{"total_tokens":900}}\n\n',
                                   "missing"),
    # Carried, but not a plain whole number, or given twice: unreadable.
    "a string": (b'data: {"usage":{"total_tokens":"900"}}\n\n', "unreadable"),
    "a fraction": (b'data: {"usage":{"total_tokens":900.0}}\n\n', "unreadable"),
    "a repeated member": (b'data: {"usage":{"total_tokens":9,"total_tokens":900}}\n\n',
                          "unreadable"),
    # One byte order mark at the start is the stream's, not the field name's.
    "a byte order mark": (b'\xef\xbb\xbfdata: {"usage":{"total_tokens":900}}\n\n', 900),
    # A later event carrying a plain number wins over an earlier unreadable one.
    "unreadable, then a number": (b'data: {"usage":{"total_tokens":-5}}\n\n'
                                  b'data: {"usage":{"total_tokens":900}}\n\n', 900),
}


@SINGLE_ONLY
@pytest.mark.parametrize("case", list(HOSTILE))
def test_what_a_hostile_stream_is_charged(shared, guard, case):
    """Cost 40, `unreadable`: 7000, `missing`: the estimate. Each stream is cut into pieces of
    5 bytes."""
    stream, want = HOSTILE[case]
    envoy = guard(limit("total", "/usage/total_tokens", unreadable=7000))
    run = Run()
    cuts = list(range(5, len(stream), 5))
    status, _, body, whole = run.stream(envoy, steer(stream, cuts, interval_ms=5), cost=40)
    assert status == 200 and whole and body == stream, case
    charged = {"missing": 40, "unreadable": 7000}.get(want, want)
    settles(shared, envoy.key_prefix, {"total": charged})
    assert wait_for(lambda: stat(envoy, "total", "charged") == charged, 3.0), case
    assert stat(envoy, "total", "charge_missing") == (want == "missing"), case
    assert stat(envoy, "total", "charge_unreadable") == (want == "unreadable"), case


# --- 4. compression --------------------------------------------------------------------------------


@SINGLE_ONLY
def test_with_envoys_compressor_after_the_filter_the_client_gets_gzip(shared, guard):
    """The client asks for gzip. Envoy's compressor, placed before the filter in the chain (so
    after it on the response's way out), takes accept-encoding off the request: the service
    streams plain text, the filter reads it, the client gets it compressed, piece by piece."""
    envoy = guard(limit("total", "/usage/total_tokens"), pre_filters=[COMPRESSOR])
    run = Run()
    stream = llm_stream(prompt=60, completion=40)
    cuts = cuts_inside(stream)
    sent_at_first = []

    def first_bytes() -> None:
        (entry,) = run.executed(shared)
        sent_at_first.append(entry.get("pieces_sent", 0))

    status, headers, body, whole = run.stream(envoy, steer(stream, cuts, interval_ms=250),
                                              cost=40, extra={"accept-encoding": "gzip"},
                                              on_first=first_bytes)
    assert status == 200 and whole, headers
    assert headers.get("content-encoding") == "gzip", headers
    assert zlib.decompress(body, 16 + zlib.MAX_WBITS) == stream
    assert sent_at_first and sent_at_first[0] < len(cuts) + 1, \
        f"the first bytes reached the client only after {sent_at_first} of {len(cuts) + 1} " \
        "pieces were sent: the compressed stream was held back"
    (entry,) = run.executed(shared)
    assert entry["accept_encoding"] is None, "the compressor took accept-encoding off"
    settles(shared, envoy.key_prefix, {"total": 100})
    assert stat(envoy, "total", "charge_unreadable") == 0


@SINGLE_ONLY
def test_a_stream_compressed_before_the_filter_is_unreadable(shared, guard):
    """A service that compresses its stream itself (here: says so): the filter cannot inflate
    it, so the limit's `unreadable` fallback applies (its cost.max, 10000), counted."""
    envoy = guard(limit("total", "/usage/total_tokens"))
    run = Run()
    stream = llm_stream()
    status, headers, body, _ = run.stream(
        envoy, {**steer(stream), "x-upstream-header-content-encoding": "gzip"}, cost=40)
    assert status == 200 and headers.get("content-encoding") == "gzip" and body == stream
    settles(shared, envoy.key_prefix, {"total": 10000})
    assert stat(envoy, "total", "charge_unreadable") == 1
    assert stat(envoy, "total", "charge_missing") == 0


# --- 5. configurations Envoy refuses -------------------------------------------------------------


REFUSED = {
    "pointer": ({"response_sse_json": "usage/total_tokens"},
                'policies[0].rate_limits[0].charge.response_sse_json: "usage/total_tokens" is not '
                'a JSON pointer (RFC 6901), e.g. "/usage/total_tokens"'),
    "missing_elsewhere": ({"response_json": "/usage/total_tokens", "missing": "cost"},
                          "policies[0].rate_limits[0].charge.missing: only applies to "
                          "response_sse_json"),
    "missing_value": ({"response_sse_json": "/usage/total_tokens", "missing": "estimate"},
                      'policies[0].rate_limits[0].charge.missing: "estimate" is not "cost", "max" '
                      "or a whole number of units from 0 to 1000000000"),
    "two_sources": ({"response_sse_json": "/a", "response_header": "x-used"},
                    "policies[0].rate_limits[0].charge: must have exactly one of response_header, "
                    "trailer, response_json, response_sse_json"),
}


@SINGLE_ONLY
@pytest.mark.parametrize("case", list(REFUSED))
def test_envoy_refuses_an_event_stream_charge_that_cannot_apply(shared, case):
    charge, message = REFUSED[case]
    config = plugin(shared, f"cg:e2e-sse:{uid()}",
                    {"name": "total", "by": ["tenant"], "algorithm": "fixed_window",
                     "limit": 1000, "window": "1h", "charge": charge})
    code, log = shared.envoy_expect_failure(config)
    assert code is not None and code != 0, log[-3000:]
    assert f"invalid plugin configuration: {message}" in log, log[-3000:]
