"""What the eviction policy costs the daemon per request, same run: ``lru`` against ``reuse``.

    python benchmarks/policy_cost.py [--objects 100000] [--prompt-keys 2048] [--chunks 16] [--repeats 300]
    python benchmarks/policy_cost.py --sides lru,lru     # an A/A control: what the harness alone gives

One daemon per policy, each in a process of its own on the same core (handlers called directly,
as benchmarks/handler_cost.py does), each holding ``--objects`` one-block objects in a pool that
has room for exactly that many, so every new object evicts one:
- LOOKUP: a hit of the first ``--prompt-keys`` keys: decode, handler, reply encode and the touch
  the daemon applies after the reply (``Pool.settle``), which is where a policy counts a hit;
  REPLY: the same LOOKUPs until their reply is encoded (what the engine waits for);
- STORE: ``--chunks`` new chunks, each evicting one object: decode, handler (checks, plan and the
  evictions) and the commit with its touch (``StoreJob.finish``; no bytes are copied).
The two daemons take turns request by request (which goes first alternates; one works while the
other waits). Prints each policy's p50, p90 and mean, and the ratios of the second side's over
the first's (``--sides``, default lru,reuse): the mean counts work a policy does for a batch of
requests at once. ``--sides lru,lru`` is the control: what the harness alone gives.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from handler_cost import IDENT, _register  # noqa: E402

from tierd.base.config import Settings  # noqa: E402
from tierd.core import handlers  # noqa: E402
from tierd.core.handlers import Call  # noqa: E402
from tierd.daemon.server import Daemon  # noqa: E402
from tierd.protocol import codec, messages  # noqa: E402
from tierd_client.layouts import block_span, group, layout, namespace  # noqa: E402
from tierd_client.shm import SharedBuffer  # noqa: E402

BLOCK_TOKENS, BLOCK_BYTES, NB = 16, 64, 4096


class Side:
    """One policy's daemon, filled, with the prompt it looks up and a counter for new keys."""

    def __init__(self, policy: str, objects: int, prompt_keys: int):
        folder = tempfile.mkdtemp(prefix="tierd-pc-")
        self.d = Daemon(
            Settings(
                socket=f"ipc://{folder}/p.sock",
                http_port=-1,
                l1_align_bytes=BLOCK_BYTES,
                l1_size_gb=objects * BLOCK_BYTES / (1 << 30),
                l1_segment_mb=max(1, -(-objects * BLOCK_BYTES // (1 << 20))),
                l1_grow_mb=1,
                eviction_policy=policy,
            )
        )
        self.buf = SharedBuffer(NB * BLOCK_BYTES)
        self.ns = namespace("bench", uuid.uuid4().hex)
        spans = [block_span((NB, BLOCK_BYTES), (BLOCK_BYTES, 1), 1, 0, tensor=0, offset=0)]
        lay = layout(self.ns, 0, BLOCK_TOKENS, [self.buf.ref()], [group("full", BLOCK_TOKENS, spans)])
        self.call = _register(self.d, lay)
        self.keys = [uuid.uuid4().bytes for _ in range(objects)]
        specs = [{"kind": "full", "block_tokens": BLOCK_TOKENS, "window_tokens": 0}]
        body = {"namespace": self.ns, "keys": self.keys[:prompt_keys], "groups": specs}
        body.update(chunk_tokens=BLOCK_TOKENS, lease=False)
        self.lookup_frame = codec.encode_request("LOOKUP", 1, body)
        self.prompt_keys = prompt_keys

    def fill(self, i: int) -> None:
        """Store the ``i``-th batch of the keys."""
        self.store(self.keys[i : i + messages.MAX_REQUEST_PARTS], frame=False)

    def store(self, keys: list[bytes], frame: bool = True) -> float:
        """STORE ``keys`` (one block each) and commit them; the time from decoding the frame to the
        commit's end (``frame`` False: no frame, untimed, as the fill does)."""
        body = {"instance": "i", "chunks": [{"key": k, "blocks": [[j % NB]]} for j, k in enumerate(keys)]}
        data = codec.encode_request("STORE", 1, body) if frame else None
        t0 = time.perf_counter()
        msg = codec.decode_request(data, 1 << 26)[2] if frame else messages.convert(body, messages.Store)
        job = handlers.store(self.d.tier, self.call, msg)
        if isinstance(job, handlers.StoreJob):
            job.finish(self.d.tier, None)
        return time.perf_counter() - t0

    def lookup(self) -> tuple[float, float]:
        """One LOOKUP: (seconds until its reply was encoded, seconds with the touch after it)."""
        t0 = time.perf_counter()
        _, rid, msg = codec.decode_request(self.lookup_frame, 1 << 26)
        reply = handlers.lookup(
            self.d.tier, Call(IDENT, self.d.registry.session(IDENT), [IDENT], rid, t0), msg
        )
        codec.encode_reply(rid, reply)
        replied = time.perf_counter() - t0
        self.d.pool.settle()
        took = time.perf_counter() - t0
        assert reply.chunks == self.prompt_keys, reply.chunks
        return replied, took

    def close(self) -> None:
        self.d.close()
        self.buf.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=100_000)
    ap.add_argument("--prompt-keys", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--sides", default="lru,reuse", help="the two policies compared: A,B (B / A printed)")
    args = ap.parse_args()
    if args.objects * BLOCK_BYTES < 0.001 * (1 << 30):
        ap.error(
            "--objects must be at least 16778 (the smallest pool, --l1-size-gb 0.001, of 64-byte objects)"
        )
    if not 0 < args.prompt_keys <= min(args.objects, messages.MAX_CHUNKS):
        ap.error(f"--prompt-keys must be 1..min(--objects, {messages.MAX_CHUNKS})")
    names = args.sides.split(",")
    if len(names) != 2:
        ap.error("--sides takes two policies, A,B")
    print(
        f"{args.objects:,} objects, a full pool; LOOKUP hit of {args.prompt_keys} keys, STORE of "
        f"{args.chunks} new chunks (each evicting one); {args.repeats} of each, alternated:"
    )
    ctx = multiprocessing.get_context("spawn")
    core = max(os.sched_getaffinity(0))  # both sides on one core: two cores of a VM differ by 10%
    pipes, procs = [], []
    for name in names:
        mine, theirs = ctx.Pipe()
        job = (theirs, name, args.objects, args.prompt_keys, core)
        proc = ctx.Process(target=serve_side, args=job, daemon=True)
        proc.start()
        pipes.append(mine)
        procs.append(proc)
    try:
        for c in pipes:  # filled (each in its own process, at once)
            c.recv()
        took = [{"LOOKUP": [], "REPLY": [], "STORE": []} for _ in names]
        for rep in range(args.repeats):
            order = (0, 1) if rep % 2 == 0 else (1, 0)
            for i in order:  # one side works at a time: the other waits on its pipe
                pipes[i].send(("lookup", None))
                replied, whole = pipes[i].recv()
                took[i]["LOOKUP"].append(whole)
                took[i]["REPLY"].append(replied)
            new = [uuid.uuid4().bytes for _ in range(args.chunks)]
            for i in order:
                pipes[i].send(("store", new))
                took[i]["STORE"].append(pipes[i].recv())
        for c in pipes:
            c.send(("evictions", None))
        assert all(c.recv() >= args.repeats * args.chunks for c in pipes)
    finally:
        for c in pipes:
            with contextlib.suppress(OSError):  # a side that died: its own error is the one to see
                c.send(("close", None))
        for proc in procs:
            proc.join(30)
    for op in ("LOOKUP", "REPLY", "STORE"):
        p50, mean = [], []
        for name, t in zip(names, (sorted(x[op]) for x in took)):
            p50.append(statistics.median(t))
            mean.append(statistics.fmean(t))
            p90 = t[int(len(t) * 0.9)]
            print(
                f"  {op:6s} {name:5s} p50 {p50[-1] * 1e6:8.1f} us, p90 {p90 * 1e6:8.1f} us, "
                f"mean {mean[-1] * 1e6:8.1f} us"
            )
        ratio = f"{names[1]} / {names[0]}"
        print(f"  {op:6s} {ratio} (p50): {p50[1] / p50[0]:.3f}, (mean): {mean[1] / mean[0]:.3f}")


def serve_side(conn, policy: str, objects: int, prompt_keys: int, core: int) -> None:
    """One side in a process of its own (a side's memory placed beside the other's moved both by up
    to 1.3x in one process), on ``core``: filled, then timing what the pipe asks for until "close"."""
    os.sched_setaffinity(0, {core})
    side = Side(policy, objects, prompt_keys)
    try:
        for i in range(0, objects, messages.MAX_REQUEST_PARTS):
            side.fill(i)
        assert side.d.pool.objects == objects
        gc.collect()
        gc.freeze()  # as the daemon does every GC_FREEZE_S
        conn.send("filled")
        while True:
            what, arg = conn.recv()
            if what == "lookup":
                conn.send(side.lookup())
            elif what == "store":
                conn.send(side.store(arg))
            elif what == "evictions":
                conn.send(side.d.pool.evictions)
            else:
                return
    finally:
        side.close()


if __name__ == "__main__":
    main()
