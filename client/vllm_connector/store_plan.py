"""Store plans: which chunks of a request the workers STORE this step, with their block ids.

Pure functions of vLLM's scheduler output and the request's state (no daemon, no I/O), so a
plan can be checked with exact block ids. A chunk is stored once every token of it has been
computed (prompt or, with ``tierd.store_decode``, generated), at most up to the request's
``max_offload_tokens``; recurrent states are stored from the exact blocks vLLM hands off at a
chunk boundary when it offers them (mamba "align" mode), else from the block at the boundary.
"""

from __future__ import annotations

from tierd.protocol.layout import GroupKind
from tierd_client.vllm_connector.keys import extend_keys
from tierd_client.vllm_connector.metadata import SKIP, ChunkIO, StoreOrder


def plan_state_store(geo, st, states: list[tuple[int, int, int]]) -> StoreOrder | None:
    """Recurrent states vLLM hands off with their exact blocks (mamba "align" mode): one
    state-only chunk per offered ``(group, block, boundary)`` whose boundary ends a chunk."""
    C = geo.chunk_tokens
    by_index = {g.index: g for g in geo.groups}
    chunks = []
    for gid, block_id, boundary in states:
        g = by_index.get(gid)
        if (
            g is None
            or g.kind is not GroupKind.STATE
            or boundary % C
            or boundary > len(st.request.all_token_ids)
        ):
            continue
        j = boundary // C - 1
        cap = st.caps.store_cap()
        if cap is not None and boundary > cap:
            continue
        extend_keys(st.request, st.keys, j + 1, C)
        blocks = [
            [block_id] if other.index == gid else [SKIP] * other.blocks_per_chunk(C) for other in geo.groups
        ]
        chunks.append(ChunkIO(st.keys[j], blocks))
    return StoreOrder(st.request.request_id, chunks, []) if chunks else None


def plan_store(
    geo, cfg, st, n_sched: int, resolve, positional_states: bool, events=None
) -> StoreOrder | None:
    """The chunks of ``st``'s request completed by this step's ``n_sched`` tokens and not yet in
    the tier; advances ``st.stored_chunks``. ``resolve(req_id)`` gives the request's block ids
    per group; ``events`` (RouterEvents) records each planned chunk for the router."""
    req = st.request
    C = geo.chunk_tokens
    written = min(req.num_computed_tokens + n_sched, len(req.all_token_ids))
    if not cfg.store_decode:
        written = min(written, req.num_prompt_tokens)
    cap = st.caps.store_cap()
    if cap is not None:
        written = min(written, cap)
    done = written // C
    if done <= st.stored_chunks:
        return None
    ids = resolve(req.request_id)
    if ids is None:
        return None
    extend_keys(req, st.keys, done, C)
    chunks = []
    for j in range(st.stored_chunks, done):
        per_group = []
        for g in geo.groups:
            gids = ids[g.index]
            if g.kind is GroupKind.STATE:
                # vLLM that hands off boundary states gets them stored from those exact blocks
                # (plan_state_store); older vLLM: the block at the boundary's position.
                idx = (j + 1) * C // g.block_tokens - 1
                per_group.append([gids[idx] if positional_states and idx < len(gids) else SKIP])
            else:
                bpc = C // g.block_tokens
                per_group.append([gids[i] if i < len(gids) else SKIP for i in range(j * bpc, (j + 1) * bpc)])
        chunks.append(ChunkIO(st.keys[j], per_group))
        if events is not None:
            events.record(req, j, st.keys[j])
    job = StoreOrder(req.request_id, chunks, st.keys[: st.stored_chunks])
    st.stored_chunks = done
    return job


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


def state_offers(so) -> dict[str, list[tuple[int, int, int]]] | None:
    """vLLM's exact (group, block, boundary tokens) recurrent-state hand-offs, or None when this
    vLLM does not offer them (then states are read positionally)."""
    state = getattr(so, "kv_connector_block_state", None)
    if state is None or not hasattr(state, "boundary_state_offloads"):
        return None
    return state.boundary_state_offloads


def block_resolver(so, kv_cache_manager):
    state = getattr(so, "kv_connector_block_state", None)
    if state is not None:
        return state.get_block_ids
    if kv_cache_manager is not None:
        return kv_cache_manager.get_block_ids
    return lambda req_id: None
