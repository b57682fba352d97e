"""KV cache events as a KV-aware router receives them: vLLM's real Scheduler and event publisher
(ZeroMQ, as ``--kv-events-config`` sets it up), a real ``tierd serve``, and a SUB socket in the
router's place. Every chunk the tier stored for a request is announced once as ``BlockStored``
with medium ``CPU`` in vLLM's own block hashes; chunks the tier did not take are not."""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import Future

import msgspec
import pytest
import zmq

pytest.importorskip("vllm")

from util import ranks  # noqa: E402,F401 - fixture
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_sim import GroupDef, SimEngine  # noqa: E402

from tierd.protocol import messages  # noqa: E402

CHUNK = 64
BLOCK = 16


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


class Router:
    """What a KV-aware router runs: a SUB socket on the engine's event endpoint."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []

    def drain(self, wait_s: float = 0.5) -> list:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.events += self.decoder.decode(payload).events
        return self.events

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def world(tiny_model, daemon, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv-events.sock"
    made = []

    def engine(groups=(GroupDef("full", block_size=BLOCK),), **kw):  # noqa: B008 - one frozen default
        e = SimEngine(
            tiny_model,
            daemon.endpoint,
            list(groups),
            chunk_tokens=CHUNK,
            kv_events={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint},
            **kw,
        )
        made.append(e)
        return e

    first = engine()
    router = Router(endpoint)
    time.sleep(0.3)  # SUB joins (ZeroMQ's slow-joiner)
    yield first, engine, router
    router.close()
    for e in made:
        e.close()


def run_until_idle(e: SimEngine, max_steps: int = 2000) -> None:
    """Step as vLLM's engine core does: while the scheduler has requests (the connector keeps
    it stepping while stored chunks await their reports)."""
    e.run()
    for _ in range(max_steps):
        if not e.scheduler.has_requests():
            return
        e.step()
        time.sleep(0.002)
    raise AssertionError("the engine never went idle")


def cpu(events, kind):
    return [ev for ev in events if isinstance(ev, kind) and ev.medium == "CPU"]


def test_a_router_receives_block_stored_on_cpu_for_each_chunk_the_tier_stored(world, daemon, tmp_path):
    e, _, router = world
    tokens = prompt(3 * CHUNK + 20, seed=91)
    req = e.add("r", tokens)
    run_until_idle(e)
    events = router.drain()
    stored = cpu(events, BlockStored)
    assert daemon.status()["stored_chunks"] == 3
    assert len(stored) == 3, events
    per = CHUNK // BLOCK
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]  # as vLLM publishes them
    for j, ev in enumerate(stored):
        assert ev.block_hashes == hashes[j * per : (j + 1) * per]  # vLLM's own hashes of those blocks
        assert ev.parent_block_hash == (hashes[j * per - 1] if j else None)
        assert ev.token_ids == tokens[j * CHUNK : (j + 1) * CHUNK]
        assert ev.block_size == BLOCK and ev.group_idx == 0 and ev.kv_cache_spec_kind == "full_attention"
    # the same blocks were announced on the GPU by vLLM itself: the router can match them
    gpu_hashes = {
        h for ev in events if isinstance(ev, BlockStored) and ev.medium == "GPU" for h in ev.block_hashes
    }
    assert set(hashes[: 3 * per]) <= gpu_hashes
    record = os.environ.get("TIERD_RECORD_EVENTS")
    if record:  # TIERD_RECORD_EVENTS=FILE: what the router got for this one request, as JSON rows
        rows = [
            {
                "type": type(ev).__name__,
                "medium": ev.medium,
                "group_idx": ev.group_idx,
                "blocks": len(ev.block_hashes),
                "tokens": len(getattr(ev, "token_ids", ())),
            }
            for ev in events
        ]
        with open(record, "w") as f:
            json.dump(rows, f, indent=1)


def test_chunks_another_engine_already_stored_are_not_announced_again(world, daemon):
    e, engine, router = world
    tokens = prompt(3 * CHUNK + 20, seed=92)
    e.add("a", tokens)
    run_until_idle(e)
    assert len(cpu(router.drain(), BlockStored)) == 3
    b = engine()  # restores the 3 chunks, so it stores none of them
    b.add("b", tokens)
    run_until_idle(b)
    assert b.first_computed("b") == 3 * CHUNK
    assert len(cpu(router.drain(), BlockStored)) == 3


def test_a_chunk_is_announced_only_once_every_rank_has_it(world):
    """TP=2: a chunk is servable only when both ranks' bytes are in ("stored", or "exists" on a
    replicated rank); one rank's "rejected" (no room) or a failed STORE keeps it unannounced."""
    from tierd_client.vllm_connector.events import ChunkReports

    e, _, _ = world
    ev = e.connector.scheduler.events
    ev.world_size = 2
    req = e.add("r", prompt(3 * CHUNK + 5, seed=93))
    keys = [bytes([i]) * 16 for i in range(3)]
    for j, key in enumerate(keys):
        ev.record(req, j, key)
    ev.on_reports(ChunkReports([(keys[0], "stored"), (keys[1], "stored"), (keys[2], "stored")]))
    assert ev.take() == [] and ev.pending()  # rank 1 has not answered yet
    ev.on_reports(ChunkReports([(keys[0], "exists"), (keys[1], "rejected"), (keys[2], "failed")]))
    out = ev.take()
    assert [x.token_ids for x in out] == [list(req.all_token_ids[:CHUNK])]
    assert list(ev.announced) == [keys[0]] and not ev.pending()
    e.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)


class OlderDaemonClient:
    """The engine's real client, except that EVICTED is answered UNKNOWN_OP (a daemon from before it)."""

    def __init__(self, client):
        self.client = client
        self.server = client.server

    def call_async(self, op, body, timeout=None):
        if op != "EVICTED":
            return self.client.call_async(op, body, timeout)
        from tierd_client import TierdError

        fut: Future = Future()
        fut.set_exception(TierdError("UNKNOWN_OP", "unknown op 'EVICTED'"))
        return fut


def test_a_daemon_without_eviction_reports_leaves_stores_on(world, daemon):
    """An older daemon answers EVICTED with UNKNOWN_OP: polling stops, BlockStored still flows."""
    e, _, router = world
    ev = e.connector.scheduler.events
    ev.client = OlderDaemonClient(ev.client)
    e.add("r", prompt(2 * CHUNK + 5, seed=94))
    run_until_idle(e)
    deadline = time.monotonic() + 5
    while ev.evictions and time.monotonic() < deadline:
        e.connector.take_events()
        time.sleep(0.05)
    assert not ev.evictions
    assert len(cpu(router.drain(), BlockStored)) == 2


def test_chunks_the_daemon_evicted_reach_the_router_as_block_removed(
    tiny_model, daemon_factory, ranks, tmp_path
):
    """A real eviction: another namespace's objects fill the daemon's 2 MiB pool, which evicts
    this engine's chunks; the engine's next steps poll EVICTED and the router receives
    BlockRemoved (medium CPU) with exactly the hashes of the BlockStored it got for them."""
    from kv import GroupGeom, keys
    from wire import Raw

    d = daemon_factory(pool_mb=2)
    endpoint = f"ipc://{tmp_path}/kv-events-evict.sock"
    e = SimEngine(
        tiny_model,
        d.endpoint,
        [GroupDef("full", block_size=BLOCK)],
        chunk_tokens=CHUNK,
        kv_events={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint},
    )
    router = Router(endpoint)
    other = Raw(d.endpoint)
    try:
        time.sleep(0.3)  # SUB joins
        tokens = prompt(3 * CHUNK + 20, seed=97)
        e.add("r", tokens)
        run_until_idle(e)
        stored = cpu(router.drain(), BlockStored)
        assert len(stored) == 3 and d.status()["stored_chunks"] == 3
        ev = e.connector.scheduler.events
        deadline = time.monotonic() + 10  # its first poll ("from now on") answered: on a loaded host later
        while ev._cursor < 0 and time.monotonic() < deadline:
            e.connector.take_events()  # what vLLM calls every step; it polls EVICTED
            time.sleep(0.05)
        assert len(ev.announced) == 3 and ev._cursor >= 0
        assert not cpu(router.events, BlockRemoved)
        # another namespace fills the pool with objects of the same slot size (4 KiB): the LRU
        # takes this engine's chunks, the oldest, first
        filler = ranks(GroupGeom("full", layers=2, block_bytes=512, block_tokens=4), num_blocks=64)
        other.hello()
        other.ok("REGISTER", {"instance": "filler", "layout": filler.layout()})
        cap = d.status()["memory_configured_bytes"] // 4096
        for _ in range(3):
            ks = keys(cap // 2)
            chunks = [
                {"key": k, "blocks": [list(range(4 * (i % 16), 4 * (i % 16) + 4))]} for i, k in enumerate(ks)
            ]
            assert "stored" in other.ok("STORE", {"instance": "filler", "chunks": chunks})["results"]
        assert d.status()["evictions"] >= 3
        # vLLM publishes connector events when it steps: a short request (below one chunk) steps it
        deadline = time.monotonic() + 10
        n = 0
        while len(cpu(router.events, BlockRemoved)) < 3 and time.monotonic() < deadline:
            n += 1
            e.add(f"short{n}", prompt(CHUNK // 2, seed=200 + n), max_tokens=2)
            run_until_idle(e)
            router.drain(0.3)
        removed = cpu(router.events, BlockRemoved)
        assert sorted(tuple(x.block_hashes) for x in removed) == sorted(tuple(x.block_hashes) for x in stored)
        assert all(x.group_idx == 0 for x in removed)
        assert not ev.announced and ev.missed == 0
        assert d.status()["evicted_keys"] >= 3
    finally:
        other.close()
        router.close()
        e.close()


class EvictionReportingClient:
    """Stands in for the daemon's EVICTED reply only."""

    server = {"boot_id": "x"}

    def __init__(self, keys):
        self.keys, self.calls = keys, []

    def call_async(self, op, body, timeout=None):
        self.calls.append((op, body))
        fut: Future = Future()
        fut.set_result(messages.EvictedReply(seq=7, keys=self.keys, missed=False, boot_id="x"))
        return fut


def test_evicted_chunks_this_engine_announced_become_block_removed(world):
    e, _, router = world
    tokens = prompt(2 * CHUNK + 5, seed=95)
    e.add("r", tokens)
    run_until_idle(e)
    ev = e.connector.scheduler.events
    announced = list(ev.announced)
    assert len(announced) == 2
    stored = cpu(router.drain(), BlockStored)
    stub = EvictionReportingClient([announced[1], b"\0" * 16])  # one of ours, one never announced
    ev.client, ev.evictions, ev._poll, ev._poll_at, ev._cursor, ev._boot = stub, True, None, 0.0, -1, None
    assert ev.take() == []  # the poll goes out ...
    out = ev.take()  # ... and its answer is translated
    assert stub.calls[0] == ("EVICTED", messages.Evicted(e.connector.geo.namespace, since=-1))
    assert [type(x) for x in out] == [BlockRemoved]
    assert out[0].block_hashes == stored[1].block_hashes and out[0].medium == "CPU" and out[0].group_idx == 0
    assert ev._cursor == 7 and announced[1] not in ev.announced
