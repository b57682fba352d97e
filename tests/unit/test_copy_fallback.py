"""The pure-torch gather/scatter of the device data path, run on CPU tensors: byte-exact for every
layout vLLM 0.33 can hand us, with null blocks and more chunks than one staging slot holds. (The
GPU suite asserts the native kernel gives these same bytes.) Also: what block_span can and cannot
describe."""

import numpy as np
import pytest

from tierd_client import cuda_gather as gather

torch = pytest.importorskip("torch")

from kvlayouts import all_cases, check_objects, items_for, object_bytes, vllm_case  # noqa: E402

from tierd_client.layouts import UnsupportedLayout, block_span  # noqa: E402

CASES = all_cases(torch, "cpu")


def copy(fn, case, views, staging, n, desc, b):
    """One batch's gather or scatter: ids, item and position columns of the plan's descriptors."""
    cols = [desc[r, b.j0 : b.j1] for r in (0, 2, 3)]
    strides = case.group.object_strides(case.bpc * case.group.block_tokens)
    fn(views, staging, n, case.bpc, *cols, strides=strides)


def run_store(case, items, slot_bytes):
    views = gather.layer_views(case.group, [case.buf])
    plan = gather.make_plan(case.group, items, slot_bytes)
    desc = torch.from_numpy(plan.desc)
    staging = torch.zeros(slot_bytes, dtype=torch.uint8)
    for b in plan.batches:
        n = b.i1 - b.i0
        copy(gather.torch_gather, case, views, staging, n, desc, b)
        for k, it in enumerate(items[b.i0 : b.i1]):
            it.view[:] = staging[k * plan.obj : (k + 1) * plan.obj].numpy()
    return plan


def run_retrieve(case, items, slot_bytes, target):
    views = gather.layer_views(case.group, [target])
    plan = gather.make_plan(case.group, items, slot_bytes)
    desc = torch.from_numpy(plan.desc)
    staging = torch.zeros(slot_bytes, dtype=torch.uint8)
    for b in plan.batches:
        n = b.i1 - b.i0
        for k, it in enumerate(items[b.i0 : b.i1]):
            staging[k * plan.obj : (k + 1) * plan.obj] = torch.from_numpy(it.view)
        copy(gather.torch_scatter, case, views, staging, n, desc, b)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_torch_path_is_byte_exact_for_every_layout(case):
    obj = object_bytes(case)
    host = np.zeros(case.num_blocks // case.bpc * obj, dtype=np.uint8)
    items, ids = items_for(case, host)
    plan = run_store(case, items, slot_bytes=2 * obj)  # several batches
    assert len(plan.batches) > 1
    check_objects(case, items, ids)
    target = torch.zeros_like(case.buf)
    run_retrieve(case, items, 2 * obj, target)
    restored = gather.layer_views(case.group, [target])
    original = gather.layer_views(case.group, [case.buf])
    written = sorted(b for full in ids for b in full if b >= 0)
    for got, want in zip(restored, original):
        assert torch.equal(got[written], want[written])
        others = sorted(set(range(case.num_blocks)) - set(written))
        assert not got[others].any(), "a retrieve wrote blocks it was not given"


def test_vllm_layouts_register_without_copying_padding():
    """Block-contiguous layouts are one run per block; head-outer ones one run per head."""
    spans = {c.name: c.group.layers[0] for c in CASES}
    for name in ("LBNHC", "LBHNC", "BLHNC", "BLNHC", "MLA-LBNHC"):
        assert spans[name].runs == 1, name
    assert spans["LHBNC"].runs == 2 and spans["BHLNC"].runs == 2  # heads=2
    assert spans["LHBNC-r2"].runs == 2 and spans["BHLNC-r2"].runs == 4  # kernel blocks fold into runs
    assert spans["BLHNC-r2"].runs == 2
    assert spans["mamba-4100"].run_bytes == 4100 and spans["mamba-4100"].block_stride == 4608


def test_block_span_rejects_three_strided_levels():
    # head-outer layout (LHBNC) whose token rows are padded to 24 elements: heads, tokens and the
    # row are three strided levels, which {runs, run_stride, run_bytes} cannot describe
    buf = torch.zeros(2 * 8 * 4 * 24, dtype=torch.bfloat16).view(2, 8, 4, 24)  # [H][B][N][Cpad]
    view = buf[:, :, :, :16].permute(1, 0, 2, 3)  # logical [B, H, N, C]
    with pytest.raises(UnsupportedLayout, match="strided levels"):
        block_span(tuple(view.shape), tuple(view.stride()), 2, 0, tensor=0, offset=0)
    with pytest.raises(UnsupportedLayout, match="not a multiple"):
        block_span((10, 4), (4, 1), 2, 0, tensor=0, offset=0, blocks_per_block=3)


def test_block_span_reads_physical_order_from_strides():
    """A permuted view of a block-contiguous buffer is one run, whatever its logical order."""
    c = vllm_case(torch, "LBNHC", "cpu", heads=4, tokens=4, c=8)
    s = c.group.layers[0]
    assert (s.runs, s.run_bytes) == (1, 4 * 4 * 8 * 2)


def test_vector_width_follows_alignment():
    by = {c.name: c for c in CASES}
    assert gather.vector_width(by["LBNHC"].group, [0] * 3) == 16
    assert gather.vector_width(by["mamba-4100"].group, [0] * 3) == 4
    assert gather.vector_width(by["state-odd"].group, [0] * 3) == 1
    assert gather.vector_width(by["LBNHC"].group, [2, 0, 0]) == 2
