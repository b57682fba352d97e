"""The pool is lazily grown: /status memory_total_bytes starts at --l1-init-size-gb, grows as
objects arrive and never passes memory_configured_bytes (--l1-size-gb), after which stores evict.
The daemon's objects in this process (tests/inproc.py), built from ``tierd serve``'s flags."""

from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures

MIB = 1 << 20
GEOM = GroupGeom("full", layers=4, block_bytes=64 << 10, block_tokens=4)  # 1 MiB objects


def test_pool_grows_lazily_up_to_its_ceiling(inproc_factory, inclient_factory, ranks):
    d = inproc_factory("--l1-init-size-gb", "0.015625", "--l1-segment-mb", "16", pool_mb=96)
    st = d.status()
    assert st["memory_total_bytes"] == 16 * MIB
    assert st["memory_configured_bytes"] == 96 * MIB
    assert st["memory_used_bytes"] == 0
    c = inclient_factory(d)
    rank = ranks(GEOM, num_blocks=16)
    c.register("r", rank.layout())
    totals = []
    for _ in range(14):
        res = c.store("r", [chunk(k, range(4 * (i % 4), 4 * (i % 4) + 4)) for i, k in enumerate(keys(8))])
        assert res.results == ["stored"] * 8
        st = d.status()
        assert st["memory_used_bytes"] <= st["memory_total_bytes"] <= st["memory_configured_bytes"]
        totals.append(st["memory_total_bytes"])
    assert totals == sorted(totals)  # never shrinks
    assert totals[0] == 16 * MIB  # the first 8 MiB fit in what was backed (an 8-slot slab)
    assert 16 * MIB < totals[2] < 96 * MIB  # then grew on demand, a segment at a time, not to the ceiling
    assert totals[-1] == 96 * MIB
    assert st["evictions"] > 0 and st["objects"] == 96


def test_pool_never_backs_more_than_its_ceiling(inproc_factory, inclient_factory, ranks):
    """Regression: a ceiling that is not a multiple of --l1-align-bytes (2 MiB passed as
    0.001953 GiB) was exceeded, the last segment being rounded up past it."""
    d = inproc_factory(pool_mb=2)
    c = inclient_factory(d)
    rank = ranks(GroupGeom("full", layers=2, block_bytes=32 << 10, block_tokens=4), num_blocks=16)
    c.register("r", rank.layout())
    for _ in range(3):
        c.store("r", [chunk(k, range(4 * (i % 4), 4 * (i % 4) + 4)) for i, k in enumerate(keys(4))])
    st = d.status()
    assert st["objects"] > 0
    assert st["memory_total_bytes"] <= st["memory_configured_bytes"] <= 2 * MIB
    assert st["memory_used_bytes"] <= st["memory_total_bytes"]
