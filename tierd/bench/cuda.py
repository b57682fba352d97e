"""``tierd bench --device cuda``: this process is the engine. It lays out a vLLM 0.33-style KV
buffer on the GPU (one buffer, per-layer ``[B, H, N, C]`` views, LBNHC; MLA ``[B, 1, N, 576]``),
registers it with a real daemon, and stores and retrieves through the engine-side path the vLLM
connector uses (tierd_client.staged_rank: gather/scatter in this process's context, the daemon
DMAs through the staging buffer), timing STORE, RETRIEVE and both at once, every byte verified,
next to same-run baselines on the same bytes: raw pinned cudaMemcpyAsync (one copy per
direction, and both directions on two streams) and one cudaMemcpyAsync per block.

``--interference``: a compute-bound step (bf16 matmul) and an HBM-bound step (device copy), each
timed alone, while tierd stores and retrieves at full rate, and while raw pinned DMA runs both
ways; printed as slowdown ratios next to the copy rate reached meanwhile.
"""

from __future__ import annotations

import contextlib
import time
import uuid

from tierd.protocol.keys import KEY_BYTES

LOOKUP_KEYS = 16  # a 4096-token prompt at 256 tokens per chunk


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _baselines(torch, buf, total: int, block_bytes: int, blocks: list[int], dev) -> dict:
    """Raw pinned copies of ``total`` bytes each way and both ways at once, and per-block copies."""
    from tierd_client import native

    d1 = torch.empty(total, dtype=torch.uint8, device=dev)
    d2 = torch.empty(total, dtype=torch.uint8, device=dev)
    h1 = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    h2 = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def best(fn, repeats=3):
        out = float("inf")
        for _ in range(repeats + 1):  # the first one warms up
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize(dev)
            out = min(out, time.perf_counter() - t)
        return out

    def d2h():
        with torch.cuda.stream(s1):
            h1.copy_(d1, non_blocking=True)

    def h2d():
        with torch.cuda.stream(s2):
            d2.copy_(h2, non_blocking=True)

    def both():
        d2h()
        h2d()

    out = {
        "baseline_d2h_gbps": _gbps(total, best(d2h)),
        "baseline_h2d_gbps": _gbps(total, best(h2d)),
        "baseline_both_gbps": _gbps(2 * total, best(both)),
    }
    # one cudaMemcpyAsync per block (the C++ loop when the extension is there: no Python per call)
    mod = native.get()
    base, hbase = buf.data_ptr(), h1.data_ptr()
    srcs = [base + b * block_bytes for b in blocks]
    dsts = [hbase + i * block_bytes for i in range(len(blocks))]
    sizes = [block_bytes] * len(blocks)
    nbytes = block_bytes * len(blocks)

    def per_block(d2h_dir: bool):
        s = s1 if d2h_dir else s2
        if mod is not None:
            if d2h_dir:
                mod.memcpy_many(dsts, srcs, sizes, True, s.cuda_stream)
            else:
                mod.memcpy_many(srcs, dsts, sizes, False, s.cuda_stream)
            return
        flat_d, flat_h = buf, h1
        with torch.cuda.stream(s):
            for i, b in enumerate(blocks):
                dv = flat_d[b * block_bytes : (b + 1) * block_bytes]
                hv = flat_h[i * block_bytes : (i + 1) * block_bytes]
                (hv.copy_(dv, non_blocking=True) if d2h_dir else dv.copy_(hv, non_blocking=True))

    out["per_block_gbps"] = _gbps(nbytes, best(lambda: per_block(True)))
    out["per_block_h2d_gbps"] = _gbps(nbytes, best(lambda: per_block(False)))
    out["per_block_copies"] = len(blocks)
    out["per_block_api"] = "cudaMemcpyAsync loop (C++)" if mod is not None else "torch copy_ loop"
    return out


def run_cuda_bench(
    *,
    socket,
    layers,
    kv_heads,
    head_dim,
    block_tokens,
    chunk_tokens,
    dtype_bytes,
    mla,
    chunks,
    batch,
    rounds,
    pool_gb,
    progress,
    interference: bool = False,
    staging_mb: int = 1024,
    impl: str = "auto",
    ctas: int = 0,
    gpu_order: str = "host",
    step_burst: int = 0,
) -> dict:
    import torch

    from tierd.bench.common import BenchError, private_daemon
    from tierd.protocol.layout import PageLayout
    from tierd_client import TierdClient, native
    from tierd_client.cuda_ipc import share_cuda_tensors
    from tierd_client.cuda_stage import Stager
    from tierd_client.layouts import block_span, group, group_specs, layout, namespace
    from tierd_client.staged_rank import StagedRank

    dev = torch.device("cuda", torch.cuda.current_device())
    progress.phase("building the native kernels (cached after the first time)")
    t_build = time.monotonic()
    native.load(timeout=900)
    build_s = time.monotonic() - t_build

    heads, row = (1, 576 * dtype_bytes) if mla else (kv_heads, 2 * head_dim * dtype_bytes)
    block_bytes = block_tokens * heads * row
    bpc = chunk_tokens // block_tokens
    region = (
        chunks * bpc
    )  # blocks per region: 0 = stored from, 1 = retrieved into, 2 = stored while retrieving
    num_blocks = 3 * region + bpc  # + one chunk for the latency probes
    object_bytes = layers * bpc * block_bytes
    total = chunks * object_bytes
    progress.phase(
        f"laying out {layers * num_blocks * block_bytes / 2**30:.1f} GiB of KV on "
        f"{torch.cuda.get_device_name(dev)}"
    )
    # one buffer for all layers, LBNHC: per layer [B][N][H][row]; logical per-layer view [B, H, N, row]
    buf = torch.empty(layers * num_blocks * block_bytes, dtype=torch.uint8, device=dev)
    kv = buf.view(layers, num_blocks, block_bytes)
    kv.random_(0, 256, generator=torch.Generator(device=dev).manual_seed(0))
    views = buf.view(layers, num_blocks, block_tokens, heads, row).permute(0, 1, 3, 2, 4)
    spans = [
        block_span(
            tuple(views[l].shape),
            tuple(views[l].stride()),
            1,
            0,
            tensor=0,
            offset=l * num_blocks * block_bytes,
        )
        for l in range(layers)
    ]
    refs, _ = share_cuda_tensors([buf])
    ns = namespace("tierd-bench-cuda", uuid.uuid4().hex)
    lay = layout(
        ns,
        0,
        chunk_tokens,
        refs,
        [group("full", block_tokens, spans, dtype=f"{dtype_bytes}B")],
        device="cuda",
    )
    stager = Stager(
        PageLayout.from_wire(lay), [buf], max(staging_mb << 20, 2 * batch * object_bytes), impl, ctas
    )
    lay["staging"] = stager.ref
    specs = group_specs(lay)
    pool_bytes = (
        int(pool_gb * 2**30)
        if pool_gb
        else int((4 if interference else 2) * total * 1.05) + 24 * object_bytes + (512 << 20)
    )
    extra = ("--l1-init-size-gb", f"{pool_bytes / 2**30:.6f}")
    progress.phase("starting a private daemon" if socket is None else f"connecting to {socket}")
    ctx = private_daemon(pool_bytes, extra) if socket is None else contextlib.nullcontext(socket)
    reg = lambda r: list(range(r * region, (r + 1) * region))  # noqa: E731
    src, dst, src2 = reg(0), reg(1), reg(2)

    def ids(blocks: list[int], c: int) -> list[int]:
        return blocks[c * bpc : (c + 1) * bpc]

    def same(a: list[int], b: list[int]) -> bool:
        return bool(torch.equal(kv[:, a[0] : a[-1] + 1], kv[:, b[0] : b[-1] + 1]))

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
        rank = StagedRank(
            client,
            "bench-0",
            stager,
            request_bytes=batch * object_bytes,
            timeout_s=300,
            host_order=gpu_order == "host",
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
            res = fut.result()
            bar(len(res.get("results", res.get("ok", ()))))
            if "results" in res and any(x != "stored" for x in res["results"]):
                raise BenchError(f"store answered {res['results'][:8]}: is the pool large enough?")
            if "ok" in res:
                if not all(res["ok"]):
                    raise BenchError(f"retrieve failed for blocks {res['failed'][:8]}")
                res["done"].synchronize()  # the blocks are in the engine's KV

        times: dict[str, list[float]] = {"store": [], "retrieve": [], "both": []}
        verified = True
        bar = progress.bar(rounds * 5 * chunks, "store/retrieve/both (chunks)")
        for _ in range(rounds):
            client.call("CLEAR", {"namespace": ns})
            keys_a = [uuid.uuid4().bytes[:KEY_BYTES] for _ in range(chunks)]
            keys_c = [uuid.uuid4().bytes[:KEY_BYTES] for _ in range(chunks)]
            kv[:, dst[0] : dst[-1] + 1].zero_()
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            settle(store(keys_a, src), bar)
            times["store"].append(time.perf_counter() - t)
            t = time.perf_counter()
            settle(retrieve(keys_a, dst), bar)
            times["retrieve"].append(time.perf_counter() - t)
            verified &= same(src, dst)
            kv[:, dst[0] : dst[-1] + 1].zero_()
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
        lk = keys_a[:LOOKUP_KEYS]
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < 1.0:
            hit = client.lookup(ns, lk, specs, chunk_tokens, lease=False)["chunks"]
            if hit != len(lk):
                raise BenchError(f"LOOKUP of {len(lk)} stored chunks hit {hit}")
            n += 1
        lookups_seq = n / (time.perf_counter() - t)
        latency = _latencies(torch, rank, kv, list(range(3 * region, 3 * region + bpc)), bpc, dev)
        if interference:
            progress.phase("interference: compute and HBM steps alone, with tierd copying, with raw DMA")
            client.call("CLEAR", {"namespace": ns})
            settle(store(keys_a, src), lambda *_: None)
            out["interference"] = _interference(
                torch, dev, store, retrieve, keys_a, src2, dst, settle, total, step_burst
            )
            out["interference_step_burst"] = step_burst
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
            "layout": "mla" if mla else "mha",
            "kv_layout": "LBNHC, one buffer, per-layer [B, H, N, C] views (vLLM 0.33)",
            "path": "gather/scatter in this (the engine's) process, daemon DMA through the staging buffer",
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
            "latency_ms": latency,
            "lookup_keys": len(lk),
            "lookups_per_s": round(lookups_seq, 1),
            "impl": "kernel" if native.get() is not None and impl != "torch" else "torch",
            "ctas": stager.grid,
            "gpu_order": gpu_order,
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


def _latencies(torch, rank, kv, probe: list[int], bpc: int, dev) -> dict:
    """Store and restore 1, 4 and 16 chunks, from the call to the moment the engine may read the
    blocks, next to the raw pinned copy time of the same bytes (median of 9 after 2 warm-ups)."""
    import numpy as np

    out = {}
    nbytes_chunk = kv.shape[0] * bpc * kv.shape[2]
    for n in (1, 4, 16):
        blocks = (probe * n)[: n * bpc]  # the probe chunk's blocks, repeated: n chunks of bytes
        host = torch.empty(n * nbytes_chunk, dtype=torch.uint8, pin_memory=True)
        devbuf = torch.empty(n * nbytes_chunk, dtype=torch.uint8, device=dev)
        st, rt, raw_d2h, raw_h2d = [], [], [], []
        for i in range(11):
            keys = [uuid.uuid4().bytes[:16] for _ in range(n)]
            chunks = [{"key": k, "blocks": [blocks[c * bpc : (c + 1) * bpc]]} for c, k in enumerate(keys)]
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            res = rank.store(chunks).result()
            t1 = time.perf_counter()
            got = rank.retrieve(chunks).result()
            got["done"].synchronize()
            t2 = time.perf_counter()
            if res["results"] != ["stored"] * n or not all(got["ok"]):
                raise RuntimeError(f"latency probe failed: {res} {got['ok']}")
            t3 = time.perf_counter()
            host.copy_(devbuf, non_blocking=True)
            torch.cuda.synchronize(dev)
            t4 = time.perf_counter()
            devbuf.copy_(host, non_blocking=True)
            torch.cuda.synchronize(dev)
            t5 = time.perf_counter()
            if i >= 2:
                st.append(t1 - t)
                rt.append(t2 - t1)
                raw_d2h.append(t4 - t3)
                raw_h2d.append(t5 - t4)
        med = lambda xs: round(float(np.median(xs)) * 1e3, 3)  # noqa: E731
        out[f"{n}_chunks"] = {
            "store": med(st),
            "raw_d2h": med(raw_d2h),
            "retrieve": med(rt),
            "raw_h2d": med(raw_h2d),
            "store_goal": round(1.2 * med(raw_d2h) + 0.3, 3),
            "retrieve_goal": round(1.2 * med(raw_h2d) + 0.3, 3),
        }
    return out


def _interference(torch, dev, store, retrieve, keys, src, dst, settle, total: int, burst: int = 0) -> dict:
    """Engine steps timed with CUDA events: alone, with tierd copying both ways, with raw DMA."""
    import threading

    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    big = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)
    steps = {"matmul": lambda: a @ b, "hbm_copy": lambda: big2.copy_(big)}

    def time_step(fn, reps=20) -> float:
        """GPU time per step; with ``burst``, over bursts of that many steps, so no more launches
        are queued at once (a full launch queue blocks the launching thread inside a launch,
        holding the GIL, which may starve this process's other threads: the tierd client's and
        the raw DMA loop's). 0: all ``reps`` queued at once (the recorded runs)."""
        fn()
        total, done = 0.0, 0
        while done < reps:
            k = reps - done if burst <= 0 else min(burst, reps - done)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(k):
                fn()
            e.record()
            e.synchronize()
            total += s.elapsed_time(e)
            done += k
        return total / reps

    def background(kind: str, stop: threading.Event, moved: list):
        if kind == "tierd":
            prev = keys  # stored: round k stores new keys while it retrieves round k-1's (LRU evicts k-2's)
            # the blocks it stores were written long ago, on a stream of their own: the store's
            # "forward" event is recorded there, not behind the steps queued on the timed stream
            # (which would hold every gather back until they ran and leave the link idle)
            writer = torch.cuda.Stream(dev)
            while not stop.is_set():
                new = [uuid.uuid4().bytes[:16] for _ in keys]
                with torch.cuda.stream(writer):
                    fs = store(new, src)
                fr = retrieve(prev, dst)
                stored, got = fs.result(), fr.result()
                got["done"].synchronize()
                prev = new
                moved[0] += total * (stored["results"].count("stored") + sum(got["ok"])) // len(keys)
        else:
            h1 = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            h2 = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            d1 = torch.empty(total, dtype=torch.uint8, device=dev)
            d2 = torch.empty(total, dtype=torch.uint8, device=dev)
            s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
            while not stop.is_set():
                with torch.cuda.stream(s1):
                    h1.copy_(d1, non_blocking=True)
                with torch.cuda.stream(s2):
                    d2.copy_(h2, non_blocking=True)
                s1.synchronize()
                s2.synchronize()
                moved[0] += 2 * total

    out: dict = {}
    for name, fn in steps.items():
        time_step(fn, reps=max(40, int(2000 / time_step(fn))))  # about 2 s: clocks and power settle first
        alone = [time_step(fn, reps=max(40, int(1000 / time_step(fn))))]
        row: dict = {}
        for kind in ("tierd", "raw_dma"):
            stop, moved = threading.Event(), [0]
            th = threading.Thread(target=background, args=(kind, stop, moved), daemon=True)
            th.start()
            time.sleep(0.5)
            m0, t0 = moved[0], time.perf_counter()
            with_copies = time_step(fn, reps=max(40, int(2000 / alone[0])))  # about 2 s of steps
            rate = (moved[0] - m0) / (time.perf_counter() - t0) / 1e9
            stop.set()
            th.join(60)
            alone.append(time_step(fn, reps=max(40, int(1000 / alone[0]))))  # alone again, right after
            row[f"{kind}_ms"] = round(with_copies, 3)
            row[f"{kind}_copy_gbps"] = round(rate, 2)
        base = sorted(alone)[len(alone) // 2]
        row["alone_ms"] = round(base, 3)
        row["alone_ms_all"] = [round(x, 3) for x in alone]
        for kind in ("tierd", "raw_dma"):
            row[f"{kind}_slowdown"] = round(row[f"{kind}_ms"] / base, 3)
        out[name] = row
    return out
