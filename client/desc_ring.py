"""The block descriptors of the engine-side gather and scatter kernels (tierd_client.cuda_stage),
uploaded to the GPU through a ring that allocates nothing per request."""

from __future__ import annotations

import collections

import numpy as np

DESC_RING_WORDS = 1 << 17  # int64 descriptor words per stream's upload ring (1 MiB pinned, 1 MiB device)


class DescRing:
    """Block descriptors to the device on one stream without allocating: a pinned host ring and a
    device ring of the same size. A region of the host ring is written again only once the upload
    that last read it is complete (its event); the device region is safe by stream order (every
    reader of it ran earlier on the same stream), and a region whose reader is queued later
    (``upload_raw(pin=True)``: a scatter prepared before its answer) is not written until
    ``unpin``. torch's pin_memory() per call costs more than a small request's whole gather."""

    def __init__(self, torch, device, words: int = DESC_RING_WORDS):
        self.torch = torch
        self.host = torch.empty(words, dtype=torch.int64, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(words, dtype=torch.int64, device=device)
        self.words = words
        self.host_ptr, self.dev_ptr = self.host.data_ptr(), self.dev.data_ptr()
        self.head = 0
        self.held: collections.deque = collections.deque()  # (begin, end, event), oldest first
        self.pinned: dict[int, tuple[int, int]] = {}  # device address -> (begin, end): upload_raw(pin=True)

    def upload(self, desc: np.ndarray, stream):
        """``desc`` to the device on ``stream``: a device tensor of its shape (for torch's ops)."""
        torch = self.torch
        n = desc.size
        at = self._room(desc) if n <= self.words else None
        if at is None:
            return _upload(torch, desc, stream, self.dev.device)
        dev = self.dev[at : at + n]
        with torch.cuda.stream(stream):
            dev.copy_(self.host[at : at + n], non_blocking=True)
        self._hold(at, n, stream)
        return dev.view(desc.shape)

    def upload_raw(self, desc: np.ndarray, stream, mod, pin: bool = False) -> tuple[int, object]:
        """``upload`` for the native kernels: the device address of ``desc`` (C order) and what must
        stay referenced until the kernel that reads it is queued. One call of the native module's
        copy instead of torch's slicing, stream switch and ``copy_``: a one-chunk request's upload
        took several times its work in those (each a cold, long path in the engine's process).
        ``pin``: the kernel is queued later, after other uploads may have come: the device region
        is not written again until ``unpin`` (stream order alone protects it only up to its
        reader's launch)."""
        n = desc.size
        at = self._room(desc) if n <= self.words else None
        if at is None:  # too large, or the ring's next region is pinned: a buffer of its own
            dev = _upload(self.torch, desc, stream, self.dev.device)
            return dev.data_ptr(), dev
        mod.memcpy_many([self.dev_ptr + 8 * at], [self.host_ptr + 8 * at], [8 * n], False, stream.cuda_stream)
        self._hold(at, n, stream)
        if pin:
            self.pinned[self.dev_ptr + 8 * at] = (at, at + n)
        return self.dev_ptr + 8 * at, None

    def unpin(self, addr: int) -> None:
        """The kernel reading the descriptors at device address ``addr`` is queued (or will not
        be): stream order protects them from here on."""
        self.pinned.pop(addr, None)

    def _room(self, desc: np.ndarray) -> int | None:
        """Where ``desc`` goes in the ring (written into its host half already); None when that
        region is pinned."""
        n = desc.size
        at = self.head if self.head + n <= self.words else 0
        if any(_overlaps(p, at, at + n) for p in self.pinned.values()):
            return None
        while self.held and self.held[0][2].query():
            self.held.popleft()
        while any(_overlaps(h, at, at + n) for h in self.held):  # oldest first, until none overlaps
            self.held.popleft()[2].synchronize()  # a whole ring's uploads ago: done long since
        self.head = at + n
        np.copyto(self.host_np[at : at + n], desc.reshape(-1))
        return at

    def _hold(self, at: int, n: int, stream) -> None:
        """The host region [at, at + n) is written again only once the upload queued on ``stream``
        from it is complete."""
        ev = self.torch.cuda.Event()
        ev.record(stream)
        self.held.append((at, at + n, ev))


def _overlaps(held, begin: int, end: int) -> bool:
    return begin < held[1] and held[0] < end


def _upload(torch, desc: np.ndarray, stream, device):
    """Descriptors to the device on ``stream``: a pinned host copy per call (torch's caching host
    allocator reuses it only once the copy recorded on it has run); device memory stream-ordered."""
    host = torch.from_numpy(np.ascontiguousarray(desc)).pin_memory()
    with torch.cuda.stream(stream):
        dev = torch.empty(desc.shape, dtype=torch.int64, device=device)
        dev.copy_(host, non_blocking=True)
    return dev
