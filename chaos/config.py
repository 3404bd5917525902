"""The chaos run's plugin configuration, and what the workload and the checker read of it.

One policy per route of the chaos service (chaos/service.py). Windows and TTLs are short so
that a schedule heals within seconds: every rate limit counts per second, a record in
progress and a lease live 2 s, a concurrency slot 2 s. Every policy fails closed but
`rl-open`, whose admissions the checker counts only where Redis answered (a response with
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
# The longest TTL of a key that must be gone after a schedule: a record in progress, a lease,
# a concurrency slot (a rate-limit counter lives at most two windows of 1 s).
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
}

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
    return {
        "redis": redis,
        "identity": {"tenant_header": TENANT_HEADER, "principal_header": PRINCIPAL_HEADER,
                     "missing_tenant": "reject"},
        "failure_mode": "fail_closed",
        "response_headers": True,
        "policies": policies,
    }


def checked_limits() -> list[dict]:
    """Every rate limit the checker verifies: route, limit name, algorithm, limit, window (ms),
    burst, whether it counts per tenant, and the policy's failure mode."""
    out = []
    for route, spec in RATE_LIMITED.items():
        for limit in spec["limits"]:
            out.append({
                "route": f"rl/{route}", "name": limit["name"], "algorithm": limit["algorithm"],
                "limit": limit["limit"], "window_ms": millis(limit["window"]),
                "burst": limit.get("burst", limit["limit"]),
                "per_tenant": "tenant" in limit["by"],
                "cost": "cost" in limit,
                "failure_mode": spec.get("failure_mode", "fail_closed"),
            })
    return out
