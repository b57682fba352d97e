"""A client whose connection closes loses its session at once (``--drop-on-disconnect``, on by
default; docs/protocol.md section 6, tierd/zmtp.py): a SIGKILLed client's leases and
ranks are freed within about a second, over ipc:// and tcp://, where without the setting they
stay until the heartbeat timeout. A client whose routing identity a new connection took over
keeps its session when the old connection closes; a clean BYE still works; an empty frame is
still a BAD_REQUEST. Real daemons, real client processes, real sockets."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zmq
from conftest import free_port
from kv import GroupGeom
from util import ranks, raw  # noqa: F401 - fixtures
from wire import Raw, pack, wait_for

from tierd.edge.zmtp import Router

TESTS = Path(__file__).resolve().parents[1]

# A client process: registers a rank, stores two chunks, holds a lease on them, then idles (its
# heartbeats keep it alive) until it is killed. ``identity``: its DEALER's routing identity.
CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from kv import FakeRank, GroupGeom, keys
    from wire import Raw
    rank = FakeRank([GroupGeom("full")])
    print("SHM", *[b.path for b in rank.bufs], flush=True)
    identity = bytes.fromhex({identity!r}) if {identity!r} else None
    if {raw!r}:
        c = Raw({endpoint!r}, identity)
        c.hello()
        c.ok("REGISTER", {{"instance": "doomed", "layout": rank.layout()}})
        ks = keys(2)
        chunks = [{{"key": k, "blocks": [list(range(4 * i, 4 * i + 4))]}} for i, k in enumerate(ks)]
        c.ok("STORE", {{"instance": "doomed", "chunks": chunks}})
        body = {{"namespace": rank.ns, "keys": ks, "groups": rank.specs(), "chunk_tokens": 16}}
        reply = c.ok("LOOKUP", body)
    else:
        from tierd_client import TierdClient
        c = TierdClient({endpoint!r}, timeout_s=10, token="")
        c.wait_ready(10)
        c.register("doomed", rank.layout())
        ks = keys(2)
        c.store("doomed", [{{"key": k, "blocks": [list(range(4 * i, 4 * i + 4))]}} for i, k in enumerate(ks)])
        hit = c.lookup(rank.ns, ks, rank.specs(), 16)
        reply = {{"chunks": hit.chunks, "lease": hit.lease}}
    assert reply["chunks"] == 2 and reply["lease"]
    print("LEASE", reply["lease"], flush=True)
    print("READY", flush=True)
    time.sleep(120)
""")


class Child:
    def __init__(self, endpoint: str, identity: bytes | None = None, raw: bool = False):
        code = CHILD.format(
            tests=str(TESTS), endpoint=endpoint, identity=identity.hex() if identity else "", raw=raw
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        self.shm: list[str] = []
        self.lease = 0
        for line in self.proc.stdout:
            if line.startswith("SHM"):
                self.shm = line.split()[1:]
            elif line.startswith("LEASE"):
                self.lease = int(line.split()[1])
            elif line.startswith("READY"):
                return
        raise AssertionError(f"the client exited early with {self.proc.wait()}")

    def kill(self) -> float:
        """SIGKILL; returns when it died (monotonic)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(5)
        return time.monotonic()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for p in self.shm:
            if os.path.exists(p):
                os.unlink(p)


@pytest.fixture
def children():
    made: list[Child] = []

    def make(*args, **kw) -> Child:
        c = Child(*args, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def held(d) -> dict:
    st = d.status()
    return {
        "sessions": st["sessions"],
        "instances": [i["instance"] for i in st["instances"]],
        "leases": st["leases_active"],
    }


HELD = {"sessions": 1, "instances": ["doomed"], "leases": 1}
FREED = {"sessions": 0, "instances": [], "leases": 0}


def assert_freed_at_once(d, child: Child) -> None:
    assert held(d) == HELD
    died = child.kill()
    wait_for(lambda: held(d) == FREED, 10, interval=0.02, what="the killed client's session to go")
    took = time.monotonic() - died
    assert took < 5, f"freed {took:.2f} s after the kill, not at once (the heartbeat timeout is 30 s)"
    st = d.status()
    assert st["sessions_disconnected"] == 1 and st["sessions_reaped"] == 0 and st["leases_expired"] == 1
    assert st["objects"] == 2
    op = Raw(d.endpoint)
    try:
        op.hello()
        assert op.ok("CLEAR", {})["evicted"] == 2  # no longer leased
    finally:
        op.close()


def test_a_sigkilled_clients_leases_and_ranks_are_freed_at_once(daemon, children):
    assert_freed_at_once(daemon, children(daemon.endpoint))


def test_a_sigkilled_raw_client_over_tcp_is_freed_at_once(daemon_factory, children):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = daemon_factory("--socket", endpoint, "--insecure-tcp")
    d.endpoint = endpoint
    assert_freed_at_once(d, children(endpoint, raw=True))


def test_without_drop_on_disconnect_they_stay_until_the_heartbeat_timeout(daemon_factory, children):
    """The negative control: the same kill with --no-drop-on-disconnect."""
    d = daemon_factory("--no-drop-on-disconnect", "--heartbeat-timeout-s", "3")
    child = children(d.endpoint)
    died = child.kill()
    time.sleep(1.5)
    assert held(d) == HELD  # what the daemon did before: nothing until the timeout
    wait_for(lambda: held(d) == FREED, 6, what="the heartbeat timeout to reap the killed client")
    assert time.monotonic() - died >= 3.0
    st = d.status()
    assert st["sessions_reaped"] == 1 and st["sessions_disconnected"] == 0


def test_a_session_whose_identity_a_new_connection_took_over_stays_when_the_old_one_closes(
    daemon, children, raw
):
    """ROUTER_HANDOVER: a second connection with the same routing identity (a client that
    reconnected before its old connection was seen to close) takes the session over; the old
    connection's end must not drop it."""
    identity = os.urandom(16)
    child = children(daemon.endpoint, identity=identity, raw=True)
    new = raw(daemon, identity)
    assert new.ok("PING", {})["boot_id"]  # the session of that identity, now on this connection
    child.kill()
    time.sleep(1.5)
    assert held(daemon) == HELD
    st = daemon.status()
    assert st["sessions_disconnected"] == 0
    assert new.ok("RELEASE", {"lease": child.lease}) == {}  # the session, with its lease, is this one's
    new.close()  # and when this connection closes, it goes
    wait_for(lambda: daemon.status()["sessions"] == 0, 5, what="the session to go with its last connection")
    st = daemon.status()
    assert st["sessions_disconnected"] == 1 and not st["instances"]


def test_a_reconnecting_client_library_gets_its_session_back(daemon, client_factory, ranks):
    """A daemon restart: the client reconnects with the same routing identity, says HELLO and
    registers again; the old connection's end (seen by the old daemon only) costs nothing."""
    c = client_factory(daemon, timeout_s=15)
    rank = ranks(GroupGeom("full"))
    c.register("r", rank.layout())
    daemon.restart()
    wait_for(lambda: held(daemon)["instances"] == ["r"], 10, what="the client to register again")
    time.sleep(1.0)
    st = daemon.status()
    assert st["sessions"] == 1 and st["sessions_disconnected"] == 0
    assert c.ping().boot_id == st["boot_id"]


def test_a_clean_bye_still_works(daemon, client_factory, ranks):
    c = client_factory(daemon)
    c.register("r", ranks(GroupGeom("full")).layout())
    assert held(daemon)["sessions"] == 1
    c.close()  # BYE, answered, then the connection closes
    wait_for(lambda: held(daemon) == FREED, 5, what="BYE to free the session")
    time.sleep(0.3)
    st = daemon.status()
    assert st["sessions_disconnected"] == 0 and st["errors"] == 0  # BYE took it; nothing else happened


def test_an_empty_frame_is_still_a_bad_request(daemon, raw):
    r = raw(daemon)
    r.hello()
    r.send(b"")
    req_id, ok, body = r.recv()
    assert (req_id, ok, body["code"]) == (0, False, "BAD_REQUEST")
    assert r.ok("PING", {})  # and the session is still there
    r.send(pack(["PING", 5, {}]))
    assert r.recv()[:2] == [5, True]
    assert daemon.status()["sessions"] == 1


# ---- the endpoint on its own, in this process -----------------------------------------------------------
class Watched:
    """A Router read as the daemon reads it: one turn at a time, then what ended."""

    def __init__(self, tmp_path):
        self.ctx = zmq.Context.instance()
        self.router = Router(1 << 20)
        self.endpoint = f"ipc://{tmp_path}/w.sock"
        self.router.bind(self.endpoint)
        self.socks = []

    def dealer(self, identity: bytes) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, identity)
        s.connect(self.endpoint)
        self.socks.append(s)
        return s

    def turns(self, seconds: float) -> list:
        got, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            select.select([self.router.fd], [], [], 0.02)
            got += self.router.messages()
        return got

    def batch(self) -> list[tuple[bytes, int]]:
        """(identity, connection fd) of each message read within a turn or so (at least one)."""
        got, end = [], time.monotonic() + 5
        while not got and time.monotonic() < end:
            got = self.turns(0.05)
        got += self.turns(0.1)
        assert got, "no message"
        return [(identity, self.router.routes[identity].fd) for identity, *_ in got]

    def ended(self) -> list[tuple[bytes, int]]:
        self.turns(0.1)
        return self.router.ended()

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.router.close()


@pytest.fixture
def watched(tmp_path):
    w = Watched(tmp_path)
    yield w
    w.close()


UID = os.getuid()


def until_reused(scenario, tries: int = 20) -> None:
    """Run ``scenario() -> reused`` (it asserts what must hold either way) until the kernel gave
    the new connection the fd of the one that closed (the DEALERs live in this process too and
    can take that fd first); skip if it never did."""
    for _ in range(tries):
        if scenario():
            return
    pytest.skip(f"no fd was reused in {tries} tries: nothing to tell apart")


def test_a_new_connection_on_the_fd_of_one_that_closed_is_another_connection(watched):
    """B connects on the fd A's closed connection had, and B's message is read before A's
    disconnect is handled: A is dropped, B is not."""
    w = watched

    def scenario() -> bool:
        ia, ib = os.urandom(8), os.urandom(8)
        a = w.dealer(ia)
        a.send(b"x")
        ((_, fd_a),) = w.batch()
        assert w.ended() == []
        a.close()
        time.sleep(0.2)  # A's disconnect waits in the monitor, unread
        b = w.dealer(ib)
        b.send(b"y")
        time.sleep(0.2)
        ((who, fd_b),) = w.batch()
        assert who == ib
        assert w.router.ended() == [(ia, UID)]
        b.close()
        time.sleep(0.2)
        assert w.ended() == [(ib, UID)]
        return fd_b == fd_a

    until_reused(scenario)


def test_an_identity_whose_connection_closed_ends_once_and_routes_to_its_new_connection(watched):
    """The same routing identity closes and comes back on a new connection that gets the same
    fd: the old connection's end is read before the new one can name the identity, so it ends
    (its session goes, as with any closed connection); the new connection's message comes with
    it, and its own end ends it again."""
    w = watched

    def scenario() -> bool:
        identity = os.urandom(8)
        old = w.dealer(identity)
        old.send(b"x")
        ((_, fd_old),) = w.batch()
        old.close()
        time.sleep(0.2)
        new = w.dealer(identity)
        new.send(b"y")
        time.sleep(0.2)
        ((who, fd_new),) = w.batch()
        assert who == identity
        assert w.router.ended() == [(identity, UID)]
        new.close()
        time.sleep(0.2)
        assert w.ended() == [(identity, UID)]
        return fd_new == fd_old

    until_reused(scenario)


def test_a_connection_that_handed_its_identity_over_drops_nothing_when_it_closes(watched):
    w = watched
    first = w.dealer(b"I")
    first.send(b"x")
    w.batch()
    second = w.dealer(b"I")  # ROUTER_HANDOVER: the identity moves to this connection
    second.send(b"y")
    w.batch()
    first.close()
    time.sleep(0.2)
    assert w.ended() == []
    second.close()
    time.sleep(0.2)
    assert w.ended() == [(b"I", UID)]
