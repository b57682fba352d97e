"""A running daemon says which eviction policy it runs and why it evicted: /status
``eviction_policy``, /metrics ``tierd_hit_ratio``, ``tierd_eviction_policy`` and
``tierd_evictions_by_reason_total``, and ``tierd status``'s table; ``--eviction-policy lru``
is reported as such."""

import re

import pytest
from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures

from tierd.tools.report import status_table
from tierd.tools.testing import serve_argv

OBJ = 256 << 10  # a 2 MiB pool holds a handful of these (tests/unit/test_eviction.py's geometry)
GEOM = GroupGeom("full", layers=2, block_bytes=32 << 10, block_tokens=4)


def src(c):
    b = 4 * (c % 8)  # 8 distinct chunks of source blocks, reused
    return list(range(b, b + 4))


def fill_past_capacity(d, c, rank) -> int:
    cap = d.status()["memory_configured_bytes"] // OBJ
    a = keys(cap)
    assert c.store("r", [chunk(k, src(i)) for i, k in enumerate(a)]).results == ["stored"] * cap
    assert c.lookup(rank.ns, a[:2], rank.specs(), 16).chunks == 2  # 2 found: level 1
    c.lookup(rank.ns, keys(3), rank.specs(), 16)  # 3 more keys asked for, none held
    b = keys(3)
    assert c.store("r", [chunk(k, src(i)) for i, k in enumerate(b)]).results == ["stored"] * 3
    return cap


@pytest.mark.parametrize(
    "policy, reasons", [("reuse", {"unused": 3, "aged": 0, "displaced": 0}), ("lru", {"lru": 3})]
)
def test_status_metrics_and_table_show_the_policy_and_its_eviction_reasons(
    daemon_factory, client_factory, ranks, policy, reasons
):
    d = daemon_factory("--eviction-policy", policy, pool_mb=2)
    c = client_factory(d)
    rank = ranks(GEOM, num_blocks=64)
    c.register("r", rank.layout())
    fill_past_capacity(d, c, rank)
    st = d.status()
    assert st["evictions"] == 3
    assert st["eviction_policy"]["name"] == policy
    assert st["eviction_policy"]["evictions_by_reason"] == reasons
    code, body = d.get("/metrics")
    text = body.decode()
    assert code == 200
    # 2 chunks hit of 2 + 3 asked for
    assert re.search(r"^tierd_hit_ratio 0\.4$", text, re.M), text
    assert f'tierd_eviction_policy{{policy="{policy}"}} 1.0' in text
    for reason, n in reasons.items():
        assert f'tierd_evictions_by_reason_total{{reason="{reason}"}} {float(n)}' in text
    assert ("tierd_reuse_distance_ticks" in text) == (policy == "reuse")
    assert (re.search(r"^tierd_reuse_bonus_gate 1\.0$", text, re.M) is not None) == (policy == "reuse")
    row = next(line for line in status_table(st).splitlines() if line.startswith("evictions"))
    assert f"3  (policy {policy}:" in row


def test_an_unknown_policy_is_refused_at_start(daemon_factory):
    import subprocess
    import sys

    out = subprocess.run(
        serve_argv("--eviction-policy", "arc", http_port=-1),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "'arc' is not one of 'reuse', 'lru'" in out.stderr
