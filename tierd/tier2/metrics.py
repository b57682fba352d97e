"""/metrics families of the second tier, from the ``l2`` map of /status (docs/protocol.md 22).

Nothing here imports Mooncake or the tier: a daemon without --l2-url has no ``l2`` map and gets
no ``tierd_l2_*`` family. Counters are the tier's (tierd.tier2.stats.COUNTERS: calls, keys, bytes,
errors, state changes) and the daemon's (tierd.tier2.bridge.COUNTERS: lookups, fetches,
write-back); latency histograms are the tier's, per call kind, cumulative as Prometheus wants.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from tierd.tier2.bridge import COUNTERS
from tierd.tier2.stats import COUNTERS as TIER_COUNTERS

GAUGES = (
    ("connected", "1 while the tier is connected to its master, else 0 (degraded: L1 only)"),
    ("queued", "calls queued or running in the tier"),
    ("queued_bytes", "bytes of those calls"),
    ("registered_bytes", "pool memory registered with Mooncake"),
    ("segment_bytes", "memory this daemon contributes to the store (segment_gb)"),
    ("writeback_queued", "L1 objects waiting for their put"),
    ("writeback_queued_bytes", "bytes of those objects"),
    ("writeback_inflight_bytes", "bytes of the put in flight (their L1 slots pinned)"),
    ("fetching", "objects being fetched into L1"),
    ("waiting_lookups", "LOOKUPs waiting for L2's answer"),
    ("waiting_retrieves", "RETRIEVEs waiting for their fetches"),
)


def families(status: dict | None):
    """The ``tierd_l2_*`` families; none without a second tier."""
    if not status:
        return
    for name, doc in (*TIER_COUNTERS.items(), *COUNTERS.items()):
        yield CounterMetricFamily(f"tierd_l2_{name}", doc, value=status[name])
    err = CounterMetricFamily(
        "tierd_l2_errors_by_code", "keys failed by a Mooncake error, by code", labels=["code"]
    )
    for code, n in sorted(status["errors_by_code"].items()):
        err.add_metric([code], n)
    yield err
    for name, doc in GAUGES:
        yield GaugeMetricFamily(f"tierd_l2_{name}", doc, value=float(status[name]))
    hist = HistogramMetricFamily(
        "tierd_l2_op_seconds", "seconds from a tier call's submission to its answer", labels=["op"]
    )
    for op, h in sorted(status["latency_s"].items()):
        buckets = [("+Inf" if le == "inf" else le, n) for le, n in zip(h["le"], h["counts"])]
        hist.add_metric([op], buckets=buckets, sum_value=h["sum"])
    yield hist
