"""DMA-only copies of scattered KV fragments on a CUDA GPU (issue 9, option c): how fast the copy
engines move N fragments of F bytes with one cudaMemcpyBatchAsync (or one cudaMemcpyAsync each),
and what that costs a co-running bf16 matmul, next to the SM gather it would replace.

    python scripts/dma_probe.py [--fragments 8192,18432,65536] [--batch-mb 64] [--json out.json]

Every figure is a ratio to a baseline measured in the same run: a contiguous pinned copy of the
same bytes (rates), the matmul alone (slowdowns). Needs torch with CUDA and nvcc (the extension
is built with torch's cpp_extension).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

SRC = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <vector>

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// One cudaMemcpyBatchAsync for every (dst, src, size); flags 1: prefer copy engines (overlap with SMs).
void batch(torch::Tensor dsts, torch::Tensor srcs, torch::Tensor sizes, int64_t stream, int64_t flags) {
  const size_t n = dsts.numel();
  std::vector<void*> d(n), s(n);
  std::vector<size_t> z(n);
  auto* D = dsts.data_ptr<int64_t>(); auto* S = srcs.data_ptr<int64_t>(); auto* Z = sizes.data_ptr<int64_t>();
  for (size_t i = 0; i < n; ++i) { d[i] = (void*)D[i]; s[i] = (void*)S[i]; z[i] = (size_t)Z[i]; }
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = (unsigned)flags;
  size_t idx = 0;
  py::gil_scoped_release nogil;
#if CUDART_VERSION >= 13000
  check(cudaMemcpyBatchAsync(d.data(), s.data(), z.data(), n, &attr, &idx, 1,
                             (cudaStream_t)stream), "batch");
#else
  size_t fail = 0;
  check(cudaMemcpyBatchAsync(d.data(), s.data(), z.data(), n, &attr, &idx, 1, &fail,
                             (cudaStream_t)stream), "batch");
#endif
}

void loop(torch::Tensor dsts, torch::Tensor srcs, torch::Tensor sizes, int64_t stream) {
  const size_t n = dsts.numel();
  auto* D = dsts.data_ptr<int64_t>(); auto* S = srcs.data_ptr<int64_t>(); auto* Z = sizes.data_ptr<int64_t>();
  py::gil_scoped_release nogil;
  for (size_t i = 0; i < n; ++i)
    check(cudaMemcpyAsync((void*)D[i], (void*)S[i], (size_t)Z[i], cudaMemcpyDefault,
                          (cudaStream_t)stream), "memcpy");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("batch", &batch);
  m.def("loop", &loop);
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fragments", default="8192,18432,65536", help="fragment sizes in bytes")
    ap.add_argument("--batch-mb", type=int, default=64, help="bytes per batch")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import torch
    from torch.utils.cpp_extension import load_inline

    t0 = time.time()
    ext = load_inline("dma_probe_ext", cpp_sources="", cuda_sources=SRC, verbose=False)
    built = time.time() - t0
    print(f"built in {built:.1f} s; torch {torch.__version__} cuda {torch.version.cuda}", flush=True)
    dev = torch.device("cuda", 0)
    total = args.batch_mb << 20
    kv = torch.empty(4 << 30, dtype=torch.uint8, device=dev)  # the engine's KV: fragments anywhere in it
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    staging = torch.empty(total, dtype=torch.uint8, device=dev)
    dense = torch.empty(total, dtype=torch.uint8, device=dev)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    out: dict = {"batch_bytes": total, "device": torch.cuda.get_device_name(dev)}

    def timed(fn, reps=10) -> float:
        fn()
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t) / reps

    def gbps(sec: float, nbytes: int = total) -> float:
        return round(nbytes / sec / 1e9, 2)

    def raw_d2h():
        with torch.cuda.stream(s1):
            host.copy_(dense, non_blocking=True)

    def raw_h2d():
        with torch.cuda.stream(s2):
            dense.copy_(host2, non_blocking=True)

    def raw_both():
        raw_d2h()
        raw_h2d()

    base = {
        "d2h": gbps(timed(raw_d2h)),
        "h2d": gbps(timed(raw_h2d)),
        "both": gbps(timed(raw_both), 2 * total),
    }
    out["raw_gbps"] = base
    print("raw contiguous", base, flush=True)

    def plan(frag: int, dst_base: int, to_kv: bool):
        n = total // frag
        slots = kv.numel() // frag
        ids = torch.randperm(slots)[:n].sort().values  # distinct blocks, in id order as vLLM hands them
        kv_addr = kv.data_ptr() + ids.to(torch.int64) * frag
        lin = dst_base + torch.arange(n, dtype=torch.int64) * frag
        sizes = torch.full((n,), frag, dtype=torch.int64)
        return (kv_addr, lin, sizes) if to_kv else (lin, kv_addr, sizes)

    rows = {}
    for frag in [int(x) for x in args.fragments.split(",")]:
        d2h = plan(frag, host.data_ptr(), False)
        h2d = plan(frag, host2.data_ptr(), True)
        d2d = plan(frag, staging.data_ptr(), False)
        r: dict = {"fragments": total // frag}

        def b(p, s, flags=0):
            ext.batch(p[0], p[1], p[2], s.cuda_stream, flags)

        r["batch_d2h"] = gbps(timed(lambda d2h=d2h: b(d2h, s1)))
        r["batch_h2d"] = gbps(timed(lambda h2d=h2d: b(h2d, s2)))
        r["batch_both"] = gbps(timed(lambda d2h=d2h, h2d=h2d: (b(d2h, s1), b(h2d, s2))), 2 * total)
        r["loop_d2h"] = gbps(timed(lambda d2h=d2h: ext.loop(d2h[0], d2h[1], d2h[2], s1.cuda_stream), reps=3))
        r["batch_d2d_ce"] = gbps(timed(lambda d2d=d2d: b(d2d, s1, 1)))
        r["batch_d2d"] = gbps(timed(lambda d2d=d2d: b(d2d, s1, 0)))
        idx = (d2d[1] - kv.data_ptr()) // frag
        kv2 = kv[: (kv.numel() // frag) * frag].view(-1, frag)
        sv = staging[: idx.numel() * frag].view(-1, frag)
        idx_d = idx.to(dev)
        r["index_select_d2d"] = gbps(
            timed(lambda kv2=kv2, idx_d=idx_d, sv=sv: torch.index_select(kv2, 0, idx_d, out=sv))
        )
        for k in ("batch_d2h", "batch_h2d"):
            r[k + "_ratio"] = round(r[k] / base[k.split("_")[1]], 3)
        r["batch_both_ratio"] = round(r["batch_both"] / base["both"], 3)
        rows[frag] = r
        print(frag, r, flush=True)
    out["rates"] = rows

    # interference: bf16 matmul timed with CUDA events, alone and while copies run on other streams
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    bm = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

    def step_ms(reps: int) -> float:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            a @ bm
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / reps

    step_ms(300)  # clocks settle
    frag_i = 65536 if 65536 in rows else max(rows)
    small = min(rows)
    kinds = {}
    for frag in sorted({frag_i, small}):
        d2h, h2d, d2d = plan(frag, host.data_ptr(), False), plan(frag, host2.data_ptr(), True), None
        d2d = plan(frag, staging.data_ptr(), False)
        idx_d = ((d2d[1] - kv.data_ptr()) // frag).to(dev)
        kv2 = kv[: (kv.numel() // frag) * frag].view(-1, frag)
        sv = staging[: idx_d.numel() * frag].view(-1, frag)

        def dma_only(d2h=d2h, h2d=h2d):
            ext.batch(d2h[0], d2h[1], d2h[2], s1.cuda_stream, 0)
            ext.batch(h2d[0], h2d[1], h2d[2], s2.cuda_stream, 0)
            s1.synchronize()
            s2.synchronize()
            return 2 * total

        def ce_gather(d2d=d2d):  # copy-engine gather into staging, then one DMA out; and one in
            ext.batch(d2d[0], d2d[1], d2d[2], s1.cuda_stream, 1)
            with torch.cuda.stream(s1):
                host.copy_(staging, non_blocking=True)
            with torch.cuda.stream(s2):
                dense.copy_(host2, non_blocking=True)
            s1.synchronize()
            s2.synchronize()
            return 2 * total

        def sm_gather(idx_d=idx_d, kv2=kv2, sv=sv):  # SM gather (index_select) into staging, then DMA
            with torch.cuda.stream(s1):
                torch.index_select(kv2, 0, idx_d, out=sv)
                host.copy_(staging, non_blocking=True)
            with torch.cuda.stream(s2):
                dense.copy_(host2, non_blocking=True)
            s1.synchronize()
            s2.synchronize()
            return 2 * total

        kinds[f"dma_only_{frag}"] = dma_only
        kinds[f"ce_gather_{frag}"] = ce_gather
        kinds[f"sm_gather_{frag}"] = sm_gather
    kinds["raw_dma"] = lambda: (raw_both(), s1.synchronize(), s2.synchronize(), 2 * total)[-1]
    alone = [step_ms(200)]
    inter = {}
    for name, fn in kinds.items():
        stop, moved = threading.Event(), [0]

        def bg(fn=fn, stop=stop, moved=moved):
            while not stop.is_set():
                moved[0] += fn()

        th = threading.Thread(target=bg, daemon=True)
        th.start()
        time.sleep(0.3)
        m0, t = moved[0], time.perf_counter()
        ms = step_ms(600)
        rate = (moved[0] - m0) / (time.perf_counter() - t) / 1e9
        stop.set()
        th.join(30)
        alone.append(step_ms(200))
        inter[name] = {"matmul_ms": round(ms, 3), "copy_gbps": round(rate, 1)}
    mid = sorted(alone)[len(alone) // 2]
    for v in inter.values():
        v["slowdown"] = round(v["matmul_ms"] / mid, 3)
        v["copy_ratio_to_raw_both"] = round(v["copy_gbps"] / base["both"], 3)
    out["matmul_alone_ms"] = [round(x, 3) for x in alone]
    out["interference"] = inter
    for k, v in inter.items():
        print(f"{k:18} {v}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
