"""A folder that does not check starts cold, with a reason, and its old files removed: a flipped
or cut index, a cut or missing segment file, other settings, a smaller ceiling, a corrupted
journal record. A journal cut inside its last write (a torn tail) is not corruption: the
records before it are served, byte for byte."""

import os

import pool_writer as pw
import pytest
from pool_dirs import shm_dir, small_slabs  # noqa: F401 - fixtures
from test_pool_persist import fill, survivors

from tierd.pool import journal
from tierd.pool.pool import Pool

pytestmark = pytest.mark.usefixtures("small_slabs")


def saved(folder: str, seed: int = 1, n: int = 300, save: bool = True) -> set:
    pool = pw.open_pool(folder)
    fill(pool, seed, n)
    if save:
        pool.save({"ns": seed})
    held = survivors(pool)
    pool.close()
    assert len(held) > 20
    return held


def reopen_cold(folder: str, reason: str, **kw) -> None:
    """Opens the folder, expects a cold start for ``reason``, and no old file left behind."""
    args = dict(ceiling=pw.CEILING, initial=0, align=pw.ALIGN, segment_bytes=pw.SEGMENT, meta=pw.META)
    args.update(kw)
    pool = Pool(pool_dir=folder, **args)
    try:
        rep = pool.warm_restart
        assert not rep["warm"] and reason in rep["reason"] and "\n" not in rep["reason"]
        assert pool.objects == 0 and pool.extra is None and pw.check(pool) == (0, [])
        assert sorted(os.listdir(folder)) == ["index", "journal", "lock"]  # segments removed
    finally:
        pool.close()
    pool = Pool(pool_dir=folder, **args)  # and the fresh files it wrote are a valid pool
    assert pool.warm_restart["warm"] and pool.objects == 0
    pool.close()


def rewrite(path: str, fn) -> None:
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(fn(data))


def flip(at: int):
    return lambda d: d[:at] + bytes([d[at] ^ 0x40]) + d[at + 1 :]


@pytest.mark.parametrize("where", [0, 9, 20, 30, 60, -1, "middle"])
def test_a_flipped_index_byte_starts_cold(shm_dir, where):
    saved(shm_dir)
    path = os.path.join(shm_dir, "index")
    at = os.path.getsize(path) // 2 if where == "middle" else where
    rewrite(path, flip(at if at >= 0 else os.path.getsize(path) + at))
    reopen_cold(shm_dir, "index")


@pytest.mark.parametrize("keep", [0, 10, 56, "half", "all-1"])
def test_a_truncated_index_starts_cold(shm_dir, keep):
    saved(shm_dir)
    path = os.path.join(shm_dir, "index")
    n = {"half": os.path.getsize(path) // 2, "all-1": os.path.getsize(path) - 1}.get(keep, keep)
    rewrite(path, lambda d: d[:n])
    reopen_cold(shm_dir, "index")


def test_a_truncated_or_missing_segment_starts_cold(shm_dir):
    saved(shm_dir)
    os.truncate(os.path.join(shm_dir, "segment-00001"), 4096)
    reopen_cold(shm_dir, "segment-00001 holds 4096 bytes")
    saved(shm_dir)
    os.unlink(os.path.join(shm_dir, "segment-00002"))
    reopen_cold(shm_dir, "segment-00002 is missing")


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"align": 8192}, "align 4096 -> 8192"),
        ({"segment_bytes": 2 << 20}, "segment_bytes"),
        ({"meta": {**pw.META, "separate_object_groups": False}}, "meta.separate_object_groups True -> False"),
        ({"meta": {**pw.META, "chunk_tokens": 256}}, "meta.chunk_tokens None -> 256"),
        ({"ceiling": 2 << 20}, "ceiling"),
    ],
)
def test_changed_settings_start_cold(shm_dir, change, reason):
    saved(shm_dir)
    reopen_cold(shm_dir, reason, **change)


def test_a_larger_ceiling_is_not_a_change(shm_dir):
    held = saved(shm_dir)
    pool = Pool(2 * pw.CEILING, 0, pw.ALIGN, pw.SEGMENT, pool_dir=shm_dir, meta=pw.META)
    try:
        assert pool.warm_restart["warm"] and survivors(pool) == held
    finally:
        pool.close()


def test_a_corrupted_journal_record_starts_cold(shm_dir):
    saved(shm_dir, save=False)
    path = os.path.join(shm_dir, "journal")
    rewrite(path, flip(os.path.getsize(path) // 2))
    reopen_cold(shm_dir, "journal record at byte")


def test_a_journal_newer_than_its_index_starts_cold(shm_dir):
    saved(shm_dir)
    rewrite(os.path.join(shm_dir, "journal"), lambda d: journal.header(99))
    reopen_cold(shm_dir, "journal generation 99 is newer")


def test_an_older_journal_than_the_index_is_ignored(shm_dir):
    """A kill between the two renames of a checkpoint: the index already holds everything."""
    pool = pw.open_pool(shm_dir)
    fill(pool, 2, 200)
    pool.save()
    with open(os.path.join(shm_dir, "journal"), "rb") as fh:
        old = fh.read()
    fill(pool, 3, 100)
    pool.save()
    held = survivors(pool)
    pool.close()
    rewrite(os.path.join(shm_dir, "journal"), lambda d: old)
    pool = pw.open_pool(shm_dir)
    try:
        assert pool.warm_restart["warm"] and pool.warm_restart["journal_records"] == 0
        assert survivors(pool) == held
    finally:
        pool.close()


def last_write_torn(folder: str, prepare, act) -> list[int]:
    """Runs ``prepare(pool)`` then ``act(pool)`` on a full pool, then cuts the journal inside the
    one write that act made (all a kill can tear) at several points; returns the objects served
    after each cut."""
    pool = pw.open_pool(folder)
    fill(pool, 4, 300)
    path = os.path.join(folder, "journal")
    got = prepare(pool)
    start = os.path.getsize(path)
    act(pool, got)
    end = os.path.getsize(path)
    pool.close()
    with open(path, "rb") as fh:
        data = fh.read()
    assert end - start > 40 and len(data) == end
    served = []
    for cut in sorted({1, 7, 11, 12, 13, 40, (end - start) // 2, end - start - 1}):  # head: 12 bytes
        with open(path, "wb") as fh:
            fh.write(data[: end - cut])
        _, kept, kept_end = journal.read(data[: end - cut])
        pool = pw.open_pool(folder)
        try:
            rep = pool.warm_restart
            assert rep["warm"] and rep["journal_records"] == len(kept)
            assert rep["torn_bytes"] == end - cut - kept_end
            n, wrong = pw.check(pool)
            assert wrong == [], (cut, wrong[:3])
            served.append(n)
        finally:
            pool.close()
        assert os.path.getsize(path) < end - cut + 1  # the torn tail was cut off before appending
    return served


def test_a_torn_commit_batch_serves_the_commits_before_the_tear(shm_dir):
    def write_four(pool):
        objs = [pw.store(pool, pw.NAMESPACES[1], pw.key(pw.KEYS + i), 1, 10**8 + i) for i in range(4)]
        assert None not in objs
        return objs

    served = last_write_torn(shm_dir, write_four, lambda pool, objs: pool.commit(objs))  # one write of four
    assert served == sorted(served, reverse=True) and served[0] - served[-1] >= 3


def test_a_torn_eviction_batch_serves_the_evicted_objects_intact(shm_dir):
    """A kill inside the write of the drop records: the slot was not yet handed out, so the
    objects whose drops were cut off are served, and their bytes are still theirs."""

    def evict_for_a_big_one(pool, _):
        before = pool.evictions
        assert pool.begin_write(pw.NAMESPACES[1], b"big", {7: (0, 0)}, 0, 200 * pw.KIB, 1, "v0") is not None
        assert pool.evictions - before >= 2  # never written, never committed: as if killed here

    served = last_write_torn(shm_dir, lambda pool: None, evict_for_a_big_one)
    assert served == sorted(served) and served[-1] > served[0]  # the deeper the cut, the more come back
