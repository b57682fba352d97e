"""What the daemon's main loop spends on one STORE or RETRIEVE before its copy is queued: decode
the frame into its typed request, check it against the layout, plan it (allocate or look up its
objects, build the copy items). In-process, no socket, no copy; p50/p90 over many requests.

    python benchmarks/handler_cost.py [--chunks 16] [--groups 1|2] [--repeats 2000]
    python benchmarks/handler_cost.py --lookup-keys 32768 [--window 1073741824] [--held 200]

``--lookup-keys``: instead, one LOOKUP of that many keys (the largest the bound allows: 32768 for
one group and one rank) against a sliding-window group of ``--window`` tokens with the first
``--held`` chunks stored, with a lease (issue 10's attack, at the bound).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tierd import handlers  # noqa: E402
from tierd.config import Settings  # noqa: E402
from tierd.handlers import Call  # noqa: E402
from tierd.protocol import codec, messages  # noqa: E402
from tierd.server import Daemon  # noqa: E402
from tierd_client.layouts import block_span, group, layout, namespace  # noqa: E402
from tierd_client.shm import SharedBuffer  # noqa: E402

LAYERS, BLOCK_BYTES, BLOCK_TOKENS, CHUNK = 32, 8192, 16, 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--groups", type=int, default=1, choices=(1, 2), help="1: full; 2: full + sliding")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--lookup-keys", type=int, default=0)
    ap.add_argument("--window", type=int, default=1 << 30)
    ap.add_argument("--held", type=int, default=200)
    args = ap.parse_args()
    if args.lookup_keys:
        if not 0 < args.held <= args.lookup_keys:
            ap.error(f"--held must be 1..--lookup-keys ({args.lookup_keys}): it stores the first keys")
        return lookup_cost(args)
    nb = 2 * args.chunks * CHUNK // BLOCK_TOKENS
    folder = tempfile.mkdtemp(prefix="tierd-hc-")
    d = Daemon(Settings(socket=f"ipc://{folder}/h.sock", l1_size_gb=4, http_port=-1))
    bufs = [SharedBuffer(LAYERS * nb * BLOCK_BYTES) for _ in range(args.groups)]
    try:
        gs = []
        for gi in range(args.groups):
            spans = [
                block_span((nb, BLOCK_BYTES), (BLOCK_BYTES, 1), 1, 0, tensor=gi, offset=li * nb * BLOCK_BYTES)
                for li in range(LAYERS)
            ]
            gs.append(
                group(
                    "full" if gi == 0 else "sliding", BLOCK_TOKENS, spans, window_tokens=0 if gi == 0 else 512
                )
            )
        lay = layout(namespace("bench", uuid.uuid4().hex), 0, CHUNK, [b.ref() for b in bufs], gs)
        ident = b"h" * 16
        handlers.hello(d.tier, Call(ident, None, [ident], 0, 0.0), messages.Hello(1))
        call = Call(ident, d.registry.session(ident), [ident], 0, 0.0)
        handlers.register(d.tier, call, messages.convert({"instance": "i", "layout": lay}, messages.Register))
        bpc = CHUNK // BLOCK_TOKENS
        store_t, retrieve_t = [], []
        for rep in range(args.repeats):
            chunks = [
                {"key": uuid.uuid4().bytes, "blocks": [list(range(j * bpc, (j + 1) * bpc))] * args.groups}
                for j in range(args.chunks)
            ]
            frame = codec.encode_request(
                "STORE", rep, {"instance": "i", "chunks": chunks, "deadline": time.time() + 60}
            )
            t0 = time.perf_counter()
            op, rid, msg = codec.decode_request(frame, 1 << 26)
            job = handlers.store(d.tier, Call(ident, d.registry.session(ident), [ident], rid, t0), msg)
            store_t.append(time.perf_counter() - t0)
            d.pool.commit(job.plan.objs)
            frame = codec.encode_request(
                "RETRIEVE", rep, {"instance": "i", "chunks": chunks, "deadline": time.time() + 60}
            )
            t0 = time.perf_counter()
            op, rid, msg = codec.decode_request(frame, 1 << 26)
            job = handlers.retrieve(d.tier, Call(ident, d.registry.session(ident), [ident], rid, t0), msg)
            retrieve_t.append(time.perf_counter() - t0)
            d.pool.unpin(job.plan.objs)
            d.pool.clear()
        for name, t in (("STORE", store_t), ("RETRIEVE", retrieve_t)):
            t = sorted(t[len(t) // 10 :])
            print(
                f"{name} handler, {args.chunks} chunks x {args.groups} group(s) x {LAYERS} layers: "
                f"p50 {statistics.median(t) * 1e3:.3f} ms, p90 {t[int(len(t) * 0.9)] * 1e3:.3f} ms"
            )
    finally:
        d.close()
        for b in bufs:
            b.close()


def lookup_cost(args) -> None:
    folder = tempfile.mkdtemp(prefix="tierd-hc-")
    d = Daemon(Settings(socket=f"ipc://{folder}/h.sock", l1_size_gb=4, http_port=-1))
    nb = 2 * CHUNK // BLOCK_TOKENS
    buf = SharedBuffer(nb * BLOCK_BYTES)
    try:
        spans = [block_span((nb, BLOCK_BYTES), (BLOCK_BYTES, 1), 1, 0, tensor=0, offset=0)]
        ns = namespace("bench", uuid.uuid4().hex)
        lay = layout(
            ns, 0, CHUNK, [buf.ref()], [group("sliding", BLOCK_TOKENS, spans, window_tokens=args.window)]
        )
        ident = b"h" * 16
        handlers.hello(d.tier, Call(ident, None, [ident], 0, 0.0), messages.Hello(1))
        call = Call(ident, d.registry.session(ident), [ident], 0, 0.0)
        handlers.register(d.tier, call, messages.convert({"instance": "i", "layout": lay}, messages.Register))
        keys = [uuid.uuid4().bytes for _ in range(args.lookup_keys)]
        blocks = [list(range(CHUNK // BLOCK_TOKENS))]
        for i in range(0, args.held, 64):
            chunks = [{"key": k, "blocks": blocks} for k in keys[i : min(i + 64, args.held)]]
            job = handlers.store(
                d.tier, call, messages.convert({"instance": "i", "chunks": chunks}, messages.Store)
            )
            d.pool.commit(job.plan.objs)
        specs = [{"kind": "sliding", "block_tokens": BLOCK_TOKENS, "window_tokens": args.window}]
        frame = codec.encode_request(
            "LOOKUP", 1, {"namespace": ns, "keys": keys, "groups": specs, "chunk_tokens": CHUNK}
        )
        times, hit = [], 0
        for _ in range(max(5, args.repeats // 50)):
            t0 = time.perf_counter()
            op, rid, msg = codec.decode_request(frame, 1 << 26)
            reply = handlers.lookup(d.tier, Call(ident, d.registry.session(ident), [ident], rid, t0), msg)
            codec.encode_reply(rid, reply)
            times.append(time.perf_counter() - t0)
            hit = reply.chunks
            d.registry.release(reply.lease)
        t = sorted(times)
        print(
            f"LOOKUP of {args.lookup_keys} keys, sliding window {args.window}, {args.held} held: decode + "
            f"handler + encode p50 {statistics.median(t) * 1e3:.2f} ms, max {t[-1] * 1e3:.2f} ms, hit {hit}"
        )
    finally:
        d.close()
        buf.close()


if __name__ == "__main__":
    main()
