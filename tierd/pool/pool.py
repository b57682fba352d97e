"""The host pool: segments + slab allocator + object index + synchronous LRU eviction.

Only the daemon's main loop calls into the pool (transfer threads touch object bytes, never
metadata), and the HTTP thread reads counters under ``lock``. Eviction order is per size class
LRU; callers touch a prefix tail-first so its head is the most recent and survives longest.
Objects with pins (being written, leased, being read) are never evicted.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from tierd.pool.index import Index, Obj
from tierd.pool.segments import Pinner, SegmentSet
from tierd.pool.slabs import SlabAllocator, SizeClass
from tierd.protocol.layout import GroupSpec


class Exists:
    """Marker returned by ``begin_write`` when the object is already stored or being stored."""


EXISTS = Exists()


class Pool:
    def __init__(self, ceiling: int, initial: int, align: int, segment_bytes: int = 1 << 30, pinner: Pinner | None = None):
        self.lock = threading.Lock()
        self.segments = SegmentSet(ceiling, initial, min(segment_bytes, ceiling), align, pinner)
        self.slabs = SlabAllocator(self.segments)
        self.index = Index()
        self.lru: dict[SizeClass, OrderedDict[Obj, None]] = {}
        self._tick = 0
        self.objects = 0
        self.used_bytes = 0
        self.per_group: Counter[str] = Counter()
        self.per_ns: Counter[bytes] = Counter()
        self._spans: dict[tuple, dict[int, tuple[int, int]]] = {}  # objects per namespace id
        self.evictions = 0
        self.evicted_bytes = 0

    # ---- writing -------------------------------------------------------------------------
    def begin_write(self, ns: bytes, key: bytes, span: dict[int, tuple[int, int]], rank: int, nbytes: int, mask: int, label: str):
        """Reserve room for an object. Returns the (pinned, unready) Obj, EXISTS, or None when
        nothing evictable frees enough room."""
        with self.lock:
            replace = None
            entry = self.index.get(ns, key)
            if entry is not None:
                old = {entry[(g, rank)] for g in span if (g, rank) in entry}
                if old:
                    prev = next(iter(old)) if len(old) == 1 else None
                    if (prev is None or not prev.ready or prev.pins or prev.span != span
                            or mask & prev.mask != prev.mask or mask == prev.mask):
                        return EXISTS  # stored or being stored; or the new copy would lose blocks
                    replace = prev  # the new copy holds every block the old one had, and more
            cls = self.slabs.size_class(nbytes)
            if replace is not None:
                replace.pins += 1  # not its own eviction victim
            got = self._alloc(cls)
            if replace is not None:
                replace.pins -= 1
                if got is not None:
                    self._drop(replace)
            if got is None:
                return None
            span = self._spans.setdefault(tuple(span.items()), span)  # one dict per layout, shared
            obj = Obj(ns, key, span, rank, nbytes, mask, label)
            obj.slab, obj.slot = got
            obj.slab.owners[obj.slot] = obj
            self.index.insert(obj)
            self.objects += 1
            self.used_bytes += cls.slot_bytes
            self.per_group[label] += 1
            self.per_ns[ns] += 1
            return obj

    def commit(self, objs: Sequence[Obj]) -> None:
        """Make written objects visible; the last one given ends up least recent."""
        with self.lock:
            for obj in reversed(objs):
                assert not obj.ready and obj.pins > 0
                obj.ready = True
                obj.pins -= 1
                self._touch(obj)

    def abort(self, objs: Iterable[Obj]) -> None:
        with self.lock:
            for obj in objs:
                assert not obj.ready
                self._drop(obj)

    # ---- reading -------------------------------------------------------------------------
    def lookup(self, ns: bytes, keys: Sequence[bytes], specs: Sequence[GroupSpec], chunk_tokens: int, ranks: Sequence[int]):
        with self.lock:
            hit, objs = self.index.lookup(ns, keys, specs, chunk_tokens, ranks)
            self._touch_prefix(objs)
            return hit, objs

    def touch(self, ns: bytes, keys: Sequence[bytes]) -> None:
        """Mark a prefix's chunks used, tail first, so the head is the most recent."""
        with self.lock:
            objs = []
            for key in keys:
                entry = self.index.get(ns, key)
                if entry is not None:
                    objs.extend(o for o in entry.values() if o.ready)
            self._touch_prefix(objs)

    def find_ready(self, ns: bytes, key: bytes, group: int, rank: int) -> Obj | None:
        with self.lock:
            obj = self.index.find(ns, key, group, rank)
            return obj if obj is not None and obj.ready else None

    def pin(self, objs: Iterable[Obj]) -> None:
        with self.lock:
            for obj in objs:
                obj.pins += 1

    def unpin(self, objs: Iterable[Obj]) -> None:
        with self.lock:
            for obj in objs:
                obj.pins -= 1
                assert obj.pins >= 0

    # ---- housekeeping --------------------------------------------------------------------
    def clear(self) -> int:
        """Evict every object that is not pinned; returns how many went."""
        with self.lock:
            victims = [o for lru in self.lru.values() for o in lru if o.pins == 0]
            for obj in victims:
                self._drop(obj)
            return len(victims)

    def close(self) -> None:
        with self.lock:
            self.segments.close()

    @property
    def backed_bytes(self) -> int:
        return self.segments.backed

    @property
    def configured_bytes(self) -> int:
        return self.segments.ceiling

    # ---- internals (lock held) -------------------------------------------------------------
    def _touch(self, obj: Obj) -> None:
        self._tick += 1
        obj.tick = self._tick
        lru = self.lru.setdefault(obj.slab.cls, OrderedDict())
        lru[obj] = None
        lru.move_to_end(obj)

    def _touch_prefix(self, objs: Sequence[Obj]) -> None:
        """Touch ready objects tail first: the first one ends up most recent."""
        tick, lrus = self._tick, self.lru
        for obj in reversed(objs):
            tick += 1
            obj.tick = tick
            lrus[obj.slab.cls].move_to_end(obj)  # a ready object is always in its class's LRU
        self._tick = tick

    def _alloc(self, cls: SizeClass):
        got = self.slabs.alloc(cls)
        if got is not None:
            return got
        victim = self._lru_victim(cls)
        if victim is not None:
            self._evict(victim)
            return cls.take()
        if self._reclaim_slab(cls):
            return self.slabs.alloc(cls)
        return None

    def _lru_victim(self, cls: SizeClass) -> Obj | None:
        for obj in self.lru.get(cls, ()):
            if obj.pins == 0:
                return obj
        return None

    def _reclaim_slab(self, cls: SizeClass) -> bool:
        """Free a whole slab of another class (empty ones first, then the least recently used
        slab whose objects are all unpinned) until a slab of ``cls`` fits."""
        while True:
            best, best_age = None, None
            for other in self.slabs.classes.values():
                if other is cls:
                    continue
                for slab in other.slabs:
                    live = [o for o in slab.owners if o is not None]
                    if any(o.pins for o in live):
                        continue
                    age = max((o.tick for o in live), default=-1)
                    if best is None or age < best_age:
                        best, best_age = slab, age
            if best is None:
                return False
            for obj in [o for o in best.owners if o is not None]:
                self._evict(obj)
            self.slabs.release_slab(best)
            if self.slabs.add_slab(cls) is not None:
                return True

    def _evict(self, obj: Obj) -> None:
        self.evictions += 1
        self.evicted_bytes += obj.nbytes
        self._drop(obj)

    def _drop(self, obj: Obj) -> None:
        self.index.remove(obj)
        lru = self.lru.get(obj.slab.cls)
        if lru is not None:
            lru.pop(obj, None)
        obj.slab.owners[obj.slot] = None
        obj.slab.cls.give(obj.slab, obj.slot)
        self.objects -= 1
        self.used_bytes -= obj.slab.cls.slot_bytes
        self.per_group[obj.label] -= 1
        if not self.per_group[obj.label]:
            del self.per_group[obj.label]
        self.per_ns[obj.ns] -= 1
        if not self.per_ns[obj.ns]:
            del self.per_ns[obj.ns]
        obj.ready = False
