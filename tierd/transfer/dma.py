"""The copy lanes of a CUDA rank: one DmaLane per direction, a copy stream of the daemon's on the
rank's GPU that queues DMAs between the pinned pool and the GPU, and waits (on the GPU) for the
engine's interprocess events before them.

Hazard: a lane only queues copies; the bytes are in place once the DeviceWork it returns has
finished (an event recorded after them), never when the call returns. Merged copies stay inside
one pinned registration (HostPinner.same_range). The engine's events a lane opens are at most
``MAX_EVENTS``, the least recently used closed first. Copies go through the driver API
(cuMemcpyAsync, cuMemcpy2DAsync through ctypes: a few microseconds per DMA from Python), on the
rank's GPU's primary context (torch's: a lane makes it current on the calling thread), and a
request's contiguous DMAs go as one batch where the driver has cuMemcpyBatchAsync. The event
after a call's copies is a driver event too, reused once waited for: a request's copies make no
torch call, each of which cost tens of microseconds run between requests (docs/findings.md).
Without libcuda (ROCm) torch's copy_ queues the same DMAs and torch's events follow them, with
more Python per copy.
"""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict

import numpy as np

from tierd.transfer.engine import DeviceWork
from tierd.transfer.items import CopyItem
from tierd.transfer.pinned import HostPinner

MAX_EVENTS = 256  # engine events opened per rank, least recently used closed first


class DmaLane:
    """One direction of one rank: a copy stream, and the engine's events it waits on."""

    def __init__(self, torch, device: int, pinner: HostPinner, d2h: bool):
        self.torch, self.device, self.pinner, self.d2h = torch, device, pinner, d2h
        self.stream = torch.cuda.Stream(device=device)
        self.cu_stream = self.stream.cuda_stream
        self._done: list[int] = []  # driver events recorded after a call's copies, waited for already
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
        t0 = time.perf_counter()
        base = staging.data_ptr()
        hosts = [it.view.ctypes.data for it in items]
        devs = [base + it.staged for it in items]
        sizes = [it.view.nbytes for it in items]
        runs = np.array(_coalesce(hosts, devs, sizes, self.pinner.same_range), dtype=np.int64).reshape(-1, 3)
        self._contiguous(runs[:, 1], runs[:, 0], runs[:, 2], staging)
        return self._queued(sum(sizes), len(runs), t0)

    def copy_spans(self, devs: np.ndarray, hosts: np.ndarray, sizes: np.ndarray, tensor) -> DeviceWork:
        """Contiguous copies (int64 arrays of device addresses, host addresses, bytes), every device
        address in ``tensor`` (flat uint8): whole blocks of a block-major group
        (tierd.transfer.items.span_copies)."""
        t0 = time.perf_counter()
        self._contiguous(devs, hosts, sizes, tensor)
        return self._queued(int(sizes.sum()), len(sizes), t0)

    def _contiguous(self, devs: np.ndarray, hosts: np.ndarray, sizes: np.ndarray, tensor) -> None:
        """Queue DMAs between ``hosts`` and ``devs`` (device addresses in ``tensor``)."""
        if _DRIVER.ok:
            _DRIVER.current(self.device)
            _DRIVER.copies(hosts, devs, sizes, self.d2h, self.cu_stream, self.device)
            return
        torch, base = self.torch, tensor.data_ptr()  # torch's own path: the same DMA, more Python per copy
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for h, d, n in zip(hosts.tolist(), devs.tolist(), sizes.tolist()):
                host = torch.from_numpy(_host_bytes(h, n))
                dev = tensor[d - base : d - base + n]
                (host.copy_(dev, non_blocking=True) if self.d2h else dev.copy_(host, non_blocking=True))

    def copy_pitched(
        self, ops: list[tuple[int, int, int]], rows: int, dev_pitch: int, host_pitch: int, tensor
    ) -> DeviceWork:
        """Pitched copies ``(device address, host address, row bytes)`` of ``rows`` rows each,
        device rows ``dev_pitch`` apart, host rows ``host_pitch`` (tierd.transfer.items.Pitched);
        every device address lies in ``tensor`` (flat uint8)."""
        t0 = time.perf_counter()
        stream = self.cu_stream
        if _DRIVER.ok:
            _DRIVER.current(self.device)
            for d, h, w in ops:
                _DRIVER.copy2d(h, host_pitch, d, dev_pitch, w, rows, self.d2h, stream)
        else:  # torch's own path (ROCm, no libcuda): strided views, the same bytes
            torch = self.torch
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                for d, h, w in ops:
                    host = torch.from_numpy(_host_bytes(h, (rows - 1) * host_pitch + w))
                    host = host.as_strided((rows, w), (host_pitch, 1))
                    dev = tensor.as_strided((rows, w), (dev_pitch, 1), d - tensor.data_ptr())
                    (host.copy_(dev, non_blocking=True) if self.d2h else dev.copy_(host, non_blocking=True))
        return self._queued(sum(w for _, _, w in ops) * rows, len(ops), t0)

    def _queued(self, nbytes: int, dmas: int, t0: float) -> DeviceWork:
        """An event after the copies just queued, and the DeviceWork that waits for it: a driver
        event where libcuda is (reused once waited for: no torch call per request, each of which
        costs tens of microseconds between requests), else torch's."""
        st = self.stats
        if _DRIVER.ok:
            done = self._done.pop() if self._done else _DRIVER.event()
            _DRIVER.record(done, self.cu_stream)
            device, free = self.device, self._done

            def wait() -> None:
                t = time.perf_counter()
                _DRIVER.current(device)
                _DRIVER.synchronize(done)
                free.append(done)
                st["sync_s"] += time.perf_counter() - t

        else:
            with self.torch.cuda.device(self.device):
                ev = self.torch.cuda.Event()
                ev.record(self.stream)

            def wait() -> None:
                t = time.perf_counter()
                ev.synchronize()
                st["sync_s"] += time.perf_counter() - t

        st["calls"] += 1
        st["bytes"] += nbytes
        st["dmas"] += dmas
        st["host_s"] += time.perf_counter() - t0
        return DeviceWork([wait])

    def close(self) -> None:
        self.stream.synchronize()
        self._events.clear()
        while self._done:
            _DRIVER.destroy(self._done.pop())


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


class _Location(ctypes.Structure):
    """The driver's CUmemLocation."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CopyAttributes(ctypes.Structure):
    """The driver's CUmemcpyAttributes."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _Location),
        ("dstLocHint", _Location),
        ("flags", ctypes.c_uint),
    ]


_ORDER_STREAM, _LOC_DEVICE, _LOC_HOST = 1, 1, 2  # CUmemcpySrcAccessOrder, CUmemLocationType
_EVENT_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING


class _Driver:
    """cuMemcpyAsync through the driver API (libcuda is there wherever a GPU is): a few
    microseconds per DMA from Python, where torch's copy_ costs tens. Unified addressing: one call
    for either direction; the thread's current context is the one torch made current.

    Several DMAs go as one cuMemcpyBatchAsync where the driver has it (CUDA 12.8 and later): the
    copy engines then keep each other fed between fragments. Measured on an H200 (scattered
    fragments, one stream, same run): per-fragment copies reach 0.81-0.85 of a contiguous copy's
    rate at 640 KiB and 0.92-0.94 at 2 MiB, batches of 16 or 128 fragments 0.98-0.99 at both (two
    or four streams do not help the per-fragment copies: 0.80-0.83 at 640 KiB)."""

    def __init__(self):
        self.ok = False
        self._primary: dict[int, int] = {}  # device -> its primary context
        self.batch = None  # (function, takes failIdx): CUDA 13's _v2 has none, 12.8's has one
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
            return
        for name, fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
            fn = getattr(self.lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                self.batch = (fn, fail_index)
                break

    def copies(
        self, hosts: np.ndarray, devs: np.ndarray, sizes: np.ndarray, d2h: bool, stream: int, device: int
    ) -> None:
        """DMAs between ``hosts`` and ``devs`` (int64 arrays) in stream order: one batch where the
        driver has it and no two destinations overlap (a batch's copies have no order among
        themselves; overlapping ones, a request naming one block twice, go one by one, so the last
        one wins as before)."""
        if len(sizes) > 1 and self.batch is not None and _disjoint(hosts if d2h else devs, sizes):
            self.copy_batch(hosts, devs, sizes, d2h, stream, device)
            return
        for h, d, n in zip(hosts.tolist(), devs.tolist(), sizes.tolist()):
            self.copy(h, d, n, d2h, stream)

    def copy_batch(
        self, hosts: np.ndarray, devs: np.ndarray, sizes: np.ndarray, d2h: bool, stream: int, device: int
    ) -> None:
        fn, fail_index = self.batch
        hosts, devs = np.ascontiguousarray(hosts, np.uint64), np.ascontiguousarray(devs, np.uint64)
        sizes = np.ascontiguousarray(sizes, np.uint64)  # size_t
        attr = _CopyAttributes()
        attr.srcAccessOrder = _ORDER_STREAM
        dev, host = _Location(_LOC_DEVICE, device), _Location(_LOC_HOST, 0)
        attr.srcLocHint, attr.dstLocHint = (dev, host) if d2h else (host, dev)
        first = (ctypes.c_size_t * 1)(0)
        dsts, srcs = (hosts, devs) if d2h else (devs, hosts)
        ptr = ctypes.c_void_p
        args = [
            ptr(dsts.ctypes.data),
            ptr(srcs.ctypes.data),
            ptr(sizes.ctypes.data),
            ctypes.c_size_t(len(sizes)),
        ]
        args += [ctypes.byref(attr), first, ctypes.c_size_t(1)]
        failed = ctypes.c_size_t(0)
        if fail_index:
            args.append(ctypes.byref(failed))
        err = fn(*args, ctypes.c_void_p(stream))
        if err:
            raise RuntimeError(f"cuMemcpyBatchAsync failed at copy {failed.value}: CUDA driver error {err}")

    def current(self, device: int) -> None:
        """Make ``device``'s primary context (torch's) current on this thread, if it is not."""
        want = self._primary.get(device)
        if want is None:
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            if self.lib.cuDeviceGet(ctypes.byref(dev), device) != 0:
                raise RuntimeError(f"cuDeviceGet({device}) failed")
            if self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:  # (held for good)
                raise RuntimeError(f"cannot retain GPU {device}'s primary context")
            want = self._primary[device] = ctx.value
        now = ctypes.c_void_p()
        if self.lib.cuCtxGetCurrent(ctypes.byref(now)) == 0 and now.value == want:
            return
        if self.lib.cuCtxSetCurrent(ctypes.c_void_p(want)) != 0:
            raise RuntimeError(f"cannot make GPU {device}'s primary context current")

    def event(self) -> int:
        """A new event (no timing) in the current context."""
        ev = ctypes.c_void_p()
        err = self.lib.cuEventCreate(ctypes.byref(ev), _EVENT_DISABLE_TIMING)
        if err:
            raise RuntimeError(f"cuEventCreate failed: CUDA driver error {err}")
        return ev.value

    def record(self, event: int, stream: int) -> None:
        err = self.lib.cuEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(stream))
        if err:
            raise RuntimeError(f"cuEventRecord failed: CUDA driver error {err}")

    def synchronize(self, event: int) -> None:
        """Wait for ``event`` (the GIL let go meanwhile, as ctypes does for every call)."""
        err = self.lib.cuEventSynchronize(ctypes.c_void_p(event))
        if err:
            raise RuntimeError(f"cuEventSynchronize failed: CUDA driver error {err}")

    def destroy(self, event: int) -> None:
        self.lib.cuEventDestroy_v2(ctypes.c_void_p(event))

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
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _disjoint(starts: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether no two ranges ``[starts[i], starts[i] + sizes[i])`` overlap."""
    order = np.argsort(starts, kind="stable")
    s = starts[order]
    return bool(np.all(s[:-1] + sizes[order][:-1] <= s[1:]))


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
