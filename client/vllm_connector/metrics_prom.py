"""TierdConnector's series in vLLM's Prometheus ``/metrics`` (``TierdConnector.build_prom_metrics``):
the figures of ``metrics`` (``FIGURES``, ``BYPASSED``) per engine, observed from each step's stats.

vLLM's CPU offloading also keeps its older names during their deprecation, with a
``transfer_type`` label (``CPU_to_GPU`` a load, ``GPU_to_CPU`` a store): ``vllm:kv_offload_total_bytes``,
``vllm:kv_offload_total_time`` and ``vllm:kv_offload_size``. The tier reports them too (``TWINS``),
so a dashboard built on either generation of vLLM's names shows it.
"""

from __future__ import annotations

from typing import Any

from tierd_client.vllm_connector.metrics import BYPASS_KEY, BYPASS_REASONS, BYPASSED, FIGURES, SIZE_BUCKETS

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
except ImportError:  # pragma: no cover - vLLM without connector metrics: nothing registers these
    KVConnectorPromMetrics = object  # type: ignore[assignment,misc]

LOAD, STORE = "CPU_to_GPU", "GPU_to_CPU"
# figure key -> (vLLM's deprecated name, kind, transfer_type)
TWINS = {
    "load_bytes": ("vllm:kv_offload_total_bytes", "counter", LOAD),
    "store_bytes": ("vllm:kv_offload_total_bytes", "counter", STORE),
    "load_s": ("vllm:kv_offload_total_time", "counter", LOAD),
    "store_s": ("vllm:kv_offload_total_time", "counter", STORE),
    "load_size": ("vllm:kv_offload_size", "histogram", LOAD),
    "store_size": ("vllm:kv_offload_size", "histogram", STORE),
}
TWIN_HELP = {  # vLLM's words
    "vllm:kv_offload_total_bytes": "Number of bytes offloaded by KV connector",
    "vllm:kv_offload_total_time": "Total time measured by all KV offloading operations",
    "vllm:kv_offload_size": "Histogram of KV offload transfer size, in bytes.",
}


class TierdPromMetrics(KVConnectorPromMetrics):
    """``FIGURES``, BYPASSED and ``TWINS`` as Prometheus series of the front end, per engine. Every
    series exists from the start (0), so rates and dashboards have it before its first event."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        kinds = {"counter": self._counter_cls, "gauge": self._gauge_cls, "histogram": self._histogram_cls}
        self._children: dict[tuple[int, str], Any] = {}
        for key, (name, kind, doc, buckets) in FIGURES.items():
            kw: dict[str, Any] = {"name": name, "documentation": doc, "labelnames": labelnames}
            if buckets is not None:
                kw["buckets"] = buckets
            if kind == "gauge":
                kw["multiprocess_mode"] = "mostrecent"
            metric = kinds[kind](**kw)
            for engine, values in per_engine_labelvalues.items():
                self._children[(engine, key)] = metric.labels(*values)
        bypassed = self._counter_cls(
            name=BYPASSED,
            documentation="Requests that did not use the tier, by reason",
            labelnames=[*labelnames, "reason"],
        )
        for engine, values in per_engine_labelvalues.items():
            for reason in BYPASS_REASONS:
                self._children[(engine, BYPASS_KEY + reason)] = bypassed.labels(*values, reason)
        self._twins: dict[tuple[int, str], Any] = {}
        made: dict[str, Any] = {}
        for key, (name, kind, transfer) in TWINS.items():
            if name not in made:
                kw = {"name": name, "documentation": TWIN_HELP[name]}
                kw["labelnames"] = [*labelnames, "transfer_type"]
                if kind == "histogram":
                    kw["buckets"] = SIZE_BUCKETS
                made[name] = kinds[kind](**kw)
            for engine, values in per_engine_labelvalues.items():
                self._twins[(engine, key)] = made[name].labels(*values, transfer)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        data = transfer_stats_data or {}
        for key, n in data.get("counters", {}).items():
            for child in (self._children.get((engine_idx, key)), self._twins.get((engine_idx, key))):
                if child is not None and n:
                    child.inc(n)
        for key, value in data.get("gauges", {}).items():
            child = self._children.get((engine_idx, key))
            if child is not None:
                child.set(value)
        for key, values in data.get("samples", {}).items():
            for child in (self._children.get((engine_idx, key)), self._twins.get((engine_idx, key))):
                if child is not None:
                    for v in values:
                        child.observe(v)
