"""``python benchmarks/lookup_settle.py`` runs: two real daemons, one applying a LOOKUP's
bookkeeping in parts while idle and one applying it right after each reply, filled alike; every
case's figures for both and their ratio printed as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = str(Path(__file__).resolve().parents[2] / "benchmarks/lookup_settle.py")


def test_it_prints_both_settings_and_their_ratio_per_case():
    out = subprocess.run(
        [sys.executable, SCRIPT, "--objects", "3000", "--rounds", "1", "--repeats", "20", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert (r["objects"], r["rounds"], r["parts"]) == (3000, 1, 256)
    assert r["lookups_beside"] > 0  # the second client did send its LOOKUPs
    for case in ("2048_keys_hit", "2048_keys_hit_with_lease", "128_keys_hit", "128_keys_beside_2048"):
        figures = r[f"lookup_{case}"]
        for q in ("p50_ms", "p99_ms"):
            assert figures[f"parts_{q}"] > 0 and figures[f"whole_{q}"] > 0, figures
            lo, hi = figures[f"parts_over_whole_{q}_range"]
            assert lo <= figures[f"parts_over_whole_{q}"] <= hi, figures
