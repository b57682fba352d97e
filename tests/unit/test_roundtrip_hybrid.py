"""A hybrid layout (full attention + sliding window + recurrent state, different block sizes and
layer counts) round-trips byte for byte, with one object per group per chunk and with one object
per chunk holding every group (--no-separate-object-groups).
The daemon's objects in this process (tests/inproc.py): what it plans for these groups, bytes
copied between its pool and the rank's shared memory here (a round trip into another process's
memory: tests/daemon/test_roundtrip.py and test_roundtrip_full.py)."""

import numpy as np
from kv import GroupGeom, keys
from util import NULL, chunk, grouping, ranks  # noqa: F401 - fixtures

from tierd.protocol import messages

N = NULL
GROUPS = (
    GroupGeom("full", layers=3, block_bytes=512, block_tokens=4),
    GroupGeom("sliding", layers=2, block_bytes=256, block_tokens=4, window_tokens=8),
    GroupGeom("state", layers=1, block_bytes=4096, block_tokens=16),
)


def test_hybrid_round_trip_is_byte_equal(ginclient, ginproc, grouping, ranks):
    rank = ranks(*GROUPS)
    ginclient.register("h0", rank.layout())
    ks = keys(4)
    # full: every block; sliding: only the tail of each chunk (engines null out-of-window blocks);
    # state: one block per chunk.
    stored = [chunk(k, range(4 * c, 4 * c + 4), [N, N, 4 * c + 2, 4 * c + 3], [c]) for c, k in enumerate(ks)]
    assert ginclient.store("h0", stored).results == ["stored"] * 4
    st = ginproc.status()
    if grouping:  # combined: one object per chunk
        assert st["objects"] == 4 and st["group_objects"] == {"all": 4}
    else:
        assert st["objects"] == 12
        assert st["group_objects"] == {"g0/full": 4, "g1/sliding": 4, "g2/state": 4}
    reply = ginclient.lookup(rank.ns, ks, rank.specs(), rank.chunk_tokens)
    assert reply.chunks == 4

    full, slide, state = rank.blocks(0, range(16)), rank.blocks(1, [14, 15]), rank.blocks(2, [3])
    rank.kv[0][:, 32:48] = 0
    rank.kv[1][:, 32:34] = 0
    rank.kv[2][:, 40] = 0
    want = [chunk(k, range(32 + 4 * c, 36 + 4 * c), [N] * 4, [N]) for c, k in enumerate(ks[:3])]
    want.append(chunk(ks[3], range(44, 48), [N, N, 32, 33], [40]))
    out = ginclient.retrieve("h0", want, lease=reply.lease)
    assert out == messages.RetrieveReply([True] * 4, [])
    np.testing.assert_array_equal(rank.kv[0][:, 32:48], full)
    np.testing.assert_array_equal(rank.kv[1][:, 32:34], slide)
    np.testing.assert_array_equal(rank.kv[2][:, 40], state[:, 0])


def test_hybrid_hit_is_the_fold_of_every_group(ginclient, ranks):
    """Each group limits the hit on its own terms; the answer is the shortest."""
    rank = ranks(*GROUPS)
    ginclient.register("h0", rank.layout())

    def hit(full_ids, slide_ids, states):
        ks = keys(len(full_ids))
        ginclient.store("h0", [chunk(k, f, s, [t]) for k, f, s, t in zip(ks, full_ids, slide_ids, states)])
        return ginclient.lookup(rank.ns, ks, rank.specs(), rank.chunk_tokens, lease=False).chunks

    full = [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
    tails = [[N, N, 2, 3], [N, N, 6, 7], [N, N, 10, 11], [N, N, 14, 15]]
    assert hit(full, tails, [0, 1, 2, 3]) == 4
    # full attention missing a block of chunk 2: nothing past chunk 1
    assert hit([full[0], full[1], [8, 9, 10, N], full[3]], tails, [0, 1, 2, 3]) == 2
    # sliding tail of chunk 3 missing: boundary 4 fails, 3 is fine
    assert hit(full, tails[:3] + [[12, 13, N, N]], [0, 1, 2, 3]) == 3
    # state after chunk 3 and 2 missing: boundary 2
    assert hit(full, tails, [0, 1, N, N]) == 2


def test_hybrid_partial_retrieve_reports_exact_group_block_pairs(ginclient, ranks):
    rank = ranks(*GROUPS)
    ginclient.register("h0", rank.layout())
    ks = keys(2)
    ginclient.store("h0", [chunk(ks[0], range(4), [N, N, 2, 3], [0])])
    out = ginclient.retrieve(
        "h0",
        [
            chunk(ks[0], range(40, 44), [50, 51, 52, 53], [N]),
            chunk(ks[1], range(44, 48), [N, N, 54, 55], [9]),
        ],
    )
    assert out.ok == [False, False]
    assert sorted(out.failed) == sorted(
        [(1, 50), (1, 51), (0, 44), (0, 45), (0, 46), (0, 47), (1, 54), (1, 55), (2, 9)]
    )
    # what was there still arrived
    np.testing.assert_array_equal(rank.kv[0][:, 40:44], rank.kv[0][:, 0:4])
    np.testing.assert_array_equal(rank.kv[1][:, 52:54], rank.kv[1][:, 2:4])
