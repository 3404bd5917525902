"""`make bench`'s report (bench/run.py) from made-up runs: ratios pair each run with the plain
run of its round, and a BENCH_COMPARE build gets a row of its own."""

import sys

import pytest

from harness.proc import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import run as bench  # noqa: E402


class FakeStack:
    """What the scenarios' plugin configs read of the stack."""

    def redis_section(self, **section) -> dict:
        return {"cluster": "gateway", "authority": "webdis", **section}


def fake_run(kind: str, round_no: int, rps: float) -> dict:
    return {"kind": kind, "round": round_no, "requests_per_second": rps,
            "latency_ms": {"p50": 0.5, "p99": 2.0}, "redis_calls_per_request": 0.0,
            "redis_evals_per_request": 0.0, "foreign_cpu_cores": 0.0,
            "cpu_seconds_per_10k_requests": {"envoy": 0.5, "webdis": 0.0, "redis": 0.0,
                                             "wrk": 0.1, "upstream_envoy": None}}


def test_compare_runs_get_their_own_ratio_and_row():
    scenario = bench.Scenario("rl_rejected", "rejected", "get.lua", plugin=lambda s: {},
                              goal=0.65)
    # Plain is 100 then 200 req/s; ours 60 then 140; the other build 50 then 100.
    runs = [fake_run("plain", 1, 100), fake_run("scenario", 1, 60), fake_run("compare", 1, 50),
            fake_run("plain", 2, 200), fake_run("scenario", 2, 140), fake_run("compare", 2, 100)]
    summary = bench.summarize(scenario, runs)
    summary["compare"] = {"revision": "abc1234", **bench.summarize(scenario, runs, "compare")}
    assert summary["ratio_per_round"] == [0.6, 0.7]
    assert summary["ratio_to_plain"] == 0.65 and summary["goal_met"]
    assert summary["compare"]["ratio_per_round"] == [0.5, 0.5]
    results = {"plain": bench.summarize(None, runs, "plain"), "skipped": {},
               "scenarios": {"rl_rejected": {"summary": summary}}}
    rows = {line.split()[0]: line.split() for line in bench.table(results).splitlines()[2:]}
    assert rows["rl_rejected"][3] == "0.65"
    assert rows["rl_rejected@abc1234"][3] == "0.50"
    assert rows["rl_rejected@abc1234"][4:6] == ["0.50", "0.50"]


def test_the_performance_doc_gets_the_run_between_its_markers(tmp_path, monkeypatch):
    scenario = bench.Scenario("rl_rejected", "rejected", "get.lua", plugin=lambda s: {})
    runs = [fake_run("plain", 1, 100), fake_run("scenario", 1, 60)]
    results = {"plain": bench.summarize(None, runs, "plain"), "skipped": {},
               "scenarios": {"rl_rejected": {"summary": bench.summarize(scenario, runs)}},
               "lease_contended": [{"label": "ours", "utilisation": 0.8},
                                   {"label": "ours", "utilisation": 0.9}],
               "correctness": {"rl_rejected": {"ok": True}},
               "meta": {"command": "make bench", "date": "2026-11-30T00:00:00", "cpus": 2,
                        "envoy_version_short": "1.40.0", "rounds": 1, "seconds": 5,
                        "wrk": {"threads": 2, "connections": 16},
                        "loadavg_at_start": ["0.1", "0.2", "0.3"], "wasm_size_bytes": 1000}}
    summary = bench.summary_of(results, revision="abc1234")
    doc = tmp_path / "performance.md"
    doc.write_text(f"# Performance\nmethod\n{bench.RESULTS_BEGIN}\nold table\n{bench.RESULTS_END}\nbounds\n")
    monkeypatch.setattr(bench, "PERF_DOC", doc)
    assert bench.write_perf_doc(summary)
    text = doc.read_text()
    assert text.startswith("# Performance\nmethod\n") and text.endswith("\nbounds\n")
    assert "old table" not in text
    assert "Measured by `make bench` of abc1234 on 2026-11-30" in text
    assert "| rate limit rejected, 1 tenant, limit 10/1h | 60 | 0.60 (0.60) |" in text
    assert "busy 0.85 of the time (rounds 0.80, 0.90)" in text
    assert bench.perf_doc_results() == bench.markdown_results(summary)
    doc.write_text("no markers\n")
    assert not bench.write_perf_doc(summary) and doc.read_text() == "no markers\n"
    assert bench.perf_doc_results() is None


def test_a_scenario_is_measured_against_its_anchor_in_the_same_run():
    naive = bench.Scenario("wasm_naive", "naive", "get.lua", plugin=lambda s: {})
    ours = next(s for s in bench.scenarios() if s.name == "rl_allowed")
    assert ("wasm_naive", 0.90) in ours.anchors
    # Plain 100 then 200 req/s; the anchor 20 then 50; ours 18 then 44.
    runs_a = [fake_run("plain", 1, 100), fake_run("scenario", 1, 20),
              fake_run("plain", 2, 200), fake_run("scenario", 2, 50)]
    runs_o = [fake_run("plain", 1, 100), fake_run("scenario", 1, 18),
              fake_run("plain", 2, 200), fake_run("scenario", 2, 44)]
    results = {"wasm_naive": {"summary": bench.summarize(naive, runs_a)},
               "rl_allowed": {"summary": bench.summarize(ours, runs_o)}}
    bench.add_anchor_ratios(results)
    (entry,) = results["rl_allowed"]["summary"]["anchors"]
    # Medians: ours 0.2 (0.18, 0.22), the anchor 0.225 (0.2, 0.25): 0.2 / 0.225 = 0.8889.
    assert entry["anchor"] == "wasm_naive" and entry["ratio"] == 0.8889
    assert entry["per_round"] == [0.9, 0.88]
    assert entry["goal"] == 0.90 and entry["goal_met"] is False
    assert bench.anchor_text(results["rl_allowed"]["summary"]) == \
        "0.89 x wasm_naive (>= 0.90 missed)"
    assert results["wasm_naive"]["summary"]["anchors"] == []


def test_each_goal_is_shown_beside_the_least_a_filter_with_its_features_does():
    """The rejected path's goal beside the keyed 429, all in the path's rounds: the keyed
    anchor against the goal's anchor round by round, the path against both, their CPU."""
    ours = next(s for s in bench.scenarios() if s.name == "rl_rejected")
    assert bench.FEATURE_MINIMAL["rl_rejected"] == ("wasm_floor_429_keyed",)
    runs = []
    for r, (plain, floor, keyed, mine) in enumerate([(100, 80, 76, 70), (100, 90, 81, 80),
                                                     (100, 70, 70, 60)], 1):
        runs += [fake_run("plain", r, plain), fake_run("anchor:wasm_floor_429", r, floor),
                 fake_run("anchor:wasm_floor_429_keyed", r, keyed), fake_run("scenario", r, mine)]
    results = {"rl_rejected": {"summary": bench.summarize(ours, runs), "runs": runs}}
    bench.add_anchor_ratios(results)
    summary = {"scenarios": {"rl_rejected": bench.scenario_summary(results["rl_rejected"])},
               "feature_minimal": bench.feature_minimal(results)}
    assert summary["feature_minimal"] == {"rl_rejected": {"wasm_floor_429_keyed": [0.95, 0.9, 1.0]}}
    lines = bench.goal_lines(summary, {"rl_rejected": "rejected"})
    # The keyed anchor x the floor: 0.95, 0.9, 1.0; the path x the floor: 0.875, 0.8889,
    # 0.8571; the path x the keyed anchor: 0.9211, 0.9877, 0.8571.
    assert lines[-1] == ("| rejected | 0.95 x `wasm_floor_429` | `wasm_floor_429_keyed` 0.95 "
                         "(0.90-1.00) | 0.88 (0.86-0.89); 0.92 x `wasm_floor_429_keyed` | "
                         "50 / 50 |")
    # A run without those anchors (a partial one) shows no such table.
    alone = [fake_run("plain", 1, 100), fake_run("scenario", 1, 60)]
    partial = {"rl_rejected": {"summary": bench.summarize(ours, alone), "runs": alone}}
    bench.add_anchor_ratios(partial)
    assert bench.feature_minimal(partial) == {}
    assert bench.goal_lines({"scenarios": {"rl_rejected": bench.scenario_summary(
        partial["rl_rejected"])}, "feature_minimal": {}}, {}) == []


def test_open_loop_rows_say_what_the_filter_adds_at_each_rate():
    entry = {"scenario": "rl_allowed", "rates": [
        {"rate": 1000, "added_ms": {"p50_ms": 0.4, "p99_ms": 2.5, "p999_ms": 6.0},
         "plain": {"p50_ms": 0.2, "p99_ms": 0.9, "p999_ms": 3.0},
         "gateway": {"callouts": 5000, "connections": 9}},
        {"rate": 500, "added_ms": {"p50_ms": 0.3, "p99_ms": 1.5, "p999_ms": 4.0},
         "plain": {"p50_ms": 0.2, "p99_ms": 0.8, "p999_ms": 2.0}}]}
    gateway = [{"rate": 500, "p50_ms": 0.16, "p99_ms": 0.33, "p999_ms": 1.2},
               {"rate": 1000, "p50_ms": 0.17, "p99_ms": 0.39, "p999_ms": None}]
    summary = bench.summary_of({"meta": {}, "plain": {}, "scenarios": {}, "open_loop": [entry],
                                "open_loop_gateway": gateway})
    lines = bench.open_loop_markdown(summary["open_loop"], {"rl_allowed": "exact"},
                                     summary["open_loop_gateway"])
    assert "| scenario | adds at 1000/s | adds at 500/s | goal at 1000/s (p50 / p99) |" in lines[3]
    rows = [ln for ln in lines if ln.startswith("| exact |")]
    # One row per scenario, a column per rate; a run recorded before the gateway's counters
    # were has no figure there, not zeros.
    assert rows == ["| exact | 0.40 / 2.50 / 6.00 | 0.30 / 1.50 / 4.00 | < 0.5 / < 2.0 missed | "
                    "0.90, 0.80 | 5000 / 9, - |"]
    assert lines[-1].startswith("The gateway alone (")
    assert "500/s 0.16 / 0.33 / 1.20; 1000/s 0.17 / 0.39 / -." in lines[-1]
    # Without the gateway's own runs, the table ends the section.
    assert bench.open_loop_markdown(summary["open_loop"], {})[-1].endswith("| 5000 / 9, - |")


def test_an_open_loop_run_fails_on_an_answer_or_error_of_its_target():
    ok = {"statuses": {"200": 5000}, "errors": {"aborted due to deadline": 2}}
    refused = {"statuses": {"200": 10, "403": 4990}, "errors": {}}
    reset = {"statuses": {"200": 4000}, "errors": {"connection closed": 1000}}
    assert bench.failed_runs([ok]) == []
    assert bench.failed_runs([ok, refused, reset]) == [
        ({"200": 10, "403": 4990}, {}), ({"200": 4000}, {"connection closed": 1000})]


def test_the_naive_anchors_and_the_callout_paths_run_in_the_open_loop():
    for name in ("wasm_naive", "wasm_naive_rl", "wasm_naive_script", "rl_allowed",
                 "rl_allowed_batched"):
        assert name in bench.LATENCY_SCENARIOS
    known = {s.name for s in bench.scenarios()}
    assert set(bench.LATENCY_SCENARIOS) <= known


def test_bench_spans_reads_every_workers_reports_from_the_envoy_log(tmp_path):
    import spans

    log = tmp_path / "envoy.log"
    log.write_text(
        "[info] configuration loaded\n"
        "[warning] wasm log cg: spans: headers=10.00/10000 decide=15.00/10000 "
        "answer=12.00/9990 done=2.00/10\n"
        "[warning] wasm log cg: spans: headers=12.00/10000 decide=17.00/10000 "
        "answer=14.00/10010\n"
        "[warning] wasm log cg: spans: headers=11.00/10000 decide=x/10000\n")
    found = spans.reports(log)
    assert found["headers"] == [(10.0, 10000), (12.0, 10000), (11.0, 10000)]
    assert found["decide"] == [(15.0, 10000), (17.0, 10000)], "an unreadable mean is skipped"
    # The median of the reports' means, and how often the span ran per guarded request.
    assert spans.cell(found, "headers").split() == ["11.00", "x1.00"]
    assert spans.cell(found, "answer").split() == ["13.00", "x0.67"]
    assert spans.cell(found, "done").split() == ["2.00", "x0.00"]
    assert spans.cell(found, "resume").strip() == "-"


def test_the_open_loop_plan_comes_from_the_environment_or_the_defaults(monkeypatch):
    monkeypatch.delenv("BENCH_LATENCY_SCENARIOS", raising=False)
    monkeypatch.delenv("BENCH_LATENCY_RATES", raising=False)
    assert bench.latency_plan() == (bench.LATENCY_SCENARIOS, bench.LATENCY_RATES)
    assert "wasm_naive" in bench.LATENCY_SCENARIOS
    monkeypatch.setenv("BENCH_LATENCY_SCENARIOS", "wasm_naive, rl_allowed")
    monkeypatch.setenv("BENCH_LATENCY_RATES", "1000")
    assert bench.latency_plan() == (("wasm_naive", "rl_allowed"), (1000,))


def test_a_bad_open_loop_plan_fails_naming_the_variable(monkeypatch):
    monkeypatch.setenv("BENCH_LATENCY_SCENARIOS", "rl_allowed,nope")
    with pytest.raises(SystemExit, match="BENCH_LATENCY_SCENARIOS.*nope"):
        bench.latency_plan()
    monkeypatch.setenv("BENCH_LATENCY_SCENARIOS", "rl_allowed")
    for bad in ("0", "1e3", "-5", "fast"):
        monkeypatch.setenv("BENCH_LATENCY_RATES", bad)
        with pytest.raises(SystemExit, match="BENCH_LATENCY_RATES"):
            bench.latency_plan()


def test_rounds_alternate_the_order_of_the_scenario_and_its_anchors():
    targets = ["plain", "anchor:wasm_naive", "scenario", "compare"]
    orders = [bench.round_order(targets, r) for r in range(1, 5)]
    assert orders[0] == orders[2] == targets
    assert orders[1] == orders[3] == ["compare", "scenario", "anchor:wasm_naive", "plain"]
    # Over two rounds every target runs as often before the scenario as after it.
    for t in targets:
        before = sum(o.index(t) < o.index("scenario") for o in orders[:2])
        assert t == "scenario" or before == 1


def test_perf_split_tells_the_filters_code_from_its_host_calls_and_the_rest():
    import perf_split
    envoy = "/x/envoy/_bin/envoy"
    script = "\n\n".join([
        # In the Wasm: the innermost frame is JIT code.
        f"\t1af6d0596982 (/tmp/perf-7582.map)\n\t32da7a3 ({envoy})",
        # A host call: native code called from JIT code.
        f"\tfacd35 ({envoy})\n\t1af6d0596982 (/tmp/perf-7582.map)\n\t2fac060 ({envoy})",
        f"\tffffffff81000e46 ([kernel.kallsyms])\n\tfacd35 ({envoy})\n"
        "\t1af6d0596982 (/tmp/perf-7582.map)",
        # Outside the filter: no JIT frame at all.
        f"\t2c85186 ({envoy})\n\t55f6c8d ({envoy})",
        "\tffffffff81000e46 ([kernel.kallsyms])\n\t891f5 (/usr/lib/libc.so.6)",
    ]) + "\n"
    total, counts = perf_split.classify(script)
    assert total == 5
    assert counts == {"Wasm (JIT)": 1, "host calls from the Wasm": 2,
                      "outside the filter: Envoy": 1, "outside the filter: kernel": 1}


def test_an_anchor_without_a_goal_runs_in_its_scenarios_rounds_on_the_same_requests(
        monkeypatch):
    """The idempotency scenarios' anchors run in their rounds, with their requests (script)
    and their routing, so a per-round ratio compares like with like; other anchors without a
    goal are compared with the anchor's own rows."""
    by_name = {s.name: s for s in bench.scenarios()}
    for name, anchor in (("idem_fresh", "wasm_naive_routed"), ("idem_replay", "wasm_naive_post")):
        scenario, a = by_name[name], by_name[anchor]
        assert bench.in_round_anchors(scenario) == [anchor]
        assert a.script == scenario.script and a.wasm_path == bench.FLOOR_WASM
        assert a.plain_routed == scenario.plain_routed
        assert a.routed == scenario.plain_routed  # answered where its plain Envoy answers
    assert bench.in_round_anchors(by_name["lease"]) == []
    assert bench.in_round_anchors(by_name["rl_allowed"]) == [
        "wasm_naive", "wasm_naive_rl", "wasm_naive_script", "wasm_naive_code128",
        "wasm_naive_code256", "wasm_naive_code512", "wasm_naive_sparse124"]
    # The code-footprint anchors are the exact path's call anchor and that many functions.
    for n in bench.CODE_FUNCTIONS:
        code = by_name[f"wasm_naive_code{n}"]
        assert code.script == by_name["wasm_naive_script"].script
        assert code.wasm_path == bench.FLOOR_WASM
    sparse = by_name[f"wasm_naive_sparse{bench.SPARSE_FUNCTIONS}"]
    assert sparse.script == by_name["wasm_naive_script"].script
    # The exact path's call anchor, running the sparse functions.
    monkeypatch.setattr(bench, "naive_script", lambda stack: {"callout": "acquire.lua"})
    assert sparse.plugin(None) == {"callout": "acquire.lua", "code": bench.SPARSE_FUNCTIONS,
                                   "sparse": True}
    # The leased path's rounds hold the per-tenant floor and that floor running the code
    # anchors' functions: what a KiB of code run costs on a local path.
    assert bench.in_round_anchors(by_name["rl_allowed_leased"]) == [
        "local_ratelimit", "wasm_floor", "wasm_floor_rl",
        *(f"wasm_floor_rl_code{n}" for n in bench.LOCAL_CODE_FUNCTIONS)]
    monkeypatch.setattr(bench, "floor_rl", lambda stack: {"limit": "per tenant"})
    for n in bench.LOCAL_CODE_FUNCTIONS:
        local = by_name[f"wasm_floor_rl_code{n}"]
        assert local.script == by_name["wasm_floor_rl"].script
        assert local.plugin(None) == {"limit": "per tenant", "code": n}
    # The floor without the SDK, both ways, runs in the no-policy path's rounds, each its own
    # module (bench/floor/examples), built with the floor's crate.
    assert bench.in_round_anchors(by_name["no_policy"]) == [
        "wasm_floor", "wasm_floor_raw_all", "wasm_floor_raw"]
    raw = {by_name[n].wasm_path for n in ("wasm_floor", "wasm_floor_raw", "wasm_floor_raw_all")}
    assert raw == set(bench.FLOOR_WASMS) and len(raw) == 3
    assert "--examples" in bench.FLOOR_BUILD


def test_overrides_are_measured_beside_the_exact_path_without_them():
    """The exact path with `overrides: true` on its limit runs rl_allowed in its own rounds,
    on the same requests, with the same configuration but that flag."""
    by_name = {s.name: s for s in bench.scenarios()}
    ours, without = by_name["rl_allowed_overrides"], by_name["rl_allowed"]
    assert bench.in_round_anchors(ours) == ["rl_allowed"]
    assert ours.script == without.script and ours.verify is without.verify

    class FakeStack:
        def redis_section(self, **kw):
            return {"key_prefix": kw["key_prefix"]}

    mine, theirs = ours.plugin(FakeStack()), without.plugin(FakeStack())
    assert mine["policies"][0]["rate_limits"][0].pop("overrides") is True
    assert mine["redis"].pop("key_prefix") != theirs["redis"].pop("key_prefix")
    assert mine == theirs


def test_the_incumbent_runs_in_the_rounds_of_the_paths_it_competes_with():
    """Envoy's ratelimit filter with Limitador (no Wasm filter, no webdis) runs next to the
    exact and batched paths (its exact storage) and leased quota (its cached storage), on the
    same requests and the same configuration as the filter's own scenarios of those paths,
    all through the upstream (Envoy's ratelimit filter calls nothing on a direct response),
    with a goal of being at least as fast."""
    by_name = {s.name: s for s in bench.scenarios()}
    for name, incumbent in (("rl_allowed", "envoy_rls_exact"),
                            ("rl_allowed_batched", "envoy_rls_exact"),
                            ("rl_allowed_leased", "envoy_rls_cached")):
        direct, routed, a = by_name[name], by_name[f"{name}_routed"], by_name[incumbent]
        assert bench.in_round_anchors(routed) == [incumbent]
        assert dict(routed.anchors)[incumbent] == bench.INCUMBENT_GOAL == 1.0
        assert a.script == routed.script == direct.script
        assert routed.routed and routed.plain_routed and a.routed and a.plain_routed
        assert a.plugin is None and a.wasm_path is None
        config, own = routed.plugin(FakeStack()), direct.plugin(FakeStack())
        assert config["policies"] == own["policies"]
        assert config["redis"].get("batch") == own["redis"].get("batch")
    assert (by_name["envoy_rls_exact"].rls, by_name["envoy_rls_cached"].rls) == ("exact",
                                                                               "cached")



def test_the_incumbent_pushed_past_its_limit_has_what_it_admitted_recorded_not_checked():
    """The rejected pair: one tenant, limit 10, 16 connections, a fresh tenant per run. Ours
    must admit exactly the limit (checked); what the incumbent admits is a finding, reported
    in the table's notes for its own rows and in the rounds of the scenario beside it."""
    by_name = {s.name: s for s in bench.scenarios()}
    ours, incumbent = by_name["rl_rejected_routed"], by_name["envoy_rls_rejected"]
    assert ours.admitted_exactly == incumbent.rls_limit == incumbent.admission_reported == 10
    assert ours.script == incumbent.script == "one_tenant.lua"
    assert dict(ours.anchors)["envoy_rls_rejected"] == bench.INCUMBENT_GOAL

    runs = []
    for round_no, admitted in ((1, 16), (2, 19)):
        runs.append(fake_run("plain", round_no, 100))
        runs.append({**fake_run("anchor:envoy_rls_rejected", round_no, 50),
                     "admission": {"limit": 10, "admitted_2xx": admitted, "rejected_4xx": 9}})
        runs.append({**fake_run("scenario", round_no, 200),
                     "correctness": {"admitted_2xx": 10, "ok": True}})
    summary = bench.summarize(ours, runs)
    results = {"rl_rejected_routed": {"summary": summary, "runs": runs}}
    bench.add_anchor_ratios(results)
    assert results["rl_rejected_routed"]["summary"]["anchors"][0]["ratio"] == 4.0
    assert "admission" not in summary and summary["correctness"]["ok"]
    kept = {"rl_rejected_routed": bench.scenario_summary(results["rl_rejected_routed"])}
    # The incumbent's own ratio to plain in those rounds, kept for the table beside it.
    assert kept["rl_rejected_routed"]["anchors"][0]["its_ratio"] == 0.5
    assert bench.admission_lines(kept) == [
        "Admitted, not checked (envoy_rls_rejected, in rl_rejected_routed's rounds): 16, 19 "
        "per run for a limit of 10."]


def test_the_script_anchor_sends_the_exact_paths_own_call():
    """wasm_naive_script's callout is acquire.lua by EVALSHA with the arguments the filter
    sends for rl_allowed's limit (one fixed window, no idempotency, no lease) after a call tag,
    on a key of the filter's shape naming the tenant in its hash tag; its answer is read as
    acquire.lua's."""
    import hashlib
    import urllib.parse

    class FakeRedis:
        def script_load(self, text: str) -> str:
            return hashlib.sha1(text.encode()).hexdigest()

    class FakeStack:
        redis = FakeRedis()

        def redis_section(self) -> dict:
            return {"cluster": "gateway", "authority": "webdis", "authorization": "Basic x"}

    config = bench.naive_script(FakeStack())
    body = config["callout"]["body"].replace("{tenant}", "tenant-7")
    assert body.endswith(".raw")
    words = [urllib.parse.unquote(w) for w in body[:-len(".raw")].split("/")]
    sha = hashlib.sha1(bench.ACQUIRE_LUA.encode()).hexdigest()
    huge = str(bench.HUGE_LIMIT)
    assert words == ["EVALSHA", sha, "1",
                     f"cg:bench:naive_script:rl:{{t.tenant-7}}:api:tenant:fw:{huge}/3600000:"
                     "tenant-7", bench.ANCHOR_TAG,
                     "1", "-", "fw", huge, "3600000", huge, "0", "1", "0", "0"]
    assert config["limit"]["acquire_reply"] is True
    assert config["limit"]["limit"] == bench.HUGE_LIMIT


def test_footprint_counts_the_code_a_call_runs():
    """bench/footprint.py's instrumented module still runs, counts each function's calls, and
    counts only the regions of straight-line code that ran: one arm of an `if` ran, the other
    did not, and a loop's body ran once per turn."""
    import footprint
    from wasmtime import Engine, Instance, Module, Store, wat2wasm

    wasm = wat2wasm("""
      (module
        (func $pick (param i32) (result i32)
          (if (result i32) (local.get 0)
            (then (i32.add (i32.mul (local.get 0) (i32.const 3)) (i32.const 7)))
            (else (i32.const 0))))
        (func $sum (export "sum") (param i32) (result i32) (local i32)
          (block
            (loop
              (br_if 1 (i32.eqz (local.get 0)))
              (local.set 1 (i32.add (local.get 1) (call $pick (local.get 0))))
              (local.set 0 (i32.sub (local.get 0) (i32.const 1)))
              (br 0)))
          (local.get 1)))
    """)
    engine = Engine()
    counted, _, sizes, _ = footprint.instrument(bytes(wasm))
    store = Store(engine)
    exports = Instance(store, Module(engine, counted), []).exports(store)
    assert exports["sum"](store, 4) == sum(3 * n + 7 for n in range(1, 5))
    assert [exports[f"cnt{f}"].value(store) for f in (0, 1)] == [4, 1]
    assert sizes[0] > 0 and sizes[1] > 0

    blocked, _, _, spans = footprint.instrument(bytes(wasm), {0})
    store = Store(engine)
    exports = Instance(store, Module(engine, blocked), []).exports(store)
    assert exports["sum"](store, 4) == 58
    counts = [exports[f"cnt{c}"].value(store) for c, _, _ in spans[0]]
    # The function's start (4 calls), its `then` arm (4), its `else` arm (never), what follows.
    assert counts[0] == 4 and 0 in counts and 4 in counts[1:]
    ran = sum(size for (c, size, _), n in zip(spans[0], counts) if n)
    assert 0 < ran < sum(size for _, size, _ in spans[0])
    # Each region's address is where it begins in the original code section: consecutive,
    # each the one before plus its size.
    addresses = [a for _, _, a in spans[0]]
    assert addresses == sorted(addresses) and all(
        b - a == size for (_, size, a), (_, _, b) in zip(spans[0], spans[0][1:]))


def test_footprint_counts_the_lines_the_code_that_ran_touches():
    """A region that ran touches every line of 64 bytes it overlaps; one that did not run
    touches none, so cold code between hot code spreads the hot code over more lines."""
    import footprint
    assert footprint.lines_touched([]) == 0
    assert footprint.lines_touched([(64, True)]) == 1
    assert footprint.lines_touched([(65, True)]) == 2
    # 10 hot bytes, 200 cold, 10 hot: lines 0 and 3, not the two between.
    assert footprint.lines_touched([(10, True), (200, False), (10, True)]) == 2
    # The same hot bytes side by side: one line.
    assert footprint.lines_touched([(10, True), (10, True), (200, False)]) == 1
    # A region straddling a line's end touches both lines; an empty one none.
    assert footprint.lines_touched([(60, False), (8, True), (0, True)]) == 2


def test_footprint_finds_the_cold_code_inside_the_lines_hot_code_touches():
    """Cold code that shares a line with code that ran is counted by its bytes inside those
    lines, at its own address; cold code in lines nothing ran in is not."""
    import footprint
    # Lines 0-3: 10 hot bytes, 200 cold (54 of them in line 0, 18 in line 3), 10 hot.
    assert footprint.cold_in_touched([(10, True, 100), (200, False, 110), (10, True, 310)]) == [
        (110, 54 + 18)]
    # Cold code after the last hot line, and a function that never ran: nothing.
    assert footprint.cold_in_touched([(64, True, 0), (128, False, 64)]) == []
    assert footprint.cold_in_touched([(30, False, 0), (30, False, 30)]) == []
    # A cold region wholly inside a hot line counts whole.
    assert footprint.cold_in_touched([(8, True, 0), (16, False, 8), (8, True, 24)]) == [(8, 16)]


def test_footprint_reads_where_llvm_symbolizer_says_code_comes_from():
    """llvm-symbolizer --inlining answers each address with its frames, innermost first, and
    an empty line; the innermost frame is kept, its file named from its crate or the root."""
    import footprint
    root = str(footprint.wasm_profile.ROOT)
    output = (
        "<alloc::raw_vec::RawVec<T,A>>::reserve\n"
        "/rustc/5980761/library/alloc/src/raw_vec/mod.rs:673:16\n"
        "coordination_guard::redis::ScriptCall::encode\n"
        f"{root}/src/redis/mod.rs:120:9\n\n"
        "sha2::sha256::compress256\n"
        "/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/sha2-0.10.9/src/sha256.rs:38:5\n"
        "\n"
        f"decimal\n{root}/src/support/text.rs:0:0\n\n"
        "??\n??:0:0\n\n")
    assert footprint.short_name("coordination_guard::flow::worker::Worker<S>::settle") == (
        "Worker<S>::settle")
    assert footprint.short_name("core::ptr::drop_in_place<alloc::vec::Vec<u8>>") == (
        "drop_in_place<Vec<u8>>")
    assert footprint.symbolized(output) == [
        ("<alloc::raw_vec::RawVec<T,A>>::reserve", "alloc/src/raw_vec/mod.rs:673"),
        ("sha2::sha256::compress256", "sha2-0.10.9/src/sha256.rs:38"),
        ("decimal", "src/support/text.rs:0"),
        ("??", "??:0"),
    ]


def test_the_committed_summary_is_small_and_the_docs_and_chart_are_rendered_from_it():
    """bench/summary.json is what a full run commits (bench/results.json, its raw rounds, is a
    build output): a few KiB, and docs/performance.md's results section and bench/report.svg
    are exactly what bench/run.py renders from it, so neither can drift from the summary."""
    import json

    assert bench.SUMMARY.stat().st_size < 64 * 1024
    text = bench.SUMMARY.read_text()
    summary = json.loads(text)
    assert summary["format"] == bench.SUMMARY_FORMAT
    assert summary["meta"]["revision"] and summary["meta"]["date"]
    assert summary["plain"]["rps"] and summary["plain"]["cpu_us"]["envoy"]
    assert bench.dump_summary(summary) == text
    assert bench.perf_doc_results() == bench.markdown_results(summary)
    assert bench.CHART.read_text() == bench.svg_chart(summary)
