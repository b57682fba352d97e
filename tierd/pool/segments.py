"""Host memory segments: shared-memory mappings backed (pre-touched) when created, optionally pinned.

Segments are created on demand as slabs need room, never beyond the configured ceiling. Each
segment is one memfd mapping, populated at creation so that the first copy into it does not
page-fault, and registered with CUDA as one pinned range when a pinner is installed. A slab
never spans two segments, so every copy stays inside one pinned registration.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Protocol

import numpy as np


class Pinner(Protocol):
    def pin(self, addr: int, nbytes: int) -> None: ...

    def unpin(self, addr: int) -> None: ...


class Segment:
    __slots__ = ("index", "nbytes", "_fd", "_map", "view", "addr", "_free", "pinned")

    def __init__(self, index: int, nbytes: int, pinner: Pinner | None):
        self.index = index
        self.nbytes = nbytes
        self._fd = os.memfd_create(f"tierd-l1-{index}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, nbytes)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(self._fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            raise
        self.view = np.frombuffer(self._map, dtype=np.uint8)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.pinned = False
        if pinner is not None:
            pinner.pin(self.addr, nbytes)
            self.pinned = True
        self._free: list[list[int]] = [[0, nbytes]]  # sorted [start, size] extents

    def alloc(self, nbytes: int) -> int | None:
        """First-fit extent allocation; returns the offset or None."""
        for ext in self._free:
            if ext[1] >= nbytes:
                off = ext[0]
                ext[0] += nbytes
                ext[1] -= nbytes
                if ext[1] == 0:
                    self._free.remove(ext)
                return off
        return None

    def free(self, off: int, nbytes: int) -> None:
        exts = self._free
        i = 0
        while i < len(exts) and exts[i][0] < off:
            i += 1
        exts.insert(i, [off, nbytes])
        # coalesce with the next, then with the previous extent
        if i + 1 < len(exts) and exts[i][0] + exts[i][1] == exts[i + 1][0]:
            exts[i][1] += exts.pop(i + 1)[1]
        if i > 0 and exts[i - 1][0] + exts[i - 1][1] == exts[i][0]:
            exts[i - 1][1] += exts.pop(i)[1]

    @property
    def free_bytes(self) -> int:
        return sum(e[1] for e in self._free)

    def close(self, pinner: Pinner | None) -> None:
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

    def __init__(self, ceiling: int, initial: int, segment_bytes: int, align: int, pinner: Pinner | None = None):
        if align <= 0 or align & (align - 1):
            raise ValueError(f"alignment {align} is not a power of two")
        ceiling -= ceiling % align  # segments are whole multiples of align: never back past the ceiling
        self.ceiling = ceiling
        self.segment_bytes = max(align, _round_up(segment_bytes, align))
        self.align = align
        self.pinner = pinner
        self.segments: list[Segment] = []
        self.backed = 0
        while self.backed < min(initial, ceiling):
            self._grow(min(self.segment_bytes, ceiling - self.backed))

    def _grow(self, nbytes: int) -> Segment:
        nbytes = _round_up(nbytes, self.align)
        seg = Segment(len(self.segments), nbytes, self.pinner)
        self.segments.append(seg)
        self.backed += nbytes
        return seg

    def alloc(self, nbytes: int) -> tuple[Segment, int] | None:
        """Room for one slab: from a backed segment, else from a new one if the ceiling allows."""
        nbytes = _round_up(nbytes, self.align)
        for seg in self.segments:
            off = seg.alloc(nbytes)
            if off is not None:
                return seg, off
        room = self.ceiling - self.backed
        if room >= nbytes:
            seg = self._grow(min(room, max(nbytes, self.segment_bytes)))
            off = seg.alloc(nbytes)
            assert off is not None
            return seg, off
        return None

    def free(self, seg: Segment, off: int, nbytes: int) -> None:
        seg.free(off, _round_up(nbytes, self.align))

    def close(self) -> None:
        for seg in self.segments:
            seg.close(self.pinner)
        self.segments.clear()
        self.backed = 0


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align
