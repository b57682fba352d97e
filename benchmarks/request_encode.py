"""The client's cost to turn a verb's arguments into a request frame, and a reply frame into
what the verb returns: typed (tierd.protocol.messages through tierd_client.wire, what TierdClient
does) against plain maps of the same fields (what it did before; the request maps' construction is
copied below, the reply maps are tierd.protocol.codec.decode_reply's, the msgpack decoding the
client used), alternated round by round in one process so both see the same machine at the same
moment.

    python benchmarks/request_encode.py [--rounds 21] [--calls 2000]

Requests: a 128-key LOOKUP of one full-attention group (a 32k-token prompt in 256-token chunks),
the same with 2048 keys (16-token chunks), and a 16-chunk STORE of 16 block ids a chunk (with its
wall-clock deadline). Replies (``decode_*``): the 2048-key LOOKUP's, and a STORE's of 16 and of
1024 chunks (the most one request carries). Each round times ``--calls`` frames per case and
variant; the figures are the per-frame medians over rounds (microseconds) and typed/maps, the
ratio per round's median, with the spread of the per-round ratios (min..max) as the noise of this
run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import msgspec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tierd.protocol import MAX_LOOKUP_PARTS, MAX_REQUEST_PARTS, codec, messages  # noqa: E402
from tierd.protocol.layout import GroupKind, GroupSpec, Namespace  # noqa: E402
from tierd_client import wire  # noqa: E402
from tierd_client.client import _split, lookup_request, typed_chunks  # noqa: E402
from tierd_client.transport import with_deadline  # noqa: E402

NS = {"model": "m", "fingerprint": "f" * 16, "world_size": 1, "salt": ""}
GROUPS = [{"kind": "full", "block_tokens": 16, "window_tokens": 0}]


def maps_lookup(namespace, keys, groups, chunk_tokens, replicated=False, lease=True) -> bytes:
    """The LOOKUP as plain maps (the client's former body)."""
    ranks = 1 if replicated else int(namespace.get("world_size", 1))
    keys = keys[: max(1, MAX_LOOKUP_PARTS // (max(1, len(groups)) * max(1, ranks)))]
    body = {
        "namespace": namespace,
        "keys": keys,
        "groups": groups,
        "chunk_tokens": chunk_tokens,
        "replicated": replicated,
        "lease": lease,
    }
    return codec.encode_request("LOOKUP", 7, dict(body))


def typed_lookup(namespace, keys, groups, chunk_tokens, replicated=False, lease=True) -> bytes:
    body = lookup_request(namespace, keys, groups, chunk_tokens, replicated, lease)
    return wire.encode_request("LOOKUP", 7, with_deadline("LOOKUP", body, 10.0))


def maps_store(instance, chunks, touch=None) -> list[bytes]:
    out = []
    for i, part in enumerate(_split(chunks)):
        body = {"instance": instance, "chunks": part}
        if touch and i == 0:
            body["touch"] = touch
        body = dict(body)
        body["deadline"] = time.time() + 10.0
        out.append(codec.encode_request("STORE", 7, body))
    return out


def typed_store(instance, chunks, touch=None) -> list[bytes]:
    out = []
    for i, part in enumerate(_split(typed_chunks(chunks))):
        body = messages.Store(instance, part, touch=(touch or []) if i == 0 else [])
        out.append(wire.encode_request("STORE", 7, with_deadline("STORE", body, 10.0)))
    return out


def maps_reply(frame: bytes) -> dict:
    """A reply as plain maps (the client's former decoding: msgpack, bounded containers)."""
    return codec.decode_reply(frame, 1 << 31)[2]


def typed_reply(op: str, frame: bytes):
    req_id, ok, body = wire.split_reply(frame)
    return wire.decode_body(op, ok, body)


def cases():
    keys128 = [os.urandom(16) for _ in range(128)]
    keys2048 = [os.urandom(16) for _ in range(2048)]
    ids = [list(range(i * 16, i * 16 + 16)) for i in range(16)]
    map_chunks = [{"key": k, "blocks": [b]} for k, b in zip(keys128, ids)]
    chunk_structs = [messages.Chunk(k, [b]) for k, b in zip(keys128, ids)]
    ns, specs = Namespace.from_wire(NS), [GroupSpec(GroupKind.FULL, 16)]
    # reply frames as the daemon encodes them
    lookup_reply = codec.encode_reply(7, messages.LookupReply(2048, 12345, 60.0))
    store_16_reply = codec.encode_reply(7, messages.StoreReply(["stored"] * 16))
    store_1024_reply = codec.encode_reply(
        7, messages.StoreReply(["stored", "exists"] * (MAX_REQUEST_PARTS // 2))
    )
    return {
        "lookup_128": (
            lambda: maps_lookup(NS, keys128, GROUPS, 256),
            lambda: typed_lookup(ns, keys128, specs, 256),
        ),
        "lookup_2048": (
            lambda: maps_lookup(NS, keys2048, GROUPS, 16),
            lambda: typed_lookup(ns, keys2048, specs, 16),
        ),
        "store_16": (
            lambda: maps_store("inst", map_chunks, keys128[:4]),
            lambda: typed_store("inst", chunk_structs, keys128[:4]),
        ),
        "decode_lookup_2048": (
            lambda: maps_reply(lookup_reply),
            lambda: typed_reply("LOOKUP", lookup_reply),
        ),
        "decode_store_16": (
            lambda: maps_reply(store_16_reply),
            lambda: typed_reply("STORE", store_16_reply),
        ),
        "decode_store_1024": (
            lambda: maps_reply(store_1024_reply),
            lambda: typed_reply("STORE", store_1024_reply),
        ),
    }


def check_same_requests(table) -> None:
    """Both variants' frames decode, at the daemon's edge, to the same typed request; both reply
    variants read the same fields."""
    for name, (a, b) in table.items():
        fa, fb = a(), b()
        if name.startswith("decode_"):
            assert fa == msgspec.structs.asdict(fb), f"{name}: the variants read different replies"
            continue
        fa, fb = (fa[0], fb[0]) if isinstance(fa, list) else (fa, fb)
        ra, rb = codec.decode_request(fa, 1 << 30)[2], codec.decode_request(fb, 1 << 30)[2]
        if hasattr(ra, "deadline"):  # each variant stamped its own clock
            ra = msgspec.structs.replace(ra, deadline=0.0)
            rb = msgspec.structs.replace(rb, deadline=0.0)
        assert ra == rb, f"{name}: the variants' requests differ"


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    table = cases()
    check_same_requests(table)
    got: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in table}
    for r in range(args.rounds):
        for name, (a, b) in table.items():
            order = ((0, a), (1, b)) if r % 2 == 0 else ((1, b), (0, a))  # alternate who goes first
            for i, fn in order:
                got[name][i].append(per_call_us(fn, args.calls))
    print(f"{'case':<18} {'maps_us':>8} {'typed_us':>9} {'typed/maps':>11} {'ratio min..max':>16}")
    for name, (a, b) in got.items():
        ratios = [y / x for x, y in zip(a, b)]
        print(
            f"{name:<18} {statistics.median(a):8.2f} {statistics.median(b):9.2f} "
            f"{statistics.median(ratios):11.3f} {min(ratios):7.3f}..{max(ratios):.3f}"
        )


if __name__ == "__main__":
    main()
