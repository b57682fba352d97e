"""Where one chunk's STORE/RETRIEVE time goes on a GPU (run on the device): each step timed alone.

python3 scripts/latency_probe.py [--layers 32 --kv-heads 8]
"""

import argparse
import statistics
import time
import uuid

import torch

from tierd.bench.common import private_daemon
from tierd.protocol.layout import PageLayout
from tierd_client import TierdClient, native
from tierd_client.cuda_ipc import share_cuda_tensors
from tierd_client.cuda_stage import Stager
from tierd_client.layouts import block_span, group, layout, namespace
from tierd_client.staged_rank import StagedRank

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=32)
ap.add_argument("--kv-heads", type=int, default=8)
a = ap.parse_args()
native.load()
dev = torch.device("cuda", 0)
L, B, N, H, R = a.layers, 64, 16, a.kv_heads, 2 * 128 * 2
buf = torch.randint(0, 255, (L * B * N * H * R,), dtype=torch.uint8, device=dev)
views = buf.view(L, B, N, H, R).permute(0, 1, 3, 2, 4)
spans = [
    block_span(tuple(views[l].shape), tuple(views[l].stride()), 1, 0, tensor=0, offset=l * B * N * H * R)
    for l in range(L)
]
refs, _ = share_cuda_tensors([buf])
lay = layout(namespace("probe", uuid.uuid4().hex), 0, 256, refs, [group("full", 16, spans)], device="cuda")
st = Stager(PageLayout.from_wire(lay), [buf], 512 << 20, "kernel")
lay["staging"] = st.ref
ids = [list(range(16))]
med = lambda xs: f"{statistics.median(xs) * 1e3:.3f} ms"  # noqa: E731


def timeit(name, fn, n=30):
    fn()
    xs = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    print(f"{name:55s} {med(xs)}", flush=True)


timeit("gather 1 chunk (enqueue only)", lambda: st.gather([ids], 0))
timeit("gather 1 chunk + stream sync", lambda: (st.gather([ids], 0), st.stream.synchronize()))
timeit("scatter 1 chunk + event sync", lambda: st.scatter([ids], 0).synchronize())
h = torch.empty(st.chunk_bytes, dtype=torch.uint8, pin_memory=True)
timeit(
    "raw D2H of one chunk",
    lambda: (h.copy_(st.buf[: st.chunk_bytes], non_blocking=True), torch.cuda.synchronize()),
)
with (
    private_daemon(4 << 30, ("--l1-init-size-gb", "4")) as ep,
    TierdClient(ep, timeout_s=60, connect_timeout_s=120) as c,
):
    c.wait_ready(60)
    c.register("p", lay, timeout=120)
    timeit("PING round trip", lambda: c.ping())
    timeit("STATUS round trip", lambda: c.status())
    keys = []

    def store_raw():
        k = uuid.uuid4().bytes[:16]
        keys.append(k)
        ev = st.gather([ids], 0)
        r = c.call(
            "STORE", {"instance": "p", "chunks": [{"key": k, "blocks": ids}], "staged_at": 0, "event": ev}
        )
        assert r["results"] == ["stored"], r

    timeit("STORE raw client: gather + request + DMA + reply", store_raw)

    def store_noevent():
        k = uuid.uuid4().bytes[:16]
        keys.append(k)
        st.gather([ids], 0)
        st.stream.synchronize()
        r = c.call("STORE", {"instance": "p", "chunks": [{"key": k, "blocks": ids}], "staged_at": 0})
        assert r["results"] == ["stored"], r

    timeit("STORE raw, host sync instead of the IPC event", store_noevent)

    def store_nocopy():
        r = c.call("STORE", {"instance": "p", "chunks": [{"key": keys[-1], "blocks": ids}], "staged_at": 0})
        assert r["results"] == ["exists"], r

    timeit("STORE of an existing chunk (no copy: the request path)", store_nocopy)

    def retrieve_raw():
        k = keys[-1]
        r = c.call(
            "RETRIEVE",
            {"instance": "p", "chunks": [{"key": k, "blocks": ids}], "staged_at": 0, "event": st.mark()},
        )
        assert all(r["ok"]), r
        st.scatter([ids], 0).synchronize()

    timeit("RETRIEVE raw client: request + DMA + reply + scatter", retrieve_raw)

    def retrieve_noevent():
        r = c.call(
            "RETRIEVE", {"instance": "p", "chunks": [{"key": keys[-1], "blocks": ids}], "staged_at": 0}
        )
        assert all(r["ok"]), r

    timeit("RETRIEVE raw, no event, no scatter", retrieve_noevent)

    def retrieve_nodma():
        r = c.call(
            "RETRIEVE",
            {"instance": "p", "chunks": [{"key": uuid.uuid4().bytes[:16], "blocks": ids}], "staged_at": 0},
        )
        assert not any(r["ok"])

    timeit("RETRIEVE of a missing chunk (no copy: the request path)", retrieve_nodma)
    rank = StagedRank(c, "p", st, timeout_s=60)

    def store_rank():
        k = uuid.uuid4().bytes[:16]
        keys.append(k)
        assert rank.store([{"key": k, "blocks": ids}]).result()["results"] == ["stored"]

    timeit("StagedRank.store", store_rank)

    def retrieve_rank():
        r = rank.retrieve([{"key": keys[-1], "blocks": ids}]).result()
        r["done"].synchronize()

    timeit("StagedRank.retrieve + done", retrieve_rank)
    rank.close()
    print(c.status()["cuda_detail"]["lanes"])
