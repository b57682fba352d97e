"""Slab allocator: one size class per aligned object size, slots taken and given back in O(1)
(a freed slot is the very next one handed out), slabs carved near the ceiling at smaller sizes,
and whole slabs released back to their segment."""

import pytest

from tierd.pool.segments import SegmentSet
from tierd.pool.slabs import SLAB_TARGET_BYTES, SlabAllocator

KIB = 1 << 10


@pytest.fixture
def alloc():
    segs = SegmentSet(ceiling=4 << 20, initial=0, segment_bytes=4 << 20, align=4 * KIB)
    yield SlabAllocator(segs)
    segs.close()


def test_size_classes_round_to_alignment(alloc):
    a = alloc.size_class(1)
    assert a.slot_bytes == 4 * KIB and alloc.size_class(4 * KIB) is a
    assert alloc.size_class(4 * KIB + 1).slot_bytes == 8 * KIB
    assert a.slots_per_slab == SLAB_TARGET_BYTES // (4 * KIB)


def test_freed_slot_is_reused_first(alloc):
    cls = alloc.size_class(64 * KIB)
    got = [alloc.alloc(cls) for _ in range(10)]
    slab = got[0][0]
    assert [s for _, s in got] == list(range(10))  # slot 0 first, in order
    assert all(g[0] is slab for g in got) and slab.used == 10
    cls.give(slab, 7)
    cls.give(slab, 3)
    assert slab.used == 8
    assert alloc.alloc(cls) == (slab, 3)  # last freed, first reused: a stack, no scan
    assert alloc.alloc(cls) == (slab, 7)
    assert alloc.alloc(cls) == (slab, 10)


def test_slot_offsets_are_distinct_and_inside_the_slab(alloc):
    cls = alloc.size_class(96 * KIB)
    got = [alloc.alloc(cls) for _ in range(20)]
    offs = sorted(slab.slot_offset(s) for slab, s in got if slab is not None)
    assert all(b - a >= 96 * KIB for a, b in zip(offs, offs[1:]))
    for slab, s in got:
        assert slab.offset <= slab.slot_offset(s) < slab.offset + slab.nbytes


def test_slabs_shrink_near_the_ceiling_and_run_out(alloc):
    cls = alloc.size_class(1 << 20)  # 1 MiB slots; the 64-slot target does not fit in 4 MiB
    got = [alloc.alloc(cls) for _ in range(5)]
    assert all(g is not None for g in got[:4]) and got[4] is None
    assert sum(s.nslots for s in cls.slabs) == 4


def test_release_slab_returns_its_memory(alloc):
    big = alloc.size_class(1 << 20)
    got = [alloc.alloc(big) for _ in range(4)]
    small = alloc.size_class(4 * KIB)
    assert alloc.alloc(small) is None  # everything is carved into 1 MiB slabs
    for slab, slot in got:
        big.give(slab, slot)
    for slab in list(big.slabs):
        alloc.release_slab(slab)
    assert big.slabs == [] and big.open_slabs == []
    assert alloc.alloc(small) is not None
    assert alloc.used_bytes == 4 * KIB


def test_release_of_a_used_slab_is_refused(alloc):
    cls = alloc.size_class(64 * KIB)
    slab, _ = alloc.alloc(cls)
    with pytest.raises(AssertionError):
        alloc.release_slab(slab)
