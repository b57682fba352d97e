"""How the pool's memory is backed: every page at once, without holding the GIL (``populate``),
and in huge pages where the kernel allows them for shared memory (``advise_huge``, ``huge_pages``);
the next segment's memory backed on a thread of its own before the pool needs it (``Spare``).
A part of tierd.pool.segments."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading

log = logging.getLogger("tierd")

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
    done = _libc.madvise(ctypes.c_void_p(address(mapping)), ctypes.c_size_t(nbytes), _MADV_POPULATE_WRITE)
    return done == 0


def map_backed(fd: int, nbytes: int) -> mmap.mmap:
    """The first ``nbytes`` of file ``fd`` mapped shared, huge pages advised, every page backed."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
    advise_huge(mapping)
    if not populate(mapping, nbytes):  # a kernel before 5.14: backed at mapping instead
        mapping.close()
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
    return mapping


def memfd_backed(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    """A memfd of ``nbytes`` and its mapping, every page backed (``map_backed``)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return fd, map_backed(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def file_backed(path: str, nbytes: int, create: bool = True) -> tuple[int, mmap.mmap]:
    """File ``path`` of ``nbytes`` (created, or truncated, with ``create``; else it must have that
    size) and its mapping, every page backed (``map_backed``). On tmpfs a file is backed whole first
    (fallocate), so a full filesystem fails here, not with SIGBUS at a later copy."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_TRUNC if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot back {nbytes} bytes of {path}: {exc.strerror}") from None
        elif os.fstat(fd).st_size != nbytes:
            raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, not {nbytes}")
        return fd, map_backed(fd, nbytes)
    except BaseException:
        os.close(fd)
        if create:
            os.unlink(path)
        raise


class Spare:
    """Segment ``index``'s memory (``nbytes`` of memfd, or the file ``path``), backed on a thread
    of its own from the moment it is made, and pinned there too with a ``pinner``
    (cudaHostRegister takes a while per GiB as well): backing costs about 0.3 s per GiB on a bare
    host and several times that in a VM, during which a growth on the daemon's main loop would
    hold every request. ``take`` hands over the descriptor, the mapping and whether it is pinned
    (waiting for the backing if it is not done); ``close`` lets them go untaken."""

    def __init__(self, index: int, nbytes: int, pinner=None, path: str | None = None):
        self.index, self.nbytes, self.pinner, self.path = index, nbytes, pinner, path
        self._out: tuple[int, mmap.mmap, bool] | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()  # between ``drop`` and the end of the backing
        self._dropped = False
        threading.Thread(target=self._run, name="tierd-pool-grow", daemon=True).start()

    def _run(self) -> None:
        try:
            if self.path is None:
                fd, mapping = memfd_backed(f"tierd-l1-{self.index}", self.nbytes)
            else:
                fd, mapping = file_backed(self.path, self.nbytes)
            if self.pinner is not None:
                self.pinner.pin(address(mapping), self.nbytes)
            self._out = (fd, mapping, self.pinner is not None)
        except Exception as exc:  # noqa: BLE001 - the growth then backs it on the main loop, as before
            log.warning("backing segment %d ahead of need failed: %s", self.index, exc)
        finally:
            with self._lock:
                self._done.set()
                out = self._out if self._dropped else None
            if out is not None:
                self._out = None
                self._release(out)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the backing is over (done or failed), waiting at most ``timeout``."""
        return self._done.wait(timeout)

    def take(self, name: str | None = None) -> tuple[int, mmap.mmap, bool] | None:
        """The backed descriptor, its mapping and whether that is pinned (now the caller's), the
        file renamed to ``name`` first if given; None if backing or renaming failed."""
        self.wait()
        out, self._out = self._out, None
        if out is not None and self.path is not None and name is not None:
            try:
                os.rename(self.path, name)
            except OSError as exc:
                log.warning("segment %d was backed ahead but cannot be named %s: %s", self.index, name, exc)
                self._release(out)
                return None
        return out

    def close(self) -> None:
        out = self.take()
        if out is not None:
            self._release(out)

    def drop(self) -> None:
        """Let it go untaken without waiting: released now if backed, else by its own thread once
        it is (the caller is the daemon's main loop, which a backing in progress would hold)."""
        with self._lock:
            if not self._done.is_set():
                self._dropped = True
                return
        self.close()

    def _release(self, out: tuple[int, mmap.mmap, bool]) -> None:
        fd, mapping, pinned = out
        if pinned:
            self.pinner.unpin(address(mapping))
        mapping.close()
        os.close(fd)
        if self.path is not None:
            os.unlink(self.path)


def address(mapping: mmap.mmap) -> int:
    """Where ``mapping`` starts (the mapping can be closed again afterwards)."""
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # (the mapping can be closed again)


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
