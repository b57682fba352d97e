"""CUDA data path, daemon side: only DMA. The engine gathers its KV blocks into a staging buffer
on its own GPU (tierd_client.cuda_stage), in its own CUDA context and on its own stream; the
daemon moves whole objects between that staging buffer (opened over CUDA IPC) and its pinned
host pool with cudaMemcpyAsync on two copy streams per rank (one each way), and never launches a
kernel. Kernels of different processes time-slice on a GPU (no MPS): a gather launched from the
daemon's context holds a co-running engine's matmul off, where DMA from another process barely
slows it (docs/findings.md; ``tierd bench --device cuda --interference`` measures it; docs/protocol.md
section 20).

Staging layout: the chunks of one request lie back to back from the request's ``staged_at``
offset, each chunk its groups' parts in layout order (``[group][layer][block][run]``, the
combined object layout), so each object (or group part) is one contiguous DMA, and adjacent
objects merge.

Ordering. In host order (the engine's default) a STORE is sent once its gather is complete and
a RETRIEVE once the scatter that last read its staging bytes is; in device order each carries an
interprocess event the engine recorded on its staging stream after its last use of those bytes,
which the daemon's copy stream waits for on the GPU before the DMA. A STORE is answered once its
DMA is complete (a waiter thread per lane waits on an event, transfer/engine.py), so its staging
bytes may be reused as soon as the reply arrives; a RETRIEVE as soon as its DMA is queued, with
the daemon's interprocess event after it, which the engine's scatter waits for on the GPU (on
ROCm once the DMA is complete: below).

Direct ranks. A cuda layout without a staging buffer is copied straight between the engine's
KV blocks (its tensors opened over CUDA IPC) and the pool, with no SM work in either process:
each block of every layer of a group is one pitched (2D) copy of ``layers`` rows
(tierd.transfer.items.Pitched: every layer keeps a block in one run, the layers a constant pitch
apart, as vLLM 0.33's layer-outermost LBNHC/LBHNC KV is). Where a block's layers are one
contiguous span (block-outermost BLNHC/BLHNC: GroupLayout.block_major, objects laid out
``[block][layer]``), each block is one contiguous DMA, and a request's DMAs one batch. The
engine sends a STORE once the forward's writes are done and a RETRIEVE once the blocks may be
overwritten (both checked on its host); the daemon answers a RETRIEVE as soon as its copies are
queued, with the event the engine waits for before it reads the blocks. Block ids are checked
against the layout like any rank's, so a rank reaches only its own registered tensors.

ROCm. There an interprocess event cannot order two processes' work: HIP answers a query of one
as complete once it is recorded, whatever runs before it (ROCm/hip#3778), so the daemon neither
answers early with one nor waits for one of the engine's (``signals`` False: a RETRIEVE is answered
once its copies are complete, and a request that carries an event is refused before anything is
planned: tierd.core.handlers); the connector sends its requests in host order there.

Contexts. The daemon creates a CUDA context only on a GPU some engine registered: ``detect()``
counts devices (no context), and the pool's pinner defers ``cudaHostRegister`` until the first
rank registers. cudaHostRegister needs a current context; it runs on the first registered GPU
with ``cudaHostRegisterPortable``, so the pinned pages count as pinned for every context (all
64-bit CUDA is UVA), and later segments are pinned on that GPU as the pool grows.

Here: ``detect()`` and the CudaSupport the daemon holds, the engine's buffers opened over CUDA
IPC, and each rank's memory (staged or direct). Each direction's copy lane is tierd.transfer.dma;
the pool's pinning, tierd.transfer.pinned.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import weakref

from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import CudaIpcHandle, PageLayout, TensorRef
from tierd.transfer.dma import DmaLane
from tierd.transfer.engine import INLINE_ANY, INLINE_MAX_BYTES, DeviceWork
from tierd.transfer.items import (
    MAX_PITCH,
    CopyItem,
    events_order_processes,
    pitched,
    pitched_copies,
    span_copies,
)
from tierd.transfer.pinned import HostPinner

log = logging.getLogger("tierd.cuda")


def _driver_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def detect(settings=None):
    """A CudaSupport when a GPU is usable from this process, else None. Creates no context."""
    if not _driver_present():
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    return CudaSupport()


def _invalid(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.LAYOUT_INVALID, msg)


def _primary_contexts(count: int) -> list[int]:
    """Devices whose primary context exists in this process (driver API; creates none)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            return []
        out = []
        for i in range(count):
            dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
            if (
                lib.cuDeviceGet(ctypes.byref(dev), i) == 0
                and lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
                and active.value
            ):
                out.append(i)
        return out
    except OSError:
        return []


# ---- the support object the daemon holds -------------------------------------------------------------
class CudaSupport:
    def __init__(self):
        import torch

        self.torch = torch
        # whether a RETRIEVE may be answered once queued, with an event (False on ROCm: module doc)
        self.interprocess_events = events_order_processes(torch)
        self.host = HostPinner()
        self.count = torch.cuda.device_count()
        self._uuids: dict[str, int] | None = None
        self.devices_open: set[int] = set()
        self.memories: weakref.WeakSet = weakref.WeakSet()

    def pinner(self) -> HostPinner:
        return self.host

    @property
    def pinned_bytes(self) -> int:
        return self.host.pinned_bytes

    def device_of(self, uuid: str) -> int | None:
        if self._uuids is None:
            self._uuids = {str(self.torch.cuda.get_device_properties(i).uuid): i for i in range(self.count)}
        return self._uuids.get(uuid)

    def open_device(self, index: int) -> None:
        """First use of a GPU: its context comes up here, and the pool is pinned on it."""
        if index in self.devices_open:
            return
        with self.torch.cuda.device(index):
            self.torch.cuda.current_stream(index)
        self.host.activate(index)
        self.devices_open.add(index)
        log.info("CUDA device %d opened (%s)", index, self.torch.cuda.get_device_name(index))

    def rank_memory(self, layout: PageLayout) -> StagedRankMemory | DirectRankMemory:
        """Through the engine's staging buffer when the layout names one, else straight between
        its KV tensors and the pool (module doc)."""
        direct = layout.staging is None
        memory = DirectRankMemory(layout, self) if direct else StagedRankMemory(layout, self)
        self.memories.add(memory)
        return memory

    def lane_stats(self) -> dict:
        out: dict = {}
        for memory in list(self.memories):
            for name, lane in (("store", memory.d2h), ("retrieve", memory.h2d)):
                acc = out.setdefault(name, {})
                for k, v in lane.stats.items():
                    acc[k] = round(acc.get(k, 0) + v, 6)
        return out

    def status(self) -> dict:
        return {
            "devices": self.count,
            "devices_open": sorted(self.devices_open),
            "contexts": _primary_contexts(self.count),
            "pinned_bytes": self.host.pinned_bytes,
            "pin_pending_bytes": sum(self.host.pending.values()),
            "pin_failed_bytes": self.host.failed_bytes,
            "interprocess_events": self.interprocess_events,
            "lanes": self.lane_stats(),
        }


# ---- opening the engine's tensors -----------------------------------------------------------------------


def open_ipc(ref: TensorRef, where: str, support: CudaSupport):
    """Reopen one ``{"kind": "cuda_ipc"}`` handle on the GPU with the same UUID: (storage, device)."""
    torch = support.torch
    h = ref.handle
    if not isinstance(h, CudaIpcHandle):
        raise _invalid(f"{where}: a cuda layout needs cuda_ipc tensor handles, got a {type(h).__name__}")
    uuid = h.device_uuid
    _, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = h.ipc
    if size < ref.nbytes or size <= 0 or offset < 0 or rc_offset < 0 or len(handle) > 4096:
        raise _invalid(f"{where}: the shared storage has {size} bytes, the layout declares {ref.nbytes}")
    device = support.device_of(uuid)
    if device is None:
        raise _invalid(f"{where}: GPU {uuid} is not visible to the daemon (CUDA_VISIBLE_DEVICES?)")
    support.open_device(device)
    try:
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(
                device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync
            )
    except (RuntimeError, TypeError, ValueError, OSError) as exc:
        raise _invalid(
            f"{where}: cannot open the CUDA IPC handle: {str(exc).splitlines()[0][:300]}"
        ) from None
    if storage.nbytes() < ref.nbytes:
        raise _invalid(
            f"{where}: the opened storage has {storage.nbytes()} bytes, the layout declares {ref.nbytes}"
        )
    return storage, device


def lanes_after_open(torch, device: int, host) -> tuple[DmaLane, DmaLane]:
    """A rank's two copy lanes (device -> pool, pool -> device) on ``device``, whose first copies
    follow what the engine had queued on its memory when it shared it. torch's opening of a CUDA
    IPC handle makes this thread's current stream wait for the sharing process's event (recorded on
    its current stream as it shared: torch's own fence for IPC memory), but the lanes copy on
    streams of their own, which do not wait for that one: a restore's DMA could otherwise land
    before the engine's own fill of the KV tensors it had just allocated (vLLM allocates them
    zeroed) and be overwritten by it. Call it right after the handles were opened, on that thread."""
    with torch.cuda.device(device):
        opened = torch.cuda.Event()
        opened.record(torch.cuda.current_stream(device))
        out = DmaLane(torch, device, host, d2h=True), DmaLane(torch, device, host, d2h=False)
        for lane in out:
            lane.stream.wait_event(opened)
    return out


class StagedRankMemory:
    """One registered rank's GPU: its staging buffer opened over IPC, and a DMA lane each way.
    The daemon never maps the rank's KV tensors themselves: only the engine touches its blocks."""

    duplex = True  # stores and retrieves run on separate transfer threads
    inline = INLINE_ANY  # its copies only queue DMAs: run on the main loop when idle (transfer/engine.py)

    def __init__(self, layout: PageLayout, support: CudaSupport):
        if layout.staging is None:
            raise _invalid(
                "a cuda layout needs a staging buffer (layout.staging): the engine gathers its blocks "
                "there (tierd_client.cuda_stage) and the daemon only copies whole objects"
            )
        torch = support.torch
        self.torch, self.layout = torch, layout
        self.storage, self.device = open_ipc(layout.staging, "layout.staging", support)
        with torch.cuda.device(self.device):
            self.staging = torch.empty(0, dtype=torch.uint8, device=self.device).set_(
                self.storage, 0, (layout.staging.nbytes,), (1,)
            )
        self.d2h, self.h2d = lanes_after_open(torch, self.device, support.host)
        self.signals = support.interprocess_events  # a RETRIEVE may be answered early, with ``signal()``

    def wait_event(self, handle: bytes, store: bool = True) -> None:
        with self.torch.cuda.device(self.device):
            (self.d2h if store else self.h2d).wait(handle)

    def store(self, group: int, items: list[CopyItem]) -> DeviceWork | None:
        """Queue the DMAs staging -> pool; the DeviceWork finishes when the bytes are in the pool."""
        if not items:
            return None
        return self.d2h.copy(self.staging, items)  # (a lane makes its GPU current itself)

    def retrieve(self, group: int, items: list[CopyItem]) -> DeviceWork | None:
        """Queue the DMAs pool -> staging; the DeviceWork finishes when the bytes are in staging."""
        if not items:
            return None
        return self.h2d.copy(self.staging, items)

    def signal(self) -> bytes:
        """The event the engine's scatter waits for (on the GPU): after every retrieve DMA queued so far."""
        return self.h2d.signal()

    def close(self) -> None:
        with self.torch.cuda.device(self.device):
            self.d2h.close()
            self.h2d.close()
        self.staging = None
        self.storage = None  # drops the IPC mapping (torch closes it with the last reference)


class DirectRankMemory:
    """One registered rank's GPU without staging: its KV tensors opened over IPC, and a copy lane
    each way that moves blocks straight between them and the pool as pitched copies (module doc).
    Only copy-engine work, so its lanes run on the main loop when idle (tierd.transfer.engine)."""

    duplex = True  # stores and retrieves run on separate transfer threads
    inline = INLINE_MAX_BYTES  # its copies only queue DMAs, one per block

    def __init__(self, layout: PageLayout, support: CudaSupport):
        torch = support.torch
        self.torch, self.layout = torch, layout
        opened = [open_ipc(ref, f"layout.tensors[{i}]", support) for i, ref in enumerate(layout.tensors)]
        devices = {device for _, device in opened}
        if len(devices) != 1:
            raise _invalid(f"a rank's tensors lie on one GPU, these on {len(devices)}")
        self.device = devices.pop()
        self.storages = [storage for storage, _ in opened]
        with torch.cuda.device(self.device):
            self.flats = [
                torch.empty(0, dtype=torch.uint8, device=self.device).set_(st, 0, (ref.nbytes,), (1,))
                for st, ref in zip(self.storages, layout.tensors)
            ]
        self.d2h, self.h2d = lanes_after_open(torch, self.device, support.host)
        self.signals = support.interprocess_events  # a RETRIEVE may be answered early, with ``signal()``
        self.groups = []
        for gi, group in enumerate(layout.groups):
            tensors = {s.tensor for s in group.layers}
            flat = self.flats[group.layers[0].tensor]
            p = pitched(group, [flat.data_ptr() + s.offset for s in group.layers])
            if len(tensors) != 1 or p is None:
                raise _invalid(
                    f"layout.groups[{gi}]: without a staging buffer every layer of a group must keep a "
                    "block in one run, the layers in one tensor a constant pitch apart (at most "
                    f"{MAX_PITCH} bytes); register a staging buffer for this layout instead"
                )
            self.groups.append((p, flat, group.block_major))

    def wait_event(self, handle: bytes, store: bool = True) -> None:
        with self.torch.cuda.device(self.device):
            (self.d2h if store else self.h2d).wait(handle)

    def _copy(self, lane: DmaLane, group: int, items: list[CopyItem]) -> DeviceWork | None:
        if not items:
            return None
        p, flat, block_major = self.groups[group]
        if block_major:  # a block of every layer is one span on both sides
            devs, hosts, sizes = span_copies(p, items)
            if not len(sizes):
                return None
            return lane.copy_spans(devs, hosts, sizes, flat)  # (a lane makes its GPU current itself)
        ops = []
        for it in items:
            ops += pitched_copies(p, it.view.ctypes.data, it.ids, it.pos)
        return lane.copy_pitched(ops, p.layers, p.pitch, items[0].bpc * p.block_bytes, flat)

    def store(self, group: int, items: list[CopyItem]) -> DeviceWork | None:
        """Queue the copies engine blocks -> pool; the DeviceWork finishes when the bytes are in the pool."""
        return self._copy(self.d2h, group, items)

    def retrieve(self, group: int, items: list[CopyItem]) -> DeviceWork | None:
        """Queue the copies pool -> engine blocks; the DeviceWork finishes when the blocks are written."""
        return self._copy(self.h2d, group, items)

    def signal(self) -> bytes:
        """The event the engine waits for (on the GPU or its host) before it reads restored blocks."""
        return self.h2d.signal()

    def close(self) -> None:
        with self.torch.cuda.device(self.device):
            self.d2h.close()
            self.h2d.close()
        self.flats = []
        self.storages = []  # drops the IPC mappings
