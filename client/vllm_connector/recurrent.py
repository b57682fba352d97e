"""What a model with recurrent-state groups (Mamba2, gated DeltaNet) needs of vLLM's scheduler so
that the tier gets a state at every chunk boundary.

The tier can restore a prefix of ``k`` chunks only with the recurrent state after exactly
``k * chunk_tokens`` tokens, and vLLM ("align" prefix caching) hands a state to the connector only
where both hold:

- its prefix cache retains a state there. ``prefix_cache_retention_interval`` (vLLM's default 0)
  retains only the state at a prompt's last block boundary and at shared-prefix junctions; the
  connector sets it to one that retains every chunk boundary (``retention_interval``), through the
  ``KVCacheConfig`` vLLM hands it before the scheduler builds its KV cache manager;
- a prefill step ends there: the kernels write a state at a step's end only, so a step that runs
  over a chunk boundary leaves no state at it. vLLM reads its step size before it makes the
  connector, so this cannot be set from here: the connector says at start-up what to set
  (``step_warning``). vLLM ends a prefill step on a block boundary, not a chunk boundary, so even
  with steps of one chunk a prompt whose step shares the token budget with other requests can
  end its steps between chunk boundaries (those chunks get attention pages but no state).

A chunk without a state is not an error: a later prompt's hit ends at the last chunk that has one.
"""

from __future__ import annotations

import math

from tierd.protocol.layout import GroupKind
from tierd_client.vllm_connector.log import get_logger

log = get_logger("tierd_client.vllm_connector")


def retention_interval(current: int | None, chunk_tokens: int) -> int | None:
    """The retention interval that keeps every state vLLM keeps now and one at every chunk
    boundary: None (dense) stays; 0 (the last boundary only) becomes one chunk; a positive interval
    becomes the largest that divides both it and the chunk."""
    if current is None:
        return None
    if current == 0:
        return chunk_tokens
    return math.gcd(int(current), chunk_tokens)


def keep_states_at_chunks(vllm_config, kv_cache_config, geo) -> int | None:
    """Scheduler side, before vLLM builds its KV cache manager: set the retention interval so that
    vLLM retains (and offers the connector) a recurrent state at every chunk boundary. Returns the
    interval set, or None when nothing changed (no recurrent group, or it was fine already)."""
    if not any(g.kind is GroupKind.STATE for g in geo.groups):
        return None
    if not hasattr(kv_cache_config, "prefix_cache_retention_interval"):
        return None  # a vLLM without sparse retention keeps every block's state
    current = kv_cache_config.prefix_cache_retention_interval
    wanted = retention_interval(current, geo.chunk_tokens)
    if wanted == current:
        return None
    kv_cache_config.prefix_cache_retention_interval = wanted
    cache_config = getattr(vllm_config, "cache_config", None)
    if cache_config is not None and hasattr(cache_config, "prefix_cache_retention_interval"):
        cache_config.prefix_cache_retention_interval = wanted
    log.info(
        "tierd: prefix_cache_retention_interval %s -> %d, so that vLLM keeps a recurrent state at "
        "every %d-token chunk for the tier",
        current,
        wanted,
        geo.chunk_tokens,
    )
    return wanted


def apply_to_manager(kv_cache_manager, wanted: int | None) -> None:
    """Where vLLM built its KV cache manager before the connector: set the interval it reads
    (``coordinator.retention_interval``, read at every step) as well."""
    coordinator = getattr(kv_cache_manager, "coordinator", None)
    if wanted is not None and coordinator is not None and hasattr(coordinator, "retention_interval"):
        coordinator.retention_interval = wanted


def step_warning(vllm_config, geo) -> str | None:
    """The start-up line for an engine whose prefill steps can run over a chunk boundary (None
    when they cannot, or the model has no recurrent group)."""
    if not any(g.kind is GroupKind.STATE for g in geo.groups):
        return None
    sched = vllm_config.scheduler_config
    step = getattr(sched, "max_num_scheduled_tokens", None) or sched.max_num_batched_tokens
    C = geo.chunk_tokens
    if step <= C:
        return None
    return (
        f"tierd: prefill steps of up to {step} tokens (max_num_batched_tokens) keep a recurrent "
        f"state only where a step ends, so most {C}-token chunks of a long prompt get no state and "
        f"a later prompt's hit ends at the last chunk where a step ended; set "
        f"--max-num-batched-tokens {C} (tierd.chunk_tokens) to store a state at every chunk"
    )
