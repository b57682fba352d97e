"""What DMA driven from another process (another CUDA context, as tierd's daemon) costs a
co-running bf16 matmul, by what that process does around its copies (issue 9). The child copies
its own pinned buffers to and from its own device buffer both ways, in rounds of --mb MiB, and
per round, depending on the mode:

  plain       cudaMemcpyAsync each way, then a stream synchronize
  events      + a CUDA event recorded after each copy, waited for with event.synchronize()
  ipc_wait    + the copies wait on the GPU for an interprocess event the engine process records
  ipc_signal  + an interprocess event recorded after the copies, which the engine's side stream waits on
  all         ipc_wait, events and ipc_signal together (what tierd's daemon does)

    python scripts/ctx_probe.py [--modes plain,events,ipc_wait,ipc_signal] [--mb 256] [--json f]
"""

from __future__ import annotations

import argparse
import json
import time


def child(mode: str, mb: int, conn, ready, stop) -> None:
    import torch

    dev = torch.device("cuda", 0)
    n = mb << 20
    h1 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    h2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d1 = torch.empty(n, dtype=torch.uint8, device=dev)
    d2 = torch.empty(n, dtype=torch.uint8, device=dev)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    peer = None
    if mode in ("ipc_wait", "all"):
        peer = torch.cuda.Event.from_ipc_handle(dev, conn.recv())
    sig = None
    if mode in ("ipc_signal", "all"):
        sig = torch.cuda.Event(interprocess=True)
        sig.record(s2)
        conn.send(bytes(sig.ipc_handle()))
    ready.set()
    moved, t0 = 0, time.perf_counter()
    while not stop.is_set():
        if peer is not None:
            s1.wait_event(peer)
            s2.wait_event(peer)
        with torch.cuda.stream(s1):
            h1.copy_(d1, non_blocking=True)
        with torch.cuda.stream(s2):
            d2.copy_(h2, non_blocking=True)
        if mode != "plain":
            e1, e2 = torch.cuda.Event(), torch.cuda.Event()
            e1.record(s1)
            e2.record(s2)
            if sig is not None:
                sig.record(s2)
            e1.synchronize()
            e2.synchronize()
        else:
            s1.synchronize()
            s2.synchronize()
        moved += 2 * n
    conn.send(moved / (time.perf_counter() - t0) / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="plain,events,ipc_wait,ipc_signal,all")
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import threading

    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    dev = torch.device("cuda", 0)
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

    def step_ms(reps: int) -> float:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            a @ b
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / reps

    step_ms(400)
    alone = [step_ms(300)]
    out: dict = {}
    for mode in args.modes.split(","):
        parent_conn, child_conn = ctx.Pipe()
        ready, stop = ctx.Event(), ctx.Event()
        side = torch.cuda.Stream(dev)
        mine = torch.cuda.Event(interprocess=True)
        mine.record(side)
        proc = ctx.Process(target=child, args=(mode, args.mb, child_conn, ready, stop))
        proc.start()
        if mode in ("ipc_wait", "all"):
            parent_conn.send(bytes(mine.ipc_handle()))
        done = threading.Event()
        peer = None
        if mode in ("ipc_signal", "all"):
            peer = torch.cuda.Event.from_ipc_handle(dev, parent_conn.recv())
        ready.wait(120)

        def engine_side(done=done, peer=peer, side=side, mine=mine):
            # as the engine's staging stream: records its event, waits for the daemon's
            while not done.is_set():
                if peer is not None:
                    side.wait_event(peer)
                mine.record(side)
                side.synchronize()
                time.sleep(0.002)

        th = threading.Thread(target=engine_side, daemon=True)
        th.start()
        time.sleep(0.5)
        ms = step_ms(1200)
        stop.set()
        rate = parent_conn.recv()
        proc.join(60)
        done.set()
        th.join(10)
        alone.append(step_ms(300))
        out[mode] = {"matmul_ms": round(ms, 3), "copy_gbps": round(rate, 1)}
    mid = sorted(alone)[len(alone) // 2]
    for mode, v in out.items():
        v["slowdown"] = round(v["matmul_ms"] / mid, 3)
        print(f"{mode:12} {v}", flush=True)
    out["alone_ms"] = [round(x, 3) for x in alone]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
