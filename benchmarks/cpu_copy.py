"""The CPU data path's copies, old (mmap of the engine's file + numpy gather) vs new (coalesced
preadv/pwritev, tierd.transfer.cpu), same file, same blocks, same run; plus the kernel's own
ceiling (one big preadv/pwritev vs one memcpy) on the same tmpfs.

    python benchmarks/cpu_copy.py [--dir /dev/shm] [--layers 32] [--chunks 64] [--batch 8] [--json]

The layout is ``tierd bench``'s (block-contiguous layers, 16 blocks per chunk), at block (= run)
sizes 2, 16 and 64 KiB, with consecutive block ids (what a fresh engine hands out: a layer's
blocks of a request are one file range) and random ones (a fragmented block pool: one syscall
per block). The old gather is tests/unit/test_cpu_copy_bytes.py's reference (the replaced code).
``--dir`` on a tmpfs mounted with huge=always shows what 2 MiB pages change.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
import uuid

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests")]

from test_cpu_copy_bytes import ref_retrieve, ref_store  # noqa: E402

from tierd.protocol.layout import PageLayout  # noqa: E402
from tierd.transfer import mapcopy  # noqa: E402
from tierd.transfer.cpu import CpuRankMemory  # noqa: E402
from tierd.transfer.items import CopyItem  # noqa: E402


class OldGather:
    """The replaced path: the file mapped, blocks gathered by numpy over strided views."""

    def __init__(self, path: str, nbytes: int, lay: PageLayout):
        fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        os.close(fd)
        data = np.frombuffer(self._map, dtype=np.uint8)
        from numpy.lib.stride_tricks import as_strided

        self.layers = [
            as_strided(
                data[s.offset :],
                shape=(s.num_blocks, s.runs, s.run_bytes),
                strides=(s.block_stride, s.run_stride, 1),
                writeable=True,
            )
            for s in lay.groups[0].layers
        ]

    def store(self, group: int, items) -> None:
        ref_store(self.layers, items)

    def retrieve(self, group: int, items) -> None:
        ref_retrieve(self.layers, items)

    def close(self) -> None:
        self.layers = []
        try:
            self._map.close()
        except BufferError:
            pass


def best_gbps(fn, nbytes: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return round(nbytes / best / 1e9, 2)


def ceiling(folder: str, repeats: int) -> dict:
    n, step = 256 << 20, 1 << 20
    path = f"{folder}/tierd-bench-ceiling-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, n)
        m = mmap.mmap(fd, n)
        src = np.frombuffer(m, np.uint8)
        src[:] = 7
        dst = np.empty(n, np.uint8)
        dst[:] = 1
        view = memoryview(dst)

        def rd():
            for s in range(0, n, step):
                os.preadv(fd, [view[s : s + step]], s)

        def wr():
            for s in range(0, n, step):
                os.pwritev(fd, [view[s : s + step]], s)

        return {
            "memcpy": best_gbps(lambda: np.copyto(dst, src), n, repeats),
            "preadv_1MiB": best_gbps(rd, n, repeats),
            "pwritev_1MiB": best_gbps(wr, n, repeats),
        }
    finally:
        os.close(fd)
        os.unlink(path)


def run(
    folder: str, layers: int, chunks: int, batch: int, block_bytes: int, ids_kind: str, repeats: int
) -> dict:
    bpc = 16
    nb = 2 * chunks * bpc
    nbytes = layers * nb * block_bytes
    path = f"{folder}/tierd-bench-copy-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, nbytes)
    for off in range(0, nbytes, 1 << 24):
        os.pwrite(fd, b"\x02" * min(1 << 24, nbytes - off), off)
    os.close(fd)
    try:
        lay = PageLayout.from_wire(
            {
                "namespace": {"model": "m", "fingerprint": "f", "world_size": 1},
                "rank": 0,
                "chunk_tokens": bpc * 16,
                "tensors": [{"handle": {"kind": "shm", "path": path, "offset": 0}, "nbytes": nbytes}],
                "groups": [
                    {
                        "kind": "full",
                        "block_tokens": 16,
                        "layers": [
                            {
                                "tensor": 0,
                                "offset": li * nb * block_bytes,
                                "block_stride": block_bytes,
                                "num_blocks": nb,
                                "run_bytes": block_bytes,
                            }
                            for li in range(layers)
                        ],
                    }
                ],
            }
        )
        obj = layers * bpc * block_bytes
        pool = np.empty(chunks * obj, np.uint8)
        pool[:] = 3
        rng = np.random.default_rng(1)
        if ids_kind == "consecutive":
            blocks = [np.arange(c * bpc, (c + 1) * bpc) for c in range(chunks)]
        else:
            blocks = [rng.choice(nb, bpc, replace=False) for _ in range(chunks)]
        items = [
            CopyItem(b.astype(np.int64), np.arange(bpc), bpc, pool[c * obj : (c + 1) * obj])
            for c, b in enumerate(blocks)
        ]
        out = {"run_bytes": block_bytes, "ids": ids_kind}
        armed = mapcopy.armed
        sides = (("old", lambda: OldGather(path, nbytes, lay)), ("mapped", None), ("syscalls", None))
        for name, make in sides:
            mapcopy.armed = (lambda: False) if name == "syscalls" else armed
            mem = make() if make else CpuRankMemory(lay)
            try:
                for op in ("store", "retrieve"):

                    def go(op=op, mem=mem):
                        for i in range(0, chunks, batch):
                            getattr(mem, op)(0, items[i : i + batch])

                    out[f"{name}_{op}"] = best_gbps(go, chunks * obj, repeats)
            finally:
                mem.close()
                mapcopy.armed = armed
        for name in ("mapped", "syscalls"):
            for op in ("store", "retrieve"):
                out[f"{name}_{op}_ratio"] = round(out[f"{name}_{op}"] / out[f"old_{op}"], 2)
        return out
    finally:
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="chunks per store/retrieve call, as per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [{"ceiling": ceiling(a.dir, a.repeats)}]
    for bb in (2048, 16384, 65536):
        for kind in ("consecutive", "random"):
            rows.append(run(a.dir, a.layers, a.chunks, a.batch, bb, kind, a.repeats))
    for row in rows:
        if a.json:
            print(json.dumps(row))
        elif "ceiling" in row:
            c = row["ceiling"]
            print(
                f"kernel ceiling on {a.dir}: memcpy {c['memcpy']} GB/s, preadv {c['preadv_1MiB']}, "
                f"pwritev {c['pwritev_1MiB']} (1 MiB per call)"
            )
        else:
            print(
                f"{row['run_bytes'] >> 10:>3} KiB {row['ids']:<11}"
                + "".join(
                    f"  {op} old {row[f'old_{op}']:>5} mapped {row[f'mapped_{op}']:>5} "
                    f"({row[f'mapped_{op}_ratio']:.2f}x) syscalls {row[f'syscalls_{op}']:>5} "
                    f"({row[f'syscalls_{op}_ratio']:.2f}x)"
                    for op in ("store", "retrieve")
                )
                + " GB/s"
            )


if __name__ == "__main__":
    main()
