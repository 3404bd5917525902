"""The chaos run's plugin configuration, and what the workload and the checker read of it.

One policy per route of the chaos service (chaos/service.py), its gRPC methods too. Windows
and TTLs are short so that a schedule heals within seconds: every rate limit counts per second
(the leased one per 4 s), a record in progress and a lease live 2 s, a concurrency slot 2 s.
Every policy fails closed but `rl-open`, whose admissions the checker counts only where Redis answered (a response with
`RateLimit` headers): failing open admits without counting by design.

`ROUTES` describes each route for the workload (what to send) and the checker (what the
filter must guarantee on it); `plugin_config()` is the JSON the Envoys load.
"""

from __future__ import annotations

import copy

KEY_PREFIX = "cg:chaos"
REDIS_TIMEOUT_MS = 150
TENANT_HEADER = "x-tenant-id"
PRINCIPAL_HEADER = "x-user-id"
COST_HEADER = "x-cost"
CHARGE_HEADER = "x-charge"
PROCESSING_TTL_MS = 2000
COMPLETED_TTL_MS = 20000
LEASE_TTL_MS = 2000
SLOT_WINDOW_MS = 2000
IDEM_MAX_WAIT_MS = 1000
LEASE_MAX_WAIT_MS = 1000
LEASED_LIMIT = 24
LEASED_WINDOW_MS = 4000
# The longest TTL of a key that must be gone after a schedule: a record in progress, a lease,
# a concurrency slot (a rate-limit counter may stay: see counter_ttls_ms).
SETTLE_MS = max(PROCESSING_TTL_MS, LEASE_TTL_MS, SLOT_WINDOW_MS)
# A cancellation marker's TTL: the largest of processing_ttl, the lease ttl and 60 s.
CANCEL_TTL_MS = max(PROCESSING_TTL_MS, LEASE_TTL_MS, 60000)

# Rate-limited routes: GET /rl/<name>, one policy `rl-<name>` each. `limits` are the policy's
# rate limits as configured, `checked` the ones the checker verifies per counter.
RATE_LIMITED = {
    "fw": {"limits": [{"name": "fw", "by": ["tenant"], "algorithm": "fixed_window",
                       "limit": 3, "window": "1s"}]},
    "sw": {"limits": [{"name": "sw", "by": ["tenant"], "algorithm": "sliding_window",
                       "limit": 3, "window": "1s"}]},
    "sl": {"limits": [{"name": "sl", "by": ["tenant"], "algorithm": "sliding_log",
                       "limit": 3, "window": "1s"}]},
    "tb": {"limits": [{"name": "tb", "by": ["tenant"], "algorithm": "token_bucket",
                       "limit": 3, "window": "1s", "burst": 2}]},
    "cc": {"limits": [{"name": "cc", "by": ["tenant"], "algorithm": "concurrency",
                       "limit": 2, "window": f"{SLOT_WINDOW_MS}ms"}]},
    "cost": {"limits": [{"name": "cost", "by": ["tenant"], "algorithm": "fixed_window",
                         "limit": 8, "window": "1s",
                         "cost": {"header": COST_HEADER, "default": 1, "max": 4},
                         "charge": {"response_header": CHARGE_HEADER, "unreadable": "cost"}}]},
    # Two hash slots: the tenant's counter and one for the whole policy (by: []).
    "multi": {"limits": [{"name": "tenant", "by": ["tenant"], "algorithm": "fixed_window",
                          "limit": 3, "window": "1s"},
                         {"name": "global", "by": [], "algorithm": "sliding_window",
                          "limit": 5, "window": "1s"}]},
    "open": {"limits": [{"name": "open", "by": ["tenant"], "algorithm": "fixed_window",
                         "limit": 3, "window": "1s"}], "failure_mode": "fail_open"},
    # Leased quota: each Envoy worker takes slices of the window's quota (an eighth of what is
    # left, at least one: 3 from an empty counter of 24, then 2, ...) and admits from them
    # locally. One counter for the whole policy (by: []), so the four workers of the two
    # Envoys share it. Its window is longer than the others': what the checker can bound is
    # twice the limit within a window (see chaos/checker.py), and the workload's bursts send
    # well over that in one, so an admission beyond the slices would show.
    "leased": {"limits": [{"name": "leased", "by": [], "algorithm": "fixed_window",
                           "limit": LEASED_LIMIT, "window": f"{LEASED_WINDOW_MS}ms",
                           "mode": "leased"}]},
}

# gRPC methods of the service (`cg.test.Chaos`, under the Envoys' `/cg.test.` route to its
# gRPC port): policy `grpc-<name>` each, matched by the method's path. The filter answers a
# gRPC call with trailers-only gRPC statuses (docs/design.md#grpc).
GRPC_SERVICE = "cg.test.Chaos"
GRPC_METHODS = {"rl": "Limited", "idem": "Create", "lease": "Lease"}
GRPC_RESOURCE_HEADER = "x-chaos-resource"
GRPC_RATE_LIMIT = [{"name": "grpc", "by": ["tenant"], "algorithm": "fixed_window", "limit": 3,
                    "window": "1s"}]
# The gRPC codes after which the filter releases an idempotency record (the default
# `retryable_grpc_codes`: UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED).
RETRYABLE_GRPC_CODES = (14, 4, 8, 10)


def counter_ttls_ms() -> dict[str, int]:
    """The longest TTL a rate-limit key of each policy may have: two windows for a sliding
    window (its previous window still counts), a token bucket's `burst + 1` emission
    intervals (its theoretical arrival time at most that far ahead), one window for the
    others (a concurrency limit's `window` is its slots' lifetime)."""
    out: dict[str, int] = {}
    specs = [(f"rl-{name}", spec) for name, spec in RATE_LIMITED.items()]
    specs.append(("grpc-rl", {"limits": GRPC_RATE_LIMIT}))
    for policy, spec in specs:
        for limit in spec["limits"]:
            window = millis(limit["window"])
            if limit["algorithm"] == "sliding_window":
                ttl = 2 * window
            elif limit["algorithm"] == "token_bucket":
                ttl = -(-(limit.get("burst", limit["limit"]) + 1) * window // limit["limit"])
            else:
                ttl = window
            out[policy] = max(out.get(policy, 0), ttl)
    return out

# Idempotent routes: POST /idem/<variant>/<key>, policy `idem-<variant>`.
IDEMPOTENT = {
    "reject": {"in_progress": "reject"},
    "wait": {"in_progress": "wait", "max_wait": f"{IDEM_MAX_WAIT_MS}ms"},
    "async": {"in_progress": "reject", "complete": "async"},
    # The service answers an event stream: completed by reference at its end.
    "stream": {"in_progress": "reject"},
}

# Lease-guarded routes: POST /lease/<variant>/<resource> (GET for the stream), policy
# `lease-<variant>`; the resource is the tenant and the path's third segment.
LEASED = {
    "reject": {"on_busy": "reject"},
    "wait": {"on_busy": "wait", "max_wait": f"{LEASE_MAX_WAIT_MS}ms"},
    "stream": {"on_busy": "reject"},
}


def millis(duration: str) -> int:
    """`"250ms"`, `"2s"` -> milliseconds (the units this configuration uses)."""
    if duration.endswith("ms"):
        return int(duration[:-2])
    if duration.endswith("s"):
        return int(duration[:-1]) * 1000
    raise ValueError(f"unsupported duration {duration!r}")


def _rate_policy(name: str, spec: dict) -> dict:
    return {
        "name": f"rl-{name}",
        "match": {"methods": ["GET"], "path_exact": f"/rl/{name}"},
        "failure_mode": spec.get("failure_mode", "fail_closed"),
        "rate_limits": copy.deepcopy(spec["limits"]),
    }


def _idem_policy(variant: str, spec: dict) -> dict:
    idem = {"header": "idempotency-key", "required": True, "methods": ["POST"],
            "processing_ttl": f"{PROCESSING_TTL_MS}ms", "completed_ttl": f"{COMPLETED_TTL_MS}ms",
            "fingerprint": ["method", "path", "principal", "body"], "conflict_status": 422}
    idem.update(spec)
    return {"name": f"idem-{variant}",
            "match": {"methods": ["POST"], "path_prefix": f"/idem/{variant}/"},
            "failure_mode": "fail_closed", "idempotency": idem}


def _lease_policy(variant: str, spec: dict) -> dict:
    lease = {"resource": ["tenant", "path_segment:3"], "ttl": f"{LEASE_TTL_MS}ms",
             "fencing_header": "x-fencing-token", "extend": True}
    lease.update(spec)
    method = "GET" if variant == "stream" else "POST"
    return {"name": f"lease-{variant}",
            "match": {"methods": [method], "path_prefix": f"/lease/{variant}/"},
            "failure_mode": "fail_closed", "lease": lease}


def grpc_path(name: str) -> str:
    """The path of the gRPC method of route `grpc/<name>`."""
    return f"/{GRPC_SERVICE}/{GRPC_METHODS[name]}"


def _grpc_policies() -> list[dict]:
    """A fail_closed rate limit on `Limited`, idempotency on `Create` (a server-streaming
    method), a lease on `Lease` whose resource is a metadata entry."""
    rl = {"name": "grpc-rl", "match": {"methods": ["POST"], "path_exact": grpc_path("rl")},
          "failure_mode": "fail_closed", "rate_limits": copy.deepcopy(GRPC_RATE_LIMIT)}
    idem = _idem_policy("grpc", {"in_progress": "reject"})
    idem.update(name="grpc-idem", match={"methods": ["POST"], "path_exact": grpc_path("idem")})
    lease = _lease_policy("grpc", {"on_busy": "wait", "max_wait": f"{LEASE_MAX_WAIT_MS}ms",
                                   "resource": ["tenant", f"header:{GRPC_RESOURCE_HEADER}"]})
    lease.update(name="grpc-lease", match={"methods": ["POST"], "path_exact": grpc_path("lease")})
    return [rl, idem, lease]


def plugin_config(authorization: str | None = None, key_prefix: str = KEY_PREFIX,
                  cluster: str = "redis_gateway") -> dict:
    """The plugin JSON of the chaos run. Without `authorization` the `redis` block has none:
    the target that knows webdis's credentials adds it."""
    redis = {"protocol": "webdis", "cluster": cluster, "authority": "redis-gateway",
             "timeout": f"{REDIS_TIMEOUT_MS}ms", "key_prefix": key_prefix}
    if authorization is not None:
        redis["authorization"] = authorization
    policies = [_rate_policy(n, s) for n, s in RATE_LIMITED.items()]
    policies += [_idem_policy(v, s) for v, s in IDEMPOTENT.items()]
    policies += [_lease_policy(v, s) for v, s in LEASED.items()]
    policies += _grpc_policies()
    return {
        "redis": redis,
        "identity": {"tenant_header": TENANT_HEADER, "principal_header": PRINCIPAL_HEADER,
                     "missing_tenant": "reject"},
        "failure_mode": "fail_closed",
        "response_headers": True,
        "policies": policies,
    }


def checked_limits() -> list[dict]:
    """Every rate limit the checker verifies: route, limit name, algorithm, mode (`exact` or
    `leased`), limit, window (ms), burst, whether it counts per tenant, and the policy's
    failure mode."""
    specs = [(f"rl/{route}", spec) for route, spec in RATE_LIMITED.items()]
    specs.append(("grpc/rl", {"limits": GRPC_RATE_LIMIT}))
    out = []
    for route, spec in specs:
        for limit in spec["limits"]:
            out.append({
                "route": route, "name": limit["name"], "algorithm": limit["algorithm"],
                "mode": limit.get("mode", "exact"),
                "limit": limit["limit"], "window_ms": millis(limit["window"]),
                "burst": limit.get("burst", limit["limit"]),
                "per_tenant": "tenant" in limit["by"],
                "cost": "cost" in limit,
                "failure_mode": spec.get("failure_mode", "fail_closed"),
            })
    return out
