"""RETRIEVE of chunks L1 does not hold yet: wait for their fetches from L2, by the deadline.

Hazards first:

- A RETRIEVE whose objects are being fetched (the LOOKUP that promised them started the fetches)
  waits for them without holding the loop: it is handed back to the main loop, which plans it
  from what it checked before the wait, once every fetch it needs settled or its time is up.
  Planning reads only committed objects, so a fetch that failed, timed out or had not landed yet
  by then leaves exactly its blocks in ``failed`` (the engine recomputes them); nothing
  half-written is ever copied out.
- Objects L1 lacks and nobody fetches (no LOOKUP before, its lease expired and the object was
  evicted) are fetched here, when the tier is connected and there is time.
- Time: a RETRIEVE with a deadline is planned MARGIN_S before it (the copy still has to run, and
  one started after its deadline answers EXPIRED); its own fetches get that long. Without a
  deadline it waits at most for the gets' own deadline.
"""

from __future__ import annotations

import time
from typing import Protocol

from tierd.protocol import messages as m
from tierd.state.planner import Geometry
from tierd.state.registry import Instance
from tierd.tier2.lookups import Caller
from tierd.tier2.parts import Part, shape_of


class Need(Protocol):
    """What a RETRIEVE asks of L2 (tierd.core.jobs.RetrieveNeeds)."""

    msg: m.Retrieve
    instance: Instance
    geometry: Geometry


MARGIN_S = 0.05
MIN_FETCH_S = 0.02  # less time left than this: do not start a get at all


class Waiting:
    __slots__ = ("call", "need", "fetches", "due")

    def __init__(self, call, need, fetches, due):
        self.call, self.need, self.fetches, self.due = call, need, fetches, due


class Retrieves:
    def __init__(self, l2):
        self.l2, self.pool = l2, l2.pool  # l2: the SecondTier
        self.pending: list[Waiting] = []

    def start(self, call: Caller, need: Need) -> bool:
        """True: the RETRIEVE waits (``ready`` hands it back); False: plan it now. ``call`` is
        handed back as it is."""
        l2, msg, inst, geo = self.l2, need.msg, need.instance, need.geometry
        now = time.monotonic()
        left = msg.deadline - time.time() - MARGIN_S if msg.deadline else l2.get_timeout_s + MARGIN_S
        if left <= 0:
            return False
        ns, rank, null = inst.ns, inst.rank_key, geo.null
        can_fetch = l2.mc.state == "connected" and left > MIN_FETCH_S
        if not can_fetch and not l2.fetches.inflight:
            return False
        l2.learn(ns, geo)
        shapes = [shape_of(geo, g) for g in range(len(geo.blocks_per_chunk))]
        waits, new, seen = {}, [], set()
        for c in msg.chunks:
            entry = None
            for g, ids in enumerate(c.blocks):
                part = Part(c.key, shapes[g], rank)
                if part in seen or all(b == null for b in ids):
                    continue
                seen.add(part)
                if entry is None:
                    entry = self.pool.entry(ns, c.key) or {}
                obj = entry.get((g, rank))
                if obj is not None and obj.ready:
                    continue
                fetch = l2.fetches.get(ns, part)
                if fetch is not None:
                    waits[part] = fetch
                elif obj is None and can_fetch:
                    new.append(part)
        if new:
            waits.update(l2.fetches.start(ns, geo, new, min(l2.get_timeout_s, left)))
        if not waits:
            return False
        self.pending.append(Waiting(call, need, list(waits.values()), now + left))
        l2.counts["retrieve_waits"] += 1
        return True

    def ready(self, now: float) -> list[tuple[Caller, Need]]:
        """RETRIEVEs whose fetches all settled, or whose time is up: (call, need), to plan now."""
        out = []
        for w in [w for w in self.pending if w.due <= now or all(f.settled for f in w.fetches)]:
            self.pending.remove(w)
            out.append((w.call, w.need))
        return out
