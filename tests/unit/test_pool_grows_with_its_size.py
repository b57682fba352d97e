"""The pool backs memory in steps that follow its size: a new segment is as large as the pool
already is (a power of two), from --l1-grow-mb (64 MiB) up to --l1-segment-mb (1 GiB), and at
least the slab it is grown for (tierd.pool.segments); /status says what is backed and what the
next growth backs. A warm restart keeps the recorded segments whatever the steps were.

Regression: every growth backed a whole --l1-segment-mb segment: 1 GiB for a 1.25 MiB object."""

from __future__ import annotations

import pytest
from pool_dirs import shm_dir  # noqa: F401 - fixture

from tierd.config import Settings
from tierd.pool.pool import Pool
from tierd.pool.segments import SegmentSet

KIB, MIB = 1 << 10, 1 << 20
NS = b"namespace-0"


def test_a_first_small_object_backs_one_64_mib_segment_not_a_whole_gib(tmp_path):
    from tierd.server import Daemon

    d = Daemon(Settings(socket=f"ipc://{tmp_path}/t.sock", http_port=-1))  # defaults: an 8 GiB ceiling
    try:
        obj = d.pool.begin_write(NS, b"k" * 16, {0: (0, 0)}, 0, 1280 * KIB, 1, "g0")
        assert obj is not None
        st = d.status()
        assert st["memory_total_bytes"] == 64 * MIB and st["memory_segments"] == 1
        assert st["memory_next_segment_bytes"] == 64 * MIB and st["memory_used_bytes"] == 1280 * KIB
        d.pool.abort([obj])
    finally:
        d.close()


def test_segments_double_with_the_pool_from_the_grow_step_to_the_segment_size():
    s = SegmentSet(
        ceiling=4 * MIB + 96 * KIB, initial=0, segment_bytes=1 * MIB, align=4 * KIB, grow_bytes=64 * KIB
    )
    try:
        assert s.next_segment_bytes() == 64 * KIB
        while s.alloc(64 * KIB) is not None:
            pass
        sizes = [seg.nbytes // KIB for seg in s.segments]
        assert sizes == [64, 64, 128, 256, 512, 1024, 1024, 1024, 96]  # the last: what the ceiling left
        assert s.backed == s.ceiling and s.next_segment_bytes() == 0
    finally:
        s.close()


def test_a_block_larger_than_the_step_gets_a_segment_of_its_own_size():
    s = SegmentSet(ceiling=8 * MIB, initial=0, segment_bytes=1 * MIB, align=4 * KIB, grow_bytes=64 * KIB)
    try:
        assert s.alloc(512 * KIB) is not None and [g.nbytes for g in s.segments] == [512 * KIB]
        assert s.alloc(2 * MIB) is not None  # larger than --l1-segment-mb: a segment of its own
        assert [g.nbytes for g in s.segments] == [512 * KIB, 2 * MIB]
        assert s.alloc(8 * MIB) is None and s.backed == 2560 * KIB  # past the ceiling: nothing grown
    finally:
        s.close()


def test_the_initial_backing_counts_as_the_pool_size_for_the_next_step():
    s = SegmentSet(
        ceiling=8 * MIB, initial=256 * KIB, segment_bytes=1 * MIB, align=4 * KIB, grow_bytes=64 * KIB
    )
    try:
        assert [g.nbytes for g in s.segments] == [256 * KIB] and s.next_segment_bytes() == 256 * KIB
    finally:
        s.close()


def test_without_a_grow_step_every_segment_is_whole_as_before():
    s = SegmentSet(ceiling=4 * MIB, initial=0, segment_bytes=1 * MIB, align=4 * KIB)
    try:
        s.alloc(4 * KIB)
        assert [g.nbytes for g in s.segments] == [1 * MIB]
    finally:
        s.close()


def fill(pool: Pool, n: int, nbytes: int) -> None:
    for i in range(n):
        obj = pool.begin_write(NS, b"key-%08d" % i, {0: (0, 0)}, 0, nbytes, 1, "g0")
        assert obj is not None
        pool.commit([obj])


@pytest.mark.parametrize("grow_after", [64 * KIB, None])
def test_a_warm_restart_keeps_the_grown_segments_whatever_the_grow_step(shm_dir, grow_after):  # noqa: F811
    """The grow step shapes only new segments: it is not among the settings a restart compares
    (so a pool of 1 GiB segments written before the step existed restarts warm too)."""
    pool = Pool(8 * MIB, 0, 4 * KIB, 1 * MIB, pool_dir=shm_dir, meta={"m": 1}, grow_bytes=64 * KIB)
    try:
        fill(pool, 80, 4 * KIB)  # ten slabs of 32 KiB
        sizes = [seg.nbytes for seg in pool.segments.segments]
        assert sizes == [64 * KIB, 64 * KIB, 128 * KIB, 256 * KIB]
        pool.save()
    finally:
        pool.close()
    pool = Pool(8 * MIB, 0, 4 * KIB, 1 * MIB, pool_dir=shm_dir, meta={"m": 1}, grow_bytes=grow_after)
    try:
        assert pool.warm_restart["warm"], pool.warm_restart["reason"]
        assert [seg.nbytes for seg in pool.segments.segments] == sizes and pool.objects == 80
    finally:
        pool.close()
