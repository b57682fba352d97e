"""MooncakeTier against a real ``mooncake_master``: two node processes, real shared memory.

Each scenario runs in a network namespace of its own (see tests/l2_harness.py: Mooncake binds
0.0.0.0), started from here with ``unshare``; the harness prints one JSON result. They skip, with
the reason, where Mooncake, its libraries or ``unshare`` are missing; CI (root, .ci/run installs
them) runs them all.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from functools import lru_cache

import pytest
from l2_harness import master_binary, namespaced, unshare_prefix

from tierd.tier2.client import L2Unavailable
from tierd.tier2.mooncake import MooncakeTier

MIB = 1 << 20


@lru_cache(maxsize=1)
def missing() -> str | None:
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        last = probe.stderr.strip().splitlines()[-1:]
        return f"Mooncake's client does not import ({last}): pip install 'tierd[mooncake]'"
    binary = master_binary()
    if binary is None:
        return "mooncake_master is not installed"
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    if version.returncode != 0:
        return f"mooncake_master does not run: {version.stdout[-300:]}{version.stderr[-300:]}"
    if unshare_prefix() is None:
        return (
            "unshare -n (or -rn) is not permitted here: Mooncake's servers must not bind 0.0.0.0 on the host"
        )
    return None


def run(scenario: str, timeout: float = 240) -> dict:
    reason = missing()
    if reason:
        pytest.skip(reason)
    result = namespaced([scenario], timeout)
    assert "error" not in result, (
        result["error"] + "\n" + "\n".join(f"== {k}\n{v}" for k, v in result.get("logs", {}).items())
    )
    return result


# -- without a master ------------------------------------------------------------------------


def test_importing_tierd_l2_does_not_import_mooncake():
    code = (
        "import sys, tierd.tier2.mooncake; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mooncake'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_without_the_package_configuring_says_what_to_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(L2Unavailable) as e:
        MooncakeTier("mooncake://127.0.0.1?segment_gb=1")
    assert "pip install 'tierd[mooncake]'" in str(e.value)


def test_a_cuda_build_on_a_host_without_cuda_says_what_to_swap(monkeypatch):
    real = importlib.import_module

    def fake(name, *a, **kw):
        if name == "mooncake.store":
            raise ImportError("libcuda.so.1: cannot open shared object file: No such file or directory")
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(
        L2Unavailable, match=r"pip uninstall -y mooncake-transfer-engine && pip install 'tierd\[mooncake\]'"
    ):
        MooncakeTier("mooncake://127.0.0.1")


def test_a_bad_url_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="protocol='udp'"):
        MooncakeTier("mooncake://127.0.0.1?protocol=udp")


# -- with a real master ----------------------------------------------------------------------


def test_bytes_put_by_one_node_are_read_byte_exact_by_another():
    r = run("share")
    assert [n["state"] for n in r["ready"]] == ["connected", "connected"]
    n = len(r["sizes"])
    assert r["before"] != r["src"]  # B's memory held other bytes before the get
    assert r["put"]["ok"] == [True] * n
    assert r["exists"]["ok"] == [True] * n + [False, False]
    assert r["get"]["ok"] == [True] * n + [False, False]
    assert r["dst"] == r["src"]
    assert r["get_larger"]["ok"] == [False] and r["get_smaller"]["ok"] == [False]
    assert (
        r["put_extra"]["ok"] == [True]
        and r["remove"]["ok"] == [True, True]
        and r["exists_removed"]["ok"] == [False]
    )
    a, b = r["status_a"], r["status_b"]
    assert a["local"] != b["local"] and a["connected"] and b["connected"]
    assert (a["puts"], a["put_stored"], a["put_bytes"]) == (2, n + 1, sum(r["sizes"]) + 4096)
    assert (b["hits"], b["misses"], b["get_bytes"], b["exists_hits"]) == (n, 2, sum(r["sizes"]), n)
    assert b["errors_by_code"] == {"SIZE_MISMATCH": 2} and b["errors"] == 0
    assert (a["registered_buffers"], a["registered_bytes"], a["segment_bytes"]) == (1, 128 * MIB, 256 * MIB)
    assert (
        b["latency_s"]["get"]["count"] == 3 and b["latency_s"]["get"]["counts"][-1] == 3
    )  # le=+Inf holds all


def test_master_killed_mid_read_fails_within_the_deadline_then_recovers_after_restart():
    r = run("master_dies")
    calls, kill = r["calls"], r["t_kill"]
    assert r["put"] == [True] * 16
    before = [c for c in calls if c["t"] + c["elapsed"] < kill]
    after = [c for c in calls if c["t"] > kill + 0.05]
    assert len(before) >= 5 and all(c["ok"] == 16 for c in before)
    around = [
        (round(c["t"] - kill, 3), round(c["elapsed"], 3), round(c["held"], 3), c["ok"], c["state"])
        for c in calls[len(before) :]
    ]
    # no stale success once the master is gone (said: the calls from the kill on: t from the kill,
    # elapsed, how long Mooncake held the memory after, keys ok, state)
    assert after and all(c["ok"] == 0 for c in after), f"{len(calls)} calls; from the kill: {around}"
    assert max(c["elapsed"] for c in calls) < 1.5 + 1.5  # every call answered by its deadline (and a stall)
    assert any(c["state"] == "degraded" for c in after)
    assert sum(c["state"] == "degraded" and c["elapsed"] < 0.1 for c in after) >= 10  # degraded: fail fast
    assert r["wait_b"]["state"] == "connected" and r["wait_a"]["state"] == "connected"
    assert (
        r["put_new"]["ok"] == [True] * 4 and r["get_new"]["ok"] == [True] * 4 and r["dst_new"] == r["src_new"]
    )
    assert r["exists_old"] == r["get_old"]  # whatever the new master knows, exists and get agree
    s = r["status_b"]
    assert s["degraded"] >= 1 and s["reconnects"] >= 1 and s["errors"] >= 1 and s["rejected"] >= 10


def test_master_that_stops_answering_fails_reads_by_the_deadline_not_mooncakes_30_s():
    r = run("master_hangs")
    hung = r["get_hung"]
    assert hung["ok"] == [False] * 4 and hung["timed_out"] and 0.95 < hung["elapsed"] < 3.0
    assert hung["state"] == "degraded" and hung["finished"] is False  # the agent still owns B's memory
    for fast in (r["get_fast"], r["exists_fast"]):
        assert fast["ok"] == [False] * 4 and fast["elapsed"] < 0.3 and not fast["timed_out"]
    assert r["still_degraded"] == "degraded"
    assert r["wait_finished"]["finished"] and r["wait_state"]["state"] == "connected"
    assert r["get_after"]["ok"] == [True] * 4 and r["dst"] == r["src"]
    s = r["status_b"]
    assert (s["timeouts"], s["degraded"], s["reconnects"]) == (1, 1, 1) and s["rejected"] >= 2


def test_a_node_started_before_its_master_degrades_by_the_setup_deadline_then_joins():
    r = run("no_master")
    assert r["ready"]["state"] == "degraded" and 1.9 < r["ready_after"] < 6.0
    assert r["put_rejected"]["ok"] == [False, False] and r["put_rejected"]["elapsed"] < 0.3
    assert r["wait_state"]["state"] == "connected"
    assert r["put"]["ok"] == [True, True] and r["get"]["ok"] == [True, True] and r["dst"] == r["src"]
    s = r["status_b"]
    assert s["timeouts"] == 1 and s["setup_failures"] >= 1 and s["state"] == "connected"


def test_a_dead_mooncake_process_degrades_the_tier_and_a_new_one_takes_over():
    r = run("agent_dies")
    assert r["put"] == [True] * 4
    lost = r["get_lost"]
    assert lost["ok"] == [False] * 4 and lost["state"] == "degraded" and lost["elapsed"] < 1.0
    assert r["wait_state"]["state"] == "connected"
    assert r["get_after"]["ok"] == [True] * 4 and r["dst"] == r["src"]  # A's objects outlive B's agent
    s = r["status_b"]
    assert s["degraded"] == 1 and s["reconnects"] == 1 and s["registered_buffers"] == 1
    assert s["errors_by_code"] == {"AGENT_LOST": 4} and s["last_error"].startswith("agent ")


def test_full_segments_refuse_keys_without_degrading_and_make_room_again():
    r = run("full")
    stored = sum(sum(p) for p in r["puts"])
    assert 0 < stored < 96  # 128 MiB of segments cannot take 192 MiB
    s = r["status_full"]
    assert s["put_full"] == 96 - stored and s["errors"] == 0
    assert s["state"] == "connected" and s["degraded"] == 0
    assert r["later"]["ok"] == [True] * 4  # the master's eviction made room
    assert r["too_big"]["ok"] == [False]  # larger than any segment: refused, not split
    assert r["status_a"]["errors_by_code"].get("NO_AVAILABLE_HANDLE", 0) == 0  # "full" is an answer
