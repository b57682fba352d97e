"""The pool backs memory in steps that follow its size: a new segment is as large as the pool
already is (a power of two), from --l1-grow-mb (64 MiB) up to --l1-segment-mb (1 GiB), and at
least the slab it is grown for (tierd.pool.segments); /status says what is backed and what the
next growth backs. A warm restart keeps the recorded segments whatever the steps were.

Regression: every growth backed a whole --l1-segment-mb segment: 1 GiB for a 1.25 MiB object."""

from __future__ import annotations

import os
import threading
import time

import pytest
from pool_dirs import shm_dir  # noqa: F401 - fixture

from tierd.base.config import Settings
from tierd.pool.pool import Pool
from tierd.pool.segments import SegmentSet
from tierd.tools.report import status_table

KIB, MIB = 1 << 10, 1 << 20
NS = b"namespace-0"


def test_a_first_small_object_backs_one_64_mib_segment_not_a_whole_gib(tmp_path):
    from tierd.daemon.server import Daemon

    d = Daemon(Settings(socket=f"ipc://{tmp_path}/t.sock", http_port=-1))  # defaults: an 8 GiB ceiling
    try:
        obj = d.pool.begin_write(NS, b"k" * 16, {0: (0, 0)}, 0, 1280 * KIB, 1, "g0")
        assert obj is not None
        st = d.status()
        assert st["memory_total_bytes"] == 64 * MIB and st["memory_segments"] == 1
        assert st["memory_next_segment_bytes"] == 64 * MIB and st["memory_used_bytes"] == 1280 * KIB
        assert st["memory_ahead_bytes"] == 64 * MIB  # the next step, backed ahead (not in the total)
        assert "1 segment; the next grows 64.00 MiB, backed ahead" in status_table(st)  # tierd status
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


@pytest.mark.parametrize(("grow_after", "ahead"), [(64 * KIB, False), (None, False), (64 * KIB, True)])
def test_a_warm_restart_keeps_the_grown_segments_whatever_the_grow_step(shm_dir, grow_after, ahead):  # noqa: F811
    """The grow step shapes only new segments: it is not among the settings a restart compares
    (so a pool of 1 GiB segments written before the step existed restarts warm too). Backed
    ahead, a pool folder's next segment is a file of its own until the pool takes it; one left
    behind (a crash) is removed at the next start, which is warm all the same."""
    pool = Pool(
        8 * MIB, 0, 4 * KIB, 1 * MIB, pool_dir=shm_dir, meta={"m": 1}, grow_bytes=64 * KIB, grow_ahead=ahead
    )
    try:
        fill(pool, 80, 4 * KIB)  # ten slabs of 32 KiB
        sizes = [seg.nbytes for seg in pool.segments.segments]
        assert sizes == [64 * KIB, 64 * KIB, 128 * KIB, 256 * KIB]
        if ahead:  # the next step's file, being backed
            assert pool.segments.spare.wait(10) and os.path.exists(f"{shm_dir}/segment-00004.ahead")
        pool.save()
    finally:
        pool.close()
    names = sorted(os.listdir(shm_dir))
    assert [n for n in names if n.startswith("segment")] == [f"segment-0000{i}" for i in range(4)]
    with open(f"{shm_dir}/segment-00004.ahead", "wb") as fh:  # as a crash would leave it
        fh.write(b"x" * 4096)
    pool = Pool(8 * MIB, 0, 4 * KIB, 1 * MIB, pool_dir=shm_dir, meta={"m": 1}, grow_bytes=grow_after)
    assert not os.path.exists(f"{shm_dir}/segment-00004.ahead")
    try:
        assert pool.warm_restart["warm"], pool.warm_restart["reason"]
        assert [seg.nbytes for seg in pool.segments.segments] == sizes and pool.objects == 80
    finally:
        pool.close()


@pytest.fixture
def backings(monkeypatch):
    """(thread id, bytes) of every memfd segment backed, in order."""
    from tierd.pool import pages

    seen, real = [], pages.memfd_backed

    def recorded(name, nbytes):
        seen.append((threading.get_ident(), nbytes))
        return real(name, nbytes)

    monkeypatch.setattr(pages, "memfd_backed", recorded)
    return seen


def steps(ceiling: int, ahead: bool) -> SegmentSet:
    """Segments from 64 KiB up to 1 MiB, grown on demand (and ``ahead``) up to ``ceiling``."""
    return SegmentSet(ceiling, 0, 1 * MIB, 4 * KIB, grow_bytes=64 * KIB, ahead=ahead)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "on-demand"])
def test_a_growth_takes_over_memory_backed_ahead_on_a_thread_of_its_own(backings, ahead):
    """Backing a step holds the daemon's main loop for 0.3 s per GiB (several times that in a VM):
    with ``ahead`` every growth after the first on-demand one takes over a segment backed on
    another thread beforehand; without it, each is backed on the caller's thread."""
    s = steps(8 * MIB, ahead)
    try:
        for _ in range(4):  # 64 KiB each: segments of 64, 64 and 128 KiB
            assert s.alloc(64 * KIB) is not None
            assert all(spare.wait(10) for spare in s.spares)  # backed before the next growth
        assert [g.nbytes // KIB for g in s.segments] == [64, 64, 128]  # the steps do not change
        me = threading.get_ident()
        assert backings[0] == (me, 64 * KIB)  # the first growth: on demand, here
        assert [(t != me, n // KIB) for t, n in backings[1:3]] == [(ahead, 64), (ahead, 128)]
        if ahead:
            assert s.spare is not None and s.spare.nbytes == 256 * KIB  # the next step, being backed
        else:
            assert s.spare is None and len(backings) == 3
    finally:
        s.close()


def test_memory_backed_ahead_stays_under_the_ceiling_and_the_steps_are_unchanged():
    ceiling = 4 * MIB + 96 * KIB
    s = steps(ceiling, ahead=True)
    try:
        while s.alloc(64 * KIB) is not None:
            assert s.backed + s.ahead_bytes <= ceiling
        sizes = [seg.nbytes // KIB for seg in s.segments]
        assert sizes == [64, 64, 128, 256, 512, 1024, 1024, 1024, 96]
        assert s.backed == ceiling and s.spare is None  # nothing left to back ahead
    finally:
        s.close()


def test_a_spare_is_let_go_when_a_larger_block_needs_a_segment_of_its_own_and_when_the_pool_closes():
    before = open_fds()
    s = steps(16 * MIB, ahead=True)
    try:
        assert s.alloc(64 * KIB) is not None and s.spare.nbytes == 64 * KIB and s.spare.wait(10)
        assert s.alloc(2 * MIB) is not None  # larger than the step: grown at its own size
        assert [g.nbytes for g in s.segments] == [64 * KIB, 2 * MIB]
        assert s.spare is not None and s.spare.index == 2 and s.spare.wait(10)  # the next step
        # two segments and the new spare, each a descriptor and its mapping's: the first spare's went
        assert open_fds() == before + 6
    finally:
        s.close()
    assert open_fds() == before


class Pinner:
    """Stands in for the CUDA host pinner: records pins (thread, address, bytes) and unpins."""

    def __init__(self):
        self.pins: list[tuple[int, int, int]] = []
        self.unpins: list[int] = []

    def pin(self, addr: int, nbytes: int) -> None:
        self.pins.append((threading.get_ident(), addr, nbytes))

    def unpin(self, addr: int) -> None:
        self.unpins.append(addr)


def test_memory_backed_ahead_is_pinned_on_its_own_thread_once_and_unpinned_when_let_go():
    """cudaHostRegister also takes a while per GiB: a spare is pinned where it is backed, the
    segment that takes it over does not pin it again, and a spare closed untaken is unpinned."""
    pinner, me = Pinner(), threading.get_ident()
    s = SegmentSet(16 * MIB, 0, 1 * MIB, 4 * KIB, pinner=pinner, grow_bytes=64 * KIB, ahead=True)
    try:
        assert s.alloc(64 * KIB) is not None and s.spare.wait(10)  # the next step, backed
        assert s.alloc(64 * KIB) is not None  # two segments, the second backed ahead
        assert [(t == me, n // KIB) for t, _, n in pinner.pins[:2]] == [(True, 64), (False, 64)]
        assert [a for _, a, _ in pinner.pins[:2]] == [g.addr for g in s.segments]  # once each
        assert all(g.pinned for g in s.segments) and s.spare.wait(10)
    finally:
        s.close()
    assert len(pinner.pins) == 3 and sorted(pinner.unpins) == sorted(a for _, a, _ in pinner.pins)


def test_a_pool_folders_segment_backed_ahead_is_renamed_to_its_name_when_the_pool_takes_it(shm_dir):  # noqa: F811
    from tierd.pool.pooldir import PoolDir

    folder = PoolDir(shm_dir)
    s = SegmentSet(8 * MIB, 0, 1 * MIB, 4 * KIB, folder=folder, grow_bytes=64 * KIB, ahead=True)
    try:
        assert s.alloc(64 * KIB) is not None and s.spare.wait(10)
        assert sorted(os.listdir(shm_dir)) == ["lock", "segment-00000", "segment-00001.ahead"]
        assert s.alloc(64 * KIB) is not None and s.spare.wait(10)  # takes it; the next one is backed
        assert sorted(os.listdir(shm_dir)) == [
            "lock",
            "segment-00000",
            "segment-00001",
            "segment-00002.ahead",
        ]
        assert folder.segments() == [0, 1] and [g.nbytes for g in s.segments] == [64 * KIB, 64 * KIB]
    finally:
        s.close()
        folder.close()
    assert sorted(os.listdir(shm_dir)) == ["lock", "segment-00000", "segment-00001"]  # the spare went


def test_a_spare_that_cannot_be_named_is_let_go_and_the_growth_backs_its_segment_as_before(
    shm_dir, monkeypatch
):  # noqa: F811
    from tierd.pool import pages
    from tierd.pool.pooldir import PoolDir

    def refuse(src, dst):
        raise OSError(13, "refused")

    folder = PoolDir(shm_dir)
    s = SegmentSet(8 * MIB, 0, 1 * MIB, 4 * KIB, folder=folder, grow_bytes=64 * KIB, ahead=True)
    try:
        assert s.alloc(64 * KIB) is not None and s.spare.wait(10)
        monkeypatch.setattr(pages.os, "rename", refuse)
        assert s.alloc(64 * KIB) is not None and s.spare.wait(10)
        assert folder.segments() == [0, 1] and "segment-00001.ahead" not in os.listdir(shm_dir)
    finally:
        s.close()
        folder.close()


class HeldPinner(Pinner):
    """A pinner whose pins on other threads than the test's wait until ``release``: memory backed
    ahead is then still being backed when the next growth comes, however fast this host is."""

    def __init__(self):
        super().__init__()
        self.me, self.go = threading.get_ident(), threading.Event()

    def pin(self, addr: int, nbytes: int) -> None:
        if threading.get_ident() != self.me:
            self.go.wait(30)
        super().pin(addr, nbytes)

    def release_in(self, seconds: float) -> None:
        threading.Timer(seconds, self.go.set).start()


def test_a_growth_that_finds_its_step_still_being_backed_backs_one_step_more_ahead_from_then_on():
    """A burst of stores (an 8k-32k-token prompt of a large model: GiBs at once) outruns one step
    backed ahead, and every growth of the burst after the first then waits for its memory on the
    main loop. Each growth that found its step still being backed makes the look-ahead one step
    deeper (up to ``max_ahead``), so the next burst of that size finds its memory backed; growths
    that find their memory ready leave the depth as it is. The spares stay under the ceiling."""
    pinner = HeldPinner()
    s = SegmentSet(16 * MIB, 0, 1 * MIB, 4 * KIB, pinner=pinner, grow_bytes=64 * KIB, ahead=True, max_ahead=3)

    def spares():
        return [(sp.index, sp.nbytes // KIB) for sp in s.spares]

    try:
        assert s.alloc(64 * KIB) is not None  # on demand; segment 1 is being backed ahead
        assert s.depth == 1 and spares() == [(1, 64)]
        pinner.release_in(0.2)
        assert s.alloc(64 * KIB) is not None  # takes segment 1, still being backed: waits for it
        assert s.depth == 2 and spares() == [(2, 128), (3, 256)]
        assert all(sp.wait(10) for sp in s.spares)
        assert s.alloc(64 * KIB) is not None and s.alloc(64 * KIB) is not None  # segment 2, ready
        assert s.depth == 2 and spares() == [(3, 256), (4, 512)]
        assert all(sp.wait(10) for sp in s.spares)
        pinner.go.clear()  # the next spares are held in their pins
        assert s.alloc(256 * KIB) is not None and s.alloc(512 * KIB) is not None  # 3 and 4, ready
        assert s.depth == 2 and spares() == [(5, 1024), (6, 1024)]
        pinner.release_in(0.2)
        assert s.alloc(1 * MIB) is not None  # takes segment 5, still being backed
        assert s.depth == 3 and spares() == [(6, 1024), (7, 1024), (8, 1024)]  # max_ahead
        assert all(sp.wait(10) for sp in s.spares)
        pinner.go.clear()
        pinner.release_in(0.2)
        assert s.alloc(1 * MIB) is not None  # segment 6 was ready; 9 is held a while
        assert s.depth == 3 and s.backed + s.ahead_bytes <= 16 * MIB
    finally:
        pinner.go.set()
        s.close()
    assert sorted(pinner.unpins) == sorted(a for _, a, _ in pinner.pins)  # every spare and segment


def test_spares_let_go_for_a_larger_block_are_not_waited_for():
    """The growth for a block larger than the step lets every spare go, and up to ``max_ahead``
    steps may still be backing: the main loop does not wait for them; each is unpinned and
    released by its own thread once its backing ends."""
    pinner = HeldPinner()
    s = SegmentSet(16 * MIB, 0, 1 * MIB, 4 * KIB, pinner=pinner, grow_bytes=64 * KIB, ahead=True)
    try:
        assert s.alloc(64 * KIB) is not None  # segment 1 is being backed ahead, held in its pin
        t = time.monotonic()
        assert s.alloc(2 * MIB) is not None  # grown at its own size; the held spare let go
        assert time.monotonic() - t < 5 and [g.nbytes for g in s.segments] == [64 * KIB, 2 * MIB]
        assert [n for _, _, n in pinner.pins] == [64 * KIB, 2 * MIB]  # the segments; spares held
        pinner.go.set()
        deadline = time.monotonic() + 10
        while not pinner.unpins and time.monotonic() < deadline:
            time.sleep(0.01)
        segments = {g.addr for g in s.segments}
        dropped = [a for _, a, n in pinner.pins if n == 64 * KIB and a not in segments]
        assert len(dropped) == 1 and pinner.unpins == dropped  # released by its own thread
    finally:
        pinner.go.set()
        s.close()
