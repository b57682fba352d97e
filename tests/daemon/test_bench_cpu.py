"""tierd bench on CPU: the bytes it stores are real (not never-written pages), and both layouts it
lays out (a block in one run, or in several runs a region apart) store and restore every byte
through a real daemon."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

from tierd.pool import pages
from tierd.tools.bench.common import fill_pattern
from tierd.tools.report import bench_table


def test_the_bench_pattern_fills_a_strided_view_in_place():
    """The stored half of each layer's blocks is a strided view; it was filled through a copy and
    left zero (the bench then stored never-written pages and compared zeros with zeros)."""
    kv = np.zeros((3, 2, 8, 64), np.uint8)  # [layer][run][block][bytes]
    fill_pattern(kv[:, :, :4])
    stored = kv[:, :, :4].reshape(-1, 64)
    assert len({row.tobytes() for row in stored}) == len(stored) == 24  # every block of every run distinct
    assert all(row.any() for row in stored)
    assert not kv[:, :, 4:].any()


@pytest.mark.parametrize("runs", [1, 2, 4])
def test_the_cpu_bench_restores_every_byte_in_each_layout(runs):
    small = "--layers 2 --kv-heads 2 --head-dim 64 --chunk-tokens 64 --chunks 4 --batch 2 --rounds 2"
    out = subprocess.run(
        [sys.executable, "-m", "tierd", "bench", "--json", "--quiet", *small.split(), "--runs", str(runs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["verified"] is True and r["runs"] == runs and r["block_bytes"] == 16 * 2 * 2 * 64 * 2
    assert r["bytes_per_round"] == 4 * 2 * 4 * r["block_bytes"]
    assert r["store_gbps"] > 0 and r["retrieve_gbps"] > 0
    # the first round, reported apart (a loaded host can round a tiny first round down to 0.0)
    assert all(isinstance(r[k], float) and r[k] >= 0 for k in ("store_first_gbps", "retrieve_first_gbps"))
    # the page size the copies ran in, beside a baseline that has huge pages
    assert r["huge_pages"] == {"memfd": pages.huge_pages(), "dev_shm": pages.huge_pages("/dev/shm")}
    assert "huge pages" in bench_table(r)
    # where the daemon's time went, per request of the second round: every stage of a CPU copy
    for op in ("STORE", "RETRIEVE"):
        assert list(r["daemon_stages_ms"][op]) == ["wait", "plan", "lane", "copy", "return", "reply"]
        assert r["daemon_stages_ms"][op]["copy"] > 0
    assert "daemon, STORE" in bench_table(r)


def test_runs_lay_out_only_the_one_rank_cpu_bench():
    out = subprocess.run(
        [sys.executable, "-m", "tierd", "bench", "--device", "cpu", "--ranks", "2", "--runs", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 1 and "--runs lays out the one-rank CPU bench" in out.stderr
