"""Fetches: L2 objects brought into freshly allocated L1 slots, with nothing in between.

Hazards first:

- Mooncake writes a fetch's slot until the get's ``finished`` resolves, which for a timed-out get
  comes later than its answer. From ``begin_write`` until then the slot is an unready, pinned
  pool object: LOOKUP and RETRIEVE only read committed objects, eviction and CLEAR skip pinned
  ones, and nothing else is ever written to that slot. A get that failed is aborted (its slot
  freed) only once ``finished`` resolved.
- A get answered True wrote exactly the object's size (tierd.tier2.mooncake checks the size it asked for), so
  the object is committed with every block present; any other answer is aborted: a failed or
  timed-out get is never served (RETRIEVE reports its blocks as failed).
- Allocation evicts synchronously, as a STORE's does; a caller that already promised some L1
  objects pins them before asking for room.
- Runs on the daemon's main loop only. The get's futures resolve on the tier's threads; their
  callbacks only post an event (``post``), handled here by ``got`` and ``freed``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from tierd.pool.pool import EXISTS, Pool
from tierd.state.planner import Geometry
from tierd.tier2.link import MAX_KEYS
from tierd.tier2.parts import Part, full_mask, part_name


class Fetch:
    __slots__ = ("ns", "part", "obj", "batch", "settled", "ok")

    def __init__(self, ns: bytes, part: Part, obj, batch):
        self.ns, self.part, self.obj, self.batch = ns, part, obj, batch
        self.settled = False  # the get answered (ok or not): a waiting RETRIEVE may go on
        self.ok = False


class Batch:
    """One get call: its fetches, and whether Mooncake has let go of their slots."""

    __slots__ = ("fetches", "freed")

    def __init__(self):
        self.fetches: list[Fetch] = []
        self.freed = False


class Fetches:
    def __init__(
        self, tier, pool: Pool, post: Callable, counts: Counter, prepare: Callable[[], None], landed: Callable
    ):
        self.tier, self.pool, self.post, self.counts = tier, pool, post, counts
        self.prepare = prepare  # hands the pool's segments to the tier before a get names them
        self.landed = landed  # told of each object committed from L2 (it is clean: L2 holds it)
        self.inflight: dict[tuple[bytes, Part], Fetch] = {}

    def get(self, ns: bytes, part: Part) -> Fetch | None:
        return self.inflight.get((ns, part))

    def coming(self, ns: bytes) -> set[Part]:
        return {p for n, p in self.inflight if n == ns}

    def start(self, ns: bytes, geo: Geometry, parts: Iterable[Part], timeout_s: float) -> dict[Part, Fetch]:
        """Fetch ``parts`` into L1 (one get call for the new ones). Returns the fetch of every part
        now in flight, its own or an earlier one; a part that got no slot is absent."""
        got: dict[Part, Fetch] = {}
        batches = [Batch()]
        for part in dict.fromkeys(parts):
            fetch = self.inflight.get((ns, part))
            if fetch is None:
                shape = geo.objects[part.shape]
                obj = self.pool.begin_write(
                    ns,
                    part.key,
                    geo.spans[part.shape],
                    part.rank,
                    shape.nbytes,
                    full_mask(geo, part.shape),
                    shape.label,
                )
                if obj is None or obj is EXISTS:  # no room even after eviction; or a STORE writes it now
                    self.counts["fetch_no_room" if obj is None else "fetch_raced"] += 1
                    continue
                if len(batches[-1].fetches) == MAX_KEYS:
                    batches.append(Batch())
                fetch = self.inflight[ns, part] = Fetch(ns, part, obj, batches[-1])
                batches[-1].fetches.append(fetch)
            got[part] = fetch
        for batch in batches:
            if batch.fetches:
                self._get(batch, geo, timeout_s)
        return got

    def _get(self, batch: Batch, geo: Geometry, timeout_s: float) -> None:
        fs = batch.fetches
        self.counts["fetches"] += len(fs)
        self.prepare()
        op = self.tier.get(
            [part_name(f.ns, f.part, geo) for f in fs],
            [f.obj.addr for f in fs],
            [f.obj.nbytes for f in fs],
            timeout_s=timeout_s,
        )
        op.finished.add_done_callback(lambda _: self.post(("freed", batch)))
        op.done.add_done_callback(lambda fut: self.post(("got", batch, fut.result())))

    # ---- events, on the main loop ------------------------------------------------------------------
    def got(self, batch: Batch, answers: list[bool]) -> None:
        for fetch, ok in zip(batch.fetches, answers):
            fetch.settled, fetch.ok = True, bool(ok)
            self.inflight.pop((fetch.ns, fetch.part), None)
            if ok:
                self.pool.commit([fetch.obj])
                self.counts["fetched"] += 1
                self.counts["fetched_bytes"] += fetch.obj.nbytes
                self.landed(fetch.obj)
            else:
                self.counts["fetch_failed"] += 1
                if batch.freed:
                    self.pool.abort([fetch.obj])

    def freed(self, batch: Batch) -> None:
        batch.freed = True
        failed = [f.obj for f in batch.fetches if f.settled and not f.ok]
        if failed:  # answered False before Mooncake let go of the slots (a timeout): free them now
            self.pool.abort(failed)
