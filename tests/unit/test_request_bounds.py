"""What one request may ask of the daemon's main loop is bounded at decode (docs/protocol.md
section 19), and tierd_client stays within the bounds by itself: a STORE or RETRIEVE larger than
MAX_REQUEST_PARTS goes as several requests, a LOOKUP larger than MAX_LOOKUP_PARTS asks for the
longest prefix that fits. The daemon's bounds on its objects in this process (tests/inproc.py), a
request handed to its loop as its ROUTER hands it; the client's LOOKUP prefix as tierd_client
builds it (that the client splits a STORE and a RETRIEVE larger than one request, against a
daemon, is tests/daemon/test_message_cap.py's)."""

from __future__ import annotations

from kv import FakeRank, GroupGeom, keys
from util import chunk

from tierd.protocol import MAX_LOOKUP_PARTS, MAX_REQUEST_PARTS

BLOCKS = 4 * (MAX_REQUEST_PARTS + 300)  # one block per chunk below: chunks of 4 tokens, blocks of 4


def rank() -> FakeRank:
    return FakeRank([GroupGeom("full", layers=1, block_bytes=64)], num_blocks=2 * BLOCKS, chunk_tokens=4)


def test_a_request_past_the_bound_is_refused_at_decode_and_nothing_is_stored(inproc, inraw):
    r = rank()
    try:
        w = inraw(inproc)
        w.hello()
        w.ok("REGISTER", {"instance": "big", "layout": r.layout()})
        n = MAX_REQUEST_PARTS + 1
        ok, reply = w.call(
            "STORE", {"instance": "big", "chunks": [chunk(k, [i]) for i, k in enumerate(keys(n))]}
        )
        # the decoder's own refusal (the planner bounds chunks x groups too, with its own words): a
        # list past the bound is never built into objects, let alone planned
        at_decode = f"chunks: Expected `array` of length <= {MAX_REQUEST_PARTS}"
        assert not ok and reply["code"] == "BAD_REQUEST" and reply["message"] == at_decode, reply
        assert inproc.status()["objects"] == 0
        ok, reply = w.call(
            "RETRIEVE", {"instance": "big", "chunks": [chunk(k, [i]) for i, k in enumerate(keys(n))]}
        )
        assert not ok and reply["code"] == "BAD_REQUEST" and reply["message"] == at_decode, reply
        # control: at the bound it is one request, stored
        ok, reply = w.call(
            "STORE", {"instance": "big", "chunks": [chunk(k, [i]) for i, k in enumerate(keys(n - 1))]}
        )
        assert ok and reply["results"] == ["stored"] * (n - 1)
    finally:
        r.close()


def test_a_lookup_past_the_bound_is_refused_and_the_client_asks_for_a_prefix(inproc, inraw, inclient):
    world = 64
    rk = FakeRank(
        [GroupGeom("full", layers=1, block_bytes=64)],
        num_blocks=64,
        chunk_tokens=4,
        world_size=world,
        replicated=False,
    )
    try:
        ks = keys(MAX_LOOKUP_PARTS // world + 10)
        body = {"namespace": rk.ns, "keys": ks, "groups": rk.specs(), "chunk_tokens": 4, "lease": False}
        w = inraw(inproc)
        w.hello()
        ok, reply = w.call("LOOKUP", body)
        assert (
            not ok and reply["code"] == "BAD_REQUEST" and f"x {world} ranks is more than" in reply["message"]
        )
        got = inclient.lookup(
            rk.ns, ks, rk.specs(), 4, lease=False
        )  # the client shortens it: a miss, answered
        assert got.chunks == 0
        ok, reply = w.call(
            "LOOKUP", {**body, "keys": ks[: MAX_LOOKUP_PARTS // world]}
        )  # control: at the bound
        assert ok and reply["chunks"] == 0
    finally:
        rk.close()
