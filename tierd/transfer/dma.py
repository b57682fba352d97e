"""The copy lanes of a CUDA rank: one DmaLane per direction, a copy stream of the daemon's on the
rank's GPU that queues DMAs between the pinned pool and the GPU, and waits (on the GPU) for the
engine's interprocess events before them.

Hazard: a lane only queues copies; the bytes are in place once the DeviceWork it returns has
finished (an event recorded after them), never when the call returns. Merged copies stay inside
one pinned registration (HostPinner.same_range). The engine's events a lane opens are at most
``MAX_EVENTS``, the least recently used closed first. Copies go through the driver API
(cuMemcpyAsync, cuMemcpy2DAsync through ctypes: a few microseconds per DMA from Python), on the
rank's GPU's primary context (torch's: a lane makes it current on the calling thread), and a
request's contiguous DMAs go as one batch where the driver has cuMemcpyBatchAsync
(tierd.transfer.cudriver). The event after a call's copies is a driver event too, reused once
waited for, and so is the signal a RETRIEVE's answer carries: a request's copies make no torch
call, each of which cost tens of microseconds run between requests (docs/findings.md).
Without libcuda (ROCm) torch's copy_ queues the same DMAs and torch's events follow them, with
more Python per copy.
"""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict

import numpy as np

from tierd.transfer.cudriver import DRIVER as _DRIVER
from tierd.transfer.engine import DeviceWork
from tierd.transfer.items import CopyItem, row_pitches
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
        """Record an interprocess event after everything queued on this lane; its 64-byte handle
        (a driver event where libcuda is: no torch call per request; the engine opens either with
        torch.cuda.Event.from_ipc_handle)."""
        if _DRIVER.ok:
            _DRIVER.current(self.device)
            if self._signal is None:
                self._signal = _DRIVER.event(interprocess=True)
                self._signal_handle = _DRIVER.ipc_handle(self._signal)
            _DRIVER.record(self._signal, self.cu_stream)
            return self._signal_handle
        with self.torch.cuda.device(self.device):
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
                dp, hp = row_pitches(rows, w, dev_pitch, host_pitch)
                _DRIVER.copy2d(h, hp, d, dp, w, rows, self.d2h, stream)
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
        if isinstance(self._signal, int):
            _DRIVER.destroy(self._signal)  # (as torch's event was once the lane went)
        self._signal = None


def _host_bytes(addr: int, nbytes: int):
    """A numpy uint8 view of ``nbytes`` of host memory at ``addr`` (inside the pool)."""
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
