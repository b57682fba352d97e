"""Shared fixtures: a real ``tierd serve`` process per test, and clients bound to it."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    """A ``tierd serve`` subprocess on a private ipc socket, with its HTTP port."""

    def __init__(self, tmp: Path, *args: str, pool_mb: int = 256):
        self.tmp = tmp
        self.endpoint = f"ipc://{tmp}/tierd.sock"
        self.socket_file = tmp / "tierd.sock"
        self.http_port = free_port()
        self.args = ["--l1-size-gb", f"{pool_mb / 1024:.6f}", *args]
        self.log = tmp / "daemon.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "tierd",
            "serve",
            "--socket",
            self.endpoint,
            "--http-port",
            str(self.http_port),
            "--log-level",
            "debug",
            *self.args,
        ]
        self._log = open(self.log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tierd exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                self.status()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"tierd did not come up:\n{self.log.read_text()}")

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def get(self, path: str) -> tuple[int, bytes]:
        with urllib.request.urlopen(self.http + path, timeout=5) as resp:
            return resp.status, resp.read()

    def status(self) -> dict:
        return json.loads(self.get("/status")[1])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    def restart(self) -> None:
        self.kill()
        self.start()


@pytest.fixture
def daemon_factory(tmp_path):
    made: list[DaemonProcess] = []

    def make(*args: str, pool_mb: int = 256, sub: str = "d") -> DaemonProcess:
        folder = tmp_path / f"{sub}{len(made)}"
        folder.mkdir()
        d = DaemonProcess(folder, *args, pool_mb=pool_mb)
        made.append(d)
        return d

    yield make
    for d in made:
        d.kill()


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()


@pytest.fixture
def xdaemon():
    """A daemon (of the tests' user) other users can reach: socket folder 0711, socket 0666."""
    import shutil

    from users import shared_socket_dir

    folder = shared_socket_dir()
    d = DaemonProcess(Path(folder), "--socket-mode", "0666")
    yield d
    d.kill()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def client_factory():
    from tierd_client import TierdClient

    made = []

    def make(d: DaemonProcess, **kw) -> TierdClient:
        kw.setdefault("timeout_s", 10)
        c = TierdClient(d.endpoint, **kw)
        c.wait_ready(10)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def client(daemon, client_factory):
    return client_factory(daemon)


from conftest_vllm import tiny_model, vllm_cpu_env  # noqa: E402,F401 - session fixture for real-engine tests
