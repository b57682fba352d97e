"""Shared fixtures: a real ``tierd serve`` process per test, and clients bound to it; the daemon's
objects in this process for tests of what it decides (tests/inproc.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tierd.tools.testing import ROOT, DaemonExited, ServeProcess, free_port  # noqa: F401 - tests import these

# Some test files import helpers from a test file of their own layer (never of another one:
# tests/unit/test_test_layers.py); with every layer's folder on the path that works however a run
# is scoped (``pytest tests/unit/test_x.py`` alone, too).
for _layer in ("unit", "daemon", "e2e"):
    _folder = str(Path(__file__).resolve().parent / _layer)
    if _folder not in sys.path:
        sys.path.append(_folder)


class DaemonProcess(ServeProcess):
    """``tierd serve`` (tierd/tools/testing.py's launcher) on ``ipc://<tmp>/tierd.sock``, with an HTTP
    port on loopback and debug logs in ``<tmp>/daemon.log``; ready when it returns."""

    def __init__(self, tmp: Path, *args: str, pool_mb: int = 256):
        super().__init__(tmp, *args, pool_mb=pool_mb)
        self.tmp = tmp


def pytest_collection_modifyitems(config, items):
    """The suite runs on pytest-xdist workers, a test module to a worker (pyproject's addopts:
    a module-scoped daemon or engine is set up once). The modules of real-engine runs (marked
    ``slow``) are handed out first, the longest first (``slow(seconds=N)``: about how long the
    module takes on the 2-core CI machine; 30 when unsaid), so the short modules fill the other
    worker while they run instead of a long one starting last. Stable: file order kept otherwise."""

    def key(item):
        slow = item.get_closest_marker("slow")
        return (1, 0) if slow is None else (0, -slow.kwargs.get("seconds", 30))

    items.sort(key=key)


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
        print_log_tail(d)


def print_log_tail(d: DaemonProcess, lines: int = 30) -> None:
    """The end of a daemon's log on this test's stdout, which pytest shows only when the test
    failed: what the daemon did last is then in the report (a CI run keeps nothing else)."""
    try:
        tail = d.log.read_text(errors="replace").splitlines()[-lines:] if d.log is not None else []
    except OSError:
        return
    if tail:
        print(f"--- last {len(tail)} lines of {d.log} ---", *tail, sep="\n")


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
from inproc import ginclient, ginproc, inclient, inclient_factory, inproc, inproc_factory, inraw  # noqa: E402,F401
