"""benchmarks/pool_growth.py --daemon measures the longest PING while a real daemon's pool fills:
a PING that fails ends the run with the error.

Regression: the PINGs ran on a thread whose exception vanished; the run went on, and printed p50,
p99 and the longest round trip of the PINGs answered before the failure, leaving out the very
stall it measures."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark

import tierd_client


def script():
    return load_benchmark("pool_growth")


def test_a_ping_that_fails_ends_the_run_with_its_error(monkeypatch):
    ping, calls = tierd_client.TierdClient.ping, []

    def failing(self, *a, **kw):
        calls.append(1)
        if len(calls) > 3:
            raise TimeoutError("no reply to PING in 30 s")
        return ping(self, *a, **kw)

    monkeypatch.setattr(tierd_client.TierdClient, "ping", failing)
    with pytest.raises(
        RuntimeError, match=r"a PING failed after 3 answered: TimeoutError\('no reply to PING"
    ):
        script().serve(64 << 20, True, 0.5)


def test_without_a_failure_it_gives_the_figures():
    got = script().serve(64 << 20, True, 2.0)
    assert got["pings"] > 0 and 0 < got["p50"] <= got["p99"] <= got["max"]


def test_bursts_compare_every_look_ahead_over_the_same_segments():
    """--burst-mb: each mode fills the same segments (64, 64 and 128 MiB for 256 MiB), and only
    the bursts after the first are summed."""
    mod = script()
    for mode in mod.MODES:
        got = mod.fill(256 << 20, mode, 0.0, burst=64 << 20, gap_s=0.0)
        assert got["growths"] == 3 and got["longest_s"] <= got["growth_s"] + got["later_bursts_s"], got
