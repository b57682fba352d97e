"""The models of the GPU engine harness (benchmarks/gpu_engine.py): a ``config.json`` each, no weight
files and no tokenizer. The engine loads them with ``load_format="dummy"`` and ``skip_tokenizer_init``,
and ``install_scaled_init`` replaces vLLM's dummy weights (uniform in +-1e-3: flat logits, every
greedy step a near tie) with seeded normal ones scaled by fan-in, so activations keep unit variance,
the output follows the context and the logits are sharp (lm_head x4): exactness can be judged.
Every process draws the same weights (one generator per parameter, seeded by its name).

Families (what the connector claims): ``llama`` (one KV group), ``gemma3`` (sliding window + full
attention: two groups), ``mla`` (DeepSeek-V2-lite-shaped latent attention, dense MLPs),
``gdn`` (Qwen3-Next's gated delta-net state + full attention, as Qwen3.5's dense text model: vLLM's
Qwen3-Next needs an MoE layer, whose routing kernels are C ops); and the timing
shapes ``llama1b`` (16 layers, 8 KV heads of 64: 32 KiB of KV per token in bf16) and ``llama8b``
(32 layers, 8 KV heads of 128: 128 KiB per token).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

VOCAB = 4096
MAX_POS = 40960

_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=MAX_POS,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)

CONFIGS: dict[str, dict] = {
    "llama": _LLAMA,
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=True,
    ),
    "mla": dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=4,  # every layer dense: no fused-MoE kernel needed
        moe_layer_freq=1,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    ),
    "gdn": dict(  # Qwen3.5's dense text model: Qwen3-Next's gated delta-net + full attention layers
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    ),
    "llama1b": {
        **_LLAMA,
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "llama8b": {
        **_LLAMA,
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
    },
}

# the engine's attention backend per family on a GPU (None: TRITON_ATTN), and the dtype exactness is
# judged in (Triton MLA and the GDN prefill kernel run in bf16/fp16 only; the others in float32)
GPU_BACKEND = {"mla": "TRITON_MLA"}
EXACT_DTYPE = {"mla": "bfloat16", "gdn": "bfloat16"}
# vLLM's additional_config per family on a GPU: its GDN prefill on Hopper is FlashInfer's kernel
# (not in this engine build) unless the Triton one is asked for
GPU_CONFIG = {"gdn": {"gdn_prefill_backend": "triton"}}
# the engine's --block-size per family. A hybrid's attention block is raised until its page holds
# one recurrent state (vLLM's Platform._align_hybrid_block_size, in multiples of the block size
# asked for): gdn's float32 state is 70 KiB a layer and its attention 1 KiB a token, so vLLM's
# default of 16 would become 80 tokens, which no 256-token chunk is made of (the connector refuses
# it at start-up); asked for 128, it stays 128
BLOCK_SIZE = {"gdn": 128}


def kv_bytes_per_token(name: str, dtype_bytes: int = 2) -> int:
    c = CONFIGS[name]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * dtype_bytes


def write(name: str, root: Path) -> str:
    """The model folder of ``name`` under ``root`` (a config.json)."""
    d = Path(root) / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**CONFIGS[name], "torch_dtype": "bfloat16"}, indent=1))
    return str(d)


def scaled_init(model, tied: bool, seed: int = 0) -> None:
    """Seeded weights for every parameter of a vLLM model: norms 1, vectors N(0, 0.1), embeddings
    N(0, 1) (N(0, 1/hidden) when tied to the output), lm_head N(0, 16/fan_in), others N(0, 1/fan_in)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator(device=p.device).manual_seed(seed ^ zlib.crc32(name.encode()))
            if "norm" in name:
                p.fill_(1.0)
                continue
            x = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            if p.dim() == 1:
                x *= 0.1
            elif "embed_tokens" in name:
                x *= p.shape[-1] ** -0.5 if tied else 1.0
            elif "lm_head" in name:
                x *= 4 * p.shape[-1] ** -0.5
            else:
                x *= p.shape[-1] ** -0.5
            p.copy_(x.to(p.dtype))


def install_scaled_init(name: str) -> None:
    """Make vLLM's dummy loader draw ``scaled_init`` weights (call in the engine's process)."""
    from vllm.model_executor.model_loader import dummy_loader

    tied = bool(CONFIGS[name].get("tie_word_embeddings"))

    def load_weights(self, model, model_config) -> None:
        scaled_init(model, tied)

    dummy_loader.DummyModelLoader.load_weights = load_weights
