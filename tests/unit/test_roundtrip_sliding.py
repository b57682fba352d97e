"""Sliding-window groups: byte-equal round trips, chunks with null blocks, and LOOKUP requiring
only the blocks inside ``window_tokens - 1`` before the hit boundary.

Geometry throughout: chunk_tokens 16, block_tokens 4 (4 blocks per chunk).
The daemon's objects in this process (tests/inproc.py): what it plans for these groups, bytes
copied between its pool and the rank's shared memory here (a round trip into another process's
memory: tests/daemon/test_roundtrip.py and test_roundtrip_full.py)."""

import numpy as np
from kv import GroupGeom, keys
from util import NULL, chunk, grouping, ranks  # noqa: F401 - fixtures

from tierd.protocol import messages

N = NULL


def sliding(window=8, layers=2, block_bytes=256):
    return GroupGeom("sliding", layers=layers, block_bytes=block_bytes, block_tokens=4, window_tokens=window)


def lookup(client, rank, ks, lease=False):
    return client.lookup(rank.ns, ks, rank.specs(), rank.chunk_tokens, lease=lease).chunks


def test_sliding_round_trip_is_byte_equal(ginclient, ranks):
    rank = ranks(sliding(layers=3, block_bytes=384))
    ginclient.register("s0", rank.layout())
    ks = keys(4)
    res = ginclient.store("s0", [chunk(k, range(4 * c, 4 * c + 4)) for c, k in enumerate(ks)])
    assert res.results == ["stored"] * 4
    assert lookup(ginclient, rank, ks) == 4
    expect = rank.blocks(0, range(16))
    rank.kv[0][:, 32:48] = 0
    out = ginclient.retrieve("s0", [chunk(k, range(32 + 4 * c, 36 + 4 * c)) for c, k in enumerate(ks)])
    assert out == messages.RetrieveReply([True] * 4, [])
    np.testing.assert_array_equal(rank.kv[0][:, 32:48], expect)


def test_sliding_lookup_needs_only_the_window(ginclient, ginproc, ranks):
    """window 8: a hit of b chunks needs tokens [16b-7, 16b), i.e. blocks 2 and 3 of chunk b-1."""
    rank = ranks(sliding(window=8))
    ginclient.register("s0", rank.layout())
    ks = keys(4)
    stored = [
        [N, N, N, N],  # chunk 0: nothing (out of every later window)
        [N, N, 6, 7],  # chunk 1: only its tail
        [8, 9, N, N],  # chunk 2: only its head: boundary 3 is not servable
        [N, N, 14, 15],  # chunk 3: its tail: boundary 4 is servable
    ]
    res = ginclient.store("s0", [chunk(k, s) for k, s in zip(ks, stored)])
    assert res.results == ["empty", "stored", "stored", "stored"]
    assert ginproc.status()["objects"] == 3
    assert lookup(ginclient, rank, ks) == 4
    assert lookup(ginclient, rank, ks[:3]) == 2  # chunk 2's tail is missing, chunk 1's tail is there
    assert lookup(ginclient, rank, ks[:2]) == 2
    assert lookup(ginclient, rank, ks[:1]) == 0  # chunk 0's tail was never stored

    # Restore the window of the 4-chunk hit, nulls elsewhere: exactly those blocks are written.
    before = rank.kv[0].copy()
    expect = rank.blocks(0, [14, 15])
    rank.kv[0][:, 40:42] = 0
    before[:, 40:42] = 0
    want = [[N] * 4, [N] * 4, [N] * 4, [N, N, 40, 41]]
    out = ginclient.retrieve("s0", [chunk(k, w) for k, w in zip(ks, want)])
    assert out == messages.RetrieveReply([True] * 4, [])
    np.testing.assert_array_equal(rank.kv[0][:, 40:42], expect)
    untouched = np.ones(rank.num_blocks, bool)
    untouched[40:42] = False
    np.testing.assert_array_equal(rank.kv[0][:, untouched], before[:, untouched])

    # The null-block chunks round-trip their stored blocks byte for byte.
    expect = rank.blocks(0, [6, 7, 8, 9])
    out = ginclient.retrieve("s0", [chunk(ks[1], [N, N, 50, 51]), chunk(ks[2], [52, 53, N, N])])
    assert out == messages.RetrieveReply([True, True], [])
    np.testing.assert_array_equal(rank.kv[0][:, 50:54], expect)


def test_sliding_window_spanning_chunks_needs_the_previous_chunk_tail(ginclient, ranks):
    """window 20: boundary 4 needs tokens [45, 64): block 3 of chunk 2 and all of chunk 3."""
    rank = ranks(sliding(window=20))
    ginclient.register("s0", rank.layout())
    a, b = keys(4), keys(4)
    ginclient.store("s0", [chunk(a[2], [N, N, N, 11]), chunk(a[3], range(12, 16))])
    ginclient.store("s0", [chunk(b[2], [N, N, 10, N]), chunk(b[3], range(12, 16))])
    assert lookup(ginclient, rank, a) == 4
    assert lookup(ginclient, rank, b) == 0  # block 3 of chunk 2 is inside the window and missing


def test_out_of_window_blocks_are_not_leased_but_window_blocks_retrieve(ginclient, ginproc, ranks):
    """A hit reported with a lease is retrievable: the window blocks come back byte-equal."""
    rank = ranks(sliding(window=8))
    ginclient.register("s0", rank.layout())
    ks = keys(3)
    ginclient.store("s0", [chunk(k, range(4 * c, 4 * c + 4)) for c, k in enumerate(ks)])
    reply = ginclient.lookup(rank.ns, ks, rank.specs(), rank.chunk_tokens)
    assert reply.chunks == 3 and reply.lease > 0
    expect = rank.blocks(0, [10, 11])
    out = ginclient.retrieve(
        "s0",
        [chunk(ks[0], [N] * 4), chunk(ks[1], [N] * 4), chunk(ks[2], [N, N, 60, 61])],
        lease=reply.lease,
    )
    assert out.ok == [True, True, True]
    np.testing.assert_array_equal(rank.kv[0][:, 60:62], expect)
    assert ginproc.status()["leases_active"] == 0  # the only rank retrieved: the lease is spent
