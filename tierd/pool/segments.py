"""Host memory segments: shared-memory mappings backed (pre-touched) when created, optionally pinned.

Segments are created on demand as slabs need room, never beyond the configured ceiling. Each
segment is one memfd mapping, populated at creation so that the first copy into it does not
page-fault, and registered with CUDA as one pinned range when a pinner is installed. A slab
never spans two segments, so every copy stays inside one pinned registration.

With a pool folder (tierd.pool.pooldir) each segment is instead a file there, created, sized and
populated the same way; a restarted pool maps the files it recovers (``restore``) without
truncating them. On hugetlbfs every file is a whole number of huge pages (``grain``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Pinner(Protocol):
    def pin(self, addr: int, nbytes: int) -> None: ...

    def unpin(self, addr: int) -> None: ...


class Segment:
    __slots__ = ("index", "nbytes", "_fd", "_map", "view", "addr", "_free", "pinned")

    def __init__(self, index: int, nbytes: int, pinner: Pinner | None, path: str | None = None,
                 create: bool = True):
        self.index = index
        self.nbytes = nbytes
        if path is None:
            self._fd = os.memfd_create(f"tierd-l1-{index}", os.MFD_CLOEXEC)
        else:
            flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_TRUNC if create else 0)
            self._fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(self._fd, nbytes)
                if path is not None:  # a full tmpfs fails here, not with SIGBUS at a later copy
                    _fallocate(self._fd, nbytes, path)
            elif os.fstat(self._fd).st_size != nbytes:
                raise ValueError(f"{path} holds {os.fstat(self._fd).st_size} bytes, not {nbytes}")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(self._fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            if path is not None and create:
                os.unlink(path)
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

    def reserve(self, off: int, nbytes: int) -> None:
        """Take exactly [off, off + nbytes) (a recovered slab); raises unless all of it is free."""
        for i, (start, size) in enumerate(self._free):
            if start <= off and off + nbytes <= start + size:
                parts = [[start, off - start], [off + nbytes, start + size - off - nbytes]]
                self._free[i : i + 1] = [e for e in parts if e[1]]
                return
        raise ValueError(f"segment {self.index}: [{off}, {off + nbytes}) is not free")

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

    def __init__(self, ceiling: int, initial: int, segment_bytes: int, align: int,
                 pinner: Pinner | None = None, folder=None, restore: Sequence[int] = ()):
        """``folder``: a PoolDir whose segment files back the pool (memfd without one);
        ``restore``: sizes of segment files 0.. to map as they are (a recovered pool)."""
        if align <= 0 or align & (align - 1):
            raise ValueError(f"alignment {align} is not a power of two")
        self.grain = max(align, folder.grain if folder is not None else 1)  # powers of two: the lcm
        ceiling -= ceiling % self.grain  # segments are whole grains: never back past the ceiling
        self.ceiling = ceiling
        self.segment_bytes = max(self.grain, _round_up(segment_bytes, self.grain))
        self.align = align
        self.pinner = pinner
        self.folder = folder
        self.segments: list[Segment] = []
        self.backed = 0
        self.watch = None  # told of every segment grown (the pool's journal)
        self.grow_error: str | None = None  # why growing failed (then it is not tried again)
        try:
            for nbytes in restore:
                self._add(nbytes, create=False)
            self.grow_to(initial)
        except BaseException:
            self.close()
            raise

    def grow_to(self, initial: int) -> None:
        """Back ``initial`` bytes (rounded up to the grain, at most the ceiling) now: whole
        segments, then a last one of what is left (not a whole segment more)."""
        target = min(_round_up(initial, self.grain), self.ceiling)
        while self.backed < target:
            self._grow(min(self.segment_bytes, target - self.backed))

    def _grow(self, nbytes: int) -> Segment:
        seg = self._add(_round_up(nbytes, self.grain), create=True)
        if self.watch is not None:
            self.watch.grew(seg)
        return seg

    def _add(self, nbytes: int, create: bool) -> Segment:
        i = len(self.segments)
        path = None if self.folder is None else self.folder.segment(i)
        seg = Segment(i, nbytes, self.pinner, path, create)
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
        if room >= nbytes and self.grow_error is None:
            try:
                seg = self._grow(min(room, max(nbytes, self.segment_bytes)))
            except OSError as exc:  # the pool folder's filesystem is full: serve from what is backed
                self.grow_error = str(exc)
                return None
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


def _fallocate(fd: int, nbytes: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot back {nbytes} bytes of {path}: {exc.strerror}") from None


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align
