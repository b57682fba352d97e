"""Where a GPU store/retrieve spends its time, without the daemon: raw pinned copies and the
daemon's copy lane (gather kernel + DMA, DMA + scatter) over host memory of several kinds
(cudaHostAlloc, memfd 4 KiB pages, anonymous memory on transparent huge pages), Llama-3-8B
geometry. Prints one JSON object.  python3 scripts/cuda_lane_probe.py [GiB]"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time

import numpy as np
import torch

from tierd.protocol.layout import GroupLayout
from tierd.transfer import cuda as tc
from tierd.transfer.items import CopyItem
from tierd_client import native
from tierd_client.layouts import block_span, group

DEV = 0
LAYERS, BLOCK_TOKENS, HEADS, ROW, BPC = 32, 16, 8, 512, 16  # 64 KiB blocks, 32 MiB chunks


def host(kind: str, nbytes: int):
    """(uint8 numpy array, keepalive, registered address or None)."""
    if kind == "cudaHostAlloc":
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return t.numpy(), t, None
    if kind.startswith("memfd"):
        fd = os.memfd_create("probe", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        huge = kind.endswith("thp")
        m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | (0 if huge else mmap.MAP_POPULATE))
        os.close(fd)
    else:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        huge = kind.endswith("thp")
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    arr = np.frombuffer(m, dtype=np.uint8)
    arr[::4096] = 0
    addr = arr.ctypes.data
    torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, 1)))
    return arr, m, addr


def best(fn, n=3):
    out = float("inf")
    for _ in range(n + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out = min(out, time.perf_counter() - t)
    return out


def main():
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    torch.cuda.set_device(DEV)
    mod = native.load()
    block = BLOCK_TOKENS * HEADS * ROW
    obj = LAYERS * BPC * block
    chunks = int(gib * 2**30) // obj
    nbytes = chunks * obj
    nblocks = chunks * BPC
    buf = torch.randint(0, 256, (LAYERS * nblocks * block,), dtype=torch.uint8, device=DEV)
    spans = [
        block_span((nblocks, block), (block, 1), 1, 0, tensor=0, offset=l * nblocks * block)
        for l in range(LAYERS)
    ]
    grp = GroupLayout.from_wire(group("full", BLOCK_TOKENS, spans), "g")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    out = {
        "gib": round(nbytes / 2**30, 3),
        "chunks": chunks,
        "object_mib": obj >> 20,
        "thp": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
        "shmem_thp": open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read().strip(),
    }
    for kind in ("cudaHostAlloc", "memfd", "memfd-thp", "anon-4k", "anon-thp"):
        t = time.perf_counter()
        arr, keep, addr = host(kind, nbytes)
        setup = time.perf_counter() - t
        ht = torch.from_numpy(arr)
        r = {"setup_s": round(setup, 3)}
        r["raw_d2h"] = round(nbytes / best(lambda: ht.copy_(dev, non_blocking=True)) / 1e9, 2)
        r["raw_h2d"] = round(nbytes / best(lambda: dev.copy_(ht, non_blocking=True)) / 1e9, 2)
        lane = tc.Lane(torch, DEV, tc.HostPinner())
        g = tc.GroupCopy(grp, [buf], torch, DEV)
        per = [16, 1]  # chunks per call: a 16-chunk request, and one chunk
        for n in per:
            items = [
                CopyItem(
                    np.arange(c * BPC, (c + 1) * BPC, dtype=np.int64),
                    np.arange(BPC, dtype=np.int64),
                    BPC,
                    arr[c * obj : (c + 1) * obj],
                )
                for c in range(chunks)
            ]
            calls = [items[i : i + n] for i in range(0, chunks, n)]
            r[f"lane_store_{n}"] = round(
                nbytes / best(lambda: [t.wait() for t in [lane.store(g, c, mod) for c in calls]]) / 1e9, 2
            )
            r[f"lane_retrieve_{n}"] = round(
                nbytes / best(lambda: [t.wait() for t in [lane.retrieve(g, c, mod) for c in calls]]) / 1e9, 2
            )
        if kind in ("cudaHostAlloc", "anon-thp"):  # a bigger staging ring: does slot size matter?
            big = tc.Lane(torch, DEV, tc.HostPinner())
            big.slot_bytes = 256 << 20
            items = [
                CopyItem(
                    np.arange(c * BPC, (c + 1) * BPC, dtype=np.int64),
                    np.arange(BPC, dtype=np.int64),
                    BPC,
                    arr[c * obj : (c + 1) * obj],
                )
                for c in range(chunks)
            ]
            calls = [items[i : i + 16] for i in range(0, chunks, 16)]
            r["lane_store_16_slot256"] = round(
                nbytes / best(lambda: [t.wait() for t in [big.store(g, c, mod) for c in calls]]) / 1e9, 2
            )
            r["lane_retrieve_16_slot256"] = round(
                nbytes / best(lambda: [t.wait() for t in [big.retrieve(g, c, mod) for c in calls]]) / 1e9, 2
            )
            big.close()
        st = lane.stats
        r["lane_host_us_per_call"] = round(st["host_s"] / st["calls"] * 1e6, 1)
        r["dmas_per_call"] = round(st["dmas"] / st["calls"], 2)
        with open("/proc/meminfo") as f:
            r["meminfo"] = {
                ln.split(":")[0]: ln.split(":")[1].strip()
                for ln in f
                if "HugePages" in ln and "Anon" in ln or "ShmemHuge" in ln
            }
        lane.close()
        ht = arr = items = None
        if addr is not None:
            torch.cuda.cudart().cudaHostUnregister(addr)
        del keep
        out[kind] = r
        print(kind, r, file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
