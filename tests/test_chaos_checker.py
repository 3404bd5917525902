"""The chaos checker (chaos/checker.py) on synthetic histories: each invariant flags a
history that breaks it, passes one that keeps it, and applies the documented weaker bound
only where a fault may have lost writes.

Pure logic: no process is started. The histories are what the workload and the service
write (chaos/workload.py, chaos/service.py), reduced to the fields the checker reads.
"""

from __future__ import annotations

import json

import pytest

import chaos  # noqa: F401  (tests/ on sys.path, as for the chaos run)
from chaos import config
from chaos.checker import Schedule, check, ratelimit_items
from harness import problems

T0 = 1_700_000_000.25  # a wall-clock time a quarter into an aligned second


class History:
    """Builds a schedule: client records and the service's ledger entries, linked by id."""

    def __init__(self) -> None:
        self.history: list[dict] = []
        self.ledger: list[dict] = []
        self.faults: list[dict] = []
        self.n = 0

    def _id(self) -> str:
        self.n += 1
        return f"s0-0-0-{self.n}"

    def answer(self, route: str, send: float, status: int, *, body: str = "", ctype: str = "",
               headers: dict | None = None, tenant: str = "t1", **fields) -> dict:
        h = dict(headers or {})
        if ctype:
            h["content-type"] = ctype
        rec = {"id": self._id(), "op": route.split("/")[0], "route": route, "tenant": tenant,
               "send": send, "headers_at": send + 0.01, "recv": send + 0.01, "status": status,
               "headers": h, "body": body, "reset": None, **fields}
        self.history.append(rec)
        return rec

    def problem(self, route: str, send: float, status: int, slug: str, retry_after="1",
                **fields) -> dict:
        headers = {} if retry_after is None else {"retry-after": str(retry_after)}
        body = json.dumps({"type": problems.problem_type(slug), "status": status,
                           "detail": problems.QUOTA_DETAIL.get(slug, "") + "..."})
        return self.answer(route, send, status, body=body, ctype="application/problem+json",
                           headers=headers, **fields)

    def served(self, route: str, send: float, begin: float | None = None, end: float | None = None,
               *, tenant: str = "t1", remaining: dict | None = None, status: int = 200,
               client: dict | None = None, **entry) -> tuple[dict, dict]:
        """A request that reached the service: (client record, ledger entry)."""
        begin = send + 0.002 if begin is None else begin
        end = begin + 0.001 if end is None else end
        headers = {"x-chaos-service": "1", "content-type": "application/json"}
        if remaining is not None:
            headers["ratelimit"] = ", ".join(f'"{k}";r={v};t=1' for k, v in remaining.items())
        rec = self.answer(route, send, status, headers=headers, tenant=tenant, **(client or {}))
        rec["recv"] = max(rec["recv"], end + 0.001)
        self.n += 0
        e = {"n": len(self.ledger) + 1, "id": rec["id"], "route": route, "tenant": tenant,
             "begin": begin, "end": end, "status": status, **entry}
        self.ledger.append(e)
        return rec, e

    def fault(self, kind: str, at: float, healed: float, data_loss: bool = False) -> None:
        self.faults.append({"kind": kind, "injected_at": at, "healed_at": healed,
                            "data_loss": data_loss})

    def check(self, **kw):
        return check(Schedule(history=self.history, ledger=self.ledger, faults=self.faults,
                              seed="test", **kw))


def invariants(result) -> list[str]:
    return [v["invariant"] for v in result.violations]


# --- answers ---------------------------------------------------------------------------------


def test_documented_answers_pass():
    h = History()
    h.problem("rl/fw", T0, 429, "rate_limited", retry_after=1)
    h.problem("rl/cc", T0, 429, "concurrency_limited")
    h.problem("idem/reject", T0, 409, "idempotency_key_in_use", key="k")
    h.problem("lease/reject", T0, 409, "resource_locked", retry_after=2, resource="r")
    h.problem("idem/reject", T0, 422, "idempotency_key_conflict", retry_after=None,
              conflict_probe=True, key="c0")
    rec = h.problem("rl/fw", T0, 401, "missing_tenant", retry_after=None, tenant=None)
    rec["op"] = "no_tenant"
    h.fault("webdis_restart", T0 - 0.1, T0 + 0.5)
    h.problem("lease/wait", T0, 503, "guard_unavailable")
    result = h.check()
    assert result.violations == []
    assert result.stats["answer_429_rate_limited"] == 1
    assert result.stats["guard_unavailable_outside_faults"] == 0


@pytest.mark.parametrize("make, expected", [
    (lambda h: h.answer("rl/fw", T0, 500, body="oops", ctype="text/plain"), "undocumented answer 500"),
    (lambda h: h.answer("lease/reject", T0, 503), "undocumented answer 503"),
    (lambda h: h.problem("idem/reject", T0, 422, "idempotency_key_conflict", key="k"),
     "undocumented answer 422"),
    (lambda h: h.problem("idem/reject", T0, 429, "rate_limited", key="k"), "undocumented answer 429"),
    (lambda h: h.problem("rl/fw", T0, 503, "guard_overloaded"), "undocumented answer 503"),
    (lambda h: h.problem("rl/fw", T0, 429, "rate_limited", retry_after=None), "Retry-After None"),
    (lambda h: h.problem("rl/fw", T0, 503, "guard_unavailable", retry_after=5), "Retry-After '5'"),
    (lambda h: h.served("rl/fw", T0), "without the RateLimit headers"),
])
def test_undocumented_answers_are_flagged(make, expected):
    h = History()
    make(h)
    result = h.check()
    assert invariants(result) == ["answers"], result.violations
    assert expected in result.violations[0]["detail"]


def test_a_fail_closed_answer_outside_faults_is_counted_not_flagged():
    h = History()
    h.problem("rl/sw", T0, 503, "guard_unavailable")
    h.fault("script_flush", T0 + 10, T0 + 10)
    result = h.check()
    assert result.violations == []
    assert result.stats["guard_unavailable_outside_faults"] == 1


def test_a_request_without_tenant_at_the_service_is_flagged():
    h = History()
    rec, _ = h.served("rl/fw", T0, remaining={"fw": 2}, tenant=None)
    rec["op"] = "no_tenant"
    assert invariants(h.check()) == ["answers"]


def test_a_panic_in_an_envoy_log_is_flagged():
    h = History()
    log = "[2026-01-01 00:00:00.000][12][critical][wasm] panicked at src/x.rs:1:1: boom\n"
    result = h.check(envoy_logs=["[info] fine\n", log])
    assert invariants(result) == ["answers"]
    assert "envoy 1" in result.violations[0]["detail"]


# --- rate limits -----------------------------------------------------------------------------


def _fixed_window(h: History, count: int, start: float, spacing: float, route="rl/fw",
                  name="fw", limit=3):
    """`count` admissions from `start`, the first one opening the window (remaining
    limit - 1), the others counting down (never below 0)."""
    for i in range(count):
        h.served(route, start + i * spacing, remaining={name: max(0, limit - 1 - i)})


def test_fixed_window_within_limit_passes_and_over_it_is_flagged():
    ok = History()
    _fixed_window(ok, 3, T0, 0.05)
    _fixed_window(ok, 3, T0 + 1.1, 0.05)  # the next window
    result = ok.check()
    assert result.violations == [] and result.stats["rate_limit_checks"] >= 2

    over = History()
    _fixed_window(over, 4, T0, 0.05)
    result = over.check()
    assert invariants(result) == ["rate_limits"]
    assert "4 units admitted in the fixed window" in result.violations[0]["detail"]
    assert len(result.violations[0]["history"]) == 4


def test_fixed_window_admissions_of_uncertain_order_are_not_counted():
    # The fourth admission's bracket starts before the opener reached the service: it may
    # have been decided in the window before, so nothing is certain.
    h = History()
    _fixed_window(h, 3, T0, 0.05)
    h.served("rl/fw", T0 - 0.5, begin=T0 + 0.2, remaining={"fw": 0})
    assert h.check().violations == []


def test_fixed_window_over_the_limit_after_a_data_loss_is_the_weaker_case():
    h = History()
    _fixed_window(h, 3, T0, 0.05)
    h.fault("redis_restart_volatile", T0 + 0.2, T0 + 0.4, data_loss=True)
    # The counter was lost: a fresh window opens (remaining limit - 1 again).
    _fixed_window(h, 3, T0 + 0.5, 0.05)
    result = h.check()
    assert result.violations == []
    assert result.weaker["rate_limit_fw"] >= 1

    twice = History()
    twice.fault("redis_restart_volatile", T0 + 0.2, T0 + 0.4, data_loss=True)
    _fixed_window(twice, 7, T0, 0.05)  # more than twice the limit: not even the weaker bound
    assert invariants(twice.check()) == ["rate_limits"]


def test_a_fault_without_data_loss_gets_no_weaker_bound():
    h = History()
    h.fault("redis_restart_persistent", T0 + 0.2, T0 + 0.4, data_loss=False)
    _fixed_window(h, 4, T0, 0.05)
    assert invariants(h.check()) == ["rate_limits"]


def test_cost_units_count():
    h = History()
    h.served("rl/cost", T0, remaining={"cost": 4}, cost=4)  # opened: 8 - 4
    h.served("rl/cost", T0 + 0.1, remaining={"cost": 0}, cost=4)
    assert h.check().violations == []
    h.served("rl/cost", T0 + 0.2, remaining={"cost": 0}, cost=1)
    assert invariants(h.check()) == ["rate_limits"]


def test_sliding_window_counts_aligned_windows():
    start = 1_700_000_000.0 + 0.1  # inside one aligned 1 s window
    ok = History()
    for i in range(3):
        ok.served("rl/sw", start + i * 0.1, remaining={"sw": 2 - i})
    for i in range(3):  # the next aligned window
        ok.served("rl/sw", start + 1.0 + i * 0.1, remaining={"sw": 0})
    assert ok.check().violations == []
    over = History()
    for i in range(4):
        over.served("rl/sw", start + i * 0.1, remaining={"sw": 0})
    result = over.check()
    assert invariants(result) == ["rate_limits"] and "aligned window" in result.violations[0]["detail"]


def test_sliding_log_counts_any_window():
    ok = History()
    for i in range(6):  # 3 a second, evenly: never 4 within a second
        ok.served("rl/sl", T0 + i * 0.34, remaining={"sl": 0})
    assert ok.check().violations == []
    over = History()
    for i in range(4):  # across an aligned boundary, still within one second
        over.served("rl/sl", 1_700_000_000.6 + i * 0.2, remaining={"sl": 0})
    assert invariants(over.check()) == ["rate_limits"]


def test_token_bucket_bounds_bursts_by_the_refill():
    ok = History()
    ok.served("rl/tb", T0, remaining={"tb": 1})
    ok.served("rl/tb", T0 + 0.01, remaining={"tb": 0})
    for i in range(1, 5):  # then one per refill (3 a second)
        ok.served("rl/tb", T0 + 0.01 + i * 0.34, remaining={"tb": 0})
    assert ok.check().violations == []
    over = History()
    for i in range(4):  # burst 2, 3 a second: at most 3 within 10 ms... and 4 came
        over.served("rl/tb", T0 + i * 0.002, begin=T0 + i * 0.002 + 0.001, remaining={"tb": 0})
    assert invariants(over.check()) == ["rate_limits"]


def test_concurrency_is_counted_at_the_service():
    ok = History()
    ok.served("rl/cc", T0, begin=T0 + 0.01, end=T0 + 0.3)
    ok.served("rl/cc", T0, begin=T0 + 0.02, end=T0 + 0.3)
    ok.served("rl/cc", T0, begin=T0 + 0.3, end=T0 + 0.5)  # after one ended
    assert ok.check().violations == []
    over = History()
    for i in range(3):
        over.served("rl/cc", T0, begin=T0 + 0.01 * i, end=T0 + 0.3)
    result = over.check()
    assert invariants(result) == ["rate_limits"] and "3 requests at the service" in \
        result.violations[0]["detail"]
    other_tenant = History()
    for i in range(2):
        other_tenant.served("rl/cc", T0, begin=T0 + 0.01 * i, end=T0 + 0.3, tenant="t1")
        other_tenant.served("rl/cc", T0, begin=T0 + 0.01 * i, end=T0 + 0.3, tenant="t2")
    assert other_tenant.check().violations == []


def test_fail_open_admissions_count_only_where_redis_decided():
    h = History()
    h.fault("redis_pause_long", T0 - 0.1, T0 + 1.0)
    for i in range(5):  # forwarded without the guard while Redis was paused: no RateLimit
        h.served("rl/open", T0 + i * 0.01)
    assert h.check().violations == []
    _fixed_window(h, 4, T0 + 2, 0.05, route="rl/open", name="open")
    assert invariants(h.check()) == ["rate_limits"]


def test_ratelimit_header_items():
    assert ratelimit_items('"tenant";r=0;t=1, "global";r=7;t=1') == {"tenant": 0, "global": 7}
    assert ratelimit_items(None) == {}
    assert ratelimit_items('"x";t=3') == {}


# --- idempotency -----------------------------------------------------------------------------


def _execution(h: History, send: float, key="k1", route="idem/reject", status=201, shape="A",
               fingerprint="sha256:" + "0" * 64, **entry):
    body = json.dumps({"key": key, "shape": shape}, sort_keys=True)
    rec, e = h.served(route, send, status=status, key=key, fingerprint=fingerprint, body=body,
                      client={"key": key, "shape": shape}, **entry)
    e["response"] = json.dumps({"exec": e["n"], "key": key}, sort_keys=True)
    rec["body"] = e["response"]
    return rec, e


def test_two_executions_while_the_record_lives_are_flagged():
    h = History()
    _execution(h, T0)
    _execution(h, T0 + 0.5)
    result = h.check()
    assert invariants(result) == ["idempotency"]
    assert "executed twice" in result.violations[0]["detail"]


@pytest.mark.parametrize("first_status, second_at, ok", [
    (503, 0.5, True),  # a retryable answer released the record
    (201, config.PROCESSING_TTL_MS / 1000 + 0.1, True),  # the record may have expired
    (201, 1.0, False),
])
def test_an_execution_again_is_allowed_only_once_the_record_is_gone(first_status, second_at, ok):
    h = History()
    _execution(h, T0, status=first_status)
    _execution(h, T0 + second_at)
    assert (h.check().violations == []) is ok


def test_a_record_lost_with_its_redis_is_the_weaker_case():
    h = History()
    _execution(h, T0)
    h.fault("cluster_failover", T0 + 0.1, T0 + 0.3, data_loss=True)
    _execution(h, T0 + 0.5)
    result = h.check()
    assert result.violations == [] and result.weaker["idempotency_lost_record"] == 1


def test_an_execution_without_its_fingerprint_is_flagged():
    h = History()
    _execution(h, T0, fingerprint=None)
    assert invariants(h.check()) == ["idempotency"]


def _replay(h: History, send: float, execution: dict, *, key="k1", route="idem/reject",
            shape="A", body=None, status=201):
    return h.answer(route, send, status, body=execution["response"] if body is None else body,
                    ctype="application/json", headers={"idempotent-replayed": "true"}, key=key,
                    shape=shape)


def test_replays_equal_the_first_response():
    h = History()
    _, e = _execution(h, T0)
    _replay(h, T0 + 0.5, e)
    assert h.check().violations == []

    for bad in (dict(body='{"exec": 999}'), dict(status=200), dict(shape="B"),
                dict(body=json.dumps({"exec": 1, "key": "k1", "x": 1}))):
        h2 = History()
        _, e2 = _execution(h2, T0)
        _replay(h2, T0 + 0.5, e2, **bad)
        assert invariants(h2.check()) == ["idempotency"], bad


def test_a_replay_of_another_tenants_key_is_flagged():
    h = History()
    _, e = _execution(h, T0, key="k1")
    e["tenant"] = "t2"
    rec = _replay(h, T0 + 0.5, e, key="k1")
    rec["headers"]["etag"] = f'"{e["n"]}"'
    result = h.check()
    assert invariants(result) == ["idempotency"]
    assert "replayed the response of another request" in result.violations[0]["detail"]


def test_a_replay_cut_short_is_known_by_its_etag():
    h = History()
    _, e = _execution(h, T0)
    rec = _replay(h, T0 + 0.5, e, body=e["response"][:10])
    rec.update(reset="mid_body")
    rec["headers"]["etag"] = f'"{e["n"]}"'
    assert h.check().violations == []
    rec["headers"]["etag"] = '"999"'
    assert invariants(h.check()) == ["idempotency"]


def test_a_replay_of_a_retryable_answer_is_flagged():
    h = History()
    _, e = _execution(h, T0, status=503)
    _replay(h, T0 + 0.5, e, status=503)
    assert invariants(h.check()) == ["idempotency"]


def test_a_stream_replay_needs_a_stream_that_ended():
    h = History()
    _execution(h, T0, route="idem/stream", status=200, stream=True, complete=False)
    h.answer("idem/stream", T0 + 0.5, 200, headers={"idempotent-replayed": "true"}, key="k1")
    assert invariants(h.check()) == ["idempotency"]
    h.ledger[0]["complete"] = True
    assert h.check().violations == []


# --- leases ----------------------------------------------------------------------------------


def _held(h: History, send: float, token: int, begin=None, end=None, res="r1",
          route="lease/reject", accepted=True, stream=False):
    rec, e = h.served(route, send, begin=begin, end=end, resource=res, token=str(token),
                      accepted=accepted, status=200 if accepted else 409, stream=stream,
                      client={"resource": res})
    return rec, e


def test_one_holder_at_a_time_passes():
    h = History()
    _held(h, T0, 100, begin=T0 + 0.01, end=T0 + 0.2)
    _held(h, T0 + 0.05, 200, begin=T0 + 0.21, end=T0 + 0.4)
    result = h.check()
    assert result.violations == [] and result.stats["lease_resources"] == 1


def test_two_holders_at_once_are_flagged():
    h = History()
    _held(h, T0, 100, begin=T0 + 0.01, end=T0 + 0.3)
    _held(h, T0 + 0.05, 200, begin=T0 + 0.1, end=T0 + 0.4)
    result = h.check()
    assert invariants(result) == ["leases"] and "two holders" in result.violations[0]["detail"]


def test_a_second_holder_after_a_lost_lease_is_the_weaker_case():
    h = History()
    _held(h, T0, 100, begin=T0 + 0.01, end=T0 + 0.6)
    h.fault("redis_restart_volatile", T0 + 0.1, T0 + 0.2, data_loss=True)
    _held(h, T0 + 0.3, 200, begin=T0 + 0.35, end=T0 + 0.5)
    result = h.check()
    assert result.violations == [] and result.weaker["lease_lost"] == 1


def test_a_stream_whose_client_left_holds_no_more():
    h = History()
    rec, _ = _held(h, T0, 100, begin=T0 + 0.01, end=T0 + 0.5, route="lease/stream", stream=True)
    rec.update(reset="mid_body", recv=T0 + 0.2)
    _held(h, T0 + 0.25, 200, begin=T0 + 0.3, end=T0 + 0.4, route="lease/stream")
    assert h.check().violations == []
    rec.update(reset=None, recv=T0 + 0.51)  # it read the stream to its end: held until then
    assert invariants(h.check()) == ["leases"]


def test_tokens_rise_with_time():
    h = History()
    _held(h, T0, 500, begin=T0 + 0.01, end=T0 + 0.1)
    _held(h, T0 + 0.2, 400, begin=T0 + 0.21, end=T0 + 0.3, accepted=False)  # issued later, smaller
    result = h.check()
    assert "leases" in invariants(result)
    assert any("is not larger" in v["detail"] for v in result.violations)


def test_a_stale_token_inside_the_lease_ttl_is_flagged():
    # B's token is older than A's but reached the service later: their leases overlapped.
    h = History()
    _held(h, T0 + 0.02, 200, begin=T0 + 0.05, end=T0 + 0.1)
    _held(h, T0, 100, begin=T0 + 0.2, end=T0 + 0.2, accepted=False)
    result = h.check()
    assert invariants(result) == ["leases"] and "two holders" in result.violations[0]["detail"]


def test_a_request_without_a_token_is_flagged():
    h = History()
    _, e = _held(h, T0, 100)
    e["token"] = None
    assert "leases" in invariants(h.check())


# --- leftovers -------------------------------------------------------------------------------


def _key(kind: str, rest: str = "{t.x}:p:h", **fields) -> dict:
    return {"key": f"{config.KEY_PREFIX}:{kind}:{rest}", "pttl": 500, **fields}


def test_what_expires_in_time_is_no_leftover():
    keys = [_key("idem", state="COMPLETED", pttl=15000), _key("fence", pttl=86400000),
            _key("cancel", pttl=59000), _key("rl", "{t.x}:p:fw:fw:3/1000:h", pttl=800),
            _key("rl", "{t.x}:p:cc:cc:2/2000:h", members=[["n1", T0 * 1e6 - 5]])]
    result = History().check(redis_keys=keys, now=T0)
    assert result.violations == [] and result.stats["redis_keys"] == 5


@pytest.mark.parametrize("key, expected", [
    (_key("idem", state="PROCESSING"), "still PROCESSING"),
    (_key("lease"), "a lease still held"),
    (_key("rl", "{t.x}:p:cc:cc:2/2000:h", members=[["n1", T0 * 1e6 + 5e5]]), "slots still held"),
    (_key("rl", "{t.x}:p:fw:fw:3/1000:h", pttl=-1), "no TTL"),
    (_key("cancel", pttl=config.CANCEL_TTL_MS + 5000), "above the"),
    (_key("whatever"), "no known kind"),
])
def test_leftovers_are_flagged(key, expected):
    result = History().check(redis_keys=[key], now=T0)
    assert invariants(result) == ["leftovers"] and expected in result.violations[0]["detail"]


def test_a_counter_outliving_its_own_policys_windows_is_flagged():
    leased = _key("rl", "{p.rl-leased}:rl-leased:leased:lq:h", pttl=config.LEASED_WINDOW_MS - 100)
    fw = _key("rl", "{t.x}:rl-fw:fw:fw:h", pttl=config.LEASED_WINDOW_MS - 100)
    assert History().check(redis_keys=[leased], now=T0).violations == []
    result = History().check(redis_keys=[fw], now=T0)
    assert invariants(result) == ["leftovers"]
    assert "above the 1000 ms" in result.violations[0]["detail"]


# --- leased quota ----------------------------------------------------------------------------


def _leased(h: History, count: int, start: float, spacing: float) -> None:
    for i in range(count):
        h.served("rl/leased", start + i * spacing, remaining={"leased": 0})


def test_a_leased_quota_is_held_to_two_windows_within_one():
    # Within half a window no more than two windows' quotas: the end of one and the start of
    # the next (slices spent until the window's end as each worker computed it).
    L = config.LEASED_LIMIT
    ok = History()
    _leased(ok, 2 * L, T0, 0.01)
    result = ok.check()
    assert result.violations == [] and result.stats["rate_limit_checks"] > 0
    over = History()
    _leased(over, 2 * L + 1, T0, 0.01)
    result = over.check()
    assert invariants(result) == ["rate_limits"]
    assert "(leased)" in result.violations[0]["detail"] and "above 2 windows" in \
        result.violations[0]["detail"]


def test_a_leased_quota_over_more_than_a_window_may_span_three():
    # Three quotas in bursts, any two within a window, all three over just more than one.
    L, W = config.LEASED_LIMIT, config.LEASED_WINDOW_MS / 1000
    h = History()
    for start in (T0, T0 + W / 2, T0 + W):
        _leased(h, L, start, 0.01)
    assert h.check().violations == []
    _leased(h, 1, T0 + W / 4, 0)  # two quotas and one more within half a window
    assert invariants(h.check()) == ["rate_limits"]


def test_a_leased_quota_after_a_lost_counter_is_the_weaker_case():
    L = config.LEASED_LIMIT
    h = History()
    h.fault("redis_restart_volatile", T0 + 0.2, T0 + 0.3, data_loss=True)
    _leased(h, 3 * L, T0, 0.01)
    result = h.check()
    assert result.violations == [] and result.weaker["rate_limit_leased"] >= 1
    _leased(h, 1, T0 + 0.005, 0)
    assert invariants(h.check()) == ["rate_limits"]


# --- gRPC ------------------------------------------------------------------------------------


def _grpc(rec: dict, *, details="", trailers_only=True, messages=0) -> dict:
    rec.update(grpc=True, op="grpc", details=details, trailers_only=trailers_only,
               messages=messages, body="")
    return rec


def grpc_problem(h: History, route: str, send: float, code: int, retry_after="1",
                 details="the problem's detail", **fields) -> dict:
    headers = {"x-envoy-ratelimited": "true"}
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    return _grpc(h.answer(route, send, code, headers=headers, **fields), details=details)


def grpc_served(h: History, route: str, send: float, code: int = 0, *, messages: int = 1,
                details: str = "", **kw) -> tuple[dict, dict]:
    rec, e = h.served(route, send, status=code, **kw)
    rec["headers"].pop("content-type")
    _grpc(rec, details=details, trailers_only=False, messages=messages)
    e["grpc"] = True
    return rec, e


def test_documented_grpc_answers_pass():
    h = History()
    grpc_problem(h, "grpc/rl", T0, 8)
    grpc_problem(h, "grpc/idem", T0, 10, key="k")
    grpc_problem(h, "grpc/idem", T0, 9, retry_after=None, key="c0", conflict_probe=True)
    grpc_problem(h, "grpc/lease", T0, 10, retry_after=2, resource="r")
    grpc_problem(h, "grpc/rl", T0, 16, retry_after=None, tenant=None, no_tenant=True)
    h.fault("webdis_restart", T0 - 0.1, T0 + 0.5)
    grpc_problem(h, "grpc/lease", T0, 14, resource="r")
    grpc_served(h, "grpc/rl", T0 + 2, remaining={"grpc": 2})
    result = h.check()
    assert result.violations == []
    assert result.stats["answer_grpc_8_rate_limited"] == 1
    assert result.stats["answer_grpc_9_idempotency_key_conflict"] == 1
    assert result.stats["grpc_forwarded"] == 1
    assert result.stats["guard_unavailable_outside_faults"] == 0


def _grpc_envoy_503(h: History) -> None:
    # Envoy's own gRPC answer (the VM failing, no upstream): no x-envoy-ratelimited.
    _grpc(h.answer("grpc/rl", T0, 14, headers={"retry-after": "1"}), details="upstream reset")


def _grpc_with_message(h: History) -> None:
    grpc_problem(h, "grpc/rl", T0, 8)["trailers_only"] = False


@pytest.mark.parametrize("make, expected", [
    (_grpc_envoy_503, "without x-envoy-ratelimited"),
    (_grpc_with_message, "not trailers-only"),
    (lambda h: grpc_problem(h, "grpc/idem", T0, 9, retry_after=None, key="k"),
     "undocumented gRPC answer 9"),
    (lambda h: grpc_problem(h, "grpc/lease", T0, 8, resource="r"), "undocumented gRPC answer 8"),
    (lambda h: grpc_problem(h, "grpc/rl", T0, 13), "undocumented gRPC answer 13"),
    (lambda h: grpc_problem(h, "grpc/rl", T0, 14, retry_after=5), "Retry-After '5'"),
    (lambda h: grpc_problem(h, "grpc/rl", T0, 8, retry_after=None), "Retry-After None"),
    (lambda h: grpc_problem(h, "grpc/rl", T0, 8, details=""), "no grpc-message"),
    (lambda h: grpc_served(h, "grpc/rl", T0), "without the RateLimit headers"),
    (lambda h: grpc_served(h, "grpc/rl", T0, remaining={"grpc": 1}, tenant=None,
                           client={"no_tenant": True}), "without a tenant reached the service"),
])
def test_undocumented_grpc_answers_are_flagged(make, expected):
    h = History()
    make(h)
    result = h.check()
    assert invariants(result) == ["answers"], result.violations
    assert expected in result.violations[0]["detail"]


def _grpc_execution(h: History, send: float, key="g1", code=0, messages=0, shape="A",
                    complete=True, end=None):
    body = json.dumps({"key": key, "shape": shape}, sort_keys=True)
    rec, e = grpc_served(h, "grpc/idem", send, code, messages=messages, end=end, key=key,
                         fingerprint="sha256:" + "0" * 64, body=body,
                         client={"key": key, "shape": shape})
    e.update(messages=messages, sent=messages, complete=complete,
             message="" if code == 0 else f"exec {e['n']}")
    rec["details"] = e["message"]
    return rec, e


def _grpc_replay(h: History, send: float, code: int, details: str, key="g1", shape="A"):
    return _grpc(h.answer("grpc/idem", send, code, key=key, shape=shape,
                          headers={"idempotent-replayed": "true", "x-envoy-ratelimited": "true"}),
                 details=details)


ALREADY = ("the call with this idempotency key already completed with OK; its response "
           "message cannot be replayed to a gRPC client")


def test_grpc_replays_carry_the_status_of_the_call():
    h = History()
    _, ok_messages = _grpc_execution(h, T0, key="g2", code=0, messages=2)
    _grpc_replay(h, T0 + 0.5, 6, ALREADY, key="g2")
    _, not_found = _grpc_execution(h, T0, key="g1", code=5, messages=1)
    _grpc_replay(h, T0 + 0.5, 5, not_found["message"], key="g1")
    _grpc_execution(h, T0, key="g0", code=0, messages=0)
    _grpc_replay(h, T0 + 0.5, 0, "", key="g0")
    result = h.check()
    assert result.violations == [] and result.stats["grpc_replayed"] == 3


@pytest.mark.parametrize("execution, replay, expected", [
    # ALREADY_EXISTS for a call that sent no message: it would be replayed as it ended.
    (dict(code=0, messages=0), dict(code=6, details=ALREADY), "ALREADY_EXISTS replay"),
    # OK replayed for a call that sent messages: the client would take OK without them.
    (dict(code=0, messages=2), dict(code=0, details=""), "matches no call"),
    (dict(code=5, messages=0), dict(code=0, details="exec 1"), "status 0 'exec 1'"),
    (dict(code=5, messages=0), dict(code=5, details="exec 999"), "status of another call"),
    (dict(code=14, messages=0), dict(code=14, details="exec 1"), "a retryable status was stored"),
    (dict(code=5, messages=0), dict(code=5, details="exec 1", shape="B"),
     "replayed to a different request"),
])
def test_grpc_replays_that_are_not_the_calls_are_flagged(execution, replay, expected):
    h = History()
    _grpc_execution(h, T0, **execution)
    _grpc_replay(h, T0 + 0.5, replay["code"], replay["details"], shape=replay.get("shape", "A"))
    result = h.check()
    assert invariants(result) == ["idempotency"], result.violations
    assert expected in result.violations[0]["detail"]


def test_a_grpc_replay_of_another_keys_call_is_flagged():
    h = History()
    _, other = _grpc_execution(h, T0, key="g3", code=5)
    _grpc_replay(h, T0 + 0.5, 5, other["message"], key="g1")
    assert invariants(h.check()) == ["idempotency"]


@pytest.mark.parametrize("first, ok", [
    (dict(code=14), True),  # UNAVAILABLE ended the call: released
    (dict(code=14, complete=False), False),  # its client left first: outcome unknown
    (dict(code=5), False),  # NOT_FOUND completed the record
])
def test_a_grpc_call_runs_again_only_once_its_record_is_released(first, ok):
    h = History()
    _grpc_execution(h, T0, **first)
    _grpc_execution(h, T0 + 0.5)
    assert (h.check().violations == []) is ok


def test_two_grpc_lease_holders_at_once_are_flagged():
    h = History()
    _held(h, T0, 100, begin=T0 + 0.01, end=T0 + 0.3, route="grpc/lease")
    _held(h, T0 + 0.05, 200, begin=T0 + 0.1, end=T0 + 0.4, route="grpc/lease")
    result = h.check()
    assert invariants(result) == ["leases"] and "two holders" in result.violations[0]["detail"]
