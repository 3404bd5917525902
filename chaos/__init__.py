"""Chaos runs: the guard's guarantees checked under random schedules of faults.

The package drives the real stack of the test suite (tests/harness): Redis or Redis Cluster,
webdis, Envoys running the built filter. The harness lives under tests/, so importing this
package puts that directory on sys.path once; `harness.*` is then importable from every module
here, as it is from the tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TESTS = str(ROOT / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
