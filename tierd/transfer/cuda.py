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

Ordering. A STORE or RETRIEVE carries an interprocess event the engine recorded on its staging
stream after its last use of those staging bytes (the gather, or the scatter of an earlier
load): the daemon's copy stream waits for it on the GPU before the DMA. The reply is sent once
the DMA is complete (a waiter thread per lane waits on an event, transfer/engine.py), so a
STORE's staging bytes may be reused, and a RETRIEVE's scattered, as soon as its reply arrives.

Direct ranks. A cuda layout without a staging buffer is copied straight between the engine's
KV blocks (its tensors opened over CUDA IPC) and the pool, with no SM work in either process:
each block of every layer of a group is one pitched (2D) copy of ``layers`` rows
(tierd.transfer.items.Pitched: every layer keeps a block in one run, the layers a constant pitch
apart, as vLLM 0.33's layer-outermost LBNHC/LBHNC and block-outermost BLNHC/BLHNC KV are). The
engine sends a STORE once the forward's writes are done and a RETRIEVE once the blocks may be
overwritten (both checked on its host); the daemon answers a RETRIEVE as soon as its copies are
queued, with the event the engine waits for before it reads the blocks. Block ids are checked
against the layout like any rank's, so a rank reaches only its own registered tensors.

Contexts. The daemon creates a CUDA context only on a GPU some engine registered: ``detect()``
counts devices (no context), and the pool's pinner defers ``cudaHostRegister`` until the first
rank registers. cudaHostRegister needs a current context; it runs on the first registered GPU
with ``cudaHostRegisterPortable``, so the pinned pages count as pinned for every context (all
64-bit CUDA is UVA), and later segments are pinned on that GPU as the pool grows.
"""

from __future__ import annotations

import bisect
import ctypes
import glob
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict

from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import CudaIpcHandle, PageLayout, TensorRef
from tierd.transfer.engine import DeviceWork
from tierd.transfer.items import MAX_PITCH, CopyItem, pitched, pitched_copies

log = logging.getLogger("tierd.cuda")

MAX_EVENTS = 256  # engine events opened per rank, least recently used closed first


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


# ---- pinned pool ----------------------------------------------------------------------------------
class HostPinner:
    """cudaHostRegister per pool segment, deferred until a GPU is in use (see module doc)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.device: int | None = None
        self.pending: dict[int, int] = {}
        self.ranges: dict[int, int] = {}  # addr -> nbytes, registered
        self._starts: list[int] = []
        self.pinned_bytes = 0
        self.failed_bytes = 0

    def pin(self, addr: int, nbytes: int) -> None:
        with self.lock:
            if self.device is None:
                self.pending[addr] = nbytes
            else:
                self._register(addr, nbytes)

    def unpin(self, addr: int) -> None:
        import torch

        with self.lock:
            if self.pending.pop(addr, None) is not None:
                return
            nbytes = self.ranges.pop(addr, None)
            if nbytes is None:
                return
            self._starts.remove(addr)
            self.pinned_bytes -= nbytes
            with torch.cuda.device(self.device):
                err = torch.cuda.cudart().cudaHostUnregister(addr)
            if int(err) != 0:
                log.warning("cudaHostUnregister(%#x) failed: error %d", addr, int(err))

    def activate(self, device: int) -> None:
        """Pin every deferred segment with ``device`` current; later ones are pinned at once."""
        with self.lock:
            if self.device is not None:
                return
            self.device = device
            pending, self.pending = self.pending, {}
            for addr, nbytes in pending.items():
                self._register(addr, nbytes)

    def _register(self, addr: int, nbytes: int) -> None:
        import torch

        with torch.cuda.device(self.device):
            err = torch.cuda.cudart().cudaHostRegister(addr, nbytes, 1)  # cudaHostRegisterPortable
        if int(err) != 0:
            self.failed_bytes += nbytes
            log.warning(
                "cudaHostRegister of %d MiB failed (error %d): copies to it run unpinned",
                nbytes >> 20,
                int(err),
            )
            return
        self.ranges[addr] = nbytes
        bisect.insort(self._starts, addr)
        self.pinned_bytes += nbytes

    def range_of(self, addr: int) -> int | None:
        """Start of the pinned registration holding ``addr`` (None: not pinned)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            start = self._starts[i]
            if addr < start + self.ranges[start]:
                return start
        return None

    def same_range(self, a: int, b: int) -> bool:
        return self.range_of(a) == self.range_of(b)


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


class DmaLane:
    """One direction of one rank: a copy stream, and the engine's events it waits on."""

    def __init__(self, torch, device: int, pinner: HostPinner, d2h: bool):
        self.torch, self.device, self.pinner, self.d2h = torch, device, pinner, d2h
        self.stream = torch.cuda.Stream(device=device)
        self._events: OrderedDict[bytes, object] = OrderedDict()
        self.stats = {"calls": 0, "bytes": 0, "dmas": 0, "host_s": 0.0, "sync_s": 0.0}
        self._signal = None  # interprocess event the engine's stream waits on (RETRIEVE)
        self._signal_handle = b""

    def signal(self) -> bytes:
        """Record an interprocess event after everything queued on this lane; its 64-byte handle."""
        if self._signal is None:
            self._signal = self.torch.cuda.Event(interprocess=True)
        self._signal.record(self.stream)
        if not self._signal_handle:
            self._signal_handle = bytes(self._signal.ipc_handle())
        return self._signal_handle

    def wait(self, handle: bytes) -> None:
        """The next copies wait (on the GPU) for the engine's interprocess event ``handle``."""
        torch = self.torch
        ev = self._events.get(handle)
        if ev is None:
            ev = torch.cuda.Event.from_ipc_handle(torch.device("cuda", self.device), handle)
            self._events[handle] = ev
            while len(self._events) > MAX_EVENTS:
                self._events.popitem(last=False)
        else:
            self._events.move_to_end(handle)
        self.stream.wait_event(ev)

    def copy(self, staging, items: list[CopyItem]) -> DeviceWork:
        """Each item's whole group part between the pool and ``staging`` at ``item.staged``."""
        torch = self.torch
        t0 = time.perf_counter()
        base = staging.data_ptr()
        hosts = [it.view.ctypes.data for it in items]
        devs = [base + it.staged for it in items]
        sizes = [it.view.nbytes for it in items]
        runs = _coalesce(hosts, devs, sizes, self.pinner.same_range)
        stream = self.stream.cuda_stream
        if _DRIVER.ok:
            _DRIVER.current(self.device)
            for h, d, n in runs:
                _DRIVER.copy(h, d, n, self.d2h, stream)
        else:  # torch's own path: the same DMA, more Python per copy
            with torch.cuda.stream(self.stream):
                for h, d, n in runs:
                    host = torch.from_numpy(_host_bytes(h, n))
                    dev = staging[d - base : d - base + n]
                    (host.copy_(dev, non_blocking=True) if self.d2h else dev.copy_(host, non_blocking=True))
        return self._queued(sum(sizes), len(runs), t0)

    def copy_pitched(
        self, ops: list[tuple[int, int, int]], rows: int, dev_pitch: int, host_pitch: int, tensor
    ) -> DeviceWork:
        """Pitched copies ``(device address, host address, row bytes)`` of ``rows`` rows each,
        device rows ``dev_pitch`` apart, host rows ``host_pitch`` (tierd.transfer.items.Pitched);
        every device address lies in ``tensor`` (flat uint8)."""
        t0 = time.perf_counter()
        stream = self.stream.cuda_stream
        if _DRIVER.ok:
            _DRIVER.current(self.device)
            for d, h, w in ops:
                _DRIVER.copy2d(h, host_pitch, d, dev_pitch, w, rows, self.d2h, stream)
        else:  # torch's own path (ROCm, no libcuda): strided views, the same bytes
            torch = self.torch
            with torch.cuda.stream(self.stream):
                for d, h, w in ops:
                    host = torch.from_numpy(_host_bytes(h, (rows - 1) * host_pitch + w))
                    host = host.as_strided((rows, w), (host_pitch, 1))
                    dev = tensor.as_strided((rows, w), (dev_pitch, 1), d - tensor.data_ptr())
                    (host.copy_(dev, non_blocking=True) if self.d2h else dev.copy_(host, non_blocking=True))
        return self._queued(sum(w for _, _, w in ops) * rows, len(ops), t0)

    def _queued(self, nbytes: int, dmas: int, t0: float) -> DeviceWork:
        done = self.torch.cuda.Event()
        done.record(self.stream)
        st = self.stats
        st["calls"] += 1
        st["bytes"] += nbytes
        st["dmas"] += dmas
        st["host_s"] += time.perf_counter() - t0

        def wait() -> None:
            t = time.perf_counter()
            done.synchronize()
            st["sync_s"] += time.perf_counter() - t

        return DeviceWork([wait])

    def close(self) -> None:
        self.stream.synchronize()
        self._events.clear()


_MEM_HOST, _MEM_DEVICE = 1, 2  # CUmemorytype


class _Memcpy2D(ctypes.Structure):
    """The driver's CUDA_MEMCPY2D."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


class _Driver:
    """cuMemcpyAsync through the driver API (libcuda is there wherever a GPU is): a few
    microseconds per DMA from Python, where torch's copy_ costs tens. Unified addressing: one call
    for either direction; the thread's current context is the one torch made current."""

    def __init__(self):
        self.ok = False
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
            self.fn = self.lib.cuMemcpyAsync
            self.fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
            self.fn.restype = ctypes.c_int
            self.fn2d = self.lib.cuMemcpy2DAsync_v2
            self.fn2d.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
            self.fn2d.restype = ctypes.c_int
            self.ok = True
        except (OSError, AttributeError):
            pass

    def current(self, device: int) -> None:
        """Make ``device``'s primary context current on this thread if no context is."""
        ctx = ctypes.c_void_p()
        if self.lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
            return
        dev = ctypes.c_int()
        if self.lib.cuDeviceGet(ctypes.byref(dev), device) != 0:
            raise RuntimeError(f"cuDeviceGet({device}) failed")
        if (
            self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0
            or self.lib.cuCtxSetCurrent(ctx) != 0
        ):
            raise RuntimeError(f"cannot make GPU {device}'s primary context current")

    def copy(self, host: int, dev: int, nbytes: int, d2h: bool, stream: int) -> None:
        err = self.fn(host, dev, nbytes, stream) if d2h else self.fn(dev, host, nbytes, stream)
        if err:
            raise RuntimeError(f"cuMemcpyAsync failed: CUDA driver error {err}")

    def copy2d(
        self, host: int, host_pitch: int, dev: int, dev_pitch: int, width: int, rows: int, d2h: bool, stream
    ) -> None:
        m = _Memcpy2D()
        m.WidthInBytes, m.Height = width, rows
        if d2h:
            m.srcMemoryType, m.srcDevice, m.srcPitch = _MEM_DEVICE, dev, dev_pitch
            m.dstMemoryType, m.dstHost, m.dstPitch = _MEM_HOST, host, host_pitch
        else:
            m.srcMemoryType, m.srcHost, m.srcPitch = _MEM_HOST, host, host_pitch
            m.dstMemoryType, m.dstDevice, m.dstPitch = _MEM_DEVICE, dev, dev_pitch
        err = self.fn2d(ctypes.byref(m), stream)
        if err:
            raise RuntimeError(f"cuMemcpy2DAsync failed: CUDA driver error {err}")


_DRIVER = _Driver()


def _host_bytes(addr: int, nbytes: int):
    """A numpy uint8 view of ``nbytes`` of host memory at ``addr`` (inside the pool)."""
    import numpy as np

    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _coalesce(hosts: list[int], devs: list[int], sizes: list[int], same_range) -> list[tuple[int, int, int]]:
    """Merge copies contiguous on both sides and inside one pinned registration."""
    out: list[list[int]] = []
    for h, d, n in zip(hosts, devs, sizes):
        if (
            out
            and out[-1][0] + out[-1][2] == h
            and out[-1][1] + out[-1][2] == d
            and same_range(out[-1][0], h)
        ):
            out[-1][2] += n
        else:
            out.append([h, d, n])
    return [tuple(x) for x in out]


class StagedRankMemory:
    """One registered rank's GPU: its staging buffer opened over IPC, and a DMA lane each way.
    The daemon never maps the rank's KV tensors themselves: only the engine touches its blocks."""

    duplex = True  # stores and retrieves run on separate transfer threads
    inline = True  # its copies only queue DMAs: run on the main loop when idle (transfer/engine.py)

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
            self.d2h = DmaLane(torch, self.device, support.host, d2h=True)
            self.h2d = DmaLane(torch, self.device, support.host, d2h=False)

    def wait_event(self, handle: bytes, store: bool = True) -> None:
        with self.torch.cuda.device(self.device):
            (self.d2h if store else self.h2d).wait(handle)

    def store(self, group: int, items: list[CopyItem]) -> DeviceWork | None:
        """Queue the DMAs staging -> pool; the DeviceWork finishes when the bytes are in the pool."""
        if not items:
            return None
        with self.torch.cuda.device(self.device):
            return self.d2h.copy(self.staging, items)

    def retrieve(self, group: int, items: list[CopyItem]) -> DeviceWork | None:
        """Queue the DMAs pool -> staging; the DeviceWork finishes when the bytes are in staging."""
        if not items:
            return None
        with self.torch.cuda.device(self.device):
            return self.h2d.copy(self.staging, items)

    def signal(self) -> bytes:
        """The event the engine's scatter waits for (on the GPU): after every retrieve DMA queued so far."""
        with self.torch.cuda.device(self.device):
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
    inline = True  # its copies only queue DMAs

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
            self.d2h = DmaLane(torch, self.device, support.host, d2h=True)
            self.h2d = DmaLane(torch, self.device, support.host, d2h=False)
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
            self.groups.append((p, flat))

    def wait_event(self, handle: bytes, store: bool = True) -> None:
        with self.torch.cuda.device(self.device):
            (self.d2h if store else self.h2d).wait(handle)

    def _copy(self, lane: DmaLane, group: int, items: list[CopyItem]) -> DeviceWork | None:
        if not items:
            return None
        p, flat = self.groups[group]
        ops = []
        for it in items:
            ops += pitched_copies(p, it.view.ctypes.data, it.ids, it.pos, it.bpc)
        with self.torch.cuda.device(self.device):
            return lane.copy_pitched(ops, p.layers, p.pitch, items[0].bpc * p.block_bytes, flat)

    def store(self, group: int, items: list[CopyItem]) -> DeviceWork | None:
        """Queue the copies engine blocks -> pool; the DeviceWork finishes when the bytes are in the pool."""
        return self._copy(self.d2h, group, items)

    def retrieve(self, group: int, items: list[CopyItem]) -> DeviceWork | None:
        """Queue the copies pool -> engine blocks; the DeviceWork finishes when the blocks are written."""
        return self._copy(self.h2d, group, items)

    def signal(self) -> bytes:
        """The event the engine waits for (on the GPU or its host) before it reads restored blocks."""
        with self.torch.cuda.device(self.device):
            return self.h2d.signal()

    def close(self) -> None:
        with self.torch.cuda.device(self.device):
            self.d2h.close()
            self.h2d.close()
        self.flats = []
        self.storages = []  # drops the IPC mappings
