"""The host pool: segments + slab allocator + object index + synchronous LRU eviction.

Only the daemon's main loop calls into the pool (transfer threads touch object bytes, never
metadata), and the HTTP thread reads counters under ``lock``. Eviction order is per size class
LRU; callers touch a prefix tail-first so its head is the most recent and survives longest.
Objects with pins (being written, leased, being read) are never evicted. What an allocation
evicts is decided in full before anything is (tierd.pool.evict): a store that cannot fit is
rejected with nothing evicted, and memory moves between size classes a small slab at a time.
With ``ns_quota_bytes`` a namespace holds at most that many bytes: at its quota it makes room by
evicting its own least recently used objects, never another namespace's.

Every chunk that stops being servable from the pool (a committed object evicted or CLEARed, or
a write that replaced an object discarded) is recorded in ``evlog`` (tierd.pool.evlog) for
EVICTED; an object replaced by a fuller copy that commits is not.

With ``pool_dir`` the segments are files that outlive the process (tierd.pool.persist): every
change that a restart could serve is journaled before it can matter, and ``save`` writes the
index at a planned stop. ``warm_restart`` says what the start recovered, or why it was cold.
A caller commits an object only once every byte of it is in the pool (as without pool_dir);
at a planned stop it waits for its copies, then calls ``save(extra)``, then ``close()``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from tierd.pool import policy
from tierd.pool.alloc import Allocation
from tierd.pool.evlog import EvictionLog
from tierd.pool.index import Index, Obj, Span
from tierd.pool.persist import KEEP, Persist
from tierd.pool.recency import Recency
from tierd.pool.segments import Pinner, Region, SegmentSet
from tierd.pool.slabs import SizeClass, SlabAllocator


class Exists:
    """Marker returned by ``begin_write`` when the object is already stored or being stored."""


EXISTS = Exists()


class Writes:
    """Pool.writes(): begin_write and abort for one plan under one hold of the pool's lock. The
    journal is flushed when the block ends, before any slot it handed out is written (the caller
    hands its objects to a copy only after the block)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: Pool):
        self._pool = pool

    def __enter__(self) -> Writes:
        self._pool.lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._pool._flush()
        finally:
            self._pool.lock.release()

    def begin(self, ns: bytes, key: bytes, span: dict, rank: int, nbytes: int, mask: int, label: str):
        """Pool.begin_write, the lock held."""
        return self._pool._begin_write(ns, key, span, rank, nbytes, mask, label)

    def begin_fresh(self, ns: bytes, keys: Sequence[bytes], start: int, end: int, rank: int, shapes) -> list:
        """The objects of ``keys[start:end]``'s leading run of keys the index does not hold, one
        per shape ``(span, nbytes, mask, label)`` a key: a list per shape, as ``begin`` would have
        made them key by key and shape by shape, but only as far as the open slabs have room (no
        eviction, no namespace quota); [] when not even the first key qualifies."""
        return self._pool._begin_fresh(ns, keys, start, end, rank, shapes)

    def abort(self, objs: Iterable[Obj]) -> None:
        """Pool.abort, the lock held."""
        self._pool._abort(objs)


class Pool(Recency, Allocation):
    def __init__(
        self,
        ceiling: int,
        initial: int,
        align: int,
        segment_bytes: int = 1 << 30,
        pinner: Pinner | None = None,
        pool_dir: str | None = None,
        meta: dict | None = None,
        index_dir: str | None = None,
        ns_quota_bytes: int = 0,
        eviction_log: int = 0,
        grow_bytes: int | None = None,
        eviction_policy: str = policy.DEFAULT,
        grow_ahead: bool = False,
    ):
        """``pool_dir``: a tmpfs/hugetlbfs folder whose files back the pool and let a restart
        recover it; ``meta``: the caller's settings that shape objects (msgpack-able), which a
        restart must find equal; ``index_dir``: a tmpfs folder for the index and journal
        (default ``pool_dir``; required when that is hugetlbfs); ``ns_quota_bytes``: the bytes
        (slots) one namespace may hold, 0 for no quota; ``eviction_log``: the records ``evlog``
        keeps (0: it only counts); ``grow_bytes``: the smallest segment grown on demand, segments
        doubling up to ``segment_bytes`` (default: all equal); ``grow_ahead``: tierd.pool.segments."""
        self.policy = policy.make(eviction_policy)  # eviction order (tierd.pool.policy)
        self.init_recency()
        self.init_allocation()
        self.ns_quota_bytes = ns_quota_bytes
        self.evlog = EvictionLog(eviction_log)
        self._replacing: set[Obj] = set()  # objects being written in place of a committed one
        segment_bytes = min(segment_bytes, ceiling)
        grow = {"grow_bytes": grow_bytes, "ahead": grow_ahead}
        self.persist = (
            None if pool_dir is None else Persist(pool_dir, index_dir, align, segment_bytes, meta, **grow)
        )
        if self.persist is None:
            self.build(SegmentSet(ceiling, initial, segment_bytes, align, pinner, **grow), None)
        else:
            self.persist.open(self, ceiling, initial, pinner)
        self.warm_restart: dict | None = None if self.persist is None else self.persist.report

    def build(self, segments: SegmentSet, model) -> None:
        """Start over on ``segments``: empty, or with a recovered ``model``'s objects (tierd.pool.persist)."""
        self.segments = segments
        self.slabs = SlabAllocator(self.segments)
        self.index = Index()
        self._untouched, self._unobserved, self._touched, self.unsettled = [], [], 0, 0
        self.lru: dict[SizeClass, OrderedDict[Obj, None]] = {}  # the policy's queue per class
        self._tick = 0
        self.objects = 0
        self.used_bytes = 0
        self.per_group: Counter[str] = Counter()
        self.per_ns: Counter[bytes] = Counter()  # objects per namespace id
        self.per_ns_bytes: Counter[bytes] = Counter()  # bytes (slots) per namespace id
        # with a quota: per (namespace, size class), its objects least recent first
        self.nslru: dict[tuple[bytes, SizeClass], OrderedDict[Obj, None]] = {}
        self._spans: dict[tuple, Span] = {}  # one shared span per layout (its items and block counts)
        self._span_seen: dict | None = None  # the span begin_write was last given, and its shared dict
        self._span_shared: dict | None = None
        self.evictions = 0
        self.evicted_bytes = 0
        # the bytes of the largest object ever placed: n objects hold at most n times this (a
        # lease's bound, read without reading the objects; tierd.state.registry)
        self.largest_bytes = 0
        if model is not None:
            self._restore(model)

    def _restore(self, model) -> None:
        """Place recovered objects in their exact slots, least recent first; free the rest."""
        segs = self.segments.segments
        slabs = {k: self.slabs.restore_slab(segs[k[0]], k[1], v[0], v[1]) for k, v in model.slabs.items()}
        self.policy.restore(model.policy)
        top, levels = policy.LEVELS - 1, model.levels
        for where, (ns, key, items, rank, nbytes, mask, label) in model.objects.items():
            obj = Obj(ns, key, self._shared_span(dict(items)), rank, nbytes, mask, label)
            obj.slab, obj.slot, obj.ready, obj.pins = slabs[where[:2]], where[2], True, 0
            obj.hits = min(levels.get(where, 0), top)  # (its level: the reuse policy's)
            self._place(obj)
            self._touch(obj)
        for slab in slabs.values():
            slab.settle()

    # ---- writing -------------------------------------------------------------------------
    def writes(self) -> Writes:
        """``with pool.writes() as w``: ``w.begin``/``w.abort`` as ``begin_write``/``abort``, under
        one hold of the lock and with one flush at the end (a whole STORE plan's allocations)."""
        return Writes(self)

    def begin_write(
        self,
        ns: bytes,
        key: bytes,
        span: dict[int, tuple[int, int]],
        rank: int,
        nbytes: int,
        mask: int,
        label: str,
    ):
        """Reserve room for an object. Returns the (pinned, unready) Obj, EXISTS, or None when
        nothing evictable frees enough room."""
        with self.lock:
            try:
                return self._begin_write(ns, key, span, rank, nbytes, mask, label)
            finally:
                self._flush()  # drops, slabs, segments: on file before the slot is handed out

    def _begin_fresh(self, ns, keys, start: int, end: int, rank: int, shapes) -> list[list[Obj]]:
        if self.ns_quota_bytes:
            return []  # a namespace's bytes are checked object by object (_alloc)
        classes = [self.slabs.size_class(nbytes) for _, nbytes, _, _ in shapes]
        share = {cls: classes.count(cls) for cls in classes}  # shapes of one class take its slots in turn
        m = end - start
        for cls, c in share.items():
            m = min(m, cls.room(m * c) // c)
        space = self.index.spaces.get(ns)
        seen: set[bytes] = set()
        k, end = start, start + m  # (what the slabs have room for bounds the scan)
        while k < end and keys[k] not in seen and (space is None or keys[k] not in space):
            seen.add(keys[k])  # a key twice: the second finds the first (the per-key path)
            k += 1
        m = k - start
        if not m:
            return []
        taken = {cls: cls.take_many(m * c) for cls, c in share.items()}
        made, turn = [], dict.fromkeys(share, 0)
        for (span, nbytes, mask, label), cls in zip(shapes, classes):
            span, c, s = self._shared_span(span), share[cls], turn[cls]
            turn[cls] += 1
            objs = []
            for key, (slab, slot) in zip(keys[start : start + m], taken[cls][s::c]):
                obj = Obj(ns, key, span, rank, nbytes, mask, label, slab, slot)
                slab.owners[slot] = obj
                objs.append(obj)
            made.append(objs)
            self._count(ns, label, nbytes, cls.slot_bytes, m)
        self.index.insert_fresh(ns, rank, made)
        return made

    def _shared_span(self, span: dict) -> Span:
        """The one Span objects of this layout share (a plan passes the same one over and over); a
        plain dict (no block counts: its objects are never whole) becomes a Span."""
        if span is not self._span_seen:
            blocks = span.blocks if type(span) is Span else None
            key = (tuple(span.items()), None if blocks is None else tuple(blocks.items()))
            shared = self._spans.get(key)
            if shared is None:
                shared = self._spans[key] = span if type(span) is Span else Span(span)
            self._span_seen, self._span_shared = span, shared
        return self._span_shared

    def _begin_write(self, ns, key, span, rank, nbytes, mask, label):
        replace = None
        entry = self.index.get(ns, key)
        if entry is not None:
            old = {entry[(g, rank)] for g in span if (g, rank) in entry}
            if old:
                prev = next(iter(old)) if len(old) == 1 else None
                if (
                    prev is None
                    or not prev.ready
                    or prev.pins
                    or prev.span != span
                    or mask & prev.mask != prev.mask
                    or mask == prev.mask
                ):
                    return EXISTS  # stored or being stored; or the new copy would lose blocks
                replace = prev  # the new copy holds every block the old one had, and more
        cls = self.slabs.size_class(nbytes)
        if replace is not None:
            replace.pins += 1  # not its own eviction victim
        try:
            got = self._alloc(cls, ns, replace)
        finally:
            if replace is not None:
                replace.pins -= 1
        if got is None:
            return None
        if replace is not None:
            self._drop(replace)
        span = self._shared_span(span)
        obj = Obj(ns, key, span, rank, nbytes, mask, label)
        obj.slab, obj.slot = got
        self._place(obj)
        if replace is not None:
            self._replacing.add(obj)  # a loss only if this write is discarded
        return obj

    def commit(self, objs: Sequence[Obj]) -> None:
        """Make written objects visible; the last one given ends up least recent."""
        with self.lock:
            evlog, replacing, index = self.evlog, self._replacing, self.index
            for obj in reversed(objs):
                assert not obj.ready and obj.pins > 0
                obj.ready = True
                index.committed(obj)
                obj.pins -= 1
                self._touch(obj)
                evlog.back(obj.ns, obj.key)
                if replacing:
                    replacing.discard(obj)
                if self.persist is not None:
                    self.persist.committed(obj)
            self._flush()  # durable before a reader can see them

    def abort(self, objs: Iterable[Obj]) -> None:
        with self.lock:
            self._abort(objs)
            self._flush()

    def _abort(self, objs: Iterable[Obj]) -> None:
        for obj in objs:
            assert not obj.ready
            if obj in self._replacing:  # the copy it replaced went at begin_write
                self._replacing.discard(obj)
                self.evlog.gone(obj.ns, obj.key)
            self._drop(obj)

    # ---- reading -------------------------------------------------------------------------
    def regions(self) -> list[Region]:
        """Every backed segment, oldest first. Segments are only added, never moved or shrunk,
        until ``close``."""
        with self.lock:
            return [Region(seg.addr, seg.nbytes, seg.fd) for seg in self.segments.segments]

    # ---- housekeeping --------------------------------------------------------------------
    def clear(self, ns: bytes | None = None) -> int:
        """Evict every unpinned object (of namespace ``ns`` only, when given); returns how many."""
        with self.lock:
            victims = [
                o for lru in self.lru.values() for o in lru if o.pins == 0 and (ns is None or o.ns == ns)
            ]
            for obj in victims:
                self.evlog.gone(obj.ns, obj.key)
                self._drop(obj)
            self.policy.forget(ns)
            self._flush()
            return len(victims)

    def save(self, extra=KEEP) -> None:
        """Index every committed object, in LRU order, and a msgpack-able ``extra`` (omitted: the
        last given). Raises OSError when it cannot write (the next start is then cold)."""
        with self.lock:
            if self.persist is None:
                raise ValueError("save() needs a pool_dir")
            self.persist.checkpoint(self, extra)

    def note_extra(self, extra) -> None:
        """Journal a new ``extra`` (e.g. a namespace registered) so a crash restart has it too."""
        with self.lock:
            if self.persist is not None:
                self.persist.noted(extra)
                self._flush()

    @property
    def extra(self):
        """The extra blob recovered at start (or last given), None without one."""
        return None if self.persist is None else self.persist.extra

    def close(self) -> None:
        with self.lock:
            self.segments.close()
            if self.persist is not None:
                self.persist.close()

    @property
    def backed_bytes(self) -> int:
        return self.segments.backed

    @property
    def configured_bytes(self) -> int:
        return self.segments.ceiling

    # ---- internals (lock held) -------------------------------------------------------------
    def _place(self, obj: Obj) -> None:
        obj.slab.owners[obj.slot] = obj
        self.index.insert(obj)
        self._count(obj.ns, obj.label, obj.nbytes, obj.slab.cls.slot_bytes, 1)

    def _count(self, ns: bytes, label: str, nbytes: int, slot_bytes: int, n: int) -> None:
        """``n`` objects of ``nbytes`` in slots of ``slot_bytes`` were placed."""
        if nbytes > self.largest_bytes:
            self.largest_bytes = nbytes
        self.objects += n
        self.used_bytes += n * slot_bytes
        self.per_group[label] += n
        self.per_ns[ns] += n
        self.per_ns_bytes[ns] += n * slot_bytes

    def _flush(self) -> None:
        if self.persist is not None:
            self.persist.flush(self)

    def _drop(self, obj: Obj) -> None:
        if self._untouched:  # (the lock's holder has applied them; code bypassing it has not)
            self._apply_touches()  # before an object they name leaves the LRU
        if obj.ready and self.persist is not None:
            self.persist.dropped(obj)  # flushed before the verb returns, so before the slot's reuse
        self.index.remove(obj)
        lru = self.lru.get(obj.slab.cls)
        if lru is not None:
            self.policy.leave(lru, obj)
        lru = self.nslru.get((obj.ns, obj.slab.cls))
        if lru is not None:
            self.policy.leave(lru, obj)
            if not lru:
                del self.nslru[obj.ns, obj.slab.cls]
        obj.slab.owners[obj.slot] = None
        obj.slab.cls.give(obj.slab, obj.slot)
        self.objects -= 1
        self.used_bytes -= obj.slab.cls.slot_bytes
        self.per_group[obj.label] -= 1
        if not self.per_group[obj.label]:
            del self.per_group[obj.label]
        self.per_ns[obj.ns] -= 1
        self.per_ns_bytes[obj.ns] -= obj.slab.cls.slot_bytes
        if not self.per_ns[obj.ns]:
            del self.per_ns[obj.ns], self.per_ns_bytes[obj.ns]
        obj.ready = False
