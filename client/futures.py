"""One future for several requests (a job split to stay within the daemon's bounds), and asking a
future whether it is done the way a polling thread should."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from tierd.protocol import messages


def failed(exc: BaseException) -> Future:
    """A future that already ended in ``exc``."""
    out: Future = Future()
    out.set_exception(exc)
    return out


def polled(fut: Future) -> bool:
    """Whether ``fut`` is done, after reading on this thread what the client's sockets hold for it
    (its ``poll``: a request's Reply, a GPU rank's job); any other future just says."""
    poll = getattr(fut, "poll", None)
    return fut.done() or (poll is not None and poll())


def join(parts: list[Future], out: Future, merge, error: BaseException | None = None) -> None:
    """Resolve ``out`` once all ``parts`` are done: with ``error`` if given, else their first error,
    else their merged results (``merge`` of their results, in order)."""
    if not parts:
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(merge([]))
        return
    left = [len(parts)]
    lock = threading.Lock()

    def one(_f: Future) -> None:
        with lock:  # callbacks run on the I/O thread, or in the caller for a future already done
            left[0] -= 1
            if left[0]:
                return
        if error is not None:
            out.set_exception(error)
            return
        for f in parts:
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
        out.set_result(merge([f.result() for f in parts]))

    for f in parts:
        f.add_done_callback(one)


def merge_stores(replies: list[messages.StoreReply]) -> messages.StoreReply:
    """STORE replies of a job's requests, as one."""
    return messages.StoreReply([x for r in replies for x in r.results])


def merge_retrieves(replies: list[messages.RetrieveReply]) -> messages.RetrieveReply:
    """RETRIEVE replies of a job's requests, as one (without their CUDA events)."""
    return messages.RetrieveReply([x for r in replies for x in r.ok], [x for r in replies for x in r.failed])
