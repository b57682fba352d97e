"""A private ``tierd serve`` in a subprocess: the one launcher the tests, the benches and the
benchmarks share (standard library only; nothing here imports the daemon).

    d = ServeProcess(tmp, "--pool-dir", folder, pool_mb=64)   # started, ready when it returns
    d.endpoint, d.status(), d.stop() -> exit code, d.kill(), d.restart()

Ready means: its HTTP /status answers (when it has an HTTP port), else its ipc socket file is
bound; a client still waits for HELLO with ``TierdClient.wait_ready``. A daemon that exits while
starting raises ``DaemonExited`` with its log. Every server listens on an ipc socket in the
given folder (or the endpoint given) and on loopback HTTP only.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the source tree (tests and benches run from it)
POLL_S = 0.02


def die_with_parent(signum: int = signal.SIGKILL):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``signum`` when the process that
    started it dies, however it dies (SIGKILL included), so a stopped test or benchmark leaves no
    server behind (Linux's PR_SET_PDEATHSIG; elsewhere it does nothing). Start such a child from a
    thread that lives as long as it should: the signal follows the starting thread's exit."""

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signum))  # PR_SET_PDEATHSIG

    return preexec


def proc_stat(path: str | os.PathLike) -> list[str]:
    """The fields of a /proc/<pid>/stat (or .../task/<tid>/stat) after the command name: [0] is
    the state letter, [11] and [12] utime and stime in clock ticks; [] once the process is gone."""
    try:
        return Path(path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def close_on_sigterm() -> None:
    """SIGTERM (``timeout``, a job scheduler, systemd) raises SystemExit in the main thread, so
    every ``finally`` that closes a server or a daemon runs, instead of Python's default of dying
    at once and leaving them running (a GPU server holds its memory until it exits)."""

    def stop(signum, _frame):
        raise SystemExit(f"stopped by signal {signal.Signals(signum).name}: closing what was started")

    signal.signal(signal.SIGTERM, stop)


class DaemonExited(RuntimeError):
    """The daemon exited, or never became ready, while starting."""


def free_port() -> int:
    """A loopback TCP port free right now."""
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(
    *args: str,
    endpoint: str | None = None,
    http_port: int | None = None,
    pool_mb: float | None = None,
    log_level: str | None = None,
    python: str = sys.executable,
) -> list[str]:
    """``python -m tierd serve`` with these settings; ``http_port=-1`` turns HTTP off."""
    cmd = [python, "-m", "tierd", "serve"]
    if endpoint is not None:
        cmd += ["--socket", endpoint]
    if http_port is not None:
        cmd += ["--http-port", str(http_port)]
    if pool_mb is not None:
        cmd += ["--l1-size-gb", f"{pool_mb / 1024:.6f}"]
    if log_level is not None:
        cmd += ["--log-level", log_level]
    return [*cmd, *args]


class ServeProcess:
    """``tierd serve`` on ``ipc://<folder>/<name>.sock`` (unless ``endpoint``) with an HTTP port on
    loopback (``http_port``: 0 picks a free one, -1 turns HTTP off), its output in
    ``<folder>/daemon.log`` (unless ``log``; ``log=False``: on this process's stdout and stderr).
    ``start=False`` builds it without starting it.
    ``env``, ``cwd``, ``preexec_fn``: for the subprocess."""

    def __init__(
        self,
        folder: str | os.PathLike,
        *args: str,
        endpoint: str | None = None,
        name: str = "tierd",
        http_port: int = 0,
        pool_mb: float | None = 256,
        log_level: str | None = "debug",
        log: str | os.PathLike | None | bool = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        preexec_fn=None,
        ready_timeout: float = 30,
        start: bool = True,
    ):
        self.folder = Path(folder)
        self.endpoint = endpoint or f"ipc://{self.folder}/{name}.sock"
        self.http_port = free_port() if http_port == 0 else http_port
        pool = ["--l1-size-gb", f"{pool_mb / 1024:.6f}"] if pool_mb is not None else []
        self.args = [*pool, *args]  # what follows the socket, port and log level; start() reads it
        self.log_level = log_level
        self.log = None if log is False else Path(log) if log is not None else self.folder / "daemon.log"
        self.env, self.cwd, self.preexec_fn = env, cwd, preexec_fn
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self._log = None
        if start:
            self.start()

    # -- life

    def start(self, wait: bool = True) -> None:
        self._close_log()
        self._log = open(self.log, "ab") if self.log is not None else None
        self.proc = subprocess.Popen(
            self.argv(),
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log is not None else None,
            cwd=self.cwd,
            env=self.env,
            preexec_fn=self.preexec_fn,
        )
        if wait:
            self.wait_ready(self.ready_timeout)

    def argv(self, log_level: str | None = None) -> list[str]:
        """The command ``start`` runs (``log_level`` overrides the one given)."""
        return serve_argv(
            *self.args,
            endpoint=self.endpoint,
            http_port=self.http_port,
            log_level=log_level or self.log_level,
        )

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise DaemonExited(f"tierd exited with {self.proc.returncode}:\n{self.log_text()}")
            if self._ready():
                return
            if time.monotonic() > deadline:
                raise DaemonExited(f"tierd did not come up in {timeout} s:\n{self.log_text()}")
            time.sleep(POLL_S)

    @property
    def socket_file(self) -> Path | None:
        """The ipc socket's path (None for tcp://)."""
        return Path(self.endpoint[len("ipc://") :]) if self.endpoint.startswith("ipc://") else None

    def _ready(self) -> bool:
        if self.http_port is not None and self.http_port > 0:
            try:
                self.status()
                return True
            except OSError:
                return False
        path = self.socket_file
        return path is None or path.exists()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        """Signal it and wait for its exit code (``subprocess.TimeoutExpired`` after ``timeout``)."""
        if self.proc is None:
            return 0
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                self.proc.wait(timeout)
            return self.proc.returncode
        finally:
            self._close_log()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close_log()

    def restart(self) -> None:
        self.kill()
        self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace") if self.log is not None else "(on stderr)"
        except OSError:
            return ""

    # -- HTTP

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def get(self, path: str, timeout: float = 5) -> tuple[int, bytes]:
        with urllib.request.urlopen(self.http + path, timeout=timeout) as resp:
            return resp.status, resp.read()

    def status(self) -> dict:
        return json.loads(self.get("/status")[1])

    def metrics(self) -> str:
        return self.get("/metrics")[1].decode()
