"""Planned restart of a file-backed pool: every committed object comes back byte for byte in its
LRU order, the restored allocator behaves exactly like one never restarted, objects being
written are left out, the caller's extra blob comes back, and only tmpfs/hugetlbfs folders held
by one pool are accepted."""

import os
import random

import pool_writer as pw
import pytest
from pool_dirs import huge_dir, shm_dir, small_slabs, small_tmpfs  # noqa: F401 - fixtures

from tierd.pool import persist
from tierd.pool.pool import Pool
from tierd.pool.pooldir import TMPFS_MAGIC, PoolDirError, statfs

pytestmark = pytest.mark.usefixtures("small_slabs")  # several size classes in a few MiB


def fill(pool, seed: int, n: int) -> list:
    """n stores of random keys over both namespaces and ranks, with touches in between."""
    r, stored = random.Random(seed), []
    for v in range(seed * 10**6, seed * 10**6 + n):
        ns, k = r.choice(pw.NAMESPACES), pw.key(r.randrange(pw.KEYS))
        obj = pw.store(pool, ns, k, r.choice(pw.RANKS), v)
        if obj is not None:
            pool.commit([obj])
            stored.append((ns, k))
        if r.random() < 0.2 and stored:
            pool.touch(*r.choice(stored))
    return stored


def lru_of(pool) -> dict:
    return {cls.slot_bytes: [(o.ns, o.key, o.rank, o.label) for o in lru] for cls, lru in pool.lru.items()}


def survivors(pool) -> set:
    return {(o.ns, o.key, o.rank, o.label) for lru in pool.lru.values() for o in lru}


def test_planned_restart_restores_every_object_in_lru_order(shm_dir):
    pool = pw.open_pool(shm_dir)
    assert not pool.warm_restart["warm"] and "first start" in pool.warm_restart["reason"]
    fill(pool, 1, 400)
    pinned = [o for lru in pool.lru.values() for o in list(lru)[:1]]
    pool.pin(pinned)  # leases are not persisted: back unpinned
    writing = pw.store(pool, pw.NAMESPACES[1], pw.key(pw.KEYS + 1), 0, 7)  # never committed
    before, lru, n = survivors(pool), lru_of(pool), pool.objects - 1
    assert len(lru) >= 3 and len({o[0] for o in before}) == 2 and any("," in str(o) for o in before)
    assert any(o.mask != (1 << 4) - 1 for lru_ in pool.lru.values() for o in lru_)  # partial masks
    used = pool.used_bytes - writing.slab.cls.slot_bytes
    pool.save({"namespaces": {"ns-model-a": {"model": "m", "world_size": 2}}})
    pool.close()

    pool = pw.open_pool(shm_dir)
    try:
        rep = pool.warm_restart
        assert rep["warm"] and rep["reason"] is None and rep["objects"] == n and rep["journal_records"] == 0
        assert rep["bytes"] == sum(o.nbytes for lru_ in pool.lru.values() for o in lru_)
        assert pool.extra == {"namespaces": {"ns-model-a": {"model": "m", "world_size": 2}}}
        assert survivors(pool) == before and lru_of(pool) == lru
        assert pool.objects == n and pool.used_bytes == used
        assert pw.check(pool) == (n, [])
        assert pool.find_ready(pw.NAMESPACES[1], pw.key(pw.KEYS + 1), 0, 0) is None
        assert all(o.pins == 0 for lru_ in pool.lru.values() for o in lru_)
    finally:
        pool.close()


def test_a_restored_pool_allocates_and_evicts_like_one_never_restarted(shm_dir):
    """Free slots, free segment space and recency are all restored: the same later workload
    keeps exactly the same objects in both, and the old objects' bytes survive new writes."""
    twin = Pool(pw.CEILING, 0, pw.ALIGN, pw.SEGMENT)  # memfd: never restarted
    pool = pw.open_pool(shm_dir)
    try:
        for p in (twin, pool):
            fill(p, 2, 300)
        pool.save()
        pool.close()
        pool = pw.open_pool(shm_dir)
        assert pool.warm_restart["warm"] and survivors(pool) == survivors(twin)
        evictions = twin.evictions
        for p in (twin, pool):
            fill(p, 3, 150)
        assert survivors(pool) == survivors(twin)
        assert pool.evictions == twin.evictions - evictions > 0
        assert pool.backed_bytes == twin.backed_bytes and pool.used_bytes == twin.used_bytes
        assert pw.check(pool)[1] == []
    finally:
        twin.close()
        pool.close()


def test_close_without_save_recovers_from_the_journal_alone(shm_dir):
    pool = pw.open_pool(shm_dir)
    fill(pool, 4, 300)
    pool.note_extra({"noted": 1})
    before = survivors(pool)
    pool.close()
    pool = pw.open_pool(shm_dir)
    try:
        rep = pool.warm_restart
        assert rep["warm"] and rep["journal_records"] > 300 and pool.extra == {"noted": 1}
        assert survivors(pool) == before and pw.check(pool)[1] == []
    finally:
        pool.close()


def test_automatic_checkpoints_bound_the_journal_and_lose_nothing(shm_dir, monkeypatch):
    monkeypatch.setattr(persist, "COMPACT_MIN", 100)
    pool = pw.open_pool(shm_dir)
    fill(pool, 5, 500)
    gen, records, before = pool.persist.generation, pool.persist.journal.records, survivors(pool)
    pool.close()
    assert gen > 3 and records <= max(100, 2 * len(before)) + 8  # rotated, not grown without bound
    pool = pw.open_pool(shm_dir)
    try:
        assert pool.warm_restart["warm"] and survivors(pool) == before and pw.check(pool)[1] == []
    finally:
        pool.close()


def test_a_folder_not_on_tmpfs_or_hugetlbfs_is_refused(tmp_path):
    if statfs(str(tmp_path))[0] == TMPFS_MAGIC:
        pytest.skip("the test tmp folder is itself on tmpfs here")
    folder = tmp_path / "pool"
    with pytest.raises(PoolDirError) as err:
        Pool(1 << 20, 0, 4096, 1 << 20, pool_dir=str(folder))
    assert str(folder) in str(err.value) and "must be on tmpfs or hugetlbfs" in str(err.value)
    assert os.listdir(folder) == []  # nothing written there


def test_a_folder_is_held_by_one_pool_at_a_time(shm_dir):
    pool = pw.open_pool(shm_dir)
    try:
        with pytest.raises(PoolDirError, match="held by another pool"):
            pw.open_pool(shm_dir)
    finally:
        pool.close()
    pw.open_pool(shm_dir).close()  # released with the pool


def test_hugetlbfs_segments_are_whole_huge_pages_and_restart_warm(huge_dir, shm_dir):
    with pytest.raises(PoolDirError, match="hugetlbfs files cannot be written"):
        Pool(8 << 20, 0, 4096, 3 << 20, pool_dir=huge_dir)  # its index needs a tmpfs folder
    pool = Pool(8 << 20, 0, 4096, 3 << 20, pool_dir=huge_dir, meta={"m": 1}, index_dir=shm_dir)
    fill(pool, 6, 200)
    page = pool.persist.folder.grain
    assert page >= 2 << 20 and all(s.nbytes % page == 0 for s in pool.segments.segments)
    before = survivors(pool)
    pool.save()
    pool.close()
    pool = Pool(8 << 20, 0, 4096, 3 << 20, pool_dir=huge_dir, meta={"m": 1}, index_dir=shm_dir)
    try:
        assert pool.warm_restart["warm"] and survivors(pool) == before and pw.check(pool)[1] == []
    finally:
        pool.close()


def test_a_full_tmpfs_stops_growth_and_the_journal_never_a_wrong_restart(small_tmpfs):
    """The pool stops growing (a store is not stored, no SIGBUS at a later copy); a journal
    write that fails removes the index, so the next start is cold rather than stale."""
    folder, filler = os.path.join(small_tmpfs, "pool"), os.path.join(small_tmpfs, "filler")
    pool = Pool(8 << 20, 0, 4096, 1 << 20, pool_dir=folder, meta={"m": 1})
    try:
        fill(pool, 7, 400)
        assert pool.segments.grow_error and "cannot back" in pool.segments.grow_error
        assert pool.backed_bytes < 4 << 20 and pool.objects > 0 and pw.check(pool)[1] == []
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(OSError):
                while True:
                    os.write(fd, b"\0" * 4096)  # take what is left
        finally:
            os.close(fd)
        fill(pool, 8, 200)  # commits and evictions: the journal cannot be written
        assert pool.persist.error and "journal write failed" in pool.persist.error
        assert not os.path.exists(os.path.join(folder, "index"))
        assert pw.check(pool)[1] == []  # still serving from memory
    finally:
        pool.close()
    os.unlink(filler)
    pool = Pool(8 << 20, 0, 4096, 1 << 20, pool_dir=folder, meta={"m": 1})
    try:
        assert not pool.warm_restart["warm"] and "no index" in pool.warm_restart["reason"]
    finally:
        pool.close()


def levels_of(pool) -> dict:
    return {(o.ns, o.key, o.rank, o.label): o.hits for lru in pool.lru.values() for o in lru}


def test_planned_restart_keeps_the_reuse_policys_levels_and_what_it_learned(shm_dir):
    pool = pw.open_pool(shm_dir)
    assert pool.policy.name == "reuse"
    fill(pool, 3, 300)
    objs = [o for lru in pool.lru.values() for o in list(lru)[::3]]
    with pool.lock:
        pool.touch_objects(objs)  # found by a LOOKUP: one level up
        pool.touch_objects(objs[::2])  # twice: two
    before = levels_of(pool)
    assert 0 in before.values() and len(set(before.values()) - {0}) >= 2
    p = pool.policy
    p.estimates, p.s, p.guard.gate = [100.0, 300.0], 0.5, 0.25
    pool.save()
    pool.close()

    pool = pw.open_pool(shm_dir)
    try:
        assert pool.warm_restart["warm"]
        assert levels_of(pool) == before
        p = pool.policy
        assert (p.B, p.s, p.guard.gate, p.bonus) == (200.0, 0.5, 0.25, [0, 25, 38, 50])
        objs = [o for lru in pool.lru.values() for o in lru]
        first = pool.coldest(1 << 30)[0]
        assert first.hits == 0  # a level-0 object goes before the ones found before
        assert all(o in pool.lru[o.slab.cls].q[o.hits] for o in objs)  # each in its level's queue
    finally:
        pool.close()


def test_an_index_without_levels_restores_every_object_at_level_zero(shm_dir, monkeypatch):
    """An index of a tierd before levels were kept: the same objects, all at level 0, and the
    policy starts from scratch."""
    from tierd.pool import model

    pool = pw.open_pool(shm_dir)
    fill(pool, 4, 200)
    with pool.lock:
        pool.touch_objects([o for lru in pool.lru.values() for o in lru])
    pool.policy.estimates = [100.0]
    packb = model.msgpack.packb

    def older(obj, **kw):  # the index body as an older tierd wrote it
        if isinstance(obj, dict) and "levels" in obj:
            obj = {k: v for k, v in obj.items() if k not in ("levels", "policy")}
        return packb(obj, **kw)

    monkeypatch.setattr(model.msgpack, "packb", older)
    pool.save()
    pool.close()
    monkeypatch.setattr(model.msgpack, "packb", packb)

    pool = pw.open_pool(shm_dir)
    try:
        assert pool.warm_restart["warm"] and pool.objects > 0
        assert set(levels_of(pool).values()) == {0}
        assert pool.policy.B == 0.0 and pool.policy.estimates == []
    finally:
        pool.close()
