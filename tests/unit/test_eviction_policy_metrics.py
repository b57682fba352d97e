"""A running daemon says which eviction policy it runs and why it evicted: /status
``eviction_policy``, /metrics ``tierd_hit_ratio``, ``tierd_eviction_policy`` and
``tierd_evictions_by_reason_total``, and ``tierd status``'s table; ``--eviction-policy lru``
is reported as such. The daemon's objects in this process (tests/inproc.py), its registry scraped
as /metrics scrapes it (that /metrics answers over HTTP is tests/daemon/test_http.py's; that
``tierd serve`` refuses an unknown policy, tests/daemon/test_cli.py's)."""

import re

import pytest
from kv import keys
from test_eviction import GEOM, OBJ, src
from util import chunk, ranks  # noqa: F401 - fixtures

from tierd.tools.report import status_table


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
    inproc_factory, inclient_factory, ranks, policy, reasons
):
    d = inproc_factory("--eviction-policy", policy, pool_mb=2)
    c = inclient_factory(d)
    rank = ranks(GEOM, num_blocks=64)
    c.register("r", rank.layout())
    fill_past_capacity(d, c, rank)
    st = d.status()
    assert st["evictions"] == 3
    assert st["eviction_policy"]["name"] == policy
    assert st["eviction_policy"]["evictions_by_reason"] == reasons
    text = d.metrics()
    # 2 chunks hit of 2 + 3 asked for
    assert re.search(r"^tierd_hit_ratio 0\.4$", text, re.M), text
    assert f'tierd_eviction_policy{{policy="{policy}"}} 1.0' in text
    for reason, n in reasons.items():
        assert f'tierd_evictions_by_reason_total{{reason="{reason}"}} {float(n)}' in text
    assert ("tierd_reuse_distance_ticks" in text) == (policy == "reuse")
    assert (re.search(r"^tierd_reuse_bonus_gate 1\.0$", text, re.M) is not None) == (policy == "reuse")
    row = next(line for line in status_table(st).splitlines() if line.startswith("evictions"))
    assert f"3  (policy {policy}:" in row
