"""The pool folder (``--pool-dir``): segment files, the index and its journal, one daemon at a time.

Hazards: on a disk filesystem every copy into the pool would become page-cache writeback (and
the pool would outlive a reboot that it cannot survive consistently), so the folder must be on
tmpfs or hugetlbfs, checked by statfs magic; two daemons on one folder would overwrite each
other's objects, so an exclusive flock on ``lock`` in each folder is held for the pool's
lifetime (the kernel drops it when the process dies, however it dies). hugetlbfs files cannot
be written with write(2), only mapped, so with segments there the index and journal need a
tmpfs ``index_dir``. Files are mode 0600: they hold every tenant's KV bytes. Only the names
below are ever created or removed; other files in the folders are left alone.

Names: ``segment-NNNNN`` (segment N, N from 0) and ``segment-NNNNN.ahead`` (its memory backed
before the pool needs it, renamed to the former when it does; any left at start are removed) in
the pool folder; ``index``, ``journal``, ``*.tmp`` (a file being replaced by rename) in the index
folder (the pool folder by default); ``lock`` in both.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re

TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
_ACCEPTED = {TMPFS_MAGIC: "tmpfs", HUGETLBFS_MAGIC: "hugetlbfs"}
_OCTAL = re.compile(r"\\([0-7]{3})")
_SEGMENT = re.compile(r"segment-(\d{5})\Z")
_AHEAD = re.compile(r"segment-\d{5}\.ahead\Z")


class PoolDirError(RuntimeError):
    """The folder cannot hold a pool (wrong filesystem, held by another daemon)."""


class PoolDir:
    def __init__(self, path: str, index_dir: str | None = None):
        self.path = os.path.abspath(path)
        self.index_dir = os.path.abspath(index_dir or path)
        magic, bsize = _check(self.path, "pool folder", _ACCEPTED)
        if self.index_dir != self.path or magic != TMPFS_MAGIC:
            _check(
                self.index_dir,
                "index folder (hugetlbfs files cannot be written: give one on tmpfs)",
                {TMPFS_MAGIC: "tmpfs"},
            )
        self.fstype = _ACCEPTED[magic]
        self.grain = bsize if magic == HUGETLBFS_MAGIC else 1  # hugetlbfs files are whole huge pages
        self._locks: list[int] = []
        try:
            for folder in dict.fromkeys((self.path, self.index_dir)):
                lock = os.open(os.path.join(folder, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                self._locks.append(lock)
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise PoolDirError(
                        f"folder {folder} is held by another pool (another tierd? its lock file is flocked)"
                    ) from None
        except BaseException:
            self.close()
            raise
        for name in os.listdir(self.path):  # backed ahead by a pool that did not take it
            if _AHEAD.match(name):
                os.unlink(os.path.join(self.path, name))

    def file(self, name: str) -> str:
        """A file of the index folder."""
        return os.path.join(self.index_dir, name)

    def segment(self, i: int) -> str:
        return os.path.join(self.path, f"segment-{i:05d}")

    def ahead(self, i: int) -> str:
        """Segment ``i``'s file while it is backed ahead of need (tierd.pool.segments)."""
        return self.segment(i) + ".ahead"

    def segments(self) -> list[int]:
        """Indices of the segment files present, sorted."""
        return sorted(int(m.group(1)) for n in os.listdir(self.path) if (m := _SEGMENT.match(n)))

    def segment_size(self, i: int) -> int | None:
        try:
            return os.stat(self.segment(i)).st_size
        except FileNotFoundError:
            return None

    def read(self, name: str) -> bytes | None:
        try:
            with open(self.file(name), "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def write_tmp(self, name: str, data: bytes) -> None:
        """Write ``name.tmp`` whole; ``publish`` renames it over ``name``."""
        fd = os.open(self.file(name + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def publish(self, name: str) -> None:
        os.replace(self.file(name + ".tmp"), self.file(name))

    def remove(self, name: str) -> None:
        try:
            os.unlink(self.file(name))
        except FileNotFoundError:
            pass

    def remove_segments_from(self, first: int) -> None:
        for i in self.segments():
            if i >= first:
                os.unlink(self.segment(i))

    def wipe(self) -> None:
        """Remove the index first (without it nothing is ever recovered), then the rest."""
        for name in ("index", "journal", "index.tmp", "journal.tmp"):
            self.remove(name)
        self.remove_segments_from(0)

    def close(self) -> None:
        while self._locks:
            os.close(self._locks.pop())  # releases the flock


def _check(path: str, what: str, accepted: dict[int, str]) -> tuple[int, int]:
    os.makedirs(path, mode=0o700, exist_ok=True)
    magic, bsize = statfs(path)
    if magic not in accepted:
        raise PoolDirError(
            f"{what} {path} is on {mount_fstype(path)} (statfs magic {magic:#x}); "
            f"it must be on {' or '.join(accepted.values())}"
        )
    return magic, bsize


def statfs(path: str) -> tuple[int, int]:
    """(f_type, f_bsize) of the filesystem holding ``path``."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _libc().statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    f_type, f_bsize = (ctypes.c_long * 2).from_buffer(buf)  # __fsword_t f_type, f_bsize
    return f_type & 0xFFFFFFFF, f_bsize


def mount_fstype(path: str) -> str:
    """The filesystem type /proc/self/mountinfo gives for the mount holding ``path``."""
    path = os.path.realpath(path)
    best, fstype = "", "an unknown filesystem"
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), left.split()[4])  # \040: a space
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, right.split()[0]
    except OSError:
        pass
    return fstype


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC
