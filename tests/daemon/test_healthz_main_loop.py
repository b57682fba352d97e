"""/healthz says when the daemon's main loop is stuck, not only that the HTTP thread is alive.

The stall is a real one an operator can meet: the daemon logs to a pipe nobody reads (a stuck log
collector). Once the pipe is full the main loop blocks in its next log write; the HTTP thread,
which logs nothing to answer /healthz, keeps answering, and must answer 503 with the reason
within STALL_S. Reading the pipe again frees the loop, and /healthz is 200 again."""

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
