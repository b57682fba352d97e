"""A test's synthetic rank (tests/kv.py) leaves no /dev/shm file behind, closed or not: a test
that forgets ``close()`` once left its files on the machine for good, six per suite run."""

import gc
import os
import subprocess
import sys
from pathlib import Path

from kv import FakeRank, GroupGeom

TESTS = Path(__file__).resolve().parents[1]


def test_a_rank_nobody_closed_removes_its_files_when_collected():
    rank = FakeRank([GroupGeom("full"), GroupGeom("sliding_window")])
    paths = [b.path for b in rank.bufs]
    assert all(os.path.exists(p) for p in paths)
    del rank
    gc.collect()
    assert [p for p in paths if os.path.exists(p)] == []


def test_a_rank_alive_when_its_process_ends_removes_its_files():
    code = "from kv import FakeRank, GroupGeom\nr = FakeRank([GroupGeom('full')])\nprint(r.bufs[0].path)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])),
        capture_output=True,
        text=True,
        check=True,
    )
    path = out.stdout.strip()
    assert path.startswith("/dev/shm/") and not os.path.exists(path)
