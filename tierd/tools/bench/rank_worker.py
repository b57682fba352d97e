"""One rank of ``tierd bench --ranks N`` (``python -m tierd.tools.bench.rank_worker``, started by
tierd.tools.bench.ranks): its own KV buffer registered with the daemon, then the same phases in the
same wall-clock windows as every other rank.

Hazard: stdout is the parent's channel. The first line must be ``ready`` (the rank registered
and stored its resident chunks) and the last one the JSON result; anything printed there before
``ready`` is taken as a failed start. Windows: a rank waits for the parent's start time and counts
only the requests that complete inside each window, so the ranks' figures add up to what all of
them moved together.

The rank stores its resident chunks, runs each phase (tierd.tools.bench.ranks: solo, all ranks, raw
copies) with ``DEPTH`` requests in flight per direction, then restores the resident chunks into
other blocks and compares them byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import deque

import numpy as np

from tierd.protocol.layout import PageLayout
from tierd.tools.bench.common import fill_pattern
from tierd.tools.bench.ranks import DEPTH, GAP_S, _phases, namespace_of
from tierd_client import TierdClient
from tierd_client.cuda_ipc import share_cuda_tensors
from tierd_client.cuda_stage import Stager
from tierd_client.layouts import block_span, group, layout
from tierd_client.shm import SharedBuffer
from tierd_client.staged_rank import StagedRank


def _key(run: str, *parts) -> bytes:
    return hashlib.blake2b("/".join(map(str, (run, *parts))).encode(), digest_size=16).digest()


# ---- a worker (one rank) --------------------------------------------------------------------------
class _Rank:
    """One rank's KV buffer, registered, with store/retrieve returning futures and a raw copy."""

    def __init__(self, cfg: dict, client):
        self.cfg, self.client = cfg, client
        self.rank, self.device = cfg["rank"], cfg["device"]
        self.bpc = cfg["chunk_tokens"] // cfg["block_tokens"]
        self.region = cfg["chunks"] * self.bpc
        self.num_blocks = 2 * self.region  # resident chunks' blocks, then the blocks restored into
        self.block_bytes = cfg["block_tokens"] * cfg["heads"] * cfg["row"]
        self.object_bytes = cfg["layers"] * self.bpc * self.block_bytes
        self.request_bytes = cfg["batch"] * self.object_bytes
        seed = 0 if cfg["mla"] else self.rank + 1  # replicated ranks hold the same bytes
        ns = namespace_of(cfg)
        self.ns, self.gpu = ns, None
        if self.device == "cuda":
            self._cuda_init(seed, ns)
        else:
            self._cpu_init(seed, ns)

    def _spans(self, shape_strides):
        return [
            block_span(shape, strides, 1, 0, tensor=0, offset=li * self.num_blocks * self.block_bytes)
            for li, (shape, strides) in enumerate(shape_strides)
        ]

    def _cpu_init(self, seed, ns):
        c = self.cfg
        self.buf = SharedBuffer(c["layers"] * self.num_blocks * self.block_bytes, prefix="tierd-bench-ranks")
        self.kv = self.buf.array.reshape(c["layers"], self.num_blocks, self.block_bytes)
        fill_pattern(self.kv[:, : self.region], seed=0x9E3779B1 + seed)
        shape = [((self.num_blocks, self.block_bytes), (self.block_bytes, 1))] * c["layers"]
        lay = layout(
            ns,
            self.rank,
            c["chunk_tokens"],
            [self.buf.ref()],
            [group("full", c["block_tokens"], self._spans(shape))],
            replicated=c["mla"],
        )
        self.client.register(f"bench-rank-{self.rank}", lay)
        self._raw = (np.empty(self.request_bytes, np.uint8), np.empty(self.request_bytes, np.uint8))
        np.copyto(self._raw[1], self._raw[0])

    def _cuda_init(self, seed, ns):
        import torch

        c = self.cfg
        self.gpu = self.rank % torch.cuda.device_count()
        torch.cuda.set_device(self.gpu)
        dev = self.dev = torch.device("cuda", self.gpu)
        self.torch = torch
        buf = torch.empty(c["layers"] * self.num_blocks * self.block_bytes, dtype=torch.uint8, device=dev)
        self.kv = buf.view(c["layers"], self.num_blocks, self.block_bytes)
        self.kv[:, : self.region].random_(0, 256, generator=torch.Generator(device=dev).manual_seed(seed))
        views = buf.view(c["layers"], self.num_blocks, c["block_tokens"], c["heads"], c["row"]).permute(
            0, 1, 3, 2, 4
        )
        shape = [(tuple(views[li].shape), tuple(views[li].stride())) for li in range(c["layers"])]
        refs, _ = share_cuda_tensors([buf])
        lay = layout(
            ns,
            self.rank,
            c["chunk_tokens"],
            refs,
            [group("full", c["block_tokens"], self._spans(shape))],
            device="cuda",
            replicated=c["mla"],
        )
        stager = Stager(PageLayout.from_wire(lay), [buf], max(256 << 20, 2 * DEPTH * self.request_bytes))
        lay["staging"] = stager.ref
        self.client.register(f"bench-rank-{self.rank}", lay, timeout=300)
        self.staged = StagedRank(
            self.client,
            f"bench-rank-{self.rank}",
            stager,
            request_bytes=self.request_bytes,
            timeout_s=300,
            host_order=c.get("gpu_order", "host") == "host",
        )
        n = self.request_bytes
        self._host = (
            torch.empty(n, dtype=torch.uint8, pin_memory=True),
            torch.empty(n, dtype=torch.uint8, pin_memory=True),
        )
        self._dev = (
            torch.empty(n, dtype=torch.uint8, device=dev),
            torch.empty(n, dtype=torch.uint8, device=dev),
        )
        self._streams = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))

    # ---- requests: each returns something ``finish`` waits on, and the bytes it moves ---------------
    def chunks(self, keys: list[bytes], base: int, first: int) -> list[dict]:
        return [
            {
                "key": k,
                "blocks": [
                    list(
                        range(
                            base + (first + i) % self.cfg["chunks"] * self.bpc,
                            base + ((first + i) % self.cfg["chunks"] + 1) * self.bpc,
                        )
                    )
                ],
            }
            for i, k in enumerate(keys)
        ]

    def store(self, keys, first: int, touch=None):
        chunks = self.chunks(keys, 0, first)
        if self.device == "cuda":
            return self.staged.store(chunks, touch=touch)
        return self.client.store_async(f"bench-rank-{self.rank}", chunks, touch=touch)

    def retrieve(self, keys, first: int):
        chunks = self.chunks(keys, self.region, first)
        if self.device == "cuda":
            return self.staged.retrieve(chunks)
        return self.client.retrieve_async(f"bench-rank-{self.rank}", chunks)

    def finish(self, fut) -> tuple[int, int]:
        """Wait for a request; (bytes it moved, objects it stored)."""
        res = fut.result()  # a StoreReply; a RetrieveReply, or on CUDA a tierd_client.rank_jobs.Loaded
        results = getattr(res, "results", None)
        if results is not None:
            bad = [r for r in results if r not in ("stored", "exists")]
            if bad:
                raise RuntimeError(f"rank {self.rank}: store answered {bad[:4]}: is the pool large enough?")
            n = results.count("stored")
            return n * self.object_bytes, n
        if not all(res.ok):
            raise RuntimeError(f"rank {self.rank}: retrieve failed for blocks {res.failed[:8]}")
        if getattr(res, "done", None) is not None:
            res.done.synchronize()  # the blocks are in the KV
        return len(res.ok) * self.object_bytes, 0

    def raw(self, which: str):
        """One raw copy of a request's bytes (``which``: d2h, h2d, both; CPU: memcpy)."""
        if self.device != "cuda":
            np.copyto(self._raw[1], self._raw[0])
            return self.request_bytes  # counted as a store's bytes are: once
        torch = self.torch
        if which in ("d2h", "both"):
            with torch.cuda.stream(self._streams[0]):
                self._host[0].copy_(self._dev[0], non_blocking=True)
        if which in ("h2d", "both"):
            with torch.cuda.stream(self._streams[1]):
                self._dev[1].copy_(self._host[1], non_blocking=True)
        return self._streams

    def raw_done(self, streams) -> None:
        for s in streams:
            s.synchronize()

    def verify(self, keys: list[bytes]) -> bool:
        futs = [
            self.retrieve(keys[i : i + self.cfg["batch"]], i) for i in range(0, len(keys), self.cfg["batch"])
        ]
        for f in futs:
            self.finish(f)
        a, b = self.kv[:, : self.region], self.kv[:, self.region :]
        if self.device == "cuda":
            return bool(self.torch.equal(a, b))
        return bool(np.array_equal(a, b))

    def close(self) -> None:
        if self.device == "cuda":
            self.staged.close()
        else:
            self.buf.close()


def _window(
    rank: _Rank, phase: str, start: float, end: float, resident: list[bytes], counter: list[int]
) -> tuple:
    """Run ``phase`` from ``start`` to ``end`` (wall clock); (bytes completed inside, objects stored)."""
    c = rank.cfg
    active = not phase.startswith("solo_") or rank.rank == 0
    while time.time() < start:
        time.sleep(min(0.01, max(0.0, start - time.time())))
    if not active:
        time.sleep(max(0.0, end - time.time()))
        return 0, 0
    moved = stored = 0
    kind = phase.removeprefix("solo_")
    if kind.startswith("raw"):
        which = kind.removeprefix("raw_") if "_" in kind else "memcpy"
        inflight: deque = deque()
        while time.time() < end:
            if rank.device == "cuda":
                inflight.append(rank.raw(which))
                if len(inflight) >= DEPTH:
                    rank.raw_done(inflight.popleft())
                    if time.time() <= end:
                        moved += rank.request_bytes * (2 if which == "both" else 1)
            else:
                moved += rank.raw(which)
        while inflight:
            rank.raw_done(inflight.popleft())
        return moved, 0
    batch, n = c["batch"], c["chunks"]
    inflight = deque()
    i = 0
    while time.time() < end:
        if kind in ("store", "both"):
            keys = [_key(c["run"], "churn", counter[0] + j) for j in range(batch)]
            counter[0] += batch
            inflight.append(rank.store(keys, i, touch=resident))
        if kind in ("retrieve", "both"):
            first = i % n
            keys = [resident[(first + j) % n] for j in range(batch)]
            inflight.append(rank.retrieve(keys, first))
        i += batch
        while len(inflight) >= DEPTH * (2 if kind == "both" else 1):
            got, objs = rank.finish(inflight.popleft())
            stored += objs
            if time.time() <= end:
                moved += got
    while inflight:
        stored += rank.finish(inflight.popleft())[1]
    return moved, stored


def worker_main() -> None:
    cfg = json.loads(sys.stdin.readline())
    with TierdClient(
        cfg["endpoint"], timeout_s=300, connect_timeout_s=60, name=f"tierd-bench-rank-{cfg['rank']}"
    ) as client:
        client.wait_ready(60)
        rank = _Rank(cfg, client)
        try:
            # the ranks of one engine name the same chunks (each stores its part; replicated: rank
            # 0's serves all)
            resident = [_key(cfg["run"], "resident", j) for j in range(cfg["chunks"])]
            stored = 0
            futs = [
                rank.store(resident[j : j + cfg["batch"]], j) for j in range(0, cfg["chunks"], cfg["batch"])
            ]
            for f in futs:
                stored += rank.finish(f)[1]
            print("ready", flush=True)
            start = json.loads(sys.stdin.readline())["start"]
            gbps, counter = {}, [0]
            for k, phase in enumerate(_phases(cfg["device"])):
                ws = start + k * (cfg["seconds"] + GAP_S)
                moved, objs = _window(rank, phase, ws, ws + cfg["seconds"], resident, counter)
                stored += objs
                gbps[phase] = round(moved / cfg["seconds"] / 1e9, 3)
            verified = rank.verify(resident)
        finally:
            rank.close()
        client.unregister(f"bench-rank-{cfg['rank']}")
    print(
        json.dumps(
            {
                "rank": cfg["rank"],
                "gpu": rank.gpu,
                "gbps": gbps,
                "stored_objects": stored,
                "verified": verified,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    worker_main()
