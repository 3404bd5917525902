"""`make unit-wasm` runs the core's unit tests in Node (wasm-bindgen-test-runner): a test module
runs there only if it takes `#[test]` from wasm_bindgen_test on that target. Every module with
tests does, except the host-only tools', so no test silently runs natively alone."""

from __future__ import annotations

import re

from harness.proc import ROOT

# Built for the host only (they read files, or talk to Redis over TCP): no Wasm build to run
# them in. A path ending in `/` stands for everything under it.
HOST_ONLY = ("src/bin/", "src/admin/", "src/config/manifest.rs", "src/config/manifest_tests.rs")
SHADOW = "use wasm_bindgen_test::wasm_bindgen_test as test;"


def test_every_test_module_runs_in_wasm_too():
    missing = []
    for path in sorted(ROOT.glob("src/**/*.rs")):
        name = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if not name.startswith(HOST_ONLY) and re.search(r"^\s*#\[test\]", text, re.M) and SHADOW not in text:
            missing.append(name)
    assert not missing, f"tests that would not run in Wasm (add `{SHADOW}`): {missing}"
