"""Counters and histograms. /status and /metrics read the same numbers (docs/protocol.md lists them)."""

from __future__ import annotations

import time
from collections import Counter
from operator import itemgetter

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tierd.protocol.errors import ErrorCode

# Counters every reply path maintains; names are the /status keys, prefixed tierd_ on /metrics.
COUNTERS = (
    ("lookups", "LOOKUP requests answered"),
    ("lookup_chunks", "chunks asked for by LOOKUP"),
    ("hit_chunks", "chunks LOOKUP reported servable"),
    ("stores", "STORE requests answered"),
    ("stored_chunks", "chunks newly stored"),
    ("stored_bytes", "bytes copied into the pool"),
    ("store_rejects", "chunks answered 'rejected': no room even after eviction"),
    ("evictions", "objects evicted to make room"),
    ("retrieves", "RETRIEVE requests answered"),
    ("retrieved_chunks", "chunks fully retrieved"),
    ("retrieved_bytes", "bytes copied out of the pool"),
    ("retrieve_failed_blocks", "block ids RETRIEVE reported as failed"),
    ("leases_granted", "leases handed out by LOOKUP"),
    ("leases_expired", "leases dropped by TTL or by their client's death"),
    ("sessions_reaped", "clients dropped after --heartbeat-timeout-s of silence"),
    ("sessions_disconnected", "clients dropped at once when their connection closed"),
    ("evicted_polls", "EVICTED requests answered"),
    ("evicted_keys", "chunk keys EVICTED replies carried"),
    ("evicted_missed", "EVICTED replies that said missed: the caller may have lost removals"),
    ("errors", "requests answered with an error"),
)


# Where a STORE's or RETRIEVE's time goes in the daemon, each stage the time until it ended, from
# the request's arrival (the frame read) on; /status request_stages sums them per op.
STAGES = (
    ("wait", "waited for the main loop, behind the requests read before it (tierd.core.backlog)"),
    ("plan", "decoded, checked and planned (objects allocated or found, copies listed)"),
    ("lane", "waited for its rank's transfer lane (an earlier copy of the rank, or a copy thread)"),
    ("copy", "the copy call: a CPU rank's memcpy, a GPU rank's DMAs queued"),
    ("device", "queued DMAs finished, as the lane's waiter thread saw it"),
    ("return", "handed back to the main loop"),
    ("early reply", "a reply sent once the copies were queued (a GPU RETRIEVE's)"),
    ("reply", "committed or aborted, and the reply sent"),
    ("finish", "committed after an early reply"),
)


class Stats:
    def __init__(self):
        self.started = time.time()
        self.counts: Counter[str] = Counter()
        self.errors_by_code: Counter[str] = Counter()
        self.registry = CollectorRegistry(auto_describe=True)
        self.op_seconds = Histogram(
            "tierd_op_seconds",
            "Time from a request's arrival to its reply, by op",
            ["op"],
            registry=self.registry,
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10),
        )
        self.op_bytes = Histogram(
            "tierd_op_bytes",
            "Bytes copied per STORE or RETRIEVE",
            ["op"],
            registry=self.registry,
            buckets=tuple(float(1 << s) for s in range(12, 36, 2)),
        )
        self._seconds_of: dict[str, Histogram] = {}  # op -> its op_seconds child
        self.stage_seconds: dict[str, Counter[str]] = {}  # op -> stage (STAGES) -> seconds
        self.stage_jobs: Counter[str] = Counter()  # op -> jobs whose stages are counted

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def error(self, code_name: str) -> None:
        self.counts["errors"] += 1
        self.errors_by_code[code_name] += 1

    def observe(self, op: str, seconds: float, nbytes: int | None = None) -> None:
        child = self._seconds_of.get(op)
        if child is None:  # (``labels`` takes a lock and builds a key: a few µs a request)
            child = self._seconds_of[op] = self.op_seconds.labels(op)
        child.observe(seconds)
        if nbytes is not None:
            self.op_bytes.labels(op).observe(nbytes)

    def stages(self, op: str, stamps: list[tuple[str, float]]) -> None:
        """Count a finished job's stages: ``stamps`` (stage, when it ended), the first its arrival
        (tierd.core.jobs.Job.stamps; stamps of two threads, so put in time order here)."""
        acc = self.stage_seconds.get(op)
        if acc is None:
            acc = self.stage_seconds[op] = Counter()
        stamps = sorted(stamps, key=itemgetter(1))
        for (_, t0), (stage, t1) in zip(stamps, stamps[1:]):
            acc[stage] += t1 - t0
        self.stage_jobs[op] += 1

    def stages_status(self) -> dict:
        """/status ``request_stages``: per op, the jobs counted and seconds per stage (sums)."""
        return {
            op: {"jobs": self.stage_jobs[op], "seconds": {k: round(v, 6) for k, v in acc.items()}}
            for op, acc in sorted(self.stage_seconds.items())
        }

    def install(self, gauges, extra=None, live=None) -> None:
        """``gauges()`` returns the live /status dict; scraped values come from it. ``extra(status)``
        yields more families (the second tier's: given by the daemon, so nothing here imports it);
        ``live()`` those read on the scraping thread after the status came (``live_families``)."""
        self.registry.register(_Collector(self, gauges, extra, live))


def live_families(beat_age_s: float, http):
    """What the HTTP thread reads without the main loop: how long since that loop last beat (it beats
    at every housekeeping, several times a second; /healthz fails past tierd.daemon.status.STALL_S), asked
    after the status, which waits up to 5 s for a stalled loop; and the HTTP server's own counts."""
    yield GaugeMetricFamily(
        "tierd_main_loop_heartbeat_age_seconds",
        "seconds since the main loop last beat (a stalled loop: past 5 s, /healthz fails)",
        value=round(beat_age_s, 3),
    )
    if http is None:
        return
    for name, attr, doc in (
        (
            "http_thread_restarts",
            "restarts",
            "times the HTTP accepting thread had ended and was started again",
        ),
        (
            "http_failures",
            "failures",
            "exceptions the HTTP server survived (a connection closed, or a loop reset)",
        ),
        (
            "http_refused",
            "refused",
            "HTTP connections answered 503: too many open, or too many being answered",
        ),
        ("http_timed_out", "timed_out", "HTTP connections closed before their request arrived in time"),
    ):
        yield CounterMetricFamily(f"tierd_{name}", doc, value=getattr(http, attr))


class _Collector:
    def __init__(self, stats: Stats, gauges, extra=None, live=None):
        self.stats = stats
        self.gauges = gauges
        self.extra = extra
        self.live = live

    def describe(self):
        return []

    def collect(self):
        status = self.gauges()
        for name, doc in COUNTERS:
            yield CounterMetricFamily(f"tierd_{name}", doc, value=status[name])
        err = CounterMetricFamily(
            "tierd_errors_by_code", "requests answered with an error, by code", labels=["code"]
        )
        for code in sorted({c.name for c in ErrorCode} | set(self.stats.errors_by_code)):
            err.add_metric([code], self.stats.errors_by_code.get(code, 0))  # every code: rates from 0
        yield err
        stage = CounterMetricFamily(
            "tierd_request_stage_seconds",
            "seconds STORE and RETRIEVE spent in each stage in the daemon, by op and stage",
            labels=["op", "stage"],
        )
        jobs = CounterMetricFamily(
            "tierd_request_stage_jobs", "STORE and RETRIEVE copies whose stages are counted", labels=["op"]
        )
        for op, acc in sorted(self.stats.stage_seconds.items()):
            jobs.add_metric([op], self.stats.stage_jobs[op])
            for name, seconds in sorted(acc.items()):
                stage.add_metric([op, name], seconds)
        yield stage
        yield jobs
        for name, doc in (
            ("memory_configured_bytes", "ceiling of the host pool (--l1-size-gb)"),
            ("memory_total_bytes", "host memory backed now (all segments)"),
            ("memory_segments", "segments backed"),
            ("memory_next_segment_bytes", "bytes the pool's next growth backs (0 at the ceiling)"),
            ("memory_ahead_bytes", "host memory backed ahead for the next growths, not in a segment yet"),
            ("memory_used_bytes", "bytes held by objects"),
            ("memory_pinned_bytes", "pool bytes registered with CUDA (page-locked)"),
            ("largest_free_bytes", "the largest new object a STORE places now without evicting"),
            ("largest_storable_bytes", "the largest new object a STORE places now, evicting if need be"),
            ("leased_bytes", "bytes pinned by leases"),
            ("objects", "objects in the index"),
            ("leases_active", "leases outstanding"),
            ("sessions", "connected clients"),
        ):
            yield GaugeMetricFamily(f"tierd_{name}", doc, value=status[name])
        per = GaugeMetricFamily("tierd_group_objects", "objects per engine group", labels=["group"])
        for group, n in sorted(status["group_objects"].items()):
            per.add_metric([group], n)
        yield per
        yield GaugeMetricFamily("tierd_instances", "registered ranks", value=len(status["instances"]))
        yield from _tenant_families(status)
        yield GaugeMetricFamily(
            "tierd_hit_ratio",
            "hit_chunks / lookup_chunks since start (0 before any LOOKUP)",
            value=status["hit_chunks"] / status["lookup_chunks"] if status["lookup_chunks"] else 0.0,
        )
        policy = status["eviction_policy"]
        info = GaugeMetricFamily(
            "tierd_eviction_policy", "1 for the policy evicting (--eviction-policy)", labels=["policy"]
        )
        info.add_metric([policy["name"]], 1)
        yield info
        why = CounterMetricFamily(
            "tierd_evictions_by_reason",
            "objects evicted to make room, by the policy's reason",
            labels=["reason"],
        )
        for reason, n in sorted(policy["evictions_by_reason"].items()):
            why.add_metric([reason], n)
        yield why
        if "reuse_distance" in policy:
            yield GaugeMetricFamily(
                "tierd_reuse_distance_ticks",
                "reuse policy: B, the reuse distance it measures",
                value=policy["reuse_distance"],
            )
            yield GaugeMetricFamily(
                "tierd_reuse_bonus_scale",
                "reuse policy: s, the scale of its bonus",
                value=policy["bonus_scale"],
            )
            yield GaugeMetricFamily(
                "tierd_reuse_bonus_gate",
                "reuse policy: the share of its bonus kept while an LRU shadow hits more (1: whole)",
                value=policy["bonus_gate"],
            )
        evlog = status["eviction_log"]
        yield GaugeMetricFamily(
            "tierd_eviction_log_records", "evicted chunks remembered for EVICTED", value=evlog["records"]
        )
        yield GaugeMetricFamily(
            "tierd_eviction_log_seq",
            "the eviction log's last seq (chunks recorded this boot)",
            value=evlog["seq"],
        )
        if self.extra is not None:
            yield from self.extra(status)
        if self.live is not None:
            yield from self.live()
        warm = status.get("warm_restart")
        if warm is not None:  # --pool-dir
            yield GaugeMetricFamily(
                "tierd_warm_restart_objects", "objects recovered at start (0: cold)", value=warm["objects"]
            )
            yield GaugeMetricFamily(
                "tierd_warm_restart_seconds",
                "seconds the start took to recover the pool",
                value=warm["seconds"],
            )
            yield GaugeMetricFamily(
                "tierd_pool_persisting",
                "1 while the pool folder is kept restartable, 0 once a journal or index write failed",
                value=0 if warm["persist_error"] else 1,
            )


def _tenant_families(status: dict):
    """Per tenant (``default`` for the daemon's own user's, else ``uid:N`` / ``tcp:NAME``): the
    objects and bytes its namespaces hold and the ranks it has registered."""
    objects: Counter[str] = Counter()
    held: Counter[str] = Counter()
    ranks: Counter[str] = Counter()
    for ns in status["namespaces"]:
        objects[ns["tenant"] or "default"] += ns["objects"]
        held[ns["tenant"] or "default"] += ns["bytes"]
    for inst in status["instances"]:
        ranks[inst["tenant"] or "default"] += 1
    for name, doc, values in (
        ("tenant_objects", "objects held, per tenant", objects),
        ("tenant_bytes", "pool bytes (slots) held, per tenant", held),
        ("tenant_instances", "registered ranks, per tenant", ranks),
    ):
        fam = GaugeMetricFamily(f"tierd_{name}", doc, labels=["tenant"])
        for tenant, n in sorted(values.items()):
            fam.add_metric([tenant], n)
        yield fam
