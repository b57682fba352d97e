"""What the pool holds and how recently: LOOKUP's reads of the index, the policy's queues (LRU
per size class, and per namespace with a quota), pins, lease pins, and the touches and pins a
LOOKUP's reply does not wait for: applied by the daemon while no request waits, a part at a time
(``Recency.settle``), and all at once whenever anything but a LOOKUP takes the pool's lock
(``PoolLock``), so nothing that evicts or reads the order sees it without them.

A part of :class:`tierd.pool.pool.Pool` (its state lives there); the lock held where it says.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from tierd.pool import policy
from tierd.pool.index import Obj
from tierd.protocol.layout import GroupSpec


class PoolLock:
    """The pool's lock. Whoever takes it next first applies what a LOOKUP's reply did not wait for:
    the pins of the leases it granted (Recency.defer_lease), then its LRU touches (Recency.lookup). So
    nobody sees pins or the LRU without them, and the daemon applies them itself right after each
    reply (Recency.settle). ``plain`` is the same lock applying the pins only, for code that neither
    reads nor changes the LRU (lease grants and releases); ``reads`` the same lock applying
    nothing, for LOOKUP's read of the index, which neither order nor pins decide."""

    __slots__ = ("_lock", "_pool", "plain", "reads")

    def __init__(self, pool: Recency):
        self._lock = threading.Lock()
        self._pool = pool
        self.plain = _PinsLock(self._lock, pool)
        self.reads = self._lock

    def acquire(self) -> None:
        _take(self._lock, self._pool, touches=True)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> PoolLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


class _PinsLock:
    """PoolLock.plain: the pool's lock, applying pending lease pins (not LRU touches) when taken."""

    __slots__ = ("_lock", "_pool")

    def __init__(self, lock: threading.Lock, pool: Recency):
        self._lock, self._pool = lock, pool

    def __enter__(self) -> _PinsLock:
        _take(self._lock, self._pool, touches=False)
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


def _take(lock: threading.Lock, pool: Recency, touches: bool) -> None:
    """Acquire ``lock``, then apply the pool's pending pins (and LRU touches, with ``touches``);
    if applying raises, the lock is let go before the exception propagates."""
    lock.acquire()
    if pool._unpinned or (touches and (pool._untouched or pool._unobserved)):
        try:
            if pool._unpinned:
                pool._apply_pins()
            if touches:
                pool._apply_touches()
        except BaseException:
            lock.release()
            raise


class Recency:
    """The index's reads and the eviction policy's order (a part of Pool)."""

    def init_recency(self) -> None:
        self._untouched: list[list[Obj]] = []  # LOOKUP answers whose touch is not applied yet
        self._touched = 0  # of _untouched[0], the objects (from its tail) touched already
        self.unsettled = 0  # objects and keys LOOKUPs left to touch, pin and observe
        # LOOKUPs (namespace, keys, hit) the policy has not seen yet, if it looks at them
        self._observes = hasattr(self.policy, "observe")
        self._unobserved: list[tuple[bytes, Sequence[bytes], int]] = []
        self._unpinned: list[tuple[Sequence[Obj], str]] = []  # lease grants whose pins are not applied yet
        self.leased_bytes: dict[str, int] = {}  # owner (tenant) -> bytes its leases pin (each object once)
        self.lock = PoolLock(self)

    def lookup(
        self,
        ns: bytes,
        keys: Sequence[bytes],
        specs: Sequence[GroupSpec],
        chunk_tokens: int,
        ranks: Sequence[int],
    ):
        """Longest servable boundary and the objects a retrieve there reads (tierd.pool.fold).
        They are touched (most recent: the first) when the lock is next taken, or at ``settle``;
        what earlier LOOKUPs left is not applied first (the read depends on neither)."""
        with self.lock.reads:
            hit, objs = self.index.lookup(ns, keys, specs, chunk_tokens, ranks)
            if objs:
                self._untouched.append(objs)
                self.unsettled += len(objs)
            if self._observes:
                self._unobserved.append((ns, keys, hit))
                self.unsettled += len(keys)
            return hit, objs

    def settle(self, budget: int | None = None) -> bool:
        """Apply the pins and touches LOOKUPs left: all of them, or (``budget``) the pins and about
        that many objects' touches and keys' observations, the next in order (a LOOKUP's objects
        tail first, as ``touch_objects`` takes them: any split gives the order of one call).
        Returns whether any are left."""
        if not (self._untouched or self._unpinned or self._unobserved):
            return False
        if budget is None:
            with self.lock:  # taking it applies them (PoolLock.acquire)
                pass
            return False
        with self.lock.plain:  # the pins
            self._apply_touches(budget)
        return bool(self._untouched or self._unobserved)

    def defer_lease(self, objs: Sequence[Obj], owner: str) -> None:
        """``pin_lease(objs, owner)`` runs when the lock is next taken, before anything else does."""
        self._unpinned.append((objs, owner))

    def pin_lease(self, objs: Sequence[Obj], owner: str) -> int:
        """Pin a lease's objects; ``owner``'s leased bytes grow by the objects no lease held yet
        (each object once, however many leases pin it). Returns those bytes. The lock held."""
        add = 0
        for o in objs:
            o.pins += 1
            if not o.leases:
                add += o.nbytes  # an object repeated in objs counts once
            o.leases += 1
        if add:
            self.leased_bytes[owner] = self.leased_bytes.get(owner, 0) + add
        return add

    def unpin_lease(self, objs: Sequence[Obj], owner: str) -> None:
        """Undo ``pin_lease``. The lock held."""
        freed = 0
        for o in objs:
            o.pins -= 1
            o.leases -= 1
            if not o.leases:
                freed += o.nbytes
        left = self.leased_bytes.get(owner, 0) - freed
        if left:
            self.leased_bytes[owner] = left
        else:
            self.leased_bytes.pop(owner, None)

    def settle_pins(self) -> None:
        """Apply the lease pins granted so far (``defer_lease``), not the LRU touches."""
        if self._unpinned:
            with self.lock.plain:
                pass

    def _apply_pins(self) -> None:
        while self._unpinned:
            self.pin_lease(*self._unpinned.pop(0))

    def _apply_touches(self, budget: float = float("inf")) -> None:
        """The touches, then the observations, LOOKUPs left: about ``budget`` objects and keys of
        them (all by default). The lock held."""
        while self._untouched and budget > 0:
            # taken off first: a touch that raises drops its own LOOKUP's, not every later lock's
            objs, done, self._touched = self._untouched.pop(0), self._touched, 0
            left = len(objs) - done
            self.unsettled -= left
            take = left if budget >= left else int(budget)
            part = objs[left - take : left] if take < len(objs) else objs
            self.touch_objects(part, weight=0 if done else len(objs))
            budget -= take
            if take < left:
                self._untouched.insert(0, objs)
                self._touched, self.unsettled = done + take, self.unsettled + left - take
        if self._untouched or not self._unobserved:
            return
        held = sum(map(len, self.index.spaces.values()))  # keys
        while self._unobserved and budget > 0:
            ns, keys, hit = self._unobserved.pop(0)
            self.policy.observe(ns, keys, hit, held)
            budget -= len(keys)
            self.unsettled -= len(keys)

    def touch(self, ns: bytes, keys: Sequence[bytes]) -> None:
        """Mark a prefix's chunks used, tail first, so the head is the most recent."""
        with self.lock:
            objs = []
            for key in keys:
                entry = self.index.get(ns, key)
                if entry is not None:
                    objs.extend(o for o in entry.values() if o.ready)
            self.touch_objects(objs, hit=False)

    def find_ready(self, ns: bytes, key: bytes, group: int, rank: int) -> Obj | None:
        return self.find_ready_many(ns, [key], group, rank)[0]

    def find_ready_many(self, ns: bytes, keys: Sequence[bytes], group: int, rank: int) -> list[Obj | None]:
        """``find_ready`` for each of ``keys``, under one hold of the lock."""
        with self.lock:
            space = self.index.spaces.get(ns)
            if space is None:
                return [None] * len(keys)
            part = (group, rank)
            out = []
            for entry in map(space.get, keys):
                obj = None if entry is None else entry.get(part)
                out.append(obj if obj is not None and obj.ready else None)
            return out

    def entry(self, ns: bytes, key: bytes) -> dict | None:
        """A copy of the chunk entry of ``key``: (group, rank) -> Obj, objects being written included."""
        with self.lock:
            entry = self.index.get(ns, key)
            return None if entry is None else dict(entry)

    def coldest(self, nbytes: int, limit: int = 4096) -> list[Obj]:
        """Committed objects in eviction order, until their slots add up to ``nbytes`` (at most
        ``limit``): roughly the next victims of eviction, which picks per size class."""
        out, total = [], 0
        with self.lock:
            for obj in policy.merged(self.policy, self.lru.values()):
                if total >= nbytes or len(out) >= limit:
                    break
                out.append(obj)
                total += obj.slab.cls.slot_bytes
        return out

    def pin(self, objs: Iterable[Obj]) -> None:
        with self.lock:
            for obj in objs:
                obj.pins += 1

    def unpin(self, objs: Iterable[Obj]) -> None:
        with self.lock:
            for obj in objs:
                obj.pins -= 1
                assert obj.pins >= 0

    def _touch(self, obj: Obj) -> None:
        self._tick += 1
        obj.tick = self._tick
        lru = self.lru.get(obj.slab.cls)
        if lru is None:
            lru = self.lru[obj.slab.cls] = self.policy.queue()
        self.policy.enter(lru, obj)
        if self.ns_quota_bytes:
            lru = self.nslru.get((obj.ns, obj.slab.cls))
            if lru is None:
                lru = self.nslru[obj.ns, obj.slab.cls] = self.policy.queue()
            self.policy.join(lru, obj)

    def touch_objects(self, objs: Sequence[Obj], hit: bool = True, weight: int | None = None) -> None:
        """Touch ready objects tail first: the first one ends up most recent. ``hit``: a LOOKUP
        found them, which the policy counts (False: only their recency changes; ``weight``: see
        ``policy.LRU.touch``). The lock held."""
        self._tick = self.policy.touch(self.lru, objs, self._tick, hit, weight)
        if self.ns_quota_bytes:
            self.policy.retouch(self.nslru, objs)
