"""``python benchmarks/touch_cost.py`` runs: a pool per policy, a LOOKUP found again and again,
its read and its touch timed, per policy, as JSON; bad input refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = str(Path(__file__).resolve().parents[2] / "benchmarks/touch_cost.py")


def test_it_prints_the_read_and_the_touch_of_every_policy():
    out = subprocess.run(
        [sys.executable, SCRIPT, "--objects", "5000", "--keys", "128", "--repeats", "5", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    r = json.loads(out)
    assert (r["objects"], r["keys"], r["repeats"]) == (5000, 128, 5)
    for policy in ("reuse", "lru"):
        assert r[policy]["lookup_us"] > 0 and r[policy]["touch_us"] > 0, r


def test_more_keys_than_objects_is_refused():
    run = subprocess.run(
        [sys.executable, SCRIPT, "--objects", "10", "--keys", "11"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--keys must be between 1 and --objects (10)" in run.stderr
