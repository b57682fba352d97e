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
engine nothing measurable). Why: a co-running matmul slows down more while the daemon's copy
streams wait on this process's interprocess events than in host order (docs/findings.md; ``tierd
bench --device cuda --interference --gpu-order device|host`` measures both). ``host_order=False``
restores the GPU-side waits (every request carries ``event``), except on ROCm, whose
interprocess events order nothing between processes (tierd.protocol.copies).

Thread hand-offs (each a wake-up) are the fixed cost of a small request, so a job takes as few as
its ordering allows: a job of one request whose direction is idle is gathered and sent on the
caller's thread (``inline``) when its room is free at once (else it queues for the submitter as
before); a STORE is sent by whoever gathered it when the gather completes within a short spin
(the caller only when the blocks were written already, ``INLINE_SPIN_S``; the submitter when
nothing else waits for it), else by the helper thread; and a caller that waits on a job's future
reads the daemon's answer on its own thread (``tierd_client.rank_jobs.RankJob``), so the answer's
callbacks (a RETRIEVE's scatter) run there too.

``tierd_client.direct_rank.DirectRank`` is the same interface for a rank registered without
staging.

A STORE future is done only once its gathers have read the blocks, whatever the daemon answered
(an answer without a DMA, a refusal or a timeout, can come before the gather ran): the caller
may overwrite the blocks as soon as the future is done (the connector's block-reuse fence). A
job that fails part-way fails only once every request already sent is done, so no scatter of
it is still to be queued when the caller hears of the failure (``scatters_done`` then covers
those queued).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

from tierd.protocol import MAX_REQUEST_PARTS, messages
from tierd.protocol.copies import events_order_processes
from tierd_client.client import blocks_of, typed_chunks
from tierd_client.cuda_stage import Stager
from tierd_client.futures import join, merge_retrieves, merge_stores
from tierd_client.rank_jobs import Loaded, RankJob, chain, spin, stamp
from tierd_client.staging_ring import Ring

MIN_REQUESTS_IN_FLIGHT = 4  # per direction: enough to keep a copy engine busy between requests
INLINE_SPIN_S = 0.0002  # the caller waits this long for its own gather of written blocks, then hands off
SUBMITTER_SPIN_S = 0.005  # the submitter, with nothing queued behind, waits this long for its gather


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
        inline: bool = True,
    ):
        """``host_order`` (the default): the daemon's DMAs never wait on the GPU for this process's
        events; this side waits on the host instead (a STORE is sent once its gather is complete, a
        RETRIEVE into a staging room once that room's earlier scatter is), module doc. False: each
        request carries an interprocess event the daemon's copy stream waits on. ``inline``: a job
        of one request may run on the caller's thread (module doc); False: always the submitter."""
        self.client, self.instance, self.stager, self.null = client, instance, stager, null
        self.timeout_s = timeout_s
        # a list (the bench's breakdown): each request appends its {stage: perf_counter()} stamps
        self.trace: list[dict] | None = None
        # ROCm's interprocess events order nothing between processes: host order there
        self.host_order = host_order or not events_order_processes(stager.torch)
        self.inline = inline
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
        # per direction: jobs not finished by the submitter (an inline job counts while it runs), and
        # the lock whoever runs that direction's jobs holds (jobs of a direction go out in order)
        self._backlog = dict.fromkeys(self.rings, 0)
        self._mutex = threading.Lock()
        self._running = {op: threading.Lock() for op in self.rings}
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
    def store(self, chunks: list, touch: list[bytes] | None = None, after=None) -> Future:
        """Gather and store ``chunks`` (messages.Chunk, or plain maps ``{"key", "blocks": [[ids] per
        group]}`` converted) after the event ``after``; the future's result is a StoreReply."""
        chunks = typed_chunks(chunks)
        out = self._job(chunks)
        self._submit("STORE", (chunks, {"touch": touch, "after": after, "t_call": time.perf_counter()}, out))
        return out

    def retrieve(self, chunks: list, lease: int = 0, after=None) -> Future:
        """Retrieve ``chunks`` into their blocks, the scatter queued after the event ``after`` (if
        given); the future's result is a rank_jobs.Loaded, whose ``done`` event marks the scatter."""
        chunks = typed_chunks(chunks)
        out = self._job(chunks)
        self._submit(
            "RETRIEVE", (chunks, {"lease": lease, "after": after, "t_call": time.perf_counter()}, out)
        )
        return out

    def _job(self, chunks: list[dict]) -> RankJob:
        out = RankJob()
        if len(chunks) <= self.per_request:
            out.alone = self._alone
        return out

    def _alone(self) -> bool:
        """At most one request of this rank in flight (the waiting job's own)."""
        return sum(not f.done() for ring in self.rings.values() for _, _, f in list(ring.held)) <= 1

    def _submit(self, op: str, job: tuple) -> None:
        chunks = job[0]
        with self._mutex:
            inline = self.inline and not self._backlog[op] and 0 < len(chunks) <= self.per_request
            self._backlog[op] += 1
        if not (inline and self._run_inline(op, job)):
            self._jobs[op].put(job)  # the submitter runs it, and counts it done

    def _run_inline(self, op: str, job: tuple) -> bool:
        """Gather and send a one-request job on this thread if its room is free now; False (nothing
        done, the job still counted) when it is not."""
        chunks, kw, out = job
        ring = self.rings[op]
        with self._running[op]:
            at = ring.try_take(len(chunks) * self.stager.chunk_bytes)
            if at is None:
                return False
            self._run(op, ring, chunks, kw, out, at)
        with self._mutex:
            self._backlog[op] -= 1
        return True

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
            with self._running[op]:
                self._run(op, ring, *job)
            with self._mutex:
                self._backlog[op] -= 1

    def _run(
        self, op: str, ring: Ring, chunks: list[dict], kw: dict, out: Future, at: int | None = None
    ) -> None:
        """Send a job's requests (the first into room ``at`` when taken already) and join them."""
        merge = merge_stores if op == "STORE" else self._merge_retrieves
        parts: list[Future] = []
        kw = {**kw, "job": out}
        try:
            for i, batch in enumerate(self._batches(chunks)):
                parts.append(self._send(op, ring, batch, kw, first=(i == 0), at=at if i == 0 else None))
        except BaseException as exc:  # noqa: BLE001 - the job fails as a whole; the engine recomputes
            join(parts, out, merge, error=exc)  # once the requests already sent are done
            return
        join(parts, out, merge)

    def _send(
        self, op: str, ring: Ring, batch: list[dict], kw: dict, first: bool, at: int | None = None
    ) -> Future:
        rec = self._record(op, kw, first)
        size = len(batch) * self.stager.chunk_bytes
        if at is None:
            at = ring.take(size)
        stamp(rec, "taken")
        if op == "STORE":
            event = self.stager.gather(
                [blocks_of(c) for c in batch],
                at,
                after=kw["after"],
                null=self.null,
                fence=not self.host_order,
            )
            touch = (kw["touch"] or []) if first else []
            gathered = self.stager.recorded()
            stamp(rec, "launched")
            if self.host_order:
                body = messages.Store(self.instance, batch, touch=touch, staged_at=at)
                return self._send_gathered(ring, at, size, body, gathered, rec, self._spin_s(kw), kw["job"])
            body = messages.Store(self.instance, batch, touch=touch, event=event, staged_at=at)
            fut = kw["job"].sent(self.client.call_async("STORE", body, timeout=self.timeout_s))
            ring.hold(at, size, fut)  # the next gather into this room queues behind this one anyway
            read: Future = Future()
            fut.add_done_callback(lambda f: self._when_read(f, gathered, read))
            return read
        # host order: this room's earlier scatters are complete (Ring.take waited), no event
        event = None if self.host_order else self.stager.mark()
        body = messages.Retrieve(self.instance, batch, lease=kw["lease"], event=event, staged_at=at)
        scattered: Future = Future()
        fut = kw["job"].sent(self.client.call_async("RETRIEVE", body, timeout=self.timeout_s))
        stamp(rec, "sent")
        ids = [blocks_of(c) for c in batch]
        try:  # while the daemon copies: the answer then only has the scatter launched
            prepared = self.stager.prepare_scatter(ids, at, null=self.null)
        except Exception:  # noqa: BLE001 - planned again when the answer comes, and fails there
            prepared = None
        fut.add_done_callback(lambda f: self._scatter(f, ids, at, scattered, kw.get("after"), rec, prepared))
        ring.hold(at, size, scattered)
        return scattered

    def _record(self, op: str, kw: dict, first: bool) -> dict | None:
        """The trace record of a request (None unless tracing): the job's call time, then stages."""
        if self.trace is None:
            return None
        now = time.perf_counter()
        rec = {"op": op, "first": first, "call": kw.get("t_call", now) if first else now, "start": now}
        self.trace.append(rec)
        return rec

    def _spin_s(self, kw: dict) -> float:
        """How long the thread that gathered a STORE waits for its gather before handing the send to
        the helper thread (module doc)."""
        if threading.current_thread() in self._threads and not self._jobs["STORE"].empty():
            return 0.0  # more jobs to gather: the helper thread sends this one
        after = kw.get("after")
        if after is not None and not after.query():
            return 0.0  # the forward is still writing the blocks: the helper thread waits for it
        return SUBMITTER_SPIN_S if threading.current_thread() in self._threads else INLINE_SPIN_S

    def _send_gathered(
        self, ring: Ring, at: int, size: int, body: dict, gathered, rec=None, spin_s: float = 0.0, job=None
    ) -> Future:
        """Host order's STORE: sent once the gather is complete on the GPU, by this thread if that
        happens within ``spin_s``, else by the helper thread."""
        read: Future = Future()
        ring.hold(at, size, read)

        def send() -> None:
            stamp(rec, "gathered")
            try:
                fut = self.client.call_async("STORE", body, timeout=self.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - the store fails; the engine recomputes
                read.set_exception(exc)
                return
            if job is not None:
                job.sent(fut)
            stamp(rec, "sent")
            fut.add_done_callback(lambda f: (stamp(rec, "answered"), chain(f, read)))

        if spin_s > 0 and spin(gathered, spin_s):
            send()
        else:
            self._waits.put((gathered, send))
        return read

    def _when_read(self, fut: Future, gathered, out: Future) -> None:
        """Pass the daemon's STORE answer on once the gather has read the blocks. After a DMA it has
        (the DMA waited for it); an answer without one may come first, and then a helper thread,
        not the client's I/O thread, waits for the gather."""
        if gathered.query():
            chain(fut, out)
        else:
            self._waits.put((gathered, lambda: chain(fut, out)))

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

    def _scatter(
        self, fut: Future, ids: list, at: int, out: Future, ready=None, rec=None, prepared=None
    ) -> None:
        """On the daemon's answer (the client's I/O thread): scatter what was restored (``ids``:
        per chunk, per group, the block ids; ``prepared``: their scatter planned ahead)."""
        stamp(rec, "answered")
        exc = fut.exception()
        if exc is not None:
            self.stager.release(prepared)
            out.set_exception(exc)
            return
        reply = fut.result()
        try:
            skip = {(int(g), int(b)) for g, b in reply.failed}
            done = self.stager.scatter(
                ids, at, null=self.null, skip=skip, after=reply.event, ready=ready, prepared=prepared
            )
        except BaseException as e:  # noqa: BLE001 - the load failed: the engine recomputes
            self.stager.release(prepared)
            out.set_exception(e)
            return
        stamp(rec, "scattered")
        out.set_result(Loaded(reply.ok, reply.failed, done))

    def _merge_retrieves(self, replies: list[Loaded]) -> Loaded:
        """One reply; its ``done`` follows every part's scatter (the parts' answers, and so their
        scatters, may come in any order: an event recorded now, when all are queued)."""
        done = replies[0].done if len(replies) == 1 else self.scatters_done() if replies else None
        merged = merge_retrieves(replies)
        return Loaded(merged.ok, merged.failed, done)

    def _batches(self, chunks: list[dict]):
        for i in range(0, len(chunks), self.per_request):
            yield chunks[i : i + self.per_request]
