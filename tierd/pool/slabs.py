"""Slab allocator: one size class per distinct object size, O(1) slot allocation and free.

A slab is one buddy block of a segment (tierd.pool.segments) cut into equal slots. Slots never
move and never split, so a class does not fragment. A slab is sized to its class
(``slab_order``): the smallest power of two that holds SLAB_SLOTS slots and wastes at most
1/SLAB_WASTE of itself (fewer slots once it reaches SLAB_TARGET_BYTES), so it is at most ~32
objects' worth of bytes. Hence a class that needs a slab under pressure takes little: the pool
empties the slabs inside one aligned window of that size (``slabs_in``), which by the buddy rule
is then one free block, and carves the new slab there (``carve_at``); the objects evicted number
at most window / victim slot size, i.e. a small constant times the object's size over the
victims'. Near the ceiling a class settles for a smaller slab rather than evict (``carve``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable

from tierd.pool.segments import Segment, SegmentSet, order_of

SLAB_SLOTS = 8  # a slab holds at least this many slots...
SLAB_WASTE = 16  # ...and wastes at most 1/16 of its bytes...
SLAB_TARGET_BYTES = 64 << 20  # ...unless that needs more than this: then fewer slots


def slab_order(slot_bytes: int, top: int) -> int:
    """The order of a new slab of ``slot_bytes`` slots, in segments whose largest block is of order
    ``top`` (the slot's own order when it is larger: such a slab needs a larger segment)."""
    k = order_of(slot_bytes)
    while k < top:
        size = 1 << k
        if (size % slot_bytes) * SLAB_WASTE <= size and (
            size // slot_bytes >= SLAB_SLOTS or size >= SLAB_TARGET_BYTES
        ):
            break
        k += 1
    return k


class Slab:
    __slots__ = ("cls", "segment", "offset", "order", "nslots", "free", "fresh", "used", "owners", "live")

    def __init__(self, cls: SizeClass, segment: Segment, offset: int, order: int, nslots: int):
        self.cls = cls
        self.segment = segment
        self.offset = offset
        self.order = order  # the buddy block: [offset, offset + 2^order)
        self.nslots = nslots
        self.free: list[int] = []  # slots given back (a stack)
        self.fresh = 0  # slots [fresh, nslots) were never handed out
        self.used = 0
        self.owners: list[object | None] = [None] * nslots  # slot -> its object (the pool's bookkeeping)
        self.live = True  # False once released

    @property
    def has_room(self) -> bool:
        return bool(self.free) or self.fresh < self.nslots

    def pop(self) -> int:
        if self.free:
            return self.free.pop()
        self.fresh += 1
        return self.fresh - 1

    def settle(self) -> None:
        """After recovered objects were placed in ``owners``: every other slot is free."""
        self.free = [s for s in range(self.nslots - 1, -1, -1) if self.owners[s] is None]  # lowest pops first
        self.fresh = self.nslots
        self.used = self.nslots - len(self.free)
        if self.free:
            self.cls.open_slabs.append(self)
        if not self.used:
            self.cls.empty[self] = None

    @property
    def nbytes(self) -> int:
        return self.nslots * self.cls.slot_bytes

    @property
    def block(self) -> int:
        return 1 << self.order

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot`` inside its segment."""
        return self.offset + slot * self.cls.slot_bytes


class SizeClass:
    __slots__ = ("slot_bytes", "order", "slabs", "open_slabs", "empty")

    def __init__(self, slot_bytes: int, order: int, empty: dict):
        self.slot_bytes = slot_bytes
        self.order = order  # of its new slabs
        self.slabs: dict[Slab, None] = {}
        self.open_slabs: list[Slab] = []  # slabs with at least one free slot (a stack)
        self.empty = empty  # the allocator's slabs without objects, of every class

    @property
    def slots_per_slab(self) -> int:
        return (1 << self.order) // self.slot_bytes

    def take(self) -> tuple[Slab, int] | None:
        while self.open_slabs:
            slab = self.open_slabs[-1]
            if slab.has_room:
                slot = slab.pop()
                if not slab.used:
                    self.empty.pop(slab, None)
                slab.used += 1
                if not slab.has_room:
                    self.open_slabs.pop()
                return slab, slot
            self.open_slabs.pop()
        return None

    def room(self, n: int) -> int:
        """How many slots (up to ``n``) the open slabs have: what ``take_many(n)`` gives."""
        have = 0
        for slab in reversed(self.open_slabs):
            have += len(slab.free) + slab.nslots - slab.fresh
            if have >= n:
                return n
        return have

    def take_many(self, n: int) -> list[tuple[Slab, int]]:
        """Up to ``n`` slots from the open slabs, the ones ``take`` would give one by one, in its
        order (fewer when the open slabs run out: the caller allocates the rest)."""
        out: list[tuple[Slab, int]] = []
        open_slabs = self.open_slabs
        while open_slabs and len(out) < n:
            slab = open_slabs[-1]
            want = n - len(out)
            free = slab.free
            got = free[: -want - 1 : -1]  # what ``pop`` gives, in its order: the top of the stack first
            if got:
                del free[-len(got) :]
            fresh = min(want - len(got), slab.nslots - slab.fresh)
            if fresh > 0:
                got.extend(range(slab.fresh, slab.fresh + fresh))
                slab.fresh += fresh
            if got:
                if not slab.used:
                    self.empty.pop(slab, None)
                slab.used += len(got)
                out.extend(zip([slab] * len(got), got))
            if not slab.has_room:
                open_slabs.pop()
        return out

    def give(self, slab: Slab, slot: int) -> None:
        if not slab.has_room:
            self.open_slabs.append(slab)
        slab.free.append(slot)
        slab.used -= 1
        assert slab.used >= 0
        if not slab.used:
            self.empty[slab] = None


class SlabAllocator:
    def __init__(self, segments: SegmentSet):
        self.segments = segments
        self.classes: dict[int, SizeClass] = {}
        self.empty: dict[Slab, None] = {}  # slabs without objects: free memory for any class
        self._at: dict[tuple[int, int], Slab] = {}  # (segment, offset) -> the slab there
        self.watch = None  # told of every slab carved and released (the pool's journal)

    def slot_bytes(self, nbytes: int) -> int:
        """The slot of an object of ``nbytes``: rounded up to the alignment."""
        return -(-nbytes // self.segments.align) * self.segments.align

    def class_order(self, slot_bytes: int) -> int:
        """The order of a new slab of a class of ``slot_bytes`` slots (``slab_order`` in segments
        of ``segment_bytes``)."""
        return slab_order(slot_bytes, order_of(self.segments.segment_bytes + 1) - 1)

    def size_class(self, nbytes: int) -> SizeClass:
        slot = self.slot_bytes(nbytes)
        cls = self.classes.get(slot)
        if cls is None:
            cls = self.classes[slot] = SizeClass(slot, self.class_order(slot), self.empty)
        return cls

    def fits(self, cls: SizeClass) -> bool:
        """Whether one slot of ``cls`` fits in a segment that is or could be backed at all."""
        return order_of(cls.slot_bytes) <= self.segments.top_order

    def alloc(self, cls: SizeClass) -> tuple[Slab, int] | None:
        """A free slot of ``cls``; carves a new slab when free or growable memory allows."""
        got = cls.take()
        if got is None and self.carve(cls) is not None:
            got = cls.take()
        return got

    def can_carve(self, cls: SizeClass) -> bool:
        """Whether ``carve`` would succeed (after giving back other classes' empty slabs)."""
        k0 = order_of(cls.slot_bytes)
        return self.segments.has_free(k0) or (self.release_empty(cls) and self.segments.has_free(k0))

    def carve(self, cls: SizeClass) -> Slab | None:
        """A new slab of ``cls`` from free (or growable) memory, no eviction: of the class's size,
        else smaller down to one slot; other classes' empty slabs are given back if need be."""
        k0 = order_of(cls.slot_bytes)
        for attempt in range(2):
            for k in range(cls.order, k0 - 1, -1):
                if self.segments.has_free(k):
                    room = self.segments.alloc(1 << k)
                    if room is not None:
                        return self._add(cls, room[0], room[1], k, (1 << k) // cls.slot_bytes)
            if attempt or not self.release_empty(cls):
                return None
        return None

    def carve_at(self, cls: SizeClass, seg: Segment, off: int, order: int) -> Slab:
        """A new slab of ``cls`` exactly at the free block [off, off + 2^order)."""
        seg.reserve(off, 1 << order)
        return self._add(cls, seg, off, order, (1 << order) // cls.slot_bytes)

    def _add(self, cls: SizeClass, seg: Segment, off: int, order: int, nslots: int) -> Slab:
        slab = Slab(cls, seg, off, order, nslots)
        cls.slabs[slab] = None
        cls.open_slabs.append(slab)
        self.empty[slab] = None
        self._at[seg.index, off] = slab
        if self.watch is not None:
            self.watch.carved(slab)
        return slab

    def restore_slab(self, segment: Segment, offset: int, slot_bytes: int, nslots: int) -> Slab:
        """A recovered slab at exactly its old place; ``Slab.settle`` once its objects are in.
        Raises ValueError unless it is a free buddy block of the segment."""
        cls = self.size_class(slot_bytes)
        assert cls.slot_bytes == slot_bytes
        order = order_of(nslots * slot_bytes)
        segment.reserve(offset, 1 << order)
        slab = Slab(cls, segment, offset, order, nslots)
        cls.slabs[slab] = None
        self._at[segment.index, offset] = slab
        return slab

    def release_slab(self, slab: Slab) -> None:
        """Return an empty slab's block to its segment."""
        assert slab.used == 0, "only an empty slab can be released"
        cls = slab.cls
        del cls.slabs[slab]
        slab.live = False
        for i in range(len(cls.open_slabs) - 1, -1, -1):  # an emptied slab was pushed lately: near the top
            if cls.open_slabs[i] is slab:
                del cls.open_slabs[i]
                break
        self.empty.pop(slab, None)
        del self._at[slab.segment.index, slab.offset]
        self.segments.free(slab.segment, slab.offset, slab.block)
        if self.watch is not None:
            self.watch.released(slab)

    def release_empty(self, cls: SizeClass | None = None) -> bool:
        """Give back the blocks of every empty slab of another class than ``cls``; any?"""
        gone = [s for s in self.empty if s.cls is not cls]
        for slab in gone:
            self.release_slab(slab)
        return bool(gone)

    def slabs_in(self, seg: Segment, off: int, order: int) -> list[Slab]:
        """The slabs that emptying the aligned window [off, off + 2^order) must empty: the one
        slab holding it when a larger slab does, else every slab inside it."""
        at = self._at
        for k in range(order, seg.top_order + 1):
            base = off & -(1 << k)
            slab = at.get((seg.index, base))
            if slab is not None and slab.order >= k:
                return [slab]
        out, pos, end = [], off, off + (1 << order)
        while pos < end:
            slab = at.get((seg.index, pos))
            if slab is not None:
                out.append(slab)
                pos += slab.block
                continue
            k = seg.free_order_at(pos, order + 1)
            assert k is not None, f"segment {seg.index}: nothing at {pos}"
            pos += 1 << k
        return out

    def clean_order(self, busy: Callable[[object], bool], budget: int) -> int:
        """The order of the largest aligned window of a segment where no slab holds an object
        ``busy`` says must stay (-1: none): evicting the rest empties it for a new slab of that
        order (tierd.pool.evict). Largest segments first, each from its start; after ``budget``
        slabs and objects looked at, the rest counts as busy (the answer is then a lower bound)."""
        best, align, at = -1, order_of(self.segments.align), self._at
        for seg in sorted(self.segments.segments, key=_size, reverse=True):
            if seg.top_order <= best or budget <= 0:
                break
            dirty, pos = [], 0  # busy extents, in offset order
            while pos < seg.nbytes:
                if budget <= 0:
                    dirty.append((pos, seg.nbytes))
                    break
                slab = at.get((seg.index, pos))
                if slab is None:  # a free block
                    pos += 1 << seg.free_order_at(pos, seg.top_order + 1)
                    continue
                budget -= 1 + slab.used
                if any(map(busy, filter(None, slab.owners))):  # (an owner is an object or None)
                    dirty.append((pos, pos + slab.block))
                pos += slab.block
            starts = [a for a, _ in dirty]
            for off, k in seg.tiles():
                floor = max(best, align - 1)  # no window below the alignment
                found = _clean(dirty, starts, off, k, floor)
                if found > floor:
                    best = found
        return best

    @property
    def used_bytes(self) -> int:
        return sum(s.used * c.slot_bytes for c in self.classes.values() for s in c.slabs)


def _size(seg: Segment) -> int:
    return seg.nbytes


def _clean(dirty: list[tuple[int, int]], starts: list[int], lo: int, k: int, floor: int) -> int:
    """The order of the largest aligned block inside [lo, lo + 2^k) that meets none of the
    sorted, disjoint ``dirty`` extents, if above ``floor``; else ``floor``."""
    if k <= floor:
        return floor
    hi = lo + (1 << k)
    i = bisect_right(starts, lo) - 1  # the last extent starting at or before lo
    if i >= 0 and dirty[i][1] > lo:
        if dirty[i][1] >= hi:
            return floor  # inside one busy extent
    else:
        i += 1
        if i == len(dirty) or dirty[i][0] >= hi:
            return k  # meets none
    half = 1 << (k - 1)
    floor = _clean(dirty, starts, lo, k - 1, floor)
    return _clean(dirty, starts, lo + half, k - 1, floor)
