"""The CUDA driver API through ctypes, for the copy lanes (tierd.transfer.dma): DMAs one by one,
pitched, or as one cuMemcpyBatchAsync; events (plain and interprocess); the primary context made
current. libcuda is there wherever an NVIDIA GPU is; ``DRIVER.ok`` is False without it (ROCm),
and the lanes use torch's copies instead."""

from __future__ import annotations

import ctypes

import numpy as np

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
_EVENT_DISABLE_TIMING, _EVENT_INTERPROCESS = 2, 4  # CU_EVENT_DISABLE_TIMING, CU_EVENT_INTERPROCESS
_IPC_HANDLE_BYTES, _NOT_READY = 64, 600  # CU_IPC_HANDLE_SIZE, CUDA_ERROR_NOT_READY


class Driver:
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
        self._attrs: dict[tuple[bool, int], tuple] = {}  # (d2h, device) -> a batch's attribute arguments
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
        hosts, devs, sizes = _u64(hosts), _u64(devs), _u64(sizes)  # (size_t)
        dsts, srcs = (hosts, devs) if d2h else (devs, hosts)
        ptr = ctypes.c_void_p
        args = [ptr(dsts.ctypes.data), ptr(srcs.ctypes.data), ptr(sizes.ctypes.data)]
        args += [ctypes.c_size_t(len(sizes)), *self._attributes(d2h, device)]
        failed = ctypes.c_size_t(0)
        if fail_index:
            args.append(ctypes.byref(failed))
        err = fn(*args, ptr(stream))
        if err:
            raise RuntimeError(f"cuMemcpyBatchAsync failed at copy {failed.value}: CUDA driver error {err}")

    def _attributes(self, d2h: bool, device: int) -> tuple:
        """A batch's attribute arguments for one direction of one GPU (made once, reused): every
        copy stream-ordered, with its source and destination kinds."""
        key = (d2h, device)
        out = self._attrs.get(key)
        if out is None:
            attr = _CopyAttributes()
            attr.srcAccessOrder = _ORDER_STREAM
            dev, host = _Location(_LOC_DEVICE, device), _Location(_LOC_HOST, 0)
            attr.srcLocHint, attr.dstLocHint = (dev, host) if d2h else (host, dev)
            first = (ctypes.c_size_t * 1)(0)  # the one attribute applies from the first copy on
            out = self._attrs[key] = (ctypes.byref(attr), first, ctypes.c_size_t(1))  # (byref keeps attr)
        return out

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

    def event(self, interprocess: bool = False) -> int:
        """A new event (no timing) in the current context; ``interprocess``: one another process
        may open (``ipc_handle``)."""
        ev = ctypes.c_void_p()
        flags = _EVENT_DISABLE_TIMING | (_EVENT_INTERPROCESS if interprocess else 0)
        err = self.lib.cuEventCreate(ctypes.byref(ev), flags)
        if err:
            raise RuntimeError(f"cuEventCreate failed: CUDA driver error {err}")
        return ev.value

    def ipc_handle(self, event: int) -> bytes:
        """The 64-byte interprocess handle of an ``interprocess`` event (cudaIpcEventHandle_t's)."""
        handle = ctypes.create_string_buffer(_IPC_HANDLE_BYTES)
        err = self.lib.cuIpcGetEventHandle(handle, ctypes.c_void_p(event))
        if err:
            raise RuntimeError(f"cuIpcGetEventHandle failed: CUDA driver error {err}")
        return handle.raw

    def query(self, event: int) -> bool:
        """Whether everything before ``event``'s last record has completed."""
        err = self.lib.cuEventQuery(ctypes.c_void_p(event))
        if err not in (0, _NOT_READY):
            raise RuntimeError(f"cuEventQuery failed: CUDA driver error {err}")
        return err == 0

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
            raise RuntimeError(
                f"cuMemcpy2DAsync failed: CUDA driver error {err} ({rows} rows of {width} bytes, "
                f"pitches {dev_pitch} on the device, {host_pitch} on the host)"
            )


DRIVER = Driver()


def _u64(a: np.ndarray) -> np.ndarray:
    """``a`` as contiguous uint64 (size_t, addresses): a view of contiguous int64, else a copy."""
    if a.dtype == np.int64 and a.flags.c_contiguous:
        return a.view(np.uint64)
    return np.ascontiguousarray(a, np.uint64)


def _disjoint(starts: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether no two ranges ``[starts[i], starts[i] + sizes[i])`` overlap."""
    order = np.argsort(starts, kind="stable")
    s = starts[order]
    return bool(np.all(s[:-1] + sizes[order][:-1] <= s[1:]))
