"""What the CPU and CUDA benches share: a private daemon, a memcpy baseline, a fast data pattern
and progress reporting (each phase with the time the one before took, then a bar whose ETA counts
bytes moved)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

import click
import numpy as np

from tierd.base.stats import STAGES
from tierd.tools.testing import ServeProcess


class BenchError(Exception):
    pass


@contextlib.contextmanager
def private_daemon(pool_bytes: int, extra: tuple[str, ...] = (), source: str | None = None):
    """A ``tierd serve`` subprocess on a private socket (tierd/tools/testing.py's launcher); yields its
    endpoint once the socket is bound. ``source``: a folder holding another copy of the ``tierd``
    package to run instead (an older revision, for A/B)."""
    folder = tempfile.mkdtemp(prefix="tierd-bench-")
    env = None
    if source is not None:
        path = [source, os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [source]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    daemon = ServeProcess(
        folder,
        *extra,
        http_port=-1,
        pool_mb=pool_bytes / 2**20,
        log_level="warning",
        log=False,
        env=env,
        cwd=source,
    )
    try:
        yield daemon.endpoint
    finally:
        try:
            daemon.stop(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(folder, ignore_errors=True)


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


def fill_pattern(a: np.ndarray, seed: int = 0x9E3779B1, start: int = 0) -> int:
    """Fill ``a`` (uint8) with distinct, position-dependent bytes, at memory speed (a random
    generator would take seconds per GiB: the bench would look stuck before it starts). ``a`` may
    be a strided view (the first half of each layer's blocks): each C-contiguous piece is filled in
    place, its words numbered on from ``start``. Returns the next number."""
    if not a.flags.c_contiguous:  # reshape(-1) would fill a copy and leave ``a`` as it was
        for row in a:
            start = fill_pattern(row, seed, start)
        return start
    flat = a.reshape(-1)
    n = len(flat) // 4 * 4
    words = flat[:n].view(np.uint32)
    words[:] = np.arange(len(words), dtype=np.uint32)
    words += np.uint32(start % 2**32)
    words *= np.uint32(seed)
    words ^= words >> np.uint32(13)
    flat[n:] = 7
    return start + len(words)


class Progress:
    """Phases on stderr as they start, each with the time the one before took; then a bar over
    bytes moved (so its ETA is honest), and the time it took. ``clock`` and ``out``: for tests."""

    def __init__(self, enabled: bool, clock=time.monotonic, out=None):
        self.enabled = enabled
        self.clock = clock
        self.out = out
        self._open: tuple[str, float] | None = None  # the phase running, and when it started

    def phase(self, what: str) -> None:
        before = self._close()
        self._say(f"{what}{f' ({before})' if before else ''}")
        self._open = (what, self.clock())

    def bar(self, total: int, label: str):
        """``step(n)`` advances by ``n`` units; ``step(None)`` ends the bar."""
        self.phase(label)
        if not self.enabled:
            return lambda n: self._say(self._close()) if n is None else None
        bar = click.progressbar(length=total, label=f"bench: {label}", file=self._file(), show_eta=True)
        bar.__enter__()

        def step(n):
            if n is None:
                bar.__exit__(None, None, None)
                self._say(self._close())
            else:
                bar.update(n)

        return step

    def _close(self) -> str:
        """'<the phase running> took N s', ending it ('' when none runs)."""
        if self._open is None:
            return ""
        (what, t0), self._open = self._open, None
        return f"{what} took {self.clock() - t0:.1f} s"

    def _say(self, line: str) -> None:
        if self.enabled and line:
            print(f"bench: {line}", file=self._file(), flush=True)

    def _file(self):
        return self.out if self.out is not None else sys.stderr


def request_stages(client) -> dict:
    """The daemon's ``request_stages`` now (/status; {} from a daemon without them)."""
    return client.status().get("request_stages") or {}


def stage_means(before: dict, after: dict) -> dict:
    """Per op, the mean ms of each daemon stage over the jobs between two /status
    ``request_stages`` (tierd.base.stats.STAGES), in the order a job passes them."""
    out = {}
    for op, now in after.items():
        was = before.get(op) or {"jobs": 0, "seconds": {}}
        jobs = now["jobs"] - was["jobs"]
        if jobs > 0:
            secs = now["seconds"]
            out[op] = {
                name: round((secs[name] - was["seconds"].get(name, 0.0)) / jobs * 1e3, 3)
                for name, _ in STAGES
                if name in secs
            }
    return out
