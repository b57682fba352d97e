"""SecondTier: what the daemon's main loop calls to use Mooncake Store as L2.

Hazards first:

- Threads. The tier's futures resolve on its worker and clock threads; their callbacks only
  ``post`` an event and write a byte to ``wake_r``, which the main loop polls. Everything else
  here (the pool, the registry, the fetch and put tables) runs on the main loop only.
- Memory. A put reads and a get writes pool slots. The pool's segments are handed to the tier
  (``register``, the segment's memfd: the agent maps the same pages) before the first call
  naming them; the slots stay pinned until Mooncake let go (see fetch, spill). ``close`` stops
  the agent (bounded) before the daemon unmaps the pool.
- Degradation. A tier that is not connected answers every call False at once: LOOKUPs are
  answered from L1, RETRIEVEs do not wait, puts wait for the tier to come back (the tier logs
  each change of state and counts it). Nothing here raises for L2 trouble.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter

from tierd.pool.index import Obj
from tierd.pool.pool import Pool
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.state.planner import Geometry
from tierd.state.registry import Instance, Registry
from tierd.tier2.fetch import Fetches
from tierd.tier2.keys import FORMAT as NAME_FORMAT
from tierd.tier2.lookups import PENDING, Caller, Folded, Lookups
from tierd.tier2.lookups import Need as LookupNeed
from tierd.tier2.mooncake import MooncakeTier
from tierd.tier2.retrieves import Need as RetrieveNeed
from tierd.tier2.retrieves import Retrieves
from tierd.tier2.spill import Spill

log = logging.getLogger("tierd.l2")
PRUNE_S = 10.0
CLOSE_S = 4.0  # leaving the store takes seconds with a segment (unmounting it); then the agent is killed

# The daemon's own L2 counters: name -> meaning (/status "l2" and /metrics tierd_l2_<name>_total).
COUNTERS = {
    "lookups": "LOOKUPs that asked L2 what it holds (one exists call each)",
    "lookups_skipped": "LOOKUPs answered from L1 alone because the tier was not connected",
    "lookups_late": "LOOKUPs answered from L1 alone because L2 did not answer within --l2-lookup-timeout-ms",
    "hit_chunks": "chunks LOOKUP reported servable beyond what L1 alone held",
    "fetches": "objects whose fetch from L2 into L1 started",
    "fetched": "objects fetched into L1 whole",
    "fetched_bytes": "bytes fetched into L1",
    "fetch_failed": "fetches that failed or timed out (never served: their blocks are reported failed)",
    "fetch_no_room": "objects not fetched: no room in L1 even after eviction",
    "fetch_raced": "objects not fetched: a STORE was writing them into L1 at that moment",
    "retrieve_waits": "RETRIEVEs that waited for fetches",
    "writeback_puts": "L1 objects put to L2 (stored, or already there)",
    "writeback_bytes": "bytes of those objects",
    "writeback_failed": "L1 objects whose put failed or was refused (the store full)",
    "writeback_lost": "complete objects evicted from L1 before their put ran",
    "writeback_dropped": "objects dropped from a queue over --l2-backlog-mb before their put",
    "writeback_partial": "objects not put: some of their blocks are null (L2 holds whole objects only)",
}


class SecondTier:
    PENDING = PENDING  # ``lookup``'s answer while the LOOKUP waits for L2

    def __init__(self, settings, pool: Pool, registry: Registry):
        self.settings, self.pool, self.registry = settings, pool, registry
        self.mc = MooncakeTier(settings.l2_url)  # connects in the background
        self.get_timeout_s = self.mc.url.timeout_ms / 1000
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_lock = threading.Lock()  # the pipe is closed under it: no write to a reused descriptor
        self._closed = False
        self._registered = 0  # pool segments handed to the tier
        self._geos: dict[bytes, tuple] = {}  # namespace id -> (layout, Geometry)
        self._next_prune = 0.0
        self.counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self.spill = Spill(
            self.mc,
            pool,
            settings.l2_policy,
            settings.l2_backlog_mb << 20,
            self.post,
            self.counts,
            self._prepare,
        )
        self.fetches = Fetches(self.mc, pool, self.post, self.counts, self._prepare, self.spill.landed)
        self.lookups = Lookups(self, registry, settings.l2_lookup_timeout_ms / 1000)
        self.retrieves = Retrieves(self)
        log.info(
            "l2: %s, %s, LOOKUPs wait at most %d ms; objects named %s/%s/<key>: objects that other "
            "versions of the key derivation or object layout wrote are never read",
            self.mc.url,
            settings.l2_policy,
            settings.l2_lookup_timeout_ms,
            self.mc.url.prefix,
            NAME_FORMAT,
        )

    # ---- what the main loop and handlers call -------------------------------------------------
    def lookup(self, call: Caller, need: LookupNeed) -> Folded | None | object:
        """The fold over L1 and L2, PENDING (``drain`` hands it back), or None (answer from L1)."""
        return self.lookups.start(call, need)

    def fetch_for(self, call: Caller, need: RetrieveNeed) -> bool:
        """True: the RETRIEVE waits for fetches (``drain`` hands it back)."""
        return self.retrieves.start(call, need)

    def committed(self, inst: Instance, geo: Geometry, objs: list[Obj]) -> None:
        self.spill.learn(inst.ns, geo)
        self.spill.committed(objs)
        self.spill.pump(time.monotonic())

    def learn(self, ns: bytes, geo: Geometry) -> None:
        self.spill.learn(ns, geo)

    def geometry(self, ns: bytes) -> Geometry | None:
        """The object geometry of the ranks registered in ``ns`` (None: none is)."""
        registered = self.registry.registered_layout(ns)
        if registered is None:
            return None
        layout = registered[1]
        cached = self._geos.get(ns)
        if cached is None or cached[0] is not layout:
            s = self.settings
            cached = self._geos[ns] = (layout, Geometry(layout, s.separate_object_groups, s.null_block_id))
            self.spill.learn(ns, cached[1])
        return cached[1]

    # ---- the main loop ---------------------------------------------------------------------------
    def post(self, event: tuple) -> None:
        """From any thread: hand an event to the main loop."""
        self._events.put(event)
        with self._wake_lock:
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"!")
            except OSError:  # the pipe is full: the loop wakes anyway
                pass

    def drain(self, now: float) -> list[tuple]:
        """Handle the tier's events; (call, op, result) of requests no longer waiting: a LOOKUP's
        Folded or exception, a RETRIEVE's need (checked before it waited: to plan now)."""
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                kind, *args = self._events.get_nowait()
            except queue.Empty:
                break
            if kind == "exists":
                result = self.lookups.answered(*args)
                if result is not None:
                    out.append((args[0].call, "LOOKUP", result))
            elif kind == "got":
                self.fetches.got(*args)
            elif kind == "freed":
                self.fetches.freed(*args)
            elif kind == "put":
                self.spill.put_done(*args)
            elif kind == "put_freed":
                self.spill.put_freed(*args)
        out += [(rec.call, "LOOKUP", result) for rec, result in self.lookups.overdue(now)]
        out += [(call, "RETRIEVE", need) for call, need in self.retrieves.ready(now)]
        return out

    def next_due(self, now: float) -> float | None:
        """Seconds until a waiting request is due (None: none waits)."""
        dues = [r.due for r in self.lookups.pending] + [w.due for w in self.retrieves.pending]
        return min(dues) - now if dues else None

    @property
    def idle(self) -> bool:
        return not self.lookups.pending and not self.retrieves.pending

    def housekeeping(self, now: float) -> None:
        if self.mc.state == "connected":
            self._prepare()  # segments the pool grew since: registered now, not under the next call
        self.spill.pump(now)
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_S
            self.spill.prune()

    def abandon(self) -> list[tuple]:
        """At a stop past its grace: every waiting request, answered SHUTTING_DOWN."""
        err = ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon stopped while this request waited for L2")
        out = [(r.call, "LOOKUP", err) for r in self.lookups.pending]
        out += [(w.call, "RETRIEVE", err) for w in self.retrieves.pending]
        self.lookups.pending.clear()
        self.retrieves.pending.clear()
        return out

    def _prepare(self) -> None:
        """Hand the tier every pool segment not yet registered (before a call names its memory)."""
        regions = self.pool.regions()
        for region in regions[self._registered :]:
            self.mc.register(region.addr, region.nbytes, region.fd)
        self._registered = len(regions)

    # ---- status and shutdown -----------------------------------------------------------------
    def status(self) -> dict:
        spill = self.spill
        spill.settle()
        out = self.mc.status()
        out.update(
            policy=self.settings.l2_policy,
            lookup_timeout_ms=self.settings.l2_lookup_timeout_ms,
            backlog_limit_bytes=spill.backlog,
            writeback_queued=len(spill.queue),
            writeback_queued_bytes=spill.queued_bytes,
            writeback_inflight_bytes=spill.inflight_bytes,
            fetching=len(self.fetches.inflight),
            waiting_lookups=len(self.lookups.pending),
            waiting_retrieves=len(self.retrieves.pending),
        )
        out.update(self.counts)
        return out

    def close(self) -> None:
        """Leave the store (bounded: the agent is killed if it does not go); the pool may go after."""
        self.pool.keep_evicted(False)
        if not self.mc.close(timeout_s=CLOSE_S):
            log.warning("l2: the Mooncake client did not leave cleanly (killed)")
        with self._wake_lock:
            self._closed = True
            for fd in (self.wake_r, self._wake_w):
                os.close(fd)
