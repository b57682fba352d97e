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

from vllm_sim import make_vllm_config  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from tierd_client.vllm_connector import TierdConnector  # noqa: E402
from tierd_client.vllm_connector.metadata import ChunkIO, StoreJob, TierdMetadata  # noqa: E402

NUM_BLOCKS, BLOCK, CHUNK = 32, 16, 64
PAUSE = 1.0


@pytest.fixture
def worker(tiny_model, daemon):
    vc = make_vllm_config(tiny_model, daemon.endpoint, BLOCK, CHUNK, extra={"tierd.timeout_s": 20})
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.int8)
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    w = TierdConnector(vc, KVConnectorRole.WORKER, kcc)
    w.register_kv_caches({"l0": torch.randint(-100, 100, (NUM_BLOCKS, BLOCK, 8), dtype=torch.int8)})
    yield w
    w.shutdown()


def paused_store(daemon, w, blocks):
    """Send a STORE of ``blocks`` while the daemon is stopped; it resumes PAUSE s later."""
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    threading.Timer(PAUSE, os.kill, (daemon.proc.pid, signal.SIGCONT)).start()
    w.bind_connector_metadata(TierdMetadata(stores=[StoreJob("r", [ChunkIO(uuid.uuid4().bytes, [blocks])], [])]))
    w.wait_for_save()
    w.clear_connector_metadata()
    (fut, _), = w.worker.stores
    return fut


def test_forward_into_a_block_a_store_still_reads_waits_for_the_store(worker, daemon):
    fut = paused_store(daemon, worker, [4, 5, 6, 7])
    t0 = time.monotonic()
    worker.handle_preemptions(TierdMetadata(new_blocks={6, 20}))  # block 6 is handed out again
    waited = time.monotonic() - t0
    assert fut.done() and fut.result()["results"] == ["stored"]
    assert waited >= PAUSE * 0.8


def test_forward_into_other_blocks_does_not_wait(worker, daemon):
    fut = paused_store(daemon, worker, [4, 5, 6, 7])
    t0 = time.monotonic()
    worker.handle_preemptions(TierdMetadata(new_blocks={8, 9, 20}))
    assert time.monotonic() - t0 < PAUSE / 2
    assert not fut.done()
    assert fut.result(timeout=10)["results"] == ["stored"]
