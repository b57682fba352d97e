"""Latencies of ``tierd bench --device cuda``, one job at a time: 1, 4 and 16 chunks stored and
restored, from the call to the moment the engine may read the blocks, next to the raw pinned copy
of the same bytes; where a one-chunk request's time goes (``breakdown``); and ``wire_floor_ms``,
round trips that copy nothing.

Hazard: the breakdown reads the stamps the rank's trace records (tierd_client.staged_rank,
tierd_client.direct_rank) by name (``STORE_STAGES``, ``RETRIEVE_STAGES``, ``DIRECT_STAGES``): a
stamp renamed there drops its stage from the breakdown without an error. The first two iterations
of each size (three of the wire floor's) are warm-ups, left out of every median. The daemon's lane
times per call are the difference of its status (``cuda_detail``) before and after, so another
client's copies in the meantime count in them.
"""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np

from tierd.tools.bench.common import stage_means

PROBE_CHUNKS = 16  # the most chunks a latency probe moves; ``probe`` holds that many chunks' blocks


def _latencies(torch, rank, nbytes_chunk: int, probe: list[int], bpc: int, dev, client=None) -> dict:
    """Store and restore 1, 4 and 16 chunks (``PROBE_CHUNKS``) into distinct blocks of ``probe``,
    from the call to the moment the engine may read the blocks, next to the raw pinned copy time
    of the same bytes (median of 9 after 2 warm-ups), and where a request's time goes
    (``breakdown``: the medians of its stages, module doc)."""
    out = {}
    med = lambda xs: round(float(np.median(xs)) * 1e3, 3) if len(xs) else None  # noqa: E731
    for n in (1, 4, PROBE_CHUNKS):
        blocks = probe[: n * bpc]  # distinct blocks, as an engine's (a block named twice in a request
        # is written twice, in order, by copies one at a time: not a request an engine makes)
        host = torch.empty(n * nbytes_chunk, dtype=torch.uint8, pin_memory=True)
        devbuf = torch.empty(n * nbytes_chunk, dtype=torch.uint8, device=dev)
        st, rt, raw_d2h, raw_h2d, wait = [], [], [], [], []
        lanes0 = _daemon(client)
        rank.trace = []
        stager = getattr(rank, "stager", None)
        if stager is not None:
            stager.timings = {}
        for i in range(11):
            keys = [uuid.uuid4().bytes[:16] for _ in range(n)]
            chunks = [{"key": k, "blocks": [blocks[c * bpc : (c + 1) * bpc]]} for c, k in enumerate(keys)]
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            res = rank.store(chunks).result()
            t1 = time.perf_counter()
            got = rank.retrieve(chunks).result()
            t1b = time.perf_counter()
            got.done.synchronize()
            t2 = time.perf_counter()
            if res.results != ["stored"] * n or not all(got.ok):
                raise RuntimeError(f"latency probe failed: {res} {got.ok}")
            t3 = time.perf_counter()
            host.copy_(devbuf, non_blocking=True)
            torch.cuda.synchronize(dev)
            t4 = time.perf_counter()
            devbuf.copy_(host, non_blocking=True)
            torch.cuda.synchronize(dev)
            t5 = time.perf_counter()
            if i >= 2:
                st.append(t1 - t)
                rt.append(t2 - t1)
                raw_d2h.append(t4 - t3)
                raw_h2d.append(t5 - t4)
                wait.append((t1, t1b, t2))
        trace, rank.trace = rank.trace, None
        timings = stager.timings if stager is not None else None
        if stager is not None:
            stager.timings = None
        lanes1 = _daemon(client)
        row = {
            "store": med(st),
            "raw_d2h": med(raw_d2h),
            "retrieve": med(rt),
            "raw_h2d": med(raw_h2d),
            "store_goal": round((1.2 if n == 1 else 1.1) * med(raw_d2h) + 0.3, 3),
            "retrieve_goal": round((1.2 if n == 1 else 1.1) * med(raw_h2d) + 0.3, 3),
        }
        direct = getattr(rank, "stager", None) is None
        row["breakdown"] = _breakdown(trace, wait, lanes0, lanes1, med, direct)
        for op, calls in (timings or {}).items():  # inside the engine's gather and scatter calls
            calls = calls[2:]
            stages = {k for c in calls for k in c}
            row["breakdown"][f"engine {op} call"] = {
                k: med([c.get(k, 0.0) for c in calls]) for k in sorted(stages)
            }
        out[f"{n}_chunks"] = row
    if client is not None:
        out["wire_floor_ms"] = _wire_floor(client, rank, bpc, med)
    return out


# a request's stages as StagedRank's trace stamps them, in order: (name, from stamp, to stamp)
STORE_STAGES = (
    ("handoff to the submitter thread", "call", "start"),
    ("staging room, gather launch (Python)", "start", "launched"),
    ("gather on the GPU, helper thread wakes", "launched", "gathered"),
    ("STORE encoded and sent", "gathered", "sent"),
    ("daemon and wire, DMA included", "sent", "answered"),
)
DIRECT_STAGES = (  # DirectRank: no gather, no scatter, no room
    ("ordering (the caller's own thread when its event is done), encoded and sent", "call", "sent"),
    ("daemon and wire, copies included (a RETRIEVE's answered once queued)", "sent", "answered"),
)
RETRIEVE_STAGES = (
    ("handoff to the submitter thread", "call", "start"),
    ("staging room, RETRIEVE sent", "start", "sent"),
    ("daemon and wire (DMA queued, answered at once)", "sent", "answered"),
    ("scatter launch (Python)", "answered", "scattered"),
)


def _breakdown(trace: list[dict], waits: list[tuple], lanes0: dict, lanes1: dict, med, direct=False) -> dict:
    """Medians (ms) of each stage of a job's first request over the timed iterations (the first
    two are warm-ups), the caller's wait after the last stamp, and the daemon's lane times per
    call (``host``: issuing the DMAs; ``sync``: waiting for them)."""
    firsts = {"STORE": [], "RETRIEVE": []}
    for rec in trace:
        if "call" in rec and rec.get("first", True):
            firsts[rec["op"]].append(rec)
    out: dict = {}
    stages_of = {"STORE": STORE_STAGES, "RETRIEVE": RETRIEVE_STAGES}
    if direct:
        stages_of = dict.fromkeys(stages_of, DIRECT_STAGES)
    for op, stages in stages_of.items():
        recs = firsts[op][2:]
        row = {}
        for name, a, b in stages:
            xs = [r[b] - r[a] for r in recs if a in r and b in r]
            if xs:
                row[name] = med(xs)
        out[op.lower()] = row
    # the caller's side: a STORE's answer to the caller's result(), a RETRIEVE's scatter to result(),
    # and its wait for the DMA and the scatter on the GPU
    st = [r for r in firsts["STORE"][2:] if "answered" in r]
    last = "answered" if direct else "scattered"
    rt = [r for r in firsts["RETRIEVE"][2:] if last in r]
    if len(st) == len(waits):
        out["store"]["answer to the caller"] = med([w[0] - r["answered"] for r, w in zip(st, waits)])
    if len(rt) == len(waits):
        out["retrieve"]["answer to the caller"] = med([w[1] - r[last] for r, w in zip(rt, waits)])
        out["retrieve"]["copies (and scatter) finish on the GPU"] = med([w[2] - w[1] for w in waits])
    for name, lane in (("store", "store"), ("retrieve", "retrieve")):
        a, b = lanes0["lanes"].get(lane) or {}, lanes1["lanes"].get(lane) or {}
        calls = b.get("calls", 0) - a.get("calls", 0)
        if calls:
            for k in ("host_s", "sync_s"):
                out[name][f"daemon lane {k[:-2]} per call"] = round((b[k] - a[k]) / calls * 1e3, 3)
        for stage, ms in stage_means(lanes0["stages"], lanes1["stages"]).get(name.upper(), {}).items():
            out[name][f"daemon: {stage}"] = ms
    return out


def _daemon(client) -> dict:
    """The daemon's copy lanes (``cuda_detail``) and its request stages, now (/status)."""
    if client is None:
        return {"lanes": {}, "stages": {}}
    status = client.status()
    return {
        "lanes": (status.get("cuda_detail") or {}).get("lanes") or {},
        "stages": status.get("request_stages") or {},
    }


def _wire_floor(client, rank, bpc: int, med) -> dict:
    """Round trips that copy nothing, the same way a STORE's answer travels (through the client's
    I/O thread to a waiting caller): a STORE of chunks already stored and a RETRIEVE of a key
    never stored, each one chunk."""
    key = uuid.uuid4().bytes[:16]
    chunk = {"key": key, "blocks": [list(range(bpc))]}
    rank.store([chunk]).result()
    missing = {**chunk, "key": uuid.uuid4().bytes[:16]}
    at = {"staged_at": 0} if getattr(rank, "stager", None) is not None else {}
    out = {}
    for name, op, body in (
        ("store_exists", "STORE", {"instance": rank.instance, "chunks": [chunk], **at}),
        ("retrieve_missing", "RETRIEVE", {"instance": rank.instance, "chunks": [missing], **at}),
    ):
        xs = []
        for i in range(23):
            ev = threading.Event()
            t = time.perf_counter()
            fut = client.call_async(op, body)
            fut.add_done_callback(lambda _f, ev=ev: ev.set())
            ev.wait(10)
            if i >= 3:
                xs.append(time.perf_counter() - t)
        out[name] = med(xs)
    return out
