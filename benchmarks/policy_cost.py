"""What the eviction policy costs the daemon per request, same run: ``lru`` against ``reuse``.

    python benchmarks/policy_cost.py [--objects 100000] [--prompt-keys 2048] [--chunks 16] [--repeats 300]
    python benchmarks/policy_cost.py --sides lru,lru     # an A/A control: what the harness alone gives

One in-process daemon per policy (handlers called directly, as benchmarks/handler_cost.py does),
each holding ``--objects`` one-block objects in a pool that has room for exactly that many, so
every new object evicts one:
- LOOKUP: a hit of the first ``--prompt-keys`` keys: decode, handler, reply encode and the touch
  the daemon applies after the reply (``Pool.settle``), which is where a policy counts a hit;
  REPLY: the same LOOKUPs until their reply is encoded (what the engine waits for);
- STORE: ``--chunks`` new chunks, each evicting one object: decode, handler (checks, plan and the
  evictions) and the commit with its touch (``StoreJob.finish``; no bytes are copied).
The two daemons take turns request by request (which goes first alternates). Prints each policy's
p50, p90 and mean, and the ratios of the second side's over the first's (``--sides``, default
lru,reuse): the mean counts work a policy does for a batch of requests at once.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from handler_cost import IDENT, _register  # noqa: E402

from tierd import handlers  # noqa: E402
from tierd.config import Settings  # noqa: E402
from tierd.handlers import Call  # noqa: E402
from tierd.protocol import codec, messages  # noqa: E402
from tierd.server import Daemon  # noqa: E402
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
        """Store the ``i``-th batch of the keys (the two sides are filled batch by batch in turn,
        so that neither's objects lie later in memory: that alone made the later one's LOOKUP up to
        1.27x slower, lru against lru)."""
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
    sides = [Side(p, args.objects, args.prompt_keys) for p in names]
    try:
        step = messages.MAX_REQUEST_PARTS
        for i in range(0, args.objects, step):
            for s in sides if (i // step) % 2 == 0 else sides[::-1]:
                s.fill(i)
        assert all(s.d.pool.objects == args.objects for s in sides)
        gc.collect()
        gc.freeze()  # as the daemon does every GC_FREEZE_S
        took = [{"LOOKUP": [], "REPLY": [], "STORE": []} for _ in sides]
        for rep in range(args.repeats):
            order = (0, 1) if rep % 2 == 0 else (1, 0)
            for i in order:
                replied, whole = sides[i].lookup()
                took[i]["LOOKUP"].append(whole)
                took[i]["REPLY"].append(replied)
            new = [uuid.uuid4().bytes for _ in range(args.chunks)]
            for i in order:
                took[i]["STORE"].append(sides[i].store(new))
        assert all(s.d.pool.evictions >= args.repeats * args.chunks for s in sides)
        print(
            f"{args.objects:,} objects, a full pool; LOOKUP hit of {args.prompt_keys} keys, STORE of "
            f"{args.chunks} new chunks (each evicting one); {args.repeats} of each, alternated:"
        )
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
    finally:
        for s in sides:
            s.close()


if __name__ == "__main__":
    main()
