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

Ordering between this process and the daemon (``host_order``, the default): the daemon's copy
streams never wait on the GPU for an event of this process. A STORE is sent once its gather is
complete (a helper thread waits for it), and a RETRIEVE goes into a staging room only once the
scatter that last read that room is complete (``Ring``); the daemon's answers already follow its
DMA (STORE) or carry its event (RETRIEVE: the scatter waits on the GPU for it, which costs the
engine nothing measurable). Why: on an H200, a co-running bf16 matmul ran 1.072x slower while the
daemon's copy streams waited on this process's interprocess events, 1.019x in host order, at 32
and 49 GB/s (``tierd bench --device cuda --interference --gpu-order device|host``, one run;
``scripts/ctx_probe.py`` isolates the cross-context wait). ``host_order=False`` restores the
GPU-side waits (every request carries ``event``).

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
    """One direction's half of the staging buffer, handed out in request-sized regions. A region
    is free again once its future is done and, with ``device_done`` (host order's RETRIEVE ring:
    the future's result carries the scatter's ``done`` event), once that event has completed."""

    def __init__(self, start: int, nbytes: int, timeout_s: float | None, device_done: bool = False):
        self.start, self.nbytes, self.timeout_s = start, nbytes, timeout_s
        self.device_done = device_done
        self.head = start
        self.held: collections.deque = collections.deque()  # (begin, end, future), oldest first

    def _free(self, fut: Future) -> bool:
        if not fut.done():
            return False
        done = self._scatter_done(fut)
        return done is None or done.query()

    def _scatter_done(self, fut: Future):
        """With ``device_done``: the scatter event of a finished RETRIEVE request (None if failed)."""
        if not self.device_done or fut.exception() is not None:
            return None
        return fut.result().get("done")

    def take(self, size: int) -> int:
        end_all = self.start + self.nbytes
        while True:
            while self.held and self._free(self.held[0][2]):
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
            done = self._scatter_done(oldest)
            if done is not None:
                done.synchronize()  # its scatter has read the room: the daemon may overwrite it

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
        host_order: bool = True,
    ):
        """``host_order`` (the default): the daemon's DMAs never wait on the GPU for this process's
        events; this side waits on the host instead (a STORE is sent once its gather is complete, a
        RETRIEVE into a staging room once that room's earlier scatter is), module doc. False: each
        request carries an interprocess event the daemon's copy stream waits on."""
        self.client, self.instance, self.stager, self.null = client, instance, stager, null
        self.timeout_s = timeout_s
        self.host_order = host_order
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
        self.rings = {
            "STORE": Ring(0, half, timeout_s),
            "RETRIEVE": Ring(half, half, timeout_s, device_done=host_order),
        }
        self._jobs = {op: queue.SimpleQueue() for op in self.rings}
        # (event, then): waits off the I/O thread: every host-order STORE's gather, rare ones else
        self._waits: queue.SimpleQueue = queue.SimpleQueue()
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
            event = self.stager.gather(
                [c["blocks"] for c in batch], at, after=kw["after"], null=self.null, fence=not self.host_order
            )
            if first and kw["touch"]:
                body["touch"] = kw["touch"]
            gathered = self.stager.recorded()
            if self.host_order:
                return self._send_gathered(ring, at, size, body, gathered)
            body["event"] = event
            fut = self.client.call_async("STORE", body, timeout=self.timeout_s)
            ring.hold(at, size, fut)  # the next gather into this room queues behind this one anyway
            read: Future = Future()
            fut.add_done_callback(lambda f: self._when_read(f, gathered, read))
            return read
        body["lease"] = kw["lease"]
        if not self.host_order:  # else this room's earlier scatters are complete (Ring.take waited)
            body["event"] = self.stager.mark()
        scattered: Future = Future()
        fut = self.client.call_async("RETRIEVE", body, timeout=self.timeout_s)
        fut.add_done_callback(lambda f: self._scatter(f, batch, at, scattered, kw.get("after")))
        ring.hold(at, size, scattered)
        return scattered

    def _send_gathered(self, ring: Ring, at: int, size: int, body: dict, gathered) -> Future:
        """Host order's STORE: sent by the helper thread once the gather is complete on the GPU."""
        read: Future = Future()
        ring.hold(at, size, read)

        def send() -> None:
            try:
                fut = self.client.call_async("STORE", body, timeout=self.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - the store fails; the engine recomputes
                read.set_exception(exc)
                return
            fut.add_done_callback(lambda f: _chain(f, read))

        self._waits.put((gathered, send))
        return read

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
