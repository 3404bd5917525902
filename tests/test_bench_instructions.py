"""`make bench-instructions` (bench/instructions.py): the core benchmark built for wasm32-wasip1,
run in wasmtime with fuel metering, counts the Wasm instructions of one request the same way
run after run, where every timing on these machines moves by 10-30%."""

import sys

import pytest

from harness.proc import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import instructions  # noqa: E402

REJECTED = "request through the worker, rejected by the over-limit cache"
EXACT = "request through the worker, exact, 10k tenants, 1 in flight"


@pytest.fixture(scope="module")
def runner() -> instructions.Runner:
    return instructions.Runner(instructions.build(ROOT / "Cargo.toml", None))


def test_a_request_counts_the_same_instructions_run_after_run(runner):
    first, ran = runner.per_run(REJECTED, 20)
    again, _ = runner.per_run(REJECTED, 20)
    longer, _ = runner.per_run(REJECTED, 50)
    assert ran == [REJECTED]
    # Only hash tables' random seeds move a count, by a few instructions.
    assert abs(first - again) <= 0.001 * first
    assert abs(first - longer) <= 0.005 * first
    assert 2_000 < first < 200_000, first


def test_counts_tell_the_paths_apart(runner):
    rejected, _ = runner.per_run(REJECTED, 20)
    exact, ran = runner.per_run(EXACT, 20)
    assert ran == [EXACT]
    # The exact path builds a key (two SHA-256 digests for a new tenant), encodes a gateway
    # call and reads its answer; a cached rejection does none of that.
    assert exact > 2 * rejected, (exact, rejected)


def test_a_filter_that_selects_no_case_runs_none(runner):
    used, ran = runner.run("no case has this name", 0)
    assert ran == [] and used > 0
