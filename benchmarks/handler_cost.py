"""What the daemon's main loop spends on one STORE or RETRIEVE before its copy is queued: decode
the frame into its typed request, check it against the layout, plan it (allocate or look up its
objects, build the copy items). In-process, no socket, no copy; p50/p90 over many requests.

    python benchmarks/handler_cost.py [--chunks 16] [--groups 1|2] [--repeats 2000]
    python benchmarks/handler_cost.py --lookup-keys 32768 [--window 1073741824] [--held 200]

    python benchmarks/handler_cost.py --index-objects 1000000 [--prompt-keys 2048]

``--lookup-keys``: instead, one LOOKUP of that many keys (the largest the bound allows: 32768 for
one group and one rank) against a sliding-window group of ``--window`` tokens with the first
``--held`` chunks stored, with a lease (a hostile client's LOOKUP, at the bound).

``--index-objects``: instead, where a full-attention LOOKUP's daemon time goes once the index
holds that many one-block objects: a hit of the first ``--prompt-keys`` keys, without a lease,
split into decode, handler (checks and the fold), reply encode and the LRU touch the daemon
applies after the reply (``Pool.settle``); next to same-run references that are not tierd code:
msgspec decoding the bare key list, a plain dict of as many random keys probed for the prompt's
(``list(map(dict.get))``) and an OrderedDict of as many moving the prompt's to its end.
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
from collections import OrderedDict, deque

import msgspec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tierd.base.config import Settings  # noqa: E402
from tierd.core import handlers  # noqa: E402
from tierd.core.handlers import Call  # noqa: E402
from tierd.daemon.server import Daemon  # noqa: E402
from tierd.protocol import codec, messages  # noqa: E402
from tierd_client.layouts import block_span, group, layout, namespace  # noqa: E402
from tierd_client.shm import SharedBuffer  # noqa: E402

LAYERS, BLOCK_BYTES, BLOCK_TOKENS, CHUNK = 32, 8192, 16, 256
IDENT = b"h" * 16  # the one client's identity


def _daemon() -> Daemon:
    """An in-process daemon (no loop runs: the handlers are called directly)."""
    folder = tempfile.mkdtemp(prefix="tierd-hc-")
    return Daemon(Settings(socket=f"ipc://{folder}/h.sock", l1_size_gb=4, http_port=-1))


def _register(d: Daemon, lay: dict) -> Call:
    """HELLO, then REGISTER ``lay`` as instance "i"; the session's Call."""
    handlers.hello(d.tier, Call(IDENT, None, [IDENT], 0, 0.0), messages.Hello(1))
    call = Call(IDENT, d.registry.session(IDENT), [IDENT], 0, 0.0)
    handlers.register(d.tier, call, messages.convert({"instance": "i", "layout": lay}, messages.Register))
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--groups", type=int, default=1, choices=(1, 2), help="1: full; 2: full + sliding")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--lookup-keys", type=int, default=0)
    ap.add_argument("--window", type=int, default=1 << 30)
    ap.add_argument("--held", type=int, default=200)
    ap.add_argument("--index-objects", type=int, default=0)
    ap.add_argument("--prompt-keys", type=int, default=2048)
    args = ap.parse_args()
    if args.index_objects:
        if not 0 < args.prompt_keys <= min(args.index_objects, messages.MAX_CHUNKS):
            ap.error(f"--prompt-keys must be 1..min(--index-objects, {messages.MAX_CHUNKS})")
        return lookup_split(args)
    if args.lookup_keys:
        if not 0 < args.held <= args.lookup_keys:
            ap.error(f"--held must be 1..--lookup-keys ({args.lookup_keys}): it stores the first keys")
        return lookup_cost(args)
    nb = 2 * args.chunks * CHUNK // BLOCK_TOKENS
    d = _daemon()
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
        _register(d, lay)
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
            job = handlers.store(d.tier, Call(IDENT, d.registry.session(IDENT), [IDENT], rid, t0), msg)
            store_t.append(time.perf_counter() - t0)
            d.pool.commit(job.plan.objs)
            frame = codec.encode_request(
                "RETRIEVE", rep, {"instance": "i", "chunks": chunks, "deadline": time.time() + 60}
            )
            t0 = time.perf_counter()
            op, rid, msg = codec.decode_request(frame, 1 << 26)
            job = handlers.retrieve(d.tier, Call(IDENT, d.registry.session(IDENT), [IDENT], rid, t0), msg)
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
    d = _daemon()
    nb = 2 * CHUNK // BLOCK_TOKENS
    buf = SharedBuffer(nb * BLOCK_BYTES)
    try:
        spans = [block_span((nb, BLOCK_BYTES), (BLOCK_BYTES, 1), 1, 0, tensor=0, offset=0)]
        ns = namespace("bench", uuid.uuid4().hex)
        lay = layout(
            ns, 0, CHUNK, [buf.ref()], [group("sliding", BLOCK_TOKENS, spans, window_tokens=args.window)]
        )
        call = _register(d, lay)
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
            reply = handlers.lookup(d.tier, Call(IDENT, d.registry.session(IDENT), [IDENT], rid, t0), msg)
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


def _tails(samples: list[float]) -> str:
    t = sorted(samples)
    return f"p50 {statistics.median(t) * 1e6:7.1f} us, p99 {t[int(len(t) * 0.99)] * 1e6:7.1f} us"


def lookup_split(args) -> None:
    d = _daemon()
    nb, bb = 4096, 64  # one 64-byte block an object: the index, not the bytes, is measured
    buf = SharedBuffer(nb * bb)
    try:
        ns = namespace("bench", uuid.uuid4().hex)
        spans = [block_span((nb, bb), (bb, 1), 1, 0, tensor=0, offset=0)]
        lay = layout(ns, 0, BLOCK_TOKENS, [buf.ref()], [group("full", BLOCK_TOKENS, spans)])
        call = _register(d, lay)
        keys = [uuid.uuid4().bytes for _ in range(args.index_objects)]
        step = messages.MAX_REQUEST_PARTS
        for i in range(0, len(keys), step):
            chunks = [{"key": k, "blocks": [[(i + j) % nb]]} for j, k in enumerate(keys[i : i + step])]
            job = handlers.store(
                d.tier, call, messages.convert({"instance": "i", "chunks": chunks}, messages.Store)
            )
            d.pool.commit(job.plan.objs)
            if i % (64 * step) == 0:
                print(f"\rindexed {i + len(chunks):,}/{len(keys):,}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        gc.collect()
        gc.freeze()  # as the daemon does every GC_FREEZE_S
        prompt = keys[: args.prompt_keys]
        specs = [{"kind": "full", "block_tokens": BLOCK_TOKENS, "window_tokens": 0}]
        body = {
            "namespace": ns,
            "keys": prompt,
            "groups": specs,
            "chunk_tokens": BLOCK_TOKENS,
            "lease": False,
        }
        frame = codec.encode_request("LOOKUP", 1, body)
        parts: dict[str, list[float]] = {"decode": [], "handler": [], "encode": [], "touch": []}
        # the references: the same work done by msgspec and by plain dicts, no tierd code
        bare = msgspec.msgpack.encode(prompt)
        probe = dict.fromkeys(uuid.uuid4().bytes for _ in range(len(keys) - len(prompt)))
        probe.update(dict.fromkeys(prompt))
        lru = OrderedDict.fromkeys(probe)
        refs: dict[str, list[float]] = {"decode the keys": [], "probe a dict": [], "OrderedDict touch": []}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            op, rid, msg = codec.decode_request(frame, 1 << 26)
            t1 = time.perf_counter()
            reply = handlers.lookup(d.tier, Call(IDENT, d.registry.session(IDENT), [IDENT], rid, t0), msg)
            t2 = time.perf_counter()
            codec.encode_reply(rid, reply)
            t3 = time.perf_counter()
            d.pool.settle()
            t4 = time.perf_counter()
            assert reply.chunks == len(prompt), reply.chunks
            for name, a, b in zip(parts, (t0, t1, t2, t3), (t1, t2, t3, t4)):
                parts[name].append(b - a)
            t0 = time.perf_counter()
            got = msgspec.msgpack.decode(bare, type=list[bytes])
            t1 = time.perf_counter()
            list(map(probe.get, got))
            t2 = time.perf_counter()
            deque(map(lru.move_to_end, reversed(got)), 0)
            t3 = time.perf_counter()
            for name, a, b in zip(refs, (t0, t1, t2), (t1, t2, t3)):
                refs[name].append(b - a)
        print(f"LOOKUP hit of {len(prompt)} keys, {len(keys):,} objects indexed, {args.repeats} times:")
        for name, t in parts.items():
            print(f"  {name:18s} {_tails(t)}")
        total = [sum(x) for x in zip(*parts.values())]
        print(f"  {'all':18s} {_tails(total)}")
        print("same-run references (no tierd code; the same keys, as many of them indexed):")
        for name, t in refs.items():
            print(f"  {name:18s} {_tails(t)}")
    finally:
        d.close()
        buf.close()


if __name__ == "__main__":
    main()
