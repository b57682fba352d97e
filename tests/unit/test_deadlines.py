"""Deadlines: a STORE or RETRIEVE carries the client's wall-clock deadline. Arriving late it is
answered EXPIRED at once; a STORE whose copy finishes late is aborted (nothing committed, the
chunk stays absent and can be stored again); a RETRIEVE whose copy would start late copies
nothing into the engine's blocks. The daemon's objects in this process (tests/inproc.py): requests
handed to its loop as its ROUTER hands them, copies on its transfer lanes (that a client that gave
up on its call never has its chunk stored is tests/daemon/test_client_deadlines.py's)."""

import math
import time

import numpy as np
import pytest
from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures

BIG = GroupGeom("full", layers=4, block_bytes=128 << 10, block_tokens=4)  # 2 MiB per chunk


def test_expired_on_arrival(inproc, inraw, ranks):
    rank = ranks(GroupGeom("full"))
    r = inraw(inproc)
    r.hello()
    r.ok("REGISTER", {"instance": "r", "layout": rank.layout()})
    a, b = keys(2)
    past = time.time() - 1
    assert r.error("STORE", {"instance": "r", "chunks": [chunk(a, range(4))], "deadline": past}) == "EXPIRED"
    st = inproc.status()
    assert st["objects"] == 0 and st["stores"] == 0 and st["errors_by_code"] == {"EXPIRED": 1}
    assert st["request_stages"] == {}  # at once: no copy was planned, queued or run for it
    assert (
        r.ok("LOOKUP", {"namespace": rank.ns, "keys": [a], "groups": rank.specs(), "chunk_tokens": 16})[
            "chunks"
        ]
        == 0
    )
    r.ok("STORE", {"instance": "r", "chunks": [chunk(b, range(4))]})
    rank.kv[0][:, 40:44] = 0
    assert (
        r.error("RETRIEVE", {"instance": "r", "chunks": [chunk(b, range(40, 44))], "deadline": past})
        == "EXPIRED"
    )
    assert not rank.kv[0][:, 40:44].any()
    assert "RETRIEVE" not in inproc.status()["request_stages"]
    assert r.ok("STORE", {"instance": "r", "chunks": [chunk(a, range(4))], "deadline": time.time() + 30})[
        "results"
    ] == ["stored"]


def busy_lane(r, ks, seconds):
    """Queue RETRIEVEs on the rank's copy lane worth about ``seconds`` of copying; returns their req_ids."""
    body = {"instance": "r", "chunks": [chunk(k, range(32 + 4 * i, 36 + 4 * i)) for i, k in enumerate(ks)]}
    one = math.inf
    for _ in range(2):  # the first round also faults the target pages in: keep the faster
        t = time.monotonic()
        for q in [r.send_request("RETRIEVE", body) for _ in range(6)]:
            assert r.recv(30)[:2] == [q, True]
        one = min(one, (time.monotonic() - t) / 6)
    n = max(16, min(600, math.ceil(seconds / one)))
    return [r.send_request("RETRIEVE", body) for _ in range(n)]


def test_store_finishing_after_its_deadline_commits_nothing(inproc_factory, inraw, ranks):
    d = inproc_factory(pool_mb=64)
    rank = ranks(BIG, num_blocks=68)  # 0-31 stored from, 32-63 the busy retrieves' targets
    r = inraw(d)
    r.hello()
    r.ok("REGISTER", {"instance": "r", "layout": rank.layout()})
    ks = keys(8)
    r.ok("STORE", {"instance": "r", "chunks": [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)]})
    queued = busy_lane(r, ks, 1.5)
    late = keys(1)[0]
    rank.kv[0][:, 64:68] = 0
    store_id = r.send_request(
        "STORE", {"instance": "r", "chunks": [chunk(late, range(4))], "deadline": time.time() + 0.3}
    )
    retr_id = r.send_request(
        "RETRIEVE", {"instance": "r", "chunks": [chunk(ks[0], range(64, 68))], "deadline": time.time() + 0.3}
    )
    replies = {}
    while len(replies) < len(queued) + 2:
        req_id, ok, body = r.recv(30)
        assert req_id not in replies
        replies[req_id] = (ok, body)
    assert all(replies[q][0] for q in queued)
    ok, body = replies[store_id]
    assert not ok and body["code"] == "EXPIRED"
    assert "nothing was stored" in body["message"]  # it arrived in time: the finished copy was dropped
    ok, body = replies[retr_id]
    assert not ok and body["code"] == "EXPIRED"
    assert not rank.kv[0][:, 64:68].any()  # not a byte copied into the engine's blocks
    # regression: an expired RETRIEVE is the client's deadline, not a failed copy (no ERROR line)
    assert "copy for r failed" not in d.log.read_text()
    st = d.status()
    assert st["objects"] == 8 and st["stored_chunks"] == 8
    look = {"namespace": rank.ns, "keys": [late], "groups": rank.specs(), "chunk_tokens": 16, "lease": False}
    assert r.ok("LOOKUP", look)["chunks"] == 0
    # the aborted object left no trace: the chunk stores normally now
    assert r.ok("STORE", {"instance": "r", "chunks": [chunk(late, range(4))]})["results"] == ["stored"]
    assert r.ok("LOOKUP", look)["chunks"] == 1
