"""The eviction log: which chunks stopped being servable from this daemon's memory, for EVICTED.

A bounded ring of records ``(seq, namespace id, chunk key)``, ``seq`` a daemon-wide counter from 1
per process. The pool records a chunk key when one of its committed objects leaves L1 by
eviction (LRU, slab reclaim, a namespace at its quota) or CLEAR, or when a write that replaced
an object by a fuller copy is discarded (the old copy is gone with it). Replacing an object by a
fuller copy that commits is not a loss; neither is discarding a write that replaced nothing.

One record per chunk per loss: a chunk whose objects (groups, ranks) leave one by one is
recorded when the first goes, and again only after an object of it was committed since. Reads
(``since``) cost a bisection plus what they return: each namespace keeps its own records in seq
order, so a namespace's reader never scans another's. When the ring is full its oldest record
falls out; a reader whose cursor is older than a record of its namespace that fell out is told
``missed`` (it may have lost removals). A namespace whose records all fell out is forgotten,
and readers of namespaces without records are told ``missed`` when any record newer than their
cursor fell out: over-reported, never under-reported. Capacity 0 keeps no records: ``seq`` still
counts, and every reader with an older cursor is told ``missed``.

Only the daemon's main loop calls in (under the pool's lock).
"""

from __future__ import annotations

import bisect
from collections import deque

DEFAULT_CAPACITY = 1 << 16
MAX_REPLY_KEYS = 1 << 16  # keys one read returns, whatever it asks


class _Space:
    """One namespace's records in the ring, oldest first (``head`` on)."""

    __slots__ = ("seqs", "keys", "head", "lost")

    def __init__(self, lost: int):
        self.seqs: list[int] = []
        self.keys: list[bytes] = []
        self.head = 0
        self.lost = lost  # the newest seq of this namespace's records that fell out (or older: see forgot)

    def __len__(self) -> int:
        return len(self.seqs) - self.head


class EvictionLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.seq = 0  # the last seq given
        self.dropped = 0  # records that fell out of the ring
        self.forgot = 0  # the newest seq of a namespace forgotten with all its records
        self._order: deque[bytes] = deque()  # namespace id of each record in the ring, oldest first
        self._spaces: dict[bytes, _Space] = {}
        self._open: dict[tuple[bytes, bytes], int] = {}  # (ns, key) -> its record's seq, no commit since

    def __len__(self) -> int:
        return len(self._order)

    @property
    def oldest(self) -> int:
        """The seq of the oldest record held, or seq + 1 when none is."""
        return self.seq + 1 - len(self._order)

    # ---- writing (the pool) ---------------------------------------------------------------------
    def gone(self, ns: bytes, key: bytes) -> None:
        """A committed object of chunk ``key`` of namespace ``ns`` left the pool."""
        k = (ns, key)
        if k in self._open:
            return  # already recorded and nothing of it committed since
        self.seq += 1
        space = self._spaces.get(ns)
        if space is None:
            space = self._spaces[ns] = _Space(self.forgot)
        space.seqs.append(self.seq)
        space.keys.append(key)
        self._order.append(ns)
        self._open[k] = self.seq
        while len(self._order) > self.capacity:
            self._fall_out()

    def back(self, ns: bytes, key: bytes) -> None:
        """An object of chunk ``key`` was committed: its next loss is recorded again."""
        if self._open:
            self._open.pop((ns, key), None)

    # ---- reading (EVICTED) ----------------------------------------------------------------------
    def since(self, ns: bytes, since: int, limit: int) -> tuple[int, list[bytes], bool]:
        """``(cursor, keys, missed)``: the chunk keys of ``ns`` recorded after seq ``since``, oldest
        first, each once, at most ``limit``; ``cursor`` is the seq of the last one returned, or the
        current seq when nothing more of ``ns`` is held; ``missed`` when a record of ``ns`` (or,
        for a namespace with none held, any record) newer than ``since`` fell out."""
        limit = max(1, min(limit, MAX_REPLY_KEYS))
        space = self._spaces.get(ns)
        if space is None:
            return self.seq, [], since < self.forgot
        missed = since < space.lost
        seqs, keys = space.seqs, space.keys
        i = bisect.bisect_right(seqs, since, space.head)
        end = len(seqs)
        out: list[bytes] = []
        seen: set[bytes] = set()
        while i < end and len(out) < limit:
            key = keys[i]
            if key not in seen:
                seen.add(key)
                out.append(key)
            i += 1
        cursor = self.seq if i == end else seqs[i - 1]
        return cursor, out, missed

    # ---- internals ------------------------------------------------------------------------------
    def _fall_out(self) -> None:
        ns = self._order.popleft()
        space = self._spaces[ns]
        seq, key = space.seqs[space.head], space.keys[space.head]
        space.head += 1
        space.lost = seq
        self.dropped += 1
        if self._open.get((ns, key)) == seq:
            del self._open[ns, key]
        if not len(space):
            del self._spaces[ns]
            self.forgot = max(self.forgot, seq)
        elif space.head >= 64 and 2 * space.head >= len(space.seqs):
            del space.seqs[: space.head], space.keys[: space.head]
            space.head = 0
