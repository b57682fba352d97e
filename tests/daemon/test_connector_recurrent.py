"""Recurrent-state groups (vLLM's MambaSpec in "align" prefix caching: Mamba2, gated DeltaNet)
restored from the tier, on vLLM's real Scheduler with the simulated forward (``vllm_sim``).

Every forward that starts or resumes a request checks that the state it continues from is, byte
for byte, the state after exactly the tokens before it (``SimEngine.stale_reads``), and every
attention position it reads holds what a forward wrote there.

- Which chunks get a state in the tier, with vLLM's defaults and with the settings the connector
  makes or asks for (``recurrent``): prompts of 1-8 chunks, each hit counted.
- Hits of 1-8 chunks served alone, as one batch, and in a KV cache so small that requests are
  preempted and restored again.
- Mixed sources: a prompt whose first chunks are in the engine's own prefix cache and whose later
  chunks, and the state at their end, come from the tier.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from vllm_sim import GroupDef, SimEngine  # noqa: E402

from tierd_client.vllm_connector import connector as connector_module  # noqa: E402
from tierd_client.vllm_connector.recurrent import step_warning  # noqa: E402
from tierd_client.vllm_connector.scheduler import SchedulerSide  # noqa: E402

BLOCK, CHUNK = 16, 64
GROUPS = [GroupDef("mamba", block_size=BLOCK), GroupDef("full", block_size=BLOCK)]
KS = list(range(1, 9))


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def prefixes(seed: int) -> dict[int, list[int]]:
    rng = random.Random(seed)
    return {k: tokens(k * CHUNK, rng) for k in KS}


def with_tail(prefix: list[int], rng: random.Random) -> list[int]:
    """The prefix and 20-40 tokens more: the prompt's last block boundary is not a chunk's."""
    return prefix + tokens(rng.randrange(20, 41), rng)


@pytest.fixture
def engines(tiny_model, daemon):
    made = []

    def make(**kw):
        kw.setdefault("retention", 0)  # vLLM's own default: the state at a prompt's last boundary only
        e = SimEngine(tiny_model, daemon.endpoint, GROUPS, chunk_tokens=CHUNK, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def store_alone(a: SimEngine, prompts: dict[str, list[int]]) -> None:
    """Engine A computes each prompt by itself (its prefill steps share no token budget)."""
    for rid, t in prompts.items():
        a.add(rid, t)
        a.run()
    a.flush()


# name: (the connector sets the retention interval, prefill step tokens, hit chunks per prefix of 1..8)
SETTINGS = {
    # Retention 0 keeps the state at the prompt's last block boundary (a tail past a chunk): none.
    "vllm defaults": (False, 8 * CHUNK, [0] * 8),
    # Every chunk boundary retained, but a step of the whole prompt ends only at its last block
    # boundary before the tail; the 8-chunk prefix fills a step exactly and keeps its state.
    "retention set by the connector": (True, 8 * CHUNK, [0] * 7 + [8]),
    # Steps end on every chunk boundary, but vLLM retains none of those states.
    "steps of one chunk, retention left at 0": (False, CHUNK, [0] * 8),
    "retention set, steps of one chunk": (True, CHUNK, KS),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_state_at_every_chunk_takes_the_retention_the_connector_sets_and_steps_of_one_chunk(
    engines, daemon, monkeypatch, name
):
    sets_retention, step, want = SETTINGS[name]
    if not sets_retention:  # the connector as it was before it set the interval
        monkeypatch.setattr(connector_module, "keep_states_at_chunks", lambda *a: None)
    shared = prefixes(seed=1)
    rng = random.Random(2)
    a = engines(max_batched=step)
    store_alone(a, {f"a{k}": with_tail(p, rng) for k, p in shared.items()})
    b = engines(max_batched=step)
    for k, p in shared.items():  # the same prefix, another tail, in a new engine
        b.add(f"b{k}", with_tail(p, rng))
        b.run()
    hits = [b.first_computed(f"b{k}") // CHUNK for k in KS]
    for e in (a, b):
        assert e.scheduler.kv_cache_manager.coordinator.retention_interval == (CHUNK if sets_retention else 0)
    assert not b.failed_loads and b.reads_checked > 0
    s = daemon.status()
    print(
        f"{name}: hit chunks per prefix of 1..8 chunks {hits}; stored/hit",
        s["stored_chunks"],
        s["hit_chunks"],
    )
    assert hits == want, f"{name}: hit chunks {hits}, expected {want}"
    warning = step_warning(a.vllm_config, a.connector.geo)
    if step > CHUNK:
        assert warning is not None and f"--max-num-batched-tokens {CHUNK}" in warning, warning
    else:
        assert warning is None, warning


def test_hits_of_one_to_eight_chunks_alone_batched_preempted_and_on_top_of_the_local_cache(
    engines, monkeypatch
):
    """Prompts whose prefixes of 1..8 chunks engine A stored, served by a new engine one at a time,
    then as one batch; then by a third engine with room for the longest prompt and a few blocks
    more, whose 8 requests decoding 60 tokens each are preempted and restored again; then by a
    fourth that holds the first two chunks of each prefix in its own prefix cache and takes the
    rest, with the state at its end, from the tier."""
    shared = {mode: prefixes(seed=10 + i) for i, mode in enumerate("abcd")}
    rng = random.Random(3)
    a = engines(max_batched=CHUNK)
    store_alone(a, {f"{m}{k}-a": with_tail(p, rng) for m, ps in shared.items() for k, p in ps.items()})
    prompts = {f"{m}{k}": with_tail(p, rng) for m, ps in shared.items() for k, p in ps.items()}
    loads = []  # (request, tokens the engine had, tokens from the tier) of each load
    alloc = SchedulerSide.update_state_after_alloc

    def record(self, request, blocks, num_external_tokens):
        if num_external_tokens > 0:
            local = self.reqs[request.request_id].local_tokens
            loads.append((request.request_id, local, num_external_tokens))
        return alloc(self, request, blocks, num_external_tokens)

    monkeypatch.setattr(SchedulerSide, "update_state_after_alloc", record)

    b = engines(max_batched=4 * CHUNK)
    for k in KS:  # one at a time
        b.add(f"a{k}", prompts[f"a{k}"])
        b.run()
    for k in KS:  # one batch
        b.add(f"b{k}", prompts[f"b{k}"])
    b.run()

    longest = max(len(t) for t in prompts.values())
    c = engines(num_blocks=2 * -(-longest // BLOCK) + 4, max_batched=4 * CHUNK)
    for k in KS:
        c.add(f"c{k}", prompts[f"c{k}"], max_tokens=60)
    c.run(max_steps=4000)

    d = engines(max_batched=CHUNK)
    for k in KS[2:]:
        d.add(f"d{k}-local", with_tail(shared["d"][k][: 2 * CHUNK], rng))  # the tier's first 2 chunks
        d.run()
        d.add(f"d{k}", prompts[f"d{k}"])
        d.run()

    for e in (b, c, d):
        assert not e.failed_loads and e.reads_checked > 0
    for rid in prompts:
        if rid[0] == "d" and int(rid[1:]) < 3:
            continue
        e = {"a": b, "b": b, "c": c, "d": d}[rid[0]]
        assert e.first_computed(rid) == int(rid[1:]) * CHUNK, f"{rid}: hit {e.first_computed(rid)}"
    resumed = [
        rid
        for rid, runs in c.computed.items()
        if any(s < max(x + n for x, n in runs[:i]) for i, (s, _) in enumerate(runs) if i)
    ]
    assert resumed, "no request was preempted and restored again"
    c_loads = [rid for rid, _, _ in loads if rid[0] == "c"]
    print(f"preempted and resumed: {len(resumed)} of {len(KS)}; loads {len(c_loads)}")
    assert len(c_loads) > len(KS), f"no preempted request was restored from the tier again: {c_loads}"
    mixed = {rid: (local, ext) for rid, local, ext in loads if rid.startswith("d") and "-" not in rid}
    for k in KS[2:]:
        local, ext = mixed[f"d{k}"]
        assert local == 2 * CHUNK and local + ext == k * CHUNK, f"d{k}: {local} local + {ext} from the tier"
