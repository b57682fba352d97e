"""``tierd bench`` on CPU: a synthetic multi-layer KV layout in shared memory stored and retrieved
through the real protocol and a real daemon, every byte verified, next to a same-run memcpy
baseline.

``runs``: each block's bytes in that many runs, run ``r`` of every block of a layer in one region of
its own (``runs=2``: K and V halves a layer apart, vLLM's CPU layout), so a chunk's blocks are
``runs`` ranges of contiguous memory per layer instead of one. The first round is reported apart
(``*_first_gbps``): it writes into pool memory and engine pages that no round touched before."""

from __future__ import annotations

import contextlib
import time
import uuid

import numpy as np

from tierd.pool import pages
from tierd.protocol.keys import KEY_BYTES
from tierd.tools.bench.common import (
    BenchError,
    Progress,
    fill_pattern,
    memcpy_gbps,
    private_daemon,
    request_stages,
    stage_means,
)
from tierd.tools.bench.options import BenchOptions
from tierd_client import TierdClient
from tierd_client.layouts import block_span, group, layout, namespace
from tierd_client.shm import SharedBuffer


def run_cpu_bench(opts: BenchOptions, progress: Progress) -> dict:
    socket, layers, chunks, batch = opts.socket, opts.layers, opts.chunks, opts.batch
    rounds, runs = opts.rounds, opts.runs
    block_bytes, bpc, object_bytes = opts.block_bytes, opts.blocks_per_chunk, opts.object_bytes
    if runs < 1 or block_bytes % runs:
        raise BenchError(f"--runs {runs} does not divide a block's {block_bytes} bytes")
    run_bytes = block_bytes // runs
    num_blocks = 2 * chunks * bpc  # first half stored from, second half retrieved into
    total = chunks * object_bytes
    progress.phase("laying out the KV buffer")
    buf = SharedBuffer(layers * num_blocks * block_bytes, prefix="tierd-bench")
    try:
        kv = buf.array.reshape(layers, runs, num_blocks, run_bytes)  # a layer: [run][block][bytes]
        fill_pattern(kv[:, :, : num_blocks // 2])
        spans = [
            block_span(
                (runs, num_blocks, run_bytes),
                (num_blocks * run_bytes, run_bytes, 1),
                1,
                1,
                tensor=0,
                offset=l * num_blocks * block_bytes,
            )
            for l in range(layers)
        ]
        ns = namespace("tierd-bench", uuid.uuid4().hex)
        lay = layout(
            ns,
            0,
            opts.chunk_tokens,
            [buf.ref()],
            [group("full", opts.block_tokens, spans, dtype=f"{opts.dtype_bytes}B")],
        )
        pool_bytes = int(opts.pool_gb * 2**30) if opts.pool_gb else int(total * 1.25) + (256 << 20)
        progress.phase("starting a private daemon" if socket is None else f"connecting to {socket}")
        ctx = private_daemon(pool_bytes) if socket is None else contextlib.nullcontext(socket)
        with (
            ctx as endpoint,
            # a private daemon just started can take seconds to bind on a loaded host: the HELLO
            # waits for it longer than a client's default
            TierdClient(endpoint, timeout_s=120, name="tierd-bench", connect_timeout_s=30) as client,
        ):
            client.wait_ready(30)
            client.register("bench-0", lay)
            progress.phase("memcpy baseline")
            baseline = memcpy_gbps(total)
            store_s, retrieve_s, verified = [], [], True
            bar = progress.bar(rounds * 2 * total, "store/retrieve")
            stages0 = {}
            for r in range(rounds):
                if r == min(1, rounds - 1):  # the daemon's stages of the rounds after the first
                    stages0 = request_stages(client)
                client.call("CLEAR", {"namespace": ns})
                keys = [uuid.uuid4().bytes[:KEY_BYTES] for _ in range(chunks)]
                src_ids = [list(range(c * bpc, (c + 1) * bpc)) for c in range(chunks)]
                dst_ids = [[num_blocks // 2 + b for b in ids] for ids in src_ids]
                kv[:, :, num_blocks // 2 :] = 0
                t = time.perf_counter()
                futs = [
                    client.store_async(
                        "bench-0",
                        [{"key": keys[c], "blocks": [src_ids[c]]} for c in range(i, min(i + batch, chunks))],
                    )
                    for i in range(0, chunks, batch)
                ]
                for fut in futs:
                    res = fut.result()
                    bar(len(res.results) * object_bytes)
                    if any(x != "stored" for x in res.results):
                        raise BenchError(f"store answered {res.results}: is the pool large enough?")
                store_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                futs = [
                    client.retrieve_async(
                        "bench-0",
                        [{"key": keys[c], "blocks": [dst_ids[c]]} for c in range(i, min(i + batch, chunks))],
                    )
                    for i in range(0, chunks, batch)
                ]
                for fut in futs:
                    res = fut.result()
                    bar(len(res.ok) * object_bytes)
                    if not all(res.ok):
                        raise BenchError(f"retrieve failed for blocks {res.failed[:8]}")
                retrieve_s.append(time.perf_counter() - t)
                verified &= bool(np.array_equal(kv[:, :, : num_blocks // 2], kv[:, :, num_blocks // 2 :]))
            bar(None)
            stages = stage_means(stages0, request_stages(client))
            client.call("CLEAR", {"namespace": ns})  # leave nothing behind in the operator's daemon
            client.unregister("bench-0")
    finally:
        buf.close()
    later = slice(1, None) if rounds > 1 else slice(None)  # best of the rounds after the first
    store_gbps = total / min(store_s[later]) / 1e9
    retrieve_gbps = total / min(retrieve_s[later]) / 1e9
    return {
        "device": "cpu",
        "layout": "mla" if opts.mla else "mha",
        "layers": layers,
        "block_bytes": block_bytes,
        "runs": runs,
        "object_bytes": object_bytes,
        "chunks": chunks,
        "bytes_per_round": total,
        "store_gbps": round(store_gbps, 3),
        "retrieve_gbps": round(retrieve_gbps, 3),
        "baseline_gbps": round(baseline, 3),
        "store_ratio": round(store_gbps / baseline, 3),
        "retrieve_ratio": round(retrieve_gbps / baseline, 3),
        "store_first_gbps": round(total / store_s[0] / 1e9, 3),
        "retrieve_first_gbps": round(total / retrieve_s[0] / 1e9, 3),
        # the kernel's huge-page settings for the shared memory the copies go through (a daemon's
        # pool without --pool-dir, the bench's buffers): the memcpy baseline has huge pages
        "huge_pages": {"memfd": pages.huge_pages(), "dev_shm": pages.huge_pages("/dev/shm")},
        "daemon_stages_ms": stages,  # per op, mean ms per request in each daemon stage (tierd.base.stats)
        "verified": verified,
    }
