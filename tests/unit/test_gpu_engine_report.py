"""benchmarks/gpu_engine.py judges a restore by comparing each prompt's token ids and logprobs
with another pass's. Regression: a logprob that is NaN (the engine read a KV block that was never
written: the negative control's skipped block) made the difference NaN, which ``max`` and ``<=``
read as no difference, so the table printed ``max dlp 0.00e+00`` for a pass whose output was
garbage, and a pass of NaNs with the same ids as its reference counted as a match."""

from __future__ import annotations

import math

import pytest
from bench_scripts import load_benchmark


@pytest.fixture
def harness(monkeypatch):
    return load_benchmark("gpu_engine", monkeypatch)


def row(ids, logprobs):
    return {"ids": ids, "logprobs": logprobs}


def test_equal_passes_match_with_their_largest_difference(harness):
    a = [row([5, 6], [-0.5, -1.0]), row([7, 8], [-0.25, -2.0])]
    b = [row([5, 6], [-0.5, -1.0004]), row([7, 8], [-0.25, -2.0])]
    got = harness.compare(a, b, 1e-3)
    assert got["match"] == 2 and got["of"] == 2
    assert got["max_lp_diff"] == pytest.approx(0.0004)


def test_a_pass_whose_logprobs_are_nan_never_matches_and_shows_an_infinite_difference(harness):
    ref = [row([5, 6], [-0.5, -1.0]), row([7, 8], [-0.25, -2.0])]
    garbage = [row([0, 0], [math.nan, math.nan]), row([7, 8], [-0.25, math.nan])]
    got = harness.compare(garbage, ref, 1e-3)
    assert got["match"] == 0
    assert got["max_lp_diff"] == math.inf
    # NaN on both sides is not agreement either: a broken model judges nothing
    both = harness.compare([row([0], [math.nan])], [row([0], [math.nan])], 1e-3)
    assert both["match"] == 0 and both["max_lp_diff"] == math.inf


def test_the_table_reads_a_nan_negative_control_as_failed_with_an_infinite_difference(harness):
    ref = [row([5, 6], [-0.5, -1.0])]
    cells = {
        key: harness.compare(ref, ref, 1e-3)
        for key in (
            "restored_vs_stored",
            "restored_vs_nothing",
            "restored_vs_none",
            "stored_vs_nothing",
            "nothing_vs_none",
        )
    }
    skip = harness.compare([row([0, 0], [math.nan, math.nan])], ref, 1e-3)
    line = harness.exact_table(
        [
            {
                "family": "gdn",
                "path": "direct",
                "dtype": "bfloat16",
                **cells,
                "skip_vs_stored": skip,
                "tier_tokens": 1024,
                "prompt_tokens": 1100,
                "skip_tier_tokens": 1024,
            }
        ]
    ).splitlines()[-1]
    assert line.endswith("| 1/1 (max dlp inf, 1024 tier tokens) |"), line


@pytest.mark.vllm
def test_the_harness_asks_each_hybrid_family_for_a_block_size_its_chunks_are_made_of(harness):
    """vLLM raises a hybrid model's attention block until its page holds one recurrent state, in
    multiples of the block size asked for (``Platform._align_hybrid_block_size``); the connector
    refuses chunks that are not whole blocks. Regression: the GDN family at vLLM's default of 16
    became 80-token blocks, and every tier pass of it failed at start-up."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from gpu_engine_models import BLOCK_SIZE, CONFIGS, EXACT_DTYPE
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    hybrids = [name for name, c in CONFIGS.items() if "linear_attention" in c.get("layer_types", [])]
    assert hybrids, "no hybrid family in the harness"
    for name in hybrids:
        c = CONFIGS[name]
        dtype = getattr(torch, EXACT_DTYPE.get(name, "float32"))
        shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
            1,
            c["linear_num_key_heads"],
            c["linear_num_value_heads"],
            c["linear_key_head_dim"],
            c["linear_value_head_dim"],
            c["linear_conv_kernel_dim"],
            0,
        )
        dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(dtype, "auto", "auto")
        state = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
        token = FullAttentionSpec(
            block_size=1, num_kv_heads=c["num_key_value_heads"], head_size=c["head_dim"], dtype=dtype
        ).page_size_bytes
        asked = BLOCK_SIZE.get(name, 16)  # vLLM's default
        block = asked * -(-state // (asked * token))
        assert harness.CHUNK % block == 0, (name, asked, block)


def passes(stored, restored, skipped, nothing, none, cached=1024):
    """Pass results by name, as benchmarks/gpu_engine.py's passes leave them (one family, direct)."""

    def res(rows, **phases):
        return {"phases": {"run": {"rows": [{**x, "cached": cached} for x in rows]}, **phases}}

    skip = {"rows": [{**x, "cached": cached} for x in skipped]}
    return {
        "gdn-direct-store": res(stored),
        "gdn-direct-restore": res(restored, skip=skip),
        "gdn-nothing": res(nothing),
        "gdn-none": res(none),
    }


def test_a_restore_and_its_negative_control_are_judged_bit_for_bit_against_the_pass_that_stored(harness):
    """Restored and stored passes prefill the same split over the same bytes, so they agree bit for
    bit; bf16's tolerance (0.1) is for passes of another configuration. Regression: on an H100 the
    GDN negative control moved one prompt's logprobs by 0.059 only, within bf16's tolerance, and the
    table counted the skipped block as not caught."""
    ref = [row([5, 6], [-0.5, -1.0]), row([7, 8], [-0.25, -2.0])]
    slightly = [row([5, 6], [-0.5, -1.059]), row([7, 8], [-0.25, -2.0001])]
    got = harness.exact_row("gdn", "direct", passes(ref, slightly, slightly, ref, slightly))
    assert got["dtype"] == "bfloat16" and got["tol"] == 0.1
    assert got["restored_vs_stored"]["match"] == 0  # 0.059 and 1e-4 off: not bit for bit
    assert got["skip_vs_stored"]["match"] == 0  # the control is caught
    assert got["restored_vs_none"]["match"] == 2  # the same configuration's outputs: equal
    assert got["restored_vs_nothing"]["match"] == 2  # another configuration: within 0.1
    assert got["tier_tokens"] == 2048 and got["prompt_tokens"] == 2 * harness.EXACT_LENS
    exact = harness.exact_row("gdn", "direct", passes(ref, ref, slightly, ref, ref))
    assert exact["restored_vs_stored"] == {"match": 2, "of": 2, "max_lp_diff": 0.0}


def test_a_missing_or_failed_pass_is_the_rows_error(harness):
    ref = [row([5, 6], [-0.5, -1.0])]
    results = passes(ref, ref, ref, ref, ref)
    results["gdn-nothing"] = {"error": "exit 1: boom"}
    assert harness.exact_row("gdn", "direct", results)["error"] == "exit 1: boom"
    del results["gdn-direct-restore"]
    assert harness.exact_row("gdn", "staged", results)["error"] == "exit 1: boom"
    assert harness.exact_row("llama", "direct", {})["error"] == "no result"
