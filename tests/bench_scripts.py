"""The benchmark scripts (benchmarks/*.py) as fresh modules, for tests of what they compute and
refuse without running them whole."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str, monkeypatch=None):
    """benchmarks/``name``.py, executed as a new module; with ``monkeypatch``, tests/ and
    benchmarks/ are on its import path for the test, as they are when the script runs."""
    if monkeypatch is not None:
        for path in (ROOT / "tests", ROOT / "benchmarks"):
            monkeypatch.syspath_prepend(str(path))
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
