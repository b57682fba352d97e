"""What ``tierd bench --device cuda`` sets tierd's copies against, measured in the same run on the
same GPU and bytes: raw pinned cudaMemcpyAsync of ``total`` bytes one way, the other way, and both
at once on two streams, and one cudaMemcpyAsync per block (the native extension's C++ loop when it
is built, else torch's copy_ per block).

Hazard: it allocates two device buffers and two pinned host buffers of ``total`` bytes each, on
top of the bench's KV buffer; the bench calls it after its own requests are done. Each figure is
the best of three timed runs after a warm-up, the device synchronized around each, as tierd's
rounds are taken at their best.
"""

from __future__ import annotations

import time

from tierd_client import native


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _baselines(torch, buf, total: int, block_bytes: int, blocks: list[int], dev) -> dict:
    """Raw pinned copies of ``total`` bytes each way and both ways at once, and per-block copies."""
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
