"""Page layouts and the client's layout builder: validation of what REGISTER accepts, block
geometry per group kind (which blocks a hit of b chunks needs), and block_span's description of
strided tensors."""

import pytest

from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import GroupKind, GroupSpec, PageLayout
from tierd_client.layouts import UnsupportedLayout, block_span, group, layout, namespace


def base(num_blocks=8, block_bytes=256, layers=2, chunk=16, kind="full", **gkw):
    nbytes = layers * num_blocks * block_bytes
    spans = [
        block_span(
            (num_blocks, block_bytes), (block_bytes, 1), 1, 0, tensor=0, offset=l * num_blocks * block_bytes
        )
        for l in range(layers)
    ]
    return layout(
        namespace("m", "fp"),
        0,
        chunk,
        [{"handle": {"kind": "shm", "path": "/dev/shm/x"}, "nbytes": nbytes}],
        [group(kind, 4, spans, **gkw)],
    )


def code_of(lay):
    with pytest.raises(ProtocolError) as err:
        PageLayout.from_wire(lay)
    return err.value.code


def test_good_layout_round_trips_the_wire():
    lay = PageLayout.from_wire(base())
    assert PageLayout.from_wire(lay.to_wire()) == lay
    g = lay.groups[0]
    assert g.block_bytes == 256 and g.num_blocks == 8 and g.object_bytes(16) == 2 * 4 * 256


def test_blocks_must_stay_inside_their_tensor():
    lay = base()
    lay["groups"][0]["layers"][1]["num_blocks"] = 9
    assert code_of(lay) is ErrorCode.LAYOUT_INVALID
    lay = base()
    lay["tensors"][0]["nbytes"] -= 1
    assert code_of(lay) is ErrorCode.LAYOUT_INVALID
    lay = base()
    lay["groups"][0]["layers"][0]["tensor"] = 1
    assert code_of(lay) is ErrorCode.LAYOUT_INVALID


def test_geometry_errors():
    assert code_of(base(chunk=18)) is ErrorCode.LAYOUT_INVALID
    lay = base()
    lay["groups"][0]["layers"][0].update(runs=2, run_stride=100)  # runs of 256 bytes every 100
    assert code_of(lay) is ErrorCode.LAYOUT_INVALID
    lay = base()
    lay["groups"][0]["layers"][0]["run_bytes"] = 128
    assert code_of(lay) is ErrorCode.LAYOUT_INVALID
    assert code_of(base(kind="sliding")) is ErrorCode.BAD_REQUEST  # no window
    assert code_of(base(kind="paged")) is ErrorCode.BAD_REQUEST
    lay = base()
    lay["rank"] = 1
    assert code_of(lay) is ErrorCode.BAD_REQUEST
    lay = base()
    lay["namespace"]["world_size"] = 0
    assert code_of(lay) is ErrorCode.BAD_REQUEST


def test_state_groups_need_chunks_that_end_on_a_state_block():
    """Regression: the daemon accepted a state group whose blocks do not divide the chunk (the
    connector refused it). A chunk's state is the state at the chunk's end, which an engine keeps
    only at block ends: a chunk of 18 tokens over 4-token state blocks has none to store."""
    assert code_of(base(kind="state", chunk=18)) is ErrorCode.LAYOUT_INVALID
    lay = base(kind="state", chunk=16)
    assert PageLayout.from_wire(lay).groups[0].spec.blocks_per_chunk(16) == 1


def test_needed_masks():
    full = GroupSpec(GroupKind.FULL, 4)
    state = GroupSpec(GroupKind.STATE, 16)
    slide = GroupSpec(GroupKind.SLIDING, 4, window_tokens=8)
    assert [full.needed_mask(j, 3, 16) for j in range(4)] == [0b1111, 0b1111, 0b1111, 0]
    assert [state.needed_mask(j, 3, 16) for j in range(4)] == [0, 0, 1, 0]
    # window 8 at boundary 3 (token 48): tokens 41..47 -> blocks 2 and 3 of chunk 2
    assert [slide.needed_mask(j, 3, 16) for j in range(4)] == [0, 0, 0b1100, 0]
    wide = GroupSpec(GroupKind.SLIDING, 4, window_tokens=20)  # tokens 29..47
    assert [wide.needed_mask(j, 3, 16) for j in range(4)] == [0, 0b1000, 0b1111, 0]
    assert wide.lookback_chunks(16) == 3 and slide.lookback_chunks(16) == 2 and state.lookback_chunks(16) == 1
    one = GroupSpec(GroupKind.SLIDING, 4, window_tokens=1)  # only the next token itself
    assert [one.needed_mask(j, 2, 16) for j in range(2)] == [0, 0]


def test_block_span_contiguous_blocks():
    span = block_span((10, 16, 8), (128, 8, 1), 2, 0, tensor=3, offset=64)
    assert span == {
        "tensor": 3,
        "offset": 64,
        "block_stride": 256,
        "num_blocks": 10,
        "runs": 1,
        "run_stride": 0,
        "run_bytes": 256,
    }


def test_block_span_head_outer_is_runs():
    # [heads=4, blocks=10, tokens*dim=32] elements of 2 bytes, block index in dim 1
    span = block_span((4, 10, 32), (320, 32, 1), 2, 1, tensor=0, offset=0)
    assert (span["runs"], span["run_stride"], span["run_bytes"], span["block_stride"]) == (4, 640, 64, 64)


def test_block_span_kernel_blocks():
    # 12 kernel blocks of 64 bytes; a manager block is 3 of them
    span = block_span((12, 64), (64, 1), 1, 0, tensor=0, offset=0, blocks_per_block=3)
    assert (span["num_blocks"], span["block_stride"], span["run_bytes"], span["runs"]) == (4, 192, 192, 1)
    with pytest.raises(UnsupportedLayout):
        block_span((10, 64), (64, 1), 1, 0, tensor=0, offset=0, blocks_per_block=3)


def test_block_span_refuses_three_level_blocks():
    # [blocks, 2 (K/V), heads=3 (strided), 8]: K/V and heads not mergeable into one stride
    with pytest.raises(UnsupportedLayout):
        block_span((5, 2, 3, 8), (100, 40, 10, 1), 1, 0, tensor=0, offset=0)
