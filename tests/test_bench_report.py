"""`make bench`'s report (bench/run.py) from made-up runs: ratios pair each run with the plain
run of its round, and a BENCH_COMPARE build gets a row of its own."""

import sys

from harness.proc import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import run as bench  # noqa: E402


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
