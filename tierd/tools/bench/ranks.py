"""``tierd bench --ranks N``: N engine processes (TP ranks) on one daemon at once, each with its
own KV buffer (CUDA: on GPU ``rank % device_count``, its own staging buffer and streams), timed
in the same wall-clock windows, next to the same processes running raw copies at the same time.

Why windows: ranks of one engine copy concurrently, so what counts is bytes moved per second by
all of them together while all of them run. The parent starts the daemon and the workers
(``python -m tierd.tools.bench.rank_worker``), waits until each has registered and stored its resident
chunks, then gives one start time; every worker runs the same phases in the same windows:

- ``solo_store`` / ``solo_retrieve`` / ``solo_both``: rank 0 alone (one engine's figure, this run);
- ``store`` / ``retrieve`` / ``both``: every rank;
- ``raw_d2h`` / ``raw_h2d`` / ``raw_both`` (CUDA: pinned cudaMemcpyAsync of the same request size;
  CPU: ``raw`` memcpy): every rank, the baseline of the same link(s) shared the same way.

A worker counts the bytes of requests that completed inside the window (a retrieve completes when
its scatter has, on the device); ``gbps`` is bytes over the window. Stores write fresh keys and
touch the resident ones (every rank's part: the ranks name the same chunks, as an engine's TP
ranks do), so the daemon's LRU evicts earlier store-phase objects, never what the retrieves read.
Afterwards each rank restores its resident chunks into other blocks and compares
them byte for byte. MLA (``--mla``): the layout is replicated, so only rank 0's STORE copies
(``stored_objects`` of the other ranks is 0: one copy in the pool) and every rank restores from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

from tierd.tools.bench.common import BenchError, Progress, private_daemon
from tierd.tools.bench.options import BenchOptions
from tierd_client import TierdClient, native
from tierd_client.layouts import namespace

PHASES_SOLO = ("solo_store", "solo_retrieve", "solo_both")
PHASES_ALL = ("store", "retrieve", "both")
RAW = {"cuda": ("raw_d2h", "raw_h2d", "raw_both"), "cpu": ("raw",)}
# each phase's baseline: the raw copy of the same direction (CPU: memcpy)
RAW_OF = {
    "cuda": {"store": "raw_d2h", "retrieve": "raw_h2d", "both": "raw_both"},
    "cpu": dict.fromkeys(PHASES_ALL, "raw"),
}
GAP_S = 0.3  # between windows: the last requests of one phase drain before the next starts
DEPTH = 4  # requests in flight per rank and direction


# ---- the parent ------------------------------------------------------------------------------------
def run_ranks_bench(opts: BenchOptions, progress: Progress) -> dict:
    socket, device, ranks, seconds = opts.socket, opts.device, opts.ranks, opts.seconds
    mla, chunks, batch = opts.mla, opts.chunks, opts.batch
    if ranks < 1:
        raise BenchError(f"--ranks {ranks}: at least 1")
    object_bytes, block_bytes = opts.object_bytes, opts.block_bytes
    resident = (1 if mla else ranks) * chunks * object_bytes
    churn = ranks * 2 * DEPTH * batch * object_bytes  # store-phase objects in flight and just committed
    pool_bytes = int(opts.pool_gb * 2**30) if opts.pool_gb else resident + churn + (512 << 20)
    if device == "cuda":
        progress.phase("building the native kernels (cached after the first time)")
        native.load(timeout=900)  # once here: the workers find it built
    run = os.urandom(8).hex()
    cfg = dict(
        device=device,
        ranks=ranks,
        seconds=opts.seconds,
        layers=opts.layers,
        heads=opts.heads,
        row=opts.row_bytes,
        block_tokens=opts.block_tokens,
        chunk_tokens=opts.chunk_tokens,
        dtype_bytes=opts.dtype_bytes,
        mla=mla,
        chunks=chunks,
        batch=batch,
        run=run,
        gpu_order=opts.gpu_order,
    )
    extra = ("--l1-init-size-gb", f"{pool_bytes / 2**30:.6f}") if device == "cuda" else ()
    progress.phase("starting a private daemon" if socket is None else f"connecting to {socket}")
    ctx = private_daemon(pool_bytes, extra) if socket is None else contextlib.nullcontext(socket)
    with ctx as endpoint:
        progress.phase(f"starting {ranks} rank processes")
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tierd.tools.bench.rank_worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(ranks)
        ]
        try:
            for i, p in enumerate(procs):
                p.stdin.write(json.dumps({**cfg, "rank": i, "endpoint": endpoint}) + "\n")
                p.stdin.flush()
            for i, p in enumerate(procs):  # each registered and stored its resident chunks
                line = p.stdout.readline()
                if line.strip() != "ready":
                    p.wait(30)
                    raise BenchError(f"rank {i} did not start (exit {p.poll()}): {line.strip()[:500]}")
            phases = _phases(device)
            start = time.time() + 0.5
            for p in procs:
                p.stdin.write(json.dumps({"start": start}) + "\n")
                p.stdin.flush()
            progress.phase(f"{len(phases)} windows of {seconds:g} s, all ranks at once")
            outs = []
            for i, p in enumerate(procs):
                out, _ = p.communicate(timeout=len(phases) * (seconds + GAP_S) + 300)
                if p.returncode != 0 or not out.strip():
                    raise BenchError(f"rank {i} failed (exit {p.returncode}); see its stderr above")
                outs.append(json.loads(out.strip().splitlines()[-1]))
            _clear(endpoint, namespace_of(cfg))  # leave nothing behind in the operator's daemon
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return _aggregate(cfg, outs, object_bytes, block_bytes)


def namespace_of(cfg: dict) -> dict:
    return namespace("tierd-bench-ranks", cfg["run"], world_size=cfg["ranks"])


def _clear(endpoint: str, ns: dict) -> None:
    with TierdClient(endpoint, timeout_s=30, name="tierd-bench-ranks") as client:
        client.call("CLEAR", {"namespace": ns})


def _phases(device: str) -> tuple[str, ...]:
    return PHASES_SOLO + PHASES_ALL + RAW[device]


def _aggregate(cfg: dict, outs: list[dict], object_bytes: int, block_bytes: int) -> dict:
    outs.sort(key=lambda o: o["rank"])
    agg = {ph: round(sum(o["gbps"][ph] for o in outs), 3) for ph in _phases(cfg["device"])}
    raw = RAW_OF[cfg["device"]]
    out = {
        "device": cfg["device"],
        "bench": "ranks",
        "ranks": cfg["ranks"],
        "layout": "mla" if cfg["mla"] else "mha",
        "gpu_order": cfg.get("gpu_order") if cfg["device"] == "cuda" else None,
        "layers": cfg["layers"],
        "block_bytes": block_bytes,
        "object_bytes": object_bytes,
        "chunks": cfg["chunks"],
        "batch": cfg["batch"],
        "window_s": cfg["seconds"],
        "gpus": sorted({o.get("gpu") for o in outs if o.get("gpu") is not None}),
        "aggregate_gbps": agg,
        "ratio_to_raw": {k: round(agg[k] / agg[v], 3) if agg[v] else None for k, v in raw.items()},
        "ratio_to_one_rank": {
            k: round(agg[k] / agg["solo_" + k], 3) if agg["solo_" + k] else None for k in PHASES_ALL
        },
        "per_rank": [
            {
                "rank": o["rank"],
                "gpu": o.get("gpu"),
                "gbps": o["gbps"],
                "stored_objects": o["stored_objects"],
                "verified": o["verified"],
            }
            for o in outs
        ],
        "verified": all(o["verified"] for o in outs),
    }
    if cfg["mla"]:
        out["one_copy"] = all(o["stored_objects"] == 0 for o in outs if o["rank"] != 0)
        out["verified"] = out["verified"] and out["one_copy"]
    return out
