"""README's ``python benchmarks/handler_cost.py --index-objects N`` runs: it indexes N objects in
an in-process daemon, splits a full-attention LOOKUP's daemon time into its parts and prints the
same-run references next to them; a LOOKUP that misses would fail it (the hit is asserted). No
daemon process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks/handler_cost.py")


def test_the_lookup_split_prints_each_part_and_each_reference():
    out = subprocess.run(
        [sys.executable, SCRIPT, "--index-objects", "3000", "--prompt-keys", "300", "--repeats", "30"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "LOOKUP hit of 300 keys, 3,000 objects indexed, 30 times:" in out, out
    rows = dict(re.findall(r"^  (\S.*?)\s+p50\s+([\d.]+) us, p99\s+[\d.]+ us$", out, re.M))
    parts = ["decode", "handler", "encode", "touch", "all"]
    refs = ["decode the keys", "probe a dict", "OrderedDict touch"]
    assert sorted(rows) == sorted(parts + refs), out
    assert all(float(rows[name]) > 0 for name in parts + refs)
    assert float(rows["all"]) >= float(rows["handler"])


def test_a_prompt_longer_than_the_index_is_refused_before_anything_is_built():
    run = subprocess.run(
        [sys.executable, SCRIPT, "--index-objects", "100", "--prompt-keys", "200"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--prompt-keys must be 1..min(--index-objects, 65536)" in run.stderr
