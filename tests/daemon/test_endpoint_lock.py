"""One daemon per endpoint, decided by the flock on ``<socket>.lock`` (tierd.edge.endpoint), not by a
probe: a second daemon on a busy socket refuses naming the lock and its holder's pid, a SIGKILLed
daemon's lock is free at once, a clean stop (and a start that fails after taking the lock) leaves
no file behind, a daemon racing that removal never holds a lock on a removed file, and only a
socket is ever unlinked at the socket's path."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from conftest import ROOT, DaemonProcess, free_port

from tierd.edge.endpoint import EndpointError, bind
from tierd.edge.zmtp import Router
from tierd.tools.testing import serve_argv

REFUSE_WAIT_S = 20  # a second daemon that refuses exits long before; one that serves never does


def second_serve(endpoint: str, *args: str) -> subprocess.CompletedProcess:
    """``tierd serve`` on ``endpoint``, expected to refuse; fails the test if it serves instead."""
    cmd = serve_argv(*args, endpoint=endpoint, http_port=-1, pool_mb=10.24)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=REFUSE_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the second daemon served {endpoint} instead of refusing:\n{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def sock_id(path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def test_second_daemon_refuses_while_the_first_is_busy(daemon, client_factory):
    """The old probe took a daemon that did not answer a PING within 0.5 s for a dead one,
    unlinked its socket and served: a stopped (SIGSTOP) first daemon stands for a busy one."""
    before = sock_id(daemon.socket_file)
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        res = second_serve(daemon.endpoint)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert res.returncode == 2, res.stderr
    lock = f"{daemon.socket_file}.lock"
    assert f"pid {daemon.proc.pid}" in res.stderr and lock in res.stderr, res.stderr
    assert sock_id(daemon.socket_file) == before, "the live socket was replaced"
    assert client_factory(daemon).status()["pid"] == daemon.proc.pid, "the first daemon still serves"


def test_the_refusal_ends_with_its_advice_not_with_the_busy_socket(daemon):
    """Regression: the refusal ended with ``[--socket <the busy socket>]``, which read as advice to
    pass the very socket that is busy."""
    res = second_serve(daemon.endpoint)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: another tierd") and last.endswith(
        "Stop it first, or give this daemon another --socket"
    ), last


def test_a_refused_second_daemon_never_backs_a_pool(daemon, tmp_path):
    """The endpoint is taken before the pool: a second daemon on a served socket exits without
    creating (or pinning) any pool memory; the control, the same command on a free socket, does."""
    folder = f"/dev/shm/tierd-test-second-{os.getpid()}"
    os.mkdir(folder, 0o700)
    try:
        res = second_serve(daemon.endpoint, "--pool-dir", folder, "--l1-init-size-gb", "0.01")
        assert res.returncode == 2, res.stderr
        assert f"pid {daemon.proc.pid}" in res.stderr, res.stderr
        assert os.listdir(folder) == [], f"the refused daemon backed a pool: {os.listdir(folder)}"
        free = DaemonProcess(tmp_path, "--pool-dir", folder, "--l1-init-size-gb", "0.01")
        try:
            assert os.listdir(folder), "control: a daemon that serves creates its pool files"
        finally:
            free.kill()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_sigkilled_daemon_restarts_at_once(tmp_path):
    d = DaemonProcess(tmp_path)
    try:
        d.proc.kill()
        d.proc.wait(10)
        assert d.socket_file.is_socket(), "SIGKILL leaves the socket file behind"
        t0 = time.monotonic()
        d.start()  # the kernel dropped the flock with the process: no wait, no probe
        assert time.monotonic() - t0 < 15
        assert (tmp_path / "tierd.sock.lock").read_text().strip() == str(d.proc.pid)
        assert d.status()["pid"] == d.proc.pid
    finally:
        d.kill()


def test_a_clean_stop_leaves_no_file_in_the_socket_folder(tmp_path):
    """Regression: ``<socket>.lock`` stayed after every SIGTERM stop."""
    d = DaemonProcess(tmp_path)
    try:
        assert (tmp_path / "tierd.sock.lock").read_text().strip() == str(d.proc.pid)
        assert d.stop() == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["daemon.log"]
        d.start()  # and the next daemon starts as before
        assert d.status()["pid"] == d.proc.pid
    finally:
        d.kill()


def test_a_start_refused_on_a_busy_http_port_leaves_no_file(tmp_path):
    """Regression: a daemon that took the socket's lock, then failed to listen on its HTTP port,
    left the lock file behind."""
    folder = tmp_path / "s"
    folder.mkdir(mode=0o700)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        res = second_serve(f"ipc://{folder}/tierd.sock", "--http-port", str(busy.getsockname()[1]))
    assert res.returncode == 2 and "--http-port" in res.stderr, res.stderr
    assert list(folder.iterdir()) == []


def test_tierd_bench_leaves_no_folder_behind():
    """Regression: every ``tierd bench`` left /tmp/tierd-bench-*/tierd.sock.lock (and so its folder).
    Its TMPDIR is a short folder of its own: the bench's socket path, under a pytest-xdist worker's
    tmp_path, is longer than AF_UNIX takes."""
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="tierd-t-"))
    try:
        bench_leaves_nothing_in(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def bench_leaves_nothing_in(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "tierd", "bench", "--json", "--chunks", "2", "--rounds", "1", "--layers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_a_daemon_racing_the_lock_files_removal_takes_the_new_file(tmp_path, monkeypatch):
    """The lock file goes at a clean stop. A daemon that opened it just before, and flocks it just
    after, holds a lock on a removed file: it must see that and start over on the path, else a
    third daemon would take the path's new file and two would serve."""
    from tierd.edge import endpoint

    sock = str(tmp_path / "tierd.sock")
    lock = sock + endpoint.LOCK_SUFFIX
    first = endpoint.Endpoint("ipc://" + sock, sock, endpoint.take_lock(lock, "u"), None)
    flock, raced = fcntl.flock, []

    def flock_after_the_first_stops(fd, op):
        if not raced:  # the second daemon opened the old file; the first stops before it flocks
            raced.append(os.fstat(fd).st_ino)
            first.close()
        return flock(fd, op)

    monkeypatch.setattr(endpoint.fcntl, "flock", flock_after_the_first_stops)
    second = endpoint.take_lock(lock, "u")
    monkeypatch.setattr(endpoint.fcntl, "flock", flock)
    try:
        assert raced, "the race was not run"
        assert os.fstat(second).st_ino == os.stat(lock).st_ino  # it holds the file the path names
        with pytest.raises(EndpointError, match=f"pid {os.getpid()}"):
            endpoint.take_lock(lock, "u")  # so a third daemon is refused
    finally:
        os.close(second)


def test_any_holder_of_the_lock_keeps_a_daemon_out(tmp_path):
    """The lock alone decides (no socket file at all here), and the refusal names its pid."""
    folder = tmp_path / "s"
    folder.mkdir(mode=0o700)
    with open(folder / "tierd.sock.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(f"{os.getpid()}\n")
        f.flush()
        res = second_serve(f"ipc://{folder}/tierd.sock")
    assert res.returncode == 2 and f"pid {os.getpid()}" in res.stderr, res.stderr
    assert not (folder / "tierd.sock").exists()


def test_a_file_that_is_not_a_socket_is_left_alone(tmp_path):
    """Only a socket (or a symlink) at the socket's path is a dead daemon's; the old code unlinked
    whatever lay there."""
    folder = tmp_path / "s"
    folder.mkdir(mode=0o700)
    victim = folder / "tierd.sock"
    victim.write_text("not a socket\n")
    res = second_serve(f"ipc://{victim}")
    assert res.returncode == 2 and "is not a socket" in res.stderr, res.stderr
    assert victim.read_text() == "not a socket\n"


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:{port}", "ipc://@tierd-test-{port}"])
def test_file_less_endpoints_are_held_by_the_kernel(url):
    """tcp:// and abstract ipc:// names have no file to lock or unlink: a second bind fails (a
    usage error in ``tierd serve``) and the first keeps serving."""
    url = url.format(port=free_port())
    first, second = Router(1 << 20), Router(1 << 20)
    try:
        held = bind(first, url, "0600")
        with pytest.raises(EndpointError, match="Address already in use"):
            bind(second, url, "0600")
        held.close()
    finally:
        first.close()
        second.close()
