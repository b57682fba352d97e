"""Sliding-window groups restored from the tier, at the level of vLLM's real Scheduler.

Engine A computes and stores a prompt; engine B (fresh scheduler and block pool, its KV tensors
full of noise) gets the prefix from the tier. At B's first forward, before it writes anything:

- every position the sliding-window attention reads for the first computed token (the window
  before the hit boundary) and every full-attention position holds, byte for byte, what A's
  forward wrote there (``SimEngine.stale_reads`` checks this on every forward of every test);
- the load wrote exactly the pages it must and no other: all of the full group's blocks of the
  hit, and of the sliding group only the blocks the window touches. A block the window does not
  need is neither loaded nor left where the engine reads it (vLLM gives those positions its null
  block, which must stay untouched).

Windows: smaller than a block, one block, several blocks on and off a block edge, one chunk,
more than a chunk. Hit boundaries land on and off a window edge (the window's first position
is or is not a block's first position).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm_sim import GroupDef, SimEngine  # noqa: E402

BLOCK, CHUNK = 16, 64

# The window's first position for a boundary at a multiple of CHUNK is boundary - window + 1: on a
# block edge for 17 and 49, inside a block for the others. 5 < a block, 16 = a block, 64 = a chunk,
# 100 > a chunk (the window reaches back into the chunk before the last).
WINDOWS = [5, 16, 17, 40, 49, 64, 100]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def window_blocks(boundary: int, window: int) -> list[int]:
    """Block indices (in the request's table) the first token after ``boundary`` reads."""
    first = max(0, boundary - window + 1)
    return list(range(first // BLOCK, -(-boundary // BLOCK)))


@pytest.fixture
def pair(tiny_model, daemon):
    made = []

    def make(groups, **kw):
        e = SimEngine(tiny_model, daemon.endpoint, groups, chunk_tokens=CHUNK, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _noise(engine: SimEngine, seed: int) -> dict[int, np.ndarray]:
    """Fill every KV page with noise; return a copy per distinct tensor."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in engine.kv.values():
        if id(t) not in out:
            t.numpy()[:] = rng.integers(-128, 127, t.shape, dtype=np.int8)
            out[id(t)] = t.numpy().copy()
    return out


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("prompt_tokens", [3 * CHUNK + 20, 4 * CHUNK + 1])
def test_first_token_after_a_hit_reads_the_window_it_would_have_computed(pair, window, prompt_tokens):
    groups = [GroupDef("full", block_size=BLOCK), GroupDef("sliding", block_size=BLOCK, window=window)]
    tokens = prompt(prompt_tokens, seed=window * 7 + prompt_tokens)
    a = pair(groups)
    a.add("a", tokens)
    a.run()

    b = pair(groups)
    before = _noise(b, seed=window)
    null = b.scheduler.kv_cache_manager.block_pool.null_block.block_id
    seen = {}

    def first_forward(so):
        if "b" in so.num_scheduled_tokens and not seen:
            seen["table"] = [list(x) for x in b.scheduler.kv_cache_manager.get_block_ids("b")]
            seen["kv"] = {id(t): t.numpy().copy() for t in b.kv.values()}

    b.on_forward = first_forward
    b.add("b", tokens)
    b.run()
    hit = b.first_computed("b")
    boundary = (prompt_tokens - 1) // CHUNK * CHUNK  # the last chunk boundary short of the last token
    assert hit == boundary, f"window {window}: expected a hit of {boundary} tokens, got {hit}"
    assert b.reads_checked > 0 and not b.failed_loads

    full_ids, swa_ids = seen["table"]
    want_full = {full_ids[i] for i in range(boundary // BLOCK)}
    want_swa = {swa_ids[i] for i in window_blocks(boundary, window)}
    # every block the window reads is a real block (not vLLM's null page) ...
    assert null not in want_swa
    # ... and positions the window does not need are vLLM's null page, which nobody wrote
    assert all(swa_ids[i] == null for i in range(window_blocks(boundary, window)[0]))
    changed = set()
    for key, snap in before.items():
        now = seen["kv"][key]
        changed |= set(np.flatnonzero((now != snap).reshape(len(now), -1).any(axis=1)).tolist())
    assert changed == want_full | want_swa, (
        f"window {window}: the load wrote blocks {sorted(changed - want_full - want_swa)} it must not "
        f"and missed {sorted((want_full | want_swa) - changed)}"
    )
    assert null not in changed


# (block tokens, window tokens): windows of 1, 2 and 4 blocks of 16 and of 32 tokens, and sizes in
# between (one token, a block and a half, one past two blocks); 64-token chunks throughout.
SWEEP = [(16, 1), (16, 16), (16, 24), (16, 32), (16, 64), (32, 32), (32, 48), (32, 64), (32, 65), (32, 128)]


@pytest.mark.parametrize("block,window", SWEEP)
def test_every_hit_boundary_restores_what_the_forward_wrote_alone_batched_and_preempted(pair, block, window):
    """Prompts with prefixes of 1..8 chunks restored one at a time, then as one batch, then as a
    batch in a KV cache so small that requests are preempted and restored again: each forward reads
    (stale_reads: every position of every group its attention reads) exactly what A's forward
    wrote there, and each first hit is the whole-chunk prefix."""
    groups = [GroupDef("sliding", block_size=block, window=window), GroupDef("full", block_size=block)]
    prompts = {
        f"p{k}-{mode}": prompt(k * CHUNK + 5 + k, seed=k * 31 + window + block + 1000 * "abc".index(mode))
        for mode in "abc"
        for k in range(1, 9)
    }
    a = pair(groups, num_blocks=512, max_batched=1024)
    for rid, tokens in prompts.items():
        a.add(rid, tokens)
    a.run()
    a.flush()

    b = pair(groups, num_blocks=512, max_batched=1024)
    _noise(b, seed=window + block)
    for rid, tokens in prompts.items():  # one at a time: each restored from the tier alone
        if rid.endswith("-a"):
            b.add(rid, tokens)
            b.run()
    for rid, tokens in prompts.items():  # then one batch
        if rid.endswith("-b"):
            b.add(rid, tokens)
    b.run()
    # a KV cache that admits the longest prompt in both groups with a few blocks to spare, for 8
    # requests that decode 60 tokens each
    longest = max(len(t) for t in prompts.values())
    c = pair(groups, num_blocks=2 * -(-longest // block) + -(-window // block) + 2, max_batched=1024)
    _noise(c, seed=window + block + 1)
    for rid, tokens in prompts.items():
        if rid.endswith("-c"):
            c.add(rid, tokens, max_tokens=60)
    c.run(max_steps=3000)
    for engine in (b, c):
        assert not engine.failed_loads and engine.reads_checked > 0
    for rid in prompts:
        k = int(rid[1 : rid.index("-")])
        engine = c if rid.endswith("-c") else b
        assert engine.first_computed(rid) == k * CHUNK, f"{rid}: hit {engine.first_computed(rid)}"
    # preempted and resumed: a forward that starts at or before one the request already ran
    resumed = [
        rid
        for rid, runs in c.computed.items()
        if any(s <= max(x for x, _ in runs[:i]) for i, (s, _) in enumerate(runs) if i)
    ]
    assert resumed, "no request was preempted and resumed"
