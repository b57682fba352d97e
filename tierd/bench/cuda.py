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
the daemon's lane time per call (issuing the DMAs; waiting for them), the stages inside the
engine's gather and scatter calls, and ``wire_floor_ms``: round trips that copy nothing.

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
    kv_layout: str = "LBNHC",
    path: str = "staged",
) -> dict:
    import torch

    from tierd.bench.common import BenchError, private_daemon
    from tierd.protocol.layout import PageLayout
    from tierd_client import TierdClient, native
    from tierd_client.cuda_ipc import share_cuda_tensors
    from tierd_client.cuda_stage import Stager
    from tierd_client.direct_rank import DirectRank, direct_layout
    from tierd_client.layouts import block_span, group, group_specs, layout, namespace
    from tierd_client.staged_rank import StagedRank

    if sorted(kv_layout) != sorted("LBNHC") or kv_layout[-1] != "C":
        raise BenchError(f"--kv-layout {kv_layout}: a physical order of L, B, N, H ending in C (e.g. BLNHC)")
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
        [group("full", block_tokens, spans, dtype=f"{dtype_bytes}B")],
        device="cuda",
    )
    stager = None
    if path == "direct":
        if not direct_layout(PageLayout.from_wire(lay), [buf]):
            raise BenchError(f"--path direct: {kv_layout} keeps a layer's block in more than one run")
    else:
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
            rank = DirectRank(client, "bench-0", dev, timeout_s=300)
        else:
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
        lk = keys_a[:LOOKUP_KEYS]
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < 1.0:
            hit = client.lookup(ns, lk, specs, chunk_tokens, lease=False)["chunks"]
            if hit != len(lk):
                raise BenchError(f"LOOKUP of {len(lk)} stored chunks hit {hit}")
            n += 1
        lookups_seq = n / (time.perf_counter() - t)
        probe = (torch.randperm(bpc, generator=torch.Generator().manual_seed(3)) + 3 * region).tolist()
        latency = _latencies(torch, rank, object_bytes, probe, bpc, dev, client)
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
            "kv_layout": f"{kv_layout}: one buffer, per-layer [B, H, N, C] views (vLLM 0.33), shuffled ids",
            "path": path,
            "path_is": "gather/scatter in this (the engine's) process, daemon DMA through the staging buffer"
            if stager is not None
            else "the daemon's pitched copies straight between the KV blocks and its pool, no SM work",
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
            "impl": "kernel" if native.get() is not None and impl != "torch" else "torch",
            "ctas": stager.grid if stager is not None else 0,
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


def _latencies(torch, rank, nbytes_chunk: int, probe: list[int], bpc: int, dev, client=None) -> dict:
    """Store and restore 1, 4 and 16 chunks, from the call to the moment the engine may read the
    blocks, next to the raw pinned copy time of the same bytes (median of 9 after 2 warm-ups), and
    where a request's time goes (``breakdown``: the medians of its stages, module doc)."""
    import numpy as np

    out = {}
    med = lambda xs: round(float(np.median(xs)) * 1e3, 3) if len(xs) else None  # noqa: E731
    for n in (1, 4, 16):
        blocks = (probe * n)[: n * bpc]  # the probe chunk's blocks, repeated: n chunks of bytes
        host = torch.empty(n * nbytes_chunk, dtype=torch.uint8, pin_memory=True)
        devbuf = torch.empty(n * nbytes_chunk, dtype=torch.uint8, device=dev)
        st, rt, raw_d2h, raw_h2d, wait = [], [], [], [], []
        lanes0 = _lanes(client)
        rank.trace = []
        stager = getattr(rank, "stager", None)
        if stager is not None:
            stager.timings = {}
        for i in range(11):
            keys = [uuid.uuid4().bytes[:16] for _ in range(n)]
            chunks = [{"key": k, "blocks": [blocks[c * bpc : (c + 1) * bpc]]} for c, k in enumerate(keys)]
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            res = rank.store(chunks).result()
            t1 = time.perf_counter()
            got = rank.retrieve(chunks).result()
            t1b = time.perf_counter()
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
                wait.append((t1, t1b, t2))
        trace, rank.trace = rank.trace, None
        timings = stager.timings if stager is not None else None
        if stager is not None:
            stager.timings = None
        lanes1 = _lanes(client)
        row = {
            "store": med(st),
            "raw_d2h": med(raw_d2h),
            "retrieve": med(rt),
            "raw_h2d": med(raw_h2d),
            "store_goal": round((1.2 if n == 1 else 1.1) * med(raw_d2h) + 0.3, 3),
            "retrieve_goal": round((1.2 if n == 1 else 1.1) * med(raw_h2d) + 0.3, 3),
        }
        direct = getattr(rank, "stager", None) is None
        row["breakdown"] = _breakdown(trace, wait, lanes0, lanes1, med, direct)
        for op, calls in (timings or {}).items():  # inside the engine's gather and scatter calls
            calls = calls[2:]
            stages = {k for c in calls for k in c}
            row["breakdown"][f"engine {op} call"] = {
                k: med([c.get(k, 0.0) for c in calls]) for k in sorted(stages)
            }
        out[f"{n}_chunks"] = row
    if client is not None:
        out["wire_floor_ms"] = _wire_floor(client, rank, bpc, med)
    return out


# a request's stages as StagedRank's trace stamps them, in order: (name, from stamp, to stamp)
STORE_STAGES = (
    ("handoff to the submitter thread", "call", "start"),
    ("staging room, gather launch (Python)", "start", "launched"),
    ("gather on the GPU, helper thread wakes", "launched", "gathered"),
    ("STORE encoded and sent", "gathered", "sent"),
    ("daemon and wire, DMA included", "sent", "answered"),
)
DIRECT_STAGES = (  # DirectRank: no gather, no scatter, no room
    ("ordering (the caller's own thread when its event is done), encoded and sent", "call", "sent"),
    ("daemon and wire, copies included (a RETRIEVE's answered once queued)", "sent", "answered"),
)
RETRIEVE_STAGES = (
    ("handoff to the submitter thread", "call", "start"),
    ("staging room, RETRIEVE sent", "start", "sent"),
    ("daemon and wire (DMA queued, answered at once)", "sent", "answered"),
    ("scatter launch (Python)", "answered", "scattered"),
)


def _breakdown(trace: list[dict], waits: list[tuple], lanes0: dict, lanes1: dict, med, direct=False) -> dict:
    """Medians (ms) of each stage of a job's first request over the timed iterations (the first
    two are warm-ups), the caller's wait after the last stamp, and the daemon's lane times per
    call (``host``: issuing the DMAs; ``sync``: waiting for them)."""
    firsts = {"STORE": [], "RETRIEVE": []}
    for rec in trace:
        if "call" in rec and rec.get("first", True):
            firsts[rec["op"]].append(rec)
    out: dict = {}
    stages_of = {"STORE": STORE_STAGES, "RETRIEVE": RETRIEVE_STAGES}
    if direct:
        stages_of = dict.fromkeys(stages_of, DIRECT_STAGES)
    for op, stages in stages_of.items():
        recs = firsts[op][2:]
        row = {}
        for name, a, b in stages:
            xs = [r[b] - r[a] for r in recs if a in r and b in r]
            if xs:
                row[name] = med(xs)
        out[op.lower()] = row
    # the caller's side: a STORE's answer to the caller's result(), a RETRIEVE's scatter to result(),
    # and its wait for the DMA and the scatter on the GPU
    st = [r for r in firsts["STORE"][2:] if "answered" in r]
    last = "answered" if direct else "scattered"
    rt = [r for r in firsts["RETRIEVE"][2:] if last in r]
    if len(st) == len(waits):
        out["store"]["answer to the caller"] = med([w[0] - r["answered"] for r, w in zip(st, waits)])
    if len(rt) == len(waits):
        out["retrieve"]["answer to the caller"] = med([w[1] - r[last] for r, w in zip(rt, waits)])
        out["retrieve"]["copies (and scatter) finish on the GPU"] = med([w[2] - w[1] for w in waits])
    for name, lane in (("store", "store"), ("retrieve", "retrieve")):
        a, b = lanes0.get(lane) or {}, lanes1.get(lane) or {}
        calls = b.get("calls", 0) - a.get("calls", 0)
        if calls:
            for k in ("host_s", "sync_s"):
                out[name][f"daemon lane {k[:-2]} per call"] = round((b[k] - a[k]) / calls * 1e3, 3)
    return out


def _lanes(client) -> dict:
    if client is None:
        return {}
    return (client.status().get("cuda_detail") or {}).get("lanes") or {}


def _wire_floor(client, rank, bpc: int, med) -> dict:
    """Round trips that copy nothing, the same way a STORE's answer travels (through the client's
    I/O thread to a waiting caller): a STORE of chunks already stored and a RETRIEVE of a key
    never stored, each one chunk."""
    import threading

    key = uuid.uuid4().bytes[:16]
    chunk = {"key": key, "blocks": [list(range(bpc))]}
    rank.store([chunk]).result()
    missing = {**chunk, "key": uuid.uuid4().bytes[:16]}
    at = {"staged_at": 0} if getattr(rank, "stager", None) is not None else {}
    out = {}
    for name, op, body in (
        ("store_exists", "STORE", {"instance": rank.instance, "chunks": [chunk], **at}),
        ("retrieve_missing", "RETRIEVE", {"instance": rank.instance, "chunks": [missing], **at}),
    ):
        xs = []
        for i in range(23):
            ev = threading.Event()
            t = time.perf_counter()
            fut = client.call_async(op, body)
            fut.add_done_callback(lambda _f, ev=ev: ev.set())
            ev.wait(10)
            if i >= 3:
                xs.append(time.perf_counter() - t)
        out[name] = med(xs)
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
