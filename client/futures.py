"""One future for several requests (a job split to stay within the daemon's bounds)."""

from __future__ import annotations

import threading
from concurrent.futures import Future


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


def merge_stores(replies: list[dict]) -> dict:
    """STORE replies of a job's requests, as one."""
    return {"results": [x for r in replies for x in r["results"]]}


def merge_retrieves(replies: list[dict]) -> dict:
    """RETRIEVE replies of a job's requests, as one (CPU: no ``done`` event)."""
    return {"ok": [x for r in replies for x in r["ok"]], "failed": [x for r in replies for x in r["failed"]]}
