"""Transfer threads. Copies run off the main loop, one FIFO lane per registered rank: a lane runs
its jobs one at a time and in order, and every lane shares one bounded pool of copy threads
(``--workers``), so ranks copy in parallel up to that many at once and a thousand registered
ranks cost a thousand queues, not a thousand threads. Busy lanes take turns (each runs one job,
then queues itself behind the others). A *duplex* rank (the CUDA path) gets a second lane for
its retrieves, so a store and a retrieve of one rank use both directions of the link at once.
Device work a copy leaves queued (DeviceWork) is waited for on the lane's waiter, a lane of a
second bounded pool. A finished job is queued back to the main loop, which commits metadata and
replies, and woken through a pipe.

An *inline* lane (a rank whose copies only queue device work, the CUDA path: a few driver calls,
no blocking copy) runs a job on the thread that submits it, the main loop, whenever the lane is
idle, and queues it only behind a job of its own still running: each thread hand-off costs a
wake-up (``benchmarks/lookup_latency.py``'s ``no_spin`` figures show one), and a queued job
waited for two of them (to a copy thread and back to the main loop) before its reply or its wait
could start. A job the lane
answers early (QUEUED) is then answered in the same turn of the main loop that received it."""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("tierd")


READ_LANE = "\x00read"  # suffix of a duplex rank's retrieve lane
# a direct rank's job larger than this goes to a copy thread all the same: queueing its copies
# (one per block, about a microsecond each in a batch) would hold the main loop too long
INLINE_MAX_BYTES = 64 << 20
# a staged rank's jobs run inline whatever their size: each object part is one DMA (adjacent ones
# merged), a few per request; on a copy thread they waited for it and for the GIL (an H200's 80 MiB
# requests: 2 ms in the lane, 0.6 ms per copy call)
INLINE_ANY = 1 << 62


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


def _stamp(job: Any, stage: str) -> None:
    """``job.stamp(stage)`` where the job keeps stamps (tierd.core.jobs.Job; tierd.base.stats STAGES)."""
    stamp = getattr(job, "stamp", None)
    if stamp is not None:
        stamp(stage)


QUEUED = object()  # drain() result of a job whose device work is queued and whose reply may go now


def auto_workers() -> int:
    """Copy threads for ``--workers 0``: two per CPU core, at least 16 (a GPU node's ranks in both
    directions), at most 64."""
    return min(64, max(16, 2 * (os.cpu_count() or 1)))


class Lane:
    """Runs what is submitted to it one at a time, in order, on a shared executor (``inline``: on
    the submitting thread when the lane is idle, module doc)."""

    __slots__ = ("_q", "_busy", "_lock", "_pool", "_engine", "inline")

    def __init__(self, pool: ThreadPoolExecutor, engine: TransferEngine, inline: int = 0):
        self._q: collections.deque = collections.deque()
        self._busy = False
        self._lock = threading.Lock()
        self._pool = pool
        self._engine = engine
        self.inline = inline

    def submit(self, fn: Callable, *args, small: bool = True) -> None:
        """``small``: an inline lane may run it here (a large job goes to a copy thread)."""
        self._engine._held(+1)
        with self._lock:
            self._q.append((fn, args))
            if self._busy:
                return
            self._busy = True
        if self.inline and small:
            self._step()
        else:
            self._pool.submit(self._step)

    def _step(self) -> None:
        with self._lock:
            fn, args = self._q.popleft()
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001 - a lane's own bookkeeping; jobs report their errors
            log.exception("transfer lane step failed")
        finally:
            with self._lock:
                more = bool(self._q)
                self._busy = more
            if more:
                self._pool.submit(self._step)  # behind the other lanes' steps: lanes take turns
            self._engine._held(-1)


class TransferEngine:
    def __init__(self, workers: int = 0, waiters: int = 0):
        self.workers = workers or auto_workers()
        self._copy_pool = ThreadPoolExecutor(self.workers, thread_name_prefix="tierd-xfer")
        self._wait_pool = ThreadPoolExecutor(waiters or self.workers, thread_name_prefix="tierd-wait")
        self._lanes: dict[str, Lane] = {}
        self._waiters: dict[Lane, Lane] = {}  # a lane -> the lane its device work is waited on
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self._inflight = 0
        self._queued = 0  # lane items not yet run (jobs, waits, detach barriers)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    def _held(self, n: int) -> None:
        with self._lock:
            self._queued += n
            if not self._queued:
                self._idle.notify_all()

    def attach(self, lane: str, duplex: bool = False, inline: int = 0) -> None:
        """``duplex``: a second lane for the rank's retrieves; ``inline``: its jobs only queue device
        work, and those of at most this many bytes run on the submitting thread when the lane is
        idle (module doc; 0: none)."""
        if duplex:
            self.attach(lane + READ_LANE, inline=inline)
        if lane not in self._lanes:
            self._lanes[lane] = Lane(self._copy_pool, self, inline)

    def detach(self, lane: str, last: Callable[[], None] | None = None) -> None:
        """Forget a lane (and its read lane); ``last`` runs after every job already queued on both
        and after the device work those jobs left, once it is waited for."""
        lanes = [
            x for x in (self._lanes.pop(lane, None), self._lanes.pop(lane + READ_LANE, None)) if x is not None
        ]
        if not lanes:  # no lane (closed already): nothing is queued, finish now
            if last is not None:
                last()
            return
        if last is None:
            return
        left = [len(lanes)]
        lock = threading.Lock()

        def one_done() -> None:
            with lock:
                left[0] -= 1
                done = not left[0]
            if done:
                last()

        for x in lanes:

            def after(x=x) -> None:  # the lane's jobs ran: their waits are queued on its waiter
                with self._lock:
                    waiter = self._waiters.pop(x, None)
                if waiter is None:
                    one_done()
                else:
                    waiter.submit(one_done)

            x.submit(after)

    def submit(self, lane: str, fn: Callable[[], Any], job: Any) -> None:
        _stamp(job, "plan")
        with self._lock:
            self._inflight += 1
        x = self._lanes[lane]
        x.submit(self._run, fn, job, x, small=getattr(job, "nbytes", 0) <= x.inline)

    def _run(self, fn: Callable[[], Any], job: Any, lane: Lane | None = None) -> None:
        _stamp(job, "lane")
        try:
            result, exc = fn(), None
        except BaseException as e:  # reported to the client as DEVICE_ERROR, never lost
            result, exc = None, e
        _stamp(job, "copy")
        if exc is None and isinstance(result, DeviceWork) and lane is not None:
            if result.early is not None:
                self._done.put((job, QUEUED, None))  # reply now; the waiter completes the job later
                self._wake()
            self._waiter(lane).submit(self._settle, job, result)
            return
        self._finish(job, result, exc)

    def _settle(self, job: Any, result: DeviceWork) -> None:
        try:
            result.wait()
            exc = None
        except BaseException as e:  # noqa: BLE001 - a device error: DEVICE_ERROR
            exc = e
        _stamp(job, "device")
        self._finish(job, None, exc)

    def _waiter(self, lane: Lane) -> Lane:
        with self._lock:
            waiter = self._waiters.get(lane)
            if waiter is None:
                waiter = self._waiters[lane] = Lane(self._wait_pool, self)
            return waiter

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
        """Wait for every queued copy, wait and detach barrier, on live and detached lanes alike.
        Idempotent."""
        if self.wake_r < 0:
            return
        with self._idle:
            self._idle.wait_for(lambda: self._queued == 0)
        self._copy_pool.shutdown(wait=True)
        self._wait_pool.shutdown(wait=True)
        self._waiters.clear()
        self._lanes.clear()
        os.close(self.wake_r)
        os.close(self._wake_w)
        self.wake_r = self._wake_w = -1  # drain() after close() must not read a reused descriptor
