"""Scheduler side of TierdConnector: lookups, load plans and store plans.

Per request it keeps the chunk keys (chained PAGE hashes over the token ids, independent of
PYTHONHASHSEED), the LOOKUP in flight or its answer and lease, how many chunks are already in
the tier, and whether the tier is bypassed after a failed load (so a failure recomputes once
instead of looping lookup -> load -> fail).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tierd.protocol.layout import GroupKind, GroupSpec

from tierd_client.vllm_connector.config import ConnectorConfig
from tierd_client.vllm_connector.geometry import Geometry
from tierd_client.vllm_connector.keys import extend_keys, unkeyable as _unkeyable
from tierd_client.vllm_connector.metadata import ChunkIO, LoadJob, StoreJob, TierdMetadata

log = logging.getLogger("tierd_client.vllm_connector")

SKIP = -1  # "leave this block alone": the worker turns it (and vLLM's null block) into the daemon's null id


@dataclass
class ReqState:
    request: object
    keys: list[bytes] = field(default_factory=list)
    lookup: object = None  # Future of the LOOKUP reply
    lookup_at: float = 0.0
    hit_chunks: int = 0
    lease: int = 0
    local_tokens: int = 0  # block-aligned local prefix-cache hit at the last query
    stored_chunks: int = 0  # chunks [0, stored_chunks) are in the tier (stored or loaded)
    bypass: bool = False  # a load failed: no more lookups for this request
    loading: bool = False


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, geo: Geometry, client):
        self.cfg = cfg
        self.geo = geo
        self.client = client
        self.reqs: dict[str, ReqState] = {}
        self.pending_loads: list[LoadJob] = []
        self.kv_cache_manager = None
        self.specs = [GroupSpec.from_wire(g, f"groups[{i}]") for i, g in enumerate(geo.specs())]
        # With recurrent or sliding groups a hit must end on a chunk boundary short of the last
        # token (the state at that boundary is what is stored); attention-only models may
        # serve a whole-prompt hit and recompute just the last token.
        self.need_spare_token = not geo.attention_only

    # ---- keys ---------------------------------------------------------------------------------
    def _keys(self, st: ReqState, upto_chunks: int) -> list[bytes]:
        extend_keys(st.request, st.keys, upto_chunks, self.geo.chunk_tokens)
        return st.keys[:upto_chunks]

    # ---- lookups --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        req_id = request.request_id
        st = self.reqs.get(req_id)
        if st is None:
            st = self.reqs[req_id] = ReqState(request)
        st.local_tokens = num_computed_tokens
        if st.bypass or _unkeyable(request):
            return 0, False
        C = self.geo.chunk_tokens
        usable = request.num_tokens - 1 if self.need_spare_token else request.num_tokens
        max_chunks = max(0, usable) // C
        if max_chunks * C <= num_computed_tokens:
            return 0, False
        if st.lookup is not None and time.monotonic() - st.lookup_at > self._lease_ttl() / 2:
            self._drop_lease(st)  # an old answer: its lease may be gone, ask again
            st.lookup = None
        if st.lookup is None:
            keys = self._keys(st, max_chunks)
            try:
                st.lookup = self.client.lookup_async(
                    self.geo.namespace, keys, self.geo.specs(), C, replicated=self.geo.replicated,
                    timeout=self.cfg.lookup_timeout_s,
                )
            except Exception as exc:  # noqa: BLE001 - the tier is an optimisation; never fail the request
                log.warning("tierd lookup for %s not sent: %s", req_id, exc)
                return 0, False
            st.lookup_at = time.monotonic()
            st.hit_chunks, st.lease = 0, 0
            if self.cfg.lookup_wait_ms > 0:
                try:
                    st.lookup.result(timeout=self.cfg.lookup_wait_ms / 1000)
                except Exception:  # noqa: BLE001 - timeout or error: handled below
                    pass
        if not st.lookup.done():
            return None, False
        if st.lookup.exception() is not None:
            log.debug("tierd lookup for %s failed: %s", req_id, st.lookup.exception())
            return 0, False
        reply = st.lookup.result()
        st.hit_chunks, st.lease = int(reply["chunks"]), int(reply.get("lease", 0))
        hit_tokens = min(st.hit_chunks * C, usable)
        external = hit_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        return external, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0:
            if not st.loading:
                self._drop_lease(st)
            return
        C = self.geo.chunk_tokens
        block_ids = blocks.get_block_ids()
        local = st.local_tokens
        hit = -(-(local + num_external_tokens) // C)  # the boundary whose chunks we load
        first = local // C
        chunks = []
        for j in range(first, hit):
            per_group = []
            for g, spec in zip(self.geo.groups, self.specs):
                need = spec.needed_mask(j, hit, C)
                per_group.append(self._chunk_blocks(g, spec, block_ids[g.index], j, need, local))
            chunks.append(ChunkIO(st.keys[j], per_group))
        self.pending_loads.append(LoadJob(request.request_id, st.lease, chunks))
        st.loading = True
        st.stored_chunks = max(st.stored_chunks, hit)

    def _chunk_blocks(self, g, spec: GroupSpec, ids: list[int], chunk: int, need: int, local_tokens: int) -> list[int]:
        """Block ids of ``chunk`` for group ``g`` to load: SKIP for blocks not needed at the hit
        boundary and for blocks the local prefix cache already holds (shared, read-only)."""
        C = self.geo.chunk_tokens
        if g.kind is GroupKind.STATE:
            idx = (chunk + 1) * C // g.block_tokens - 1
            return [ids[idx] if need and idx < len(ids) else SKIP]
        bpc = C // g.block_tokens
        out = []
        for b in range(bpc):
            idx = chunk * bpc + b
            shared = (idx + 1) * g.block_tokens <= local_tokens
            out.append(ids[idx] if need >> b & 1 and not shared and idx < len(ids) else SKIP)
        return out

    # ---- stores -----------------------------------------------------------------------------------
    def build_meta(self, so) -> TierdMetadata:
        meta = TierdMetadata(loads=self.pending_loads, new_blocks=new_block_ids(so))
        self.pending_loads = []
        for req_id in list(so.preempted_req_ids or ()):
            st = self.reqs.get(req_id)
            if st is not None:
                self._drop_lease(st)
                st.lookup, st.loading = None, False
        resolve = _block_resolver(so, self.kv_cache_manager)
        offers = _state_offers(so)
        for req_id, n_sched in so.num_scheduled_tokens.items():
            st = self.reqs.get(req_id)
            if st is None or _unkeyable(st.request):
                continue
            job = self._store_job(st, n_sched, resolve, positional_states=offers is None)
            if job is not None:
                meta.stores.append(job)
        for req_id, states in (offers or {}).items():
            st = self.reqs.get(req_id)
            if st is not None and not _unkeyable(st.request):
                job = self._state_job(st, states)
                if job is not None:
                    meta.stores.append(job)
        return meta

    def _state_job(self, st: ReqState, states: list[tuple[int, int, int]]) -> StoreJob | None:
        """Recurrent states vLLM hands off with their exact blocks (mamba "align" mode): one
        state-only chunk per offered boundary that ends a chunk."""
        C = self.geo.chunk_tokens
        by_index = {g.index: g for g in self.geo.groups}
        chunks = []
        for gid, block_id, boundary in states:
            g = by_index.get(gid)
            if g is None or g.kind is not GroupKind.STATE or boundary % C or boundary > len(st.request.all_token_ids):
                continue
            j = boundary // C - 1
            keys = self._keys(st, j + 1)
            blocks = [[block_id] if other.index == gid else [SKIP] * other.blocks_per_chunk(C)
                      for other in self.geo.groups]
            chunks.append(ChunkIO(keys[j], blocks))
        return StoreJob(st.request.request_id, chunks, []) if chunks else None

    def _store_job(self, st: ReqState, n_sched: int, resolve, positional_states: bool) -> StoreJob | None:
        req = st.request
        C = self.geo.chunk_tokens
        written = min(req.num_computed_tokens + n_sched, len(req.all_token_ids))
        if not self.cfg.store_decode:
            written = min(written, req.num_prompt_tokens)
        done = written // C
        if done <= st.stored_chunks:
            return None
        ids = resolve(req.request_id)
        if ids is None:
            return None
        keys = self._keys(st, done)
        chunks = []
        for j in range(st.stored_chunks, done):
            per_group = []
            for g in self.geo.groups:
                gids = ids[g.index]
                if g.kind is GroupKind.STATE:
                    # vLLM that hands off boundary states gets them stored from those exact blocks
                    # (_state_job); older vLLM: the block at the boundary's position.
                    idx = (j + 1) * C // g.block_tokens - 1
                    per_group.append([gids[idx] if positional_states and idx < len(gids) else SKIP])
                else:
                    bpc = C // g.block_tokens
                    per_group.append([gids[i] if i < len(gids) else SKIP for i in range(j * bpc, (j + 1) * bpc)])
            chunks.append(ChunkIO(keys[j], per_group))
        job = StoreJob(req.request_id, chunks, keys[: st.stored_chunks])
        st.stored_chunks = done
        return job

    # ---- feedback ---------------------------------------------------------------------------------
    def update_connector_output(self, output) -> None:
        failed = set(getattr(output, "failed_recving", None) or ())
        worker_meta = getattr(output, "kv_connector_worker_meta", None)
        failed |= set(getattr(worker_meta, "failed_loads", ()) or ())
        for req_id in failed:
            st = self.reqs.get(req_id)
            if st is not None:
                log.warning("tierd load for %s failed: recomputing it without the tier", req_id)
                st.bypass = True
                st.stored_chunks = min(st.stored_chunks, st.local_tokens // self.geo.chunk_tokens)
        for req_id in getattr(output, "finished_recving", None) or ():
            st = self.reqs.get(req_id)
            if st is not None:
                st.loading, st.lease = False, 0  # consumed by the ranks' retrieves

    def request_finished(self, request) -> tuple[bool, None]:
        """Never delays the free: stores are fenced instead (see the worker), and a request that
        ends during its load is held by vLLM itself until ``finished_recving`` names it."""
        st = self.reqs.pop(request.request_id, None)
        if st is not None and not st.loading:
            self._drop_lease(st)
        return False, None

    def _drop_lease(self, st: ReqState) -> None:
        if st.lease:
            lease, st.lease = st.lease, 0
            try:
                self.client.call_async("RELEASE", {"lease": lease}, timeout=self.cfg.lookup_timeout_s)
            except Exception:  # noqa: BLE001 - a lease left behind expires by TTL
                pass

    def _lease_ttl(self) -> float:
        server = getattr(self.client, "server", None) or {}
        return float(server.get("lease_ttl_s", 60.0))


def new_block_ids(so) -> set[int]:
    """Every block id handed out in this step, over all of vLLM's KV cache groups (including
    groups tierd does not store: their blocks share pages with the groups it does)."""
    out: set[int] = set()

    def add(block_ids):
        for ids in block_ids or ():
            out.update(ids)

    for req in so.scheduled_new_reqs:
        add(req.block_ids)
    cached = so.scheduled_cached_reqs
    for ids in getattr(cached, "new_block_ids", None) or ():
        add(ids)
    return out


def _state_offers(so) -> dict[str, list[tuple[int, int, int]]] | None:
    """vLLM's exact (group, block, boundary tokens) recurrent-state hand-offs, or None when this
    vLLM does not offer them (then states are read positionally)."""
    state = getattr(so, "kv_connector_block_state", None)
    if state is None or not hasattr(state, "boundary_state_offloads"):
        return None
    return state.boundary_state_offloads


def _block_resolver(so, kv_cache_manager):
    state = getattr(so, "kv_connector_block_state", None)
    if state is not None:
        return state.get_block_ids
    if kv_cache_manager is not None:
        return kv_cache_manager.get_block_ids
    return lambda req_id: None
