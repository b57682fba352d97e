"""How the pool's memory is backed: every page at once, without holding the GIL (``populate``),
and in huge pages where the kernel allows them for shared memory (``advise_huge``, ``huge_pages``).
A part of tierd.pool.segments."""

from __future__ import annotations

import ctypes
import mmap

SMALL_PAGES = ("never", "deny", "unsupported")  # huge_pages() where the pool's pages are all 4 KiB
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_libc = ctypes.CDLL(None, use_errno=True)


def advise_huge(mapping: mmap.mmap) -> None:
    """Ask for huge pages where the pages are not backed yet (MADV_HUGEPAGE): a CPU copy through
    shared memory in 4 KiB pages misses the TLB every 4 KiB and runs below memcpy's speed (README,
    "Huge pages"; a GPU's DMA is not affected). The kernel grants them only where its setting
    for shared memory allows it (memfd: ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``
    advise, within_size or always; a tmpfs file: that mount's ``huge=``); elsewhere this changes
    nothing."""
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # a kernel or platform without transparent huge pages
        pass


def populate(mapping: mmap.mmap, nbytes: int) -> bool:
    """Back every page of ``mapping`` now, without holding the GIL (Python's MAP_POPULATE mmap
    holds it for the whole backing: about a second per GiB, in which no other thread of the
    daemon runs). False where the kernel does not know MADV_POPULATE_WRITE."""
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        done = _libc.madvise(
            ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(nbytes), _MADV_POPULATE_WRITE
        )
    finally:
        del anchor  # (the mapping can be closed again)
    return done == 0


_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def huge_pages(folder: str | None = None, thp: str = _THP, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The kernel's huge-page setting for the pool's memory (``advise_huge``): memfd's
    (``shmem_enabled``: never, advise, within_size, always; deny and force override every tmpfs
    too), or with ``folder`` its tmpfs mount's ``huge=`` (never unless the mount says otherwise).
    "unsupported" where the kernel has no transparent huge pages for shared memory; "unknown"
    where the mount table cannot be read."""
    try:
        with open(thp) as f:
            words = f.read().split()
    except OSError:
        return "unsupported"
    setting = next((w[1:-1] for w in words if w.startswith("[")), "unsupported")
    if folder is None or setting in ("deny", "force"):
        return setting
    best, huge = "", "never"
    try:
        with open(mountinfo) as f:
            for line in f:  # id parent major:minor root mount-point options ... - type source super-options
                fields = line.split()
                point, sep = fields[4], fields.index("-")
                under = folder == point or folder.startswith(point.rstrip("/") + "/")
                if under and len(point) > len(best):
                    best = point
                    opts = dict(o.partition("=")[::2] for o in fields[sep + 3].split(","))
                    huge = opts.get("huge", "never")
    except (OSError, ValueError, IndexError):
        return "unknown"
    return huge
