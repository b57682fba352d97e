"""Warm restart with slabs that are buddy blocks: the index and journal record each slab's place
and slot size as before; a restart restores every slab at its block (windows reclaimed across
classes included) and then allocates like a pool never restarted. An index of the older format
(first-fit slabs at any offset) starts cold, and so does a slab record that is no buddy block."""

from pool_dirs import shm_dir  # noqa: F401 - fixtures

from tierd.pool import model, persist
from tierd.pool.pool import Pool

KIB, MIB = 1 << 10, 1 << 20
NS = b"ns"


def open_pool(folder: str) -> Pool:
    return Pool(2 * MIB, 0, 4 * KIB, 1 * MIB, pool_dir=folder, meta={"t": 1})


def key(i: int) -> bytes:
    return b"key-%06d" % i


def put(pool, i, nbytes):
    obj = pool.begin_write(NS, key(i), {0: (0, 0)}, 0, nbytes, 1, "g0")
    if obj is None:
        return None
    obj.view()[:] = i % 251
    pool.commit([obj])
    return obj


def layout(pool) -> list[tuple]:
    return sorted(
        (s.segment.index, s.offset, s.order, s.cls.slot_bytes, s.nslots)
        for c in pool.slabs.classes.values()
        for s in c.slabs
    )


def test_slabs_moved_between_classes_come_back_at_their_blocks(shm_dir):
    pool = open_pool(shm_dir)
    for i in range(512):
        put(pool, i, 4 * KIB)  # 64 slabs of 32 KiB: all 2 MiB
    for i in range(512, 526):
        put(pool, i, 36 * KIB)  # a new class: a slab of 14 in a window of 512 KiB of the coldest
    before, evicted = layout(pool), pool.evictions
    assert evicted == 128 and [s[:3] for s in before if s[3] == 36 * KIB] == [(0, 0, 19)]
    kept = {o.key: o.nbytes for lru in pool.lru.values() for o in lru}
    pool.save()
    pool.close()

    pool = open_pool(shm_dir)
    try:
        assert pool.warm_restart["warm"], pool.warm_restart["reason"]
        assert layout(pool) == before
        assert {o.key: o.nbytes for lru in pool.lru.values() for o in lru} == kept
        for k in kept:
            o = pool.find_ready(NS, k, 0, 0)
            assert (o.view() == int(k[4:]) % 251).all()
        put(pool, 600, 36 * KIB)  # the next window, as a pool never restarted would take it
        assert pool.evictions == 128 and layout(pool)[1][:4] == (0, 512 * KIB, 19, 36 * KIB)
    finally:
        pool.close()


def test_an_index_of_the_older_format_starts_cold(shm_dir, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(model, "FORMAT", 1)
        m.setattr(persist, "FORMAT", 1)
        pool = open_pool(shm_dir)
        put(pool, 0, 4 * KIB)
        pool.save()
        pool.close()
    pool = open_pool(shm_dir)
    try:
        assert not pool.warm_restart["warm"] and "format" in pool.warm_restart["reason"]
        assert pool.objects == 0
    finally:
        pool.close()


def test_a_slab_record_that_is_no_buddy_block_starts_cold(shm_dir):
    pool = open_pool(shm_dir)
    put(pool, 0, 4 * KIB)  # one segment grown, a slab at offset 0
    pool.persist._add(("S", 0, 36 * KIB, 4 * KIB, 3))  # 12 KiB at 36 KiB: inside the segment, not a block
    pool.close()
    pool = open_pool(shm_dir)
    try:
        assert not pool.warm_restart["warm"] and "could not be mapped" in pool.warm_restart["reason"]
    finally:
        pool.close()
