"""What the CPU and CUDA benches share: a private daemon, a memcpy baseline, a fast data pattern
and progress reporting (phases from the start, then a bar whose ETA counts bytes moved)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


class BenchError(Exception):
    pass


@contextlib.contextmanager
def private_daemon(pool_bytes: int, extra: tuple[str, ...] = (), source: str | None = None):
    """A ``tierd serve`` subprocess on a private socket; yields its endpoint. ``source``: a folder
    holding another copy of the ``tierd`` package to run instead (an older revision, for A/B)."""
    folder = tempfile.mkdtemp(prefix="tierd-bench-")
    endpoint = f"ipc://{folder}/tierd.sock"
    cmd = [
        sys.executable,
        "-m",
        "tierd",
        "serve",
        "--socket",
        endpoint,
        "--http-port",
        "-1",
        "--l1-size-gb",
        f"{pool_bytes / 2**30:.6f}",
        "--log-level",
        "warning",
        *extra,
    ]
    env = None
    if source is not None:
        path = [source, os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [source]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.Popen(cmd, env=env, cwd=source)
    try:
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    src = np.empty(nbytes, dtype=np.uint8)
    fill_pattern(src)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def fill_pattern(a: np.ndarray, seed: int = 0x9E3779B1) -> None:
    """Fill ``a`` (uint8, C-contiguous rows) with distinct, position-dependent bytes, at memory speed
    (a random generator would take seconds per GiB: the bench would look stuck before it starts)."""
    flat = a.reshape(-1)
    n = len(flat) // 4 * 4
    words = flat[:n].view(np.uint32)
    words[:] = np.arange(len(words), dtype=np.uint32)
    words *= np.uint32(seed)
    words ^= words >> np.uint32(13)
    flat[n:] = 7


class Progress:
    """Phases on stderr as they start, then a bar over bytes moved (so its ETA is honest)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.t0 = time.monotonic()

    def phase(self, what: str) -> None:
        if self.enabled:
            print(f"bench: {what} ({time.monotonic() - self.t0:.1f} s)", file=sys.stderr, flush=True)

    def bar(self, total: int, label: str):
        """``step(n)`` advances by ``n`` units; ``step(None)`` ends the bar."""
        if not self.enabled:
            return lambda n: None
        import click

        bar = click.progressbar(length=total, label=f"bench: {label}", file=sys.stderr, show_eta=True)
        bar.__enter__()

        def step(n):
            if n is None:
                bar.__exit__(None, None, None)
            else:
                bar.update(n)

        return step
