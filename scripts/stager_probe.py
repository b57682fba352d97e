"""Where a co-running matmul's slowdown under tierd's GPU copies comes from (issue 9): the engine
side's gather/scatter (tierd_client.cuda_stage.Stager, native kernels) with the DMA done in the
same process, no daemon, next to the same moves with torch's index_select/index_copy_ and to raw
DMA, all in one run. The same layout as ``tierd bench --device cuda`` (32 layers x 64 KiB blocks,
16 blocks a chunk, 8 chunks a request).

    python scripts/stager_probe.py [--layers 32] [--kv-heads 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=8, help="chunks a request")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import torch

    from tierd.protocol.layout import PageLayout
    from tierd_client import native
    from tierd_client.cuda_ipc import share_cuda_tensors
    from tierd_client.cuda_stage import Stager
    from tierd_client.layouts import block_span, group, layout, namespace

    native.load(timeout=900)
    dev = torch.device("cuda", 0)
    layers, bt, row = args.layers, 16, 2 * 128 * 2
    heads = args.kv_heads
    block_bytes = bt * heads * row
    bpc = 256 // bt
    nb = 4 * args.chunks * bpc
    buf = torch.empty(layers * nb * block_bytes, dtype=torch.uint8, device=dev)
    buf.random_(0, 256)
    views = buf.view(layers, nb, bt, heads, row).permute(0, 1, 3, 2, 4)
    spans = [
        block_span(tuple(v.shape), tuple(v.stride()), 1, 0, tensor=0, offset=i * nb * block_bytes)
        for i, v in enumerate(views)
    ]
    refs, _ = share_cuda_tensors([buf])
    lay = layout(namespace("probe", "x"), 0, 256, refs, [group("full", bt, spans, dtype="2B")], device="cuda")
    chunk_bytes = layers * bpc * block_bytes
    total = args.chunks * chunk_bytes
    stager = Stager(PageLayout.from_wire(lay), [buf], 2 * total)
    src = [[list(range(c * bpc, (c + 1) * bpc))] for c in range(args.chunks)]
    dst = [[list(range((args.chunks + c) * bpc, (args.chunks + c + 1) * bpc))] for c in range(args.chunks)]
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    stg = stager.buf
    # torch equivalents (the same bytes each way, in [layer][block] order rather than staging's
    # [chunk][layer][block]: a cost probe, not a restore)
    rows = buf.view(layers, nb, block_bytes)
    ids_src = torch.tensor([b for c in src for b in c[0]], device=dev)
    ids_dst = torch.tensor([b for c in dst for b in c[0]], device=dev)
    stg_rows = stg[: 2 * total].view(2, layers, -1, block_bytes)  # [half][layer][block][bytes]

    def native_both():
        stager.gather(src, 0)
        s1.wait_stream(stager.stream)
        with torch.cuda.stream(s1):
            host.copy_(stg[:total], non_blocking=True)
        with torch.cuda.stream(s2):
            stg[total : 2 * total].copy_(host2, non_blocking=True)
        stager.scatter_stream.wait_stream(s2)
        done = stager.scatter(dst, total)
        s1.synchronize()
        done.synchronize()
        return 2 * total

    def native_gather_only():
        stager.gather(src, 0)
        s1.wait_stream(stager.stream)
        with torch.cuda.stream(s1):
            host.copy_(stg[:total], non_blocking=True)
        with torch.cuda.stream(s2):
            stg[total : 2 * total].copy_(host2, non_blocking=True)
        s1.synchronize()
        s2.synchronize()
        return 2 * total

    def torch_both():
        with torch.cuda.stream(s1):
            torch.index_select(rows, 1, ids_src, out=stg_rows[0])
            host.copy_(stg[:total], non_blocking=True)
        with torch.cuda.stream(s2):
            stg[total : 2 * total].copy_(host2, non_blocking=True)
            rows.index_copy_(1, ids_dst, stg_rows[1])
        s1.synchronize()
        s2.synchronize()
        return 2 * total

    def raw():
        with torch.cuda.stream(s1):
            host.copy_(stg[:total], non_blocking=True)
        with torch.cuda.stream(s2):
            stg[total : 2 * total].copy_(host2, non_blocking=True)
        s1.synchronize()
        s2.synchronize()
        return 2 * total

    def kernels_only():  # the native gather and scatter, no DMA
        stager.gather(src, 0)
        done = stager.scatter(dst, total)
        torch.cuda.current_stream(dev).wait_stream(stager.stream)
        done.synchronize()
        stager.stream.synchronize()
        return 2 * total

    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    bm = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    big = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)
    steps = {"matmul": lambda: a @ bm, "hbm_copy": lambda: big2.copy_(big)}

    def step_ms(fn, reps: int) -> float:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / reps

    kinds = {
        "native_both": native_both,
        "native_gather_only": native_gather_only,
        "kernels_only": kernels_only,
        "torch_both": torch_both,
        "raw_dma": raw,
    }
    out: dict = {"request_bytes": total, "layers": layers, "block_bytes": block_bytes}
    # alone rates
    for name, fn in kinds.items():
        fn()
        t = time.perf_counter()
        moved = sum(fn() for _ in range(10))
        out[f"{name}_alone_gbps"] = round(moved / (time.perf_counter() - t) / 1e9, 1)
    print({k: v for k, v in out.items() if k.endswith("gbps")}, flush=True)
    for sname, sfn in steps.items():
        step_ms(sfn, 300)
        alone = [step_ms(sfn, 200)]
        res = {}
        for name, fn in kinds.items():
            stop, moved = threading.Event(), [0]

            def bg(fn=fn, stop=stop, moved=moved):
                while not stop.is_set():
                    moved[0] += fn()

            th = threading.Thread(target=bg, daemon=True)
            th.start()
            time.sleep(0.3)
            m0, t = moved[0], time.perf_counter()
            ms = step_ms(sfn, 600 if sname == "matmul" else 1000)
            rate = (moved[0] - m0) / (time.perf_counter() - t) / 1e9
            stop.set()
            th.join(30)
            alone.append(step_ms(sfn, 200))
            res[name] = [round(ms, 3), round(rate, 1)]
        mid = sorted(alone)[len(alone) // 2]
        for name, (ms, rate) in res.items():
            res[name] = {"slowdown": round(ms / mid, 3), "copy_gbps": rate}
            print(f"{sname:8} {name:20} {res[name]}", flush=True)
        out[sname] = res
        out[sname + "_alone_ms"] = [round(x, 3) for x in alone]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
