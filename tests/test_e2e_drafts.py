"""End-to-end: the RateLimit headers and the problem types to the letter of the drafts.

draft-ietf-httpapi-ratelimit-headers-10 and RFC 9457, as a client reads them from real Envoy
with the filter, webdis and redis-server (docs/ratelimit-headers.md, docs/problems.md):

- a `429` has the registered quota-exceeded problem type and lists the limits it violated,
  and only those, in `violated-policies` and both headers, none with a `t` later than its
  `Retry-After`;
- `r` is never above `q`: a token bucket shows its capacity over the time it takes to fill;
- a concurrency limit is in the headers with `qu="concurrent-requests"`, a limit counted in a
  unit of the service's own with that unit;
- every other problem's `type` is `problem_type_base` and its name, the Idempotency-Key
  problems with a `Link` to it;
- a busy lease's `Retry-After` is the holder's remaining time, and the limit headers on that
  answer never reset later than it.
"""

from __future__ import annotations

import re
import time

import pytest

from harness.concurrency import in_thread, wait_for
from harness.problems import DOCS, QUOTA_EXCEEDED
from test_e2e_ratelimit import plugin, post, retry_after, rl, start

pytestmark = pytest.mark.topologies("single")

TENANT = "x-tenant-id"
PROBLEM_JSON = "application/problem+json"
# Items as draft-10 writes them: an sf-string name, then integer or sf-string parameters.
ITEM = re.compile(r'"([A-Za-z0-9_-]+)"((?:;[a-z]+=(?:\d+|"[a-z0-9-]+"))*)')


def items(value: str) -> dict[str, dict[str, int | str]]:
    """`"a";q=1;qu="x";w=2, "b";r=3` -> {"a": {"q": 1, "qu": "x", "w": 2}, "b": {"r": 3}};
    fails on any other syntax."""
    out: dict[str, dict[str, int | str]] = {}
    for raw in value.split(", "):
        m = ITEM.fullmatch(raw)
        assert m, f"not draft-10 syntax: {raw!r} in {value!r}"
        params: dict[str, int | str] = {}
        for p in m.group(2).split(";")[1:]:
            k, v = p.split("=", 1)
            params[k] = v.strip('"') if v.startswith('"') else int(v)
        out[m.group(1)] = params
    return out


def headers_of(resp) -> tuple[dict, dict]:
    """(RateLimit-Policy items, RateLimit items), the same names in the same order."""
    policy = items(resp.headers["ratelimit-policy"])
    state = items(resp.headers["ratelimit"])
    assert list(policy) == list(state), resp
    return policy, state


def quota_exceeded(resp, violated: list[str]) -> dict:
    assert resp.status == 429, resp
    assert resp.headers.get("content-type") == PROBLEM_JSON, resp
    body = resp.json()
    assert body["type"] == QUOTA_EXCEEDED, body
    assert body["title"] == "Quota Exceeded", body
    assert body["status"] == 429, body
    assert body["violated-policies"] == violated, body
    return body


def test_a_429_is_quota_exceeded_and_shows_only_the_limits_it_violated(stack_factory):
    """Per tenant 2 a minute beside a large hourly quota: the allowed answers show both, the
    tighter first; the 429 shows the minute limit alone (the hourly one resets an hour later
    than the Retry-After, which the draft does not allow), named as in violated-policies."""
    stack = start(stack_factory, [{"name": "orders", "rate_limits": [
        rl("hourly", limit=1000, window="1h"), rl("minute", limit=2, window="60s")]}])
    envoy = stack.envoy
    for left in (1, 0):
        ok = post(envoy)
        assert ok.status == 200, ok
        policy, state = headers_of(ok)
        assert list(policy) == ["minute", "hourly"], ok
        assert policy == {"minute": {"q": 2, "w": 60}, "hourly": {"q": 1000, "w": 3600}}
        assert state["minute"]["r"] == left and 1 <= state["minute"]["t"] <= 60, ok
        assert state["hourly"]["r"] <= policy["hourly"]["q"], ok

    rejected = post(envoy)
    body = quota_exceeded(rejected, ["minute"])
    assert body["detail"].startswith('rate limit "minute"'), body
    policy, state = headers_of(rejected)
    assert policy == {"minute": {"q": 2, "w": 60}}, rejected
    wait = retry_after(rejected)
    assert state["minute"]["r"] == 0 and 1 <= state["minute"]["t"] <= wait <= 60, rejected
    assert stack.upstream.count("POST", "/orders") == 2


def test_a_sliding_windows_reset_is_never_later_than_the_retry_after(stack_factory):
    """A sliding window's full quota comes back only after the next aligned window, but a
    request fits much earlier: the 429's `t` is when the next unit comes back, which is when
    the request fits, not the full restore."""
    stack = start(stack_factory, [{"name": "orders", "rate_limits": [
        rl("tenant", limit=3, window="60s", algorithm="sliding_window")]}])
    envoy = stack.envoy
    for _ in range(3):
        assert post(envoy).status == 200
    rejected = post(envoy)
    quota_exceeded(rejected, ["tenant"])
    _, state = headers_of(rejected)
    assert state["tenant"]["r"] == 0, rejected
    assert state["tenant"]["t"] <= retry_after(rejected), rejected


def test_a_token_bucket_shows_its_capacity_so_remaining_never_exceeds_the_quota(stack_factory):
    """5 a second with a burst of 10: `q=10;w=2` (10 tokens, full in 2 s), `r` up to 10, the
    next token within a second; the 11th request of a burst waits for that token."""
    stack = start(stack_factory, [{"name": "orders", "rate_limits": [
        rl("burst", limit=5, window="1s", algorithm="token_bucket", burst=10)]}])
    envoy = stack.envoy
    seen = []
    for _ in range(10):
        ok = post(envoy)
        assert ok.status == 200, ok
        policy, state = headers_of(ok)
        assert policy == {"burst": {"q": 10, "w": 2}}, ok
        assert state["burst"]["r"] <= 10 and state["burst"]["t"] <= 1, ok
        seen.append(state["burst"]["r"])
    assert seen[0] == 9 and seen == sorted(seen, reverse=True), seen
    rejected = post(envoy)
    if rejected.status == 200:  # a token came back during the burst: spend it
        rejected = post(envoy)
    quota_exceeded(rejected, ["burst"])
    _, state = headers_of(rejected)
    assert state["burst"] == {"r": 0, "t": 1} and retry_after(rejected) == 1, rejected


def test_a_concurrency_limit_is_in_the_headers_in_concurrent_requests(stack_factory):
    """One request in flight per tenant: the admitted request's answer shows the limit with
    `qu="concurrent-requests"`, no window and no reset; a second one while it runs is a 429
    quota-exceeded with `r=0` and `Retry-After: 1`."""
    stack = start(stack_factory, [{"name": "orders", "rate_limits": [
        {"name": "inflight", "by": ["tenant"], "algorithm": "concurrency", "limit": 1,
         "window": "30s"}]}])
    envoy = stack.envoy
    slow = in_thread(post, envoy, headers={"x-upstream-delay-ms": "1500"})
    assert wait_for(lambda: len(stack.upstream.in_flight()) == 1, 5.0), "never forwarded"
    busy = post(envoy)
    body = quota_exceeded(busy, ["inflight"])
    assert body["detail"].startswith('concurrency limit "inflight"'), body
    assert busy.headers["ratelimit-policy"] == '"inflight";q=1;qu="concurrent-requests"', busy
    assert busy.headers["ratelimit"] == '"inflight";r=0', busy
    assert busy.headers["retry-after"] == "1", busy
    done = slow()
    assert done.status == 200, done
    assert headers_of(done) == ({"inflight": {"q": 1, "qu": "concurrent-requests"}},
                                {"inflight": {"r": 0}}), done


def test_a_limit_counted_in_tokens_says_so(stack_factory):
    """A cost limit with `unit: tokens` shows `qu="tokens"`, and `r` in tokens."""
    stack = start(stack_factory, [{"name": "llm", "rate_limits": [
        rl("tokens", limit=1000, window="60s", cost={"header": "x-tokens", "max": 500},
           unit="tokens"),
        rl("calls", limit=100, window="60s")]}])
    ok = post(stack.envoy, path="/llm", headers={"x-tokens": "40"})
    assert ok.status == 200, ok
    policy, state = headers_of(ok)
    assert policy == {"calls": {"q": 100, "w": 60},
                      "tokens": {"q": 1000, "qu": "tokens", "w": 60}}, ok
    assert state["tokens"]["r"] == 960 and state["calls"]["r"] == 99, ok


def test_problem_types_are_the_configured_base_and_idempotency_errors_link_to_it(stack_factory):
    """`problem_type_base` set: a missing tenant's `type` is it and the problem's name; the
    Idempotency-Key errors (missing, reused for another body, in progress) carry a `Link`
    to the same documentation; a 429 keeps the registered type."""
    base = "https://api.example.com/problems/"
    stack = start(stack_factory, [{
        "name": "orders", "rate_limits": [rl("tenant", limit=4)],
        "idempotency": {"processing_ttl": "30s"}}], problem_type_base=base)
    envoy = stack.envoy

    def idem(key: str | None, body: bytes, **headers: str):
        h = {TENANT: "acme", "content-type": "application/json", **headers}
        if key is not None:
            h["idempotency-key"] = key
        return envoy.request("POST", "/orders", headers=h, body=body)

    no_tenant = post(envoy, tenant=None)
    assert no_tenant.status == 401 and no_tenant.json()["type"] == base + "missing_tenant"
    assert "link" not in no_tenant.headers, no_tenant

    missing = idem(None, b"{}")
    assert missing.status == 400, missing
    assert missing.json()["type"] == base + "idempotency_key_missing", missing
    assert missing.headers["link"] == f'<{base}idempotency_key_missing>; rel="describedby"'

    running = in_thread(idem, '"k-1"', b'{"a":1}', **{"x-upstream-delay-ms": "1500"})
    assert wait_for(lambda: len(stack.upstream.in_flight()) == 1, 5.0), "never forwarded"
    in_use = idem('"k-1"', b'{"a":1}')
    assert in_use.status == 409 and in_use.json()["type"] == base + "idempotency_key_in_use"
    assert in_use.headers["link"] == f'<{base}idempotency_key_in_use>; rel="describedby"'
    # The in-progress answer's Retry-After is 1: the minute limit's reset is later, so
    # neither limit header is on it.
    assert in_use.headers["retry-after"] == "1", in_use
    assert "ratelimit" not in in_use.headers and "ratelimit-policy" not in in_use.headers
    assert running().status == 200

    conflict = idem('"k-1"', b'{"a":2}')
    assert conflict.status == 422, conflict
    assert conflict.json()["type"] == base + "idempotency_key_conflict", conflict
    assert conflict.headers["link"] == f'<{base}idempotency_key_conflict>; rel="describedby"'
    # A replay has no Retry-After: the limit headers are on it. Every request that reached
    # the limits counted (the first, the one in progress, the conflict, the replay); the
    # missing key was refused before.
    replay = idem('"k-1"', b'{"a":1}')
    assert replay.headers.get("idempotent-replayed") == "true", replay
    assert items(replay.headers["ratelimit"])["tenant"]["r"] == 0, replay

    over = idem('"k-2"', b"{}")
    assert over.status == 429 and over.json()["type"] == QUOTA_EXCEEDED, over


def test_the_default_problem_type_opens_the_projects_page(stack_factory):
    stack = start(stack_factory, [{"name": "orders", "rate_limits": [rl("tenant", limit=5)]}])
    resp = post(stack.envoy, tenant=None)
    assert resp.status == 401 and resp.json()["type"] == DOCS + "missing_tenant", resp
    assert DOCS.endswith("/docs/problems.md#")


def test_a_busy_lease_says_the_holders_remaining_time(stack_factory):
    """A lease of 8 s, not extended, taken 3 s ago: the second request's Retry-After is what
    is left of it (5 s, not the 8 s TTL), and the hourly limit's headers, which reset later
    than that, are left off the 409."""
    stack = start(stack_factory, [{
        "name": "activate", "match": {"methods": ["POST"], "path_prefix": "/orders/"},
        "rate_limits": [rl("hourly", limit=100, window="1h")],
        "lease": {"resource": ["tenant", "path_segment:2"], "ttl": "8s", "extend": False}}])
    envoy = stack.envoy
    holder = in_thread(post, envoy, path="/orders/42/activate",
                       headers={"x-upstream-delay-ms": "4500"})
    assert wait_for(lambda: len(stack.upstream.in_flight()) == 1, 5.0), "never forwarded"
    started = time.monotonic()
    time.sleep(3.0)
    busy = post(envoy, path="/orders/42/activate")
    held_for = time.monotonic() - started
    assert busy.status == 409, busy
    assert busy.json()["type"] == DOCS + "resource_locked", busy
    wait = retry_after(busy)
    assert wait < 8, busy
    assert 8 - held_for - 1 <= wait <= 8 - held_for + 1, (busy, held_for)
    assert "ratelimit" not in busy.headers and "ratelimit-policy" not in busy.headers, busy
    assert holder().status == 200


@pytest.mark.parametrize("base,message", [
    ("urn:coordination-guard:problem:", "is not an absolute https:// or http:// URI"),
    ("https://example.com/problems", "must end with '/', '#' or '='"),
    ('https://example.com/"x"/', "holds a character a URI cannot"),
])
def test_envoy_refuses_a_problem_type_base_that_is_no_uri_prefix(stack_factory, base, message):
    stack = stack_factory(None, envoys=0)
    config = plugin(stack, [{"name": "orders", "rate_limits": [rl("tenant")]}],
                    problem_type_base=base)
    code, log = stack.envoy_expect_failure(config)
    assert code is not None and code != 0, log[-3000:]
    assert "invalid plugin configuration: problem_type_base: " in log, log[-3000:]
    assert message in log, log[-3000:]


def test_envoy_refuses_a_unit_that_is_no_sf_token(stack_factory):
    stack = stack_factory(None, envoys=0)
    config = plugin(stack, [{"name": "orders", "rate_limits": [
        rl("tenant", unit='tok"ens')]}])
    code, log = stack.envoy_expect_failure(config)
    assert code is not None and code != 0, log[-3000:]
    assert ('invalid plugin configuration: policies[0].rate_limits[0].unit: "tok\\"ens" is not '
            "a quota unit") in log, log[-3000:]
