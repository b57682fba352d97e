"""Publishing host tensors to the daemon as shared memory, without leaving files behind.

``share_torch_tensors`` moves each CPU tensor's storage into shared memory *in place* with
torch's per-storage ``_share_fd_cpu_`` (the storage's data pointer is swapped, so every view
the engine holds keeps working). That memory is a /dev/shm file which torch unlinks at once and
keeps open by fd: it has no name, so nothing can outlive the process, however it ends (SIGKILL
included), and the kernel frees it when the last fd and mapping are gone.

The daemon never follows a path to that memory: ``Publication`` hands its descriptors to the
daemon (tierd_client.fdpass) right before every REGISTER of the rank (the client's ``publish``
hook, also around every re-REGISTER after a daemon restart), and the layout names them by a
ticket and an index. Nothing is created in /dev/shm, so nothing can be left behind there, and
the daemon (which may run as its own user) needs no access to the engine's files or /proc.
Nothing here changes process-wide state: torch's sharing strategy is left as it is, and torch's
file_system machinery (torch_shm_manager, named files) is not used.

``SharedBuffer`` is a plain named shared buffer for callers without torch (tests, ``tierd bench``);
its owner unlinks it with ``close``.
"""

from __future__ import annotations

import mmap
import os
import uuid

import numpy as np

from tierd_client import fdpass


class SharedBuffer:
    """A /dev/shm file mapped into this process, exposed as a uint8 numpy array."""

    def __init__(self, nbytes: int, prefix: str = "tierd-buf"):
        self.path = f"/dev/shm/{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
            try:  # huge pages where /dev/shm's huge= allows them (fewer TLB misses in every copy)
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError):
                pass
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    @property
    def handle(self) -> dict:
        return {"kind": "shm", "path": self.path, "offset": 0}

    def ref(self) -> dict:
        return {"handle": self.handle, "nbytes": self.nbytes}

    def close(self) -> None:
        self.array = None
        try:
            self._map.close()
        except BufferError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Publication:
    """Descriptors of unnamed shared storages, handed to the daemon before each REGISTER."""

    def __init__(self, fds: list[int]):
        self.fds = fds
        self.ticket = fdpass.new_ticket()

    def open(self, url: str) -> None:
        fdpass.send_fds(url, self.ticket, self.fds)

    def close(self) -> None:
        pass  # the daemon claims the descriptors with the REGISTER (and closes unclaimed ones)

    def handle(self, index: int, offset: int) -> dict:
        return {"kind": "fd", "ticket": self.ticket, "index": index, "offset": offset}


def share_torch_tensors(tensors) -> tuple[list[dict], list[tuple[int, int]], Publication | None]:
    """Move the storages of ``tensors`` (CPU) into unnamed shared memory, in place.

    Returns ``(refs, where, publication)``: ``refs`` are the distinct storages as REGISTER tensor
    refs, ``where[i] = (ref index, byte offset of tensors[i]'s first element in that storage)``,
    and ``publication`` must go with the REGISTER (``register_async(publish=)``): it hands the
    storages' descriptors to the daemon (None when every storage already had a name).
    """
    refs: list[dict] = []
    by_storage: dict[int, int] = {}
    where = []
    fds: dict[int, int] = {}  # ref index -> fd of its unnamed memory
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"share_torch_tensors takes CPU tensors, got one on {t.device}")
        storage = t.untyped_storage()
        if not storage.is_shared():
            share = getattr(storage, "_share_fd_cpu_", None)
            if share is None:
                raise RuntimeError(
                    "this torch has no UntypedStorage._share_fd_cpu_: tierd cannot share its CPU KV cache"
                )
            share()  # swaps the storage's data pointer: every view of it follows
        base = storage.data_ptr()
        if base not in by_storage:
            by_storage[base] = len(refs)
            path, offset = _mapping_of(base)
            try:
                fds[len(refs)] = int(storage._get_shared_fd())
                path = None  # unnamed: handed over as a descriptor
            except RuntimeError:  # shared by torch's file_system strategy before we saw it: named
                if not path.startswith("/dev/shm/") or path.endswith("(deleted)"):
                    raise RuntimeError(
                        f"tensor storage lives in {path!r}, which the daemon cannot map"
                    ) from None
            refs.append(
                {"handle": {"kind": "shm", "path": path, "offset": offset}, "nbytes": storage.nbytes()}
            )
        where.append((by_storage[base], t.data_ptr() - base))
    publication = Publication(list(fds.values())) if fds else None
    for n, i in enumerate(fds):
        refs[i]["handle"] = publication.handle(n, refs[i]["handle"]["offset"])
    return refs, where, publication


def _mapping_of(addr: int) -> tuple[str, int]:
    """(file, offset of ``addr`` inside it) for a shared file mapping of this process."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) == 6:
                return parts[5].strip(), addr - lo + int(parts[2], 16)
    raise RuntimeError(f"address {addr:#x} is not in a file mapping")
