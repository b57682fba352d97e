"""A STORE's run of whole chunks of new keys is allocated and planned in one go
(``Writes.begin_fresh``): its outcome must be exactly what planning the same chunks key by key and
shape by shape gives. Two pools take the same random STOREs in step (new, held and repeated keys,
chunks with null ids, pools small enough to evict, commits and aborts), one of them with the run
path turned off; results, objects, slots, copy items and the pools' whole state must match at
every step. No daemon."""

from __future__ import annotations

import random

import numpy as np
import pytest
from planning import plan_store
from test_planner import FULL, NULL, SLIDE, STATE, geo

from tierd.pool.pool import Pool
from tierd.protocol.messages import Chunk

NS = b"ns-runs-0"
KEYS = [b"key-%06d" % i for i in range(160)]

LAYOUTS = {
    "full": ((FULL,), True),
    "full+sliding, separate": ((FULL, SLIDE), True),
    "full+sliding, one object": ((FULL, SLIDE), False),
    "full+full, one size class": ((FULL, FULL), True),  # two shapes take one class's slots in turn
    "sliding+state": ((SLIDE, STATE), True),
}


def small_pool() -> Pool:
    return Pool(ceiling=96 * 1024, initial=0, align=256, segment_bytes=96 * 1024)


def where(view: np.ndarray, pool: Pool) -> tuple[int, int]:
    """(segment, byte offset) of a view into the pool's memory."""
    at = view.__array_interface__["data"][0]
    for k, seg in enumerate(pool.segments.segments):
        base = seg.view.__array_interface__["data"][0]
        if base <= at < base + seg.view.nbytes:
            return k, at - base
    raise AssertionError("a copy item's view is not in the pool")


def placed(obj, pool: Pool) -> tuple:
    return (obj.key, obj.label, obj.rank, obj.mask, obj.nbytes, where(obj.view(), pool), obj.slot)


def plan_state(plan, pool: Pool) -> tuple:
    copies = {
        g: [(it.ids.tolist(), it.pos.tolist(), it.bpc, where(it.view, pool), it.view.nbytes) for it in items]
        for g, items in plan.copies.items()
    }
    return plan.results, [placed(o, pool) for o in plan.objs], copies, plan.nbytes


def pool_state(pool: Pool) -> tuple:
    entries = {
        key: {pk: placed(o, pool) + (o.ready, o.pins) for pk, o in entry.items()}
        for key, entry in pool.index.spaces.get(NS, {}).items()
    }
    columns = {
        pk: {w: sorted(col) for w, col in part.items()} for pk, part in pool.index.columns.get(NS, {}).items()
    }
    lru = sorted((cls.slot_bytes, [o.key for o in objs]) for cls, objs in pool.lru.items())
    counts = (
        pool.objects,
        pool.used_bytes,
        dict(pool.per_group),
        dict(pool.per_ns),
        dict(pool.per_ns_bytes),
        pool.largest_bytes,
        pool.evictions,
    )
    return entries, columns, lru, counts


def random_chunks(rnd: random.Random, g, n: int) -> list[Chunk]:
    out = []
    for _ in range(n):
        key = rnd.choice(KEYS[:12]) if rnd.random() < 0.2 else rnd.choice(KEYS)
        blocks = []
        for bpc in g.blocks_per_chunk:
            ids = [rnd.randrange(64) for _ in range(bpc)]
            if rnd.random() < 0.15:
                ids = [NULL if rnd.random() < 0.5 else b for b in ids]
            blocks.append(ids)
        out.append(Chunk(key, blocks))
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_run_of_new_chunks_is_planned_exactly_as_chunk_by_chunk(name):
    groups, separate = LAYOUTS[name]
    g = geo(*groups, separate=separate)
    runs, steps = small_pool(), small_pool()
    steps._begin_fresh = lambda *args: []  # the chunk-by-chunk path only
    rnd = random.Random(name)
    fresh_used = 0
    try:
        for step in range(300):
            chunks = random_chunks(rnd, g, rnd.randrange(1, 14))
            a = plan_store(g, chunks, runs, NS, 0)
            b = plan_store(g, chunks, steps, NS, 0)
            assert plan_state(a, runs) == plan_state(b, steps), f"step {step}"
            fresh_used += a.results.count("stored")
            if rnd.random() < 0.85:
                runs.commit(a.objs)
                steps.commit(b.objs)
            else:
                runs.abort(a.objs)
                steps.abort(b.objs)
            if rnd.random() < 0.1:
                touched = rnd.sample(KEYS, 6)
                runs.touch(NS, touched)
                steps.touch(NS, touched)
            assert pool_state(runs) == pool_state(steps), f"step {step}"
        assert runs.evictions > 0, "the pool never had to evict: the test did not reach that path"
        assert fresh_used > 300
    finally:
        runs.close()
        steps.close()


def test_a_run_of_two_shapes_of_one_size_class_interleaves_their_slots():
    """Exact slots: chunk k's two objects (one per group, equal sizes) take slots 2k and 2k + 1
    of one fresh slab, as chunk-by-chunk planning gives them, and the plan lists them chunk by
    chunk (the order a commit touches them in)."""
    g = geo(FULL, FULL, separate=True)
    pool = small_pool()
    try:
        chunks = [Chunk(KEYS[k], [[4 * k + b for b in range(4)]] * 2) for k in range(3)]
        plan = plan_store(g, chunks, pool, NS, 0)
        assert plan.results == ["stored"] * 3
        assert [(o.key, o.label, o.slot) for o in plan.objs] == [
            (KEYS[0], "g0/full", 0),
            (KEYS[0], "g1/full", 1),
            (KEYS[1], "g0/full", 2),
            (KEYS[1], "g1/full", 3),
            (KEYS[2], "g0/full", 4),
            (KEYS[2], "g1/full", 5),
        ]
        assert len({o.slab for o in plan.objs}) == 1
        assert [it.ids.tolist() for it in plan.copies[1]] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    finally:
        pool.close()
