"""The pool's host memory pinned for DMA: cudaHostRegister per pool segment (HostPinner).

Hazard: cudaHostRegister needs a current CUDA context, and the daemon makes none on a GPU that no
engine registered (tierd.transfer.cuda, Contexts). So nothing is pinned until the first rank's
GPU is opened (``activate``): the segments before it wait in ``pending``, later ones are pinned
at once, all with cudaHostRegisterPortable so the pages count as pinned in every context. A
segment whose registration fails stays in use, unpinned (its copies are slower, not wrong), and
counts in ``failed_bytes``. ``range_of`` and ``same_range`` say which registration an address
lies in, so that no merged copy spans two (tierd.transfer.dma).
"""

from __future__ import annotations

import bisect
import logging
import threading

log = logging.getLogger("tierd.cuda")


class HostPinner:
    """cudaHostRegister per pool segment, deferred until a GPU is in use (see module doc)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.device: int | None = None
        self.pending: dict[int, int] = {}
        self.ranges: dict[int, int] = {}  # addr -> nbytes, registered
        self._starts: list[int] = []
        self.pinned_bytes = 0
        self.failed_bytes = 0

    def pin(self, addr: int, nbytes: int) -> None:
        with self.lock:
            if self.device is None:
                self.pending[addr] = nbytes
            else:
                self._register(addr, nbytes)

    def unpin(self, addr: int) -> None:
        import torch

        with self.lock:
            if self.pending.pop(addr, None) is not None:
                return
            nbytes = self.ranges.pop(addr, None)
            if nbytes is None:
                return
            self._starts.remove(addr)
            self.pinned_bytes -= nbytes
            with torch.cuda.device(self.device):
                err = torch.cuda.cudart().cudaHostUnregister(addr)
            if int(err) != 0:
                log.warning("cudaHostUnregister(%#x) failed: error %d", addr, int(err))

    def activate(self, device: int) -> None:
        """Pin every deferred segment with ``device`` current; later ones are pinned at once."""
        with self.lock:
            if self.device is not None:
                return
            self.device = device
            pending, self.pending = self.pending, {}
            for addr, nbytes in pending.items():
                self._register(addr, nbytes)

    def _register(self, addr: int, nbytes: int) -> None:
        import torch

        with torch.cuda.device(self.device):
            err = torch.cuda.cudart().cudaHostRegister(addr, nbytes, 1)  # cudaHostRegisterPortable
        if int(err) != 0:
            self.failed_bytes += nbytes
            log.warning(
                "cudaHostRegister of %d MiB failed (error %d): copies to it run unpinned",
                nbytes >> 20,
                int(err),
            )
            return
        self.ranges[addr] = nbytes
        bisect.insort(self._starts, addr)
        self.pinned_bytes += nbytes

    def range_of(self, addr: int) -> int | None:
        """Start of the pinned registration holding ``addr`` (None: not pinned)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            start = self._starts[i]
            if addr < start + self.ranges[start]:
                return start
        return None

    def same_range(self, a: int, b: int) -> bool:
        return self.range_of(a) == self.range_of(b)
