"""The engine-side gather/scatter (tierd_client.cuda_stage.Stager), native kernel against the
pure-torch fallback, on the GPU: identical bytes for every layout vLLM 0.33 can register (six
KVCacheLayouts, kernel blocks smaller than manager blocks, MLA, mamba state pages, unaligned
state sizes), with null blocks, staging offsets inside the buffer, and both directions."""

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kvlayouts import all_cases, check_objects, items_for, object_bytes, vllm_case  # noqa: E402

from tierd.protocol.layout import PageLayout  # noqa: E402
from tierd_client import native  # noqa: E402
from tierd_client.cuda_stage import Stager  # noqa: E402
from tierd_client.layouts import layout, namespace  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = 0
CASES = all_cases(torch, f"cuda:{DEV}")
OFFSET = 4096  # gather into the buffer at an offset, as requests do


@pytest.fixture(scope="module")
def mod():
    m = native.load(timeout=900)
    assert m is not None, native.state()
    return m


def page_layout(case, nbytes: int) -> PageLayout:
    g = case.group.to_wire()
    return PageLayout.from_wire(
        layout(
            namespace("k", "f"),
            0,
            case.bpc * g["block_tokens"] if g["kind"] != "state" else g["block_tokens"],
            [{"handle": {"kind": "shm", "path": "/dev/shm/x"}, "nbytes": nbytes}],
            [g],
        )
    )


def round_trip(case, impl):
    """Gather every chunk of ``case`` (some positions null) into staging, then scatter it into a
    zeroed copy of the buffer; returns (host objects, items, ids per chunk, restored buffer)."""
    obj = object_bytes(case)
    chunks = case.num_blocks // case.bpc
    host_t = torch.zeros(chunks * obj, dtype=torch.uint8)
    items, ids = items_for(case, host_t.numpy())
    lay = page_layout(case, case.buf.numel())
    stager = Stager(lay, [case.buf], OFFSET + chunks * obj, impl)
    assert stager.chunk_bytes == obj
    per_chunk = [[c] for c in ids]
    stager.gather(per_chunk, OFFSET)
    stager.stream.synchronize()
    host_t.copy_(stager.buf[OFFSET : OFFSET + chunks * obj].cpu())
    target = torch.zeros_like(case.buf)
    back = Stager(lay, [target], OFFSET + chunks * obj, impl)
    back.buf.copy_(stager.buf)
    torch.cuda.synchronize()  # the copy ran on the current stream, the scatter runs on the stager's
    back.scatter(per_chunk, OFFSET).synchronize()
    return host_t, items, ids, target


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_and_fallback_copy_identical_bytes(case, mod):
    k_host, k_items, ids, k_target = round_trip(case, "kernel")
    t_host, t_items, _, t_target = round_trip(case, "torch")
    check_objects(case, k_items, ids)  # the kernel's staging holds the engine's bytes
    check_objects(case, t_items, ids)  # and so does the fallback's
    assert torch.equal(k_target, t_target), "scatter: kernel and fallback restored different bytes"
    from tierd_client.cuda_gather import layer_views

    written = sorted(b for full in ids for b in full if b >= 0)
    for got, want in zip(layer_views(case.group, [k_target]), layer_views(case.group, [case.buf])):
        assert torch.equal(got[written], want[written])


def test_skipped_blocks_are_not_scattered(mod):
    """A RETRIEVE's failed blocks are skipped: their engine bytes stay what they were."""
    case = vllm_case(torch, "LBNHC", f"cuda:{DEV}", layers=2, blocks=8, bpc=2)
    lay = page_layout(case, case.buf.numel())
    stager = Stager(lay, [case.buf], 1 << 20, "kernel")
    stager.buf.fill_(0x5A)
    before = case.buf.clone()
    torch.cuda.synchronize()
    stager.scatter([[[0, 1]], [[2, 3]]], 0, skip={(0, 1), (0, 2)}).synchronize()
    from tierd_client.cuda_gather import layer_views

    for got, old in zip(layer_views(case.group, [case.buf]), layer_views(case.group, [before])):
        assert torch.equal(got[[1, 2]], old[[1, 2]])  # skipped: untouched
        assert not torch.equal(got[[0, 3]], old[[0, 3]])  # written from staging


@pytest.mark.parametrize("kind", ["LBNHC", "LHBNC"])
def test_gather_kernel_at_llama_scale(kind, mod):
    """32 layers x 64 KiB blocks (Llama-3-8B, bf16, 16-token blocks): bytes exact. The gather's
    rate is printed, not asserted (it is the machine's: 56 GB/s beside four vLLM engines on an
    H100, far more alone); tierd bench --device cuda measures it against raw copies."""
    case = vllm_case(torch, kind, f"cuda:{DEV}", layers=32, blocks=256, heads=8, tokens=16, c=256, bpc=16)
    obj = object_bytes(case)
    chunks = case.num_blocks // case.bpc
    lay = page_layout(case, case.buf.numel())
    stager = Stager(lay, [case.buf], chunks * obj, "kernel")
    host_t = torch.zeros(chunks * obj, dtype=torch.uint8)
    items, ids = items_for(case, host_t.numpy(), null_every=0)
    per_chunk = [[c] for c in ids]
    stager.gather(per_chunk, 0)
    stager.stream.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        stager.gather(per_chunk, 0)
    stager.stream.synchronize()
    gbps = 5 * chunks * obj / (time.perf_counter() - t) / 1e9
    print(f"\n{kind}: engine-side gather {gbps:.0f} GB/s ({chunks * obj >> 20} MiB)")
    host_t.copy_(stager.buf.cpu())
    check_objects(case, items, ids)
    assert np.count_nonzero(host_t.numpy()) > 0


def _scatter_setup(case, words: int = 0):
    """A stager over a zeroed copy of ``case``'s buffer with random staging bytes (``words``: its
    scatter descriptor ring that small), and a reference stager with the same staging."""
    from tierd_client.desc_ring import DescRing

    lay = page_layout(case, case.buf.numel())
    target, ref_target = torch.zeros_like(case.buf), torch.zeros_like(case.buf)
    stager, ref = Stager(lay, [target], 1 << 20, "kernel"), Stager(lay, [ref_target], 1 << 20, "kernel")
    stager.buf.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=stager.buf.device))
    ref.buf.copy_(stager.buf)
    if words:
        stager.rings[True] = DescRing(torch, stager.device, words=words)
    torch.cuda.synchronize()
    return stager, target, ref, ref_target


def _blocks(case, buf, ids):
    from tierd_client.cuda_gather import layer_views

    return [v[ids] for v in layer_views(case.group, [buf])]


def _same(case, a, b, ids) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_blocks(case, a, ids), _blocks(case, b, ids)))


@pytest.mark.parametrize("skip", [set(), {(0, 1), (0, 2)}], ids=["all", "skipped"])
def test_a_scatter_prepared_before_its_answer_restores_what_one_planned_at_the_answer_does(skip, mod):
    """A RETRIEVE's scatter is planned and its descriptors uploaded while the daemon copies; the
    answer then launches it. Same bytes as planning at the answer, and with failed blocks in the
    answer the prepared plan is set aside for one that skips them."""
    case = vllm_case(torch, "LBNHC", f"cuda:{DEV}", layers=2, blocks=16, bpc=2)
    stager, target, ref, ref_target = _scatter_setup(case)
    chunks = [[[5, 1]], [[2, 7]]]
    prepared = stager.prepare_scatter(chunks, 4096)
    assert prepared is not None and prepared.plans
    stager.scatter(chunks, 4096, skip=skip, prepared=prepared).synchronize()
    ref.scatter(chunks, 4096, skip=skip).synchronize()
    assert torch.equal(target, ref_target)
    assert not stager.rings[True].pinned  # its ring place is let go either way
    assert _same(case, target, ref_target, [5, 1, 2, 7]) and target.count_nonzero() > 0


def test_prepared_scatter_descriptors_outlive_uploads_that_wrap_the_ring(mod):
    """Descriptors uploaded ahead are read by a kernel queued later: uploads in between that wrap
    the ring must not overwrite them (stream order protects a region only up to its reader's
    launch). Control: with the pin let go at once, the wrap overwrites them and the prepared
    scatter writes another request's blocks."""
    case = vllm_case(torch, "LBNHC", f"cuda:{DEV}", layers=2, blocks=16, bpc=2)
    mine, others = [[[0, 1]], [[2, 3]]], [[[8, 9]], [[10, 11]]]
    for pinned in (True, False):
        stager, target, ref, ref_target = _scatter_setup(case, words=64)
        prepared = stager.prepare_scatter(mine, 0)
        if not pinned:
            for plan in prepared.plans:
                stager.rings[True].unpin(plan.desc)
        for _ in range(12):  # 8 words each: the ring of 64 wraps onto the prepared region
            stager.scatter(others, 8192)
        stager.scatter(mine, 0, prepared=prepared).synchronize()
        ref.scatter(mine, 0).synchronize()
        assert _same(case, target, ref_target, [0, 1, 2, 3]) is pinned, f"pinned={pinned}"
