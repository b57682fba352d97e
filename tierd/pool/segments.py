"""Host memory segments: shared-memory mappings backed (pre-touched) when created, optionally pinned.

Segments are created on demand as slabs need room, never beyond the configured ceiling. Each
segment is one memfd mapping, populated at creation so that the first copy into it does not
page-fault, and registered with CUDA as one pinned range when a pinner is installed. A slab
never spans two segments, so every copy stays inside one pinned registration.

How much a growth backs is a trade-off: small segments back memory close to what is stored, but
each is a mapping, a file descriptor and a CUDA registration, and an eviction window never spans
two segments, so only a large segment can take a large slab once the pool is full. So a new
segment is as large as the pool already is (rounded down to a power of two), at least
``grow_bytes`` and at most ``segment_bytes`` (and at least the block it is grown for): a small
pool grows in small steps, a large one in steps of ``segment_bytes``, with O(log) more segments
than equal ones of that size (an 8 GiB pool: 64, 64, 128, 256, 512 MiB, then 1 GiB ones).

With a pool folder (tierd.pool.pooldir) each segment is instead a file there, created, sized and
populated the same way; a restarted pool maps the files it recovers (``restore``) without
truncating them. On hugetlbfs every file is a whole number of huge pages (``grain``).

Inside a segment, room is handed out as buddy blocks: a block is a power of two bytes at an
offset that is a multiple of its size, and a freed block merges with its free buddy (the block
it was split from with). So fragmentation stays bounded: any aligned window of 2^k bytes becomes
one free block as soon as everything inside it is freed, whatever was carved there before, and
freeing the slabs inside one window is always enough to make room for a slab of that size. A
segment that is not a power of two is the maximal aligned blocks that tile it.
"""

from __future__ import annotations

import heapq
import mmap
import os
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from tierd.pool import pages

# steps a pool backs ahead of need at most (tierd.pool.segments.SegmentSet._look_ahead): 8 GiB of
# 1 GiB segments, as much as a 64k-token prompt of an 8B model stores at once
MAX_AHEAD_STEPS = 8


class Pinner(Protocol):
    def pin(self, addr: int, nbytes: int) -> None: ...

    def unpin(self, addr: int) -> None: ...


class Region(NamedTuple):  # a backed segment as a second tier registers it
    addr: int
    nbytes: int
    fd: int


class Segment:
    __slots__ = ("index", "nbytes", "_fd", "_map", "view", "addr", "_free", "_heaps", "_where", "pinned")

    def __init__(
        self,
        index: int,
        nbytes: int,
        pinner: Pinner | None,
        path: str | None = None,
        create: bool = True,
        where: list[set[int]] | None = None,
        backing: tuple[int, mmap.mmap, bool] | None = None,
    ):
        """``where``: per order, the indexes of the segments with a free block of that order
        (the SegmentSet's, kept up to date here); ``backing``: a descriptor and its mapping of
        ``nbytes``, every page backed, that the segment takes over, and whether ``pinner`` pinned it."""
        self.index = index
        self.nbytes = nbytes
        pinned = False
        if backing is not None:  # backed already (pages.Spare)
            self._fd, self._map, pinned = backing
        elif path is None:
            self._fd, self._map = pages.memfd_backed(f"tierd-l1-{index}", nbytes)
        else:
            self._fd, self._map = pages.file_backed(path, nbytes, create)
        self.view = np.frombuffer(self._map, dtype=np.uint8)
        self.addr = pages.address(self._map)
        self.pinned = pinned
        if pinner is not None and not pinned:
            pinner.pin(self.addr, nbytes)
            self.pinned = True
        self._free: list[set[int]] = [set() for _ in range(nbytes.bit_length())]  # order -> offsets
        self._heaps: list[list[int]] = [[] for _ in self._free]  # the same, lowest first (lazily pruned)
        self._where = where if where is not None else [set() for _ in range(64)]
        for off, k in self.tiles():
            self._push(k, off)

    @property
    def fd(self) -> int:
        """The descriptor of the segment's memory, open until ``close`` (L2 registers it: tierd.tier2)."""
        return self._fd

    @property
    def top_order(self) -> int:
        """The order of the largest block this segment can ever hand out."""
        return self.nbytes.bit_length() - 1

    def tiles(self) -> list[tuple[int, int]]:
        """(offset, order) of the maximal aligned blocks that tile the segment, lowest first."""
        out, off = [], 0
        while off < self.nbytes:
            k = min((off & -off).bit_length() - 1 if off else 64, (self.nbytes - off).bit_length() - 1)
            out.append((off, k))
            off += 1 << k
        return out

    def _push(self, k: int, off: int) -> None:
        if not self._free[k]:
            self._where[k].add(self.index)
        self._free[k].add(off)
        heapq.heappush(self._heaps[k], off)

    def _take(self, k: int, off: int) -> None:
        free = self._free[k]
        free.remove(off)  # its heap entry is pruned when met
        if not free:
            self._where[k].discard(self.index)

    def _pop(self, k: int) -> int | None:
        free, heap = self._free[k], self._heaps[k]
        while heap:
            off = heapq.heappop(heap)
            if off in free:
                self._take(k, off)
                return off
        return None

    def has_free(self, k: int) -> bool:
        """Whether a block of order ``k`` (or larger, to split) is free."""
        return any(self._free[j] for j in range(k, len(self._free)))

    def alloc(self, nbytes: int) -> int | None:
        """The lowest free block of the smallest order that holds ``nbytes`` (split from a larger
        one when none is free); its offset, or None."""
        k = order_of(nbytes)
        for j in range(k, len(self._free)):
            if self._free[j]:
                off = self._pop(j)
                for i in range(j - 1, k - 1, -1):  # split: the upper halves stay free
                    self._push(i, off + (1 << i))
                return off
        return None

    def reserve(self, off: int, nbytes: int) -> None:
        """Take exactly the block [off, off + 2^order) (a recovered slab); raises unless it is an
        aligned block and all of it is free."""
        k = order_of(nbytes)
        if off % (1 << k) or off + (1 << k) > self.nbytes:
            raise ValueError(f"segment {self.index}: [{off}, +{1 << k}) is not an aligned block of it")
        for j in range(k, len(self._free)):
            base = off & -(1 << j)
            if base in self._free[j]:
                self._take(j, base)
                for i in range(j - 1, k - 1, -1):  # split down to the block, the other halves free
                    half = 1 << i
                    self._push(i, base + half if off - base < half else base)
                    base = base if off - base < half else base + half
                return
        raise ValueError(f"segment {self.index}: [{off}, +{1 << k}) is not free")

    def free(self, off: int, nbytes: int) -> None:
        """Give a block back; it merges with its free buddy, and so on up."""
        k = order_of(nbytes)
        while k + 1 < len(self._free):
            buddy = off ^ (1 << k)
            if buddy not in self._free[k]:
                break
            self._take(k, buddy)
            off, k = min(off, buddy), k + 1
        self._push(k, off)
        heap = self._heaps[k]
        if len(heap) > 2 * len(self._free[k]) + 64:  # prune the entries of merged blocks
            self._heaps[k] = sorted(self._free[k])

    def free_order_at(self, off: int, below: int) -> int | None:
        """The order of the free block starting at ``off``, if one of order < ``below`` does."""
        for k in range(min(below, len(self._free)) - 1, -1, -1):
            if off in self._free[k]:
                return k
        return None

    @property
    def free_bytes(self) -> int:
        return sum(len(offs) << k for k, offs in enumerate(self._free))

    def close(self, pinner: Pinner | None) -> None:
        for k, offs in enumerate(self._free):
            if offs:
                self._where[k].discard(self.index)
        if self.pinned and pinner is not None:
            pinner.unpin(self.addr)
            self.pinned = False
        self.view = None
        try:
            self._map.close()
        except BufferError:
            pass  # a straggling view; the mapping goes with the process
        os.close(self._fd)


class SegmentSet:
    """All segments of the pool, grown up to ``ceiling`` bytes."""

    def __init__(
        self,
        ceiling: int,
        initial: int,
        segment_bytes: int,
        align: int,
        pinner: Pinner | None = None,
        folder=None,
        restore: Sequence[int] = (),
        grow_bytes: int | None = None,
        ahead: bool = False,
        max_ahead: int = MAX_AHEAD_STEPS,
    ):
        """``folder``: a PoolDir whose segment files back the pool (memfd without one);
        ``restore``: sizes of segment files 0.. to map as they are (a recovered pool);
        ``grow_bytes``: the smallest segment grown on demand (default ``segment_bytes``: all equal);
        ``ahead``: once the pool has grown on demand, the next segments' memory is backed on
        threads of their own before it is needed, at most ``max_ahead`` steps (``_look_ahead``)."""
        if align <= 0 or align & (align - 1):
            raise ValueError(f"alignment {align} is not a power of two")
        self.grain = max(align, folder.grain if folder is not None else 1)  # powers of two: the lcm
        ceiling -= ceiling % self.grain  # segments are whole grains: never back past the ceiling
        self.ceiling = ceiling
        self.segment_bytes = max(self.grain, _round_up(segment_bytes, self.grain))
        grow = self.segment_bytes if grow_bytes is None else _round_up(max(1, grow_bytes), self.grain)
        self.grow_bytes = min(self.segment_bytes, grow)
        self.align = align
        self.pinner = pinner
        self.folder = folder
        self.segments: list[Segment] = []
        self.where: list[set[int]] = [set() for _ in range(64)]  # order -> segments with such a free block
        self.backed = 0
        self.watch = None  # told of every segment grown (the pool's journal)
        self.grow_error: str | None = None  # why growing failed (then it is not tried again)
        self.ahead = ahead
        self.spares: list[pages.Spare] = []  # the next segments, being backed (``_look_ahead``)
        self.depth = 1  # steps backed ahead: one more each time a growth had to wait for its memory
        self.max_ahead = max(1, max_ahead)
        try:
            for nbytes in restore:
                self._add(nbytes, create=False)
            self.grow_to(initial)
        except BaseException:
            self.close()
            raise

    def huge_pages(self) -> str:
        """The kernel's huge-page setting for the segments' memory (tierd.pool.pages)."""
        return pages.huge_pages(self.folder.path if self.folder is not None else None)

    def grow_to(self, initial: int) -> None:
        """Back ``initial`` bytes (rounded up to the grain, at most the ceiling) now: whole
        segments, then a last one of what is left (not a whole segment more)."""
        target = min(_round_up(initial, self.grain), self.ceiling)
        while self.backed < target:
            self._grow(min(self.segment_bytes, target - self.backed))

    def _grow(self, nbytes: int) -> Segment:
        nbytes = _round_up(nbytes, self.grain)
        backing = None
        if self.spares:
            spare = self.spares[0]
            if spare.index == len(self.segments) and spare.nbytes == nbytes:
                self.spares.pop(0)
                if not spare.wait(0):  # the growths outran the look-ahead: it backs one step more
                    self.depth = min(self.max_ahead, self.depth + 1)
                name = None if self.folder is None else self.folder.segment(spare.index)
                backing = spare.take(name)  # None if that failed: then backed here, as without one
            else:  # a growth for a larger block than the step: the spares' indices and sizes are off
                for spare in self.spares:
                    spare.drop()  # not waited for: up to max_ahead steps may still be backing
                self.spares.clear()
        seg = self._add(nbytes, create=True, backing=backing)
        if self.watch is not None:
            self.watch.grew(seg)
        return seg

    def _look_ahead(self) -> None:
        """After a growth on demand: back the next ones' memory now, each on a thread of its own,
        so that it holds no request when it comes (0.3 s per GiB on a bare host, several times that
        in a VM). One step ahead at first; a growth that finds its step still being backed (a burst
        of stores, as an 8k-32k-token prompt's of a large model, outran it) makes it one step more,
        up to ``max_ahead``. The spares' bytes and the segments' stay under the ceiling (a step is
        at most what the ceiling leaves)."""
        if not self.ahead:
            return
        backed = self.backed + self.ahead_bytes
        while len(self.spares) < self.depth:
            nbytes = self._step(0, backed)
            if nbytes <= 0:
                return
            i = len(self.segments) + len(self.spares)
            path = None if self.folder is None else self.folder.ahead(i)
            self.spares.append(pages.Spare(i, nbytes, self.pinner, path))
            backed += nbytes

    def _add(self, nbytes: int, create: bool, backing=None) -> Segment:
        i = len(self.segments)
        path = None if self.folder is None else self.folder.segment(i)
        seg = Segment(i, nbytes, self.pinner, path, create, self.where, backing)
        self.segments.append(seg)
        self.backed += nbytes
        return seg

    def alloc(self, nbytes: int) -> tuple[Segment, int] | None:
        """A block of at least ``nbytes`` (a power of two, at least ``align``): from a backed
        segment, else from a new one if the ceiling allows."""
        k = order_of(max(nbytes, self.align))
        for j in range(k, len(self.where)):
            if self.where[j]:  # the lowest segment with a free block of the smallest order that holds it
                seg = self.segments[min(self.where[j])]
                return seg, seg.alloc(1 << k)
        if self.can_grow(k):
            try:
                seg = self._grow(self.next_segment_bytes(k))
            except OSError as exc:  # the pool folder's filesystem is full: serve from what is backed
                self.grow_error = str(exc)
                return None
            off = seg.alloc(1 << k)
            assert off is not None
            self._look_ahead()
            return seg, off
        return None

    def next_segment_bytes(self, k: int = 0) -> int:
        """The bytes a growth for a block of order ``k`` backs: the pool's size so far rounded down
        to a power of two, within [grow_bytes, segment_bytes], at least the block, at most what
        the ceiling leaves (module doc); 0 once growing failed."""
        return self._step(k, self.backed)

    def _step(self, k: int, backed: int) -> int:
        """``next_segment_bytes`` of a pool that has ``backed`` bytes."""
        if self.grow_error is not None:
            return 0
        step = min(self.segment_bytes, max(self.grow_bytes, 1 << max(0, backed.bit_length() - 1)))
        return min(self.ceiling - backed, _round_up(max(1 << k, step), self.grain))

    @property
    def ahead_bytes(self) -> int:
        """Bytes backed (or being backed) ahead for the next growths, not in a segment yet."""
        return sum(spare.nbytes for spare in self.spares)

    @property
    def spare(self) -> pages.Spare | None:
        """The next segment's memory, being backed (None: nothing is)."""
        return self.spares[0] if self.spares else None

    def can_grow(self, k: int) -> bool:
        """Whether a new segment holding a block of order ``k`` fits under the ceiling."""
        return self.grow_error is None and self.ceiling - self.backed >= 1 << k

    def has_free(self, k: int) -> bool:
        """Whether a block of order ``k`` is free in a backed segment or could be grown."""
        return any(self.where[j] for j in range(k, len(self.where))) or self.can_grow(k)

    def free_order(self) -> int:
        """The order of the largest block free now or growable under the ceiling (-1: none)."""
        free = max((j for j, segs in enumerate(self.where) if segs), default=-1)
        room = self.ceiling - self.backed if self.grow_error is None else 0
        return max(free, room.bit_length() - 1 if room >= self.align else -1)

    @property
    def top_order(self) -> int:
        """The order of the largest block any segment holds or could hold (-1: none)."""
        top = max((seg.top_order for seg in self.segments), default=-1)
        room = self.ceiling - self.backed if self.grow_error is None else 0
        return max(top, room.bit_length() - 1 if room >= self.align else -1)

    def free(self, seg: Segment, off: int, nbytes: int) -> None:
        seg.free(off, max(nbytes, self.align))

    def close(self) -> None:
        for spare in self.spares:
            spare.close()
        self.spares.clear()
        for seg in self.segments:
            seg.close(self.pinner)
        self.segments.clear()
        self.backed = 0


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def order_of(nbytes: int) -> int:
    """The smallest k with 2^k >= nbytes."""
    return max(0, (nbytes - 1).bit_length())
