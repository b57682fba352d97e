"""README's ``python scripts/planner_ab.py --rev REV`` runs: it unpacks REV's daemon code under
another name and times both trees' STORE/RETRIEVE handlers (here REV is HEAD, a tree the working
copy may differ from only in what this checkout changed). No daemon process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_handler_ab_script_times_this_tree_against_a_revision():
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/planner_ab.py"), "--rev", "HEAD", "--chunks", "4"]
        + ["--repeats", "20", "--groups", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = re.findall(
        r"^\s+(this tree|HEAD) (STORE|RETRIEVE)\s+p50 ([\d.]+) ms .*\(([\d.]+)x of HEAD\)$", out, re.M
    )
    assert sorted((side, op) for side, op, _, _ in rows) == [
        ("HEAD", "RETRIEVE"),
        ("HEAD", "STORE"),
        ("this tree", "RETRIEVE"),
        ("this tree", "STORE"),
    ], out
    assert all(float(p50) > 0 for _, _, p50, _ in rows)
    assert [ratio for side, _, _, ratio in rows if side == "HEAD"] == ["1.00", "1.00"]
