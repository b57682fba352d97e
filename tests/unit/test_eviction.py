"""Eviction under pressure: synchronous LRU that takes a prefix's tail before its head, never
touches leased or in-flight objects, and answers "rejected" (counted in store_rejects) when
nothing evictable frees room: a chunk answered "stored" is always there afterwards.

A 2 MiB pool with 256 KiB objects (2 layers x 4 blocks x 32 KiB) holds a handful of chunks. The
daemon's objects in this process (tests/inproc.py), copying to and from the rank's shared memory."""

import random

import numpy as np
import pytest
from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures

from tierd.protocol import messages

OBJ = 256 << 10
GEOM = GroupGeom("full", layers=2, block_bytes=32 << 10, block_tokens=4)


@pytest.fixture
def tight(inproc_factory, inclient_factory, ranks):
    d = inproc_factory("--max-lease-share", "1", pool_mb=2)  # some tests lease the whole pool
    c = inclient_factory(d)
    rank = ranks(GEOM, num_blocks=64)
    c.register("r", rank.layout())
    cap = d.status()["memory_configured_bytes"] // OBJ
    assert 6 <= cap <= 8
    return d, c, rank, cap


def src(c):
    b = 4 * (c % 8)  # 8 distinct chunks of source blocks, reused
    return list(range(b, b + 4))


def store(inclient, ks, first=0, **kw):
    return inclient.store("r", [chunk(k, src(first + i)) for i, k in enumerate(ks)], **kw).results


def hit(inclient, rank, ks, lease=False):
    reply = inclient.lookup(rank.ns, ks, rank.specs(), 16, lease=lease)
    return reply if lease else reply.chunks


def present(inclient, rank, k):
    return hit(inclient, rank, [k]) == 1


def test_in_flight_objects_are_not_evicted_by_their_own_store(tight):
    d, c, rank, cap = tight
    ks = keys(cap + 2)
    assert store(c, ks) == ["stored"] * cap + ["rejected"] * 2
    st = d.status()
    assert st["objects"] == cap and st["store_rejects"] == 2 and st["evictions"] == 0
    assert hit(c, rank, ks) == cap
    assert not present(c, rank, ks[-1])


def test_pressure_evicts_prefix_tail_before_head(tight):
    d, c, rank, cap = tight
    a, b = keys(cap), keys(2)
    assert store(c, a) == ["stored"] * cap
    assert store(c, b) == ["stored"] * 2
    assert d.status()["evictions"] == 2
    assert hit(c, rank, a) == cap - 2  # a shorter head prefix, no hole
    assert [present(c, rank, k) for k in a] == [True] * (cap - 2) + [False] * 2
    # the surviving head is intact
    expect = rank.blocks(0, range(4 * (cap - 2)))
    out = c.retrieve("r", [chunk(k, range(32 + 4 * i, 36 + 4 * i)) for i, k in enumerate(a[: cap - 2])])
    assert all(out.ok)
    np.testing.assert_array_equal(rank.kv[0][:, 32 : 32 + 4 * (cap - 2)], expect)


def test_store_touch_keeps_prefix_head_most_recent(tight):
    """Regression: STORE's ``touch`` (the prefix before the stored chunks) was applied before the
    new chunks were committed, so each extension of a prefix became more recent than its head and
    pressure evicted the head first, losing the whole prefix."""
    d, c, rank, cap = tight
    a = keys(cap - 1)
    for i in range(0, len(a), 2):
        assert set(store(c, a[i : i + 2], first=i, touch=a[:i])) == {"stored"}
    # (no LOOKUP in between: it would refresh the head by itself)
    store(c, keys(3), first=0)  # 2 evictions
    assert d.status()["evictions"] == 2
    assert hit(c, rank, a) == cap - 3
    assert [present(c, rank, k) for k in a] == [True] * (cap - 3) + [False] * 2


def test_leased_objects_are_never_evicted_and_store_is_rejected(tight):
    d, c, rank, cap = tight
    a, b = keys(cap), keys(1)
    store(c, a)
    reply = hit(c, rank, a, lease=True)
    assert reply.chunks == cap and reply.lease
    before = d.status()
    assert store(c, b) == ["rejected"]  # answered, not acknowledged and dropped
    after = d.status()
    assert after["store_rejects"] == before["store_rejects"] + 1
    assert after["objects"] == cap and after["evictions"] == 0
    assert hit(c, rank, b) == 0
    assert c.clear().evicted == 0  # CLEAR spares leased objects too
    # everything the lease covers is retrievable, byte for byte
    expect = rank.blocks(0, [b for i in range(cap) for b in src(i)])
    dst = [list(range(32 + 4 * (i % 8), 36 + 4 * (i % 8))) for i in range(cap)]
    out = c.retrieve("r", [chunk(k, ids) for k, ids in zip(a, dst)], lease=reply.lease)
    assert out == messages.RetrieveReply([True] * cap, [])
    np.testing.assert_array_equal(rank.kv[0][:, 32 : 32 + 4 * cap], expect)
    # the retrieve spent the lease: the objects are evictable again
    assert d.status()["leases_active"] == 0
    assert store(c, b) == ["stored"]
    assert d.status()["evictions"] == 1


def test_leased_prefix_survives_heavy_pressure(tight):
    d, c, rank, cap = tight
    a = keys(cap)
    store(c, a)
    reply = hit(c, rank, a[:3], lease=True)
    assert reply.chunks == 3
    for _ in range(4):
        results = store(c, keys(cap))
        assert results.count("stored") == cap - 3 and results.count("rejected") == 3
    assert hit(c, rank, a) == 3
    expect = rank.blocks(0, range(12))
    out = c.retrieve(
        "r", [chunk(k, range(40 + 4 * i, 44 + 4 * i)) for i, k in enumerate(a[:3])], lease=reply.lease
    )
    assert out.ok == [True] * 3
    np.testing.assert_array_equal(rank.kv[0][:, 40:52], expect)


def test_stored_means_stored_under_pressure(tight):
    d, c, rank, cap = tight
    rng = random.Random(7)
    for _ in range(12):
        ks = keys(rng.randint(1, cap))
        results = store(c, ks, first=rng.randint(0, 7))
        for k, r in zip(ks, results):
            assert r in ("stored", "rejected")
            assert present(c, rank, k) == (r == "stored"), r
    st = d.status()
    assert st["evictions"] > 0
    assert st["memory_used_bytes"] <= st["memory_total_bytes"] <= st["memory_configured_bytes"]
