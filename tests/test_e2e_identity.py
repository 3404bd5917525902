"""Identity from a verified token, and policies that match on headers, end to end.

Real Envoy runs Envoy's own `jwt_authn` filter in front of the Wasm filter, configured the way
Istio's `RequestAuthentication` does it (`payload_in_metadata: "payload"`, so a claim is at
`envoy.filters.http.jwt_authn` -> `payload` -> claim), with a local JWKS inline; tokens are
HS256 JWTs signed in the test with an `oct` key. Real redis-server behind webdis and the counting
upstream, as everywhere.

A claim is read with its type: numeric, string, huge, fractional and other claims each get the
answer docs/configuration.md gives them (see "claims read with their type" below), and the
bucket of callers without a tenant is no real tenant's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import struct
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


def plugin(stack: Stack, prefix: str, policies: list[dict],
           missing_tenant: str = "reject", principal: str = "sub") -> dict:
    return {"redis": stack.redis_section(key_prefix=prefix, timeout="500ms"),
            "identity": {"tenant": claim("tid"), "principal": claim(principal),
                         "missing_tenant": missing_tenant},
            "policies": policies}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("identity"), None, envoys=0).start()
    yield stack
    stack.stop()


@pytest.fixture
def guard(shared, sidecars):
    def make(policies: list[dict], missing_tenant: str = "reject", principal: str = "sub") -> Envoy:
        prefix = f"cg:identity:{uuid.uuid4().hex[:8]}"
        return sidecars(shared, plugin(shared, prefix, policies, missing_tenant, principal), prefix,
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
    assert r.json()["type"].endswith("#missing_tenant")
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
    assert other.status == 422 and other.json()["type"].endswith("#idempotency_key_conflict")


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


# --- claims read with their type ----------------------------------------------------------------

MAX_SAFE = 2**53 - 1  # the largest integer a double (as jwt_authn keeps a JSON number) holds exactly


def api_policy(n: int, by=("tenant",)) -> list[dict]:
    return [{"name": "api", "match": {"path_prefix": "/api"}, "rate_limits": [limit("tenant", n, by)]}]


def test_a_numeric_claim_is_its_number_never_its_bytes_read_as_text(shared, guard):
    """The 8 bytes of the double 5419773080977729 spell "AAAAAA3C": the filter read the bytes
    as that string when they were printable, so the numeric tenant and the tenant "AAAAAA3C"
    shared one counter. Now the claim's type comes from the host: two tenants."""
    envoy = guard(api_policy(1))
    number, text = 5419773080977729, "AAAAAA3C"
    assert struct.pack("<d", float(number)) == text.encode()
    assert call(envoy, jwt=token({"tid": number, "sub": "u"})).status == 200
    assert call(envoy, jwt=token({"tid": text, "sub": "u"})).status == 200, "a tenant of its own"
    assert call(envoy, jwt=token({"tid": number, "sub": "u"})).status == 429
    assert call(envoy, jwt=token({"tid": text, "sub": "u"})).status == 429
    # An integer is its decimal text, whatever its spelling in the token.
    assert call(envoy, jwt=token({"tid": str(number), "sub": "u"})).status == 429
    for edge in (MAX_SAFE, -MAX_SAFE, 0):
        assert call(envoy, jwt=token({"tid": edge, "sub": "u"})).status == 200, edge


@pytest.mark.parametrize("missing_tenant", ["reject", "anonymous"])
def test_a_claim_that_names_no_one_tenant_is_refused(shared, guard, missing_tenant):
    """A number a double cannot hold exactly (2^53 and 2^53+1 arrive as one double; a 64-bit
    snowflake id loses its last digits), a fraction, a boolean, a map, a list or null is not a
    tenant: 401 missing_tenant, even under `missing_tenant: anonymous` (they once shared the
    bucket of unauthenticated callers, or each other's), and nothing reaches the service."""
    envoy = guard(api_policy(100), missing_tenant=missing_tenant)
    mark = len(shared.upstream.requests())
    for tid in (2**53, 2**53 + 1, 1_234_567_890_123_456_789, -(2**53), 1.5, 1e300, True,
                {"id": "acme"}, ["acme"], None, "acme\u0001"):
        r = call(envoy, jwt=token({"tid": tid, "sub": "u"}))
        assert r.status == 401 and r.headers.get("content-type") == PROBLEM, (tid, r)
        body = r.json()
        assert body["type"].endswith("#missing_tenant"), (tid, body)
        assert "tid claim" in body["detail"], (tid, body)
        assert r.headers.get("www-authenticate") == "Bearer", (tid, r)
    assert len(shared.upstream.requests()) == mark, "nothing reached the service"
    assert envoy.stat("wasmcustom.cg.policy.api.missing_tenant") == 11


def test_a_principal_claim_that_names_no_one_principal_is_refused(shared, guard):
    """The same for the principal (a numeric `uid` claim; jwt_authn itself refuses a `sub`
    that is not a string): a uid of 2^53 + 1 would share a per-principal counter with 2^53, a
    boolean one with every caller that has no principal."""
    envoy = guard(api_policy(100, by=("tenant", "principal")), principal="uid")
    for uid_claim in (2**53 + 1, 2.5, False, {"a": 1}):
        r = call(envoy, jwt=token({"tid": "t-uid", "uid": uid_claim}))
        assert r.status == 400 and r.headers.get("content-type") == PROBLEM, (uid_claim, r)
        body = r.json()
        assert body["type"].endswith("#ambiguous_principal"), (uid_claim, body)
        assert "uid claim" in body["detail"], (uid_claim, body)
    assert call(envoy, jwt=token({"tid": "t-uid", "uid": 7})).status == 200
    assert call(envoy, jwt=token({"tid": "t-uid"})).status == 200, "no principal: anonymous"


def test_a_real_tenant_named_anonymous_is_not_the_anonymous_bucket(shared, guard):
    """Under `missing_tenant: anonymous`, callers without a tenant share one bucket, which no
    real tenant can name: a token whose tid is "anonymous" has a counter of its own."""
    envoy = guard(api_policy(1), missing_tenant="anonymous")
    assert call(envoy).status == 200, "no token: the anonymous bucket"
    assert call(envoy).status == 429
    assert call(envoy, jwt=token({"tid": "anonymous", "sub": "u"})).status == 200
    assert call(envoy, jwt=token({"tid": "anonymous", "sub": "u"})).status == 429
