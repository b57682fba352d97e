"""``tierd bench``: a synthetic multi-layer KV layout stored and retrieved through the real
protocol and a real daemon, every byte verified, next to a same-run memcpy baseline."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

from tierd.protocol.keys import KEY_BYTES


class BenchError(Exception):
    pass


@contextlib.contextmanager
def private_daemon(pool_bytes: int, extra: tuple[str, ...] = ()):
    """A ``tierd serve`` subprocess on a private socket; yields its endpoint."""
    folder = tempfile.mkdtemp(prefix="tierd-bench-")
    endpoint = f"ipc://{folder}/tierd.sock"
    cmd = [sys.executable, "-m", "tierd", "serve", "--socket", endpoint, "--http-port", "-1",
           "--l1-size-gb", f"{pool_bytes / 2**30:.6f}", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd)
    try:
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def run_bench(*, url, device, layers, kv_heads, head_dim, block_tokens, chunk_tokens, dtype_bytes, mla, chunks,
              batch, rounds, pool_gb, progress) -> dict:
    if chunk_tokens % block_tokens:
        raise BenchError(f"--chunk-tokens {chunk_tokens} is not a multiple of --block-tokens {block_tokens}")
    if device == "cuda":
        from tierd.transfer.cuda_bench import run_cuda_bench

        return run_cuda_bench(url=url, layers=layers, kv_heads=kv_heads, head_dim=head_dim, block_tokens=block_tokens,
                              chunk_tokens=chunk_tokens, dtype_bytes=dtype_bytes, mla=mla, chunks=chunks, batch=batch,
                              rounds=rounds, pool_gb=pool_gb, progress=progress)
    from tierd_client import TierdClient
    from tierd_client.layouts import block_span, group, layout, namespace
    from tierd_client.shm import SharedBuffer

    block_bytes = block_tokens * (576 if mla else kv_heads * 2 * head_dim) * dtype_bytes
    bpc = chunk_tokens // block_tokens
    num_blocks = 2 * chunks * bpc  # first half stored from, second half retrieved into
    object_bytes = layers * bpc * block_bytes
    total = chunks * object_bytes
    buf = SharedBuffer(layers * num_blocks * block_bytes, prefix="tierd-bench")
    try:
        kv = buf.array.reshape(layers, num_blocks, block_bytes)
        kv[:, : num_blocks // 2] = np.random.default_rng(0).integers(0, 255, (layers, num_blocks // 2, block_bytes), dtype=np.uint8)
        spans = [block_span((num_blocks, block_bytes), (block_bytes, 1), 1, 0, tensor=0, offset=l * num_blocks * block_bytes)
                 for l in range(layers)]
        lay = layout(namespace("tierd-bench", uuid.uuid4().hex), 0, chunk_tokens, [buf.ref()],
                     [group("full", block_tokens, spans, dtype=f"{dtype_bytes}B")])
        pool_bytes = int(pool_gb * 2**30) if pool_gb else int(total * 1.25) + (256 << 20)
        ctx = private_daemon(pool_bytes) if url is None else contextlib.nullcontext(url)
        with ctx as endpoint, TierdClient(endpoint, timeout_s=120, name="tierd-bench") as client:
            client.wait_ready(30)
            client.register("bench-0", lay)
            baseline = memcpy_gbps(total)
            store_s, retrieve_s, verified = [], [], True
            steps = rounds * 2 * -(-chunks // batch)
            bar = _progress(steps, progress)
            for r in range(rounds):
                client.clear()
                keys = [uuid.uuid4().bytes[:KEY_BYTES] for _ in range(chunks)]
                src_ids = [list(range(c * bpc, (c + 1) * bpc)) for c in range(chunks)]
                dst_ids = [[num_blocks // 2 + b for b in ids] for ids in src_ids]
                kv[:, num_blocks // 2 :] = 0
                t = time.perf_counter()
                futs = [client.store_async("bench-0", [{"key": keys[c], "blocks": [src_ids[c]]}
                                                      for c in range(i, min(i + batch, chunks))])
                        for i in range(0, chunks, batch)]
                for fut in futs:
                    res = fut.result()
                    bar(1)
                    if any(x != "stored" for x in res["results"]):
                        raise BenchError(f"store answered {res['results']}: is the pool large enough?")
                store_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                futs = [client.retrieve_async("bench-0", [{"key": keys[c], "blocks": [dst_ids[c]]}
                                                         for c in range(i, min(i + batch, chunks))])
                        for i in range(0, chunks, batch)]
                for fut in futs:
                    res = fut.result()
                    bar(1)
                    if not all(res["ok"]):
                        raise BenchError(f"retrieve failed for blocks {res['failed'][:8]}")
                retrieve_s.append(time.perf_counter() - t)
                verified &= bool(np.array_equal(kv[:, : num_blocks // 2], kv[:, num_blocks // 2 :]))
            bar(None)
            client.unregister("bench-0")
    finally:
        buf.close()
    store_gbps = total / min(store_s) / 1e9
    retrieve_gbps = total / min(retrieve_s) / 1e9
    return {
        "device": "cpu",
        "layout": "mla" if mla else "mha",
        "layers": layers,
        "block_bytes": block_bytes,
        "object_bytes": object_bytes,
        "chunks": chunks,
        "bytes_per_round": total,
        "store_gbps": round(store_gbps, 3),
        "retrieve_gbps": round(retrieve_gbps, 3),
        "baseline_gbps": round(baseline, 3),
        "store_ratio": round(store_gbps / baseline, 3),
        "retrieve_ratio": round(retrieve_gbps / baseline, 3),
        "verified": verified,
    }


def _progress(total: int, enabled: bool):
    if not enabled:
        return lambda n: None
    import click

    bar = click.progressbar(length=total, label="bench", file=sys.stderr)
    bar.__enter__()

    def step(n):
        if n is None:
            bar.__exit__(None, None, None)
        else:
            bar.update(n)

    return step
