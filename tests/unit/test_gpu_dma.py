"""The daemon's copy lanes' batched DMA (tierd.transfer.dma): a request's contiguous DMAs go as
one cuMemcpyBatchAsync, through either of the driver's signatures, and move exactly the bytes
one-by-one copies move, both ways, at scattered device addresses; a lane queues on its GPU's primary
context whatever context its thread has, and reuses its events once waited for; its signal to the
engine follows its copies."""

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tierd.transfer import dma  # noqa: E402
from tierd.transfer.cudriver import DRIVER  # noqa: E402

pytestmark = pytest.mark.gpu
FRAG = 40 << 10


def variants():
    lib = DRIVER.lib
    out = []
    for name, fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            out.append(pytest.param((fn, fail_index), id=name))
    return out or [pytest.param(None, marks=pytest.mark.skip("the driver has no batched copy"))]


@pytest.mark.parametrize("batch", variants())
def test_a_batch_moves_the_same_bytes_as_copies_one_by_one(batch, monkeypatch):
    assert DRIVER.ok
    monkeypatch.setattr(DRIVER, "batch", batch)
    n = 24
    dev = torch.randint(0, 256, (2 * n * FRAG,), dtype=torch.uint8, device="cuda")
    host = torch.zeros(n * FRAG, dtype=torch.uint8, pin_memory=True)
    slots = torch.randperm(2 * n, generator=torch.Generator().manual_seed(3))[:n].tolist()
    hosts = np.array([host.data_ptr() + i * FRAG for i in range(n)], dtype=np.int64)
    devs = np.array([dev.data_ptr() + s * FRAG for s in slots], dtype=np.int64)
    sizes = np.full(n, FRAG, dtype=np.int64)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    DRIVER.copies(hosts, devs, sizes, True, stream.cuda_stream, 0)  # device -> host
    stream.synchronize()
    want = torch.cat([dev[s * FRAG : (s + 1) * FRAG] for s in slots]).cpu()
    assert torch.equal(host, want)
    back = torch.zeros_like(dev)
    host[:FRAG].fill_(7)  # host -> device, with a changed first fragment
    DRIVER.copies(hosts, devs - dev.data_ptr() + back.data_ptr(), sizes, False, stream.cuda_stream, 0)
    stream.synchronize()
    for i, s in enumerate(slots):
        assert torch.equal(back[s * FRAG : (s + 1) * FRAG].cpu(), host[i * FRAG : (i + 1) * FRAG]), i


def test_a_lane_queues_on_its_gpus_context_whatever_is_current_and_reuses_its_events():
    from tierd.transfer.pinned import HostPinner

    lib = DRIVER.lib
    create = getattr(lib, "cuCtxCreate_v2", None)
    if create is None:
        pytest.skip("the driver has no cuCtxCreate_v2")
    lane = dma.DmaLane(torch, 0, HostPinner(), d2h=True)
    n = 8
    dev = torch.randint(0, 256, (2 * n * FRAG,), dtype=torch.uint8, device="cuda")
    host = torch.zeros(n * FRAG, dtype=torch.uint8, pin_memory=True)
    hosts = np.array([host.data_ptr() + i * FRAG for i in range(n)], dtype=np.int64)
    devs = np.array([dev.data_ptr() + (2 * i + 1) * FRAG for i in range(n)], dtype=np.int64)
    sizes = np.full(n, FRAG, dtype=np.int64)
    torch.cuda.synchronize()
    other, device = ctypes.c_void_p(), ctypes.c_int()
    assert lib.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert create(ctypes.byref(other), 0, device) == 0  # a context of its own, current on this thread
    try:
        work = lane.copy_spans(devs, hosts, sizes, dev)  # the lane's stream is in the primary context
        work.wait()
        first = list(lane._done)
        assert len(first) == 1  # the event after the copies, free again once waited for
        work = lane.copy_spans(devs, hosts, sizes, dev)
        assert lane._done == []  # ... and taken again
        work.wait()
        assert lane._done == first
    finally:
        lib.cuCtxDestroy_v2(other)
        lane.close()
    torch.cuda.synchronize()
    want = torch.cat([dev[(2 * i + 1) * FRAG : (2 * i + 2) * FRAG] for i in range(n)]).cpu()
    assert torch.equal(host, want)


def test_a_lanes_signal_completes_only_once_the_copies_queued_before_it_have():
    """The interprocess event a RETRIEVE's answer carries (the engine reads its blocks after it) is
    recorded on the lane's stream after its copies: held behind them, and one handle throughout."""
    from tierd.transfer.pinned import HostPinner

    assert DRIVER.ok
    lane = dma.DmaLane(torch, 0, HostPinner(), d2h=False)
    n = 8
    dev = torch.zeros(2 * n * FRAG, dtype=torch.uint8, device="cuda")
    host = torch.randint(0, 256, (n * FRAG,), dtype=torch.uint8).pin_memory()
    hosts = np.array([host.data_ptr() + i * FRAG for i in range(n)], dtype=np.int64)
    devs = np.array([dev.data_ptr() + (2 * i + 1) * FRAG for i in range(n)], dtype=np.int64)
    sizes = np.full(n, FRAG, dtype=np.int64)
    torch.cuda.synchronize()
    try:
        with torch.cuda.stream(lane.stream):
            torch.cuda._sleep(500_000_000)  # holds the lane's stream for a fraction of a second
        work = lane.copy_spans(devs, hosts, sizes, dev)
        handle = lane.signal()
        assert len(handle) == 64
        assert not DRIVER.query(lane._signal)  # behind the held copies
        work.wait()
        assert DRIVER.query(lane._signal)
        assert lane.signal() == handle  # one event, recorded again
    finally:
        lane.close()
    torch.cuda.synchronize()
    got = torch.cat([dev[(2 * i + 1) * FRAG : (2 * i + 2) * FRAG] for i in range(n)]).cpu()
    assert torch.equal(got, host)
