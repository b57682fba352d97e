"""Per-request ``kv_transfer_params`` on vLLM's real Scheduler against a real ``tierd serve``:
``max_load_tokens`` caps (0: disables) what a request loads, ``max_offload_tokens`` caps what
it stores, ``tierd.skip`` does neither, and a malformed value is ignored, never an error."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from vllm_sim import GroupDef, SimEngine  # noqa: E402

CHUNK = 64
FULL = [GroupDef("full")]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


@pytest.fixture
def engines(tiny_model, daemon):
    made = []

    def make(groups=FULL, **kw):
        e = SimEngine(tiny_model, daemon.endpoint, groups, chunk_tokens=CHUNK, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture
def stored(engines, daemon):
    """A prompt of 4 chunks + a tail, stored by a first engine."""
    tokens = prompt(4 * CHUNK + 10, seed=81)
    a = engines()
    a.add("a", tokens)
    a.run()
    assert daemon.status()["stored_chunks"] == 4
    return tokens


def counters(daemon) -> dict:
    s = daemon.status()
    return {k: s[k] for k in ("lookups", "retrieved_chunks", "stored_chunks")}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("cap, loaded_chunks", [(130, 2), (64, 1), (63, 0), (10_000, 4)])
def test_max_load_tokens_caps_what_a_request_loads(engines, daemon, stored, cap, loaded_chunks):
    b = engines()
    before = counters(daemon)
    b.add("b", stored, kv_transfer_params={"max_load_tokens": cap})
    b.run()
    d = delta(counters(daemon), before)
    assert b.first_computed("b") == loaded_chunks * CHUNK <= cap
    assert d["retrieved_chunks"] == loaded_chunks
    if loaded_chunks:
        b.assert_restored("b", stored, loaded_chunks * CHUNK)
    assert "b" in b.finished and not b.failed_loads


def test_max_load_tokens_zero_disables_loading_and_sends_no_lookup(engines, daemon, stored):
    b = engines()
    before = counters(daemon)
    b.add("b", stored, kv_transfer_params={"max_load_tokens": 0})
    b.run()
    d = delta(counters(daemon), before)
    assert d["lookups"] == 0 and d["retrieved_chunks"] == 0
    assert b.first_computed("b") == 0


def test_max_load_tokens_counts_beyond_the_local_prefix_cache_hit(engines, daemon, stored):
    """The cap is on tokens *loaded*: with 1 chunk already in the engine's own prefix cache, a
    cap of 2 chunks ends the hit at chunk 3."""
    b = engines()
    b.add("warm", stored[: CHUNK + 5], kv_transfer_params={"tierd.skip": True})
    b.run()
    before = counters(daemon)
    b.add("b", stored, kv_transfer_params={"max_load_tokens": 2 * CHUNK})
    b.run()
    assert b.first_computed("b") == 3 * CHUNK
    assert delta(counters(daemon), before)["retrieved_chunks"] == 2
    b.assert_restored("b", stored, 3 * CHUNK)


@pytest.mark.parametrize("cap, stored_chunks", [(130, 2), (0, 0), (10_000, 4)])
def test_max_offload_tokens_caps_what_a_request_stores(engines, daemon, cap, stored_chunks):
    tokens = prompt(4 * CHUNK + 10, seed=82)
    a = engines()
    a.add("a", tokens, kv_transfer_params={"max_offload_tokens": cap})
    a.run()
    assert daemon.status()["stored_chunks"] == stored_chunks
    b = engines()
    b.add("b", tokens)
    b.run()
    assert b.first_computed("b") == stored_chunks * CHUNK


def test_max_offload_tokens_caps_recurrent_states_too(engines, daemon):
    """A recurrent state exists only where a step ended: prefill one chunk per step, so every
    boundary has one, and the cap keeps the states past it out of the tier as well."""
    tokens = prompt(4 * CHUNK + 10, seed=83)
    a = engines([GroupDef("full"), GroupDef("mamba")], max_batched=CHUNK)
    a.add("a", tokens, kv_transfer_params={"max_offload_tokens": 2 * CHUNK})
    a.run()
    stored = daemon.status()["stored_chunks"]
    b = engines([GroupDef("full"), GroupDef("mamba")])
    b.add("b", tokens)
    b.run()
    assert b.first_computed("b") == 2 * CHUNK, f"{stored} chunk results stored by the capped request"
    b.assert_restored("b", tokens, 2 * CHUNK)


def test_tierd_skip_neither_loads_nor_stores(engines, daemon, stored):
    fresh = prompt(4 * CHUNK + 10, seed=84)
    b = engines()
    before = counters(daemon)
    b.add("old", stored, kv_transfer_params={"tierd.skip": True})
    b.add("new", fresh, kv_transfer_params={"tierd.skip": "true"})
    b.run()
    assert delta(counters(daemon), before) == {"lookups": 0, "retrieved_chunks": 0, "stored_chunks": 0}
    assert b.first_computed("old") == 0 and b.first_computed("new") == 0


@pytest.mark.parametrize(
    "params",
    [
        {"max_load_tokens": "128"},
        {"max_load_tokens": -1},
        {"max_offload_tokens": 1.5},
        {"tierd.skip": "maybe"},
    ],
)
def test_malformed_params_are_ignored(engines, daemon, stored, params):
    b = engines()
    b.add("b", stored, kv_transfer_params=params)
    b.run()
    assert "b" in b.finished and b.first_computed("b") == 4 * CHUNK
