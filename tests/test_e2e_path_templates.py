"""Path templates end to end: real Envoy running the filter, real redis-server behind webdis,
and the counting upstream.

`match.path_template` (Envoy's URI-template syntax) guards one operation among its siblings:
`POST /accounts/{id}/transfer` and not `POST /accounts/{id}/close`, which a `path_prefix` could
not tell apart. `path_param:<name>` names a lease's resource or a limit's counter by what a
variable matched, on the canonical path: every spelling of one account is one resource, and a
spelling that reads two ways is refused as `path_prefix` paths are. Each test asserts what the
client got, what the service ran (the upstream's ledger) and what is in Redis.

One Redis/webdis/upstream stack serves the module; each test starts its own Envoy with a fresh
`key_prefix` and its own tenant.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import subprocess
import time
import uuid

import pytest

from harness import problems
from harness.concurrency import in_thread, wait_for
from harness.envoy import Envoy, Response
from harness.proc import ROOT
from harness.stack import Stack

TENANT_HEADER = "x-tenant-id"
LABEL_HEADER = "x-user-id"  # the upstream records it: it tells the ledger's requests apart
FENCING_HEADER = "x-fencing-token"
PROBLEM = "application/problem+json"
HOLD_MS = 2500  # how long a holder's call runs: the requests raced against it fit well inside

TRANSFER = {"name": "transfer",
            "match": {"methods": ["POST"], "path_template": "/accounts/{id}/transfer"},
            "lease": {"resource": ["tenant", "path_param:id"], "ttl": "10s", "on_busy": "reject"}}
FILES = {"name": "files", "match": {"methods": ["PUT"], "path_template": "/files/{rest=**}"},
         "lease": {"resource": ["tenant", "path_param:rest"], "ttl": "10s", "on_busy": "reject"}}
REPORTS = {"name": "reports", "match": {"methods": ["GET"], "path_template": "/reports/{name}.pdf"},
           "rate_limits": [{"name": "per-report", "by": ["tenant", "path_param:name"],
                            "algorithm": "fixed_window", "limit": 2, "window": "1m"}]}


def uid() -> str:
    return uuid.uuid4().hex[:10]


def plugin(stack: Stack, key_prefix: str, *policies: dict) -> dict:
    return {"redis": stack.redis_section(key_prefix=key_prefix, timeout="500ms"),
            "identity": {"tenant_header": TENANT_HEADER, "principal_header": LABEL_HEADER,
                         "missing_tenant": "reject"},
            "policies": list(policies)}


def raw(envoy: Envoy, method: str, path: str, tenant: str, *, label: str = "",
        hold_ms: int = 0, timeout: float = 15.0) -> Response:
    """One request with the path exactly as given (no client normalisation)."""
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=timeout)
    start = time.monotonic()
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("host", "api.test")
        conn.putheader(TENANT_HEADER, tenant)
        if label:
            conn.putheader(LABEL_HEADER, label)
        if hold_ms:
            conn.putheader("x-upstream-delay-ms", str(hold_ms))
        conn.putheader("content-length", "0")
        conn.endheaders()
        resp = conn.getresponse()
        return Response(resp.status, dict(resp.getheaders()), resp.read(),
                        time.monotonic() - start)
    finally:
        conn.close()


def problem(resp: Response, status: int, slug: str) -> dict:
    assert resp.status == status, (resp.status, resp.body)
    assert resp.headers.get("content-type") == PROBLEM, resp.headers
    body = json.loads(resp.body)
    assert problems.is_problem(body, slug), body
    assert body["status"] == status, body
    return body


def short_hash(domain: str, value: bytes) -> str:
    """keys.rs `short_hash`: 16 hex digits of SHA-256(domain NUL value)."""
    return hashlib.sha256(domain.encode() + b"\0" + value).hexdigest()[:16]


def scope_hash(parts: list[tuple[str, str]]) -> str:
    """docs/design.md "Redis keys": each selector's spelling, `=`, its value, then 0x1f."""
    return short_hash("scope", b"".join(n.encode() + b"=" + v.encode() + b"\x1f"
                                        for n, v in parts))


def tenant_tag(tenant: str) -> str:
    return "t." + short_hash("tenant", tenant.encode())


def lease_key(prefix: str, tenant: str, policy: str, parts: list[tuple[str, str]]) -> str:
    return f"{prefix}:lease:{{{tenant_tag(tenant)}}}:{policy}:{scope_hash(parts)}"


def served(stack: Stack, mark: int, label: str) -> list[dict]:
    """What the upstream ran with this label since `mark`."""
    return [r for r in stack.upstream.requests()[mark:] if r["headers"].get(LABEL_HEADER) == label]


def keys(stack: Stack, prefix: str) -> set[str]:
    return {k.decode() for k in stack.redis.scan_iter(match=f"{prefix}:*", count=1000)}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("templates"), None, envoys=0).start()
    yield stack
    stack.stop()


@pytest.fixture
def guard(shared, sidecars):
    """`guard(*policies, normalise=True) -> Envoy` with a key prefix of its own; `normalise`
    False drops Envoy's own path normalisation, so what is asserted is the filter's."""

    def make(*policies: dict, normalise: bool = True) -> Envoy:
        prefix = f"cg:e2e-templates:{uid()}"
        return sidecars(shared, plugin(shared, prefix, *policies), prefix,
                        path_normalization=normalise)

    return make


def hold(envoy: Envoy, stack: Stack, method: str, path: str, tenant: str, key: str, label: str):
    """Starts a request on `path` whose call runs HOLD_MS, and waits until it holds `key`."""
    holder = in_thread(raw, envoy, method, path, tenant, label=label, hold_ms=HOLD_MS)
    assert wait_for(lambda: stack.redis.exists(key), 3.0), f"the holder never acquired {key}"
    return holder


# --- the example ---------------------------------------------------------------------


def test_a_transfer_holds_its_account_and_nothing_else(shared, guard):
    """POST /accounts/{id}/transfer with a lease on [tenant, path_param:id]: while a transfer on
    42 runs, POST /accounts/42/close is not guarded and runs beside it (with a path_prefix on
    /accounts/ it got 409), a second transfer on 42 gets 409 and never runs, a transfer on 43
    runs at once. Each transfer the service ran carried its fencing token."""
    envoy = guard(TRANSFER)
    tenant, mark = f"t-{uid()}", len(shared.upstream.requests())
    key = lease_key(envoy.key_prefix, tenant, "transfer", [("tenant", tenant), ("path_param:id", "42")])
    first = hold(envoy, shared, "POST", "/accounts/42/transfer", tenant, key, "first")

    close = raw(envoy, "POST", "/accounts/42/close", tenant, label="close")
    second = raw(envoy, "POST", "/accounts/42/transfer", tenant, label="second")
    other = raw(envoy, "POST", "/accounts/43/transfer", tenant, label="other")
    still_held = shared.redis.exists(key)
    first = first(timeout=15)

    assert first.status == 200, first
    assert close.status == 200 and close.elapsed < HOLD_MS / 1000, close
    problem(second, 409, "resource_locked")
    assert other.status == 200 and other.elapsed < HOLD_MS / 1000, other
    assert still_held, "the lease went before the transfer ended"
    ran_first, ran_close, ran_other = (served(shared, mark, label) for label in ("first", "close", "other"))
    assert served(shared, mark, "second") == [], "the second transfer on 42 ran"
    assert len(ran_first) == len(ran_close) == len(ran_other) == 1
    assert ran_close[0]["time"] < ran_first[0]["time"], "close waited for the transfer"
    assert FENCING_HEADER not in ran_close[0]["headers"], ran_close
    assert int(ran_first[0]["headers"][FENCING_HEADER]) > 0
    assert int(ran_other[0]["headers"][FENCING_HEADER]) > int(ran_first[0]["headers"][FENCING_HEADER])
    assert envoy.stat("wasmcustom.cg.policy.transfer.lease.acquired") == 2
    assert envoy.stat("wasmcustom.cg.policy.transfer.lease.busy") == 1
    # Given back: the next transfer on 42 runs.
    assert wait_for(lambda: not shared.redis.exists(key), 3.0)
    assert raw(envoy, "POST", "/accounts/42/transfer", tenant).status == 200


# --- hostile spellings -------------------------------------------------------------------------


def test_every_spelling_of_an_account_is_one_resource(shared, guard):
    """Without Envoy's own normalisation: escapes, repeated slashes, dot segments and a
    trailing slash all name account 42 (the held lease answers 409), and none of them runs."""
    envoy = guard(TRANSFER, normalise=False)
    tenant, mark = f"t-{uid()}", len(shared.upstream.requests())
    key = lease_key(envoy.key_prefix, tenant, "transfer", [("tenant", tenant), ("path_param:id", "42")])
    first = hold(envoy, shared, "POST", "/accounts/42/transfer", tenant, key, "first")
    spellings = ["/accounts/%34%32/transfer", "/accounts//42/transfer", "//accounts/42//transfer",
                 "/accounts/x/../42/transfer", "/accounts/42/./transfer", "/accounts/42/transfer/",
                 "/accounts/4%32/%74ransfer", "/x/../accounts/42/transfer?y=1"]
    answers = {path: raw(envoy, "POST", path, tenant, label="spelled") for path in spellings}
    assert first(timeout=15).status == 200
    for path, resp in answers.items():
        problem(resp, 409, "resource_locked")
    assert served(shared, mark, "spelled") == []
    assert envoy.stat("wasmcustom.cg.policy.transfer.lease.busy") == len(spellings)


@pytest.mark.parametrize("path", ["/accounts/4%2F2/transfer", "/accounts/42%2Ftransfer",
                                  "/accounts/42;v=1/transfer", "/accounts/42/transfer;v=1",
                                  "/accounts/42%5Ctransfer", "/accounts/%252F/transfer",
                                  "/accounts/4%zz/transfer", "/a//../accounts/42/transfer"])
def test_a_templated_path_that_reads_two_ways_is_refused(shared, guard, path):
    """A path services read more than one way, one reading of which fits the template: 400
    ambiguous_path, as for a path_prefix; nothing runs and nothing is written."""
    envoy = guard(TRANSFER, normalise=False)
    tenant, mark = f"t-{uid()}", len(shared.upstream.requests())
    problem(raw(envoy, "POST", path, tenant, label="ambiguous"), 400, "ambiguous_path")
    assert served(shared, mark, "ambiguous") == []
    assert keys(shared, envoy.key_prefix) == set()
    assert envoy.stat("wasmcustom.cg.policy.transfer.ambiguous_input") == 1


def test_a_path_that_reads_two_ways_none_fitting_passes(shared, guard):
    """The filter refuses only what it guards: no reading of /accounts/42%2Fclose fits."""
    envoy = guard(TRANSFER, normalise=False)
    tenant, mark = f"t-{uid()}", len(shared.upstream.requests())
    assert raw(envoy, "POST", "/accounts/42%2Fclose", tenant, label="odd").status == 200
    assert [r["path"] for r in served(shared, mark, "odd")] == ["/accounts/42%2Fclose"]


# --- `**` and suffixes ---------------------------------------------------------------------------


def test_a_rest_variable_names_the_whole_rest_of_the_path(shared, guard):
    """PUT /files/{rest=**} with a lease on [tenant, path_param:rest]: while /files/a/b/c is
    held, every spelling of it gets 409 (a trailing slash, repeated slashes), its parent and
    its child are other resources and run, /files itself is not guarded, and /files/ is the
    resource with an empty rest."""
    envoy = guard(FILES, normalise=False)
    tenant, mark = f"t-{uid()}", len(shared.upstream.requests())
    key = lease_key(envoy.key_prefix, tenant, "files", [("tenant", tenant), ("path_param:rest", "a/b/c")])
    first = hold(envoy, shared, "PUT", "/files/a/b/c", tenant, key, "first")
    same = {p: raw(envoy, "PUT", p, tenant, label="same")
            for p in ["/files/a/b/c", "/files/a/b/c/", "/files//a/b//c", "/files/a/%62/c"]}
    others = {p: raw(envoy, "PUT", p, tenant, label=f"other{i}")
              for i, p in enumerate(["/files/a/b", "/files/a/b/c/d", "/files/", "/files"])}
    assert first(timeout=15).status == 200
    for path, resp in same.items():
        problem(resp, 409, "resource_locked")
    assert served(shared, mark, "same") == []
    for i, (path, resp) in enumerate(others.items()):
        assert resp.status == 200 and resp.elapsed < HOLD_MS / 1000, (path, resp)
        ran = served(shared, mark, f"other{i}")
        assert len(ran) == 1, path
        # /files is not under the template: no lease, no token.
        assert (FENCING_HEADER in ran[0]["headers"]) == (path != "/files"), (path, ran)
    assert envoy.stat("wasmcustom.cg.policy.files.lease.acquired") == 4
    problem(raw(envoy, "PUT", "/files/a%2Fb/c", tenant), 400, "ambiguous_path")


def test_a_rate_limit_counts_per_template_variable(shared, guard):
    """GET /reports/{name}.pdf limited to 2 a minute per [tenant, path_param:name]: the third
    q1.pdf (however spelled) is 429, q2.pdf has its own counter, q1.csv is not guarded; the
    counter's key is named by the variable's value."""
    envoy = guard(REPORTS, normalise=False)
    tenant = f"t-{uid()}"
    assert [raw(envoy, "GET", p, tenant).status for p in ["/reports/q1.pdf", "/reports/q%31.pdf"]] \
        == [200, 200]
    problem(raw(envoy, "GET", "/reports/q1.pdf/", tenant), 429, "rate_limited")
    problem(raw(envoy, "GET", "/reports//q1%2Epdf", tenant), 429, "rate_limited")
    assert raw(envoy, "GET", "/reports/q2.pdf", tenant).status == 200
    assert [raw(envoy, "GET", "/reports/q1.csv", tenant).status for _ in range(3)] == [200] * 3
    scope = scope_hash([("tenant", tenant), ("path_param:name", "q1")])
    counter = f"{envoy.key_prefix}:rl:{{{tenant_tag(tenant)}}}:reports:per-report:fw:2/60000:{scope}"
    assert counter in keys(shared, envoy.key_prefix), keys(shared, envoy.key_prefix)
    assert envoy.stat("wasmcustom.cg.policy.reports.limit.per-report.rejected") == 2


# --- configuration mistakes ------------------------------------------------------------------------


def test_a_param_the_template_does_not_define_is_refused_naming_the_field(shared, tmp_path):
    """Envoy refuses the plugin with the filter's error naming the selector, and the checker
    (`make check`'s cg-check) gives the same line and exit 1."""
    policy = json.loads(json.dumps(TRANSFER))
    policy["lease"]["resource"] = ["tenant", "path_param:account"]
    config = plugin(shared, f"cg:e2e-templates:{uid()}", policy)
    want = ("policies[0].lease.resource[1]: path_param:account names no variable of "
            "match.path_template \"/accounts/{id}/transfer\" (it defines id)")
    code, log = shared.envoy_expect_failure(config)
    assert code is not None, "Envoy started with the plugin"
    assert "invalid plugin configuration: " + want in log, log[-2000:]
    path = tmp_path / "plugin.json"
    path.write_text(json.dumps(config))
    r = subprocess.run(["cargo", "run", "--quiet", "--bin", "cg-check", "--", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert want in r.stdout + r.stderr, (r.stdout, r.stderr)
