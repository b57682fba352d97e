"""Block reuse is fenced, not held: a store is asynchronous, the engine's blocks are freed at
once, and a forward (or a load) that is about to write a block a pending store still reads waits
for that store first; one that writes other blocks does not wait.

The daemon is paused (SIGSTOP) so that the store stays pending for as long as the test wants.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm_sim import make_vllm_config  # noqa: E402

from tierd_client.vllm_connector import TierdConnector  # noqa: E402
from tierd_client.vllm_connector.metadata import ChunkIO, StoreOrder, TierdMetadata  # noqa: E402

NUM_BLOCKS, BLOCK, CHUNK = 32, 16, 64
PAUSE = 1.0


@pytest.fixture
def worker(tiny_model, daemon):
    vc = make_vllm_config(tiny_model, daemon.endpoint, BLOCK, CHUNK, extra={"tierd.timeout_s": 20})
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.int8)
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    w = TierdConnector(vc, KVConnectorRole.WORKER, kcc)
    w.register_kv_caches({"l0": torch.randint(-100, 100, (NUM_BLOCKS, BLOCK, 8), dtype=torch.int8)})
    yield w
    w.shutdown()


def paused_store(daemon, w, blocks):
    """Send a STORE of ``blocks`` while the daemon is stopped; it resumes PAUSE s later."""
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    threading.Timer(PAUSE, os.kill, (daemon.proc.pid, signal.SIGCONT)).start()
    w.bind_connector_metadata(
        TierdMetadata(stores=[StoreOrder("r", [ChunkIO(uuid.uuid4().bytes, [blocks])], [])])
    )
    w.wait_for_save()
    w.clear_connector_metadata()
    ((fut, _),) = w.worker.stores
    return fut


def test_forward_into_a_block_a_store_still_reads_waits_for_the_store(worker, daemon):
    fut = paused_store(daemon, worker, [4, 5, 6, 7])
    t0 = time.monotonic()
    worker.handle_preemptions(TierdMetadata(new_blocks={6, 20}))  # block 6 is handed out again
    waited = time.monotonic() - t0
    assert fut.done() and fut.result().results == ["stored"]
    assert waited >= PAUSE * 0.8


def test_forward_into_other_blocks_does_not_wait(worker, daemon):
    fut = paused_store(daemon, worker, [4, 5, 6, 7])
    t0 = time.monotonic()
    worker.handle_preemptions(TierdMetadata(new_blocks={8, 9, 20}))
    assert time.monotonic() - t0 < PAUSE / 2
    assert not fut.done()
    assert fut.result(timeout=10).results == ["stored"]


def test_new_block_ids_cover_every_group_including_ones_tierd_does_not_store():
    """Regression: the fence once took vLLM's groups by position and compared them with tierd's
    groups, so with a group tierd skips (enable_kv_transfer False) group 1's new blocks were
    checked against group 0's reads. Block ids are one namespace over all groups."""
    from types import SimpleNamespace

    from tierd_client.vllm_connector.scheduler import new_block_ids

    so = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(block_ids=([1, 2], [3], [4, 5])),
            SimpleNamespace(block_ids=None),
        ],
        scheduled_cached_reqs=SimpleNamespace(new_block_ids=[([6], [], [7]), None]),
    )
    assert new_block_ids(so) == {1, 2, 3, 4, 5, 6, 7}


def test_forward_into_a_block_another_group_store_reads_waits(tiny_model, daemon):
    """A store reads blocks of the sliding group; the forward hands one of those ids out to the
    full group (same page under vLLM's hybrid allocator): it waits for the store."""
    vc = make_vllm_config(tiny_model, daemon.endpoint, BLOCK, CHUNK, extra={"tierd.timeout_s": 20})
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.int8)
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    swa = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.int8, sliding_window=BLOCK
    )
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["f0"], full), KVCacheGroupSpec(["s0"], swa)],
    )
    w = TierdConnector(vc, KVConnectorRole.WORKER, kcc)
    page = torch.randint(-100, 100, (NUM_BLOCKS, BLOCK, 8), dtype=torch.int8)
    w.register_kv_caches({"f0": page, "s0": page})
    try:
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        threading.Timer(PAUSE, os.kill, (daemon.proc.pid, signal.SIGCONT)).start()
        chunk = ChunkIO(uuid.uuid4().bytes, [[-1] * (CHUNK // BLOCK), [4, 5, 6, 7]])
        w.bind_connector_metadata(TierdMetadata(stores=[StoreOrder("r", [chunk], [])]))
        w.wait_for_save()
        w.clear_connector_metadata()
        ((fut, _),) = w.worker.stores
        t0 = time.monotonic()
        w.handle_preemptions(TierdMetadata(new_blocks={6}))
        assert time.monotonic() - t0 >= PAUSE * 0.8 and fut.done()
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        w.shutdown()


def test_blocks_a_finished_request_frees_wait_for_its_pending_store_before_reuse(tiny_model, daemon):
    """vLLM frees a finished request's blocks at once while its store may still read them. The
    requests that get them next (in either group: one pool, shared pages) must not overwrite
    them before the store has read them, or the tier keeps their bytes under A's keys (engine C
    restores A's prefix and SimEngine.stale_reads checks every byte)."""
    from vllm_sim import GroupDef, SimEngine

    groups = [GroupDef("full", block_size=BLOCK), GroupDef("sliding", block_size=BLOCK, window=BLOCK)]
    a = SimEngine(tiny_model, daemon.endpoint, groups, num_blocks=24, chunk_tokens=CHUNK)
    try:
        tokens_a = list(range(100, 100 + CHUNK + 1))
        a.add("a", tokens_a, max_tokens=1)

        def pause(so):  # after the lookup was answered: A's store stays pending
            if so.num_scheduled_tokens:
                os.kill(daemon.proc.pid, signal.SIGSTOP)
                threading.Timer(PAUSE, os.kill, (daemon.proc.pid, signal.SIGCONT)).start()

        while "a" not in a.finished:
            a.step(after_schedule=pause)  # prefill, store sent, A finishes and frees its blocks
        assert a.worker.worker.stores, "A's store should still be pending"
        pending_reads = set().union(*(reads for _, reads in a.worker.worker.stores))
        # prompts shorter than a chunk never ask the (paused) daemon, so they are scheduled at once;
        # together they need more blocks than were never used, so they get some of A's
        for i, n in enumerate([CHUNK - 1, CHUNK - 1, CHUNK // 2]):
            a.add(f"b{i}", list(range(2000 + 100 * i, 2000 + 100 * i + n)), max_tokens=1)
        so = a.scheduler.schedule()
        reused = [
            (r, g, blk)
            for r in so.num_scheduled_tokens
            for g, ids in enumerate(a.scheduler.kv_cache_manager.get_block_ids(r))
            for blk in ids
            if blk in pending_reads
        ]
        assert reused, "the scenario needs B to get some of the blocks A's store reads"
        assert any(g == 0 for _, g, _ in reused) and any(g == 1 for _, g, _ in reused)
        t0 = time.monotonic()
        a.worker.handle_preemptions(so.kv_connector_metadata)
        assert time.monotonic() - t0 >= PAUSE * 0.5, (
            f"B's forward did not wait for the store (reused {reused})"
        )
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        a.close()
    c = SimEngine(tiny_model, daemon.endpoint, groups, num_blocks=24, chunk_tokens=CHUNK)
    try:
        c.add("c", tokens_a, max_tokens=1)
        c.run()
        assert c.first_computed("c") == CHUNK  # restored from the tier, and stale_reads checked the bytes
    finally:
        c.close()
