"""LOOKUP folds across tensor-parallel ranks: a chunk is reported only when every rank of the
namespace stored every group it needs. Replicated (MLA-like) layouts keep one copy, rank 0's,
and it serves every rank. The daemon's objects in this process (tests/inproc.py), one client
(session) per rank."""

import numpy as np
from kv import GroupGeom, keys
from util import NULL, chunk, ranks  # noqa: F401 - fixtures

from tierd.protocol import messages

N = NULL
FULL = GroupGeom("full", layers=2, block_bytes=256, block_tokens=4)
STATE = GroupGeom("state", layers=1, block_bytes=1024, block_tokens=16)


def two_ranks(ranks, inclient_factory, inproc, *groups, replicated=False):
    r0 = ranks(*groups, rank=0, world_size=2, fingerprint="tp2", replicated=replicated)
    r1 = ranks(*groups, rank=1, world_size=2, fingerprint="tp2", replicated=replicated)
    c0, c1 = inclient_factory(inproc, name="rank0"), inclient_factory(inproc, name="rank1")
    c0.register("tp-0", r0.layout())
    c1.register("tp-1", r1.layout())
    assert r0.ns == r1.ns
    return r0, r1, c0, c1


def test_chunk_stored_by_one_rank_is_not_a_hit(inproc, inclient_factory, ranks):
    r0, r1, c0, c1 = two_ranks(ranks, inclient_factory, inproc, FULL)
    ks = keys(4)
    both = [chunk(k, range(4 * c, 4 * c + 4)) for c, k in enumerate(ks)]
    assert c0.store("tp-0", both).results == ["stored"] * 4

    def hit(inclient):
        return inclient.lookup(r0.ns, ks, r0.specs(), 16, lease=False).chunks

    assert hit(c0) == 0 and hit(c1) == 0  # rank 1 holds nothing yet
    c1.store("tp-1", both[:2])
    assert hit(c0) == 2 and hit(c1) == 2
    c1.store("tp-1", both[2:])
    assert hit(c0) == 4

    # each rank restores its own bytes (the ranks' buffers hold different data)
    assert not np.array_equal(r0.kv[0][:, :16], r1.kv[0][:, :16])
    e0, e1 = r0.blocks(0, range(16)), r1.blocks(0, range(16))
    back = [chunk(k, range(32 + 4 * c, 36 + 4 * c)) for c, k in enumerate(ks)]
    assert c0.retrieve("tp-0", back).ok == [True] * 4
    assert c1.retrieve("tp-1", back).ok == [True] * 4
    np.testing.assert_array_equal(r0.kv[0][:, 32:48], e0)
    np.testing.assert_array_equal(r1.kv[0][:, 32:48], e1)


def test_fold_is_per_group_per_rank(inproc, inclient_factory, ranks):
    """Rank 1 lacks only the state after the last chunk: the hit stops one chunk short."""
    r0, r1, c0, c1 = two_ranks(ranks, inclient_factory, inproc, FULL, STATE)
    ks = keys(3)
    c0.store("tp-0", [chunk(k, range(4 * c, 4 * c + 4), [c]) for c, k in enumerate(ks)])
    c1.store("tp-1", [chunk(k, range(4 * c, 4 * c + 4), [c if c < 2 else N]) for c, k in enumerate(ks)])
    assert c0.lookup(r0.ns, ks, r0.specs(), 16, lease=False).chunks == 2


def test_lease_lives_until_every_rank_retrieved(inproc, inclient_factory, ranks):
    r0, r1, c0, c1 = two_ranks(ranks, inclient_factory, inproc, FULL)
    ks = keys(2)
    for c, name in ((c0, "tp-0"), (c1, "tp-1")):
        c.store(name, [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)])
    reply = c0.lookup(r0.ns, ks, r0.specs(), 16)
    assert reply.chunks == 2 and reply.lease
    back = [chunk(k, range(40 + 4 * i, 44 + 4 * i)) for i, k in enumerate(ks)]
    c0.retrieve("tp-0", back, lease=reply.lease)
    assert inproc.status()["leases_active"] == 1  # rank 1 has not retrieved yet
    c1.retrieve("tp-1", back, lease=reply.lease)
    assert inproc.status()["leases_active"] == 0


def test_replicated_rank0_copy_serves_rank1(inproc, inclient_factory, ranks):
    r0, r1, c0, c1 = two_ranks(ranks, inclient_factory, inproc, FULL, replicated=True)
    ks = keys(3)
    src = [chunk(k, range(4 * c, 4 * c + 4)) for c, k in enumerate(ks)]
    assert c0.store("tp-0", src).results == ["stored"] * 3
    objects = inproc.status()["objects"]
    assert c1.store("tp-1", src).results == ["exists"] * 3  # rank 1 stores nothing
    assert inproc.status()["objects"] == objects == 3
    # nor a chunk rank 0 has not stored (yet): rank 0's copy is the one that will serve every rank
    [new] = keys(1)
    jobs = inproc.status()["request_stages"]["STORE"]["jobs"]  # rank 0's store: one copy
    assert c1.store("tp-1", [chunk(new, range(12, 16))]).results == ["exists"]
    st = inproc.status()
    assert st["objects"] == 3 and st["request_stages"]["STORE"]["jobs"] == jobs == 1  # no copy

    reply = c1.lookup(r1.ns, ks, r1.specs(), 16, replicated=True)
    assert reply.chunks == 3
    expect = r0.blocks(0, range(12))
    assert not np.array_equal(r1.kv[0][:, :12], expect)
    out = c1.retrieve(
        "tp-1", [chunk(k, range(40 + 4 * c, 44 + 4 * c)) for c, k in enumerate(ks)], lease=reply.lease
    )
    assert out == messages.RetrieveReply([True] * 3, [])
    np.testing.assert_array_equal(r1.kv[0][:, 40:52], expect)
