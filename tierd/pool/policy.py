"""Eviction order: which committed object of a size class goes first, and at what level a new
object enters. The pool keeps one queue per size class (and per namespace and class under a
quota); a policy decides what a queue is, how a touch reorders it, and each object's eviction
``key``: the smaller goes first, comparable across classes (tierd.pool.evict merges by it).

Hazard: an eviction order that lets a prefix's tail outlive its head keeps bytes no lookup can
reach (a hit stops at the first missing chunk). Both policies order by ``tick``, which callers
advance tail first (the head of a prefix ends up the most recent), and ``reuse`` only ever gives
an object found more often a later key: a lookup finds a head every time it finds its tail.

- ``lru``: least recently used first (one OrderedDict per queue, as the pool always did).
- ``reuse`` (the default): LRU in which an object LOOKUPs found before lives longer. Its level
  is how often they found it (0, 1, 2, 3 or more; an object stored again while the pool still
  remembers evicting its key resumes that count, plus one: that store is its key's next use).
  Its key is its tick plus ``bonus[level]`` = s * B * (0, 1, 1.5, 2): B is the reuse distance
  (in ticks) that 3/4 of recent reuses fell under (a LOOKUP's hit, or the store of a key the
  pool remembers evicting), and s (1/16..2, starting at 1) follows what eviction got wrong:
  the keys of evicted chunks are remembered (``GHOST_PER_OBJECT`` per object held), and s grows
  while the chunks evicted from higher levels are stored again more often than those evicted
  from level 0, and shrinks in the other case. Without reuse (B = 0) it is LRU.
  A guard (tierd.pool.shadow) keeps it from losing to LRU where frequency misleads: an LRU
  shadow on a sample of the keys LOOKUPs name halves the bonus while plain LRU would hit more.
  On Mooncake's conversation trace (``tierd replay``) it keeps 0.50 of what an infinite pool
  would hit at 3M tokens, where LRU keeps 0.37 (README, "Size a pool").

Each queue of ``reuse`` is one OrderedDict per level, each in tick order, so a touch stays O(1)
and a victim is the smallest key among a few heads. Eviction stays synchronous and bounded.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from tierd.pool.index import Obj
from tierd.pool.shadow import GATE_MIN, Shadow

POLICIES = ("reuse", "lru")
DEFAULT = "reuse"

LEVELS = 4  # reuse: objects found 0, 1, 2 and 3+ times
SHAPE = (0.0, 1.0, 1.5, 2.0)  # reuse: each level's bonus, in units of s * B
QUANTILE = 0.75  # reuse: B covers this share of the reuse distances measured
PERIOD = 4096  # reuse: distances measured (weighted by objects) between two estimates
HISTORY = 8  # reuse: B is the mean of the last this-many estimates; outcomes decay as much
STEP = 0.5  # reuse: s moves by at most exp(STEP * 1) per estimate
S_RANGE = (1 / 16, 2.0)
GHOST_PER_OBJECT = 6  # reuse: evicted keys remembered per object held (at least GHOST_MIN)
GHOST_MIN = 1024


def _tick(o: Obj) -> int:
    return o.tick


def make(name: str):
    """The policy called ``name`` (one of POLICIES)."""
    if name == "lru":
        return LRU()
    if name == "reuse":
        return Reuse()
    raise ValueError(f"eviction policy must be one of {', '.join(POLICIES)}, got {name!r}")


class LRU:
    """Least recently used first."""

    name = "lru"

    def __init__(self):
        self.reasons = {"lru": 0}  # evictions by reason

    def queue(self) -> OrderedDict:
        return OrderedDict()

    def key(self, obj: Obj) -> float:
        return obj.tick

    def first(self, q: OrderedDict) -> Obj | None:
        """The object ``q`` gives up first, pinned or not."""
        return next(iter(q), None)

    def victims(self, q: OrderedDict) -> Iterator[Obj]:
        """``q``'s objects in eviction order."""
        return iter(q)

    def enter(self, q: OrderedDict, obj: Obj) -> None:
        """A committed object joins its class's queue as the most recent."""
        q[obj] = None
        q.move_to_end(obj)

    def join(self, q: OrderedDict, obj: Obj) -> None:
        """...and its namespace's queue, after ``enter``."""
        q[obj] = None
        q.move_to_end(obj)

    def leave(self, q: OrderedDict, obj: Obj) -> None:
        q.pop(obj, None)

    def touch(self, lrus: dict, objs: Sequence[Obj], tick: int, hit: bool, weight: int | None = None) -> int:
        """Touch ready objects (all in ``lrus``, their class's queues) tail first: the first ends up
        most recent. ``hit``: a LOOKUP found them. ``weight``: how many objects the LOOKUP's reuse
        distance counts for (``Reuse``; default ``len(objs)``, 0 for the later parts of one LOOKUP
        touched in parts, tail first). Returns the last tick given."""
        if not objs:
            return tick
        move = lrus[objs[-1].slab.cls].move_to_end  # a ready object is always in its class's LRU
        for obj in reversed(objs):
            tick += 1
            obj.tick = tick
            try:  # a prefix's objects are mostly of one class: its queue is asked first
                move(obj)
            except KeyError:
                move = lrus[obj.slab.cls].move_to_end
                move(obj)
        return tick

    def retouch(self, qs: dict, objs: Sequence[Obj]) -> None:
        """``touch``'s order for the per-namespace queues ``qs`` ((ns, class) -> queue)."""
        for obj in reversed(objs):
            qs[obj.ns, obj.slab.cls].move_to_end(obj)

    def evicted(self, obj: Obj, now: int, held: int) -> None:
        """Count an eviction (the lock held; ``now``: the pool's tick, ``held``: its objects)."""
        self.reasons["lru"] += 1

    def forget(self, ns: bytes | None) -> None:
        """A CLEAR dropped namespace ``ns``'s objects (None: every namespace's). The lock held."""

    def state(self) -> dict:
        """What a warm restart keeps of what the policy learned (tierd.pool.persist)."""
        return {"name": self.name}

    def restore(self, state: dict | None) -> None:
        """Take ``state`` back (another policy's, or none: nothing to take)."""

    def status(self) -> dict:
        return {"name": self.name, "evictions_by_reason": dict(self.reasons)}


class Levels:
    """A ``reuse`` queue: one OrderedDict per level, each least recent first. Iterating it gives
    its objects least recent first (the order a restart replays)."""

    __slots__ = ("q",)

    def __init__(self):
        self.q = [OrderedDict() for _ in range(LEVELS)]

    def __iter__(self) -> Iterator[Obj]:
        live = [q for q in self.q if q]
        return iter(live[0]) if len(live) == 1 else heapq.merge(*live, key=_tick)

    def __len__(self) -> int:
        return sum(map(len, self.q))

    def __bool__(self) -> bool:
        return any(self.q)

    def __contains__(self, obj) -> bool:
        return any(obj in q for q in self.q)


class Reuse:
    """LRU with a bonus for objects LOOKUPs found before (module docstring)."""

    name = "reuse"

    def __init__(self):
        self.reasons = {"unused": 0, "aged": 0, "displaced": 0}  # evictions by reason
        self.bonus = [0] * LEVELS
        self.B = 0.0  # the reuse distance estimate (ticks)
        self.s = 1.0
        self.estimates: list[float] = []
        self.samples: list[tuple[int, int]] = []  # (distance, objects) since the last estimate
        self.weight = 0
        # evicted chunks: key -> [namespace, level, tick of its last use, stored again since]
        self.ghost: OrderedDict[bytes, list] = OrderedDict()
        self.ghost_max = GHOST_MIN
        # evicted chunks by level 0 / higher, decayed: [stored again while remembered, evicted]
        self.outcomes = [[0.0, 0.0], [0.0, 0.0]]
        self.guard = Shadow()  # its gate: the share of the bonus kept (tierd.pool.shadow)

    # ---- queues --------------------------------------------------------------------------
    def queue(self) -> Levels:
        return Levels()

    def key(self, obj: Obj) -> float:
        return obj.tick + self.bonus[obj.hits]

    def first(self, q: Levels) -> Obj | None:
        best = key = None
        for lq, bonus in zip(q.q, self.bonus):
            if lq:
                o = next(iter(lq))
                k = o.tick + bonus
                if best is None or k < key:
                    best, key = o, k
        return best

    def victims(self, q: Levels) -> Iterator[Obj]:
        live = [lq for lq in q.q if lq]
        if len(live) == 1:
            return iter(live[0])
        return heapq.merge(*live, key=self.key)

    def enter(self, q: Levels, obj: Obj) -> None:
        """(A committed object is in no queue yet: appending it makes it the most recent.)"""
        if self.ghost:
            g = self.ghost.get(obj.key)
            if g is not None and g[0] == obj.ns:
                self._recall(obj, g)
        q.q[obj.hits][obj] = None

    def join(self, q: Levels, obj: Obj) -> None:
        q.q[obj.hits][obj] = None

    def leave(self, q: Levels, obj: Obj) -> None:
        q.q[obj.hits].pop(obj, None)

    def touch(self, lrus: dict, objs: Sequence[Obj], tick: int, hit: bool, weight: int | None = None) -> int:
        if not objs:
            return tick
        top = LEVELS - 1
        if hit and weight != 0:  # the distance of the deepest object found, for every object of the hit
            self._sample(tick + 1 - objs[-1].tick, len(objs) if weight is None else weight)
        cls = qs = None
        if not hit:
            for obj in reversed(objs):
                tick += 1
                obj.tick = tick
                if obj.slab.cls is not cls:
                    cls = obj.slab.cls
                    qs = lrus[cls].q
                qs[obj.hits].move_to_end(obj)
            return tick
        cls = objs[-1].slab.cls
        qs = lrus[cls].q
        mtop = qs[top].move_to_end
        for obj in reversed(objs):
            tick += 1
            obj.tick = tick
            try:  # a prefix found again and again is at the top level of its class: one call
                mtop(obj)
                continue
            except KeyError:
                pass
            if obj.slab.cls is not cls:  # another class (a prefix's objects are mostly of one)
                cls = obj.slab.cls
                qs = lrus[cls].q
                mtop = qs[top].move_to_end
                if obj in qs[top]:
                    mtop(obj)
                    continue
            h = obj.hits  # below the top level: one level up
            del qs[h][obj]
            obj.hits = h + 1
            qs[h + 1][obj] = None
        return tick

    def retouch(self, qs: dict, objs: Sequence[Obj]) -> None:
        """After ``touch``: the same objects, levels already set, in the per-namespace queues."""
        for obj in reversed(objs):
            q = qs[obj.ns, obj.slab.cls].q
            lq = q[obj.hits]
            if obj in lq:
                lq.move_to_end(obj)
            else:  # promoted by this touch
                q[obj.hits - 1].pop(obj, None)
                lq[obj] = None

    def evicted(self, obj: Obj, now: int, held: int) -> None:
        """Count the eviction's reason and remember the key (``LRU.evicted``)."""
        self.guard.full = True
        level = obj.hits
        if level == 0:
            reason = "unused"
        elif obj.tick + self.bonus[level] <= now:
            reason = "aged"
        else:
            reason = "displaced"  # nothing colder could go (pinned, quota, other class)
        self.reasons[reason] += 1
        ghost = self.ghost
        k = obj.key
        g = ghost.get(k)
        if g is None:  # the usual case: a key not remembered yet
            ghost[k] = [obj.ns, level, obj.tick, False]
            self.outcomes[level > 0][1] += 1
            if len(ghost) > self.ghost_max:
                self.ghost_max = max(self.ghost_max, GHOST_PER_OBJECT * held)  # grows with the pool
                while len(ghost) > self.ghost_max:
                    ghost.popitem(last=False)
        elif not g[3] and g[0] == obj.ns:  # another object of the chunk: once
            g[1], g[2] = max(g[1], level), obj.tick
            ghost.move_to_end(k)
        else:  # evicted again after it came back (or the key of another namespace)
            self.outcomes[level > 0][1] += 1
            g[0], g[1], g[2], g[3] = obj.ns, level, obj.tick, False
            ghost.move_to_end(k)

    def forget(self, ns: bytes | None) -> None:
        """``LRU.forget``: the guard's shadow lets go of those keys too."""
        self.guard.forget(ns)

    def observe(self, ns: bytes, keys: Sequence[bytes], hit: int, held: int) -> None:
        """A LOOKUP of ``keys`` found the first ``hit`` (the pool holds ``held`` keys now): the
        guard's LRU shadow sees it (tierd.pool.shadow). The pool's lock held."""
        self._guarded(self.guard.observe, ns, keys, hit, held)

    def flush(self) -> None:
        """The guard takes the LOOKUPs it holds through its shadow now."""
        self._guarded(self.guard.flush)

    def _guarded(self, step, *args) -> None:
        """One step of the guard; the bonus follows its gate when that moved."""
        gate = self.guard.gate
        step(*args)
        if self.guard.gate != gate:
            self._rebonus()

    def _rebonus(self) -> None:
        self.bonus = [round(self.s * self.guard.gate * self.B * x) for x in SHAPE]

    def status(self) -> dict:
        return {
            "name": self.name,
            "evictions_by_reason": dict(self.reasons),
            "reuse_distance": round(self.B),
            "bonus_scale": round(self.s, 3),
            "bonus": list(self.bonus),
            "remembered": len(self.ghost),
            **self.guard.status(),
        }

    def state(self) -> dict:
        """``LRU.state``: the reuse distance's estimates, the bonus scale and the guard's gate (the
        evicted keys and the LRU shadow are not kept: they refill within a pool's turnover)."""
        return {"name": self.name, "estimates": list(self.estimates), "s": self.s, "gate": self.guard.gate}

    def restore(self, state: dict | None) -> None:
        if not isinstance(state, dict) or state.get("name") != self.name:
            return
        est, s, gate = state.get("estimates"), state.get("s"), state.get("gate")
        if not (isinstance(est, list) and all(isinstance(x, (int, float)) and x >= 0 for x in est)):
            return
        if not (isinstance(s, (int, float)) and isinstance(gate, (int, float))):
            return
        self.estimates = [float(x) for x in est[-HISTORY:]]
        self.B = sum(self.estimates) / len(self.estimates) if self.estimates else 0.0
        self.s = min(S_RANGE[1], max(S_RANGE[0], float(s)))
        self.guard.gate = min(1.0, max(GATE_MIN, float(gate)))
        self._rebonus()

    # ---- estimates -----------------------------------------------------------------------
    def _recall(self, obj: Obj, g: list) -> None:
        """A key the pool evicted (``g``, its ghost entry) is stored again: one more use of it."""
        _, level, tick, seen = g
        obj.hits = min(level + 1, LEVELS - 1)
        if not seen:  # (the chunk's other objects take the same level without counting it again)
            g[3] = True
            self.outcomes[level > 0][0] += 1
            self._sample(obj.tick - tick, 1)

    def _sample(self, distance: int, n: int) -> None:
        self.samples.append((distance, n))
        self.weight += n
        if self.weight >= PERIOD:
            self._estimate()

    def _estimate(self) -> None:
        samples, self.samples, total, self.weight = sorted(self.samples), [], self.weight, 0
        want, acc, at = QUANTILE * total, 0, 0
        for d, n in samples:
            acc += n
            at = d
            if acc >= want:
                break
        self.estimates = (self.estimates + [float(at)])[-HISTORY:]
        self.B = sum(self.estimates) / len(self.estimates)
        (a0, b0), (a1, b1) = self.outcomes
        if b0 >= 16 and b1 >= 16:  # the share of each kind's victims that came back
            r0, r1 = min(1.0, a0 / b0), min(1.0, a1 / b1)
            if r0 + r1 > 0:
                self.s = min(S_RANGE[1], max(S_RANGE[0], self.s * math.exp(STEP * (r1 - r0) / (r1 + r0))))
        keep = 1 - 1 / HISTORY
        self.outcomes = [[a * keep, b * keep] for a, b in self.outcomes]
        self._rebonus()


def merged(policy, queues: Iterable) -> Iterator[Obj]:
    """Every object of ``queues`` in ``policy``'s eviction order."""
    return heapq.merge(*(policy.victims(q) for q in queues), key=policy.key)
