"""Scheduler side of TierdConnector: lookups, load plans and store plans.

Per request it keeps the chunk keys (chained PAGE hashes over the token ids, independent of
PYTHONHASHSEED), the LOOKUP in flight or its answer and lease, how many chunks are already in
the tier, the request's own limits (``kv_transfer_params``, see ``requests``), and whether the
tier is bypassed after a failed load (so a failure recomputes once instead of looping lookup ->
load -> fail). Prompts shorter than one chunk never reach the tier.

While the client has no session with the daemon (none running yet, or it refused our HELLO),
lookups are not sent at all: a lookup waiting for a daemon that is not there would hold every
new request for ``tierd.lookup_timeout_s``. The tier turns on when the session comes up.
"""

from __future__ import annotations

import time

from tierd.protocol import messages
from tierd.protocol.layout import GroupKind, GroupSpec
from tierd_client.vllm_connector import stages
from tierd_client.vllm_connector.config import ConnectorConfig
from tierd_client.vllm_connector.geometry import EngineGeometry
from tierd_client.vllm_connector.keys import extend_keys
from tierd_client.vllm_connector.keys import unkeyable as _unkeyable
from tierd_client.vllm_connector.log import get_logger
from tierd_client.vllm_connector.metadata import SKIP, ChunkIO, LoadOrder, TierdMetadata
from tierd_client.vllm_connector.metrics import SchedulerMetrics
from tierd_client.vllm_connector.requests import ReqState, RequestCaps
from tierd_client.vllm_connector.store_plan import (
    block_resolver,
    new_block_ids,
    plan_state_store,
    plan_store,
    state_offers,
)

log = get_logger("tierd_client.vllm_connector")

__all__ = ["SKIP", "SchedulerSide", "new_block_ids"]


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, geo: EngineGeometry, client, events=None):
        self.cfg = cfg
        self.geo = geo
        self.client = client
        self.events = events  # RouterEvents, when vLLM publishes KV cache events
        self._online: bool | None = None  # last seen: the client has a session with the daemon
        self.reqs: dict[str, ReqState] = {}
        self.pending_loads: list[LoadOrder] = []
        self.kv_cache_manager = None
        self.namespace, self.specs = geo.namespace, geo.specs()  # what every LOOKUP sends
        # With recurrent or sliding groups a hit must end on a chunk boundary short of the last
        # token (the state at that boundary is what is stored); attention-only models may
        # serve a whole-prompt hit and recompute just the last token.
        self.need_spare_token = not geo.attention_only
        self.metrics = SchedulerMetrics(self)  # vLLM's connector stats (get_kv_connector_stats)

    # ---- keys ---------------------------------------------------------------------------------
    def _keys(self, st: ReqState, upto_chunks: int) -> list[bytes]:
        extend_keys(st.request, st.keys, upto_chunks, self.geo.chunk_tokens)
        return st.keys[:upto_chunks]

    # ---- lookups --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        t0 = time.perf_counter()
        out = self._matched(request, num_computed_tokens)
        seconds = time.perf_counter() - t0  # one clock for both: vLLM's metrics and the stage stamps
        self.metrics.queried(request, num_computed_tokens, out, seconds)
        req_id = request.request_id
        stages.add(req_id, "hook_s", seconds)
        stages.add(req_id, "hook_calls", 1)
        if out[0]:
            stages.stamp(req_id, "hit_seen")
        return out

    def _matched(self, request, num_computed_tokens: int):
        req_id = request.request_id
        st = self.reqs.get(req_id)
        if st is None:
            st = self.reqs[req_id] = ReqState(request, RequestCaps.of(request))
        st.local_tokens = num_computed_tokens
        if st.bypass or _unkeyable(request) or not self._session_up():
            return 0, False
        C = self.geo.chunk_tokens
        usable = request.num_tokens - 1 if self.need_spare_token else request.num_tokens
        cap = st.caps.load_cap(num_computed_tokens, C)
        if cap is not None:
            usable = min(usable, cap)
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
                    self.namespace,
                    keys,
                    self.specs,
                    C,
                    replicated=self.geo.replicated,
                    timeout=self.cfg.lookup_timeout_s,
                    wait=self.cfg.lookup_wait_ms > 0,  # read on this thread while it waits below
                )
            except Exception as exc:  # noqa: BLE001 - the tier is an optimisation; never fail the request
                log.warning("tierd lookup for %s not sent: %s", req_id, exc)
                return 0, False
            st.lookup_at = time.monotonic()
            self.metrics.lookup_sent(st.lookup, len(keys) * C)
            st.hit_chunks, st.lease = 0, 0
            stages.stamp(req_id, "lookup_sent")
            st.lookup.add_done_callback(lambda _f, r=req_id: stages.stamp(r, "lookup_answered"))
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
        st.hit_chunks, st.lease = reply.chunks, reply.lease
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
        self.pending_loads.append(LoadOrder(request.request_id, st.lease, chunks))
        stages.stamp(request.request_id, "allocated")
        st.loading = True
        st.stored_chunks = max(st.stored_chunks, hit)

    def _chunk_blocks(
        self, g, spec: GroupSpec, ids: list[int], chunk: int, need: int, local_tokens: int
    ) -> list[int]:
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
        resolve = block_resolver(so, self.kv_cache_manager)
        offers = state_offers(so)
        for req_id, n_sched in so.num_scheduled_tokens.items():
            st = self.reqs.get(req_id)
            if st is None or _unkeyable(st.request):
                continue
            job = plan_store(self.geo, self.cfg, st, n_sched, resolve, offers is None, self.events)
            if job is not None:
                meta.stores.append(job)
        for req_id, states in (offers or {}).items():
            st = self.reqs.get(req_id)
            if st is not None and not _unkeyable(st.request):
                job = plan_state_store(self.geo, st, states)
                if job is not None:
                    meta.stores.append(job)
        return meta

    # ---- feedback ---------------------------------------------------------------------------------
    def update_connector_output(self, output) -> None:
        if self.events is not None:
            self.events.on_reports(getattr(output, "kv_cache_events", None))
        failed = set(getattr(output, "failed_recving", None) or ())
        worker_meta = getattr(output, "kv_connector_worker_meta", None)
        failed |= set(getattr(worker_meta, "failed_loads", ()) or ())
        self.metrics.loads_failed(sum(1 for r in failed if r in self.reqs))
        for req_id in failed:
            st = self.reqs.get(req_id)
            if st is not None:
                log.warning("tierd load for %s failed: recomputing it without the tier", req_id)
                st.bypass = True
                st.stored_chunks = min(st.stored_chunks, st.local_tokens // self.geo.chunk_tokens)
        for req_id in getattr(output, "finished_recving", None) or ():
            stages.stamp(req_id, "finished_seen")
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
                self.client.call_async("RELEASE", messages.Release(lease), timeout=self.cfg.lookup_timeout_s)
            except Exception:  # noqa: BLE001 - a lease left behind expires by TTL
                pass

    def await_session(self, wait_s: float) -> bool:
        """Start-up: wait up to ``wait_s`` for the client's HELLO to be answered, so that the first
        requests after an engine (re)start already use the tier. vLLM builds the scheduler after
        its workers registered and sends requests at once; without this wait they raced the
        scheduler's own HELLO and were computed in full. No daemon: logged, and requests bypass
        the tier until one answers (as before)."""
        try:
            self.client.wait_ready(wait_s)
        except Exception:  # noqa: BLE001 - no daemon, or it refused us: _session_up says which
            pass
        return self._session_up()

    def _session_up(self) -> bool:
        """Whether the client has a session; says so (once per change) in vLLM's log."""
        up = getattr(self.client, "server", None) is not None
        if up != self._online:
            if up:
                log.info(
                    "tierd: scheduler has a session with %s: prompts of %d+ tokens use the tier",
                    self.client.url,
                    self.geo.chunk_tokens,
                )
            else:
                why = getattr(self.client, "refusal", None)
                log.warning(
                    "tierd: %s: requests bypass the tier until the daemon answers",
                    f"{self.client.url} refused us ({why})"
                    if why
                    else f"no daemon answers at {self.client.url} (yet)",
                )
            self._online = up
        return up

    def _lease_ttl(self) -> float:
        server = getattr(self.client, "server", None)
        return 60.0 if server is None else server.lease_ttl_s
