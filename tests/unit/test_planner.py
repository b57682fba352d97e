"""STORE and RETRIEVE planning as functions of (chunks, geometry, pool), without a daemon: every
result, presence mask, copy item and failed block id pinned exactly, for full, sliding, state
and combined-object layouts, nulls, partial objects, rejects and evictions."""

from __future__ import annotations

import numpy as np
import pytest
from planning import plan_store

from tierd.pool.pool import Pool
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import PageLayout
from tierd.protocol.messages import Chunk
from tierd.state.planner import Geometry, plan_retrieve

NULL = -1
NS = b"ns-planner-0"
BLOCK_BYTES = 256  # one layer's block
CHUNK = 16  # tokens per chunk: 4 blocks of 4 tokens


def layout(*groups: tuple[str, int, int], num_blocks: int = 64) -> PageLayout:
    """Groups as (kind, block_tokens, window); two layers each, one tensor per group."""
    tensors, gs = [], []
    for i, (kind, bt, window) in enumerate(groups):
        tensors.append(
            {"handle": {"kind": "shm", "path": f"/dev/shm/x{i}"}, "nbytes": 2 * num_blocks * BLOCK_BYTES}
        )
        layers = [
            {
                "tensor": i,
                "offset": li * num_blocks * BLOCK_BYTES,
                "block_stride": BLOCK_BYTES,
                "num_blocks": num_blocks,
                "run_bytes": BLOCK_BYTES,
            }
            for li in range(2)
        ]
        gs.append({"kind": kind, "block_tokens": bt, "window_tokens": window, "layers": layers})
    return PageLayout.from_wire(
        {
            "namespace": {"model": "m", "fingerprint": "f", "world_size": 1},
            "rank": 0,
            "chunk_tokens": CHUNK,
            "tensors": tensors,
            "groups": gs,
        }
    )


FULL = ("full", 4, 0)
SLIDE = ("sliding", 4, 6)
STATE = ("state", 16, 0)


@pytest.fixture
def pool():
    p = Pool(ceiling=8 << 20, initial=0, align=256, segment_bytes=8 << 20)
    yield p
    p.close()


def geo(*groups, separate=True) -> Geometry:
    return Geometry(layout(*groups), separate, NULL)


def chunk(i: int, *per_group) -> Chunk:
    return Chunk(b"key-%08d" % i, [list(ids) for ids in per_group])


def items(plan, group):
    return [(it.ids.tolist(), it.pos.tolist()) for it in plan.copies.get(group, [])]


def test_full_chunks_are_stored_with_full_masks_and_one_copy_item_each(pool):
    g = geo(FULL)
    plan = plan_store(g, [chunk(0, [4, 5, 6, 7]), chunk(1, [0, 1, 2, 3])], pool, NS, 0)
    assert plan.results == ["stored", "stored"]
    assert [o.mask for o in plan.objs] == [0b1111, 0b1111]
    assert items(plan, 0) == [([4, 5, 6, 7], [0, 1, 2, 3]), ([0, 1, 2, 3], [0, 1, 2, 3])]
    assert plan.nbytes == 2 * 2 * 4 * BLOCK_BYTES  # 2 chunks x 2 layers x 4 blocks
    assert all(not o.ready for o in plan.objs)  # visible only once committed


def test_nulls_make_partial_masks_and_an_all_null_chunk_is_empty(pool):
    g = geo(FULL, SLIDE)
    plan = plan_store(
        g, [chunk(0, [8, 9, 10, 11], [NULL, NULL, 20, 21]), chunk(1, [NULL] * 4, [NULL] * 4)], pool, NS, 0
    )
    assert plan.results == ["stored", "empty"]
    full, slide = plan.objs
    assert (full.mask, slide.mask) == (0b1111, 0b1100)
    assert items(plan, 1) == [([20, 21], [2, 3])]
    assert plan.nbytes == 2 * 4 * BLOCK_BYTES + 2 * 2 * BLOCK_BYTES


def test_combined_objects_hold_every_group_at_its_shift(pool):
    g = geo(FULL, SLIDE, STATE, separate=False)
    plan = plan_store(g, [chunk(0, [0, 1, 2, 3], [NULL, NULL, 6, 7], [9])], pool, NS, 0)
    (obj,) = plan.objs
    assert obj.span == {0: (0, 0), 1: (4, 2 * 4 * BLOCK_BYTES), 2: (8, 2 * 8 * BLOCK_BYTES)}
    assert obj.mask == 0b1_1100_1111
    assert items(plan, 2) == [([9], [0])]


def test_a_stored_chunk_exists_and_only_a_fuller_copy_replaces_it(pool):
    g = geo(SLIDE)
    first = plan_store(g, [chunk(0, [NULL, NULL, 2, 3])], pool, NS, 0)
    pool.commit(first.objs)
    again = plan_store(g, [chunk(0, [NULL, NULL, 12, 13]), chunk(0, [NULL, 11, NULL, NULL])], pool, NS, 0)
    assert again.results == ["exists", "exists"] and not again.objs  # same mask; a mask missing bits
    fuller = plan_store(g, [chunk(0, [10, 11, 12, 13])], pool, NS, 0)
    assert fuller.results == ["stored"] and fuller.objs[0].mask == 0b1111
    pool.commit(fuller.objs)
    assert pool.find_ready(NS, b"key-%08d" % 0, 0, 0) is fuller.objs[0]


def test_no_room_rejects_the_chunk_and_every_later_one_when_a_full_group_is_there(pool):
    small = Pool(
        ceiling=8 * 1024, initial=0, align=256, segment_bytes=8 * 1024
    )  # room for 4 objects of 2 KiB
    try:
        g = geo(FULL, SLIDE, separate=False)  # one 4 KiB object per chunk: 2 fit
        chunks = [chunk(i, [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], [NULL, NULL, 60, 61]) for i in range(5)]
        plan = plan_store(g, chunks, small, NS, 0)
        assert plan.results == ["stored", "stored", "rejected", "rejected", "rejected"]
        assert len(plan.objs) == 2  # a rejected chunk keeps none of its objects
        small.abort(plan.objs)
        assert small.objects == 0
        # state-only layouts go on past a rejected chunk (nothing needs the chunks before it)
        g = geo(STATE)
        plan = plan_store(g, [chunk(100 + i, [i]) for i in range(40)], small, NS, 0)
        assert "stored" in plan.results
    finally:
        small.close()


def test_retrieve_restores_what_is_held_and_fails_exactly_the_rest(pool):
    g = geo(FULL, SLIDE)
    stored = plan_store(g, [chunk(0, [0, 1, 2, 3], [NULL, NULL, 6, 7])], pool, NS, 0)
    pool.commit(stored.objs)
    plan = plan_retrieve(
        g, [chunk(0, [30, 31, 32, 33], [40, 41, 42, 43]), chunk(1, [50, 51, 52, 53], [NULL] * 4)], pool, NS, 0
    )
    assert plan.results == [False, False]
    assert plan.failed == [(1, 40), (1, 41), (0, 50), (0, 51), (0, 52), (0, 53)]
    assert items(plan, 0) == [([30, 31, 32, 33], [0, 1, 2, 3])]
    assert items(plan, 1) == [([42, 43], [2, 3])]  # the held blocks are still restored
    assert set(plan.objs) == set(stored.objs)


def test_retrieve_of_null_blocks_reads_nothing(pool):
    g = geo(FULL)
    plan = plan_retrieve(g, [chunk(0, [NULL] * 4)], pool, NS, 0)
    assert plan.results == [True] and not plan.objs and not plan.copies and not plan.failed


def test_evicted_objects_are_failed_not_restored(pool):
    g = geo(FULL)
    stored = plan_store(g, [chunk(0, [0, 1, 2, 3])], pool, NS, 0)
    pool.commit(stored.objs)
    assert pool.clear() == 1
    plan = plan_retrieve(g, [chunk(0, [4, 5, 6, 7])], pool, NS, 0)
    assert plan.results == [False] and plan.failed == [(0, 4), (0, 5), (0, 6), (0, 7)] and not plan.objs


@pytest.mark.parametrize(
    "bad, where",
    [
        ([chunk(0, [0, 1, 2, 3], [0])], "chunks[0].blocks: 2 groups, the layout has 1"),
        ([chunk(0, [0, 1, 2])], "chunks[0].blocks[0]: 3 block ids, the group has 4 per chunk"),
        ([chunk(0, [0, 1, 2, 3]), chunk(1, [0, 64, 2, 3])], "chunks[1].blocks[0][1]: block id 64"),
        ([chunk(0, [0, -2, 2, 3])], "chunks[0].blocks[0][1]: block id -2"),
    ],
)
def test_block_ids_are_checked_against_the_layout_before_anything_is_planned(pool, bad, where):
    g = geo(FULL)
    with pytest.raises(ProtocolError) as err:
        g.check(bad)
    assert err.value.code is ErrorCode.BAD_REQUEST and err.value.message.startswith(where)
    assert pool.objects == 0


def test_copy_items_view_the_objects_own_bytes(pool):
    g = geo(FULL, SLIDE, separate=False)
    plan = plan_store(g, [chunk(0, [0, 1, 2, 3], [4, 5, 6, 7])], pool, NS, 0)
    (obj,) = plan.objs
    full_item, slide_item = plan.copies[0][0], plan.copies[1][0]
    base = obj.view()
    assert np.shares_memory(full_item.view, base) and np.shares_memory(slide_item.view, base)
    assert full_item.view.nbytes == slide_item.view.nbytes == 2 * 4 * BLOCK_BYTES


def test_a_request_is_bounded_in_chunks_times_groups():
    from tierd.protocol import MAX_REQUEST_PARTS

    g = geo(FULL, SLIDE)
    ok = [chunk(i, [0, 1, 2, 3], [4, 5, 6, 7]) for i in range(MAX_REQUEST_PARTS // 2)]
    g.check(ok)
    with pytest.raises(ProtocolError) as err:
        g.check(ok + [chunk(0, [0, 1, 2, 3], [4, 5, 6, 7])])
    assert err.value.code is ErrorCode.BAD_REQUEST
    assert err.value.message == (
        f"chunks: {MAX_REQUEST_PARTS // 2 + 1} chunks x 2 groups is more than "
        f"{MAX_REQUEST_PARTS} parts in one request: split it (tierd_client does)"
    )


def test_every_chunk_after_a_rejected_one_is_rejected_and_none_before(pool):
    tight = Pool(ceiling=4 * 2048, initial=0, align=256, segment_bytes=4 * 2048)  # room for four objects
    try:
        g = geo(FULL)
        chunks = [chunk(i, [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3]) for i in range(8)]
        plan = plan_store(g, chunks, tight, NS, 0)
        assert plan.results == ["stored"] * 4 + ["rejected"] * 4
        assert len(plan.objs) == 4
    finally:
        tight.close()


def test_check_gives_each_groups_block_ids_as_one_array_of_chunks_by_blocks():
    g = geo(FULL, STATE)
    blocks = g.check([chunk(0, [0, 1, 2, 3], [9]), chunk(1, [NULL, 5, 6, 7], [NULL])])
    assert [a.tolist() for a in blocks] == [[[0, 1, 2, 3], [NULL, 5, 6, 7]], [[9], [NULL]]]
    assert [a.dtype for a in blocks] == [np.int64, np.int64]
    assert [a.shape for a in g.check([])] == [(0, 4), (0, 1)]


@pytest.mark.parametrize(
    "bad, where",
    [
        ([chunk(0, [0, 1, 2, 3]), chunk(1, [0, 1, 2])], "chunks[1].blocks[0]: 3 block ids"),
        ([chunk(0, [0, 1, 2, 3]), chunk(1, [0, 1, 2, 3, 4])], "chunks[1].blocks[0]: 5 block ids"),
        ([chunk(0, [0, 1, 2, 2**63])], f"chunks[0].blocks[0][3]: block id {2**63} is neither null"),
        ([chunk(0, [0, 1, 2, -(2**63) - 1])], "chunks[0].blocks[0][3]: block id"),
    ],
)
def test_ragged_or_out_of_range_block_ids_are_named_not_crashed_on(pool, bad, where):
    with pytest.raises(ProtocolError) as err:
        geo(FULL).check(bad)
    assert err.value.code is ErrorCode.BAD_REQUEST and err.value.message.startswith(where)


def test_whole_and_holed_chunks_of_one_store_keep_chunk_order_masks_and_items(pool):
    g = geo(FULL, SLIDE, separate=False)
    chunks = [
        chunk(0, [0, 1, 2, 3], [4, 5, 6, 7]),
        chunk(1, [8, 9, 10, 11], [NULL, NULL, 14, 15]),
        chunk(2, [16, 17, 18, 19], [20, 21, 22, 23]),
    ]
    plan = plan_store(g, chunks, pool, NS, 0, blocks=g.check(chunks))
    assert plan.results == ["stored"] * 3
    assert [o.mask for o in plan.objs] == [0b1111_1111, 0b1100_1111, 0b1111_1111]
    assert items(plan, 0) == [
        ([0, 1, 2, 3], [0, 1, 2, 3]),
        ([8, 9, 10, 11], [0, 1, 2, 3]),
        ([16, 17, 18, 19], [0, 1, 2, 3]),
    ]
    assert items(plan, 1) == [
        ([4, 5, 6, 7], [0, 1, 2, 3]),
        ([14, 15], [2, 3]),
        ([20, 21, 22, 23], [0, 1, 2, 3]),
    ]
    assert plan.nbytes == (3 + 2) * 2 * 4 * BLOCK_BYTES + 2 * 2 * BLOCK_BYTES  # 5 whole parts, 2 blocks
    # the same chunks planned without the caller's arrays plan the same
    pool.abort(plan.objs)
    again = plan_store(g, chunks, pool, NS, 0)
    assert [o.mask for o in again.objs] == [o.mask for o in plan.objs] and items(again, 1) == items(plan, 1)


def test_a_whole_chunk_whose_second_object_finds_no_room_keeps_neither():
    one = Pool(ceiling=2048, initial=0, align=256, segment_bytes=2048)  # room for one 2 KiB object
    try:
        g = geo(FULL, SLIDE)  # separate objects: 2 KiB each, two per chunk
        plan = plan_store(g, [chunk(0, [0, 1, 2, 3], [4, 5, 6, 7])], one, NS, 0)
        assert plan.results == ["rejected"] and not plan.objs and not plan.copies and plan.nbytes == 0
        assert one.objects == 0
    finally:
        one.close()


def test_retrieve_of_whole_and_holed_chunks_restores_each_exactly(pool):
    g = geo(FULL, SLIDE, separate=False)
    stored = [chunk(0, [0, 1, 2, 3], [4, 5, 6, 7]), chunk(1, [8, 9, 10, 11], [NULL, NULL, 14, 15])]
    pool.commit(plan_store(g, stored, pool, NS, 0).objs)
    want = [chunk(0, [30, 31, 32, 33], [34, 35, 36, 37]), chunk(1, [40, 41, 42, 43], [44, 45, 46, 47])]
    plan = plan_retrieve(g, want, pool, NS, 0, blocks=g.check(want))
    assert plan.results == [True, False] and plan.failed == [(1, 44), (1, 45)]
    assert items(plan, 0) == [([30, 31, 32, 33], [0, 1, 2, 3]), ([40, 41, 42, 43], [0, 1, 2, 3])]
    assert items(plan, 1) == [([34, 35, 36, 37], [0, 1, 2, 3]), ([46, 47], [2, 3])]


def test_a_key_twice_in_one_store_is_stored_once():
    p = Pool(ceiling=8 << 20, initial=0, align=256, segment_bytes=8 << 20)
    try:
        g = geo(FULL)
        plan = plan_store(
            g, [chunk(0, [0, 1, 2, 3]), chunk(0, [4, 5, 6, 7]), chunk(1, [8, 9, 10, 11])], p, NS, 0
        )
        assert plan.results == ["stored", "exists", "stored"]
        assert items(plan, 0) == [([0, 1, 2, 3], [0, 1, 2, 3]), ([8, 9, 10, 11], [0, 1, 2, 3])]
        assert p.objects == 2
    finally:
        p.close()


def test_without_a_full_group_chunks_after_a_rejected_one_are_still_tried():
    two = Pool(ceiling=2 * 2048, initial=0, align=256, segment_bytes=2 * 2048)  # room for two objects
    try:
        g = geo(SLIDE)
        in_flight = plan_store(g, [chunk(0, [0, 1, 2, 3]), chunk(1, [4, 5, 6, 7])], two, NS, 0)
        assert in_flight.results == ["stored", "stored"]  # pinned until committed: not evictable
        plan = plan_store(
            g, [chunk(0, [8, 9, 10, 11]), chunk(2, [12, 13, 14, 15]), chunk(1, [0, 1, 2, 3])], two, NS, 0
        )
        assert plan.results == ["exists", "rejected", "exists"] and not plan.objs
        assert two.objects == 2
    finally:
        two.close()


def test_a_null_block_id_of_zero_is_a_null_not_a_block(pool):
    """``--null-block-id 0`` (vLLM's own null block is id 0): ids equal to it are nulls in STORE and
    RETRIEVE, even though 0 is also a valid id of the layout and no id is negative."""
    g = Geometry(layout(FULL), True, 0)
    chunks = [chunk(0, [4, 5, 6, 7]), chunk(1, [0, 9, 10, 0]), chunk(2, [0, 0, 0, 0])]
    plan = plan_store(g, chunks, pool, NS, 0)
    assert plan.results == ["stored", "stored", "empty"]
    assert [o.mask for o in plan.objs] == [0b1111, 0b0110]
    assert items(plan, 0) == [([4, 5, 6, 7], [0, 1, 2, 3]), ([9, 10], [1, 2])]
    pool.commit(plan.objs)
    got = plan_retrieve(g, [chunk(0, [0, 12, 13, 14]), chunk(1, [20, 21, 22, 0])], pool, NS, 0)
    assert got.results == [True, False]
    assert items(got, 0) == [([12, 13, 14], [1, 2, 3]), ([21, 22], [1, 2])]
    assert got.failed == [(0, 20)]  # chunk 1's block 0 was a null when stored


def test_store_items_name_where_each_chunks_group_lies_in_staging(pool):
    """A staged (cuda) STORE: item ``k`` of group ``g`` copies from staging offset ``staged_at +
    k * chunk_bytes + group_offsets[g]``, for runs of whole chunks and chunks with nulls alike."""
    g = geo(FULL, SLIDE)
    assert (g.chunk_bytes, g.group_offsets) == (4096, [0, 2048])
    chunks = [
        chunk(0, [0, 1, 2, 3], [4, 5, 6, 7]),
        chunk(1, [8, 9, 10, 11], [12, 13, 14, 15]),
        chunk(2, [16, 17, 18, 19], [NULL, NULL, 22, 23]),
        chunk(3, [24, 25, 26, 27], [28, 29, 30, 31]),
    ]
    plan = plan_store(g, chunks, pool, NS, 0, staged_at=1000)
    assert plan.results == ["stored"] * 4
    for group in (0, 1):
        assert [it.staged for it in plan.copies[group]] == [1000 + 4096 * k + 2048 * group for k in range(4)]
    assert items(plan, 1)[2] == ([22, 23], [2, 3])
    unstaged = plan_store(g, [chunk(4, [0, 1, 2, 3], [4, 5, 6, 7])], pool, NS, 0)
    assert [it.staged for grp in (0, 1) for it in unstaged.copies[grp]] == [-1, -1]
