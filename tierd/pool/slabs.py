"""Slab allocator: one size class per distinct object size, O(1) slot allocation and free.

A slab is a run of equal slots carved from one segment. Slots never move and never split, so a
class does not fragment; memory moves between classes a whole slab at a time (see Pool).
"""

from __future__ import annotations

from tierd.pool.segments import Segment, SegmentSet

SLAB_TARGET_BYTES = 64 << 20  # a slab holds as many slots as fit in this, at least one


class Slab:
    __slots__ = ("cls", "segment", "offset", "nslots", "free", "fresh", "used", "owners")

    def __init__(self, cls: "SizeClass", segment: Segment, offset: int, nslots: int):
        self.cls = cls
        self.segment = segment
        self.offset = offset
        self.nslots = nslots
        self.free: list[int] = []  # slots given back (a stack)
        self.fresh = 0  # slots [fresh, nslots) were never handed out
        self.used = 0
        self.owners: list[object | None] = [None] * nslots  # slot -> its object (the pool's bookkeeping)

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

    @property
    def nbytes(self) -> int:
        return self.nslots * self.cls.slot_bytes

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot`` inside its segment."""
        return self.offset + slot * self.cls.slot_bytes


class SizeClass:
    __slots__ = ("slot_bytes", "slabs", "open_slabs", "slots_per_slab")

    def __init__(self, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self.slots_per_slab = max(1, SLAB_TARGET_BYTES // slot_bytes)
        self.slabs: list[Slab] = []
        self.open_slabs: list[Slab] = []  # slabs with at least one free slot

    def take(self) -> tuple[Slab, int] | None:
        while self.open_slabs:
            slab = self.open_slabs[-1]
            if slab.has_room:
                slot = slab.pop()
                slab.used += 1
                if not slab.has_room:
                    self.open_slabs.pop()
                return slab, slot
            self.open_slabs.pop()
        return None

    def give(self, slab: Slab, slot: int) -> None:
        if not slab.has_room:
            self.open_slabs.append(slab)
        slab.free.append(slot)
        slab.used -= 1
        assert slab.used >= 0


class SlabAllocator:
    def __init__(self, segments: SegmentSet):
        self.segments = segments
        self.classes: dict[int, SizeClass] = {}
        self.watch = None  # told of every slab carved and released (the pool's journal)

    def size_class(self, nbytes: int) -> SizeClass:
        slot = -(-nbytes // self.segments.align) * self.segments.align
        cls = self.classes.get(slot)
        if cls is None:
            cls = self.classes[slot] = SizeClass(slot)
        return cls

    def alloc(self, cls: SizeClass) -> tuple[Slab, int] | None:
        """A free slot of ``cls``; carves a new slab when backed or growable memory allows."""
        got = cls.take()
        if got is not None:
            return got
        if self.add_slab(cls) is None:
            return None
        return cls.take()

    def add_slab(self, cls: SizeClass) -> Slab | None:
        nslots = cls.slots_per_slab
        while nslots >= 1:
            room = self.segments.alloc(nslots * cls.slot_bytes)
            if room is not None:
                slab = Slab(cls, room[0], room[1], nslots)
                cls.slabs.append(slab)
                cls.open_slabs.append(slab)
                if self.watch is not None:
                    self.watch.carved(slab)
                return slab
            nslots //= 2  # near the ceiling, settle for a smaller slab
        return None

    def restore_slab(self, segment: Segment, offset: int, slot_bytes: int, nslots: int) -> Slab:
        """A recovered slab at exactly its old place; ``Slab.settle`` once its objects are in."""
        cls = self.size_class(slot_bytes)
        assert cls.slot_bytes == slot_bytes
        segment.reserve(offset, nslots * slot_bytes)
        slab = Slab(cls, segment, offset, nslots)
        cls.slabs.append(slab)
        return slab

    def coldest_slab(self, cls: SizeClass) -> Slab | None:
        """The slab of another class to give up first: an empty one, else the one whose most
        recent object is least recent; never one holding a pinned object."""
        best, best_age = None, None
        for other in self.classes.values():
            if other is cls:
                continue
            for slab in other.slabs:
                live = [o for o in slab.owners if o is not None]
                if any(o.pins for o in live):
                    continue
                age = max((o.tick for o in live), default=-1)
                if best is None or age < best_age:
                    best, best_age = slab, age
        return best

    def release_slab(self, slab: Slab) -> None:
        """Return an empty slab's memory to its segment."""
        assert slab.used == 0, "only an empty slab can be released"
        cls = slab.cls
        cls.slabs.remove(slab)
        if slab in cls.open_slabs:
            cls.open_slabs.remove(slab)
        self.segments.free(slab.segment, slab.offset, slab.nbytes)
        if self.watch is not None:
            self.watch.released(slab)

    @property
    def used_bytes(self) -> int:
        return sum(s.used * c.slot_bytes for c in self.classes.values() for s in c.slabs)
