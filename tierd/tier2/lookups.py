"""LOOKUP across L1 and L2: asked without waiting, answered by a deadline, leases what it promised.

Hazards first:

- The main loop never waits for L2: a LOOKUP that L1 alone cannot answer whole asks L2 with one
  ``exists`` call and waits (PENDING), until that call answers or --l2-lookup-timeout-ms
  (then from L1 and the fetches already in flight; ``lookups_late``). A late answer is dropped.
  With the tier not connected, it is answered from L1 at once (``lookups_skipped``). What comes
  back is the fold (``Folded``); the main loop hands it to the LOOKUP handler, which leases it.
- What the reply promises must be retrievable: the fold is recomputed from the pool as it is
  when L2 answered; the L1 objects it reads are pinned while the fetches of the L2 ones take
  room (allocation evicts), every fetched object is an unready pinned L1 slot the lease then
  pins too, and a part that gets no room is taken out of the fold before the reply.
- ``exists`` says present now; the object may still go before the get (evicted by the master, or
  its segment's node gone). Then RETRIEVE reports its blocks failed: the engine recomputes.
- A LOOKUP names its namespace; L2 names carry the namespace id, so one tenant's LOOKUP can only
  ever find its own objects.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import msgspec

from tierd.pool.index import Obj
from tierd.protocol import messages as m
from tierd.state.registry import Registry, Session
from tierd.tier2.link import MAX_KEYS
from tierd.tier2.parts import Remote, fold, missing, part_name

log = logging.getLogger("tierd.l2")
QUIET_S = 10.0  # a repeated warning is logged at most this often


PENDING = object()  # ``start``'s answer when the LOOKUP waits for L2 (``answered``, ``overdue``)


class Caller(Protocol):
    """Whose request waits: the session it was sent in (the lease is granted only while it lives)."""

    identity: bytes
    session: Session | None


class Need(Protocol):
    """What a LOOKUP asks of L2 (tierd.core.jobs.LookupNeeds)."""

    msg: m.Lookup
    ns: bytes
    ranks: list[int]


@dataclass
class Folded:
    """A LOOKUP's answer over L1 and L2: ``hit`` and the objects a retrieve there reads (``msg`` with
    lease False: nothing to lease). ``pinned``: L1 objects pinned while L2's fetches took room, to
    be unpinned once the lease holds them."""

    msg: m.Lookup
    hit: int
    objs: list[Obj]
    pinned: list[Obj]


class Pending:
    __slots__ = ("call", "msg", "ns", "ranks", "geo", "parts", "due", "done")

    def __init__(self, call, msg, ns, ranks, geo, parts, due):
        self.call, self.msg, self.ns, self.ranks = call, msg, ns, ranks
        self.geo, self.parts, self.due = geo, parts, due
        self.done = False


class Lookups:
    def __init__(self, l2, registry: Registry, timeout_s: float):
        self.l2, self.timeout_s = l2, timeout_s  # l2: the SecondTier
        self.registry, self.pool = registry, l2.pool
        self.pending: list[Pending] = []
        self._warned = 0.0

    def start(self, call: Caller, need: Need) -> Folded | None | object:
        """The fold now, PENDING, or None (answer from L1 as usual)."""
        l2, msg, ns, ranks = self.l2, need.msg, need.ns, need.ranks
        geo = l2.geometry(ns)
        if geo is None:  # no rank registered here: no object shapes to ask about
            return None
        coming = l2.fetches.coming(ns)
        if l2.mc.state != "connected":
            if not coming:
                l2.counts["lookups_skipped"] += 1
                return None
            parts = []
        else:
            parts = missing(self.pool, ns, msg.keys, geo, len(msg.groups), ranks, coming, MAX_KEYS)
        rec = Pending(call, msg, ns, ranks, geo, parts, time.monotonic() + self.timeout_s)
        if not parts:
            return self.finish(rec, [])
        l2.counts["lookups"] += 1
        op = l2.mc.exists([part_name(ns, p, geo) for p in parts])
        op.done.add_done_callback(lambda fut: l2.post(("exists", rec, fut.result())))
        self.pending.append(rec)
        return PENDING

    def answered(self, rec: Pending, answer: list[bool]) -> Folded | Exception | None:
        """The exists call answered: the fold (None if the LOOKUP was answered already)."""
        if rec.done:
            return None
        self.pending.remove(rec)
        return self._safe(rec, answer)

    def overdue(self, now: float) -> list[tuple[Pending, Folded | Exception]]:
        out = []
        for rec in [r for r in self.pending if r.due <= now]:
            self.pending.remove(rec)
            self.l2.counts["lookups_late"] += 1
            if now - self._warned > QUIET_S:
                self._warned = now
                log.warning(
                    "l2 did not answer a LOOKUP within %g ms: answered from L1 alone", self.timeout_s * 1e3
                )
            out.append((rec, self._safe(rec, [])))
        return out

    def finish(self, rec: Pending, answer: list[bool]) -> Folded:
        """The fold over L1, L2 (what ``answer`` says it holds) and the fetches in flight; the fetches
        of what it promised from L2 start now (the handler then counts and leases it as any LOOKUP)."""
        rec.done = True
        l2, pool, msg, ns, geo = self.l2, self.pool, rec.msg, rec.ns, rec.geo
        present = {p for p, ok in zip(rec.parts, answer) if ok} | l2.fetches.coming(ns)
        args = (pool, ns, msg.keys, msg.groups, msg.chunk_tokens, rec.ranks, geo)
        alone, _ = fold(*args, ())
        live = self.registry.sessions.get(rec.call.identity) is rec.call.session
        if not msg.lease or not live:  # nothing to lease, nothing to fetch for
            hit, _ = fold(*args, present)
            l2.counts["hit_chunks"] += max(0, hit - alone)
            return Folded(msgspec.structs.replace(msg, lease=False), hit, [], [])
        pinned, got = [], {}
        try:
            while True:
                hit, objs = fold(*args, present)
                l1 = [o for o in objs if not isinstance(o, Remote)]
                pool.pin(l1)  # the fetches' allocations may evict: not what this answer reads
                pinned += l1
                want = [o.part for o in objs if isinstance(o, Remote) and o.part not in got]
                if not want:
                    break
                got.update(l2.fetches.start(ns, geo, want, l2.get_timeout_s))
                lost = [p for p in want if p not in got]
                if not lost:
                    break
                present.difference_update(lost)  # no room for them: fold again without
            objs = [got[o.part].obj if isinstance(o, Remote) else o for o in objs]
            pool.touch(ns, msg.keys[:hit])
            l2.counts["hit_chunks"] += max(0, hit - alone)
            return Folded(msg, hit, objs, pinned)  # the handler unpins ``pinned`` once leased
        except BaseException:
            pool.unpin(pinned)
            raise

    def _safe(self, rec: Pending, answer: list[bool]) -> Folded | Exception:
        try:
            return self.finish(rec, answer)
        except Exception as exc:  # noqa: BLE001 - the caller sends it as the error reply
            return exc
