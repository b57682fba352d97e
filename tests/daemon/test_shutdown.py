"""Shutdown and the socket file: SIGTERM and SIGINT make the daemon exit 0 within 10 s and remove
its socket; a second daemon on a live socket is refused with a clear message (and leaves the first
untouched); a stale socket file from a SIGKILLed daemon does not stop a new one."""

import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from kv import GroupGeom, keys
from util import chunk, ranks, raw  # noqa: F401 - fixtures

from tierd.tools.testing import serve_argv


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_cleanly(daemon, client_factory, ranks, sig):
    c = client_factory(daemon)
    rank = ranks(GroupGeom("full"))
    c.register("r", rank.layout())
    c.store("r", [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(keys(4))])
    assert daemon.socket_file.exists()
    t0 = time.monotonic()
    assert daemon.stop(sig, timeout=10) == 0
    assert time.monotonic() - t0 < 10
    assert not daemon.socket_file.exists()
    assert "stopped" in daemon.log.read_text()


def serve(endpoint, *extra):
    return subprocess.run(
        serve_argv(*extra, endpoint=endpoint, http_port=-1),
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )


def test_second_daemon_on_a_live_socket_is_refused(daemon, client):
    res = serve(daemon.endpoint)
    assert res.returncode != 0
    assert f"another tierd (pid {daemon.proc.pid}) serves {daemon.endpoint}" in res.stderr, res.stderr
    assert res.returncode == 2, "a usage error (tests/daemon/test_endpoint_lock.py has the busy case)"
    assert "Traceback" not in res.stderr
    # the first one still serves on its (untouched) socket
    assert daemon.socket_file.exists()
    assert client.ping().boot_id == client.server.boot_id
    assert daemon.proc.poll() is None


def test_stale_socket_file_does_not_block_a_new_daemon(daemon, client_factory, ranks):
    daemon.kill()  # SIGKILL: no cleanup
    assert daemon.socket_file.exists()
    daemon.start()
    c = client_factory(daemon)
    rank = ranks(GroupGeom("full"))
    c.register("r", rank.layout())
    assert c.store("r", [chunk(keys(1)[0], range(4))]).results == ["stored"]
    assert daemon.stop() == 0 and not daemon.socket_file.exists()


def test_socket_file_mode(daemon_factory):
    d = daemon_factory("--socket-mode", "0660")
    assert d.socket_file.stat().st_mode & 0o777 == 0o660
    d2 = daemon_factory()
    assert d2.socket_file.stat().st_mode & 0o777 == 0o600


def test_sigterm_with_copies_in_flight_answers_every_request_and_exits_0(daemon_factory, raw, ranks):
    """Regression: close() drained finished copies through the transfer engine's wake pipe after
    closing it (EBADF), so a daemon that had served a rank exited 1 and left its socket file."""
    d = daemon_factory(pool_mb=64)
    rank = ranks(GroupGeom("full", layers=4, block_bytes=128 << 10, block_tokens=4), num_blocks=64)
    r = raw(d)
    r.hello()
    r.ok("REGISTER", {"instance": "r", "layout": rank.layout()})
    ks = keys(8)
    r.ok("STORE", {"instance": "r", "chunks": [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)]})
    body = {"instance": "r", "chunks": [chunk(k, range(32 + 4 * i, 36 + 4 * i)) for i, k in enumerate(ks)]}
    sent = [r.send_request("RETRIEVE", body) for _ in range(20)]
    time.sleep(0.05)
    d.proc.send_signal(signal.SIGTERM)
    replies = {}
    try:
        while len(replies) < len(sent):
            req_id, ok, reply = r.recv(10)
            assert req_id not in replies
            replies[req_id] = ok or reply["code"]
    except TimeoutError:
        pass
    assert d.proc.wait(10) == 0
    assert not d.socket_file.exists()
    assert set(replies) == set(sent), f"{len(sent) - len(replies)} requests never answered"
    assert set(replies.values()) <= {True, "SHUTTING_DOWN"}
    assert "Traceback" not in d.log.read_text()


@pytest.mark.parametrize("workers", ["0", "2"])
def test_copy_in_flight_at_sigterm_finishes_before_its_memory_goes(daemon_factory, raw, ranks, workers):
    """Regression: close() unregistered instances (detaching their lanes) before closing the
    transfer engine, so with --workers 0 the close joined no lane and the pool was unmapped while
    a copy still ran (SIGSEGV/SIGBUS, exit status < 0). Copies first, then memory, then the pool."""
    d = daemon_factory("--workers", workers, pool_mb=1100)
    rank = ranks(GroupGeom("full", layers=2, block_bytes=1 << 20, block_tokens=4), num_blocks=256)
    r = raw(d)
    r.hello()
    r.ok("REGISTER", {"instance": "r", "layout": rank.layout()})
    ks = keys(64)  # 64 chunks x 4 blocks x 2 layers x 1 MiB = 512 MiB: a copy that takes a while
    store = r.send_request(
        "STORE", {"instance": "r", "chunks": [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)]}
    )
    time.sleep(0.02)  # the copy has started
    d.proc.send_signal(signal.SIGTERM)
    req_id, ok, reply = r.recv(30)
    assert req_id == store and ok and reply["results"] == ["stored"] * 64
    assert d.proc.wait(15) == 0, d.log.read_text()[-2000:]
    assert "Traceback" not in d.log.read_text()


def test_status_while_stopping_is_always_answered(daemon_factory, raw, ranks):
    """Regression: /status was computed on the HTTP thread once stopping began, racing with the
    teardown (dict changed size during iteration, KeyError: HTTP 500)."""
    import threading
    import urllib.error
    import urllib.request

    d = daemon_factory()
    rank = ranks(GroupGeom("full"))
    r = raw(d)
    r.hello()
    r.ok("REGISTER", {"instance": "r", "layout": rank.layout()})
    codes, stop = [], threading.Event()

    def hammer():
        while not stop.is_set():
            try:
                with urllib.request.urlopen(d.http + "/status", timeout=5) as resp:
                    codes.append(resp.status)
            except urllib.error.HTTPError as exc:
                codes.append(exc.code)
            except OSError:
                return  # the daemon is gone

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0
    stop.set()
    for t in threads:
        t.join(10)
    assert codes and set(codes) == {200}, sorted(set(codes))
