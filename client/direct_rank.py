"""STORE and RETRIEVE for a GPU rank registered without a staging buffer (the daemon copies
straight between its KV blocks and the pool: tierd.transfer.cuda): no gather, no scatter, no
room; only the ordering on this side's host. The same interface as
tierd_client.staged_rank.StagedRank, which the vLLM worker and ``tierd bench --device cuda``
choose between by ``direct_layout``."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

from tierd.protocol import MAX_REQUEST_PARTS, messages
from tierd.protocol.copies import pitched
from tierd_client.client import typed_chunks
from tierd_client.cuda_stage import MAX_PEER_EVENTS
from tierd_client.futures import join, merge_retrieves, merge_stores
from tierd_client.rank_jobs import Loaded, RankJob, stamp

# A request's copies start once the daemon has planned all of it: requests of at most this many
# bytes let the copy engines move one while the daemon plans the next (a 640 MiB request left them
# idle for about 4 ms first on an H200), and each request costs the daemon's main loop a fixed
# share (requests of 10-20 MiB fell to 0.40-0.92 of raw on an H200, 40 and 128 MiB gave 0.89-0.97).
REQUEST_BYTES = 64 << 20


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

    def __init__(
        self,
        client,
        instance: str,
        device,
        groups: int = 1,
        null: int = -1,
        timeout_s=None,
        chunk_bytes: int = 0,
        request_bytes: int = REQUEST_BYTES,
    ):
        """``chunk_bytes``: a chunk's bytes on this rank (PageLayout.chunk_bytes); a job is cut into
        requests of at most ``request_bytes`` (at least one chunk each) when it is given."""
        self.client, self.instance, self.device, self.null = client, instance, device, null
        self.timeout_s = timeout_s
        self.trace: list[dict] | None = None  # as StagedRank's
        self.per_request = max(1, MAX_REQUEST_PARTS // max(1, groups))
        if chunk_bytes > 0:
            self.per_request = max(1, min(self.per_request, request_bytes // chunk_bytes))
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

    def store(self, chunks: list, touch: list[bytes] | None = None, after=None) -> Future:
        """A StoreReply's future (``chunks``: messages.Chunk, or plain maps converted)."""
        return self._order("STORE", typed_chunks(chunks), {"touch": touch or []}, after)

    def retrieve(self, chunks: list, lease: int = 0, after=None) -> Future:
        """A rank_jobs.Loaded's future (``chunks``: messages.Chunk, or plain maps converted)."""
        return self._order("RETRIEVE", typed_chunks(chunks), {"lease": lease}, after)

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
        out = RankJob()
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

    def _send(self, op: str, chunks: list[dict], extra: dict, out: RankJob, t_call: float) -> None:
        merge = merge_stores if op == "STORE" else self._merge_retrieves
        parts: list[Future] = []
        try:
            for i in range(0, len(chunks), self.per_request):
                rec = None
                if self.trace is not None:
                    now = time.perf_counter()
                    rec = {"op": op, "first": i == 0, "call": t_call if i == 0 else now, "start": now}
                    self.trace.append(rec)
                part = chunks[i : i + self.per_request]
                if op == "STORE":  # the touched keys go with the first part only
                    body = messages.Store(self.instance, part, touch=extra["touch"] if i == 0 else [])
                else:
                    body = messages.Retrieve(self.instance, part, lease=extra["lease"])
                fut = out.sent(self.client.call_async(op, body, timeout=self.timeout_s))
                stamp(rec, "sent")
                if rec is not None:
                    fut.add_done_callback(lambda _f, rec=rec: stamp(rec, "answered"))
                parts.append(fut)
        except BaseException as exc:  # noqa: BLE001 - the job fails as a whole; the engine recomputes
            join(parts, out, merge, error=exc)
            return
        join(parts, out, merge)

    def _merge_retrieves(self, replies: list[messages.RetrieveReply]) -> Loaded:
        """One reply; ``done`` is the daemon's event of the last answer (its copy stream runs them in
        order, and it records that event after each)."""
        handle = next((r.event for r in reversed(replies) if r.event), None)
        done = self._event(handle) if handle else self.scatters_done()
        merged = merge_retrieves(replies)
        return Loaded(merged.ok, merged.failed, done)

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
    for group in layout.groups:
        if len({s.tensor for s in group.layers}) != 1:
            return False
        base = tensors[group.layers[0].tensor].data_ptr()
        if pitched(group, [base + s.offset for s in group.layers]) is None:
            return False
    return True
