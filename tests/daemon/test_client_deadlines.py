"""Every client call has a deadline: with no daemon, or a daemon that stops answering (SIGSTOP),
calls fail with DaemonUnavailable / DeadlineExceeded on time, and a reply that comes late is
ignored (the next call gets its own answer)."""

import signal
import time

import pytest
from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures

from tierd_client import DaemonUnavailable, DeadlineExceeded, TierdClient, TierdError


def test_no_daemon_fails_fast(tmp_path):
    t0 = time.monotonic()
    c = TierdClient(f"ipc://{tmp_path}/nobody.sock", connect_timeout_s=0.5, timeout_s=0.5)
    try:
        with pytest.raises(DaemonUnavailable):
            c.wait_ready(5)
        with pytest.raises(TierdError):
            c.ping()
    finally:
        c.close()
    assert time.monotonic() - t0 < 4


def test_stopped_daemon_calls_time_out_and_late_replies_are_ignored(daemon, client_factory, ranks):
    c = client_factory(daemon)
    rank = ranks(GroupGeom("full"))
    c.register("r", rank.layout())
    k = keys(1)[0]
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.ping(timeout=0.5)
        with pytest.raises(DeadlineExceeded):
            c.store("r", [chunk(k, range(4))], timeout=0.5)
        assert time.monotonic() - t0 < 3
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    # the late answers (and the EXPIRED store) are dropped; the next calls get their own replies
    assert c.ping(timeout=5).time > 0
    assert c.lookup(rank.ns, [k], rank.specs(), 16, lease=False, timeout=5).chunks == 0
    assert c.store("r", [chunk(k, range(4))], timeout=5).results == ["stored"]
