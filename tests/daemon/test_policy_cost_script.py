"""README's ``python benchmarks/policy_cost.py`` runs: two daemons of full pools, one per policy,
each in a process of its own (handlers called directly, no socket), LOOKUPs and evicting STOREs
alternated, each op's p50s and their ratio printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = str(Path(__file__).resolve().parents[2] / "benchmarks/policy_cost.py")


def test_it_prints_both_policies_and_their_ratio_per_op():
    out = subprocess.run(
        [sys.executable, SCRIPT, "--objects", "16800", "--prompt-keys", "100", "--repeats", "10"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout
    assert "16,800 objects, a full pool; LOOKUP hit of 100 keys, STORE of 16 new chunks" in out, out
    for op in ("LOOKUP", "REPLY", "STORE"):
        for policy in ("lru", "reuse"):
            assert re.search(
                rf"^  {op}\s+{policy}\s+p50\s+[\d.]+ us, p90\s+[\d.]+ us, mean\s+[\d.]+ us$", out, re.M
            ), out
        assert re.search(
            rf"^  {op}\s+reuse / lru \(p50\): \d+\.\d{{3}}, \(mean\): \d+\.\d{{3}}$", out, re.M
        ), out


def test_too_small_a_pool_is_refused():
    run = subprocess.run(
        [sys.executable, SCRIPT, "--objects", "100"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and "--objects must be at least 16778" in run.stderr
