"""CUDA data path: engine KV tensors opened over CUDA IPC, a pinned host pool, batched
gather/scatter kernels (native/) with a pure-torch fallback that gives the same bytes.

Contexts. The daemon creates a CUDA context only on a GPU some engine registered: ``detect()``
counts devices (no context), the native build reads device properties (no context), and the
pool's pinner defers ``cudaHostRegister`` until the first rank registers. cudaHostRegister needs
a current context; it runs on the first registered GPU with ``cudaHostRegisterPortable``, so the
pinned pages count as pinned for every context (all 64-bit CUDA is UVA), and later segments are
pinned on that GPU as the pool grows.

Copies. Each registered rank gets two *lanes* (``duplex``: the daemon runs stores and retrieves of
one rank on two transfer threads, so both directions overlap on the link). A lane owns a kernel
stream, a copy stream and a ring of device staging slots. STORE: gather kernel (all layers x all
blocks of a batch of chunks) into a slot on the kernel stream, then one DMA per object (adjacent
objects merged) into the pinned pool on the copy stream, slots double/triple-buffered so the
gather of batch k+1 overlaps the DMA of batch k. A copy call returns as soon as its work is
queued, with a Pending that the lane's waiter thread waits on (transfer/engine.py): the next
request is planned and queued while the device still copies this one, so the link never idles
between requests, and the reply still goes out only when the copy is complete: the last DMA for
a STORE, the last scatter kernel for a RETRIEVE (the bytes are in the engine's blocks).
A STORE may carry an interprocess event recorded on the engine's forward stream: the kernel
stream waits on it (on the GPU) before its first gather.
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

import numpy as np

from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import CudaIpcHandle, GroupLayout, PageLayout, TensorRef
from tierd.transfer import gather, native
from tierd.transfer.engine import Pending
from tierd.transfer.items import CopyItem

log = logging.getLogger("tierd.cuda")

IPC_EVENT_BYTES = 64  # CUDA_IPC_HANDLE_SIZE
MAX_EVENTS = 256


def _driver_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def detect(settings):
    """A CudaSupport when a GPU is usable from this process, else None. Creates no context."""
    if not _driver_present():
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    native.configure(settings.native_cache, settings.native_build)
    return CudaSupport(settings.cuda_impl, settings.cuda_staging_mb << 20, settings.cuda_staging_slots)


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
            log.warning("cudaHostRegister of %d MiB failed (error %d): copies to it run unpinned", nbytes >> 20, int(err))
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
            if lib.cuDeviceGet(ctypes.byref(dev), i) == 0 and lib.cuDevicePrimaryCtxGetState(
                dev, ctypes.byref(flags), ctypes.byref(active)
            ) == 0 and active.value:
                out.append(i)
        return out
    except OSError:
        return []


# ---- the support object the daemon holds -------------------------------------------------------------
class CudaSupport:
    def __init__(self, impl: str = "auto", slot_bytes: int = 64 << 20, slots: int = 3):
        import torch

        self.torch = torch
        self.impl = impl  # auto | kernel | torch
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.host = HostPinner()
        self.count = torch.cuda.device_count()
        self._uuids: dict[str, int] | None = None
        self.devices_open: set[int] = set()
        self.memories: weakref.WeakSet = weakref.WeakSet()
        native.start()

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

    def rank_memory(self, layout: PageLayout) -> "CudaRankMemory":
        memory = CudaRankMemory(layout, self)
        self.memories.add(memory)
        return memory

    def lane_stats(self) -> dict:
        out = {}
        for memory in list(self.memories):
            for name, lane in (("store", memory.store_lane), ("retrieve", memory.load_lane)):
                acc = out.setdefault(name, {"impl": lane.impl})
                for k, v in lane.stats.items():
                    acc[k] = round(acc.get(k, 0) + v, 6)
        return out

    def status(self) -> dict:
        return {
            "devices": self.count,
            "devices_open": sorted(self.devices_open),
            "contexts": _primary_contexts(self.count),
            "native": native.state(),
            "pinned_bytes": self.host.pinned_bytes,
            "pin_pending_bytes": sum(self.host.pending.values()),
            "pin_failed_bytes": self.host.failed_bytes,
            "staging_slot_bytes": self.slot_bytes,
            "staging_slots": self.slots,
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
        raise _invalid(f"{where}: cannot open the CUDA IPC handle: {str(exc).splitlines()[0][:300]}") from None
    if storage.nbytes() < ref.nbytes:
        raise _invalid(f"{where}: the opened storage has {storage.nbytes()} bytes, the layout declares {ref.nbytes}")
    return storage, device


class GroupCopy:
    """What a group's copies need on the device: per-layer descriptor table and torch views."""

    def __init__(self, group: GroupLayout, flats: list, torch, device: int):
        self.group = group
        self.layers = len(group.layers)
        self.block_bytes = group.block_bytes
        self.views = gather.layer_views(group, flats)
        bases = [flats[s.tensor].data_ptr() + s.offset for s in group.layers]
        table = np.zeros((self.layers, 4), dtype=np.int64)
        for i, (base, s) in enumerate(zip(bases, group.layers)):
            table[i, :3] = (base, s.block_stride, s.run_stride)
        self.table = torch.from_numpy(table).to(device)
        self.kernel_ok = gather.uniform_runs(group)
        self.runs, self.run_bytes = group.layers[0].runs, group.layers[0].run_bytes
        self.vec = gather.vector_width(group, bases)


class Lane:
    """One direction of one rank: kernel stream, copy stream, staging ring, descriptor buffers."""

    def __init__(self, torch, device: int, pinner: HostPinner, slot_bytes: int, slots: int):
        self.torch = torch
        self.device = device
        self.pinner = pinner
        self.kernel = torch.cuda.Stream(device=device)
        self.copy = torch.cuda.Stream(device=device)
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.staging = None
        self.ready = [torch.cuda.Event() for _ in range(slots)]
        self.free = [torch.cuda.Event() for _ in range(slots)]
        self.used = [False] * slots
        self.cursor = 0  # the ring turns across calls, so back-to-back calls overlap too
        self.sm = torch.cuda.get_device_properties(device).multi_processor_count
        self.impl = "none"
        self.stats = {"calls": 0, "bytes": 0, "batches": 0, "dmas": 0, "host_s": 0.0, "sync_s": 0.0}

    def _account(self, plan: gather.Plan, t0: float, t1: float) -> None:
        st = self.stats
        st["calls"] += 1
        st["bytes"] += plan.obj * len(plan.items)
        st["batches"] += len(plan.batches)
        st["host_s"] += t1 - t0  # planning, uploads, launches: the Python side of a copy

    def _slots(self, obj: int):
        if self.staging is None or obj > self.slot_bytes:
            if obj > self.slot_bytes:
                self.slot_bytes = -(-obj // (1 << 20)) << 20
            self.kernel.synchronize()  # earlier calls may still use the old ring
            self.copy.synchronize()
            self.staging = None
            self.staging = self.torch.empty(self.slots * self.slot_bytes, dtype=self.torch.uint8, device=self.device)
            self.used = [False] * self.slots
        return self.staging

    def _upload(self, desc: np.ndarray):
        """Descriptors to the device on the kernel stream. Calls overlap (a call returns before its
        copies finish), so each gets its own pinned buffer: torch's caching host allocator reuses
        it only after the copy recorded on it has run; the device buffer is stream-ordered."""
        torch = self.torch
        host = torch.from_numpy(np.ascontiguousarray(desc).ravel()).pin_memory()
        with torch.cuda.stream(self.kernel):
            dev = torch.empty(desc.size, dtype=torch.int64, device=self.device)
            dev.copy_(host, non_blocking=True)
        return dev.view(desc.shape)

    def _ticket(self, plan: gather.Plan, stream, t0: float) -> Pending:
        """The call's completion: an event after its last device op, waited for by the lane's waiter."""
        done = self.torch.cuda.Event()
        done.record(stream)
        t1 = time.perf_counter()
        self._account(plan, t0, t1)

        def wait() -> None:
            t = time.perf_counter()
            done.synchronize()
            self.stats["sync_s"] += time.perf_counter() - t

        return Pending([wait])

    def _host_copies(self, mod, plan: gather.Plan, b: gather.Batch, slot_ptr: int, d2h: bool, stream) -> None:
        items = plan.items[b.i0 : b.i1]
        hosts = [it.view.ctypes.data for it in items]
        devs = [slot_ptr + k * plan.obj for k in range(len(items))]
        if mod is not None:
            hs, ds, ns = gather.coalesce(hosts, devs, plan.obj, self.pinner.same_range)
            self.stats["dmas"] += len(hs)
            if d2h:
                mod.memcpy_many(hs, ds, ns, True, stream.cuda_stream)
            else:
                mod.memcpy_many(ds, hs, ns, False, stream.cuda_stream)
            return
        torch = self.torch
        slot = self.staging
        base = slot_ptr - slot.data_ptr()
        with torch.cuda.stream(stream):
            for k, it in enumerate(items):
                host = torch.from_numpy(it.view)
                dev = slot[base + k * plan.obj : base + (k + 1) * plan.obj]
                if d2h:
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)

    def _device_copy(self, mod, g: GroupCopy, plan: gather.Plan, b: gather.Batch, desc, slot_ptr: int, scatter: bool):
        torch = self.torch
        n_jobs = b.j1 - b.j0
        if n_jobs == 0:
            return
        bpc = plan.items[0].bpc
        if mod is not None and g.kernel_ok:
            fn = mod.scatter if scatter else mod.gather
            row = desc.stride(0) * 8
            fn(g.table.data_ptr(), g.layers, desc.data_ptr() + b.j0 * 8, desc.data_ptr() + row + b.j0 * 8, n_jobs,
               slot_ptr, bpc * g.block_bytes, g.block_bytes, g.run_bytes, g.runs, g.vec, self.sm * 8,
               self.kernel.cuda_stream)
            return
        base = slot_ptr - self.staging.data_ptr()
        staging = self.staging[base : base + plan.obj * (b.i1 - b.i0)]
        args = (g.views, staging, b.i1 - b.i0, bpc, desc[0, b.j0 : b.j1], desc[2, b.j0 : b.j1], desc[3, b.j0 : b.j1])
        with torch.cuda.stream(self.kernel):
            (gather.torch_scatter if scatter else gather.torch_gather)(*args)

    def store(self, g: GroupCopy, items: list[CopyItem], mod) -> Pending:
        t0 = time.perf_counter()
        plan = gather.make_plan(g.group, items, self.slot_bytes)
        staging = self._slots(plan.obj)
        desc = self._upload(plan.desc)
        self.impl = "kernel" if mod is not None and g.kernel_ok else "torch"
        for n, b in enumerate(plan.batches, self.cursor):
            s = n % self.slots
            slot_ptr = staging.data_ptr() + s * self.slot_bytes
            if self.used[s]:
                self.kernel.wait_event(self.free[s])
            self._device_copy(mod, g, plan, b, desc, slot_ptr, scatter=False)
            self.ready[s].record(self.kernel)
            self.copy.wait_event(self.ready[s])
            self._host_copies(mod, plan, b, slot_ptr, True, self.copy)
            self.free[s].record(self.copy)
            self.used[s] = True
        self.cursor += len(plan.batches)
        return self._ticket(plan, self.copy, t0)

    def retrieve(self, g: GroupCopy, items: list[CopyItem], mod) -> Pending:
        t0 = time.perf_counter()
        plan = gather.make_plan(g.group, items, self.slot_bytes)
        staging = self._slots(plan.obj)
        desc = self._upload(plan.desc)
        self.impl = "kernel" if mod is not None and g.kernel_ok else "torch"
        for n, b in enumerate(plan.batches, self.cursor):
            s = n % self.slots
            slot_ptr = staging.data_ptr() + s * self.slot_bytes
            if self.used[s]:
                self.copy.wait_event(self.free[s])
            self._host_copies(mod, plan, b, slot_ptr, False, self.copy)
            self.ready[s].record(self.copy)
            self.kernel.wait_event(self.ready[s])
            self._device_copy(mod, g, plan, b, desc, slot_ptr, scatter=True)
            self.free[s].record(self.kernel)
            self.used[s] = True
        self.cursor += len(plan.batches)
        return self._ticket(plan, self.kernel, t0)  # the reply waits for it: bytes in the engine's blocks

    def close(self) -> None:
        self.kernel.synchronize()
        self.copy.synchronize()
        self.staging = None


class CudaRankMemory:
    """One registered rank's KV on a GPU: same interface as CpuRankMemory, plus ``wait_event``."""

    duplex = True  # stores and retrieves run on separate transfer threads

    def __init__(self, layout: PageLayout, support: CudaSupport, impl: str | None = None):
        torch = support.torch
        self.layout = layout
        self.torch = torch
        self.support = support
        self.impl = impl or support.impl
        self.storages = []
        device = None
        for i, ref in enumerate(layout.tensors):
            storage, dev = open_ipc(ref, f"layout.tensors[{i}]", support)
            if device is not None and dev != device:
                raise _invalid(f"layout.tensors[{i}]: on GPU {dev}, the rank's other tensors on GPU {device}")
            device = dev
            self.storages.append(storage)
        self.device = device
        with torch.cuda.device(device):
            flats = [torch.empty(0, dtype=torch.uint8, device=device).set_(s, 0, (s.nbytes(),), (1,)) for s in self.storages]
            self.groups = [GroupCopy(g, flats, torch, device) for g in layout.groups]
            self.store_lane = Lane(torch, device, support.host, support.slot_bytes, support.slots)
            self.load_lane = Lane(torch, device, support.host, support.slot_bytes, support.slots)
        self._events: OrderedDict[bytes, object] = OrderedDict()

    def _module(self):
        if self.impl == "torch":
            return None
        mod = native.get()
        if mod is None and self.impl == "kernel":
            mod = native.load()
            if mod is None:
                raise RuntimeError(f"native kernels unavailable: {native.state()['error']}")
        return mod

    def wait_event(self, handle: bytes) -> None:
        """Make the next store's gather wait (on the GPU) for the engine's interprocess event."""
        torch = self.torch
        with torch.cuda.device(self.device):
            ev = self._events.get(handle)
            if ev is None:
                ev = torch.cuda.Event.from_ipc_handle(torch.device("cuda", self.device), handle)
                self._events[handle] = ev
                while len(self._events) > MAX_EVENTS:
                    self._events.popitem(last=False)
            else:
                self._events.move_to_end(handle)
            self.store_lane.kernel.wait_event(ev)

    def store(self, group: int, items: list[CopyItem]) -> Pending | None:
        """Queue the copies; the returned Pending finishes when the bytes are in the pool."""
        if items:
            with self.torch.cuda.device(self.device):
                return self.store_lane.store(self.groups[group], items, self._module())
        return None

    def retrieve(self, group: int, items: list[CopyItem]) -> Pending | None:
        """Queue the copies; the returned Pending finishes when the scatter is done on the GPU."""
        if items:
            with self.torch.cuda.device(self.device):
                return self.load_lane.retrieve(self.groups[group], items, self._module())
        return None

    def close(self) -> None:
        with self.torch.cuda.device(self.device):
            self.store_lane.close()
            self.load_lane.close()
        self.groups = []
        self._events.clear()
        self.storages = []  # drops the IPC mappings (torch closes them with the last reference)
