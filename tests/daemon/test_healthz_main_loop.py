"""/healthz says when the daemon's main loop is stuck, not only that the HTTP thread is alive.

The stall is a real one an operator can meet: the daemon logs to a pipe nobody reads (a stuck log
collector). Once the pipe is full the main loop blocks in its next log write; the HTTP thread,
which logs nothing to answer /healthz, keeps answering, and must answer 503 with the reason
within STALL_S. Reading the pipe again frees the loop, and /healthz is 200 again. And a client
that keeps the daemon's socket full of STOREs never holds the loop from the rest of its turn:
/status, answered between two turns, comes back while the flood goes on."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from conftest import ROOT, free_port
from kv import GroupGeom, keys
from util import chunk, ranks, raw  # noqa: F401 - fixtures
from wire import Raw, wait_for

from tierd.daemon.status import STALL_S
from tierd.tools.testing import serve_argv

SENT = 200
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Python 3.10+ on Linux; spelled out for older builds)


def healthz(port: int) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:  # not listening yet
        return 0, b""


class LogPipe:
    """The daemon's stderr, read by a thread until ``hold()``, again after ``release()``."""

    def __init__(self, pipe):
        self.pipe, self.reading, self.lines = pipe, threading.Event(), 0
        fcntl.fcntl(pipe.fileno(), F_SETPIPE_SZ, 4096)  # the smallest pipe: fills in a few lines
        self.reading.set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while self.reading.wait() and self.pipe.readline():
            self.lines += 1

    def hold(self) -> None:
        self.reading.clear()

    def release(self) -> None:
        self.reading.set()


def test_healthz_fails_with_the_reason_while_the_main_loop_is_stuck_and_recovers(tmp_path):
    port = free_port()
    endpoint = f"ipc://{tmp_path}/tierd.sock"
    proc = subprocess.Popen(
        serve_argv(endpoint=endpoint, http_port=port, pool_mb=64, log_level="debug"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    logs = LogPipe(proc.stderr)
    r = None
    try:
        wait_for(lambda: os.path.exists(f"{tmp_path}/tierd.sock") and healthz(port)[0] == 200, timeout=30)
        r = Raw(endpoint)
        r.hello()
        logs.hold()
        time.sleep(0.2)  # (the reader is parked before the daemon logs more)
        for _ in range(SENT):  # each error reply is logged at debug: the pipe fills, the loop blocks
            r.send(b"\x93\xa4NOPE\x00\x80")
        t0 = time.monotonic()
        code, body = wait_for(
            lambda: (got := healthz(port))[0] != 200 and got, timeout=STALL_S + 5, interval=0.2
        )
        assert code == 503 and body.startswith(b"main loop stalled: no heartbeat for "), (code, body)
        assert time.monotonic() - t0 < STALL_S + 3
        answered = 0
        while not r.quiet(0.3):
            r.recv(1)
            answered += 1
        assert answered < SENT, "the loop answered every request: it was not stuck"

        logs.release()  # the log is read again: the loop goes on
        wait_for(lambda: healthz(port) == (200, b"ok\n"), timeout=5, interval=0.1)
        for _ in range(SENT - answered):  # and every request is answered
            r.recv(5)
    finally:
        logs.release()
        if r is not None:
            r.close()
        proc.terminate()
        proc.wait(15)


def test_a_flood_of_stores_never_keeps_the_main_loop_from_its_other_work(daemon_factory, raw, ranks):
    """While STOREs wait, the loop reads more between two requests (so a RETRIEVE can go first);
    a client that keeps the socket full must still not hold the loop in that: /status (answered
    by the main loop between two turns) comes back while the flood goes on."""
    d = daemon_factory()
    rank = ranks(GroupGeom("full"))
    r = raw(d)
    r.hello()
    r.ok("REGISTER", {"instance": "r", "layout": rank.layout()})
    k = keys(1)[0]
    r.ok("STORE", {"instance": "r", "chunks": [chunk(k, range(4))]})
    body = {"instance": "r", "chunks": [chunk(k, range(4))]}  # present already: answered at once
    t = time.monotonic()
    for _ in range(500):
        r.send_request("STORE", body)
    for _ in range(500):
        r.recv(30)
    n = int(min(500_000, max(20_000, 5.0 * 500 / (time.monotonic() - t))))  # about five seconds
    answered = [0]

    def flood():  # (one thread owns the socket: up to 2,000 requests in flight)
        inflight = 0
        for _ in range(n):
            r.send_request("STORE", body)
            inflight += 1
            while inflight > 2000:
                r.recv(60)
                inflight -= 1
                answered[0] += 1
        while inflight:  # (a reply past the connection's send queue is dropped: docs/protocol.md)
            try:
                r.recv(5)
            except TimeoutError:
                return
            inflight -= 1
            answered[0] += 1

    sender = threading.Thread(target=flood)
    sender.start()
    time.sleep(0.3)
    before = n - answered[0]
    t = time.monotonic()
    d.status()
    took, after = time.monotonic() - t, n - answered[0]
    sender.join(120)
    assert before > n // 4, f"the flood was nearly over before /status was asked ({before} of {n} left)"
    assert took < 1.0, (
        f"/status took {took:.2f} s during the flood ({before} of {n} STOREs left, then {after})"
    )
