"""Publishing host tensors to the daemon as shared memory.

``share_torch_tensors`` moves each tensor's storage into shared memory *in place* (torch's own
``share_memory_`` machinery swaps the storage's data pointer, so every view the engine holds
keeps working) and returns the handles the daemon maps. ``SharedBuffer`` is a plain shared
buffer for callers without torch (tests, ``tierd bench``).
"""

from __future__ import annotations

import mmap
import os
import uuid

import numpy as np


class SharedBuffer:
    """A /dev/shm file mapped into this process, exposed as a uint8 numpy array."""

    def __init__(self, nbytes: int, prefix: str = "tierd-buf"):
        self.path = f"/dev/shm/{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
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


def _mapping_of(addr: int) -> tuple[str, int]:
    """(file, offset of ``addr`` inside it) for a shared file mapping of this process."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) == 6:
                return parts[5].strip(), addr - lo + int(parts[2], 16)
    raise RuntimeError(f"address {addr:#x} is not in a file mapping")


def share_torch_tensors(tensors) -> tuple[list[dict], list[tuple[int, int]]]:
    """Move the storages of ``tensors`` (CPU) into shared memory, in place.

    Returns ``(refs, where)``: ``refs`` are the distinct storages as REGISTER tensor refs,
    ``where[i] = (ref index, byte offset of tensors[i]'s first element in that storage)``.
    """
    refs: list[dict] = []
    by_storage: dict[int, int] = {}
    where = []
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"share_torch_tensors takes CPU tensors, got one on {t.device}")
        storage = t.untyped_storage()
        if not storage.is_shared():
            _share_by_filename(storage)
        base = storage.data_ptr()
        if base not in by_storage:
            path, offset = _mapping_of(base)
            if not path.startswith("/dev/shm/") or path.endswith("(deleted)"):
                raise RuntimeError(
                    f"tensor storage lives in {path!r}, not a named /dev/shm file: it was shared with torch's "
                    "file_descriptor strategy before tierd saw it"
                )
            by_storage[base] = len(refs)
            refs.append({"handle": {"kind": "shm", "path": path, "offset": offset}, "nbytes": storage.nbytes()})
        where.append((by_storage[base], t.data_ptr() - base))
    return refs, where


def _share_by_filename(storage) -> None:
    """Move a storage into a *named* /dev/shm file in place (torch's file_system strategy for
    this one storage, whatever the process-wide strategy is)."""
    share = getattr(storage, "_share_filename_cpu_", None)
    if share is not None:
        share()
        return
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")
    storage.share_memory_()
