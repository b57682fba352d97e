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
gather waits (on the GPU) for ``after``, the event the caller recorded after writing the blocks,
and a RETRIEVE's scatter for its ``after``, recorded where the blocks may be overwritten.

A STORE future is done only once its gathers have read the blocks, whatever the daemon answered
(an answer without a DMA, a refusal or a timeout, can come before the gather ran): the caller
may overwrite the blocks as soon as the future is done (the connector's block-reuse fence). A
job that fails part-way fails only once every request already sent is done, so no scatter of
it is still to be queued when the caller hears of the failure (``scatters_done`` then covers
those queued).
"""

from __future__ import annotations

import collections
import queue
import threading
from concurrent.futures import Future

from tierd.protocol import MAX_REQUEST_PARTS
from tierd_client.cuda_stage import Stager
from tierd_client.futures import join, merge_retrieves, merge_stores

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
    def __init__(
        self,
        client,
        instance: str,
        stager: Stager,
        null: int = -1,
        request_bytes: int | None = None,
        timeout_s: float | None = None,
    ):
        self.client, self.instance, self.stager, self.null = client, instance, stager, null
        self.timeout_s = timeout_s
        half = stager.nbytes // 2 // stager.chunk_bytes * stager.chunk_bytes
        if half < stager.chunk_bytes:
            raise ValueError(
                f"a staging buffer of {stager.nbytes} bytes cannot hold a chunk each way "
                f"({stager.chunk_bytes} bytes)"
            )
        cap = min(request_bytes or half, max(stager.chunk_bytes, half // MIN_REQUESTS_IN_FLIGHT))
        # and within the daemon's bound on one request (chunks x groups), as TierdClient splits its own
        bound = MAX_REQUEST_PARTS // max(1, len(stager.groups))
        self.per_request = max(1, min(cap // stager.chunk_bytes, bound))
        self.rings = {"STORE": Ring(0, half, timeout_s), "RETRIEVE": Ring(half, half, timeout_s)}
        self._jobs = {op: queue.SimpleQueue() for op in self.rings}
        self._waits: queue.SimpleQueue = queue.SimpleQueue()  # (event, then): rare waits, off the I/O thread
        self._threads = [
            threading.Thread(
                target=self._submitter, args=(op,), daemon=True, name=f"tierd-stage-{op.lower()}"
            )
            for op in self.rings
        ]
        self._threads.append(threading.Thread(target=self._wait_events, daemon=True, name="tierd-stage-wait"))
        for t in self._threads:
            t.start()

    # ---- jobs ---------------------------------------------------------------------------------
    def store(self, chunks: list[dict], touch: list[bytes] | None = None, after=None) -> Future:
        """Gather and store ``chunks`` ([{"key", "blocks": [[ids] per group]}]) after the event ``after``."""
        out: Future = Future()
        self._jobs["STORE"].put((chunks, {"touch": touch, "after": after}, out))
        return out

    def retrieve(self, chunks: list[dict], lease: int = 0, after=None) -> Future:
        """Retrieve ``chunks`` into their blocks, the scatter queued after the event ``after`` (if
        given); the future's ``"done"`` event marks the scatter."""
        out: Future = Future()
        self._jobs["RETRIEVE"].put((chunks, {"lease": lease, "after": after}, out))
        return out

    def scatters_done(self):
        """A CUDA event after every scatter queued so far (a failed load's blocks are free of them
        once it completes)."""
        return self.stager.recorded(scatter=True)

    def close(self) -> None:
        for q in self._jobs.values():
            q.put(None)
        self._waits.put(None)
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
            merge = merge_stores if op == "STORE" else self._merge_retrieves
            parts: list[Future] = []
            try:
                for i, batch in enumerate(self._batches(chunks)):
                    parts.append(self._send(op, ring, batch, kw, first=(i == 0)))
            except BaseException as exc:  # noqa: BLE001 - the job fails as a whole; the engine recomputes
                join(parts, out, merge, error=exc)  # once the requests already sent are done
                continue
            join(parts, out, merge)

    def _send(self, op: str, ring: Ring, batch: list[dict], kw: dict, first: bool) -> Future:
        size = len(batch) * self.stager.chunk_bytes
        at = ring.take(size)
        body = {"instance": self.instance, "chunks": batch, "staged_at": at}
        if op == "STORE":
            body["event"] = self.stager.gather(
                [c["blocks"] for c in batch], at, after=kw["after"], null=self.null
            )
            if first and kw["touch"]:
                body["touch"] = kw["touch"]
            gathered = self.stager.recorded()
            fut = self.client.call_async("STORE", body, timeout=self.timeout_s)
            ring.hold(at, size, fut)  # the next gather into this room queues behind this one anyway
            read: Future = Future()
            fut.add_done_callback(lambda f: self._when_read(f, gathered, read))
            return read
        body["lease"], body["event"] = kw["lease"], self.stager.mark()
        scattered: Future = Future()
        fut = self.client.call_async("RETRIEVE", body, timeout=self.timeout_s)
        fut.add_done_callback(lambda f: self._scatter(f, batch, at, scattered, kw.get("after")))
        ring.hold(at, size, scattered)
        return scattered

    def _when_read(self, fut: Future, gathered, out: Future) -> None:
        """Pass the daemon's STORE answer on once the gather has read the blocks. After a DMA it has
        (the DMA waited for it); an answer without one may come first, and then a helper thread,
        not the client's I/O thread, waits for the gather."""
        if gathered.query():
            _chain(fut, out)
        else:
            self._waits.put((gathered, lambda: _chain(fut, out)))

    def _wait_events(self) -> None:
        while True:
            item = self._waits.get()
            if item is None:
                return
            event, then = item
            try:
                event.synchronize()
            finally:
                then()

    def _scatter(self, fut: Future, batch: list[dict], at: int, out: Future, ready=None) -> None:
        """On the daemon's answer (the client's I/O thread): scatter what was restored."""
        exc = fut.exception()
        if exc is not None:
            out.set_exception(exc)
            return
        reply = fut.result()
        try:
            skip = {(int(g), int(b)) for g, b in reply.get("failed", ())}
            done = self.stager.scatter(
                [c["blocks"] for c in batch],
                at,
                null=self.null,
                skip=skip,
                after=reply.get("event"),
                ready=ready,
            )
        except BaseException as e:  # noqa: BLE001 - the load failed: the engine recomputes
            out.set_exception(e)
            return
        out.set_result({**reply, "done": done})

    def _merge_retrieves(self, replies: list[dict]) -> dict:
        """One reply; its ``done`` follows every part's scatter (the parts' answers, and so their
        scatters, may come in any order: an event recorded now, when all are queued)."""
        done = replies[0]["done"] if len(replies) == 1 else self.scatters_done() if replies else None
        return {**merge_retrieves(replies), "done": done}

    def _batches(self, chunks: list[dict]):
        for i in range(0, len(chunks), self.per_request):
            yield chunks[i : i + self.per_request]


def _chain(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())
