"""``tierd bench --device cuda``: this process is the engine. It lays out a vLLM 0.33-style KV
buffer on the GPU (one buffer, per-layer ``[B, H, N, C]`` views, LBNHC; MLA ``[B, 1, N, 576]``),
registers it with a real daemon over CUDA IPC, and times STORE, RETRIEVE and both at once
(a store of new chunks while other chunks are retrieved), every byte verified, next to
same-run baselines on the same bytes: raw pinned cudaMemcpyAsync (one copy per direction, and
both directions on two streams) and one cudaMemcpyAsync per block.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import uuid

from tierd.protocol.keys import KEY_BYTES

LOOKUP_KEYS = 16  # a 4096-token prompt at 256 tokens per chunk


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _baselines(torch, buf, total: int, block_bytes: int, blocks: list[int], dev) -> dict:
    """Raw pinned copies of ``total`` bytes each way and both ways at once, and per-block copies."""
    from tierd.transfer import native

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


def run_cuda_bench(*, socket, layers, kv_heads, head_dim, block_tokens, chunk_tokens, dtype_bytes, mla, chunks,
                   batch, rounds, pool_gb, progress) -> dict:
    import torch

    from tierd.bench.common import BenchError, private_daemon
    from tierd.transfer import native
    from tierd_client import TierdClient
    from tierd_client.cuda_ipc import StoreFence, share_cuda_tensors
    from tierd_client.layouts import block_span, group, group_specs, layout, namespace

    if not torch.cuda.is_available():
        raise BenchError("--device cuda needs a CUDA GPU visible to this process")
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)
    t_build = time.monotonic()
    native.load(timeout=900)  # warm the shared build cache, so the daemon only loads it
    build_s = time.monotonic() - t_build

    heads, row = (1, 576 * dtype_bytes) if mla else (kv_heads, 2 * head_dim * dtype_bytes)
    block_bytes = block_tokens * heads * row
    bpc = chunk_tokens // block_tokens
    region = chunks * bpc  # blocks per region: 0 = stored from, 1 = retrieved into, 2 = stored while retrieving
    num_blocks = 3 * region + bpc  # + one chunk for the latency probes
    object_bytes = layers * bpc * block_bytes
    total = chunks * object_bytes
    # one buffer for all layers, LBNHC: per layer [B][N][H][row]; logical per-layer view [B, H, N, row]
    buf = torch.empty(layers * num_blocks * block_bytes, dtype=torch.uint8, device=dev)
    kv = buf.view(layers, num_blocks, block_bytes)
    gen = torch.Generator(device=dev).manual_seed(0)
    kv.random_(0, 256, generator=gen)
    views = buf.view(layers, num_blocks, block_tokens, heads, row).permute(0, 1, 3, 2, 4)
    spans = [block_span(tuple(views[l].shape), tuple(views[l].stride()), 1, 0, tensor=0, offset=l * num_blocks * block_bytes)
             for l in range(layers)]
    refs, _ = share_cuda_tensors([buf])
    ns = namespace("tierd-bench-cuda", uuid.uuid4().hex)
    lay = layout(ns, 0, chunk_tokens, refs, [group("full", block_tokens, spans, dtype=f"{dtype_bytes}B")], device="cuda")
    specs = group_specs(lay)
    pool_bytes = int(pool_gb * 2**30) if pool_gb else int(2 * total * 1.05) + 24 * object_bytes + (512 << 20)
    extra = ("--l1-init-size-gb", f"{pool_bytes / 2**30:.6f}")
    ctx = private_daemon(pool_bytes, extra) if socket is None else contextlib.nullcontext(socket)
    fence = StoreFence(dev)
    reg = lambda r: list(range(r * region, (r + 1) * region))  # noqa: E731
    src, dst, src2 = reg(0), reg(1), reg(2)

    def ids(blocks: list[int], c: int) -> list[int]:
        return blocks[c * bpc : (c + 1) * bpc]

    def same(a: list[int], b: list[int]) -> bool:
        return bool(torch.equal(kv[:, a[0] : a[-1] + 1], kv[:, b[0] : b[-1] + 1]))

    out: dict = {}
    with ctx as endpoint, TierdClient(endpoint, timeout_s=300, connect_timeout_s=300, name="tierd-bench-cuda") as client:
        client.wait_ready(120)
        t0 = time.monotonic()
        while True:  # the daemon loads the extension in the background; time it only once loaded
            st = client.status()
            impl = st.get("cuda_detail", {}).get("native", {}).get("state")
            if impl in ("ready", "failed", "disabled") or time.monotonic() - t0 > 600:
                break
            time.sleep(0.2)
        if not st.get("cuda"):
            raise BenchError("the daemon found no usable GPU")
        t_reg = time.monotonic()
        client.register("bench-0", lay, timeout=300)
        register_s = time.monotonic() - t_reg

        def store(keys, blocks, first=0):
            handle = fence.mark()
            return [client.store_async("bench-0", [{"key": keys[c], "blocks": [ids(blocks, c)]}
                                                   for c in range(i, min(i + batch, len(keys)))], event=handle)
                    for i in range(first, len(keys), batch)]

        def retrieve(keys, blocks):
            return [client.retrieve_async("bench-0", [{"key": keys[c], "blocks": [ids(blocks, c)]}
                                                      for c in range(i, min(i + batch, len(keys)))])
                    for i in range(0, len(keys), batch)]

        def settle(futs, bar):
            for fut in futs:
                res = fut.result()
                bar(1)
                if "results" in res and any(x != "stored" for x in res["results"]):
                    raise BenchError(f"store answered {res['results']}: is the pool large enough?")
                if "ok" in res and not all(res["ok"]):
                    raise BenchError(f"retrieve failed for blocks {res['failed'][:8]}")

        times: dict[str, list[float]] = {"store": [], "retrieve": [], "both": []}
        verified = True
        steps = rounds * 5 * -(-chunks // batch)
        bar = progress.bar(steps, "store/retrieve/both")
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
            futs_s, futs_r = store(keys_c, src2), retrieve(keys_a, dst)
            settle(futs_s + futs_r, bar)
            times["both"].append(time.perf_counter() - t)
            verified &= same(src, dst)
            settle(retrieve(keys_c, dst), bar)  # untimed: what the concurrent store wrote
            verified &= same(src2, dst)
        bar(None)

        # latency of one chunk, through the whole protocol
        probe = list(range(3 * region, 3 * region + bpc))
        lat_s, lat_r = [], []
        for i in range(23):
            [key] = [uuid.uuid4().bytes[:KEY_BYTES]]
            t = time.perf_counter()
            res = client.store("bench-0", [{"key": key, "blocks": [probe]}], event=fence.mark())
            ts = time.perf_counter() - t
            t = time.perf_counter()
            got = client.retrieve("bench-0", [{"key": key, "blocks": [probe]}])
            tr = time.perf_counter() - t
            if res["results"] != ["stored"] or not all(got["ok"]):
                raise BenchError(f"latency probe failed: {res} {got}")
            if i >= 3:
                lat_s.append(ts)
                lat_r.append(tr)

        # lookups: a LOOKUP_KEYS-chunk prefix that hits, no lease
        lk = keys_a[:LOOKUP_KEYS]
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < 1.5:
            assert client.lookup(ns, lk, specs, chunk_tokens, lease=False)["chunks"] == len(lk)
            n += 1
        lookups_seq = n / (time.perf_counter() - t)
        n, t, inflight = 0, time.perf_counter(), []
        while time.perf_counter() - t < 1.5:
            inflight.append(client.lookup_async(ns, lk, specs, chunk_tokens, lease=False))
            if len(inflight) >= 64:
                inflight.pop(0).result()
                n += 1
        for f in inflight:
            f.result()
            n += 1
        lookups_pipe = n / (time.perf_counter() - t)
        status = client.status()
        client.call("CLEAR", {"namespace": ns})  # leave nothing behind in the operator's daemon
        client.unregister("bench-0")

    base = _baselines(torch, buf, total, block_bytes,
                      [l * num_blocks + b for b in src[: min(chunks, 8) * bpc] for l in range(layers)], dev)
    store_g = _gbps(total, min(times["store"]))
    retrieve_g = _gbps(total, min(times["retrieve"]))
    both_g = _gbps(2 * total, min(times["both"]))
    out.update({
        "device": "cuda",
        "gpu": torch.cuda.get_device_name(dev),
        "layout": "mla" if mla else "mha",
        "kv_layout": "LBNHC, one buffer, per-layer [B, H, N, C] views (vLLM 0.33)",
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
        "baseline": "raw pinned cudaMemcpyAsync of the same bytes, this run (store vs D2H, retrieve vs H2D)",
        "store_ratio": round(store_g / base["baseline_d2h_gbps"], 3),
        "retrieve_ratio": round(retrieve_g / base["baseline_h2d_gbps"], 3),
        "both_ratio": round(both_g / base["baseline_both_gbps"], 3),
        "per_block_ratio": round(base["per_block_gbps"] / base["baseline_d2h_gbps"], 3),
        "chunk_tokens": chunk_tokens,
        "chunk_latency_ms": {"store": round(statistics.median(lat_s) * 1e3, 3),
                             "retrieve": round(statistics.median(lat_r) * 1e3, 3),
                             "store_p90": round(sorted(lat_s)[int(0.9 * len(lat_s))] * 1e3, 3),
                             "retrieve_p90": round(sorted(lat_r)[int(0.9 * len(lat_r))] * 1e3, 3)},
        "lookup_keys": len(lk),
        "lookups_per_s": round(lookups_seq, 1),
        "lookups_per_s_pipelined": round(lookups_pipe, 1),
        "impl": impl,
        "native": status.get("cuda_detail", {}).get("native"),
        "register_s": round(register_s, 3),
        "bench_build_s": round(build_s, 3),
        "pinned_bytes": status.get("memory_pinned_bytes"),
        "lanes": status.get("cuda_detail", {}).get("lanes"),
        "times_s": {k: [round(x, 5) for x in v] for k, v in times.items()},
        "verified": bool(verified),
    })
    return out
