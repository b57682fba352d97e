"""Operator endpoints: /status (JSON) carries the documented fields and its numbers move with
the operations; /metrics is valid Prometheus text with tierd_ names, per-op latency and byte
histograms; /healthz answers ok; anything else is a 404."""

import json
import time
import urllib.error
import urllib.request

import pytest
from kv import GroupGeom, keys
from prometheus_client.parser import text_string_to_metric_families
from util import chunk, ranks  # noqa: F401 - fixtures

from tierd_client import TierdError

GEOM = GroupGeom("full", layers=2, block_bytes=32 << 10, block_tokens=4)  # 256 KiB objects
FIELDS = [
    "memory_configured_bytes",
    "memory_total_bytes",
    "memory_used_bytes",
    "objects",
    "group_objects",
    "instances",
    "lookups",
    "lookup_chunks",
    "hit_chunks",
    "stores",
    "stored_chunks",
    "stored_bytes",
    "retrieves",
    "retrieved_chunks",
    "retrieved_bytes",
    "retrieve_failed_blocks",
    "evictions",
    "store_rejects",
    "errors",
    "errors_by_code",
    "leases_active",
    "leases_granted",
    "leases_expired",
    "sessions",
    "sessions_reaped",
    "version",
    "boot_id",
    "pid",
    "uptime_s",
    "socket",
]


def delta(before, after, *names):
    return {n: after[n] - before[n] for n in names}


def test_status_fields_and_counters_move(daemon_factory, client_factory, ranks):
    d = daemon_factory("--max-lease-share", "1", pool_mb=2)  # leases most of the pool
    s0 = d.status()
    for name in FIELDS:
        assert name in s0, name
    assert s0["objects"] == 0 and s0["instances"] == [] and s0["memory_used_bytes"] == 0
    c = client_factory(d, name="http-test")
    rank = ranks(GEOM)
    c.register("r0", rank.layout())
    s1 = d.status()
    [inst] = s1["instances"]
    assert (
        inst["instance"] == "r0"
        and inst["namespace"] == {**{k: v for k, v in rank.ns.items() if k != "salt"}, "salted": False}
        and inst["rank"] == 0
    )
    assert inst["groups"] == ["full"] and 0 <= inst["last_heartbeat_s_ago"] < 10
    assert inst["copies"] == "shm" and inst["object_order"] == ["layer"]
    assert s1["sessions"] == 1

    ks = keys(3)
    c.store("r0", [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)])
    s2 = d.status()
    assert delta(s1, s2, "stores", "stored_chunks", "stored_bytes", "objects") == {
        "stores": 1,
        "stored_chunks": 3,
        "stored_bytes": 3 * (256 << 10),
        "objects": 3,
    }
    assert s2["group_objects"] == {"g0/full": 3}
    assert s2["memory_used_bytes"] == 3 * (256 << 10) <= s2["memory_total_bytes"]

    reply = c.lookup(rank.ns, ks + keys(2), rank.specs(), 16)
    s3 = d.status()
    assert delta(s2, s3, "lookups", "lookup_chunks", "hit_chunks", "leases_granted", "leases_active") == {
        "lookups": 1,
        "lookup_chunks": 5,
        "hit_chunks": 3,
        "leases_granted": 1,
        "leases_active": 1,
    }

    missing = keys(1)[0]
    c.retrieve(
        "r0",
        [chunk(k, range(40 + 4 * i, 44 + 4 * i)) for i, k in enumerate(ks)] + [chunk(missing, range(52, 56))],
        lease=reply.lease,
    )
    s4 = d.status()
    assert delta(
        s3, s4, "retrieves", "retrieved_chunks", "retrieved_bytes", "retrieve_failed_blocks", "leases_active"
    ) == {
        "retrieves": 1,
        "retrieved_chunks": 3,
        "retrieved_bytes": 3 * (256 << 10),
        "retrieve_failed_blocks": 4,
        "leases_active": -1,
    }

    with pytest.raises(TierdError):
        c.release(999)
    s5 = d.status()
    assert s5["errors"] == s4["errors"] + 1
    assert s5["errors_by_code"]["UNKNOWN_LEASE"] == s4["errors_by_code"].get("UNKNOWN_LEASE", 0) + 1

    # pressure: evictions, then (everything leased) rejects
    cap = s5["memory_configured_bytes"] // (256 << 10)
    more = keys(cap)
    c.store("r0", [chunk(k, range(4 * (i % 8), 4 * (i % 8) + 4)) for i, k in enumerate(more)])
    s6 = d.status()
    assert s6["evictions"] == 3 and s6["objects"] == cap
    c.lookup(rank.ns, more, rank.specs(), 16)
    assert c.store("r0", [chunk(keys(1)[0], range(4))]).results == ["rejected"]
    s7 = d.status()
    assert s7["store_rejects"] == s6["store_rejects"] + 1 and s7["objects"] == cap
    # the same numbers over the STATUS op
    assert c.status()["store_rejects"] == s7["store_rejects"]


def test_request_stages_add_up_to_each_copys_time_in_the_daemon(daemon, client, ranks):
    rank = ranks(GroupGeom("full"))
    client.register("r0", rank.layout())
    before = daemon.status()["request_stages"]
    ks = keys(2)
    t = time.perf_counter()
    client.store("r0", [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)])
    client.retrieve("r0", [chunk(k, range(40 + 4 * i, 44 + 4 * i)) for i, k in enumerate(ks)])
    took = time.perf_counter() - t
    stages = daemon.status()["request_stages"]
    assert before == {}
    for op in ("STORE", "RETRIEVE"):
        assert stages[op]["jobs"] == 1
        seconds = stages[op]["seconds"]
        assert set(seconds) == {
            "wait",
            "plan",
            "lane",
            "copy",
            "return",
            "reply",
        }  # a CPU rank: no device work
        assert all(v >= 0 for v in seconds.values()) and seconds["copy"] > 0
    # each stage ends where the next begins, and all but the last ("reply": its stamp follows the
    # send) end before the reply goes out: the daemon's share of the client's two calls
    rounding = 1e-6 * sum(len(stages[op]["seconds"]) for op in stages)  # (each rounded to 1 us)
    before_reply = sum(v for op in stages for k, v in stages[op]["seconds"].items() if k != "reply")
    assert 0 < before_reply <= took + rounding
    code, body = daemon.get("/metrics")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
    }
    assert samples[("tierd_request_stage_jobs_total", (("op", "STORE"),))] == 1
    copy = samples[("tierd_request_stage_seconds_total", (("op", "RETRIEVE"), ("stage", "copy")))]
    assert copy == pytest.approx(stages["RETRIEVE"]["seconds"]["copy"], abs=1e-6)  # /status rounds to 1 us


def test_metrics_are_prometheus_text(daemon, client, ranks):
    rank = ranks(GroupGeom("full"))
    client.register("r0", rank.layout())
    ks = keys(2)
    client.store("r0", [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)])
    client.retrieve("r0", [chunk(k, range(40 + 4 * i, 44 + 4 * i)) for i, k in enumerate(ks)])
    client.lookup(rank.ns, ks, rank.specs(), 16, lease=False)
    code, body = daemon.get("/metrics")
    assert code == 200
    text = body.decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(name.startswith("tierd_") for name in families), sorted(families)
    for name in (
        "tierd_lookups",
        "tierd_stores",
        "tierd_retrieves",
        "tierd_evictions",
        "tierd_store_rejects",
        "tierd_errors",
        "tierd_memory_total_bytes",
        "tierd_memory_used_bytes",
        "tierd_objects",
        "tierd_instances",
        "tierd_op_seconds",
        "tierd_op_bytes",
    ):
        assert name in families, name
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
    }
    assert samples[("tierd_stores_total", ())] == 1
    assert samples[("tierd_objects", ())] == 2
    assert samples[("tierd_op_seconds_count", (("op", "STORE"),))] == 1
    assert samples[("tierd_op_seconds_count", (("op", "LOOKUP"),))] == 1
    assert samples[("tierd_op_seconds_bucket", (("le", "+Inf"), ("op", "RETRIEVE")))] == 1
    assert samples[("tierd_op_bytes_sum", (("op", "STORE"),))] == 2 * 2 * 4 * 256
    assert any(n == "tierd_op_bytes_bucket" for n, _ in samples)
    with urllib.request.urlopen(daemon.http + "/metrics", timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")


def test_healthz_and_unknown_paths(daemon):
    code, body = daemon.get("/healthz")
    assert code == 200 and body.strip() == b"ok"
    with pytest.raises(urllib.error.HTTPError) as err:
        daemon.get("/nope")
    assert err.value.code == 404
    code, body = daemon.get("/status?pretty=1")
    assert code == 200 and json.loads(body)["objects"] == 0
