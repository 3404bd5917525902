"""Identity from a verified token, and policies that match on headers, end to end.

Real Envoy runs Envoy's own `jwt_authn` filter in front of the Wasm filter, configured the way
Istio's `RequestAuthentication` does it (`payload_in_metadata: "payload"`, so a claim is at
`envoy.filters.http.jwt_authn` -> `payload` -> claim), with a local JWKS inline; tokens are
HS256 JWTs signed in the test with an `oct` key. Real redis-server behind webdis and the counting
upstream, as everywhere.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid

import pytest

from harness.envoy import Envoy, Response
from harness.stack import Stack

ISSUER = "https://issuer.test"
SECRET = b"coordination-guard test signing key, 32+ bytes long"
JWT_FILTER = "envoy.filters.http.jwt_authn"
PROBLEM = "application/problem+json"


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def token(claims: dict, secret: bytes = SECRET, ttl: int = 600) -> str:
    header = {"alg": "HS256", "typ": "JWT", "kid": "k1"}
    body = {"iss": ISSUER, "iat": int(time.time()), "exp": int(time.time()) + ttl, **claims}
    signing = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(body).encode())}"
    sig = hmac.new(secret, signing.encode(), hashlib.sha256).digest()
    return f"{signing}.{b64url(sig)}"


def jwt_filter() -> dict:
    """Envoy's jwt_authn as Istio's RequestAuthentication configures it: tokens optional
    (`allow_missing`), a bad or expired one refused by Envoy itself with 401."""
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "kid": "k1", "k": b64url(SECRET)}]}
    return {
        "name": JWT_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {"test": {"issuer": ISSUER,
                                   "local_jwks": {"inline_string": json.dumps(jwks)},
                                   "payload_in_metadata": "payload", "forward": True}},
            "rules": [{"match": {"prefix": "/"},
                       "requires": {"requires_any": {"requirements": [
                           {"provider_name": "test"}, {"allow_missing": {}}]}}}],
        },
    }


def claim(name: str) -> dict:
    return {"metadata": [JWT_FILTER, "payload", name]}


def limit(name: str, n: int, by=("tenant",)) -> dict:
    return {"name": name, "by": list(by), "algorithm": "fixed_window", "limit": n,
            "window": "1m"}


def plugin(stack: Stack, prefix: str, policies: list[dict]) -> dict:
    return {"redis": stack.redis_section(key_prefix=prefix, timeout="500ms"),
            "identity": {"tenant": claim("tid"), "principal": claim("sub"),
                         "missing_tenant": "reject"},
            "policies": policies}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("identity"), None, envoys=0).start()
    yield stack
    stack.stop()


@pytest.fixture
def guard(shared, sidecars):
    def make(policies: list[dict]) -> Envoy:
        prefix = f"cg:identity:{uuid.uuid4().hex[:8]}"
        return sidecars(shared, plugin(shared, prefix, policies), prefix,
                        pre_filters=[jwt_filter()])

    return make


def call(envoy: Envoy, path: str = "/api/x", jwt: str | None = None, method: str = "GET",
         headers: dict | None = None, body: bytes | None = None) -> Response:
    h = dict(headers or {})
    if jwt:
        h["authorization"] = f"Bearer {jwt}"
    return envoy.request(method, path, headers=h, body=body)


def rl_stat(envoy: Envoy, policy: str, lim: str, what: str) -> int:
    return envoy.stat(f"wasmcustom.cg.policy.{policy}.limit.{lim}.{what}")


def test_per_tenant_limits_follow_the_tokens_claim(shared, guard):
    envoy = guard([{"name": "api", "match": {"path_prefix": "/api"},
                    "rate_limits": [limit("tenant", 2)]}])
    a, b = token({"tid": "tenant-a", "sub": "u1"}), token({"tid": "tenant-b", "sub": "u2"})
    assert [call(envoy, jwt=a).status for _ in range(3)] == [200, 200, 429]
    # Tenant B has a counter of its own.
    assert [call(envoy, jwt=b).status for _ in range(2)] == [200, 200]
    # An integer claim is its decimal text: tenant 42 is a tenant like any other.
    n = token({"tid": 42, "sub": "u3"})
    assert [call(envoy, jwt=n).status for _ in range(3)] == [200, 200, 429]


def test_a_forged_tenant_header_changes_nothing(shared, guard):
    """A valid token for tenant A and `x-tenant-id: B`: counted under A; B's quota untouched."""
    envoy = guard([{"name": "api", "match": {"path_prefix": "/api"},
                    "rate_limits": [limit("tenant", 1)]}])
    a = token({"tid": "tenant-a", "sub": "u1"})
    forged = {"x-tenant-id": "tenant-b"}
    assert call(envoy, jwt=a, headers=forged).status == 200
    assert call(envoy, jwt=a, headers=forged).status == 429, "counted under A"
    b = token({"tid": "tenant-b", "sub": "u2"})
    assert call(envoy, jwt=b).status == 200, "B's quota was not touched"


def test_no_token_is_a_missing_tenant_and_a_bad_token_never_reaches_the_filter(shared, guard):
    envoy = guard([{"name": "api", "match": {"path_prefix": "/api"},
                    "rate_limits": [limit("tenant", 5)]}])
    mark = len(shared.upstream.requests())
    # No token (allowed by jwt_authn): the filter has no tenant, and the header is ignored.
    r = call(envoy, headers={"x-tenant-id": "tenant-a"})
    assert r.status == 401 and r.headers.get("content-type") == PROBLEM, r
    assert r.json()["type"].endswith(":missing_tenant")
    # Expired, or signed with another key: Envoy's own 401, never the filter's.
    expired = token({"tid": "tenant-a", "sub": "u1"}, ttl=-120)
    forged = token({"tid": "tenant-a", "sub": "u1"}, secret=b"another key, also 32+ bytes long!")
    for bad in (expired, forged):
        r = call(envoy, jwt=bad)
        assert r.status == 401 and r.headers.get("content-type") != PROBLEM, r
    assert rl_stat(envoy, "api", "tenant", "allowed") == 0
    assert len(shared.upstream.requests()) == mark, "nothing reached the service"


def test_the_principal_comes_from_sub(shared, guard):
    """`sub` drives a per-principal limit and the idempotency fingerprint."""
    envoy = guard([
        {"name": "api", "match": {"path_prefix": "/api"},
         "rate_limits": [limit("user", 1, by=("tenant", "principal"))]},
        {"name": "orders", "match": {"methods": ["POST"], "path_prefix": "/orders"},
         "idempotency": {"fingerprint": ["method", "path", "principal", "body"]}},
    ])
    alice, bob = token({"tid": "t1", "sub": "alice"}), token({"tid": "t1", "sub": "bob"})
    forged = {"x-user-id": "bob"}
    assert call(envoy, jwt=alice, headers=forged).status == 200
    assert call(envoy, jwt=alice).status == 429, "alice's own counter"
    assert call(envoy, jwt=bob).status == 200, "bob's counter is his"
    key = {"idempotency-key": f'"{uuid.uuid4().hex}"', "content-type": "application/json"}
    first = call(envoy, "/orders", alice, "POST", key, b'{"a":1}')
    assert first.status == 200, first
    again = call(envoy, "/orders", alice, "POST", key, b'{"a":1}')
    assert again.headers.get("idempotent-replayed") == "true", again
    # The same key and body from another principal is another request.
    other = call(envoy, "/orders", bob, "POST", key, b'{"a":1}')
    assert other.status == 422 and other.json()["type"].endswith(":idempotency_key_conflict")


def test_policies_match_on_headers(shared, guard):
    """One policy per plan tier, chosen by a header the auth layer sets; a repeated header
    matches nothing (and falls through to the next policy)."""
    envoy = guard([
        {"name": "gold", "match": {"path_prefix": "/api", "headers": [
            {"name": "x-plan", "exact": "gold"}]}, "rate_limits": [limit("tenant", 3)]},
        {"name": "free", "match": {"path_prefix": "/api", "headers": [
            {"name": "x-plan", "prefix": "fr"}, {"name": "x-beta", "present": False}]},
         "rate_limits": [limit("tenant", 1)]},
        {"name": "rest", "match": {"path_prefix": "/api"}, "rate_limits": [limit("tenant", 100)]},
    ])
    t = token({"tid": f"t-{uuid.uuid4().hex[:6]}", "sub": "u"})
    assert [call(envoy, jwt=t, headers={"x-plan": "gold"}).status for _ in range(4)] == \
        [200, 200, 200, 429]
    u = token({"tid": f"t-{uuid.uuid4().hex[:6]}", "sub": "u"})
    assert [call(envoy, jwt=u, headers={"x-plan": "free"}).status for _ in range(2)] == [200, 429]
    assert rl_stat(envoy, "gold", "tenant", "allowed") == 3
    assert rl_stat(envoy, "free", "tenant", "allowed") == 1
    # `present: false`: a beta user on the free plan is not the free policy's.
    v = token({"tid": f"t-{uuid.uuid4().hex[:6]}", "sub": "u"})
    assert call(envoy, jwt=v, headers={"x-plan": "free", "x-beta": "1"}).status == 200
    assert rl_stat(envoy, "rest", "tenant", "allowed") == 1
    # A repeated x-plan matches neither tier.
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=10)
    try:
        conn.putrequest("GET", "/api/x")
        conn.putheader("authorization", f"Bearer {v}")
        conn.putheader("x-plan", "gold")
        conn.putheader("x-plan", "gold")
        conn.endheaders()
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    assert rl_stat(envoy, "gold", "tenant", "allowed") == 3
    assert rl_stat(envoy, "rest", "tenant", "allowed") == 2
