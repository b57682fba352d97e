"""TierdConnector's figures in vLLM's own metrics: the engine's Prometheus ``/metrics`` and its
periodic ``KV Transfer metrics:`` log line.

The path is vLLM's connector-stats interface. Every step vLLM asks each side of the connector for
what happened since the last ask (``get_kv_connector_stats``): the worker side's figures travel
with the model runner's output and are summed over the ranks, the scheduler side's are joined to
them in the engine core, and their ``data`` goes to the front end. There vLLM rebuilds them
(``build_kv_connector_stats``), sums them over each logging interval for the log line
(``reduce``), and hands every step's to the connector's Prometheus metrics (``build_prom_metrics``,
``metrics_prom.TierdPromMetrics``), labelled ``model_name`` and ``engine`` like vLLM's own.

Series (``FIGURES``): where a figure means what one of vLLM's offloading connector's does, it has
that name, so dashboards built on ``vllm:kv_offload_*`` show the tier as they show vLLM's own CPU
offload:

- ``vllm:kv_offload_load_bytes_total`` / ``_load_time_total`` / ``_load_size``: bytes RETRIEVE
  copied into the engine's blocks (failed blocks left out), seconds from each RETRIEVE sent to its
  answer (summed), and bytes per load (histogram, vLLM's buckets);
- ``vllm:kv_offload_store_bytes_total`` / ``_store_time_total`` / ``_store_size``: the same for
  the chunks STORE stored (chunks the tier had already are not counted);
- ``vllm:kv_offload_lookup_sync_delay_seconds``: seconds in the scheduler's hook for a request the
  tier was asked about (each call); ``vllm:kv_offload_lookup_async_delay_seconds``: from the hook
  first returning "not answered yet" to the call that saw the answer;
- ``vllm:kv_offload_allocation_failure_total``: chunks the daemon answered ``rejected`` (no room
  even after eviction).

tierd's own (no offload equivalent):

- ``vllm:tierd_lookups_total``, ``vllm:tierd_lookup_tokens_total``, ``vllm:tierd_hit_tokens_total``:
  LOOKUPs sent, the prompt tokens they asked about (whole chunks) and of those the tokens the tier
  held; ``hit / lookup`` tokens is the hit ratio the engine saw;
- ``vllm:tierd_failed_loads_total``: requests whose load failed (blocks missing, an error, a
  deadline): vLLM recomputed them, and they bypass the tier from then on;
- ``vllm:tierd_failed_stores_total``: STOREs that failed or timed out (their chunks are misses later);
- ``vllm:tierd_bypassed_requests_total{reason}``: requests that did not use the tier, counted once
  per request and reason (``BYPASS_REASONS``);
- ``vllm:tierd_daemon_connected``: 1 while the scheduler side has a session with the daemon and its
  connection is up. vLLM updates it with the engine's steps: an idle engine keeps the last value.

vLLM registers one connector's metrics: these names would collide with OffloadingConnector's under
one MultiConnector.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from tierd_client.vllm_connector.keys import unkeyable

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # pragma: no cover - the recorders work without vLLM (tools, tests)
    KVConnectorStats = object  # type: ignore[assignment,misc]

# vLLM's own buckets for transfer sizes and lookup delays (vllm/distributed/kv_transfer/
# kv_connector/v1/offloading/metrics.py), so one dashboard's quantiles mean the same for both
SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
SYNC_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1)
ASYNC_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5, 10)

# figure key (in the stats' data) -> (metric name as registered, kind, help, histogram buckets)
FIGURES: dict[str, tuple[str, str, str, tuple | None]] = {
    "load_bytes": ("vllm:kv_offload_load_bytes", "counter", "Bytes the tier loaded into the KV cache", None),
    "load_s": ("vllm:kv_offload_load_time", "counter", "Seconds of tier loads (RETRIEVE round trips)", None),
    "load_size": ("vllm:kv_offload_load_size", "histogram", "Bytes per load from the tier", SIZE_BUCKETS),
    "store_bytes": ("vllm:kv_offload_store_bytes", "counter", "Bytes the tier stored of the KV cache", None),
    "store_s": ("vllm:kv_offload_store_time", "counter", "Seconds of tier stores (STORE round trips)", None),
    "store_size": ("vllm:kv_offload_store_size", "histogram", "Bytes per store into the tier", SIZE_BUCKETS),
    "lookup_sync_s": (
        "vllm:kv_offload_lookup_sync_delay_seconds",
        "histogram",
        "Seconds in one scheduler lookup call for a request the tier was asked about",
        SYNC_BUCKETS,
    ),
    "lookup_async_s": (
        "vllm:kv_offload_lookup_async_delay_seconds",
        "histogram",
        "Seconds from a lookup first deferring to the call that saw the tier's answer",
        ASYNC_BUCKETS,
    ),
    "rejected_chunks": (
        "vllm:kv_offload_allocation_failure",
        "counter",
        "Chunks the tier refused to store: no room even after eviction",
        None,
    ),
    "lookups": ("vllm:tierd_lookups", "counter", "LOOKUPs sent to the tier", None),
    "lookup_tokens": ("vllm:tierd_lookup_tokens", "counter", "Prompt tokens LOOKUPs asked about", None),
    "hit_tokens": ("vllm:tierd_hit_tokens", "counter", "Of the tokens asked, those the tier held", None),
    "failed_loads": (
        "vllm:tierd_failed_loads",
        "counter",
        "Requests whose load from the tier failed and were recomputed",
        None,
    ),
    "failed_stores": ("vllm:tierd_failed_stores", "counter", "STOREs that failed or timed out", None),
    "connected": (
        "vllm:tierd_daemon_connected",
        "gauge",
        "1 while the connector has a session with the tier daemon",
        None,
    ),
}
BYPASSED = "vllm:tierd_bypassed_requests"
# why a request did not use the tier
BYPASS_REASONS = {
    "short": "its prompt is shorter than one chunk (tierd.chunk_tokens)",
    "no_daemon": "no daemon answered (not running, refused the session, or its connection is down)",
    "request": "its kv_transfer_params said so (tierd.skip, or max_load_tokens below a chunk)",
    "failed_load": "a load of it failed earlier: it is recomputed without the tier",
    "unkeyable": "it has no token ids to key (prompt embeddings)",
    "lookup_failed": "its LOOKUP was not sent, or failed",
}
BYPASS_KEY = "bypassed:"  # counter keys of BYPASSED, by reason


@dataclass
class TierdConnectorStats(KVConnectorStats):
    """One interval's figures: ``data`` = {"counters": {key: n}, "gauges": {key: v},
    "samples": {key: [observations]}}, keys of ``FIGURES`` (``bypassed:<reason>`` for
    BYPASSED). Plain dicts of str, numbers and lists: vLLM sends them between processes."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {"counters": {}, "gauges": {}, "samples": {}}

    def count(self, key: str, n: float = 1) -> None:
        c = self.data["counters"]
        c[key] = c.get(key, 0) + n

    def sample(self, key: str, value: float) -> None:
        self.data["samples"].setdefault(key, []).append(value)

    def aggregate(self, other) -> TierdConnectorStats:
        if other is None or other.is_empty():
            return self
        for key, n in other.data["counters"].items():
            self.count(key, n)
        self.data["gauges"].update(other.data["gauges"])  # the latest wins
        for key, values in other.data["samples"].items():
            self.data["samples"].setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's sums, for vLLM's log line."""
        c, g, s = self.data["counters"], self.data["gauges"], self.data["samples"]
        out: dict[str, int | float] = {}
        for key in ("lookups", "lookup_tokens", "hit_tokens"):
            out[key] = int(c.get(key, 0))
        if out["lookup_tokens"]:
            out["hit_ratio"] = round(out["hit_tokens"] / out["lookup_tokens"], 3)
        for op in ("load", "store"):
            nbytes, secs = c.get(f"{op}_bytes", 0), c.get(f"{op}_s", 0.0)
            out[f"{op}s"] = len(s.get(f"{op}_size", ()))
            out[f"{op}_MB"] = round(nbytes / 1e6, 3)
            out[f"{op}_s"] = round(secs, 4)
            if secs > 0:
                out[f"{op}_GBps"] = round(nbytes / secs / 1e9, 3)
        for key in ("failed_loads", "failed_stores", "rejected_chunks"):
            if c.get(key):
                out[key] = int(c[key])
        for key, n in sorted(c.items()):
            if key.startswith(BYPASS_KEY) and n:
                out[f"bypassed_{key[len(BYPASS_KEY) :]}"] = int(n)
        if "connected" in g:
            out["daemon_connected"] = int(g["connected"])
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in ("counters", "gauges", "samples"))


class _Recorder:
    """Figures since the last ``take``; written by the engine's thread and the client's I/O thread
    (a future's callbacks), hence the lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats = TierdConnectorStats()

    def count(self, key: str, n: float = 1) -> None:
        with self._lock:
            self._stats.count(key, n)

    def sample(self, key: str, value: float) -> None:
        with self._lock:
            self._stats.sample(key, value)

    def take(self) -> TierdConnectorStats | None:
        with self._lock:
            out, self._stats = self._stats, TierdConnectorStats()
        return None if out.is_empty() else out


class SchedulerMetrics(_Recorder):
    """The scheduler side's figures: lookups, hits, bypasses, failed loads, the session."""

    def __init__(self, side):
        super().__init__()
        self.side = side  # SchedulerSide
        self._asked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # LOOKUP future -> _Asked
        self._why: dict[str, set[str]] = {}  # request -> bypass reasons counted for it

    def lookup_sent(self, fut, tokens: int) -> None:
        self._asked[fut] = _Asked(tokens)
        self.count("lookups")
        self.count("lookup_tokens", tokens)

    def queried(self, request, num_computed_tokens: int, out, seconds: float) -> None:
        """After the hook ``get_num_new_matched_tokens`` answered ``out`` in ``seconds``."""
        st = self.side.reqs.get(request.request_id)
        fut = st.lookup if st is not None else None
        asked = self._asked.get(fut) if fut is not None else None
        if asked is not None:
            self.sample("lookup_sync_s", seconds)
            if out[0] is None:
                if asked.deferred_at is None:
                    asked.deferred_at = time.perf_counter()
            elif not asked.answered and fut.done():
                asked.answered = True
                if asked.deferred_at is not None:
                    self.sample("lookup_async_s", time.perf_counter() - asked.deferred_at)
                if fut.exception() is None:
                    chunks = fut.result().chunks
                    self.count("hit_tokens", min(chunks * self.side.geo.chunk_tokens, asked.tokens))
        if out[0] == 0 and st is not None:
            why = bypass_reason(self.side, st, request, num_computed_tokens)
            seen = self._why.setdefault(request.request_id, set()) if why else None
            if why and why not in seen:
                seen.add(why)
                self.count(BYPASS_KEY + why)

    def loads_failed(self, n: int) -> None:
        if n:
            self.count("failed_loads", n)

    def take(self) -> TierdConnectorStats:
        """Never empty: the session gauge goes with every step, so it follows the daemon."""
        out = super().take() or TierdConnectorStats()
        out.data["gauges"]["connected"] = 1 if daemon_connected(self.side.client) else 0
        if self._why:
            live = self.side.reqs
            self._why = {r: w for r, w in self._why.items() if r in live}
        return out


class _Asked:
    __slots__ = ("tokens", "deferred_at", "answered")

    def __init__(self, tokens: int):
        self.tokens, self.deferred_at, self.answered = tokens, None, False


class WorkerMetrics(_Recorder):
    """A rank's figures: bytes and seconds of its loads and stores, as the daemon answered them."""

    def __init__(self, reg):
        super().__init__()
        self.reg = reg  # the rank's RankRegistration: its page layout, once published
        self._block_bytes: list[int] | None = None

    @property
    def block_bytes(self) -> list[int]:
        """Bytes of one block of each group on this rank, all its layers, as its layout has them
        (what the daemon copies per block id)."""
        if self._block_bytes is None and self.reg.layout is not None:
            self._block_bytes = [sum(layer.block_bytes for layer in g.layers) for g in self.reg.layout.groups]
        return self._block_bytes or []

    def _bytes(self, ids: list[list[int]], null: int) -> int:
        """Bytes of one chunk's non-null blocks (``ids``: per group)."""
        sizes = self.block_bytes
        return sum(
            sizes[g] * sum(1 for b in blocks if b != null) for g, blocks in enumerate(ids) if g < len(sizes)
        )

    def load_sent(self, fut, ids: list[list[list[int]]], null: int) -> None:
        """A RETRIEVE of ``ids`` (per chunk, per group) went out as ``fut``."""
        nbytes, t0 = sum(self._bytes(c, null) for c in ids), time.perf_counter()
        fut.add_done_callback(lambda f: self._load_done(f, t0, nbytes))

    def _load_done(self, fut, t0: float, nbytes: int) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return  # the scheduler side counts the failed load
        sizes = self.block_bytes
        nbytes -= sum(sizes[int(g)] for g, _ in fut.result().failed if 0 <= int(g) < len(sizes))
        with self._lock:
            self._stats.count("load_bytes", nbytes)
            self._stats.count("load_s", time.perf_counter() - t0)
            self._stats.sample("load_size", nbytes)

    def store_sent(self, fut, ids: list[list[list[int]]], null: int) -> None:
        """A STORE of ``ids`` (per chunk, per group) went out as ``fut``."""
        sizes, t0 = [self._bytes(c, null) for c in ids], time.perf_counter()
        fut.add_done_callback(lambda f: self._store_done(f, t0, sizes))

    def _store_done(self, fut, t0: float, sizes: list[int]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            self.count("failed_stores")
            return
        results = fut.result().results
        nbytes = sum(n for n, r in zip(sizes, results) if r == "stored")
        with self._lock:
            self._stats.count("store_bytes", nbytes)
            self._stats.count("store_s", time.perf_counter() - t0)
            self._stats.sample("store_size", nbytes)
            self._stats.count("rejected_chunks", sum(1 for r in results if r == "rejected"))


def daemon_connected(client) -> bool:
    """Whether ``client`` has a session whose connection is up (False for any other object)."""
    return bool(getattr(client, "connected", False))


def bypass_reason(side, st, request, num_computed_tokens: int) -> str | None:
    """Why the hook gave ``request`` no tokens from the tier, where that was a bypass (None: it
    asked and the tier held nothing beyond the local cache, or the local cache holds the prompt).
    In the order the hook (``SchedulerSide``) decides."""
    C = side.geo.chunk_tokens
    if st.bypass:
        return "failed_load"
    if unkeyable(request):
        return "unkeyable"
    if not daemon_connected(side.client):
        return "no_daemon"
    usable = request.num_tokens - 1 if side.need_spare_token else request.num_tokens
    if usable < C:
        return "short"
    cap = st.caps.load_cap(num_computed_tokens, C)
    if usable // C * C <= num_computed_tokens:
        return None  # the engine's own cache holds every whole chunk
    if cap is not None and min(usable, cap) // C * C <= num_computed_tokens:
        return "request"
    fut = st.lookup
    if fut is None or (fut.done() and fut.exception() is not None):
        return "lookup_failed"
    return None
