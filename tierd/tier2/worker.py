"""One thread that runs blocking calls in order, each one answered by its deadline.

Hazards:

- A Mooncake call cannot be cancelled. When its deadline passes, its ``done`` future gets the
  fallback answer at once, but the call goes on running on the worker thread (a stopped master
  holds an RPC for 30 s), and every call queued behind it waits. A call whose deadline passes
  while it is still queued is dropped, never started.
- Memory a call reads or writes stays in use until its ``finished`` future resolves, which for a
  timed-out call is later than ``done``. Reusing it earlier lets a late put publish torn bytes
  under a valid key, or a late get overwrite memory that now holds something else.
- Callbacks on ``done`` and ``finished`` run on the worker or the clock thread. Keep them short,
  never block in them, never wait there for another Op (hand off to your own loop instead).
- ``finished`` resolves before ``done`` for a call that returns in time, so a ``done`` callback
  can test ``op.finished.done()`` to know whether the memory is free already. A callback added
  to an Op that is already answered (a call rejected fast) runs at once, in the adding thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

log = logging.getLogger("tierd.l2")


class Op:
    """A submitted call: ``done`` (answer by the deadline), ``finished`` (memory free again)."""

    __slots__ = ("kind", "nbytes", "done", "finished", "timed_out", "submitted", "deadline", "_settled")

    def __init__(self, kind: str, nbytes: int = 0, deadline: float = 0.0):
        self.kind = kind
        self.nbytes = nbytes
        self.done: Future = Future()
        self.finished: Future = Future()
        self.timed_out = False
        self.submitted = time.monotonic()
        self.deadline = deadline
        self._settled = False

    @classmethod
    def answered(cls, kind: str, value) -> Op:
        """An Op that never reached the worker (rejected fast): both futures already resolved."""
        op = cls(kind)
        op._settled = True
        op.finished.set_result(None)
        op.done.set_result(value)
        return op

    def result(self, timeout: float | None = None):
        """Block for the answer (tests, tools; the daemon's loop uses callbacks instead)."""
        return self.done.result(timeout)


class DeadlineWorker:
    """A worker thread for the calls, a clock thread for deadlines and periodic checks."""

    def __init__(self, name: str = "l2"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._deadlines: list[tuple[float, int, Op, object, Callable | None]] = []
        self._periodic: list[list] = []  # [next_at, interval, fn]
        self._seq = itertools.count()
        self._queued: dict[int, Op] = {}
        self._busy: Op | None = None
        self._busy_since: float | None = None
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"{name}-worker", daemon=True)
        self._clock = threading.Thread(target=self._tick, name=f"{name}-clock", daemon=True)
        self._worker.start()
        self._clock.start()

    def submit(
        self, op: Op, fn: Callable[[], object], fallback, on_timeout: Callable[[Op], None] | None = None
    ) -> Op:
        """Queue ``fn``; ``op.done`` gets its value, or ``fallback`` at ``op.deadline``."""
        seq = next(self._seq)
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._queued[seq] = op
                heapq.heappush(self._deadlines, (op.deadline, seq, op, fallback, on_timeout))
                self._wake.notify()
        if closed:
            return Op.answered(op.kind, fallback)
        self._jobs.put((seq, op, fn, fallback))
        return op

    def every(self, interval_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the clock thread every ``interval_s``; it must not block."""
        with self._lock:
            self._periodic.append([time.monotonic() + interval_s, interval_s, fn])
            self._wake.notify()

    @property
    def idle(self) -> bool:
        return self._busy is None and not self._queued

    def backlog(self) -> tuple[int, int, float]:
        """(calls queued or running, their bytes, seconds the running call has run)."""
        with self._lock:
            ops = list(self._queued.values()) + ([self._busy] if self._busy is not None else [])
            since = self._busy_since
        running = time.monotonic() - since if since is not None else 0.0
        return len(ops), sum(op.nbytes for op in ops), running

    def close(self, timeout_s: float) -> bool:
        """Answer every queued call with its fallback, stop both threads; False if the worker is stuck."""
        with self._lock:
            self._closed = True
            pending = [(op, fb) for _, _, op, fb, _ in self._deadlines]
            self._deadlines.clear()
            self._wake.notify()
        for op, fallback in pending:
            self._settle(op, fallback)
        self._jobs.put(None)
        self._worker.join(timeout_s)
        self._clock.join(1.0)
        return not self._worker.is_alive()

    def _settle(self, op: Op, value, timed_out: bool = False) -> bool:
        with self._lock:
            if op._settled:
                return False
            op._settled = True
            op.timed_out = timed_out
        op.done.set_result(value)
        return True

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            seq, op, fn, fallback = job
            with self._lock:
                self._queued.pop(seq, None)
                late = op._settled
                if not late:
                    self._busy, self._busy_since = op, time.monotonic()
            if late:  # answered while queued (deadline or close): never start it
                op.finished.set_result(None)
                continue
            try:
                value = fn()
            except Exception:  # the tier's call wrappers do not raise; this keeps the thread alive
                log.exception("l2 %s call raised", op.kind)
                value = fallback
            with self._lock:
                self._busy = self._busy_since = None
            op.finished.set_result(None)
            self._settle(op, value)

    def _tick(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                expired = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    expired.append(heapq.heappop(self._deadlines))
                due = [p for p in self._periodic if p[0] <= now]
                for p in due:
                    p[0] = now + p[1]
            for _, _, op, fallback, on_timeout in expired:
                if self._settle(op, fallback, timed_out=True) and on_timeout is not None:
                    _quietly(on_timeout, op)
            for p in due:
                _quietly(p[2])
            with self._lock:
                if self._closed:
                    return
                wakes = [d[0] for d in self._deadlines[:1]] + [p[0] for p in self._periodic]
                wait = min(wakes) - time.monotonic() if wakes else 1.0
                if wait > 0:
                    self._wake.wait(min(wait, 1.0))


def _quietly(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("l2 clock callback raised")
