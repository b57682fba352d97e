"""The memory the tier may move to and from: the daemon's registered buffers, by address.

Hazards: a put or get naming memory outside every registered buffer is refused (ValueError,
in the caller's thread), because the agent would map and touch exactly what it is told. Each
buffer keeps a duplicate of its file descriptor, so a reconnect (a new agent) can map it again
after the daemon closed its own; :meth:`Buffers.close` releases them. Shared by the caller's
thread (add, remove, place) and the worker (snapshot): one lock.
"""

from __future__ import annotations

import bisect
import os
import threading
from typing import NamedTuple


class Buf(NamedTuple):
    ident: int  # how the agent names its mapping
    nbytes: int
    fd: int  # our duplicate
    offset: int  # where the buffer starts in the file


class Buffers:
    def __init__(self):
        self._lock = threading.Lock()
        self._by_addr: dict[int, Buf] = {}
        self._starts: list[int] = []
        self._next = 0

    def add(self, addr: int, nbytes: int, fd: int, offset: int = 0) -> Buf:
        if nbytes <= 0 or addr <= 0 or offset < 0:
            raise ValueError(f"cannot register {nbytes} bytes at {addr:#x} (file offset {offset})")
        with self._lock:
            i = bisect.bisect_right(self._starts, addr)
            below = self._starts[i - 1] if i else None
            if (below is not None and below + self._by_addr[below].nbytes > addr) or (
                i < len(self._starts) and addr + nbytes > self._starts[i]
            ):
                raise ValueError(f"buffer at {addr:#x} overlaps one already registered")
            buf = Buf(self._next, nbytes, os.dup(fd), offset)
            self._next += 1
            self._by_addr[addr] = buf
            self._starts.insert(i, addr)
        return buf

    def remove(self, addr: int) -> Buf:
        """Forget it; the caller closes ``buf.fd`` once the agent has let go."""
        with self._lock:
            buf = self._by_addr.pop(addr, None)
            if buf is None:
                raise ValueError(f"no buffer registered at {addr:#x}")
            self._starts.remove(addr)
        return buf

    def place(self, addrs, sizes) -> tuple[list[int], list[int]]:
        """(buffer id, offset inside it) for each range; ValueError if one is not inside a buffer."""
        ids, offs = [], []
        with self._lock:
            for addr, size in zip(addrs, sizes):
                i = bisect.bisect_right(self._starts, addr) - 1
                start = self._starts[i] if i >= 0 else -1
                buf = self._by_addr.get(start)
                if size <= 0 or buf is None or addr + size > start + buf.nbytes:
                    raise ValueError(f"{size} bytes at {addr:#x} are not inside a registered buffer")
                ids.append(buf.ident)
                offs.append(addr - start)
        return ids, offs

    def snapshot(self) -> list[Buf]:
        with self._lock:
            return list(self._by_addr.values())

    def totals(self) -> tuple[int, int]:
        with self._lock:
            return len(self._by_addr), sum(b.nbytes for b in self._by_addr.values())

    def close(self) -> None:
        with self._lock:
            for buf in self._by_addr.values():
                os.close(buf.fd)
            self._by_addr.clear()
            self._starts.clear()
