"""A RETRIEVE that arrives behind STOREs is handled before them: an engine waits for its
restores, not for its stores (tierd.core.backlog). Here the STORE ahead of it needs room in a full
pool; handled first, it would evict one of the objects the RETRIEVE reads. The daemon's objects
in this process (tests/inproc.py): both requests read in one turn of its loop, as when they wait
on its socket together (that a flood of STOREs never keeps the loop from the rest of its turn is
tests/daemon/test_healthz_main_loop.py's)."""

import time

from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures

GEOM = GroupGeom("full", layers=2, block_bytes=32 << 10, block_tokens=4)  # 256 KiB objects


def test_a_retrieve_behind_a_store_goes_first_so_the_store_cannot_evict_what_it_reads(
    inproc_factory, inraw, ranks
):
    d = inproc_factory(pool_mb=2)  # room for a few objects
    rank = ranks(GEOM, num_blocks=80)
    r = inraw(d)
    r.hello()
    r.ok("REGISTER", {"instance": "r", "layout": rank.layout()})
    cap = d.status()["memory_configured_bytes"] // (256 << 10)
    held = keys(cap)
    for i, k in enumerate(held):
        assert r.ok("STORE", {"instance": "r", "chunks": [chunk(k, range(4 * i, 4 * i + 4))]})["results"] == [
            "stored"
        ]
    assert d.status()["objects"] == cap and d.status()["evictions"] == 0
    # the daemon reads both in one turn, the STORE first
    new = keys(1)[0]
    store, retrieve = r.send_together(
        [
            ("STORE", {"instance": "r", "chunks": [chunk(new, range(72, 76))]}),
            (
                "RETRIEVE",
                {
                    "instance": "r",
                    "chunks": [chunk(k, range(40 + 4 * i, 44 + 4 * i)) for i, k in enumerate(held)],
                },
            ),
        ]
    )
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
