"""A client that dies (SIGKILL) or goes silent loses its session after --heartbeat-timeout-s:
its leases are released (the objects become evictable) and its instances unregistered. A live
client's heartbeats keep it registered however long it idles."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kv import GroupGeom, keys
from util import chunk, ranks, raw  # noqa: F401 - fixtures
from wire import wait_for

HB = ("--heartbeat-timeout-s", "1")
TESTS = Path(__file__).resolve().parents[1]


def reaped(d):
    st = d.status()
    return not st["instances"] and st["leases_active"] == 0 and st["sessions"] == 0 and st


def test_silent_raw_client_is_reaped(daemon_factory, raw, ranks):
    d = daemon_factory(*HB)
    rank = ranks(GroupGeom("full"))
    r = raw(d)
    r.hello()
    r.ok("REGISTER", {"instance": "silent", "layout": rank.layout()})
    ks = keys(3)
    res = r.ok(
        "STORE",
        {"instance": "silent", "chunks": [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)]},
    )
    assert res["results"] == ["stored"] * 3
    reply = r.ok("LOOKUP", {"namespace": rank.ns, "keys": ks, "groups": rank.specs(), "chunk_tokens": 16})
    assert reply["chunks"] == 3 and reply["lease"]
    st = d.status()
    assert [i["instance"] for i in st["instances"]] == ["silent"] and st["leases_active"] == 1
    t0 = time.monotonic()
    # it says nothing more
    st = wait_for(lambda: reaped(d), 6, what="the silent client to be reaped")
    assert time.monotonic() - t0 < 5
    assert st["sessions_reaped"] == 1 and st["leases_expired"] >= 1
    # its leased objects are evictable now (CLEAR only takes unpinned objects)
    assert d.status()["objects"] == 3
    other = raw(d)
    other.hello()
    assert other.ok("CLEAR", {})["evicted"] == 3
    # the reaped connection is told so, and may start over
    assert r.error("PING", {}) == "UNKNOWN_SESSION"


CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from kv import FakeRank, GroupGeom, keys
    from tierd_client import TierdClient
    c = TierdClient({endpoint!r}, timeout_s=10)
    c.wait_ready(10)
    rank = FakeRank([GroupGeom("full")])
    print("SHM", *[b.path for b in rank.bufs], flush=True)
    c.register("doomed", rank.layout())
    ks = keys(2)
    c.store("doomed", [{{"key": k, "blocks": [list(range(4 * i, 4 * i + 4))]}} for i, k in enumerate(ks)])
    reply = c.lookup(rank.ns, ks, rank.specs(), 16)
    assert reply.chunks == 2 and reply.lease
    print("READY", flush=True)
    time.sleep(60)
""")


def test_sigkilled_client_is_reaped(daemon_factory, client_factory):
    # the heartbeat path: with --drop-on-disconnect (the default) the closed connection would drop
    # the session first (tests/daemon/test_router_notify.py)
    d = daemon_factory(*HB, "--no-drop-on-disconnect")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(tests=str(TESTS), endpoint=d.endpoint)],
        stdout=subprocess.PIPE,
        text=True,
    )
    shm = []
    try:
        for line in child.stdout:
            if line.startswith("SHM"):
                shm = line.split()[1:]
            if line.startswith("READY"):
                break
        else:
            raise AssertionError(f"child exited early with {child.wait()}")
        st = d.status()
        assert [i["instance"] for i in st["instances"]] == ["doomed"] and st["leases_active"] == 1
        # alive and heartbeating: still registered after more than the timeout
        time.sleep(1.5)
        assert [i["instance"] for i in d.status()["instances"]] == ["doomed"]
        child.send_signal(signal.SIGKILL)
        child.wait(5)
        st = wait_for(lambda: reaped(d), 6, what="the killed client to be reaped")
        assert st["sessions_reaped"] == 1 and st["objects"] == 2
        c = client_factory(d)
        assert c.clear().evicted == 2  # no longer leased
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for p in shm:
            if os.path.exists(p):
                os.unlink(p)


def test_live_idle_client_keeps_its_registration(daemon_factory, client_factory, ranks):
    d = daemon_factory(*HB)
    c = client_factory(d)
    rank = ranks(GroupGeom("full"))
    c.register("idle", rank.layout())
    time.sleep(2.5)
    st = d.status()
    assert [i["instance"] for i in st["instances"]] == ["idle"]
    assert st["sessions_reaped"] == 0
    assert st["instances"][0]["last_heartbeat_s_ago"] < 1.0
    c.store("idle", [chunk(keys(1)[0], range(4))])  # no re-registration needed


def test_bye_frees_the_session_its_leases_and_instances_at_once(daemon, raw, ranks):
    """A client that closes cleanly says BYE: the daemon drops it now, not a heartbeat timeout later."""
    rank = ranks(GroupGeom("full"))
    r = raw(daemon)
    r.hello()
    r.ok("REGISTER", {"instance": "leaving", "layout": rank.layout()})
    ks = keys(2)
    r.ok(
        "STORE",
        {"instance": "leaving", "chunks": [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)]},
    )
    assert r.ok("LOOKUP", {"namespace": rank.ns, "keys": ks, "groups": rank.specs(), "chunk_tokens": 16})[
        "lease"
    ]
    assert daemon.status()["leases_active"] == 1
    assert r.ok("BYE", {}) == {}
    st = daemon.status()
    assert st["sessions"] == 0 and not st["instances"] and st["leases_active"] == 0
    assert r.error("PING", {}) == "UNKNOWN_SESSION"
