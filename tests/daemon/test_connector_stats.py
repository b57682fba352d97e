"""The connector's figures in vLLM's own metrics, through vLLM's connector-stats path: vLLM's real
Scheduler drives TierdConnector (both roles, tests/vllm_sim.py) against a real ``tierd serve``; the
worker's stats go with the model runner's output, the scheduler joins its own, and what each step
hands the front end is fed to vLLM's own ``KVConnectorLogging`` (the periodic log line) and
``KVConnectorProm`` (the Prometheus series, on a registry of the test's own).

The bytes the connector reports loaded and stored are the bytes the daemon counted copying; the
bypass reasons, failed loads and the session gauge follow what the requests met."""

from __future__ import annotations

import functools
import random
import time

import pytest

pytest.importorskip("vllm")

from vllm_sim import GroupDef, SimEngine  # noqa: E402

CHUNK = 64
FULL = [GroupDef("full")]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


class Front:
    """vLLM's front-end side of connector stats: its log accumulator and its Prometheus metrics."""

    def __init__(self, vllm_config):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

        self.registry = reg = CollectorRegistry()

        class Prom(KVConnectorProm):  # vLLM's, registering into this test's registry
            _gauge_cls = functools.partial(Gauge, registry=reg)
            _counter_cls = functools.partial(Counter, registry=reg)
            _histogram_cls = functools.partial(Histogram, registry=reg)

        self.prom = Prom(vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
        assert self.prom.prom_metrics is not None, "the connector builds no Prometheus metrics"
        self.logging = KVConnectorLogging(vllm_config.kv_transfer_config)
        self.lines: list[str] = []

    def feed(self, engine: SimEngine) -> None:
        engine.step()  # an idle step: it carries what answers reported since the last one
        for data in engine.connector_stats:
            self.logging.observe(data)
            self.prom.observe(data, 0)
        engine.connector_stats.clear()

    def log(self) -> str:
        self.logging.log(log_fn=lambda fmt, *args: self.lines.append(fmt % args))
        return self.lines[-1] if self.lines else ""

    def series(self) -> dict[str, float]:
        """``name{reason}`` -> value of the connector's series (engine 0)."""
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(generate_latest(self.registry).decode()):
            for s in fam.samples:
                extra = s.labels.get("reason") or s.labels.get("transfer_type")
                key = s.name + (f"{{{extra}}}" if extra else "")
                if "le" not in s.labels:
                    out[key] = s.value
        return out


def daemon_counts(d) -> dict:
    s = d.status()
    return {k: s[k] for k in ("stored_bytes", "retrieved_bytes", "lookups", "store_rejects")}


def test_lookups_hits_bytes_bypasses_and_the_session_reach_vllms_log_line_and_prometheus(tiny_model, daemon):
    tokens = prompt(4 * CHUNK + 10, seed=3)
    base = daemon_counts(daemon)
    a = SimEngine(tiny_model, daemon.endpoint, FULL, chunk_tokens=CHUNK)
    front = Front(a.vllm_config)
    try:
        a.add("a", tokens)
        a.add("short", prompt(CHUNK - 20, seed=4))
        a.add("skip", prompt(3 * CHUNK, seed=5), kv_transfer_params={"tierd.skip": True})
        a.run()
        front.feed(a)
    finally:
        a.close()
    stored = daemon_counts(daemon)
    assert stored["stored_bytes"] - base["stored_bytes"] > 0
    line_a = front.log()

    b = SimEngine(tiny_model, daemon.endpoint, FULL, chunk_tokens=CHUNK)
    try:
        b.add("b", tokens)
        b.run()
        assert b.first_computed("b") == 4 * CHUNK
        front.feed(b)
    finally:
        b.close()
    after = daemon_counts(daemon)
    line_b = front.log()

    got = front.series()
    m = "vllm:tierd_"
    assert got[m + "lookups_total"] == after["lookups"] - base["lookups"] == 2, got
    assert got[m + "lookup_tokens_total"] == 2 * 4 * CHUNK
    assert got[m + "hit_tokens_total"] == 4 * CHUNK  # A found nothing, B all four chunks
    # the bytes the connector saw move are the bytes the daemon copied
    assert got["vllm:kv_offload_store_bytes_total"] == stored["stored_bytes"] - base["stored_bytes"]
    assert got["vllm:kv_offload_load_bytes_total"] == after["retrieved_bytes"] - stored["retrieved_bytes"] > 0
    assert got["vllm:kv_offload_load_time_total"] > 0 and got["vllm:kv_offload_store_time_total"] > 0
    # and under the names vLLM's CPU offloading used before (kept while they are deprecated)
    assert got["vllm:kv_offload_total_bytes_total{CPU_to_GPU}"] == got["vllm:kv_offload_load_bytes_total"]
    assert got["vllm:kv_offload_total_bytes_total{GPU_to_CPU}"] == got["vllm:kv_offload_store_bytes_total"]
    assert got["vllm:kv_offload_total_time_total{CPU_to_GPU}"] == got["vllm:kv_offload_load_time_total"]
    assert got["vllm:kv_offload_size_count{GPU_to_CPU}"] == got["vllm:kv_offload_store_size_count"]
    assert got["vllm:kv_offload_load_size_count"] == 1
    assert got["vllm:kv_offload_store_size_count"] >= 1
    assert got["vllm:kv_offload_lookup_sync_delay_seconds_count"] >= 2
    assert got["vllm:kv_offload_allocation_failure_total"] == 0
    assert got[m + "failed_loads_total"] == 0 and got[m + "failed_stores_total"] == 0
    assert got[m + "bypassed_requests_total{short}"] == 1
    assert got[m + "bypassed_requests_total{request}"] == 1
    assert got[m + "bypassed_requests_total{no_daemon}"] == 0
    assert got[m + "daemon_connected"] == 1
    # vLLM's periodic line: each interval's sums
    assert line_a.startswith("KV Transfer metrics: ") and "lookups=1" in line_a, line_a
    assert "bypassed_short=1" in line_a and "bypassed_request=1" in line_a, line_a
    assert "hit_tokens=256" in line_b and "hit_ratio=1.0" in line_b and "loads=1" in line_b, line_b
    assert "daemon_connected=1" in line_b, line_b


def test_a_failed_load_and_a_dead_daemon_show_as_failed_loads_bypasses_and_no_session(
    tiny_model, daemon_factory, client_factory
):
    d = daemon_factory("--lease-ttl-s", "0.3")
    tokens = prompt(4 * CHUNK + 10, seed=6)
    a = SimEngine(tiny_model, d.endpoint, FULL, chunk_tokens=CHUNK)
    a.add("a", tokens)
    a.run()
    a.close()
    admin = client_factory(d)
    b = SimEngine(tiny_model, d.endpoint, FULL, chunk_tokens=CHUNK)
    front = Front(b.vllm_config)
    try:
        b.add("b", tokens)
        evicted = []

        def evict(so):  # between the LOOKUP's answer and the RETRIEVE, the objects go
            if not evicted and so.kv_connector_metadata.loads:
                time.sleep(0.8)  # the lease's TTL passes
                evicted.append(admin.clear().evicted)

        b.run(after_schedule=evict)
        assert evicted and "b" in b.failed_loads
        front.feed(b)
        got = front.series()
        assert got["vllm:tierd_failed_loads_total"] == 1, got
        assert got["vllm:tierd_bypassed_requests_total{failed_load}"] == 1  # asked again: bypassed
        assert got["vllm:kv_offload_load_bytes_total"] == 0  # nothing landed
        assert got["vllm:tierd_daemon_connected"] == 1

        d.kill()
        deadline = time.monotonic() + 10
        while b.worker.client.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        b.add("c", prompt(3 * CHUNK, seed=7))
        b.run()
        front.feed(b)
        got = front.series()
        assert got["vllm:tierd_bypassed_requests_total{no_daemon}"] == 1, got
        assert got["vllm:tierd_daemon_connected"] == 0
        assert "daemon_connected=0" in front.log()
    finally:
        b.close()
