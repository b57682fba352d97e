"""``tierd bench --device cuda``: this process is the engine. It lays out a vLLM 0.33-style KV
buffer on the GPU (one buffer in the physical order ``--kv-layout``: LBNHC by default, BLNHC
block-outermost; per-layer ``[B, H, N, C]`` views; MLA ``[B, 1, N, 576]``), registers it with a
real daemon, and stores and retrieves through the path ``--path`` names: ``staged`` (what the
vLLM connector uses: tierd_client.staged_rank, gather/scatter in this process's context, the
daemon DMAs through the staging buffer) or ``direct`` (no staging: the daemon's pitched copies
straight between the blocks and its pool, tierd_client.direct_rank.DirectRank). Block ids are
shuffled within each region, as an engine's free list hands them out after a while. It times
STORE, RETRIEVE and both at once, every byte verified, next to same-run baselines on the same
bytes: raw pinned cudaMemcpyAsync (one copy per direction, and both directions on two streams)
and one cudaMemcpyAsync per block.

Latencies: 1, 4 and 16 chunks stored and restored one job at a time, next to the raw copy of
their bytes, and a one-chunk request's ``breakdown``: the medians of its stages as the rank's
trace stamps them (hand-offs, the engine's Python, the daemon and the wire, the caller's wait),
the daemon's lane time per call (issuing the DMAs; waiting for them) and its own stages of the
request (``daemon: ...``, tierd.base.stats.STAGES from /status ``request_stages``), the stages inside
the engine's gather and scatter calls, and ``wire_floor_ms``: round trips that copy nothing. The
timed rounds' requests (all but the first round's) get the same daemon stages as means
(``daemon_stages_ms``).

``--interference``: a compute-bound step (bf16 matmul) and an HBM-bound step (device copy), each
timed alone, while tierd stores and retrieves at full rate, and while raw pinned DMA runs both
ways; printed as slowdown ratios next to the copy rate reached meanwhile.

Here: the bench itself (the KV buffer, the rank, the timed rounds, the result). The baselines are
tierd.tools.bench.cuda_baselines, the latencies tierd.tools.bench.cuda_latency, the interference steps
tierd.tools.bench.cuda_interference.
"""

from __future__ import annotations

import contextlib
import time
import uuid

from tierd.protocol.keys import KEY_BYTES
from tierd.protocol.layout import PageLayout
from tierd.tools.bench.common import BenchError, Progress, private_daemon, request_stages, stage_means
from tierd.tools.bench.cuda_baselines import _baselines, _gbps
from tierd.tools.bench.cuda_interference import _interference
from tierd.tools.bench.cuda_latency import PROBE_CHUNKS, _latencies
from tierd.tools.bench.options import BenchOptions
from tierd_client import TierdClient, native
from tierd_client.cuda_ipc import share_cuda_tensors
from tierd_client.cuda_stage import Stager
from tierd_client.direct_rank import REQUEST_BYTES, DirectRank, direct_layout
from tierd_client.layouts import block_span, group, group_specs, layout, namespace
from tierd_client.staged_rank import StagedRank

LOOKUP_KEYS = 16  # a 4096-token prompt at 256 tokens per chunk


def run_cuda_bench(opts: BenchOptions, progress: Progress) -> dict:
    import torch

    socket, layers, chunks, batch, rounds = opts.socket, opts.layers, opts.chunks, opts.batch, opts.rounds
    chunk_tokens, block_tokens = opts.chunk_tokens, opts.block_tokens
    kv_layout, path = opts.kv_layout, opts.path
    if sorted(kv_layout) != sorted("LBNHC") or kv_layout[-1] != "C":
        raise BenchError(f"--kv-layout {kv_layout}: a physical order of L, B, N, H ending in C (e.g. BLNHC)")
    dev = torch.device("cuda", torch.cuda.current_device())
    progress.phase("building the native kernels (cached after the first time)")
    t_build = time.monotonic()
    native.load(timeout=900)
    build_s = time.monotonic() - t_build

    heads, row, block_bytes, bpc = opts.heads, opts.row_bytes, opts.block_bytes, opts.blocks_per_chunk
    region = (
        chunks * bpc
    )  # blocks per region: 0 = stored from, 1 = retrieved into, 2 = stored while retrieving
    num_blocks = 3 * region + PROBE_CHUNKS * bpc  # + the latency probes' blocks
    object_bytes = opts.object_bytes
    total = chunks * object_bytes
    progress.phase(
        f"laying out {layers * num_blocks * block_bytes / 2**30:.1f} GiB of KV on "
        f"{torch.cuda.get_device_name(dev)}"
    )
    # one buffer for all layers in the physical order ``kv_layout`` (vLLM 0.33's KVCacheLayout: LBNHC by
    # default, BLNHC block-outermost); each layer's logical view is [B, H, N, row]
    buf = torch.empty(layers * num_blocks * block_bytes, dtype=torch.uint8, device=dev)
    buf.random_(0, 256, generator=torch.Generator(device=dev).manual_seed(0))
    dims = {"L": layers, "B": num_blocks, "N": block_tokens, "H": heads, "C": row}
    kv = buf.view([dims[ch] for ch in kv_layout]).permute([kv_layout.index(ch) for ch in "LBHNC"])
    spans = [
        block_span(tuple(kv[l].shape), tuple(kv[l].stride()), 1, 0, tensor=0, offset=kv[l].storage_offset())
        for l in range(layers)
    ]
    refs, _ = share_cuda_tensors([buf])
    ns = namespace("tierd-bench-cuda", uuid.uuid4().hex)
    lay = layout(
        ns,
        0,
        chunk_tokens,
        refs,
        [group("full", block_tokens, spans, dtype=f"{opts.dtype_bytes}B")],
        device="cuda",
    )
    stager = None
    if path == "direct":
        if not direct_layout(PageLayout.from_wire(lay), [buf]):
            raise BenchError(f"--path direct: {kv_layout} keeps a layer's block in more than one run")
    else:
        stager = Stager(
            PageLayout.from_wire(lay),
            [buf],
            max(opts.staging_mb << 20, 2 * batch * object_bytes),
            opts.impl,
            opts.ctas,
        )
        lay["staging"] = stager.ref
    specs = group_specs(lay)
    pool_bytes = (
        int(opts.pool_gb * 2**30)
        if opts.pool_gb
        else int((4 if opts.interference else 2) * total * 1.05) + 24 * object_bytes + (512 << 20)
    )
    extra = ("--l1-init-size-gb", f"{pool_bytes / 2**30:.6f}")
    progress.phase("starting a private daemon" if socket is None else f"connecting to {socket}")
    ctx = private_daemon(pool_bytes, extra) if socket is None else contextlib.nullcontext(socket)

    # each region's block ids in a fixed random order, as an engine's free list hands them out after
    # a while (a copy of neighbouring blocks may merge; the kernels do not care)
    def shuffled(r: int) -> list[int]:
        return (torch.randperm(region, generator=torch.Generator().manual_seed(r)) + r * region).tolist()

    src, dst, src2 = shuffled(0), shuffled(1), shuffled(2)

    def ids(blocks: list[int], c: int) -> list[int]:
        return blocks[c * bpc : (c + 1) * bpc]

    def same(a: list[int], b: list[int]) -> bool:
        return bool(torch.equal(kv[:, a], kv[:, b]))

    def zero(blocks: list[int]) -> None:
        kv[:, min(blocks) : max(blocks) + 1].zero_()

    out: dict = {}
    with (
        ctx as endpoint,
        TierdClient(endpoint, timeout_s=300, connect_timeout_s=300, name="tierd-bench-cuda") as client,
    ):
        client.wait_ready(120)
        if not client.status().get("cuda"):
            raise BenchError("the daemon found no usable GPU")
        t_reg = time.monotonic()
        client.register("bench-0", lay, timeout=300)
        register_s = time.monotonic() - t_reg
        if stager is None:
            cap = min(batch * object_bytes, REQUEST_BYTES)  # the rank's own default bounds it (DirectRank)
            rank = DirectRank(
                client, "bench-0", dev, timeout_s=300, chunk_bytes=object_bytes, request_bytes=cap
            )
        else:
            rank = StagedRank(
                client,
                "bench-0",
                stager,
                request_bytes=batch * object_bytes,
                timeout_s=300,
                host_order=opts.gpu_order == "host",
            )
        after = torch.cuda.Event()

        def store(keys, blocks):
            after.record(torch.cuda.current_stream(dev))  # the "forward" that wrote the blocks
            return rank.store(
                [{"key": k, "blocks": [ids(blocks, c)]} for c, k in enumerate(keys)], after=after
            )

        def retrieve(keys, blocks):
            return rank.retrieve([{"key": k, "blocks": [ids(blocks, c)]} for c, k in enumerate(keys)])

        def settle(fut, bar):
            res = fut.result()  # a StoreReply, or a retrieve's tierd_client.rank_jobs.Loaded
            stored = getattr(res, "results", None)
            bar(len(res.ok if stored is None else stored))
            if stored is not None and any(x != "stored" for x in stored):
                raise BenchError(f"store answered {stored[:8]}: is the pool large enough?")
            if stored is None:
                if not all(res.ok):
                    raise BenchError(f"retrieve failed for blocks {res.failed[:8]}")
                res.done.synchronize()  # the blocks are in the engine's KV

        times: dict[str, list[float]] = {"store": [], "retrieve": [], "both": []}
        verified = True
        bar = progress.bar(rounds * 5 * chunks, "store/retrieve/both (chunks)")
        stages0 = {}
        for r in range(rounds):
            if r == min(1, rounds - 1):  # the rounds after the first (pool pages pinned, caches warm)
                stages0 = request_stages(client)
            client.call("CLEAR", {"namespace": ns})
            keys_a = [uuid.uuid4().bytes[:KEY_BYTES] for _ in range(chunks)]
            keys_c = [uuid.uuid4().bytes[:KEY_BYTES] for _ in range(chunks)]
            zero(dst)
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            settle(store(keys_a, src), bar)
            times["store"].append(time.perf_counter() - t)
            t = time.perf_counter()
            settle(retrieve(keys_a, dst), bar)
            times["retrieve"].append(time.perf_counter() - t)
            verified &= same(src, dst)
            zero(dst)
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            fs, fr = store(keys_c, src2), retrieve(keys_a, dst)
            settle(fs, bar)
            settle(fr, bar)
            times["both"].append(time.perf_counter() - t)
            verified &= same(src, dst)
            settle(retrieve(keys_c, dst), bar)  # untimed: what the concurrent store wrote
            verified &= same(src2, dst)
        bar(None)
        out["daemon_stages_ms"] = stage_means(stages0, request_stages(client))
        lk = keys_a[:LOOKUP_KEYS]
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < 1.0:
            hit = client.lookup(ns, lk, specs, chunk_tokens, lease=False).chunks
            if hit != len(lk):
                raise BenchError(f"LOOKUP of {len(lk)} stored chunks hit {hit}")
            n += 1
        lookups_seq = n / (time.perf_counter() - t)
        probe = torch.randperm(PROBE_CHUNKS * bpc, generator=torch.Generator().manual_seed(3)) + 3 * region
        probe = probe.tolist()
        latency = _latencies(torch, rank, object_bytes, probe, bpc, dev, client)
        if opts.interference:
            progress.phase("interference: compute and HBM steps alone, with tierd copying, with raw DMA")
            client.call("CLEAR", {"namespace": ns})
            settle(store(keys_a, src), lambda *_: None)
            out["interference"] = _interference(
                torch, dev, store, retrieve, keys_a, src2, dst, settle, total, opts.step_burst
            )
            out["interference_step_burst"] = opts.step_burst
        status = client.status()
        client.call("CLEAR", {"namespace": ns})  # leave nothing behind in the operator's daemon
        rank.idle(30)
        rank.close()
        client.unregister("bench-0")

    base = _baselines(
        torch,
        buf,
        total,
        block_bytes,
        [l * num_blocks + b for b in src[: min(chunks, 8) * bpc] for l in range(layers)],
        dev,
    )
    store_g = _gbps(total, min(times["store"]))
    retrieve_g = _gbps(total, min(times["retrieve"]))
    both_g = _gbps(2 * total, min(times["both"]))
    out.update(
        {
            "device": "cuda",
            "gpu": torch.cuda.get_device_name(dev),
            "layout": "mla" if opts.mla else "mha",
            "kv_layout": f"{kv_layout}: one buffer, per-layer [B, H, N, C] views (vLLM 0.33), shuffled ids",
            "path": path,
            "path_is": "gather/scatter in this (the engine's) process, daemon DMA through the staging buffer"
            if stager is not None
            else "the daemon's DMAs straight between the KV blocks and its pool (pitched rows; a block-"
            "outermost block one span), no SM work",
            "layers": layers,
            "block_bytes": block_bytes,
            "object_bytes": object_bytes,
            "chunks": chunks,
            "batch": batch,
            "bytes_per_round": total,
            "store_gbps": store_g,
            "retrieve_gbps": retrieve_g,
            "both_gbps": both_g,
            **base,
            "baseline_gbps": min(base["baseline_d2h_gbps"], base["baseline_h2d_gbps"]),
            "baseline": "raw pinned cudaMemcpyAsync of the same bytes, this run "
            "(store vs D2H, retrieve vs H2D)",
            "store_ratio": round(store_g / base["baseline_d2h_gbps"], 3),
            "retrieve_ratio": round(retrieve_g / base["baseline_h2d_gbps"], 3),
            "both_ratio": round(both_g / base["baseline_both_gbps"], 3),
            "per_block_ratio": round(base["per_block_gbps"] / base["baseline_d2h_gbps"], 3),
            "chunk_tokens": chunk_tokens,
            "latency_ms": {k: v for k, v in latency.items() if k.endswith("_chunks")},
            "wire_floor_ms": latency.get("wire_floor_ms"),
            "lookup_keys": len(lk),
            "lookups_per_s": round(lookups_seq, 1),
            "impl": "kernel" if native.get() is not None and opts.impl != "torch" else "torch",
            "ctas": stager.grid if stager is not None else 0,
            "gpu_order": opts.gpu_order,
            "native": native.state(),
            "register_s": round(register_s, 3),
            "bench_build_s": round(build_s, 3),
            "pinned_bytes": status.get("memory_pinned_bytes"),
            "lanes": status.get("cuda_detail", {}).get("lanes"),
            "times_s": {k: [round(x, 5) for x in v] for k, v in times.items()},
            "verified": bool(verified),
        }
    )
    return out
