"""Host memory segments: buddy blocks (aligned powers of two, lowest of the smallest order first,
merged with their buddy on free), a set grown on demand up to (never past) its ceiling, whole
multiples of the alignment, and the initial backing what was asked."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierd.pool.segments import Segment, SegmentSet

KIB = 1 << 10


def blocks(seg: Segment) -> list[tuple[int, int]]:
    """The free blocks as sorted (offset, bytes)."""
    return sorted((off, 1 << k) for k, offs in enumerate(seg._free) for off in offs)


def test_free_merges_buddies_back_into_larger_blocks():
    seg = Segment(0, 64 * KIB, None)
    try:
        a, b, c, d = (seg.alloc(4 * KIB) for _ in range(4))
        assert (a, b, c, d) == (0, 4 * KIB, 8 * KIB, 12 * KIB)  # lowest first, split from the top
        assert blocks(seg) == [(16 * KIB, 16 * KIB), (32 * KIB, 32 * KIB)]
        seg.free(b, 4 * KIB)  # its buddy (a) is taken: no merge
        assert blocks(seg) == [(4 * KIB, 4 * KIB), (16 * KIB, 16 * KIB), (32 * KIB, 32 * KIB)]
        seg.free(c, 4 * KIB)  # c's buddy is d (taken); b and c are not buddies
        assert blocks(seg)[:2] == [(4 * KIB, 4 * KIB), (8 * KIB, 4 * KIB)]
        seg.free(d, 4 * KIB)  # c+d -> 8 KiB at 8 KiB
        assert blocks(seg)[:2] == [(4 * KIB, 4 * KIB), (8 * KIB, 8 * KIB)]
        seg.free(a, 4 * KIB)  # a+b -> 8 KiB, + its buddy -> 16 KiB, ... -> the whole segment
        assert blocks(seg) == [(0, 64 * KIB)] and seg.free_bytes == 64 * KIB
    finally:
        seg.close(None)


def test_the_lowest_block_of_the_smallest_order_is_handed_out():
    seg = Segment(0, 64 * KIB, None)
    try:
        offs = [seg.alloc(8 * KIB) for _ in range(8)]
        assert offs == [i * 8 * KIB for i in range(8)] and seg.alloc(1) is None
        seg.free(offs[5], 8 * KIB)
        seg.free(offs[2], 8 * KIB)
        assert seg.alloc(8 * KIB) == offs[2]
        assert seg.alloc(16 * KIB) is None  # no 16 KiB block: offs[5]'s buddy is taken
        assert seg.alloc(5 * KIB) == offs[5]  # a request is rounded up to a power of two
    finally:
        seg.close(None)


def test_a_segment_not_a_power_of_two_is_tiled_by_aligned_blocks():
    seg = Segment(0, 28 * KIB, None)
    try:
        assert blocks(seg) == [(0, 16 * KIB), (16 * KIB, 8 * KIB), (24 * KIB, 4 * KIB)]
        assert seg.top_order == 14 and seg.alloc(32 * KIB) is None
        assert seg.alloc(4 * KIB) == 24 * KIB  # the smallest block that holds it
        seg.free(24 * KIB, 4 * KIB)  # its buddy would lie past the end: it stays 4 KiB
        assert blocks(seg)[-1] == (24 * KIB, 4 * KIB)
    finally:
        seg.close(None)


def test_reserve_takes_exactly_a_free_aligned_block():
    seg = Segment(0, 64 * KIB, None)
    try:
        seg.reserve(40 * KIB, 8 * KIB)
        assert blocks(seg) == [(0, 32 * KIB), (32 * KIB, 8 * KIB), (48 * KIB, 16 * KIB)]
        with pytest.raises(ValueError):
            seg.reserve(40 * KIB, 8 * KIB)  # taken
        with pytest.raises(ValueError):
            seg.reserve(4 * KIB, 8 * KIB)  # not aligned to its size
        with pytest.raises(ValueError):
            seg.reserve(32 * KIB, 16 * KIB)  # half of it is taken
        seg.free(40 * KIB, 8 * KIB)
        assert blocks(seg) == [(0, 64 * KIB)]
    finally:
        seg.close(None)


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=24), st.randoms(use_true_random=False))
def test_any_free_order_merges_back_to_one_block(sizes, rnd):
    seg = Segment(0, 256 * KIB, None)
    try:
        held = []
        for s in sizes:
            off = seg.alloc(s * KIB)
            if off is not None:
                held.append((off, s * KIB))
        spans = sorted((off, 1 << (n - 1).bit_length()) for off, n in held)
        for (o1, n1), (o2, _) in zip(spans, spans[1:]):
            assert o1 + n1 <= o2  # never overlapping
        assert all(off % n == 0 for off, n in spans)  # every block aligned to its size
        rnd.shuffle(held)
        for off, n in held:
            seg.free(off, n)
        assert blocks(seg) == [(0, 256 * KIB)]
    finally:
        seg.close(None)


def test_segment_memory_is_writable_and_distinct():
    seg = Segment(0, 16 * KIB, None)
    try:
        seg.view[:] = 7
        assert int(seg.view.sum()) == 7 * 16 * KIB
    finally:
        seg.close(None)


def test_set_grows_on_demand_and_never_past_its_ceiling():
    s = SegmentSet(ceiling=1 << 20, initial=0, segment_bytes=256 * KIB, align=4 * KIB)
    try:
        assert s.backed == 0 and s.segments == []
        got = [s.alloc(200 * KIB) for _ in range(5)]
        assert all(g is not None for g in got[:4]) and got[4] is None  # 4 segments of 256 KiB
        assert s.backed == 1 << 20 == s.ceiling
        seg, off = got[0]
        s.free(seg, off, 200 * KIB)
        assert s.alloc(200 * KIB) == (seg, off)
    finally:
        s.close()


def test_initial_backing_is_made_up_front():
    s = SegmentSet(ceiling=1 << 20, initial=512 * KIB, segment_bytes=256 * KIB, align=4 * KIB)
    try:
        assert s.backed == 512 * KIB and len(s.segments) == 2
        s.alloc(100 * KIB)
        assert s.backed == 512 * KIB  # served from what is backed
    finally:
        s.close()


def test_unaligned_ceiling_is_rounded_down():
    """Regression: the last segment was rounded up to the alignment past the ceiling."""
    ceiling = (1 << 20) - 135
    s = SegmentSet(ceiling=ceiling, initial=ceiling, segment_bytes=ceiling, align=4 * KIB)
    try:
        assert s.backed <= ceiling and s.ceiling <= ceiling
        while s.alloc(4 * KIB) is not None:
            pass
        assert s.backed <= ceiling
    finally:
        s.close()


def test_alignment_must_be_a_power_of_two():
    with pytest.raises(ValueError):
        SegmentSet(1 << 20, 0, 1 << 20, 3000)


def test_allocations_are_aligned():
    s = SegmentSet(ceiling=1 << 20, initial=0, segment_bytes=1 << 20, align=8 * KIB)
    try:
        for n in random.Random(1).choices(range(1, 30000), k=20):
            got = s.alloc(n)
            if got is None:
                break
            assert got[1] % (8 * KIB) == 0
    finally:
        s.close()


def test_initial_backing_is_what_was_asked_not_a_whole_segment():
    """Regression: --l1-init-size-gb 0.25 with 1 GiB segments backed a whole 1 GiB segment (the
    initial backing was rounded up to a segment). Here: 300 KiB asked of 1 MiB segments."""
    s = SegmentSet(ceiling=4 << 20, initial=300 * KIB + 1, segment_bytes=1 << 20, align=4 * KIB)
    try:
        assert s.backed == 304 * KIB and [g.nbytes for g in s.segments] == [304 * KIB]  # up to the alignment
    finally:
        s.close()
    s = SegmentSet(ceiling=4 << 20, initial=(1 << 20) + 8 * KIB, segment_bytes=1 << 20, align=4 * KIB)
    try:
        assert [g.nbytes for g in s.segments] == [1 << 20, 8 * KIB]  # whole segments, then the rest
        assert s.alloc(64 * KIB) is not None and s.backed == (1 << 20) + 8 * KIB  # served from what is backed
    finally:
        s.close()
