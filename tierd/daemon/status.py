"""The /status object, and how the HTTP thread gets it without touching the daemon's state.

Only the main loop reads the registry and the pool. It also beats here (``beat``, at every
housekeeping), and /healthz reads that without waiting: a loop stuck in a call, or gone, fails
/healthz within STALL_S while the HTTP thread still answers. The HTTP thread asks the board
(``StatusBoard.ask``); the main loop answers pending asks between requests (``answer``). Once
the daemon is stopping or the loop is gone, asks are answered from the last status built, marked
``"stopping": true``, so an operator never gets a half-torn-down state or an error.
"""

from __future__ import annotations

import functools
import gc
import os
import queue
import threading
import time
from concurrent.futures import Future

from tierd import __version__
from tierd.base.stats import COUNTERS
from tierd.daemon import warm
from tierd.protocol.versions import versions

ASK_TIMEOUT_S = 5.0
STALL_S = 5.0  # /healthz fails once the main loop has not beaten for this long (as /status gives up)


class StatusBoard:
    def __init__(self):
        self.stopping = False
        self.beat = time.monotonic()  # the main loop's heartbeat: set at least every housekeeping
        self._last: dict = {}
        self._lock = threading.Lock()
        self._asks: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.open = True

    def publish(self, status: dict) -> None:
        with self._lock:
            self._last = status

    def last(self) -> dict:
        with self._lock:
            return {**self._last, "stopping": True} if self.stopping else dict(self._last)

    def health(self) -> str | None:
        """/healthz, on the HTTP thread without waiting: None while serving, else why not (stopping,
        or the main loop silent for STALL_S: stuck in a call, or its thread gone)."""
        if self.stopping:
            return "stopping"
        silent = time.monotonic() - self.beat
        if silent > STALL_S:
            return f"main loop stalled: no heartbeat for {silent:.1f} s"
        return None

    def ask(self, timeout: float = ASK_TIMEOUT_S) -> dict:
        """A fresh status from the main loop (any thread but the main loop's)."""
        if self.stopping or not self.open:
            return self.last()
        fut: Future = Future()
        self._asks.put(fut)
        try:
            os.write(self._wake_w, b"a")
        except OSError:
            return self.last()
        try:
            return fut.result(timeout)
        except Exception:  # noqa: BLE001 - the loop went away meanwhile
            return self.last()

    def answer(self, build) -> None:
        """On the main loop: build one status for every ask waiting."""
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        futs = []
        while True:
            try:
                futs.append(self._asks.get_nowait())
            except queue.Empty:
                break
        if not futs:
            return
        status = build()
        self.publish(status)
        for f in futs:
            f.set_result(status)

    def close(self) -> None:
        self.open = False
        self.stopping = True
        while True:
            try:
                self._asks.get_nowait().set_result(self.last())
            except queue.Empty:
                break
        for fd in (self.wake_r, self._wake_w):
            os.close(fd)


@functools.cache
def environment_versions() -> dict:
    """tierd's, the key format's and the vLLM of the daemon's environment (read once: the
    installed metadata is scanned, and what the daemon runs does not change under it)."""
    return versions()


def public_namespace(ns) -> dict:
    """A namespace as /status shows it: never its salt (a tenant's secret), only whether it has one."""
    return {
        "model": ns.model,
        "fingerprint": ns.fingerprint,
        "world_size": ns.world_size,
        "salted": bool(ns.salt),
    }


def build_status(daemon) -> dict:
    """The /status object (docs/protocol.md section 16), on the main loop."""
    pool, counts, reg = daemon.pool, daemon.stats.counts, daemon.registry
    huge = pool.segments.huge_pages()  # (reads the kernel's settings: not under the pool's lock)
    versions_here = dict(environment_versions())  # (the first time, reads installed metadata)
    with pool.lock:
        free, storable = pool.room()
        out = {
            "version": __version__,
            "versions": versions_here,
            "boot_id": daemon.boot_id,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - daemon.stats.started, 3),
            "socket": daemon.settings.socket,
            "stopping": daemon.stopping,
            "cuda": bool(daemon.cuda),
            "memory_configured_bytes": pool.configured_bytes,
            "memory_total_bytes": pool.backed_bytes,
            "memory_segments": len(pool.segments.segments),
            "memory_next_segment_bytes": pool.segments.next_segment_bytes(),
            "memory_ahead_bytes": pool.segments.ahead_bytes,
            "memory_used_bytes": pool.used_bytes,
            "memory_pinned_bytes": daemon.cuda.pinned_bytes if daemon.cuda else 0,
            "memory_huge_pages": huge,
            "largest_free_bytes": free,
            "largest_storable_bytes": storable,
            "objects": pool.objects,
            "group_objects": dict(pool.per_group),
            "evictions": pool.evictions,
            "eviction_policy": pool.policy.status(),
            "eviction_log": {
                "capacity": pool.evlog.capacity,
                "records": len(pool.evlog),
                "seq": pool.evlog.seq,
                "dropped": pool.evlog.dropped,
            },
            "pool_grow_error": pool.segments.grow_error,
            "warm_restart": warm.status(pool),
            "namespaces": [
                {
                    **public_namespace(ns),
                    "tenant": reg.ns_tenant.get(ns_id, ""),
                    "objects": pool.per_ns[ns_id],
                    "bytes": pool.per_ns_bytes.get(ns_id, 0),
                }
                for ns_id, ns in reg.namespaces.items()
                if pool.per_ns.get(ns_id)
            ],
        }
    out.update({name: counts.get(name, 0) for name, _ in COUNTERS if name != "evictions"})
    if daemon.cuda:
        out["cuda_detail"] = daemon.cuda.status()
    out["errors_by_code"] = dict(daemon.stats.errors_by_code)
    out["request_stages"] = daemon.stats.stages_status()
    out["l2"] = daemon.l2.status() if daemon.l2 is not None else None
    out["leases_active"] = len(reg.leases)
    out["leased_bytes"] = sum(reg.leased_bytes.values())
    out["gc_frozen_objects"] = gc.get_freeze_count()
    out["sessions"] = len(reg.sessions)
    router = daemon.router
    out["connections"] = {
        "open": router.connections,
        "max": daemon.max_connections,
        "closed_over_cap": router.refused,
    }
    inbox = daemon.inbox
    out["fd_inbox"] = (
        None
        if inbox is None
        else {
            "waiting": inbox.waiting,
            "received": inbox.received,
            "refused": inbox.refused,
            "failed": inbox.failed,
        }
    )
    channel = daemon.channel
    out["lookup_channel"] = (
        None
        if channel is None
        else {
            "connections": len(channel.conns),
            "requests": channel.requests,
            "closed_over_cap": channel.refused,
            "replies_dropped": channel.dropped,
        }
    )
    now = time.monotonic()
    out["instances"] = [
        {
            "instance": inst.name,
            "model": inst.layout.namespace.model,
            "namespace": public_namespace(inst.layout.namespace),
            "tenant": inst.tenant,
            "rank": inst.layout.rank,
            "device": inst.layout.device,
            "copies": _copies(inst.layout),
            "groups": [g.kind.value for g in inst.layout.groups],
            "object_order": ["block" if g.block_major else "layer" for g in inst.layout.groups],
            "last_heartbeat_s_ago": round(now - reg.sessions[inst.session].last_seen, 3)
            if inst.session in reg.sessions
            else None,
        }
        for inst in reg.instances.values()
    ]
    return out


def _copies(layout) -> str:
    """How the daemon moves a rank's bytes: ``shm`` (CPU: its shared-memory files), ``staged`` (GPU:
    through the engine's staging buffer) or ``direct`` (GPU: straight to and from its KV blocks)."""
    if layout.device != "cuda":
        return "shm"
    return "staged" if layout.staging is not None else "direct"
