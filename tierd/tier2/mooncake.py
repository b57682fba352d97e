"""MooncakeTier: tierd's second tier on Mooncake Store. One client, and its caller never waits.

Hazards first:

- Threading contract. Every verb returns an :class:`~tierd.tier2.worker.Op` at once. The Mooncake
  client lives in a child process (:mod:`tierd.tier2.agent`), because its setup and close hold the
  GIL for tens of seconds when the master misbehaves; the tier's worker thread relays one call at
  a time to it, in submission order. ``op.done`` resolves by the call's deadline with one bool
  per key (False: failed, missed, timed out or rejected), never with an exception for L2
  trouble. Only caller bugs raise, synchronously: mismatched lengths, sizes <= 0, memory outside
  what was registered, more than ``MAX_KEYS`` keys. ``close()`` alone blocks (bounded).
- Memory. A put reads and a get writes the given addresses until ``op.finished``, which for a
  timed-out call comes later than ``op.done``. Keep those bytes (an L1 slot) pinned until then.
  A get that failed may have written part of its destination: never serve it. Registered memory
  must be a file (the pool's memfd segments or pool-dir files): the agent maps the same pages
  from the descriptor given to :meth:`MooncakeTier.register`.
- Health. ``fail_after`` failed calls in a row (see :mod:`tierd.tier2.relay`), a timed-out call, a
  failed or timed-out setup, or a lost agent mark the tier degraded: calls then fail fast without
  touching Mooncake, and every ``retry_s`` (once the worker is free) a probe asks the master
  about one key, or a fresh client (and agent, if it died) is set up. A probe that answers brings
  the tier back. An agent silent for ``HANG_S`` is killed. A restarted master holds none of the
  old objects: old keys miss, and puts fail "full" for the second or so until every client has
  mounted its segment again.
- Names. Keys are bytes (:func:`tierd.tier2.keys.chunk_key`), stored as ``<prefix>/v3-k1-o2/<hex>``
  (:data:`tierd.tier2.keys.FORMAT`), so every node of one format derives the same name. Mooncake
  does not separate tenants: the key bytes must carry the namespace.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from tierd.base.l2url import MooncakeUrl, parse_url
from tierd.tier2 import client
from tierd.tier2.buffers import Buffers
from tierd.tier2.keys import object_name
from tierd.tier2.link import MAX_KEYS
from tierd.tier2.relay import Relay
from tierd.tier2.stats import L2Stats
from tierd.tier2.worker import DeadlineWorker, Op

log = logging.getLogger("tierd.l2")

CONNECTING, CONNECTED, DEGRADED, CLOSED = "connecting", "connected", "degraded", "closed"
HANG_S = 120.0  # an agent silent this long is killed (Mooncake's own RPC timeout is 30 s)


class MooncakeTier:
    """``MooncakeTier(url)`` starts connecting in the background; L2Unavailable without Mooncake."""

    def __init__(self, url: MooncakeUrl | str):
        self.url = parse_url(url) if isinstance(url, str) else url
        client.load_store_class()  # L2Unavailable now, at configuration time, not later in the agent
        self.stats = L2Stats()
        self._lock = threading.Lock()
        self._state = CONNECTING
        self._ever_connected = False
        self._probing = False
        self._probe_name = f"{self.url.prefix}/probe"
        self._buffers = Buffers()
        self._relay = Relay(
            self.url,
            self.stats,
            self._buffers,
            max(HANG_S, 2 * self.url.setup_timeout_s),
            trouble=self._degrade,
            joined=lambda why: self._set_state(CONNECTED, why),
        )
        self._worker = DeadlineWorker("l2-mooncake")
        self._worker.every(self.url.retry_s, self._retry)
        self.connecting = self._submit("setup", self._relay.setup, False, self.url.setup_timeout_s)

    # -- verbs -------------------------------------------------------------------------------

    def register(self, addr: int, nbytes: int, fd: int, offset: int = 0) -> Op:
        """``nbytes`` at ``addr``, mapped from ``fd`` at ``offset`` (a pool segment's memfd): memory
        puts read and gets write. Kept across reconnects; ``fd`` is duplicated. True once the
        agent holds it, False while unconnected (setup registers it). Never dropped unstarted."""
        buf = self._buffers.add(addr, nbytes, fd, offset)
        return self._submit(
            "register", lambda: self._relay.register(buf), False, self._relay.hang_s, cut=False
        )

    def unregister(self, addr: int) -> Op:
        """Forget a buffer. Only once no put or get naming it is unfinished."""
        buf = self._buffers.remove(addr)
        return self._submit(
            "unregister", lambda: self._relay.unregister(buf), False, self._relay.hang_s, cut=False
        )

    def put(
        self,
        keys: Sequence[bytes],
        addrs: Sequence[int],
        sizes: Sequence[int],
        timeout_s: float | None = None,
    ) -> Op:
        """Store ``sizes[i]`` bytes at ``addrs[i]`` under ``keys[i]``; True: stored or already there."""
        names, ids, offs, sizes = self._places(keys, addrs, sizes)
        return self._data(
            "put", names, lambda: self._relay.put(names, ids, offs, sizes), sum(sizes), timeout_s
        )

    def get(
        self,
        keys: Sequence[bytes],
        addrs: Sequence[int],
        sizes: Sequence[int],
        timeout_s: float | None = None,
    ) -> Op:
        """Fetch each object into ``addrs[i]``; True only if exactly ``sizes[i]`` bytes landed."""
        names, ids, offs, sizes = self._places(keys, addrs, sizes)
        return self._data(
            "get", names, lambda: self._relay.get(names, ids, offs, sizes), sum(sizes), timeout_s
        )

    def exists(self, keys: Sequence[bytes], timeout_s: float | None = None) -> Op:
        """True: the store holds the key now (it may still be evicted before a get)."""
        names = self._names(keys)
        return self._data("exists", names, lambda: self._relay.exists(names), 0, timeout_s)

    def remove(self, keys: Sequence[bytes], timeout_s: float | None = None) -> Op:
        """True: gone (or was absent). False for a key read within the master's lease TTL."""
        names = self._names(keys)
        return self._data("remove", names, lambda: self._relay.remove(names), 0, timeout_s)

    @property
    def state(self) -> str:
        return self._state

    def status(self) -> dict:
        """Counters (:data:`tierd.tier2.stats.COUNTERS`), latency histograms and gauges, as a plain dict."""
        queued, queued_bytes, running_s = self._worker.backlog()
        buffers, registered = self._buffers.totals()
        out = self.stats.snapshot()
        out.update(
            url=str(self.url),
            state=self._state,
            connected=self._state == CONNECTED,
            local=self._relay.local,
            segment_bytes=self.url.segment_bytes,
            registered_buffers=buffers,
            registered_bytes=registered,
            queued=queued,
            queued_bytes=queued_bytes,
            running_s=round(running_s, 6),
            consecutive_failures=self._relay.failures,
            last_error=self._relay.last_error,
        )
        return out

    def close(self, timeout_s: float = 5.0) -> bool:
        """Leave the store (this node's segment and its objects go), stop the agent and threads.
        Blocks at most about ``timeout_s + 3`` s; False if something had to be killed."""
        with self._lock:
            if self._state == CLOSED:
                return True
            self._state = CLOSED
        op = self._submit("close", lambda: self._relay.close(timeout_s), False, timeout_s, cut=False)
        try:
            done = op.done.result(timeout_s + 1.0)
        except TimeoutError:
            done = False
        self._relay.terminate()  # a worker stuck on a wedged agent gets AgentLost and moves on
        stopped = self._worker.close(2.0)
        self._buffers.close()
        return stopped and bool(done)

    # -- submission ----------------------------------------------------------------------------

    def _names(self, keys) -> list[str]:
        if len(keys) > MAX_KEYS:
            raise ValueError(f"{len(keys)} keys in one call; at most {MAX_KEYS}")
        return [object_name(k, self.url.prefix) for k in keys]

    def _places(self, keys, addrs, sizes):
        if not len(keys) == len(addrs) == len(sizes):
            raise ValueError(f"{len(keys)} keys, {len(addrs)} addresses, {len(sizes)} sizes")
        sizes = [int(s) for s in sizes]
        ids, offs = self._buffers.place(addrs, sizes)
        return self._names(keys), ids, offs, sizes

    def _data(self, kind: str, names: list[str], fn, nbytes: int, timeout_s: float | None) -> Op:
        n = len(names)
        if self._state != CONNECTED:
            self.stats.add(rejected=1, rejected_keys=n)
            return Op.answered(kind, [False] * n)

        def run() -> list[bool]:
            if self._state == CONNECTED and self._relay.connected:
                return fn()
            self.stats.add(rejected=1, rejected_keys=n)  # queued before the tier degraded
            return [False] * n

        t = self.url.timeout_ms / 1000 if timeout_s is None else timeout_s
        return self._submit(kind, run, [False] * n, t, nbytes=nbytes)

    def _submit(self, kind: str, fn, fallback, timeout_s: float, nbytes: int = 0, cut: bool = True) -> Op:
        op = Op(kind, nbytes, time.monotonic() + timeout_s)
        if kind in ("put", "get", "exists", "remove", "probe"):
            op.done.add_done_callback(lambda _: self.stats.observe(kind, time.monotonic() - op.submitted))
        return self._worker.submit(op, fn, fallback, self._timed_out if cut else None)

    def _timed_out(self, op: Op) -> None:
        self.stats.add(timeouts=1)
        if op.kind == "setup":
            self.stats.add(setup_failures=1)
        self._degrade(f"{op.kind} passed its deadline")

    # -- state ---------------------------------------------------------------------------------

    def _retry(self) -> None:
        """Clock thread, every ``retry_s``: probe (or set up again) while degraded and idle."""
        if self._state != DEGRADED or self._probing or not self._worker.idle:
            return
        self._probing = True
        timeout = self.url.timeout_ms / 1000 if self._relay.connected else self.url.setup_timeout_s
        op = self._submit("probe", lambda: self._relay.probe(self._probe_name), False, timeout, cut=False)
        op.finished.add_done_callback(lambda _: setattr(self, "_probing", False))

    def _degrade(self, reason: str) -> None:
        self._set_state(DEGRADED, reason)

    def _set_state(self, new: str, reason: str) -> None:
        with self._lock:
            old = self._state
            if old == new or old == CLOSED:
                return
            self._state = new
        if new == DEGRADED:
            self.stats.add(degraded=1)
            log.warning("l2 %s degraded, L1 only: %s", self.url.master_addr, reason)
        else:
            self.stats.add(reconnects=int(self._ever_connected))
            self._ever_connected = True
            log.info("l2 %s connected: %s", self.url.master_addr, reason)
