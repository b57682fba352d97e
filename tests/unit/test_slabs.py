"""Slab allocator: one size class per aligned object size, slabs sized to their class (a buddy
block of at least SLAB_SLOTS slots wasting at most 1/SLAB_WASTE of itself), slots taken and given
back in O(1) (a freed slot is the very next one handed out), smaller slabs near the ceiling, and
slabs given back to their segment, where the slabs of one window free a block for another class."""

import pytest

from tierd.pool.segments import SegmentSet
from tierd.pool.slabs import SLAB_SLOTS, SlabAllocator, slab_order

KIB, MIB = 1 << 10, 1 << 20


@pytest.fixture
def alloc():
    segs = SegmentSet(ceiling=4 << 20, initial=0, segment_bytes=4 << 20, align=4 * KIB)
    yield SlabAllocator(segs)
    segs.close()


def test_size_classes_round_to_alignment(alloc):
    a = alloc.size_class(1)
    assert a.slot_bytes == 4 * KIB and alloc.size_class(4 * KIB) is a
    assert alloc.size_class(4 * KIB + 1).slot_bytes == 8 * KIB
    assert a.slots_per_slab == SLAB_SLOTS == 8


@pytest.mark.parametrize(
    ("slot", "top", "block", "slots"),
    [
        (4 * KIB, 30, 32 * KIB, 8),  # 8 slots, nothing wasted
        (12 * KIB, 30, 128 * KIB, 10),  # 96 KiB would be 8 slots but is no power of two; 8 KiB wasted = 1/16
        (100 * KIB, 30, 1 * MIB, 10),  # 512 KiB holds only 5
        (9 * MIB, 30, 64 * MIB, 7),  # 7 slots: SLAB_TARGET_BYTES reached
        (40 * MIB, 30, 128 * MIB, 3),  # 64 MiB would hold one and waste 24 MiB
        (1 * MIB, 22, 4 * MIB, 4),  # segments of 4 MiB: as many as fit
        (8 * MIB, 22, 8 * MIB, 1),  # larger than a segment: one slot (it needs a larger segment)
    ],
)
def test_slabs_are_sized_to_their_class(slot, top, block, slots):
    k = slab_order(slot, top)
    assert 1 << k == block and (1 << k) // slot == slots


def test_freed_slot_is_reused_first(alloc):
    cls = alloc.size_class(12 * KIB)  # 10 slots a slab
    got = [alloc.alloc(cls) for _ in range(10)]
    slab = got[0][0]
    assert [s for _, s in got] == list(range(10))  # slot 0 first, in order
    assert all(g[0] is slab for g in got) and slab.used == 10
    cls.give(slab, 7)
    cls.give(slab, 3)
    assert slab.used == 8
    assert alloc.alloc(cls) == (slab, 3)  # last freed, first reused: a stack, no scan
    assert alloc.alloc(cls) == (slab, 7)
    nxt = alloc.alloc(cls)
    assert nxt[0] is not slab and nxt[1] == 0  # full: a new slab, next to it
    assert nxt[0].offset == slab.offset + slab.block


def test_slot_offsets_are_distinct_and_inside_the_slab(alloc):
    cls = alloc.size_class(96 * KIB)
    got = [alloc.alloc(cls) for _ in range(20)]
    offs = sorted(slab.slot_offset(s) for slab, s in got if slab is not None)
    assert all(b - a >= 96 * KIB for a, b in zip(offs, offs[1:]))
    for slab, s in got:
        assert slab.offset <= slab.slot_offset(s) < slab.offset + slab.nbytes <= slab.offset + slab.block
        assert slab.offset % slab.block == 0


def test_slabs_shrink_near_the_ceiling_and_run_out(alloc):
    small = alloc.size_class(64 * KIB)
    assert alloc.alloc(small)[0].block == 512 * KIB  # 8 slots
    cls = alloc.size_class(1 << 20)  # wants 4 MiB (4 slots): 3.5 MiB are left
    got = [alloc.alloc(cls) for _ in range(4)]
    assert all(g is not None for g in got[:3]) and got[3] is None
    assert sorted(s.block for s in cls.slabs) == [1 * MIB, 2 * MIB]  # settled for smaller slabs
    assert sum(s.nslots for s in cls.slabs) == 3


def test_release_slab_returns_its_memory(alloc):
    big = alloc.size_class(1 << 20)
    got = [alloc.alloc(big) for _ in range(4)]
    small = alloc.size_class(4 * KIB)
    assert alloc.alloc(small) is None  # everything is carved into 1 MiB slots
    for slab, slot in got:
        big.give(slab, slot)
    assert list(alloc.empty) == list(big.slabs)  # empty slabs are known...
    assert alloc.alloc(small) is not None  # ...and given back when another class needs room
    assert not big.slabs and not big.open_slabs and not alloc.empty
    assert alloc.used_bytes == 4 * KIB


def test_release_of_a_used_slab_is_refused(alloc):
    cls = alloc.size_class(64 * KIB)
    slab, _ = alloc.alloc(cls)
    with pytest.raises(AssertionError):
        alloc.release_slab(slab)


def test_the_slabs_of_one_window_free_a_block_for_another_class(alloc):
    """Small slabs, wherever they lie, never fragment memory for a larger class: releasing the
    slabs inside one aligned window leaves that window one free block."""
    a, b = alloc.size_class(4 * KIB), alloc.size_class(36 * KIB)  # slabs of 32 KiB and 512 KiB (14 slots)
    got = [alloc.alloc(a) for _ in range(1024)]  # 128 slabs: all 4 MiB
    assert alloc.alloc(b) is None
    seg = got[0][0].segment
    inside = alloc.slabs_in(seg, 512 * KIB, b.order)
    assert [s.offset for s in inside] == [512 * KIB + i * 32 * KIB for i in range(16)]
    assert alloc.slabs_in(seg, 520 * KIB, 12) == [inside[0]]  # a window inside a slab: that slab
    for slab, slot in got:
        if slab in inside:
            a.give(slab, slot)
    for slab in inside:
        alloc.release_slab(slab)
    new = alloc.carve_at(b, seg, 512 * KIB, b.order)
    assert (new.offset, new.block, new.nslots) == (512 * KIB, 512 * KIB, 14)
    assert alloc.alloc(b) == (new, 0)
