"""A RETRIEVE that arrives behind STOREs is handled before them: an engine waits for its
restores, not for its stores (tierd.core.backlog). Here the STORE ahead of it needs room in a full
pool; handled first, it would evict one of the objects the RETRIEVE reads."""

import signal
import threading
import time

from kv import GroupGeom, keys
from util import chunk, ranks, raw  # noqa: F401 - fixtures

GEOM = GroupGeom("full", layers=2, block_bytes=32 << 10, block_tokens=4)  # 256 KiB objects


def test_a_retrieve_behind_a_store_goes_first_so_the_store_cannot_evict_what_it_reads(
    daemon_factory, raw, ranks
):
    d = daemon_factory(pool_mb=2)  # room for a few objects
    rank = ranks(GEOM, num_blocks=80)
    r = raw(d)
    r.hello()
    r.ok("REGISTER", {"instance": "r", "layout": rank.layout()})
    cap = d.status()["memory_configured_bytes"] // (256 << 10)
    held = keys(cap)
    for i, k in enumerate(held):
        assert r.ok("STORE", {"instance": "r", "chunks": [chunk(k, range(4 * i, 4 * i + 4))]})["results"] == [
            "stored"
        ]
    assert d.status()["objects"] == cap and d.status()["evictions"] == 0
    # the daemon stopped while both are sent: it reads them together, the STORE first
    d.proc.send_signal(signal.SIGSTOP)
    try:
        new = keys(1)[0]
        store = r.send_request("STORE", {"instance": "r", "chunks": [chunk(new, range(72, 76))]})
        retrieve = r.send_request(
            "RETRIEVE",
            {
                "instance": "r",
                "chunks": [chunk(k, range(40 + 4 * i, 44 + 4 * i)) for i, k in enumerate(held)],
            },
        )
        time.sleep(0.5)  # (the client's I/O thread writes both into the daemon's socket meanwhile)
    finally:
        d.proc.send_signal(signal.SIGCONT)
    replies = {}
    t = time.monotonic()
    while len(replies) < 2:
        req_id, ok, body = r.recv(30)
        replies[req_id] = (ok, body, time.monotonic() - t)
    ok, body, _ = replies[retrieve]
    assert ok and body["ok"] == [True] * cap, body  # nothing it reads was evicted under it
    assert replies[store][0]
    for i in range(cap):
        assert (rank.kv[0][:, 40 + 4 * i : 44 + 4 * i] == rank.kv[0][:, 4 * i : 4 * i + 4]).all()


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
