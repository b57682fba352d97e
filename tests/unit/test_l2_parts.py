"""The LOOKUP fold over L1 and L2 and the L2 names, as pure functions of (keys, geometry, pool, what
L2 holds): exact boundaries for full, state and combined layouts over two ranks, the parts worth
asking L2 about, and names that carry the namespace (a tenant's chunks never answer another)."""

from __future__ import annotations

import random

import pytest
from planning import plan_store

from tierd.pool.pool import Pool
from tierd.protocol.layout import GroupSpec, PageLayout
from tierd.protocol.messages import Chunk
from tierd.state.planner import Geometry
from tierd.tier2.parts import Part, Remote, fold, missing, obj_name, part_name

NULL = -1
NS, OTHER = b"n" * 16, b"o" * 16
CHUNK = 16
FULL, STATE = ("full", 4), ("state", 16)


def geometry(*groups, separate=True) -> Geometry:
    tensors, gs = [], []
    for i, (kind, bt) in enumerate(groups):
        tensors.append({"handle": {"kind": "shm", "path": f"/dev/shm/x{i}"}, "nbytes": 64 * 256})
        gs.append(
            {
                "kind": kind,
                "block_tokens": bt,
                "layers": [
                    {"tensor": i, "offset": 0, "block_stride": 256, "num_blocks": 64, "run_bytes": 256}
                ],
            }
        )
    layout = PageLayout.from_wire(
        {
            "namespace": {"model": "m", "fingerprint": "f", "world_size": 2},
            "rank": 0,
            "chunk_tokens": CHUNK,
            "tensors": tensors,
            "groups": gs,
        }
    )
    return Geometry(layout, separate, NULL)


def specs(*groups) -> list[GroupSpec]:
    return [GroupSpec.from_wire({"kind": k, "block_tokens": bt}) for k, bt in groups]


KEYS = [b"key-%08d" % i for i in range(6)]


@pytest.fixture
def pool():
    p = Pool(ceiling=192 << 20, initial=0, align=256, segment_bytes=16 << 20)  # a 64 MiB slab per size class
    yield p
    p.close()


def store(pool, geo, i: int, rank: int, group: int):
    """Chunk i's object of ``group`` on ``rank`` in L1, committed."""
    blocks = [[NULL] * n for n in geo.blocks_per_chunk]
    blocks[group] = list(range(geo.blocks_per_chunk[group]))
    plan = plan_store(geo, [Chunk(KEYS[i], blocks)], pool, NS, rank)
    pool.commit(plan.objs)
    return plan.objs


def test_a_chunk_counts_only_when_every_group_and_rank_is_in_one_tier_or_the_other(pool):
    geo = geometry(FULL, STATE)
    for i in range(3):
        store(pool, geo, i, 0, 0)  # rank 0's attention for chunks 0..2 in L1
    store(pool, geo, 1, 0, 1)  # rank 0's state at chunk 1
    l2 = {Part(KEYS[i], 0, 1) for i in range(4)} | {Part(KEYS[3], 0, 0), Part(KEYS[1], 1, 1)}
    args = (pool, NS, KEYS, specs(FULL, STATE), CHUNK, [0, 1], geo)
    assert fold(*args, ())[0] == 0  # L1 alone: rank 1 holds nothing
    hit, objs = fold(*args, l2)
    assert hit == 2  # chunk 2 has no state on either rank, chunk 3 none on rank 0
    assert sorted(o.part for o in objs if isinstance(o, Remote)) == sorted(
        [Part(KEYS[0], 0, 1), Part(KEYS[1], 0, 1), Part(KEYS[1], 1, 1)]
    )
    assert sum(not isinstance(o, Remote) for o in objs) == 3  # rank 0: attention 0, 1 and state 1 from L1
    assert fold(*args, l2 | {Part(KEYS[3], 1, 0), Part(KEYS[3], 1, 1), Part(KEYS[2], 0, 0)})[0] == 4


def test_without_l2_the_fold_is_the_pools_own_lookup(pool):
    geo = geometry(FULL, STATE)
    rng = random.Random(5)
    for i in range(6):
        for r in range(2):
            for g in range(2):
                if rng.random() < 0.8:
                    store(pool, geo, i, r, g)
    for ranks in ([0], [1], [0, 1]):
        for n in range(7):
            want = pool.lookup(NS, KEYS[:n], specs(FULL, STATE), CHUNK, ranks)
            got = fold(pool, NS, KEYS[:n], specs(FULL, STATE), CHUNK, ranks, geo, ())
            assert (got[0], set(got[1])) == (want[0], set(want[1]))


def test_only_parts_l1_lacks_are_asked_in_chunk_order_and_not_those_coming_or_being_written(pool):
    geo = geometry(FULL, STATE)
    store(pool, geo, 0, 0, 0)
    blocks = [list(range(4)), [NULL]]
    writing = plan_store(geo, [Chunk(KEYS[1], blocks)], pool, NS, 0).objs  # a STORE in flight
    coming = {Part(KEYS[0], 1, 0)}
    got = missing(pool, NS, KEYS[:3], geo, 2, [0], coming, limit=100)
    assert got == [Part(KEYS[1], 1, 0), Part(KEYS[2], 0, 0), Part(KEYS[2], 1, 0)]
    assert missing(pool, NS, KEYS[:3], geo, 1, [0], coming, limit=100) == [
        Part(KEYS[2], 0, 0)
    ]  # attention only
    assert missing(pool, NS, KEYS, geo, 2, [0, 1], (), limit=4) == [
        Part(KEYS[0], 0, 1),
        Part(KEYS[0], 1, 0),
        Part(KEYS[0], 1, 1),
        Part(KEYS[1], 0, 1),
    ]
    pool.abort(writing)


def test_an_l1_object_and_its_part_have_one_name_that_carries_namespace_group_and_rank(pool):
    geo = geometry(FULL, STATE)
    (obj,) = store(pool, geo, 2, 1, 1)
    assert obj_name(obj) == part_name(NS, Part(KEYS[2], 1, 1), geo)
    names = {part_name(ns, Part(KEYS[2], s, r), geo) for ns in (NS, OTHER) for s in (0, 1) for r in (0, 1)}
    assert len(names) == 8
    assert all(n.startswith(NS) or n.startswith(OTHER) for n in names)  # the namespace id leads


def test_combined_objects_are_one_part_named_group_minus_one(pool):
    geo = geometry(FULL, STATE, separate=False)
    blocks = [list(range(4)), [9]]
    (obj,) = plan_store(geo, [Chunk(KEYS[0], blocks)], pool, NS, 0).objs
    pool.commit([obj])
    assert obj_name(obj)[-4:] == b"\xff\xff\x00\x00"  # group -1, rank 0
    assert missing(pool, NS, KEYS[:2], geo, 2, [0], (), limit=10) == [Part(KEYS[1], 0, 0)]
    hit, objs = fold(pool, NS, KEYS[:2], specs(FULL, STATE), CHUNK, [0], geo, {Part(KEYS[1], 0, 0)})
    assert hit == 2 and objs[0] is obj and isinstance(objs[1], Remote) and len(objs) == 2
