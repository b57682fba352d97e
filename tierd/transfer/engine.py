"""Transfer threads. Copies run off the main loop, one FIFO lane per registered rank (or a fixed
number of lanes shared round-robin with ``--workers N``); ranks copy in parallel. A *duplex* rank
(the CUDA path) gets a second lane for its retrieves, so a store and a retrieve of one rank use
both directions of the link at once. A finished job is queued back to the main loop, which
commits metadata and replies, and woken through a pipe."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


READ_LANE = "\x00read"  # suffix of a duplex rank's retrieve lane


class DeviceWork:
    """What a copy returns when its device work is queued but not yet finished. The lane starts
    the next job at once (so the device gets back-to-back work) and a waiter thread per lane
    calls ``wait()`` and completes the jobs in order. A job whose reply may go out as soon as its
    work is queued (``early``: what the reply carries, e.g. the event to wait on) is handed to
    the main loop at once too, as QUEUED."""

    __slots__ = ("waits", "early")

    def __init__(self, waits: list[Callable[[], None]], early: dict | None = None):
        self.waits = waits
        self.early = early

    def wait(self) -> None:
        for w in self.waits:
            w()


def device_work(results) -> DeviceWork | None:
    """One DeviceWork for the results of several copy calls (None when all finished in the call)."""
    waits = [w for r in results if isinstance(r, DeviceWork) for w in r.waits]
    return DeviceWork(waits) if waits else None


QUEUED = object()  # drain() result of a job whose device work is queued and whose reply may go now


class TransferEngine:
    def __init__(self, workers: int = 0):
        self.workers = workers
        self._shared = [ThreadPoolExecutor(1, thread_name_prefix=f"tierd-xfer-{i}") for i in range(workers)]
        self._lanes: dict[str, ThreadPoolExecutor] = {}
        self._every: set[ThreadPoolExecutor] = set()  # lanes not yet retired, joined by close()
        self._retiring: dict[ThreadPoolExecutor, ThreadPoolExecutor] = {}  # waiter -> its detached lane
        self._waiters: dict[ThreadPoolExecutor, ThreadPoolExecutor] = {}
        self._next = 0
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self._inflight = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    def attach(self, lane: str, duplex: bool = False) -> None:
        if duplex:
            self.attach(lane + READ_LANE)
        if lane in self._lanes:
            return
        if self._shared:
            self._lanes[lane] = self._shared[self._next % len(self._shared)]
            self._next += 1
        else:
            pool = self._lanes[lane] = ThreadPoolExecutor(1, thread_name_prefix=f"tierd-xfer-{lane[:24]}")
            self._every.add(pool)

    def detach(self, lane: str, last: Callable[[], None] | None = None) -> None:
        """Forget a lane (and its read lane); ``last`` runs after every job already queued on both."""
        read = self._lanes.pop(lane + READ_LANE, None)
        pool = self._lanes.pop(lane, None)
        if pool is None:  # no lane (closed already): nothing is queued, finish now
            if last is not None:
                last()
            return
        if last is not None:
            if read is not None:
                drained = read.submit(lambda: None)
                fn = last

                def last():
                    drained.result()
                    fn()

            pool.submit(last)
        if not self._shared:
            for p in (pool, read):
                if p is not None:
                    p.submit(self._drop_waiter, p)  # after the lane's last job handed over its wait
                    p.shutdown(wait=False)

    def submit(self, lane: str, fn: Callable[[], Any], job: Any) -> None:
        with self._lock:
            self._inflight += 1
        pool = self._lanes[lane]
        pool.submit(self._run, fn, job, pool)

    def _run(self, fn: Callable[[], Any], job: Any, pool: ThreadPoolExecutor | None = None) -> None:
        try:
            result, exc = fn(), None
        except BaseException as e:  # reported to the client as DEVICE_ERROR, never lost
            result, exc = None, e
        if exc is None and isinstance(result, DeviceWork) and pool is not None:
            if result.early is not None:
                self._done.put((job, QUEUED, None))  # reply now; the waiter completes the job later
                self._wake()
            self._waiter(pool).submit(self._settle, job, result)
            return
        self._finish(job, result, exc)

    def _settle(self, job: Any, result: DeviceWork) -> None:
        try:
            result.wait()
            exc = None
        except BaseException as e:  # noqa: BLE001 - a device error: DEVICE_ERROR
            exc = e
        self._finish(job, None, exc)

    def _waiter(self, pool: ThreadPoolExecutor) -> ThreadPoolExecutor:
        with self._lock:
            waiter = self._waiters.get(pool)
            if waiter is None:
                waiter = self._waiters[pool] = ThreadPoolExecutor(1, thread_name_prefix="tierd-wait")
            return waiter

    def _drop_waiter(self, pool: ThreadPoolExecutor) -> None:
        """Runs as a detached lane's last job: retire the lane and, after its queued waits, its waiter."""
        with self._lock:
            waiter = self._waiters.pop(pool, None)
            if waiter is None:
                self._every.discard(pool)
            else:
                self._retiring[waiter] = pool
        if waiter is not None:
            waiter.submit(self._retire, waiter)
            waiter.shutdown(wait=False)  # queued waits still run

    def _retire(self, waiter: ThreadPoolExecutor) -> None:
        with self._lock:
            pool = self._retiring.pop(waiter, None)
            self._every.discard(pool)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _finish(self, job: Any, result: Any, exc: BaseException | None) -> None:
        self._done.put((job, result, exc))
        self._wake()
        with self._lock:
            self._inflight -= 1
            self._idle.notify_all()

    def drain(self) -> list[tuple[Any, Any, BaseException | None]]:
        try:
            while self.wake_r >= 0 and os.read(self.wake_r, 4096):  # closed: finished jobs are still queued
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    @property
    def inflight(self) -> int:
        return self._inflight

    def wait_idle(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def close(self) -> None:
        """Wait for every queued copy, on live and detached lanes alike. Idempotent."""
        if self.wake_r < 0:
            return
        with self._lock:
            lanes = self._every | set(self._lanes.values()) | set(self._shared)
        for pool in lanes:
            pool.shutdown(wait=True)
        with self._lock:
            waiters = list(self._waiters.values()) + list(self._retiring)
        for waiter in waiters:
            waiter.shutdown(wait=True)
        self._waiters.clear()
        self._lanes.clear()
        os.close(self.wake_r)
        os.close(self._wake_w)
        self.wake_r = self._wake_w = -1  # drain() after close() must not read a reused descriptor
