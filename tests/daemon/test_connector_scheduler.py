"""TierdConnector driven by vLLM's real Scheduler (both roles) against a real ``tierd serve``.

Engine "A" computes and stores a prompt; engine "B" (a fresh scheduler, block pool and zeroed KV
tensors: a new engine in all but the process) must get the prefix from the tier, byte for byte,
in single-group, sliding-window and attention + mamba configurations; failures injected between
LOOKUP and RETRIEVE must end in a recompute, never a hang or a lookup/load loop.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import sys
import time

import pytest

pytest.importorskip("vllm")

from vllm_sim import GroupDef, SimEngine  # noqa: E402

CHUNK = 64

CONFIGS = {
    "single": [GroupDef("full")],
    "sliding": [GroupDef("full"), GroupDef("sliding", window=40)],
    "mamba": [GroupDef("full"), GroupDef("mamba")],
}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


@pytest.fixture
def engines(tiny_model, daemon):
    made = []

    def make(groups, **kw):
        e = SimEngine(tiny_model, daemon.endpoint, groups, chunk_tokens=kw.pop("chunk_tokens", CHUNK), **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        try:
            e.close()
        except Exception:  # noqa: BLE001 - a test may have killed the daemon
            pass


def stored_then_asked_by_a_new_engine(engines, config: str, tokens: list[int]) -> SimEngine:
    """Engine "a" computes and stores ``tokens``; a new engine "b" is asked for them (request "b")."""
    a = engines(CONFIGS[config])
    a.add("a", tokens)
    a.run()
    b = engines(CONFIGS[config])
    b.add("b", tokens)
    return b


@pytest.mark.parametrize("config", list(CONFIGS))
def test_new_engine_restores_prefix_byte_equal(engines, daemon, config):
    groups = CONFIGS[config]
    tokens = prompt(200, seed=len(config))
    a = engines(groups)
    a.add("a", tokens)
    a.run()
    assert a.first_computed("a") == 0  # nothing in the tier yet
    stored = daemon.status()["stored_chunks"]
    assert stored >= 3

    b = engines(groups)
    b.add("b", tokens)
    b.run()
    hit = b.first_computed("b")
    assert hit == 3 * CHUNK, f"{config}: expected the forward to start after 3 restored chunks, got {hit}"
    assert not b.failed_loads
    b.assert_restored("b", tokens, hit)
    s = daemon.status()
    assert s["retrieved_chunks"] >= 3 and s["retrieve_failed_blocks"] == 0


@pytest.mark.parametrize("config", ["single", "mamba"])
def test_whole_prompt_hit_leaves_one_token_to_compute(engines, config):
    tokens = prompt(200, seed=11)
    a = engines(CONFIGS[config])
    a.add("a", tokens)
    a.run()
    b = engines(CONFIGS[config])
    if config == "single":
        # a prompt of exactly 3 chunks: attention restores all but the last token, which is recomputed
        b.add("b", tokens[: 3 * CHUNK])
        b.run()
        assert b.first_computed("b") == 3 * CHUNK - 1
    else:
        # a recurrent state exists only at chunk boundaries, so the hit must end short of the last
        # token: 3 chunks + 1 token restores 3 chunks and computes the one token left
        b.add("b", tokens[: 3 * CHUNK + 1])
        b.run()
        assert b.first_computed("b") == 3 * CHUNK
        b.assert_restored("b", tokens, 3 * CHUNK)
    assert "b" in b.finished and not b.failed_loads


def test_cache_salt_separates_prefixes(engines):
    tokens = prompt(200, seed=3)
    a = engines(CONFIGS["single"])
    a.add("a", tokens, cache_salt="tenant-1")
    a.run()
    b = engines(CONFIGS["single"])
    b.add("other-tenant", tokens, cache_salt="tenant-2")
    b.add("same-tenant", prompt(200, seed=3), cache_salt="tenant-1")
    b.run()
    assert b.first_computed("other-tenant") in (0, 3 * CHUNK)
    assert b.first_computed("same-tenant") == 3 * CHUNK
    # the other tenant never read tenant-1's chunks: it computed from 0 or hit its own engine's APC
    assert b.computed["other-tenant"][0][0] == 0 or b.first_computed("same-tenant") < b.first_computed(
        "other-tenant"
    )


def test_chunk_size_that_is_not_a_block_multiple_is_refused(tiny_model, daemon):
    from tierd_client.vllm_connector.geometry import ChunkSizeError

    with pytest.raises(ChunkSizeError) as err:
        SimEngine(tiny_model, daemon.endpoint, [GroupDef("full", block_size=16)], chunk_tokens=40)
    msg = str(err.value)
    assert "tierd.chunk_tokens=48" in msg and "block_size=16" in msg and "--block-size" in msg


@pytest.mark.parametrize("config", ["single", "mamba"])
def test_an_unset_chunk_size_is_the_least_whole_number_of_blocks_from_256_and_restores(engines, config):
    """Blocks that do not divide 256 tokens (vLLM sizes a hybrid model's from its recurrent state):
    with tierd.chunk_tokens unset both roles take chunks of 320 tokens (four 80-token blocks) and a
    new engine restores them; the engine used to refuse to start with the default."""
    groups = [dataclasses.replace(g, block_size=80) for g in CONFIGS[config]]
    tokens = prompt(2 * 320 + 50, seed=11)
    lines: list[str] = []
    said = logging.Handler(logging.INFO)
    said.emit = lambda record: lines.append(record.getMessage())
    connector_log = logging.getLogger("tierd_client.vllm_connector")
    connector_log.addHandler(said)
    try:
        a = engines(groups, chunk_tokens=None)
    finally:
        connector_log.removeHandler(said)
    assert a.connector.geo.chunk_tokens == a.worker.geo.chunk_tokens == 320
    started = [ln for ln in lines if ln.startswith("TierdConnector (") and ": chunks of" in ln]
    assert len(started) == 2 and all(
        "chunks of 320 tokens (tierd.chunk_tokens unset: 256 is no whole number of blocks [80])" in ln
        for ln in started
    ), started
    a.add("a", tokens)
    a.run()
    b = engines(groups, chunk_tokens=None)
    b.add("b", tokens)
    b.run()
    assert b.first_computed("b") == 2 * 320 and not b.failed_loads
    b.assert_restored("b", tokens, 2 * 320)


def _lookups(daemon) -> int:
    return daemon.status()["lookups"]


def test_object_evicted_between_lookup_and_retrieve_recomputes(
    engines, daemon_factory, tiny_model, client_factory
):
    d = daemon_factory("--lease-ttl-s", "0.3")
    tokens = prompt(200, seed=21)
    a = SimEngine(tiny_model, d.endpoint, CONFIGS["single"], chunk_tokens=CHUNK)
    a.add("a", tokens)
    a.run()
    a.close()
    admin = client_factory(d)
    b = SimEngine(tiny_model, d.endpoint, CONFIGS["single"], chunk_tokens=CHUNK)
    try:
        b.add("b", tokens)
        evicted = []

        def evict(so):
            if not evicted and so.kv_connector_metadata.loads:  # LOOKUP answered, load planned
                time.sleep(0.8)  # the lease's TTL passes
                evicted.append(admin.clear().evicted)

        before = _lookups(d)
        b.run(after_schedule=evict)
        assert evicted and evicted[0] >= 3
        assert "b" in b.failed_loads
        assert b.computed["b"][-1][0] >= 0 and "b" in b.finished
        # recomputed from scratch after the failed load, and the tier was not asked again
        starts = [s for s, _ in b.computed["b"]]
        assert starts[0] == 0
        assert _lookups(d) - before == 1
    finally:
        b.close()


def test_daemon_killed_mid_load_recomputes_without_hanging(daemon, tiny_model):
    tokens = prompt(200, seed=31)
    a = SimEngine(tiny_model, daemon.endpoint, CONFIGS["mamba"], chunk_tokens=CHUNK)
    a.add("a", tokens)
    a.run()
    a.close()
    b = SimEngine(tiny_model, daemon.endpoint, CONFIGS["mamba"], chunk_tokens=CHUNK)
    try:
        b.add("b", tokens)
        killed = []

        def kill(so):
            if not killed and so.kv_connector_metadata.loads:
                daemon.kill()
                killed.append(True)

        t0 = time.monotonic()
        b.run(after_schedule=kill, max_steps=5000)
        assert killed
        assert "b" in b.failed_loads  # hybrid model: reported as failed_recving
        assert [s for s, _ in b.computed["b"]][0] == 0
        assert time.monotonic() - t0 < 30
        # later requests run without the tier, without waiting for it
        b.add("c", prompt(200, seed=32))
        t1 = time.monotonic()
        b.run(max_steps=5000)
        assert "c" in b.finished and time.monotonic() - t1 < 15
    finally:
        b.close()


def test_speculative_step_over_a_chunk_boundary_still_stores_the_chunk(engines):
    """Decode with 3 drafts a step (2 accepted, 1 rejected): positions jump 250 -> 253 -> 256 ->
    ...; the chunk ending at 256 is still stored, with the accepted tokens' KV, never a rejected
    draft's."""
    tokens = prompt(250, seed=41)
    a = engines(CONFIGS["single"], spec_tokens=3, spec_accept=2)
    a.add("a", tokens, max_tokens=14)
    a.run()
    full = tokens + [SimEngine.true_token(i) for i in range(14)]
    steps = [n for _, n in a.computed["a"]]
    assert max(steps[1:]) > 1, "the engine never ran a speculative step"
    b = engines(CONFIGS["single"])
    b.add("b", full[: 4 * CHUNK + 1])
    b.run()
    assert b.first_computed("b") == 4 * CHUNK  # chunk 3 (192..256), crossed by a draft step, was stored
    b.assert_restored("b", full, 4 * CHUNK)


def test_request_aborted_while_its_load_is_in_flight_keeps_its_blocks_until_the_load_lands(engines, daemon):
    """A request that ends during its load must keep its blocks until the load has landed (vLLM
    holds them until finished_recving names it), or the daemon writes into blocks vLLM has handed
    to other requests; the late finished_recving must then free them."""
    import os
    import signal

    from vllm.v1.request import RequestStatus

    tokens = prompt(200, seed=51)
    b = stored_then_asked_by_a_new_engine(engines, "sliding", tokens)
    held = {}

    def pause_and_abort(so):
        if not held and so.kv_connector_metadata.loads:
            os.kill(daemon.proc.pid, signal.SIGSTOP)  # the RETRIEVE stays in flight
            held["blocks"] = [
                blk for ids in b.scheduler.kv_cache_manager.get_block_ids("b") for blk in ids if blk
            ]
            b.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)

    try:
        b.step(after_schedule=pause_and_abort)
        while not held:
            b.step(after_schedule=pause_and_abort)
        pool = b.scheduler.kv_cache_manager.block_pool
        assert held["blocks"] and all(pool.blocks[i].ref_cnt > 0 for i in held["blocks"]), (
            "blocks of a request whose load is in flight were freed"
        )
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    for _ in range(500):
        b.step()
        if "b" not in b.scheduler.requests:
            break
        time.sleep(0.01)
    assert "b" not in b.scheduler.requests  # freed once the load landed
    assert all(pool.blocks[i].ref_cnt == 0 for i in held["blocks"])


def test_an_engine_loop_that_holds_the_gil_sees_its_load_land_without_waiting_out_the_switch_interval(
    engines, daemon
):
    """vLLM's engine loop steps without pause while a request waits for its load, and holds the
    interpreter's lock between steps: a load whose reply only the client's I/O thread reads waits
    for that lock up to the switch interval (5 ms by default) per hand-over. The worker polls its
    loads, reading what the client's sockets hold on the engine's thread. Here the interval is 2 s
    and the loop gives up after 1 s of steps."""
    tokens = prompt(200, seed=5)
    b = stored_then_asked_by_a_new_engine(engines, "single", tokens)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(2.0)
    try:
        t0 = time.perf_counter()
        while b.scheduler.has_unfinished_requests() and time.perf_counter() - t0 < 1.0:
            b.step()  # no sleep between steps: the engine's loop holds the interpreter's lock
        elapsed = time.perf_counter() - t0
    finally:
        sys.setswitchinterval(interval)
    b.run()
    assert b.first_computed("b") == 3 * CHUNK and not b.failed_loads
    b.assert_restored("b", tokens, 3 * CHUNK)
    assert "b" in b.finished and elapsed < 1.0, (elapsed, b.steps)
