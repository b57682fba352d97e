"""What both kinds of GPU rank (tierd_client.staged_rank.StagedRank, with a staging buffer, and
tierd_client.direct_rank.DirectRank, without) hand their caller: a job's future that reads its own
answer on the waiting thread, and the small helpers their sending threads share."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from tierd_client.futures import polled


@dataclass(frozen=True)
class Loaded:
    """What a GPU rank's RETRIEVE (one request's, or a job's requests merged) ends in: the daemon's
    RetrieveReply (``ok`` per chunk, ``failed`` [group, block id] not restored) and ``done``, the
    CUDA event that follows its scatters into the engine's blocks (None: nothing was scattered)."""

    ok: list[bool] = field(default_factory=list)
    failed: list = field(default_factory=list)
    done: object = None


class RankJob(Future):
    """A job's future. A thread that waits on it first reads the daemon's answer to the job's
    request itself (a Reply pumps the client's socket: tierd_client.transport), one wake-up of
    another thread less before the caller sees it; only a job of one request that is alone in
    flight for its rank (``alone()``): pumping holds the client's socket for up to a few
    milliseconds, which would hold back the other requests' sends and answers."""

    alone = None  # () -> bool, set by the rank

    def __init__(self):
        super().__init__()
        self.replies: list[Future] = []  # every request's Reply, in the order sent

    def sent(self, reply: Future) -> Future:
        """Note ``reply`` (the future of one of the job's requests, just sent); returns it."""
        self.replies.append(reply)
        return reply

    @property
    def reply(self) -> Future | None:
        """Its last request's Reply (what a job of one request waits on)."""
        return self.replies[-1] if self.replies else None

    def result(self, timeout: float | None = None):
        return super().result(self._pump(timeout))

    def exception(self, timeout: float | None = None):
        return super().exception(self._pump(timeout))

    def poll(self) -> bool:
        """Whether the job has its answer, once what the client's sockets hold for its requests now
        has been read on this thread (``Reply.poll`` of each still open; for any job: it never
        waits). A job split in several requests ends when the last of them does."""
        for reply in list(self.replies):
            if self.done():
                break
            polled(reply)
        return self.done()

    def _pump(self, timeout: float | None) -> float | None:
        reply = self.reply
        if reply is None or self.done() or reply.done() or timeout == 0 or not (self.alone and self.alone()):
            return timeout
        t0 = time.monotonic()
        try:
            reply.exception(timeout)
        except Exception:  # noqa: BLE001 - timed out: the wait below says so
            pass
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))


def spin(event, seconds: float) -> bool:
    """Whether ``event`` completes within ``seconds``, polled (a yield between polls)."""
    end = time.perf_counter() + seconds
    while not event.query():
        if time.perf_counter() >= end:
            return False
        os.sched_yield()
    return True


def stamp(rec: dict | None, stage: str) -> None:
    if rec is not None:
        rec[stage] = time.perf_counter()


def chain(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())
