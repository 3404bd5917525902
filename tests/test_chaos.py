"""The chaos run (chaos/run.py) in `make test`: five fixed schedule seeds on each topology,
the real stack (two Envoys with the built filter, webdis, a single Redis or Redis Cluster),
faults drawn from each seed, every invariant of chaos/checker.py checked.

`make chaos` runs the same with a hundred schedules and a fresh seed; a schedule of either
reruns exactly with `python -m chaos.run --schedule-seed <seed> --topologies <topology>`.
"""

from __future__ import annotations

import json

import pytest

import chaos  # noqa: F401  (tests/ on sys.path, as for the chaos run)
from chaos import run as chaos_run

SEEDS = [f"58-{i}" for i in range(5)]


def _explain(report: dict) -> str:
    lines = [f"{v['invariant']} (seed {v.get('seed')}): {v['detail']}\n"
             + "\n".join(json.dumps(h, sort_keys=True) for h in v.get("history", [])[:10])
             for v in report["violations"]]
    return "\n\n".join(lines)


@pytest.mark.timeout(900)
def test_five_schedules_on_a_single_redis(tmp_path, capsys):
    out = tmp_path / "chaos"
    args = ["--seed", "58", "--topologies", "single", "--out", str(out)]
    for seed in SEEDS:
        args += ["--schedule-seed", seed]
    status = chaos_run.main(args)
    printed = capsys.readouterr().out.strip().splitlines()
    report = json.loads((out / "report.json").read_text())
    assert report["violations"] == [], _explain(report)
    assert status == 0
    assert printed[-1] == "5 schedules, 0 violations"
    assert (out / "report.md").read_text().startswith("# Chaos run, seed 58")
    assert report["by_topology"] == {"single": 5}
    assert sum(report["faults"].values()) >= 5, report["faults"]
    # The checks had something to check: traffic, admissions, replays, fencing tokens.
    stats = report["stats"]
    assert report["requests"] > 1000, report["requests"]
    assert stats["rate_limit_checks"] > 50 and stats["replayed"] > 10, stats
    assert stats["lease_resources"] > 10 and stats["forwarded"] > 300, stats
    # gRPC calls reached the service, were answered by the filter and replayed; the leased
    # limit admitted from its slices.
    assert stats["grpc_forwarded"] > 50 and stats["grpc_replayed"] > 3, stats
    assert sum(v for k, v in stats.items() if k.startswith("answer_grpc_")) > 20, stats
    assert stats["leased_admissions"] > 50, stats


@pytest.mark.timeout(900)
def test_five_schedules_on_redis_cluster(tmp_path):
    report = chaos_run.run("58", len(SEEDS), ["cluster"], tmp_path / "chaos", SEEDS,
                           echo=lambda *_: None)
    assert report["violations"] == [], _explain(report)
    assert report["by_topology"] == {"cluster": 5}
    assert sum(report["faults"].values()) >= 5, report["faults"]
    assert report["requests"] > 1000 and report["stats"]["rate_limit_checks"] > 50, report["stats"]
    assert report["stats"]["grpc_forwarded"] > 50, report["stats"]
