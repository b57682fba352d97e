"""L2 counters and latency histograms, kept as plain numbers for ``status()``.

Updated from the tier's worker and clock threads, read from the daemon's thread: every change and
every snapshot takes one lock (a few hundred calls a second at most; no contention worth a
lock-free design). Histograms are cumulative like Prometheus's (``le`` upper bounds, seconds), so
/metrics can export them without re-bucketing.
"""

from __future__ import annotations

import threading
from collections import Counter

BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, float("inf"))
OPS = ("setup", "put", "get", "exists", "remove", "probe")

# Counters: name -> meaning (docs for the daemon's /metrics; status() returns every one).
COUNTERS = {
    "puts": "put calls answered",
    "put_keys": "keys asked to be stored",
    "put_stored": "keys stored (or already present)",
    "put_full": "keys refused for lack of space (NO_AVAILABLE_HANDLE: segments full, eviction behind)",
    "put_bytes": "bytes stored",
    "gets": "get calls answered",
    "get_keys": "keys asked for",
    "hits": "keys whose bytes landed in full",
    "misses": "keys the store does not hold",
    "get_bytes": "bytes fetched",
    "exists_calls": "exists calls answered",
    "exists_keys": "keys asked about",
    "exists_hits": "keys reported present",
    "removes": "remove calls answered",
    "removed": "keys removed or already absent",
    "errors": "keys failed by an error code other than miss/full/lease",
    "timeouts": "calls answered by their deadline (their keys failed)",
    "rejected": "calls failed fast: tier not connected (degraded, connecting, closed)",
    "rejected_keys": "keys of those calls",
    "setup_failures": "connection attempts that failed or timed out",
    "degraded": "times the tier went degraded",
    "reconnects": "times it came back",
    "probes": "health probes sent while degraded",
}


class L2Stats:
    def __init__(self):
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self.codes: Counter[str] = Counter()
        self._hist = {op: [0] * len(BUCKETS) for op in OPS}
        self._sum = {op: 0.0 for op in OPS}
        self._n = {op: 0 for op in OPS}

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self.counts[name] += n

    def code(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.codes[name] += n

    def observe(self, op: str, seconds: float) -> None:
        with self._lock:
            hist = self._hist[op]
            for i, le in enumerate(BUCKETS):
                if seconds <= le:
                    hist[i] += 1
            self._sum[op] += seconds
            self._n[op] += 1

    def snapshot(self) -> dict:
        with self._lock:
            out: dict = dict(self.counts)
            out["errors_by_code"] = dict(sorted(self.codes.items()))
            out["latency_s"] = {
                op: {
                    "le": [str(b) for b in BUCKETS],
                    "counts": list(self._hist[op]),
                    "sum": self._sum[op],
                    "count": self._n[op],
                }
                for op in OPS
            }
        return out
