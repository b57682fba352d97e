"""Recurrent-state groups: one block per chunk holding the state at the chunk's end. A hit needs
only the state at boundary - 1; a missing state shortens the hit to the last boundary whose
state exists, and the state restored is byte-equal to the state stored.
The daemon's objects in this process (tests/inproc.py): what it plans for these groups, bytes
copied between its pool and the rank's shared memory here (a round trip into another process's
memory: tests/daemon/test_roundtrip.py and test_roundtrip_full.py)."""

import numpy as np
from kv import GroupGeom, keys
from util import NULL, chunk, grouping, ranks  # noqa: F401 - fixtures

from tierd.protocol import messages

N = NULL
FULL = GroupGeom("full", layers=2, block_bytes=256, block_tokens=4)
STATE = GroupGeom("state", layers=2, block_bytes=2048, block_tokens=16)


def lookup(client, rank, ks):
    return client.lookup(rank.ns, ks, rank.specs(), rank.chunk_tokens, lease=False).chunks


def test_state_only_round_trip_is_byte_equal(ginclient, ranks):
    rank = ranks(STATE)
    ginclient.register("m0", rank.layout())
    ks = keys(4)
    assert ginclient.store("m0", [chunk(k, [c]) for c, k in enumerate(ks)]).results == ["stored"] * 4
    assert lookup(ginclient, rank, ks) == 4
    expect = rank.blocks(0, range(4))
    rank.kv[0][:, 20:24] = 0
    out = ginclient.retrieve("m0", [chunk(k, [20 + c]) for c, k in enumerate(ks)])
    assert out == messages.RetrieveReply([True] * 4, [])
    np.testing.assert_array_equal(rank.kv[0][:, 20:24], expect)


def test_missing_state_shortens_hit_to_last_boundary_with_state(ginclient, ranks):
    rank = ranks(FULL, STATE)
    ginclient.register("h0", rank.layout())
    ks = keys(4)
    states = [0, N, 2, N]  # state after chunk 0 and after chunk 2 only
    res = ginclient.store(
        "h0", [chunk(k, range(4 * c, 4 * c + 4), [s]) for c, (k, s) in enumerate(zip(ks, states))]
    )
    assert res.results == ["stored"] * 4
    assert lookup(ginclient, rank, ks) == 3  # not 4 (no state after chunk 3), not 1 (first gap)
    assert lookup(ginclient, rank, ks[:2]) == 1
    assert lookup(ginclient, rank, ks[:1]) == 1

    # Restore the 3-chunk hit: all attention blocks, the state at the boundary only.
    expect_kv = rank.blocks(0, range(12))
    expect_state = rank.blocks(1, [2])
    rank.kv[0][:, 40:52] = 0
    rank.kv[1][:, 30] = 0
    out = ginclient.retrieve(
        "h0",
        [
            chunk(ks[0], range(40, 44), [N]),
            chunk(ks[1], range(44, 48), [N]),
            chunk(ks[2], range(48, 52), [30]),
        ],
    )
    assert out == messages.RetrieveReply([True] * 3, [])
    np.testing.assert_array_equal(rank.kv[0][:, 40:52], expect_kv)
    np.testing.assert_array_equal(rank.kv[1][:, 30], expect_state[:, 0])


def test_state_only_missing_state_shortens_hit(ginclient, ranks):
    rank = ranks(STATE)
    ginclient.register("m0", rank.layout())
    ks = keys(5)
    res = ginclient.store("m0", [chunk(k, [s]) for k, s in zip(ks, [N, 1, N, 3, N])])
    assert res.results == ["empty", "stored", "empty", "stored", "empty"]
    assert lookup(ginclient, rank, ks) == 4
    assert lookup(ginclient, rank, ks[:3]) == 2
    assert lookup(ginclient, rank, ks[:1]) == 0


def test_retrieving_a_missing_state_fails_exactly_that_block(ginclient, ranks):
    rank = ranks(FULL, STATE)
    ginclient.register("h0", rank.layout())
    ks = keys(2)
    ginclient.store("h0", [chunk(ks[0], range(4), [0]), chunk(ks[1], range(4, 8), [N])])
    out = ginclient.retrieve("h0", [chunk(ks[0], range(40, 44), [N]), chunk(ks[1], range(44, 48), [33])])
    assert out == messages.RetrieveReply([True, False], [(1, 33)])
