"""Worker side of TierdConnector: publishes this rank's page layout and issues STORE/RETRIEVE by
block id. The daemon does every copy; the worker never touches the tier's memory.

Block reuse is fenced instead of holding blocks: a store is asynchronous, and before a forward
(or a load) writes into a block that a pending store still reads, the worker waits for that
store. Loads report completion per request; a failed load is reported as ``failed_recving`` for
multi-group models and as invalid block ids for single-group ones, so vLLM recomputes.
"""

from __future__ import annotations

import logging
import time

from tierd_client.client import TierdError
from tierd_client.layouts import block_span, group as group_desc, layout as layout_desc
from tierd_client.vllm_connector.config import ConnectorConfig
from tierd_client.vllm_connector.geometry import Geometry
from tierd_client.vllm_connector.metadata import ChunkIO, TierdMetadata, TierdWorkerMeta
from tierd_client.vllm_connector.scheduler import SKIP

log = logging.getLogger("tierd_client.vllm_connector")

REGISTER_RETRY_S = 5.0


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, geo: Geometry, client, instance_id: str, num_blocks: int, vllm_null: int = 0):
        self.cfg = cfg
        self.geo = geo
        self.client = client
        self.instance = instance_id
        self.num_blocks = num_blocks
        self.vllm_null = vllm_null
        self.layout: dict | None = None
        self.registered = False
        self._register_future = None
        self._register_at = 0.0
        self.loads: dict[str, tuple[object, list[int]]] = {}
        self.stores: list[tuple[object, set[int]]] = []  # pending STOREs and the block ids they read
        self.failed: set[str] = set()
        self.invalid_blocks: set[int] = set()
        self._failed_now: set[str] = set()  # loads that failed before being sent
        self.event_for_store = None  # CUDA: callable recording an IPC event on the forward stream

    # ---- registration -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict, rank: int) -> None:
        named = [(g, [kv_caches[n] for n in g.layer_names if n in kv_caches]) for g in self.geo.groups]
        tensors = [t for _, ts in named for t in ts]
        if not tensors:
            raise ValueError("register_kv_caches got none of the layers in the KV cache config")
        device = tensors[0].device.type
        if device == "cpu":
            from tierd_client.shm import share_torch_tensors

            refs, where = share_torch_tensors(tensors)
        elif device == "cuda":
            from tierd_client.cuda_ipc import share_cuda_tensors, store_event_recorder

            refs, where = share_cuda_tensors(tensors)
            self.event_for_store = store_event_recorder(tensors[0].device)
        else:
            raise ValueError(f"TierdConnector supports cpu and cuda KV caches, not {device}")
        groups, i = [], 0
        for g, ts in named:
            spans = []
            for t in ts:
                ref, offset = where[i]
                i += 1
                if t.shape[0] % self.num_blocks:
                    raise ValueError(f"layer tensor with {t.shape[0]} blocks is not a multiple of {self.num_blocks}")
                spans.append(block_span(tuple(t.shape), tuple(t.stride()), t.element_size(), 0, tensor=ref,
                                        offset=offset, blocks_per_block=t.shape[0] // self.num_blocks))
            groups.append(group_desc(g.kind.value, g.block_tokens, spans, window_tokens=g.window_tokens,
                                     dtype=str(ts[0].dtype) if ts else ""))
        self.layout = layout_desc(self.geo.namespace, rank, self.geo.chunk_tokens, refs, groups,
                                  device=device, replicated=self.geo.replicated)
        self._try_register(block=True)

    def _try_register(self, block: bool = False) -> bool:
        if self.registered or self.layout is None:
            return self.registered
        fut = self._register_future
        if fut is None:
            if time.monotonic() - self._register_at < REGISTER_RETRY_S and not block:
                return False
            self._register_at = time.monotonic()
            fut = self._register_future = self.client.register_async(self.instance, self.layout, self.cfg.timeout_s)
        if block:
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - reported below
                pass
        if not fut.done():
            return False
        self._register_future = None
        exc = fut.exception()
        if exc is not None:
            log.error("tierd: registering %s with %s failed (%s); the tier is off for this rank until it succeeds",
                      self.instance, self.client.url, exc)
            return False
        self.registered = True
        log.info("tierd: registered %s with %s", self.instance, self.client.url)
        return True

    # ---- per step -----------------------------------------------------------------------------------
    def handle_preemptions(self, meta: TierdMetadata) -> None:
        self._fence(meta.new_blocks)

    def start_load_kv(self, meta: TierdMetadata) -> None:
        for job in meta.loads:
            ids = [self._ids(c) for c in job.chunks]
            if not self._try_register():
                self._fail_load(job.req_id, self._flat(ids))
                continue
            self._fence(self._block_set(ids))
            chunks = [{"key": c.key, "blocks": blocks} for c, blocks in zip(job.chunks, ids)]
            try:
                fut = self.client.retrieve_async(self.instance, chunks, lease=job.lease, timeout=self.cfg.timeout_s)
            except Exception as exc:  # noqa: BLE001
                log.warning("tierd: load for %s not sent: %s", job.req_id, exc)
                self._fail_load(job.req_id, self._flat(ids))
                continue
            self.loads[job.req_id] = (fut, ids)

    def wait_for_save(self, meta: TierdMetadata) -> None:
        if not meta.stores or not self._try_register():
            return
        event = self.event_for_store() if self.event_for_store is not None else None
        for job in meta.stores:
            ids = [self._ids(c) for c in job.chunks]
            chunks = [{"key": c.key, "blocks": blocks} for c, blocks in zip(job.chunks, ids)]
            try:
                fut = self.client.store_async(self.instance, chunks, touch=job.touch, timeout=self.cfg.timeout_s,
                                              event=event)
            except Exception as exc:  # noqa: BLE001 - a store not made is a future miss, nothing more
                log.debug("tierd: store for %s not sent: %s", job.req_id, exc)
                continue
            self.stores.append((fut, self._block_set(ids)))
        self._prune_stores()

    def transfer_results(self) -> tuple[set[str], set[str]]:
        finished, failed = set(), set()
        for req_id, (fut, ids) in list(self.loads.items()):
            if not fut.done():
                continue
            del self.loads[req_id]
            finished.add(req_id)
            exc = fut.exception()
            if exc is None and all(fut.result()["ok"]):
                continue
            if exc is None:
                bad = [int(b) for _, b in fut.result()["failed"]]
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

    def shutdown(self, timeout: float = 10.0) -> None:
        """Let pending stores finish (bounded), then leave the daemon."""
        self.flush(timeout)
        self.stores = []
        if self.registered:
            try:
                self.client.unregister(self.instance, timeout=2.0)
            except Exception:  # noqa: BLE001 - the daemon reaps us by heartbeat anyway
                pass
            self.registered = False

    # ---- helpers ------------------------------------------------------------------------------------
    @property
    def null(self) -> int:
        server = self.client.server or {}
        return int(server.get("null_block_id", -1))

    def _ids(self, chunk: ChunkIO) -> list[list[int]]:
        null, vnull = self.null, self.vllm_null
        return [[null if b == SKIP or b == vnull else int(b) for b in ids] for ids in chunk.blocks]

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
            if fut.done():
                exc = fut.exception()
                if exc is not None and not isinstance(exc, TierdError):
                    log.debug("tierd store failed: %s", exc)
            else:
                keep.append((fut, reads))
        self.stores = keep

