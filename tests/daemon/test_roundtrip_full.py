"""Full attention: several layers, block-contiguous and head-outer (strided, several runs per
block) tensors, in both object groupings: bytes restored are bytes stored."""

import numpy as np
from kv import GroupGeom, keys
from util import chunk, gclient, gdaemon, grouping, ranks  # noqa: F401 - fixtures

from tierd.protocol import messages
from tierd_client.layouts import block_span, group, layout, namespace
from tierd_client.shm import SharedBuffer


def test_full_attention_many_layers_round_trip(gclient, ranks):
    rank = ranks(GroupGeom("full", layers=6, block_bytes=1024, block_tokens=4))
    gclient.register("f0", rank.layout())
    ks = keys(6)
    src = [list(range(4 * c, 4 * c + 4)) for c in range(6)]
    assert gclient.store("f0", [chunk(k, s) for k, s in zip(ks, src)]).results == ["stored"] * 6
    # a second store of the same chunks copies nothing
    assert gclient.store("f0", [chunk(k, s) for k, s in zip(ks, src)]).results == ["exists"] * 6
    assert gclient.lookup(rank.ns, ks, rank.specs(), 16, lease=False).chunks == 6
    expect = rank.blocks(0, range(24))
    # restore into scattered, out-of-order blocks
    dst = [[63 - 4 * c - j for j in range(4)] for c in range(6)]
    out = gclient.retrieve("f0", [chunk(k, d) for k, d in zip(ks, dst)])
    assert out == messages.RetrieveReply([True] * 6, [])
    for c in range(6):
        for j in range(4):
            np.testing.assert_array_equal(rank.kv[0][:, dst[c][j]], expect[:, 4 * c + j])


def test_head_outer_strided_layout_round_trip(gclient):
    """Tensor per layer [heads, blocks, block_tokens * head_bytes]: a block is ``heads`` runs."""
    heads, nblocks, run = 4, 32, 128
    layers = 3
    buf = SharedBuffer(layers * heads * nblocks * run, prefix="tierd-test")
    try:
        kv = buf.array.reshape(layers, heads, nblocks, run)
        kv[:] = np.random.default_rng(5).integers(0, 255, kv.shape, dtype=np.uint8)
        spans = [
            block_span(
                (heads, nblocks, run),
                (nblocks * run, run, 1),
                1,
                1,
                tensor=0,
                offset=l * heads * nblocks * run,
            )
            for l in range(layers)
        ]
        assert spans[0]["runs"] == heads and spans[0]["run_stride"] == nblocks * run
        lay = layout(namespace("m", "head-outer"), 0, 8, [buf.ref()], [group("full", 4, spans)])
        gclient.register("ho", lay)
        ks = keys(3)
        gclient.store("ho", [chunk(k, [2 * c, 2 * c + 1]) for c, k in enumerate(ks)])
        expect = kv[:, :, 0:6].copy()
        kv[:, :, 20:26] = 0
        out = gclient.retrieve("ho", [chunk(k, [20 + 2 * c, 21 + 2 * c]) for c, k in enumerate(ks)])
        assert out.ok == [True] * 3
        np.testing.assert_array_equal(kv[:, :, 20:26], expect)
    finally:
        buf.close()
