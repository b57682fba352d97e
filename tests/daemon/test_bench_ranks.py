"""``tierd bench --ranks N``: N rank processes on one real daemon in shared windows (the code path
a TP engine's ranks take, on CPU here and on every GPU of a node with --device cuda)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

from tierd.tools.bench.ranks import _aggregate

SMALL = [
    "--layers",
    "2",
    "--kv-heads",
    "2",
    "--head-dim",
    "64",
    "--chunks",
    "4",
    "--batch",
    "2",
    "--seconds",
    "0.4",
]


def bench(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tierd", "bench", "--json", "--quiet", *SMALL, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_every_rank_stores_and_restores_its_own_bytes_at_once():
    r = bench("--ranks", "3")
    assert r["verified"] and [o["rank"] for o in r["per_rank"]] == [0, 1, 2]
    for o in r["per_rank"]:
        g = o["gbps"]
        assert all(g[k] > 0 for k in ("store", "retrieve", "both", "raw")), o
        assert all(g[k] > 0 for k in ("solo_store", "solo_retrieve")) == (o["rank"] == 0), (
            o
        )  # solo: rank 0 alone
        assert o["stored_objects"] > 0
    assert r["aggregate_gbps"]["store"] == round(sum(o["gbps"]["store"] for o in r["per_rank"]), 3)


def test_replicated_ranks_keep_one_copy_and_all_restore_from_it():
    r = bench("--ranks", "2", "--mla")
    assert r["one_copy"] and r["verified"]
    assert r["per_rank"][0]["stored_objects"] > 0 and r["per_rank"][1]["stored_objects"] == 0
    assert r["per_rank"][1]["gbps"]["retrieve"] > 0  # rank 1 restores rank 0's copy


def test_the_aggregate_sums_the_ranks_windows_and_compares_with_raw_and_one_rank():
    phases = (
        "solo_store",
        "solo_retrieve",
        "solo_both",
        "store",
        "retrieve",
        "both",
        "raw_d2h",
        "raw_h2d",
        "raw_both",
    )
    gbps = [
        dict(zip(phases, (40, 41, 70, 24, 25, 40, 27, 28, 50))),
        dict(zip(phases, (0, 0, 0, 23, 22, 38, 27, 27, 49))),
    ]
    outs = [
        {"rank": 1, "gpu": 0, "gbps": gbps[1], "stored_objects": 0, "verified": True},
        {"rank": 0, "gpu": 0, "gbps": gbps[0], "stored_objects": 9, "verified": True},
    ]
    cfg = dict(device="cuda", ranks=2, mla=True, layers=61, chunks=64, batch=8, seconds=2.0)
    r = _aggregate(cfg, outs, 17 << 20, 18 << 10)
    assert r["aggregate_gbps"]["store"] == 47 and r["aggregate_gbps"]["raw_d2h"] == 54
    assert r["ratio_to_raw"] == {
        "store": round(47 / 54, 3),
        "retrieve": round(47 / 55, 3),
        "both": round(78 / 99, 3),
    }
    assert r["ratio_to_one_rank"] == {
        "store": round(47 / 40, 3),
        "retrieve": round(47 / 41, 3),
        "both": round(78 / 70, 3),
    }
    assert r["gpus"] == [0] and [o["rank"] for o in r["per_rank"]] == [0, 1]
    assert r["one_copy"] and r["verified"]
    next(o for o in outs if o["rank"] == 1)["stored_objects"] = 3  # rank 1 stored its own copy: not one copy
    assert not _aggregate(cfg, outs, 17 << 20, 18 << 10)["verified"]
