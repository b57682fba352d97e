"""Worker side of TierdConnector: publishes this rank's page layout and issues STORE/RETRIEVE by
block id.

CPU ranks: the daemon does every copy, over the shared mappings. CUDA ranks, staged: the SM part
runs in this process, in the engine's context on the connector's own streams
(``tierd_client.staged_rank`` gathers a STORE's blocks into the rank's staging buffer and scatters a
RETRIEVE's out of it); the daemon only DMAs between staging and its pool. CUDA ranks, direct (a
block-outermost layout, ``tierd.cuda_path``): the daemon DMAs straight between the blocks and its
pool (``tierd_client.direct_rank``), no SM work anywhere. Either way ordered without a host wait
on the forward thread and with no host work per block there:

- a store's gather (direct: its STORE) waits for an event recorded on vLLM's current (forward)
  stream in ``wait_for_save``, so the blocks are read only once the forward's KV writes are done;
- a load's scatter (direct: its RETRIEVE) waits for an event recorded on that stream in
  ``start_load_kv``, after vLLM zeroed new blocks and after the forwards that read blocks now
  handed out again;
- a load is reported finished (or failed) only once its scatter (direct: the daemon's copies) is
  complete on the GPU (its ``done`` event, polled with ``query``), so vLLM runs the forward that
  reads those blocks only then, whatever stream that forward uses.

Block reuse is fenced instead of holding blocks: a store is asynchronous, and before a forward
(or a load) writes into a block that a pending store still reads, the worker waits for that
store (on CUDA a store's future is done only once its gather, or the daemon, has read the
blocks). Loads report completion per request; a failed load is reported as ``failed_recving``
for multi-group models and as invalid block ids for single-group ones, so vLLM recomputes.

Until the rank is registered (``registration``: a bounded wait at start-up, then background
retries) loads fail over to recompute and stores are skipped. With KV cache events on, every
chunk a step asked to store is reported back with its fate (``take_events``).
"""

from __future__ import annotations

import time

from tierd.protocol import messages
from tierd.protocol.layout import GroupKind
from tierd_client.direct_rank import DirectRank
from tierd_client.errors import TierdError
from tierd_client.futures import polled
from tierd_client.staged_rank import StagedRank
from tierd_client.vllm_connector import stages
from tierd_client.vllm_connector.config import ConnectorConfig
from tierd_client.vllm_connector.geometry import EngineGeometry
from tierd_client.vllm_connector.log import get_logger
from tierd_client.vllm_connector.metadata import SKIP, ChunkIO, TierdMetadata, TierdWorkerMeta
from tierd_client.vllm_connector.metrics import WorkerMetrics
from tierd_client.vllm_connector.registration import RankRegistration

log = get_logger("tierd_client.vllm_connector")


class WorkerSide:
    def __init__(
        self,
        cfg: ConnectorConfig,
        geo: EngineGeometry,
        client,
        instance_id: str,
        num_blocks: int,
        vllm_null: int = 0,
        events: bool = False,
    ):
        self.cfg = cfg
        self.geo = geo
        self.client = client
        self.instance = instance_id
        self.vllm_null = vllm_null
        self.reg = RankRegistration(cfg, geo, client, instance_id, num_blocks)
        self.loads: dict[str, tuple[object, list[list[list[int]]]]] = {}  # req -> (future, ids per chunk)
        self._landing: dict[str, object] = {}  # CUDA: req -> the event its blocks may be read after
        self.stores: list[tuple[object, set[int]]] = []  # pending STOREs and the block ids they read
        self._store_keys: dict[int, list[bytes]] = {}  # id(STORE future) -> its chunk keys (events on)
        self.failed: set[str] = set()
        self.invalid_blocks: set[int] = set()
        self._failed_now: set[str] = set()  # loads that failed before being sent
        self.reports: list[tuple[bytes, str]] | None = [] if events else None  # (chunk key, STORE result)
        # CUDA: the rank's StagedRank (gathers and scatters in this process) or DirectRank (the daemon
        # copies straight to and from its blocks); the same calls, the same ordering
        self.gpu = None
        self.device = None
        self.metrics = WorkerMetrics(self.reg)  # vLLM's connector stats (get_kv_connector_stats)
        # Test-only switches, never user settings: with _store_fence off a store's gather does not wait
        # for the forward's writes; with _load_fence off a load is reported once its scatter is queued,
        # not done. The GPU tests turn them off to show that each one is what keeps the bytes right.
        # With _load_states off a load leaves the recurrent-state blocks unwritten (attention only):
        # the negative control of the recurrent models' exactness tests.
        self._store_fence = True
        self._load_fence = True
        # Test-only too: each load leaves its first block unwritten yet reports success, the negative
        # control of the engine harness's exactness checks (any model family).
        self._skip_one_block = False
        self._load_states = True

    # ---- registration -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict, rank: int) -> None:
        self.reg.publish(kv_caches, rank)
        if self.reg.stager is not None:
            self.device = self.reg.stager.device
            self.gpu = StagedRank(
                self.client,
                self.instance,
                self.reg.stager,
                null=self.null,
                timeout_s=self.cfg.timeout_s,
                host_order=self.cfg.gpu_order == "host",
            )
        elif self.reg.direct is not None:
            self.device = self.reg.direct
            self.gpu = DirectRank(
                self.client,
                self.instance,
                self.device,
                groups=len(self.geo.groups),
                null=self.null,
                timeout_s=self.cfg.timeout_s,
                chunk_bytes=self.reg.chunk_bytes,
            )

    def _try_register(self) -> bool:
        return self.reg.ready()

    # ---- per step -----------------------------------------------------------------------------------
    def handle_preemptions(self, meta: TierdMetadata) -> None:
        self._fence(meta.new_blocks)

    def start_load_kv(self, meta: TierdMetadata) -> None:
        ready = None  # CUDA: where on the forward stream the loads' blocks may be written
        for job in meta.loads:
            stages.stamp(job.req_id, "load_start")
            ids = [self._ids(c) for c in job.chunks]
            if self._skip_one_block:
                ids = self._without_one_block(ids)
            if not self._load_states:
                ids = [self._states_nulled(c) for c in ids]
            if not self._try_register():
                self._fail_load(job.req_id, self._flat(ids))
                continue
            self._fence(self._block_set(ids))
            chunks = [messages.Chunk(c.key, blocks) for c, blocks in zip(job.chunks, ids)]
            try:
                if self.gpu is not None:
                    if ready is None:
                        ready = self._forward_event()
                    self.gpu.null = self.null
                    fut = self.gpu.retrieve(chunks, lease=job.lease, after=ready)
                else:
                    fut = self.client.retrieve_async(
                        self.instance, chunks, lease=job.lease, timeout=self.cfg.timeout_s
                    )
            except Exception as exc:  # noqa: BLE001
                log.warning("tierd: load for %s not sent: %s", job.req_id, exc)
                self._fail_load(job.req_id, self._flat(ids))
                continue
            self.loads[job.req_id] = (fut, ids)
            self.metrics.load_sent(fut, ids, self.null)
            self._landing.pop(job.req_id, None)
            stages.stamp(job.req_id, "load_sent")
            fut.add_done_callback(lambda _f, r=job.req_id: stages.stamp(r, "load_answered"))

    def wait_for_save(self, meta: TierdMetadata) -> None:
        if not meta.stores:
            return
        if not self._try_register():
            self._report([c.key for job in meta.stores for c in job.chunks], "skipped")
            return
        after = self._forward_event() if self.gpu is not None and self._store_fence else None
        for job in meta.stores:
            ids = [self._ids(c) for c in job.chunks]
            chunks = [messages.Chunk(c.key, blocks) for c, blocks in zip(job.chunks, ids)]
            keys = [c.key for c in job.chunks]
            try:
                if self.gpu is not None:
                    self.gpu.null = self.null
                    fut = self.gpu.store(chunks, touch=job.touch, after=after)
                else:
                    fut = self.client.store_async(
                        self.instance, chunks, touch=job.touch, timeout=self.cfg.timeout_s
                    )
            except Exception as exc:  # noqa: BLE001 - a store not made is a future miss, nothing more
                log.debug("tierd: store for %s not sent: %s", job.req_id, exc)
                self._report(keys, "failed")
                continue
            self.stores.append((fut, self._block_set(ids)))
            self.metrics.store_sent(fut, ids, self.null)
            if self.reports is not None:
                self._store_keys[id(fut)] = keys
        self._prune_stores()

    def take_events(self) -> list[tuple[bytes, str]]:
        """(chunk key, result) of every store that ended since the last call (events on)."""
        self._prune_stores()
        out, self.reports = self.reports or [], [] if self.reports is not None else None
        return out

    def _report(self, keys: list[bytes], result: str) -> None:
        if self.reports is not None:
            self.reports += [(k, result) for k in keys]

    def transfer_results(self) -> tuple[set[str], set[str]]:
        finished, failed = set(), set()
        for req_id, (fut, ids) in list(self.loads.items()):
            stages.add(req_id, "load_polls", 1)
            if not polled(fut) or not self._landed(req_id, fut):
                continue
            stages.stamp(req_id, "landed")
            del self.loads[req_id]
            self._landing.pop(req_id, None)
            finished.add(req_id)
            exc = fut.exception()
            if exc is None and all(fut.result().ok):
                continue
            if exc is None:
                bad = [int(b) for _, b in fut.result().failed]
                log.warning("tierd: load for %s missed %d blocks", req_id, len(bad))
            else:
                bad = self._flat(ids)
                log.warning("tierd: load for %s failed: %s", req_id, exc)
            self._record_failure(req_id, bad)
            failed.add(req_id)
        finished |= self._failed_now
        failed |= self._failed_now
        self._failed_now = set()
        return finished, failed

    def _fail_load(self, req_id: str, ids: list[int]) -> None:
        self._record_failure(req_id, ids)
        self._failed_now.add(req_id)

    def _record_failure(self, req_id: str, ids: list[int]) -> None:
        self.failed.add(req_id)
        if len(self.geo.groups) == 1:
            self.invalid_blocks.update(ids)

    def take_invalid_blocks(self) -> set[int]:
        out, self.invalid_blocks = self.invalid_blocks, set()
        return out

    def take_worker_meta(self) -> TierdWorkerMeta | None:
        if not self.failed:
            return None
        out = TierdWorkerMeta(self.failed)
        self.failed = set()
        return out

    def flush(self, timeout: float = 10.0) -> None:
        """Wait (bounded) until every store sent so far is answered."""
        deadline = time.monotonic() + timeout
        for fut, _ in self.stores:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001
                pass
        self._prune_stores()

    def shutdown(self, timeout: float = 2.0) -> None:
        """Let pending stores finish (bounded: vLLM kills an engine that takes long to stop),
        then UNREGISTER this rank (unless a signal already had the client say BYE); the client's
        BYE then ends the session."""
        self.flush(timeout)
        self.stores, self._store_keys = [], {}
        self.reg.leave()
        if self.gpu is not None:
            self.gpu.close()

    # ---- CUDA ordering --------------------------------------------------------------------------------
    def _forward_event(self):
        """A CUDA event recorded now on vLLM's current stream (the forward's) on this rank's GPU."""
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _landed(self, req_id: str, fut) -> bool:
        """Whether a load whose future is done may be reported: on CPU at once (the daemon copied);
        on CUDA once its scatters are complete on the GPU. A failed CUDA load waits for every
        scatter queued so far (some of its requests may have been scattered): vLLM recomputes into
        those blocks next. Polled, never waited for."""
        if self.gpu is None or not self._load_fence:
            return True
        done = self._landing.get(req_id)
        if done is None:
            exc = fut.exception()
            done = fut.result().done if exc is None else self.gpu.scatters_done()  # a rank_jobs.Loaded
            if done is None:  # a job without chunks: nothing was scattered
                return True
            self._landing[req_id] = done
        return bool(done.query())

    # ---- helpers ------------------------------------------------------------------------------------
    @property
    def null(self) -> int:
        server = self.client.server
        return -1 if server is None else server.null_block_id

    def _ids(self, chunk: ChunkIO) -> list[list[int]]:
        null, vnull = self.null, self.vllm_null
        return [[null if b == SKIP or b == vnull else int(b) for b in ids] for ids in chunk.blocks]

    def _states_nulled(self, per_group: list[list[int]]) -> list[list[int]]:
        null = self.null
        return [
            [null] * len(b) if g.kind is GroupKind.STATE else b for g, b in zip(self.geo.groups, per_group)
        ]

    def _without_one_block(self, ids: list[list[list[int]]]) -> list[list[list[int]]]:
        """``ids`` with its first non-null block made null (``_skip_one_block``)."""
        null = self.null
        for c in ids:
            for per_group in c:
                for i, b in enumerate(per_group):
                    if b != null:
                        per_group[i] = null
                        return ids
        return ids

    def _flat(self, ids: list[list[list[int]]]) -> list[int]:
        """Every non-null block id of a job's chunks (per chunk, per group lists)."""
        null = self.null
        return [b for c in ids for per_group in c for b in per_group if b != null]

    def _block_set(self, ids: list[list[list[int]]]) -> set[int]:
        """The non-null block ids of a job's chunks, over all groups (see TierdMetadata.new_blocks)."""
        null = self.null
        return {b for c in ids for per_group in c for b in per_group if b != null}

    def _fence(self, blocks: set[int]) -> None:
        """Wait for pending stores that read any of ``blocks`` before they are overwritten."""
        if not self.stores or not blocks:
            return
        for fut, reads in self.stores:
            if fut.done():
                continue
            if not reads.isdisjoint(blocks):
                try:
                    fut.result(timeout=self.cfg.timeout_s)
                except Exception:  # noqa: BLE001 - an expired store is never committed
                    pass
        self._prune_stores()

    def _prune_stores(self) -> None:
        keep = []
        for fut, reads in self.stores:
            if not fut.done():
                keep.append((fut, reads))
                continue
            keys = self._store_keys.pop(id(fut), [])
            exc = fut.exception()
            if exc is not None:
                if not isinstance(exc, TierdError):
                    log.debug("tierd store failed: %s", exc)
                self._report(keys, "failed")
            elif self.reports is not None:
                self.reports += list(zip(keys, fut.result().results))
        self.stores = keep
