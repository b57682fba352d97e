"""Spill: L1 objects put to L2, by write-back (default) or write-through, never blocking the loop.

Policies (--l2-policy):

- ``write-back``: objects reach L2 on their way out of L1. Once L1 is within --l2-backlog-mb of
  its ceiling, or has evicted since the last pass, the coldest --l2-backlog-mb of it (in the
  order eviction takes objects) are put to L2 ahead of their eviction. Eviction itself stays
  synchronous and never waits for L2: an object whose put is in flight is pinned (eviction takes
  the next one), and an object evicted before its put ran is counted (``writeback_lost``): L1
  then fills faster than L2 takes puts, so size the backlog or the pool accordingly.
- ``write-through``: every complete object is queued for its put when its STORE commits, so
  other nodes see it at once (the policy for sharing across nodes).

Hazards:

- A put reads its slot until the put's ``finished`` resolves, later than its answer when it timed
  out. The object carries a pin from the put's start until then: not evicted, not replaced, and
  its slot not reused under Mooncake's reads.
- One put in flight at a time, of at most PUT_BATCH_BYTES: the tier makes its calls one after
  another on one thread, so a LOOKUP's exists or a RETRIEVE's get never waits behind more than
  one put. A put that stored nothing (the store full, its eviction behind; or L2 down) backs off.
- Only complete objects go (tierd.tier2.parts); their full masks are learnt per namespace from
  the geometry of its STOREs. Objects fetched from L2 are already there (clean).
- Queued objects are not pinned (eviction may take them first: counted) and the queue holds at
  most --l2-backlog-mb; beyond, its oldest entries are dropped (``writeback_dropped``).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from tierd.pool.pool import Pool
from tierd.state.planner import Geometry
from tierd.tier2.parts import full_mask, obj_name

PUT_BATCH_BYTES = 32 << 20
PUT_BATCH_KEYS = 256
BACKOFF_S = 1.0  # after a put that stored nothing
SCAN_EVERY_S = 0.1  # write-back: the cold end is looked at no more often


class Put:
    """One put call: its objects (pinned until ``freed``), and which of its two futures resolved."""

    __slots__ = ("objs", "answered", "freed")

    def __init__(self, objs: list):
        self.objs, self.answered, self.freed = objs, False, False


class Spill:
    def __init__(
        self,
        tier,
        pool: Pool,
        policy: str,
        backlog_bytes: int,
        post: Callable,
        counts: Counter,
        prepare: Callable[[], None],
    ):
        self.tier, self.pool, self.policy, self.backlog = tier, pool, policy, backlog_bytes
        self.post, self.counts, self.prepare = post, counts, prepare
        self.queue: OrderedDict = OrderedDict()  # Obj -> None, oldest first
        self.queued_bytes = 0
        self.inflight: Put | None = None  # the put in flight
        self.clean: set = set()  # objects L2 holds a copy of
        self._masks: dict[tuple, int] = {}  # (namespace id, span items) -> the complete object's mask
        self._seen_evictions = pool.evictions
        self._next_put = self._next_scan = 0.0
        pool.keep_evicted()  # what eviction takes, read back by ``settle`` (the pool calls nothing here)

    # ---- what L1 tells ---------------------------------------------------------------------------
    def learn(self, ns: bytes, geo: Geometry) -> None:
        for i, shape in enumerate(geo.objects):
            self._masks.setdefault((ns, tuple(shape.span.items())), full_mask(geo, i))

    def complete(self, obj) -> bool:
        return self._masks.get((obj.ns, tuple(obj.span.items()))) == obj.mask

    def committed(self, objs) -> None:
        """A STORE committed ``objs`` (write-through queues the complete ones)."""
        self.settle()
        if self.policy != "write-through":
            return
        for obj in objs:
            if self.complete(obj):
                self._enqueue(obj)
            else:
                self.counts["writeback_partial"] += 1

    def landed(self, obj) -> None:
        self.clean.add(obj)

    def settle(self) -> None:
        """What eviction took since the last call: out of the queue and the clean set, and counted
        lost if it was complete and L2 held no copy. Before the queue is read."""
        for obj in self.pool.take_evicted():
            self.evicted(obj)

    def evicted(self, obj) -> None:
        """An object eviction took (its slot may be reused already: nothing of it is read but its
        identity and metadata)."""
        if obj in self.clean:
            self.clean.discard(obj)
        elif self.complete(obj):
            self.counts["writeback_lost"] += 1
        if obj in self.queue:
            del self.queue[obj]
            self.queued_bytes -= obj.nbytes

    def prune(self) -> None:
        """Forget objects that left L1 by other ways than eviction (CLEAR, a fuller copy)."""
        self.settle()
        self.clean = {o for o in self.clean if o.ready}

    # ---- puts ------------------------------------------------------------------------------------
    def pump(self, now: float) -> None:
        """Start the next put if none is in flight (write-back: refill the queue from the cold end)."""
        self.settle()
        if self.inflight is not None or now < self._next_put or self.tier.state != "connected":
            return
        if self.policy == "write-back" and not self.queue:
            self._scan(now)
        batch, nbytes = [], 0
        while self.queue and len(batch) < PUT_BATCH_KEYS:
            obj = next(iter(self.queue))
            if batch and nbytes + obj.nbytes > PUT_BATCH_BYTES:
                break
            del self.queue[obj]
            self.queued_bytes -= obj.nbytes
            if obj.ready and obj not in self.clean:
                batch.append(obj)
                nbytes += obj.nbytes
        if not batch:
            return
        self.pool.pin(batch)
        put = self.inflight = Put(batch)
        self.prepare()
        op = self.tier.put([obj_name(o) for o in batch], [o.addr for o in batch], [o.nbytes for o in batch])
        op.finished.add_done_callback(lambda _: self.post(("put_freed", put)))
        op.done.add_done_callback(lambda fut: self.post(("put", put, fut.result())))

    def put_done(self, put: Put, answers: list[bool]) -> None:
        stored = 0
        for obj, ok in zip(put.objs, answers):
            if ok:
                stored += 1
                self.clean.add(obj)
                self.counts["writeback_puts"] += 1
                self.counts["writeback_bytes"] += obj.nbytes
            else:
                self.counts["writeback_failed"] += 1
        if not stored:
            self._next_put = time.monotonic() + BACKOFF_S
        put.answered = True
        self._settled(put)

    def put_freed(self, put: Put) -> None:
        self.pool.unpin(put.objs)
        put.freed = True
        self._settled(put)

    def _settled(self, put: Put) -> None:
        """The next put once this one is answered (its objects marked) and its slots are free."""
        if put.answered and put.freed and self.inflight is put:
            self.inflight = None
            self.pump(time.monotonic())

    @property
    def inflight_bytes(self) -> int:
        return sum(o.nbytes for o in self.inflight.objs) if self.inflight else 0

    # ---- internals -------------------------------------------------------------------------------
    def _enqueue(self, obj) -> None:
        if obj in self.queue or obj in self.clean:
            return
        self.queue[obj] = None
        self.queued_bytes += obj.nbytes
        while self.queued_bytes > self.backlog and len(self.queue) > 1:
            old, _ = self.queue.popitem(last=False)
            self.queued_bytes -= old.nbytes
            self.counts["writeback_dropped"] += 1

    def _scan(self, now: float) -> None:
        """Queue the dirty objects of L1's cold end: at once after an eviction, else at most every
        SCAN_EVERY_S while L1 is within the backlog of full."""
        pool = self.pool
        evicted = pool.evictions != self._seen_evictions
        if not evicted and (now < self._next_scan or pool.used_bytes + self.backlog < pool.configured_bytes):
            return
        self._seen_evictions, self._next_scan = pool.evictions, now + SCAN_EVERY_S
        for obj in pool.coldest(self.backlog):
            if obj not in self.clean and self.complete(obj):
                self._enqueue(obj)
