"""Sliding windows with speculative decoding, on vLLM's real Scheduler with a draft configuration
(n-gram drafts, 3 per step) and the simulated forward (``vllm_sim``).

With a multi-module drafter (multi-layer MTP) vLLM tags every sliding-window spec with
``extra_retained_tokens`` (its prefill lookahead - 1) and keeps that many tokens below each window
alive, because the drafter may re-prefill them. A prefix restored from the tier must then hold
those positions too, not only the window: the connector widens each sliding group's window by
them. Here the specs carry the tag as vLLM sets it for such a drafter, and every forward checks
(``stale_reads``) that the window and the retained tokens below it hold what A's forward wrote;
engine B's KV starts as noise, so a block the restore left out reads wrong.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm_sim import GroupDef, SimEngine  # noqa: E402

from tierd_client.vllm_connector import geometry  # noqa: E402

BLOCK, CHUNK = 16, 64
CASES = [(16, 15), (40, 30), (17, 47)]  # (window, extra retained tokens): one block more, several, a chunk


def run_pair(url: str, model: str, window: int, extra: int) -> SimEngine:
    groups = [
        GroupDef("sliding", block_size=BLOCK, window=window, extra=extra),
        GroupDef("full", block_size=BLOCK),
    ]
    kw = dict(chunk_tokens=CHUNK, spec_tokens=3, spec_accept=2)
    rng = random.Random(window * 100 + extra)
    prompts = {f"p{k}": [rng.randrange(10, 1000) for _ in range(k * CHUNK + 5 + k)] for k in range(1, 5)}
    a = SimEngine(model, url, groups, **kw)
    b = SimEngine(model, url, groups, **kw)
    try:
        for rid, t in prompts.items():
            a.add(rid, t)
            a.run()
        a.flush()
        noise = np.random.default_rng(extra)
        for t in b.kv.values():
            t.numpy()[:] = noise.integers(-128, 127, t.shape, dtype=np.int8)
        for rid, t in prompts.items():
            b.add(rid, t, max_tokens=8)
            b.run()
        for rid in prompts:
            assert b.first_computed(rid) == int(rid[1:]) * CHUNK, f"{rid}: hit {b.first_computed(rid)}"
        assert not b.failed_loads and b.reads_checked > 0
        return b
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("window,extra", CASES)
def test_a_restore_writes_the_tokens_vllm_keeps_below_the_window_for_a_drafter(
    tiny_model, daemon, window, extra
):
    b = run_pair(daemon.endpoint, tiny_model, window, extra)
    assert b.connector.geo.groups[0].window_tokens == window + extra


def test_a_restore_of_the_window_alone_leaves_those_tokens_stale(tiny_model, daemon, monkeypatch):
    """The negative control: the connector as it was, restoring the window only."""
    classify = geometry._classify

    def window_only(spec):
        kind, window, replicated = classify(spec)
        return kind, window - int(getattr(spec, "extra_retained_tokens", 0)), replicated

    monkeypatch.setattr(geometry, "_classify", window_only)
    with pytest.raises(AssertionError, match="read stale KV"):
        run_pair(daemon.endpoint, tiny_model, 40, 30)
