"""`make bench-profile` (bench/wasm_profile.py): one core case's Wasm time by function, sampled by
perf in wasmtime, where Envoy's V8 gives perf no names."""

import sys
from pathlib import Path

import pytest

from harness.proc import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import wasm_profile  # noqa: E402

EXACT = "request through the worker, exact, 10k tenants, 1 in flight"
REJECTED = "request through the worker, rejected by the over-limit cache"


@pytest.fixture(scope="module")
def wasm():
    return wasm_profile.build()


def test_the_exact_path_spends_its_time_in_the_filters_own_functions(wasm):
    shares, ran = wasm_profile.profile(wasm, EXACT, 20_000)
    assert ran == [EXACT]
    names = dict(shares)
    assert abs(sum(names.values()) - 1.0) < 1e-9
    # A new tenant's key: two SHA-256 digests; the gateway call's body: its encoding.
    for name in ("sha2::sha256::compress256", "coordination_guard::redis::ScriptCall::encode"):
        assert names.get(name, 0) > 0.02, (name, shares[:15])
    assert any(n.startswith("coordination_guard::") for n, _ in shares[:5]), shares[:15]


def test_a_cached_rejection_encodes_no_call(wasm):
    shares, ran = wasm_profile.profile(wasm, REJECTED, 20_000)
    assert ran == [REJECTED]
    names = dict(shares)
    assert shares, "no samples in the filter's code"
    # One tenant, whose key the memo holds: no digest; answered locally: no call to encode.
    for name in ("sha2::sha256::compress256", "coordination_guard::redis::ScriptCall::encode"):
        assert names.get(name, 0) < 0.01, (name, shares[:15])


def test_a_case_that_matches_nothing_runs_nothing(wasm):
    _, ran = wasm_profile.profile(wasm, "no case has this name", 10)
    assert ran == []


def test_the_perf_maps_wasmtime_writes_are_removed(wasm):
    maps = set(Path("/tmp").glob("perf-*.map"))
    wasm_profile.profile(wasm, REJECTED, 100)
    assert set(Path("/tmp").glob("perf-*.map")) <= maps


def test_the_footprints_regions_are_found_in_the_builds_line_tables(wasm):
    """`make bench-footprint SOURCES=1`: the addresses of a function's regions of straight-line
    code, as bench/footprint.py counts them, are where llvm-symbolizer finds that function's
    source in the build's line tables."""
    import footprint

    raw = wasm.read_bytes()
    _, names, _, _ = footprint.instrument(raw)
    names = footprint.demangle(names)
    key = [f for f, n in names.items() if n == "coordination_guard::guards::ratelimit::key"]
    assert len(key) == 1, "the limit's key is its own function in the core benchmark"
    _, _, _, spans = footprint.instrument(raw, set(key))
    where = footprint.symbolize(wasm, [address for _, _, address in spans[key[0]]])
    assert len(where) == len(spans[key[0]])
    assert all(place != "??:0" for _, place in where), where
    # Its own lines, and what it inlines (the digests, the standard library's vectors).
    files = {place.rsplit(":", 1)[0] for _, place in where}
    assert "src/guards/ratelimit/mod.rs" in files, files
    assert any(f.startswith("alloc/") or f.startswith("core/") for f in files), files
