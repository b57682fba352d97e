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

Thread hand-offs are the fixed cost of a small request (each a wake-up, 0.05-0.2 ms on a
virtualised host), so a job takes as few as its ordering allows: a job of one request whose
direction is idle is gathered and sent on the caller's thread (``inline``) when its room is free
at once (else it queues for the submitter as before); a STORE is sent by whoever gathered it
when the gather completes within a short spin (the caller only when the blocks were written
already, ``INLINE_SPIN_S``; the submitter when nothing else waits for it), else by the helper
thread; and a caller that waits on a job's future reads the daemon's answer on its own thread
(``_Job``), so the answer's callbacks (a RETRIEVE's scatter) run there too.

``DirectRank`` is the same interface for a rank registered without staging (the daemon copies
straight between its KV blocks and the pool: tierd.transfer.cuda): no gather, no scatter, no
room; only the ordering on this side's host.

A STORE future is done only once its gathers have read the blocks, whatever the daemon answered
(an answer without a DMA, a refusal or a timeout, can come before the gather ran): the caller
may overwrite the blocks as soon as the future is done (the connector's block-reuse fence). A
job that fails part-way fails only once every request already sent is done, so no scatter of
it is still to be queued when the caller hears of the failure (``scatters_done`` then covers
those queued).
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from concurrent.futures import Future

from tierd.protocol import MAX_REQUEST_PARTS
from tierd_client.cuda_stage import MAX_PEER_EVENTS, Stager
from tierd_client.futures import join, merge_retrieves, merge_stores

MIN_REQUESTS_IN_FLIGHT = 4  # per direction: enough to keep a copy engine busy between requests
INLINE_SPIN_S = 0.0002  # the caller waits this long for its own gather of written blocks, then hands off
SUBMITTER_SPIN_S = 0.005  # the submitter, with nothing queued behind, waits this long for its gather


class _Job(Future):
    """A job's future. A thread that waits on it first reads the daemon's answer to the job's
    request itself (a Reply pumps the client's socket: tierd_client.transport), one wake-up of
    another thread less before the caller sees it; only a job of one request that is alone in
    flight for its rank (``alone()``): pumping holds the client's socket for up to a few
    milliseconds, which would hold back the other requests' sends and answers."""

    reply: Future | None = None
    alone = None  # () -> bool, set by the rank

    def result(self, timeout: float | None = None):
        return super().result(self._pump(timeout))

    def exception(self, timeout: float | None = None):
        return super().exception(self._pump(timeout))

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

    def try_take(self, size: int) -> int | None:
        """``take`` without waiting: None when the room is still held."""
        while self.held and self._free(self.held[0][2]):
            self.held.popleft()
        at = self.head if self.head + size <= self.start + self.nbytes else self.start
        if any(at < e and b < at + size for b, e, _ in self.held):
            return None
        self.head = at + size
        return at

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
        self.host_order = host_order
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
    def store(self, chunks: list[dict], touch: list[bytes] | None = None, after=None) -> Future:
        """Gather and store ``chunks`` ([{"key", "blocks": [[ids] per group]}]) after the event ``after``."""
        out = self._job(chunks)
        self._submit("STORE", (chunks, {"touch": touch, "after": after, "t_call": time.perf_counter()}, out))
        return out

    def retrieve(self, chunks: list[dict], lease: int = 0, after=None) -> Future:
        """Retrieve ``chunks`` into their blocks, the scatter queued after the event ``after`` (if
        given); the future's ``"done"`` event marks the scatter."""
        out = self._job(chunks)
        self._submit(
            "RETRIEVE", (chunks, {"lease": lease, "after": after, "t_call": time.perf_counter()}, out)
        )
        return out

    def _job(self, chunks: list[dict]) -> _Job:
        out = _Job()
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
        _stamp(rec, "taken")
        body = {"instance": self.instance, "chunks": batch, "staged_at": at}
        if op == "STORE":
            event = self.stager.gather(
                [c["blocks"] for c in batch], at, after=kw["after"], null=self.null, fence=not self.host_order
            )
            if first and kw["touch"]:
                body["touch"] = kw["touch"]
            gathered = self.stager.recorded()
            _stamp(rec, "launched")
            if self.host_order:
                return self._send_gathered(ring, at, size, body, gathered, rec, self._spin_s(kw), kw["job"])
            body["event"] = event
            fut = kw["job"].reply = self.client.call_async("STORE", body, timeout=self.timeout_s)
            ring.hold(at, size, fut)  # the next gather into this room queues behind this one anyway
            read: Future = Future()
            fut.add_done_callback(lambda f: self._when_read(f, gathered, read))
            return read
        body["lease"] = kw["lease"]
        if not self.host_order:  # else this room's earlier scatters are complete (Ring.take waited)
            body["event"] = self.stager.mark()
        scattered: Future = Future()
        fut = kw["job"].reply = self.client.call_async("RETRIEVE", body, timeout=self.timeout_s)
        _stamp(rec, "sent")
        fut.add_done_callback(lambda f: self._scatter(f, batch, at, scattered, kw.get("after"), rec))
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
            _stamp(rec, "gathered")
            try:
                fut = self.client.call_async("STORE", body, timeout=self.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - the store fails; the engine recomputes
                read.set_exception(exc)
                return
            if job is not None:
                job.reply = fut
            _stamp(rec, "sent")
            fut.add_done_callback(lambda f: (_stamp(rec, "answered"), _chain(f, read)))

        if spin_s > 0 and _spin(gathered, spin_s):
            send()
        else:
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

    def _scatter(self, fut: Future, batch: list[dict], at: int, out: Future, ready=None, rec=None) -> None:
        """On the daemon's answer (the client's I/O thread): scatter what was restored."""
        _stamp(rec, "answered")
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
        _stamp(rec, "scattered")
        out.set_result({**reply, "done": done})

    def _merge_retrieves(self, replies: list[dict]) -> dict:
        """One reply; its ``done`` follows every part's scatter (the parts' answers, and so their
        scatters, may come in any order: an event recorded now, when all are queued)."""
        done = replies[0]["done"] if len(replies) == 1 else self.scatters_done() if replies else None
        return {**merge_retrieves(replies), "done": done}

    def _batches(self, chunks: list[dict]):
        for i in range(0, len(chunks), self.per_request):
            yield chunks[i : i + self.per_request]


class DirectRank:
    """STORE and RETRIEVE for a GPU rank registered without a staging buffer: the daemon copies
    straight between the rank's KV blocks and its pool (tierd.transfer.cuda, direct ranks), with
    no SM work on either side. This side only orders: a STORE goes out once ``after`` (recorded
    after the forward's KV writes) has completed, a RETRIEVE once its ``after`` (recorded where
    the blocks may be overwritten) has, checked on the host (on the caller's thread when it has
    completed already, else on the direction's helper thread; a direction's jobs go out in
    order). A STORE's future is done once the daemon's copies have read the blocks (its answer
    follows them); a RETRIEVE's result carries ``done``, the daemon's interprocess event, complete
    once its copies into the blocks are: read them after it (or after a stream waited on it)."""

    def __init__(self, client, instance: str, device, groups: int = 1, null: int = -1, timeout_s=None):
        self.client, self.instance, self.device, self.null = client, instance, device, null
        self.timeout_s = timeout_s
        self.trace: list[dict] | None = None  # as StagedRank's
        self.per_request = max(1, MAX_REQUEST_PARTS // max(1, groups))
        self._events: dict[bytes, object] = {}
        self._last_done = None
        self._mutex = threading.Lock()
        self._backlog = {"STORE": 0, "RETRIEVE": 0}
        self._waits = {op: queue.SimpleQueue() for op in self._backlog}
        self._inflight: set[Future] = set()
        self._threads = [
            threading.Thread(target=self._helper, args=(op,), daemon=True, name=f"tierd-direct-{op.lower()}")
            for op in self._backlog
        ]
        for t in self._threads:
            t.start()

    def store(self, chunks: list[dict], touch: list[bytes] | None = None, after=None) -> Future:
        return self._order("STORE", chunks, {"touch": touch} if touch else {}, after)

    def retrieve(self, chunks: list[dict], lease: int = 0, after=None) -> Future:
        return self._order("RETRIEVE", chunks, {"lease": lease}, after)

    def scatters_done(self):
        """An event complete once every retrieve copy answered so far is (nothing to wait for: None
        is never returned, a recorded event is)."""
        if self._last_done is not None:
            return self._last_done
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def close(self) -> None:
        for q in self._waits.values():
            q.put(None)
        for t in self._threads:
            t.join(5)

    def idle(self, timeout: float | None = None) -> None:
        for fut in list(self._inflight):
            try:
                fut.result(timeout=timeout)
            except Exception:  # noqa: BLE001
                pass

    # ---- ordering and sending -----------------------------------------------------------------
    def _order(self, op: str, chunks: list[dict], extra: dict, after) -> Future:
        out = _Job()
        if len(chunks) <= self.per_request:
            out.alone = lambda: len(self._inflight) <= 1
        t_call = time.perf_counter()
        self._inflight.add(out)
        out.add_done_callback(self._inflight.discard)
        with self._mutex:
            now = not self._backlog[op] and (after is None or after.query())
            if not now:
                self._backlog[op] += 1
        if now:
            self._send(op, chunks, extra, out, t_call)
        else:
            self._waits[op].put((after, chunks, extra, out, t_call))
        return out

    def _helper(self, op: str) -> None:
        while True:
            item = self._waits[op].get()
            if item is None:
                return
            after, chunks, extra, out, t_call = item
            try:
                if after is not None:
                    after.synchronize()
                self._send(op, chunks, extra, out, t_call)
            finally:
                with self._mutex:
                    self._backlog[op] -= 1

    def _send(self, op: str, chunks: list[dict], extra: dict, out: _Job, t_call: float) -> None:
        merge = merge_stores if op == "STORE" else self._merge_retrieves
        parts: list[Future] = []
        try:
            for i in range(0, len(chunks), self.per_request):
                rec = None
                if self.trace is not None:
                    now = time.perf_counter()
                    rec = {"op": op, "first": i == 0, "call": t_call if i == 0 else now, "start": now}
                    self.trace.append(rec)
                body = {"instance": self.instance, "chunks": chunks[i : i + self.per_request]}
                if i == 0 or op == "RETRIEVE":
                    body.update(extra)
                fut = out.reply = self.client.call_async(op, body, timeout=self.timeout_s)
                _stamp(rec, "sent")
                if rec is not None:
                    fut.add_done_callback(lambda _f, rec=rec: _stamp(rec, "answered"))
                parts.append(fut)
        except BaseException as exc:  # noqa: BLE001 - the job fails as a whole; the engine recomputes
            join(parts, out, merge, error=exc)
            return
        join(parts, out, merge)

    def _merge_retrieves(self, replies: list[dict]) -> dict:
        """One reply; ``done`` is the daemon's event of the last answer (its copy stream runs them in
        order, and it records that event after each)."""
        handle = next((r.get("event") for r in reversed(replies) if r.get("event")), None)
        done = self._event(handle) if handle else self.scatters_done()
        return {**merge_retrieves(replies), "done": done}

    def _event(self, handle: bytes):
        ev = self._events.get(handle)
        if ev is None:
            import torch

            if len(self._events) >= MAX_PEER_EVENTS:
                self._events.clear()
            ev = self._events[handle] = torch.cuda.Event.from_ipc_handle(self.device, handle)
        self._last_done = ev
        return ev


def direct_layout(layout, tensors) -> bool:
    """Whether a cuda ``layout`` (a PageLayout over ``tensors``, in its order) can be registered
    without a staging buffer: every group tierd.protocol.copies.Pitched (module doc of
    tierd.transfer.cuda), each in one tensor."""
    from tierd.protocol.copies import pitched

    for group in layout.groups:
        if len({s.tensor for s in group.layers}) != 1:
            return False
        base = tensors[group.layers[0].tensor].data_ptr()
        if pitched(group, [base + s.offset for s in group.layers]) is None:
            return False
    return True


def _spin(event, seconds: float) -> bool:
    """Whether ``event`` completes within ``seconds``, polled (a yield between polls)."""
    end = time.perf_counter() + seconds
    while not event.query():
        if time.perf_counter() >= end:
            return False
        os.sched_yield()
    return True


def _stamp(rec: dict | None, stage: str) -> None:
    if rec is not None:
        rec[stage] = time.perf_counter()


def _chain(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())
