"""Byte-equal round trips through a real daemon for full, sliding-window and recurrent groups."""

import numpy as np
import pytest
from kv import FakeRank, GroupGeom, keys

from tierd.protocol import messages


def chunk(key, *per_group):
    return {"key": key, "blocks": [list(ids) for ids in per_group]}


def test_full_attention_round_trip_is_byte_equal(client):
    rank = FakeRank([GroupGeom("full", layers=3, block_bytes=512)])
    client.register("r0", rank.layout())
    ks = keys(4)
    src = [list(range(c * 4, c * 4 + 4)) for c in range(4)]
    res = client.store("r0", [chunk(k, ids) for k, ids in zip(ks, src)])
    assert res.results == ["stored"] * 4
    expect = rank.blocks(0, range(16))
    dst = [list(range(32 + c * 4, 36 + c * 4)) for c in range(4)]
    rank.kv[0][:, 32:48] = 0
    out = client.retrieve("r0", [chunk(k, ids) for k, ids in zip(ks, dst)])
    assert out == messages.RetrieveReply([True] * 4, [])
    np.testing.assert_array_equal(rank.kv[0][:, 32:48], expect)
    rank.close()
