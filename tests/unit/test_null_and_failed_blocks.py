"""Null block ids and failed retrieves: an all-null chunk is answered "empty" and not stored,
null ids in RETRIEVE are skipped (their blocks are never written), and a retrieve reports the
exact [group, block_id] pairs it could not restore, with ok=False for those chunks only. The
daemon's objects in this process (tests/inproc.py), copying to and from the rank's shared memory."""

import numpy as np
import pytest
from kv import GroupGeom, keys
from util import NULL, chunk, ranks  # noqa: F401 - fixtures

from tierd.protocol import messages
from tierd_client import TierdError

N = NULL
FULL = GroupGeom("full", layers=2, block_bytes=256, block_tokens=4)
SLIDE = GroupGeom("sliding", layers=2, block_bytes=128, block_tokens=4, window_tokens=8)


def test_all_null_chunk_is_empty_and_not_stored(inproc, inclient, ranks):
    rank = ranks(FULL, SLIDE)
    inclient.register("r", rank.layout())
    ks = keys(3)
    res = inclient.store(
        "r", [chunk(ks[0], [N] * 4, [N] * 4), chunk(ks[1], range(4), [N] * 4), chunk(ks[2], [N] * 4, [N] * 4)]
    )
    assert res.results == ["empty", "stored", "empty"]
    st = inproc.status()
    assert st["objects"] == 1 and st["stored_chunks"] == 1
    assert inclient.lookup(rank.ns, ks[:1], [rank.specs()[0]], 16, lease=False).chunks == 0
    # an "empty" answer is not remembered as stored: real data for that key is stored later
    assert inclient.store("r", [chunk(ks[0], range(4, 8), [N] * 4)]).results == ["stored"]


def test_null_ids_in_retrieve_are_skipped(inclient, ranks):
    rank = ranks(FULL)
    inclient.register("r", rank.layout())
    k = keys(1)[0]
    inclient.store("r", [chunk(k, range(4))])
    before = rank.kv[0].copy()
    out = inclient.retrieve("r", [chunk(k, [N, 40, N, 41])])
    assert out == messages.RetrieveReply([True], [])
    after = rank.kv[0]
    np.testing.assert_array_equal(after[:, 40], before[:, 1])
    np.testing.assert_array_equal(after[:, 41], before[:, 3])
    others = np.ones(rank.num_blocks, bool)
    others[[40, 41]] = False
    np.testing.assert_array_equal(after[:, others], before[:, others])


def test_retrieve_of_missing_chunk_reports_exact_pairs(inclient, ranks):
    rank = ranks(FULL, SLIDE)
    inclient.register("r", rank.layout())
    ks = keys(3)
    inclient.store("r", [chunk(ks[0], range(4), [N, N, 2, 3]), chunk(ks[2], range(8, 12), [N, N, 10, 11])])
    before = rank.kv[0].copy()
    out = inclient.retrieve(
        "r",
        [
            chunk(ks[0], range(40, 44), [N, N, 40, 41]),
            chunk(ks[1], [44, N, 45, 46], [N, N, 42, 43]),
            chunk(ks[2], range(48, 52), [N, N, 44, 45]),
        ],
    )
    assert out.ok == [True, False, True]
    assert out.failed == [(0, 44), (0, 45), (0, 46), (1, 42), (1, 43)]
    np.testing.assert_array_equal(rank.kv[0][:, 44:47], before[:, 44:47])  # never written
    np.testing.assert_array_equal(rank.kv[0][:, 48:52], before[:, 8:12])


def test_partial_group_retrieve_restores_held_blocks_and_reports_only_missing(inclient, ranks):
    """Regression: a group object holding some of the requested blocks used to be skipped as a
    whole while only the missing blocks were reported, leaving held blocks silently unrestored."""
    rank = ranks(FULL)
    inclient.register("r", rank.layout())
    k = keys(1)[0]
    assert inclient.store("r", [chunk(k, [0, 1, N, N])]).results == ["stored"]
    rank.kv[0][:, 40:44] = 0
    out = inclient.retrieve("r", [chunk(k, [40, 41, 42, 43])])
    assert out == messages.RetrieveReply([False], [(0, 42), (0, 43)])
    np.testing.assert_array_equal(rank.kv[0][:, 40:42], rank.kv[0][:, 0:2])
    assert not rank.kv[0][:, 42:44].any()


def test_custom_null_block_id(inproc_factory, inclient_factory, ranks):
    d = inproc_factory("--null-block-id", "63")
    inclient = inclient_factory(d)
    assert inclient.server.null_block_id == 63
    rank = ranks(FULL)
    inclient.register("r", rank.layout())
    ks = keys(2)
    assert inclient.store("r", [chunk(ks[0], [63] * 4), chunk(ks[1], [0, 1, 63, 63])]).results == [
        "empty",
        "stored",
    ]
    with pytest.raises(TierdError) as err:  # -1 is just an out-of-range id now
        inclient.store("r", [chunk(ks[0], [-1] * 4)])
    assert err.value.code == "BAD_REQUEST"
    out = inclient.retrieve("r", [chunk(ks[1], [40, 41, 42, 63])])
    assert out == messages.RetrieveReply([False], [(0, 42)])
