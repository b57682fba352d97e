"""The native gather/scatter kernel against the pure-torch fallback, on the GPU: identical bytes
for every layout vLLM 0.33 can register (six KVCacheLayouts, kernel blocks smaller than manager
blocks, MLA, mamba state pages, unaligned state sizes), with null blocks, more chunks than the
staging ring holds, and both directions."""

import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kvlayouts import all_cases, check_objects, items_for, object_bytes, vllm_case  # noqa: E402
from tierd.transfer import cuda as tcuda  # noqa: E402
from tierd.transfer import gather, native  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = 0
CASES = all_cases(torch, f"cuda:{DEV}")


@pytest.fixture(scope="module")
def mod():
    m = native.load(timeout=900)
    assert m is not None, native.state()
    return m


def store_and_retrieve(case, mod_or_none):
    """STORE every chunk of ``case`` into pinned host objects, then RETRIEVE them into a zeroed
    copy of the buffer; returns (host objects, items, ids, restored buffer)."""
    obj = object_bytes(case)
    host_t = torch.zeros(case.num_blocks // case.bpc * obj, dtype=torch.uint8, pin_memory=True)
    host = host_t.numpy()
    items, ids = items_for(case, host)
    with torch.cuda.device(DEV):
        lane = tcuda.Lane(torch, DEV, tcuda.HostPinner())
        lane.slot_bytes = obj  # one chunk per batch: 4 batches through a 3-slot ring
        g = tcuda.GroupCopy(case.group, [case.buf], torch, DEV)
        lane.store(g, items, mod_or_none).wait()
        target = torch.zeros_like(case.buf)
        g2 = tcuda.GroupCopy(case.group, [target], torch, DEV)
        lane.retrieve(g2, items, mod_or_none).wait()
        lane.close()
    return host_t, items, ids, target


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_and_fallback_copy_identical_bytes(case, mod):
    g = tcuda.GroupCopy(case.group, [case.buf], torch, DEV)
    assert g.kernel_ok
    k_host, k_items, ids, k_target = store_and_retrieve(case, mod)
    t_host, t_items, _, t_target = store_and_retrieve(case, None)
    check_objects(case, k_items, ids)  # the kernel's objects hold the engine's bytes
    check_objects(case, t_items, ids)  # and so do the fallback's
    assert torch.equal(k_target, t_target), "scatter: kernel and fallback restored different bytes"
    written = sorted(b for full in ids for b in full if b >= 0)
    for got, want in zip(gather.layer_views(case.group, [k_target]), gather.layer_views(case.group, [case.buf])):
        assert torch.equal(got[written], want[written])


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_overlapping_calls_share_the_staging_ring(mod, impl):
    """Calls return before their copies finish; queued back to back, each wraps the 3-slot ring
    (one chunk per slot), so a call's first gather waits for the previous call's DMAs."""
    m = mod if impl == "kernel" else None
    case = vllm_case(torch, "LHBNC", f"cuda:{DEV}", layers=4, blocks=64, heads=2, tokens=16, c=64, bpc=4)
    obj = object_bytes(case)
    host_t = torch.zeros(case.num_blocks // case.bpc * obj, dtype=torch.uint8, pin_memory=True)
    items, ids = items_for(case, host_t.numpy(), null_every=0)
    with torch.cuda.device(DEV):
        lane = tcuda.Lane(torch, DEV, tcuda.HostPinner())
        lane.slot_bytes = obj
        g = tcuda.GroupCopy(case.group, [case.buf], torch, DEV)
        tickets = [lane.store(g, items[i : i + 3], m) for i in range(0, len(items), 3)]
        for t in tickets:
            t.wait()
        check_objects(case, items, ids)
        target = torch.zeros_like(case.buf)
        g2 = tcuda.GroupCopy(case.group, [target], torch, DEV)
        tickets = [lane.retrieve(g2, items[i : i + 3], m) for i in range(0, len(items), 3)]
        for t in tickets:
            t.wait()
        lane.close()
    assert torch.equal(target, case.buf)
    assert lane.stats["calls"] == 2 * len(tickets)


def test_vector_widths_cover_every_path(mod):
    widths = {c.name: tcuda.GroupCopy(c.group, [c.buf], torch, DEV).vec for c in CASES}
    assert widths["LBNHC"] == 16 and widths["mamba-4100"] == 4 and widths["state-odd"] == 1


@pytest.mark.parametrize("kind", ["LBNHC", "LHBNC"])
def test_gather_kernel_at_llama_scale(kind, mod):
    """32 layers x 64 KiB blocks (Llama-3-8B, bf16, 16-token blocks): bytes exact, and the device
    side of a store (the gather alone) far faster than the PCIe link."""
    case = vllm_case(torch, kind, f"cuda:{DEV}", layers=32, blocks=256, heads=8, tokens=16, c=256, bpc=16)
    obj = object_bytes(case)
    host_t = torch.zeros(case.num_blocks // case.bpc * obj, dtype=torch.uint8, pin_memory=True)
    items, ids = items_for(case, host_t.numpy(), null_every=0)
    g = tcuda.GroupCopy(case.group, [case.buf], torch, DEV)
    plan = gather.make_plan(case.group, items, 1 << 40)
    desc = torch.from_numpy(plan.desc).to(DEV)
    staging = torch.empty(len(items) * obj, dtype=torch.uint8, device=DEV)
    s = torch.cuda.current_stream(DEV)

    def run():
        mod.gather(g.table.data_ptr(), g.layers, desc.data_ptr(), desc.data_ptr() + desc.stride(0) * 8, plan.jobs,
                   staging.data_ptr(), case.bpc * g.block_bytes, g.block_bytes, g.run_bytes, g.runs, g.vec,
                   torch.cuda.get_device_properties(DEV).multi_processor_count * 8, s.cuda_stream)

    run()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    gbps = 5 * staging.numel() / (time.perf_counter() - t) / 1e9
    print(f"\n{kind}: gather kernel {gbps:.0f} GB/s ({staging.numel() >> 20} MiB, vec {g.vec}, runs {g.runs})")
    host_t.copy_(staging.cpu())
    check_objects(case, items, ids)
    assert gbps > 200
