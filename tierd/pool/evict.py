"""Eviction: what one allocation evicts, decided in full before anything is evicted.

Hazard: eviction cannot be undone. Evicting first and finding out afterwards that the object
still does not fit wiped the cache for nothing (a 128 MiB object into a 64 MiB pool evicted all
3000 others, then was rejected), and moving memory between size classes a 64 MiB slab at a time
made one 8 KiB store evict 16,384 objects of 4 KiB. So ``plan`` returns every victim, or None,
and only then does the pool evict (``Pool._alloc``).

For a slot of class C, in order (each evicts no more than it must):
1. a free slot of C; else a new slab of C from free or growable memory (smaller near the
   ceiling), other classes' empty slabs given back first: nothing evicted;
2. C's first unpinned object in the policy's order (tierd.pool.policy: least recently used
   first, or by each object's eviction key); unless another class's first object comes before
   it: then the aligned window of C's slab size around that one (tierd.pool.slabs), if every
   object in it is unpinned and would go before C's victim, so memory follows use between
   classes;
3. with no victim in C (a new class, or all of it pinned): the window around one of the
   first objects of other classes, in the policy's order, whose objects are all unpinned.
A window's objects number at most window / their slot size: a small constant times the
allocation's size over theirs. With ``only`` (a namespace at its byte quota) every victim is
that namespace's. The searches are bounded (PASS pinned objects per class's LRU, each moved to
its end; SCAN per search of other classes' windows; WINDOWS windows); when they find nothing
the allocation fails with nothing evicted. "Colder" below means earlier in that order: a smaller
``pool.policy.key``.
"""

from __future__ import annotations

from collections.abc import Iterator

from tierd.pool import policy as policies
from tierd.pool.index import Obj
from tierd.pool.slabs import SizeClass, Slab

SCAN = 1024  # pinned objects skipped in one search of the coldest windows before giving up
PASS = 8 * SCAN  # pinned objects one search of a class's LRU passes (and moves behind) at most
WINDOWS = 64  # windows tried for a class with nothing of its own to evict...
WORK = 1 << 16  # ...and slabs plus objects looked at in them, at most


class Plan:
    """The victims of one allocation; with ``window`` (segment, offset, order), the slabs to
    give back after them and where the new slab goes."""

    __slots__ = ("victims", "slabs", "window")

    def __init__(self, victims: list[Obj], slabs: list[Slab] = (), window=None):
        self.victims, self.slabs, self.window = victims, list(slabs), window


FREE = Plan([])


def plan(pool, cls: SizeClass, only: bytes | None = None) -> Plan | None:
    """How ``pool`` makes room for one slot of ``cls`` (victims only of namespace ``only`` when
    given), or None when it cannot; nothing is evicted here."""
    slabs = pool.slabs
    if not slabs.fits(cls):
        return None  # larger than any segment the ceiling allows: evicting cannot help
    if cls.open_slabs or slabs.can_carve(cls):  # every slab in open_slabs has a free slot
        return FREE
    victim = _first_unpinned(pool, cls, only)
    if victim is not None and len(slabs.classes) == 1:
        return Plan([victim])  # no other class to take memory from
    coldest = _coldest_windows(pool, cls, only)
    if victim is not None:  # rebalance: a colder window of another class, tried once
        key = pool.policy.key
        below = key(victim)
        for anchor, window in coldest:
            if key(anchor) < below:
                got = _window_plan(slabs, window, only, key, below=below)
                if got is not None:
                    return got
            break
        return Plan([victim])
    work = [WORK]
    for i, (_, window) in enumerate(coldest):
        if i >= WINDOWS or work[0] <= 0:
            break
        got = _window_plan(slabs, window, only, pool.policy.key, work=work)
        if got is not None:
            return got
    return None


def quota_victims(pool, ns: bytes, nbytes: int, spare: set) -> list[Obj] | None:
    """``ns``'s first unpinned objects in the policy's order (not in ``spare``) whose slots add up
    to ``nbytes``, or None when it does not hold that many evictable bytes."""
    out, freed = [], 0
    queues = [q for (n, _), q in pool.nslru.items() if n == ns]
    for o in _unpinned(policies.merged(pool.policy, queues)):
        if freed >= nbytes:
            break
        if o not in spare:
            out.append(o)
            freed += o.slab.cls.slot_bytes
    return out if freed >= nbytes else None


# ---- internals -----------------------------------------------------------------------------
def _queue(pool, cls: SizeClass, only: bytes | None):
    return pool.lru.get(cls) if only is None else pool.nslru.get((only, cls))


def _first_unpinned(pool, cls: SizeClass, only: bytes | None) -> Obj | None:
    """The first unpinned object of ``cls`` in the policy's order. The pinned ones passed on the
    way (leased or being read: in use) are touched, so no later search passes them again while
    they stay pinned: each pin costs one pass at most, whatever the number of stores (a cap on the
    pass instead let leases on a class's coldest objects starve every later store of the class)."""
    q = _queue(pool, cls, only)
    first = None if q is None else pool.policy.first(q)
    if first is None or not first.pins:
        return first
    passed = []
    found = None
    for o in pool.policy.victims(q):
        if not o.pins:
            found = o
            break
        passed.append(o)
        if len(passed) >= PASS:  # a class pinned through: bounded, and the next search starts past these
            break
    if passed:
        pool.touch_objects(passed, hit=False)
    return found


def _unpinned(objs) -> Iterator[Obj]:
    skipped = 0
    for o in objs:
        if not o.pins:
            yield o
        else:
            skipped += 1
            if skipped > SCAN:
                return


def _coldest_windows(pool, cls: SizeClass, only: bytes | None) -> Iterator[tuple[Obj, tuple]]:
    """(anchor, window) for the coldest unpinned objects of other classes, each window once."""
    queues = [_queue(pool, c, only) for c in pool.slabs.classes.values() if c is not cls]
    seen = set()
    for anchor in _unpinned(policies.merged(pool.policy, [q for q in queues if q])):
        slab = anchor.slab
        if slab.order >= cls.order:  # a slab at least as large: all of it
            window = (slab.segment, slab.offset, cls.order)
        else:
            window = (slab.segment, slab.offset & -(1 << cls.order), cls.order)
            if window[1] + (1 << cls.order) > slab.segment.nbytes:
                continue  # past the end of a segment that is not a power of two
        if (window[0].index, window[1]) not in seen:
            seen.add((window[0].index, window[1]))
            yield anchor, window


def _window_plan(
    slabs, window: tuple, only: bytes | None, key, below: float | None = None, work: list[int] | None = None
) -> Plan | None:
    """Every object of the slabs inside ``window``, if all may go: unpinned, of ``only`` when
    given, and colder than ``below`` (their ``key`` smaller) when given. ``work``: a budget, spent
    on what is seen."""
    seg, off, order = window
    inside = slabs.slabs_in(seg, off, order)
    victims = []
    for slab in inside:
        for o in slab.owners:
            if o is None:
                continue
            if o.pins or (only is not None and o.ns != only) or (below is not None and key(o) >= below):
                if work is not None:
                    work[0] -= len(inside) + len(victims)
                return None
            victims.append(o)
    if len(inside) == 1 and inside[0].order > order:
        off = inside[0].offset  # the new slab goes at the start of the larger one's block
    return Plan(victims, inside, (seg, off, order))
