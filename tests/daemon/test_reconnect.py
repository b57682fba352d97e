"""A restarted daemon is reconnected to transparently: the client notices the new connection (or
an UNKNOWN_SESSION answer), says HELLO again, re-registers its ranks and (for a call that met
UNKNOWN_SESSION) re-sends the call once; the test never calls register again.

Calls made while no daemon is connected fail fast with DaemonUnavailable (client.py: "answer now
rather than at the deadline"), so these tests wait for the client's own reconnection, bounded by
its reconnect interval, before the next call."""

import time

import numpy as np
from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures
from wire import wait_for


def names(d):
    return sorted(i["instance"] for i in d.status()["instances"])


def test_restarted_daemon_is_reconnected_and_reregistered(daemon, client_factory, ranks):
    c = client_factory(daemon, timeout_s=15)
    a, b = ranks(GroupGeom("full")), ranks(GroupGeom("state", block_tokens=16))
    c.register("a", a.layout())
    c.register("b", b.layout())
    boot = c.server.boot_id
    ks = keys(2)
    c.store("a", [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)])

    daemon.restart()  # SIGKILL, then a fresh process on the same socket
    t0 = time.monotonic()
    wait_for(lambda: names(daemon) == ["a", "b"], 10, what="the client to re-register by itself")
    assert time.monotonic() - t0 < 5
    assert daemon.status()["sessions"] == 1

    # the next call just works: the pool is empty after the restart, the store lands anew
    res = c.store("a", [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)])
    assert res.results == ["stored", "stored"]
    assert c.server.boot_id != boot
    out = c.retrieve("a", [chunk(k, range(40 + 4 * i, 44 + 4 * i)) for i, k in enumerate(ks)])
    assert out.ok == [True, True]
    np.testing.assert_array_equal(a.kv[0][:, 40:48], a.kv[0][:, 0:8])
    assert c.store("b", [chunk(ks[0], [3])]).results == ["stored"]
    assert names(daemon) == ["a", "b"]


def test_reaped_session_recovers_on_next_call(daemon_factory, client_factory, ranks):
    """The daemon forgot the session (here: reaped because the client's heartbeat is slower than
    --heartbeat-timeout-s). The next call meets UNKNOWN_SESSION; the client re-HELLOs,
    re-registers and re-sends it, and the call succeeds."""
    d = daemon_factory("--heartbeat-timeout-s", "0.5")
    c = client_factory(d, heartbeat_interval_s=60)
    rank = ranks(GroupGeom("full"))
    c.register("r", rank.layout())
    wait_for(lambda: d.status()["sessions_reaped"] == 1, 10, what="the session to be reaped")
    assert names(d) == []
    k = keys(1)[0]
    assert c.store("r", [chunk(k, range(4))]).results == ["stored"]
    assert names(d) == ["r"]
    assert c.lookup(rank.ns, [k], rank.specs(), 16, lease=False).chunks == 1


def test_several_calls_after_a_restart(daemon, client_factory, ranks):
    c = client_factory(daemon, timeout_s=15)
    rank = ranks(GroupGeom("full"))
    c.register("r", rank.layout())
    for _ in range(2):
        daemon.restart()
        wait_for(lambda: names(daemon) == ["r"], 10, what="re-registration")
        ks = keys(6)
        futs = [c.store_async("r", [chunk(k, range(4 * i, 4 * i + 4))]) for i, k in enumerate(ks)]
        assert [f.result().results for f in futs] == [["stored"]] * 6
        assert c.lookup(rank.ns, ks, rank.specs(), 16, lease=False).chunks == 6
