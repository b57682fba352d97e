"""STORE and RETRIEVE for a GPU rank through its staging buffer (tierd_client.cuda_stage): what the
vLLM worker and ``tierd bench --device cuda`` both call.

``store`` and ``retrieve`` never block their caller (the engine's forward thread): a job goes to
the direction's submitter thread, which cuts it into requests of at most ``request_bytes``,
takes room for each in that direction's half of the staging buffer (waiting for the oldest
request in flight when the half is full: back-pressure, not unbounded staging), gathers
(STORE) and sends. So the engine gathers request k+1 while the daemon DMAs request k, and
stores and retrieves never wait for each other's room. A STORE's room is given back when the
daemon answers (its bytes are in the pool); a RETRIEVE's when its scatter is queued (later
staging work is ordered behind it on the staging stream).

The futures carry the whole job's reply in the daemon's shape (``{"results": [...]}``;
``{"ok": [...], "failed": [[group, block], ...]}``), the retrieve's with a ``"done"`` CUDA event:
its blocks may be read once that completes (or after the reader's stream waits on it). A STORE's
gather waits (on the GPU) for ``after``, the event the caller recorded after writing the blocks:
the caller may then overwrite them only once the future is done (the connector's fence).
"""

from __future__ import annotations

import collections
import queue
import threading
from concurrent.futures import Future

from tierd_client.cuda_stage import Stager

MIN_REQUESTS_IN_FLIGHT = 4  # per direction: enough to keep a copy engine busy between requests


class Ring:
    """One direction's half of the staging buffer, handed out in request-sized regions."""

    def __init__(self, start: int, nbytes: int, timeout_s: float | None):
        self.start, self.nbytes, self.timeout_s = start, nbytes, timeout_s
        self.head = start
        self.held: collections.deque = collections.deque()  # (begin, end, future), oldest first

    def take(self, size: int) -> int:
        end_all = self.start + self.nbytes
        while True:
            while self.held and self.held[0][2].done():
                self.held.popleft()
            at = self.head if self.head + size <= end_all else self.start
            if not any(at < e and b < at + size for b, e, _ in self.held):
                self.head = at + size
                return at
            oldest = self.held.popleft()[2]
            try:
                oldest.result(timeout=self.timeout_s)
            except Exception:  # noqa: BLE001 - failed or timed out: its room is free either way
                pass

    def hold(self, at: int, size: int, fut: Future) -> None:
        self.held.append((at, at + size, fut))


class StagedRank:
    def __init__(self, client, instance: str, stager: Stager, null: int = -1, request_bytes: int | None = None,
                 timeout_s: float | None = None):
        self.client, self.instance, self.stager, self.null = client, instance, stager, null
        self.timeout_s = timeout_s
        half = stager.nbytes // 2 // stager.chunk_bytes * stager.chunk_bytes
        if half < stager.chunk_bytes:
            raise ValueError(f"a staging buffer of {stager.nbytes} bytes cannot hold a chunk each way "
                             f"({stager.chunk_bytes} bytes)")
        cap = min(request_bytes or half, max(stager.chunk_bytes, half // MIN_REQUESTS_IN_FLIGHT))
        self.per_request = max(1, cap // stager.chunk_bytes)
        self.rings = {"STORE": Ring(0, half, timeout_s), "RETRIEVE": Ring(half, half, timeout_s)}
        self._jobs = {op: queue.SimpleQueue() for op in self.rings}
        self._threads = [threading.Thread(target=self._submitter, args=(op,), daemon=True,
                                          name=f"tierd-stage-{op.lower()}") for op in self.rings]
        for t in self._threads:
            t.start()

    # ---- jobs ---------------------------------------------------------------------------------
    def store(self, chunks: list[dict], touch: list[bytes] | None = None, after=None) -> Future:
        """Gather and store ``chunks`` ([{"key", "blocks": [[ids] per group]}]) after the event ``after``."""
        out: Future = Future()
        self._jobs["STORE"].put((chunks, {"touch": touch, "after": after}, out))
        return out

    def retrieve(self, chunks: list[dict], lease: int = 0) -> Future:
        """Retrieve ``chunks`` into their blocks; the future's ``"done"`` event marks the scatter."""
        out: Future = Future()
        self._jobs["RETRIEVE"].put((chunks, {"lease": lease}, out))
        return out

    def close(self) -> None:
        for q in self._jobs.values():
            q.put(None)
        for t in self._threads:
            t.join(5)

    def idle(self, timeout: float | None = None) -> None:
        """Wait until no request is in flight (shutdown, benchmarks)."""
        for ring in self.rings.values():
            for _, _, fut in list(ring.held):
                try:
                    fut.result(timeout=timeout)
                except Exception:  # noqa: BLE001
                    pass

    # ---- the submitter threads ----------------------------------------------------------------
    def _submitter(self, op: str) -> None:
        jobs, ring = self._jobs[op], self.rings[op]
        while True:
            job = jobs.get()
            if job is None:
                return
            chunks, kw, out = job
            try:
                parts = [self._send(op, ring, batch, kw, first=(i == 0)) for i, batch in enumerate(self._batches(chunks))]
            except BaseException as exc:  # noqa: BLE001 - the job fails as a whole; the engine recomputes
                out.set_exception(exc)
                continue
            _join(parts, out, _merge_stores if op == "STORE" else _merge_retrieves)

    def _send(self, op: str, ring: Ring, batch: list[dict], kw: dict, first: bool) -> Future:
        size = len(batch) * self.stager.chunk_bytes
        at = ring.take(size)
        body = {"instance": self.instance, "chunks": batch, "staged_at": at}
        if op == "STORE":
            body["event"] = self.stager.gather([c["blocks"] for c in batch], at, after=kw["after"], null=self.null)
            if first and kw["touch"]:
                body["touch"] = kw["touch"]
            fut = self.client.call_async("STORE", body, timeout=self.timeout_s)
            ring.hold(at, size, fut)
            return fut
        body["lease"], body["event"] = kw["lease"], self.stager.mark()
        scattered: Future = Future()
        fut = self.client.call_async("RETRIEVE", body, timeout=self.timeout_s)
        fut.add_done_callback(lambda f: self._scatter(f, batch, at, scattered))
        ring.hold(at, size, scattered)
        return scattered

    def _scatter(self, fut: Future, batch: list[dict], at: int, out: Future) -> None:
        """On the daemon's answer (the client's I/O thread): scatter what was restored."""
        exc = fut.exception()
        if exc is not None:
            out.set_exception(exc)
            return
        reply = fut.result()
        try:
            skip = {(int(g), int(b)) for g, b in reply.get("failed", ())}
            done = self.stager.scatter([c["blocks"] for c in batch], at, null=self.null, skip=skip,
                                       after=reply.get("event"))
        except BaseException as e:  # noqa: BLE001 - the load failed: the engine recomputes
            out.set_exception(e)
            return
        out.set_result({**reply, "done": done})

    def _batches(self, chunks: list[dict]):
        for i in range(0, len(chunks), self.per_request):
            yield chunks[i: i + self.per_request]


def _merge_stores(replies: list[dict]) -> dict:
    return {"results": [x for r in replies for x in r["results"]]}


def _merge_retrieves(replies: list[dict]) -> dict:
    return {"ok": [x for r in replies for x in r["ok"]], "failed": [x for r in replies for x in r["failed"]],
            "done": replies[-1]["done"] if replies else None}


def _join(parts: list[Future], out: Future, merge) -> None:
    """Resolve ``out`` with the merged results of ``parts`` once all are done, or their first error."""
    if not parts:
        out.set_result(merge([]))
        return
    left = [len(parts)]
    lock = threading.Lock()

    def one(_f: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        for f in parts:
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
        out.set_result(merge([f.result() for f in parts]))

    for f in parts:
        f.add_done_callback(one)
