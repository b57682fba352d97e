"""What the connector derives from vLLM's KV cache config: engine groups, chunk geometry and the
namespace. Both roles compute it from the same ``KVCacheConfig``, so the scheduler's LOOKUP and
the workers' REGISTER always name the same namespace."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

from tierd.protocol.layout import GroupKind, GroupSpec, Namespace
from tierd_client.vllm_connector.config import DEFAULT_CHUNK_TOKENS


class ChunkSizeError(ValueError):
    pass


@dataclass(frozen=True)
class Group:
    index: int
    kind: GroupKind
    block_tokens: int
    window_tokens: int
    spec_name: str
    layer_names: tuple[str, ...]
    page_bytes: int  # bytes per block per layer, as vLLM sizes it
    replicated: bool  # identical on every TP rank (MLA latent, tp_replicated state)

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        return self.wire_spec.blocks_per_chunk(chunk_tokens)

    @property
    def wire_spec(self) -> GroupSpec:
        """What LOOKUP and the daemon's layout arithmetic know of this group."""
        return GroupSpec(self.kind, self.block_tokens, self.window_tokens)


@dataclass(frozen=True)
class EngineGeometry:
    groups: tuple[Group, ...]
    chunk_tokens: int
    model: str
    world_size: int
    fingerprint: str

    @property
    def replicated(self) -> bool:
        """One stored copy serves every rank (all groups are rank-independent, e.g. MLA)."""
        return self.world_size > 1 and all(g.replicated for g in self.groups)

    @property
    def attention_only(self) -> bool:
        return all(g.kind is GroupKind.FULL for g in self.groups)

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.model, self.fingerprint, self.world_size)

    def specs(self) -> tuple[GroupSpec, ...]:
        """What LOOKUP sends of each group, in order."""
        return tuple(g.wire_spec for g in self.groups)


def _classify(spec) -> tuple[GroupKind, int, bool]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    if isinstance(spec, MambaSpec):
        return GroupKind.STATE, 0, bool(getattr(spec, "tp_replicated", False))
    if type(spec) is SlidingWindowSpec:
        # With multi-module speculative decoding vLLM keeps extra_retained_tokens below the window
        # (a drafter may re-prefill them): a restore must write those too
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return GroupKind.SLIDING, int(spec.sliding_window) + extra, False
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return GroupKind.FULL, 0, isinstance(spec, MLAAttentionSpec)
    raise ValueError(
        f"TierdConnector cannot store KV cache groups of type {type(spec).__name__}; supported: "
        "FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec and MambaSpec"
    )


def build_geometry(vllm_config, kv_cache_config, chunk_tokens: int | None) -> EngineGeometry:
    """``chunk_tokens``: as set, which must fit the blocks as it is; None (unset): the least whole
    number of blocks from DEFAULT_CHUNK_TOKENS on (``fit_chunk_tokens``)."""
    groups = []
    for gi, group in enumerate(kv_cache_config.kv_cache_groups):
        if getattr(group, "enable_kv_transfer", True) is False:
            continue  # an ephemeral replica vLLM rebuilds from its source group after a load
        spec = group.kv_cache_spec
        kind, window, replicated = _classify(spec)
        groups.append(
            Group(
                index=gi,
                kind=kind,
                block_tokens=int(spec.block_size),
                window_tokens=window,
                spec_name=type(spec).__name__,
                layer_names=tuple(group.layer_names),
                page_bytes=int(getattr(spec, "page_size_bytes", 0)),
                replicated=replicated,
            )
        )
    if chunk_tokens is None:
        chunk_tokens = fit_chunk_tokens(DEFAULT_CHUNK_TOKENS, groups)
    check_chunk_tokens(chunk_tokens, groups)
    parallel = vllm_config.parallel_config
    world = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
    model = str(vllm_config.model_config.model)
    desc = {
        "chunk_tokens": chunk_tokens,
        "kv_layout": kv_cache_layout(vllm_config, kv_cache_config),
        "dtype": str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
        "model_dtype": str(vllm_config.model_config.dtype),
        "groups": [
            [g.spec_name, g.kind.value, g.block_tokens, g.window_tokens, len(g.layer_names), g.page_bytes]
            for g in groups
        ],
    }
    fingerprint = hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=8).hexdigest()
    return EngineGeometry(tuple(groups), chunk_tokens, model, world, fingerprint)


def kv_cache_layout(vllm_config, kv_cache_config) -> str:
    """The physical order of the bytes inside a KV block (vLLM's resolved layout name, e.g. NHD,
    HND, LBHNC). Two engines of one model whose blocks hold the same bytes in another order must
    not share a namespace: one would restore the other's pages scrambled. vLLM resolves the name
    once in the engine core and hands it to every worker and the scheduler in ``KVCacheConfig``;
    an older vLLM without the field names it nowhere both roles see (empty: not told apart)."""
    return str(
        getattr(kv_cache_config, "kv_cache_layout", None)
        or getattr(vllm_config.cache_config, "kv_cache_layout", None)
        or ""
    )


def block_multiple(groups) -> int:
    """The fewest tokens that are a whole number of blocks of every group."""
    return math.lcm(*(g.block_tokens for g in groups)) if groups else 1


def fit_chunk_tokens(least: int, groups) -> int:
    """The smallest whole multiple of every group's block size that is at least ``least`` tokens.
    Every engine of one model and parallel layout derives the same, so they share chunks."""
    lcm = block_multiple(groups)
    return max(1, -(-least // lcm)) * lcm


def check_chunk_tokens(chunk_tokens: int, groups) -> None:
    """Refuse a chunk size that is not a whole multiple of every group's block size."""
    lcm = block_multiple(groups)
    if chunk_tokens % lcm == 0:
        return
    suggestion = fit_chunk_tokens(chunk_tokens, groups)
    where = "; ".join(
        f"group {g.index} {g.spec_name} block_size={g.block_tokens} (KVCacheConfig.kv_cache_groups[{g.index}]"
        f".kv_cache_spec.block_size, from --block-size"
        f"{' and the mamba state size' if g.kind is GroupKind.STATE else ''})"
        for g in groups
    )
    raise ChunkSizeError(
        f"tierd.chunk_tokens={chunk_tokens} is not a whole multiple of every KV cache group's block size "
        f"[{where}]. Set kv_connector_extra_config tierd.chunk_tokens={suggestion} (a multiple of {lcm})."
    )
