"""Torch stand-ins for the C ops of vLLM's MLA path, for an engine built without ``vllm._C`` (the GPU
engine harness runs vLLM's pure-Python package on a host's CUDA torch: scripts/gpu_vllm_setup.sh).

vLLM's Triton MLA backend decodes with Triton kernels, but it writes the latent cache with
``concat_and_cache_mla``, reads a prefill's cached context with ``gather_and_maybe_dequant_cache`` /
``cp_gather_cache`` and merges partial attention with ``merge_attn_states``, all C ops, and its
prefill attention is flash-attn's. ``install()`` puts in their places the same arithmetic in torch
(the merge and the prefill are vLLM's own torch versions, written for its CPU platform). Slow and
unfused, and exact: the harness judges the tier's restores with them, not the engine's speed.
"""

from __future__ import annotations


def install() -> None:
    import torch
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
    from vllm.v1.attention.ops import merge_attn_states as merge

    def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype="auto", scale=None):
        n = slot_mapping.shape[0]
        src = torch.cat([kv_c.reshape(n, -1), k_pe.reshape(n, -1)], dim=-1)
        slots = slot_mapping.long()
        keep = slots >= 0
        slots, src = slots[keep], src[keep]
        bs = kv_cache.shape[1]
        kv_cache[slots // bs, slots % bs] = src.to(kv_cache.dtype)

    def gather(src_cache, dst, block_table, starts, seq, pos) -> None:
        if starts is not None:
            pos = pos + starts.long()[seq]
        bs = src_cache.shape[1]
        blocks = block_table.long()[seq, pos // bs]
        dst[: seq.shape[0]] = src_cache[blocks, pos % bs].to(dst.dtype)

    def gather_and_maybe_dequant_cache(
        src_cache,
        dst,
        block_table,
        cu_seq_lens,
        token_to_seq,
        num_tokens,
        kv_cache_dtype,
        scale,
        seq_starts=None,
    ):
        seq = token_to_seq[:num_tokens].long()
        pos = torch.arange(num_tokens, device=dst.device) - cu_seq_lens.long()[seq]
        gather(src_cache, dst, block_table, seq_starts, seq, pos)

    def cp_gather_cache(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts=None):
        cu = cu_seq_lens.long()[: batch_size + 1]
        seq = torch.repeat_interleave(torch.arange(batch_size, device=dst.device), cu[1:] - cu[:-1])
        pos = torch.arange(seq.shape[0], device=dst.device) - cu[seq]
        gather(src_cache, dst, block_table, seq_starts, seq, pos)

    ops.concat_and_cache_mla = concat_and_cache_mla
    ops.gather_and_maybe_dequant_cache = gather_and_maybe_dequant_cache
    ops.cp_gather_cache = cp_gather_cache
    ops.merge_attn_states = merge._merge_attn_states_torch
    type(current_platform).get_mla_prefill_backend_cls = classmethod(
        lambda cls, cfg: CPUSDPAMLAPrefillBackend
    )
