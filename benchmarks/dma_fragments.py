"""Scattered block-sized DMAs between GPU memory and pinned host memory, as the daemon's copy lanes
queue them (tierd.transfer.dma): one cuMemcpyAsync per fragment, against cuMemcpyBatchAsync of
``--per-call`` fragments per call, each as a share of one contiguous copy of the same bytes in the
same run. Host memory is cudaHostRegister'ed, as the pool's is. Needs a CUDA GPU.

    python benchmarks/dma_fragments.py [--sizes 64,640,2048] [--total-mib 512] [--per-call 16,128]

A block-outermost group's block (all its layers, one span) is one such fragment: 640 KiB for 80
layers of 8 KiB, 2 MiB for 32 layers of 64 KiB.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tierd.transfer.dma import _DRIVER  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,640,2048", help="fragment sizes, KiB")
    ap.add_argument("--total-mib", type=int, default=512, help="bytes moved per run, MiB")
    ap.add_argument("--per-call", default="16,128", help="fragments per batched call")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available() or not _DRIVER.ok:
        sys.exit("needs a CUDA GPU and libcuda")
    total = args.total_mib << 20
    dev = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    mem = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    host = ctypes.addressof((ctypes.c_uint8 * total).from_buffer(mem))
    ctypes.memset(host, 1, total)
    rt = torch.cuda.cudart()
    if rt.cudaHostRegister(host, total, 1) != rt.cudaError.success:  # portable, as the pool's
        sys.exit("cudaHostRegister failed")
    stream = torch.cuda.Stream()
    api = "cuMemcpyBatchAsync" if _DRIVER.batch is not None else "none: batches go one by one"
    print(f"{torch.cuda.get_device_name()}, {args.total_mib} MiB per run, median of {args.repeats}")
    print(f"batch API: {api}")
    for frag in (int(x) << 10 for x in args.sizes.split(",")):
        n = total // frag
        slots = random.Random(frag).sample(range(2 * n), n)
        devs = np.array([dev.data_ptr() + s * frag for s in slots], dtype=np.int64)
        hosts = np.arange(n, dtype=np.int64) * frag + host
        for d2h in (True, False):
            row = measure(torch, stream, dev, host, total, frag, devs, hosts, d2h, args)
            print("  " + " | ".join(row), flush=True)


def measure(torch, stream, dev, host, total, frag, devs, hosts, d2h, args) -> list[str]:
    """One fragment size and direction: contiguous, one by one, and each batch size."""
    s, n = stream.cuda_stream, len(devs)
    sizes = np.full(n, frag, dtype=np.int64)

    def rate(fn) -> tuple[float, float]:
        """(GB/s, host ms per run) of ``fn`` queuing ``total`` bytes, the median run."""
        runs = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            stream.synchronize()
            runs.append((time.perf_counter() - t0, t1 - t0))
        wall, queued = sorted(runs)[len(runs) // 2]
        return total / wall / 1e9, queued * 1e3

    def one_by_one():
        for h, d in zip(hosts.tolist(), devs.tolist()):
            _DRIVER.copy(h, d, frag, d2h, s)

    def batched(per: int):
        for i in range(0, n, per):
            sl = slice(i, i + per)
            _DRIVER.copies(hosts[sl], devs[sl], sizes[sl], d2h, s, torch.cuda.current_device())

    whole, _ = rate(lambda: _DRIVER.copy(host, dev.data_ptr(), total, d2h, s))
    row = [f"{frag >> 10:6d} KiB {'D2H' if d2h else 'H2D'}: contiguous {whole:5.1f} GB/s"]
    one, ms = rate(one_by_one)
    row.append(f"one by one {one / whole:.3f} (host {ms / n * 1e3:.1f} us/fragment)")
    for per in (int(x) for x in args.per_call.split(",")):
        got, ms = rate(lambda per=per: batched(per))
        row.append(f"batches of {per} {got / whole:.3f} (host {ms / -(-n // per):.3f} ms/call)")
    return row


if __name__ == "__main__":
    main()
