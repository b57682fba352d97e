"""The rooms of a GPU rank's staging buffer: each direction (stores, loads) owns one half, handed
out in request-sized regions that come free as the daemon and the scatters are done with them
(tierd_client.staged_rank)."""

from __future__ import annotations

import collections
from concurrent.futures import Future


class Ring:
    """One direction's half of the staging buffer, handed out in request-sized regions. A region
    is free again once its future is done and, with ``device_done`` (host order's RETRIEVE ring:
    the future's result carries the scatter's ``done`` event), once that event has completed."""

    def __init__(self, start: int, nbytes: int, timeout_s: float | None, device_done: bool = False):
        self.start, self.nbytes, self.timeout_s = start, nbytes, timeout_s
        self.device_done = device_done
        self.head = start
        self.held: collections.deque = collections.deque()  # (begin, end, future), oldest first

    def _free(self, fut: Future) -> bool:
        if not fut.done():
            return False
        done = self._scatter_done(fut)
        return done is None or done.query()

    def _scatter_done(self, fut: Future):
        """With ``device_done``: the scatter event of a finished RETRIEVE request (None if failed)."""
        if not self.device_done or fut.exception() is not None:
            return None
        return fut.result().done  # a tierd_client.rank_jobs.Loaded

    def take(self, size: int) -> int:
        end_all = self.start + self.nbytes
        while True:
            while self.held and self._free(self.held[0][2]):
                self.held.popleft()
            at = self.head if self.head + size <= end_all else self.start
            if not any(at < e and b < at + size for b, e, _ in self.held):
                self.head = at + size
                return at
            oldest = self.held.popleft()[2]
            try:
                oldest.result(timeout=self.timeout_s)
            except Exception:  # noqa: BLE001 - failed or timed out: its room is free either way
                pass
            done = self._scatter_done(oldest)
            if done is not None:
                done.synchronize()  # its scatter has read the room: the daemon may overwrite it

    def try_take(self, size: int) -> int | None:
        """``take`` without waiting: None when the room is still held."""
        while self.held and self._free(self.held[0][2]):
            self.held.popleft()
        at = self.head if self.head + size <= self.start + self.nbytes else self.start
        if any(at < e and b < at + size for b, e, _ in self.held):
            return None
        self.head = at + size
        return at

    def hold(self, at: int, size: int, fut: Future) -> None:
        self.held.append((at, at + size, fut))
