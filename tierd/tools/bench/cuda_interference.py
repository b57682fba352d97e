"""``tierd bench --device cuda --interference``: how much tierd's copies slow the engine's own GPU
work. A compute-bound step (a bf16 matmul) and an HBM-bound step (a device copy) are timed with
CUDA events alone, while tierd stores and retrieves at full rate, and while raw pinned DMA runs
both ways; each as a slowdown ratio, next to the copy rate reached meanwhile.

Hazard: the steps are launched from the same process as the tierd client and the raw DMA loop, so
a full launch queue (the launching thread blocks inside a launch, holding the GIL) can starve
their threads; ``burst`` (``--step-burst``) queues at most that many steps at once. It allocates
two 8192 x 8192 bf16 matrices and two 2 GiB device buffers, plus the raw loop's ``total`` bytes
twice on the device and twice pinned.
"""

from __future__ import annotations

import threading
import time
import uuid


def _interference(torch, dev, store, retrieve, keys, src, dst, settle, total: int, burst: int = 0) -> dict:
    """Engine steps timed with CUDA events: alone, with tierd copying both ways, with raw DMA."""
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
                got.done.synchronize()
                prev = new
                moved[0] += total * (stored.results.count("stored") + sum(got.ok)) // len(keys)
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
