"""The pool's allocator: a slot of a size class, from an open slab, a new slab, a grown segment,
or by eviction (tierd.pool.evict plans it whole before anything goes; tierd.pool.policy orders
the victims and can be replaced). What eviction took is kept for whoever reads it back
(``keep_evicted``); nothing is called on eviction.

A part of :class:`tierd.pool.pool.Pool` (its state lives there); the lock held.
"""

from __future__ import annotations

import operator

from tierd.pool import evict
from tierd.pool.index import Obj
from tierd.pool.segments import order_of
from tierd.pool.slabs import SLAB_SLOTS, SizeClass

ROOM_WORK = 1 << 15  # slabs and objects one ``Pool.room`` looks at, at most (a few ms)


class Allocation:
    """Slots: taken, evicted for, measured (a part of Pool)."""

    def init_allocation(self) -> None:
        self._evicted: list[Obj] | None = None  # what eviction took, once kept (``keep_evicted``)

    def keep_evicted(self, keep: bool = True) -> None:
        """From now on (until ``keep`` False) the objects eviction takes are kept for ``take_evicted``
        (the second tier reads them: tierd.tier2.spill). Main loop only."""
        self._evicted = [] if keep else None

    def take_evicted(self) -> list[Obj]:
        """The objects eviction took since the last call (their slots may be reused already: read
        only their identity and metadata). Main loop only."""
        out = self._evicted
        if not out:
            return []
        self._evicted = []
        return out

    def room(self) -> tuple[int, int]:
        """(without evicting, evicting too): the largest object of a size not stored yet that a
        STORE can place now, in bytes, a power of two or 0. Without evicting: in a free block, an
        empty slab's block or a segment the ceiling lets grow. Evicting too: also in an aligned
        window of a new slab's size whose objects are all unpinned (tierd.pool.evict empties
        one); a lower bound past ROOM_WORK slabs and objects looked at. Objects of a size stored
        already may also fit in free slots of their class, or in place of its least recent one.
        The lock held."""
        segs, slabs = self.segments, self.slabs
        free = max([segs.free_order(), *(slab.order for slab in slabs.empty)])
        without = 1 << free if free >= 0 else 0
        clean = slabs.clean_order(_PINS, ROOM_WORK)
        if clean < 0:
            return without, without
        # the largest object whose class's new slab fits the window: the window itself (a slab of
        # one slot), a whole segment's block, or the window's share of SLAB_SLOTS slots
        top = order_of(segs.segment_bytes + 1) - 1
        ks = (clean, min(top, clean), clean - order_of(SLAB_SLOTS))
        sizes = [1 << k for k in ks if k >= order_of(segs.align)]
        fits = [n for n in sizes if slabs.class_order(n) <= clean]
        return without, max([without, *fits])

    def _alloc(self, cls: SizeClass, ns: bytes, replace: Obj | None = None):
        """A slot of ``cls`` for an object of ``ns`` (replacing ``replace``), or None; evicts only
        once the whole plan is known to succeed (tierd.pool.evict)."""
        if not self.ns_quota_bytes and cls.open_slabs:  # the common case: a slab of the class has room
            got = cls.take()
            if got is not None:
                return got
        over = 0
        if self.ns_quota_bytes:
            held = self.per_ns_bytes.get(ns, 0) - (replace.slab.cls.slot_bytes if replace is not None else 0)
            over = held + cls.slot_bytes - self.ns_quota_bytes
            if cls.slot_bytes > self.ns_quota_bytes:
                return None
        for _ in range(2):  # twice: growing can fail (a full pool folder), then it is not tried again
            plan = evict.plan(self, cls, ns if over > 0 else None)
            if plan is None:
                return None
            extra = []
            if over > 0:  # the namespace pays for its new object with its own least recent ones
                left = over - sum(o.slab.cls.slot_bytes for o in plan.victims)
                if left > 0:
                    extra = evict.quota_victims(self, ns, left, set(plan.victims))
                    if extra is None:
                        return None
            for obj in plan.victims:
                self._evict(obj)
            if plan.window is not None:
                for slab in plan.slabs:
                    self.slabs.release_slab(slab)
                self.slabs.carve_at(cls, *plan.window)
            got = self.slabs.alloc(cls)
            if got is None:
                assert not plan.victims and self.segments.grow_error is not None, "a plan failed"
                continue
            for obj in extra:
                self._evict(obj)
            return got
        return None

    def _evict(self, obj: Obj) -> None:
        self.evictions += 1
        self.evicted_bytes += obj.nbytes
        if self._evicted is not None:
            self._evicted.append(obj)
        if obj.ready:
            self.evlog.gone(obj.ns, obj.key)
            self.policy.evicted(obj, self._tick, self.objects)
        self._drop(obj)


_PINS = operator.attrgetter("pins")  # an object's pins: true while it is pinned
