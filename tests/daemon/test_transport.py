"""Transport and copy-lane settings: a tcp:// endpoint works like ipc://, and with --workers N
ranks share N copy threads and still round-trip byte for byte, concurrently."""

import numpy as np
import pytest
from conftest import free_port
from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures


def test_tcp_endpoint_round_trip(daemon_factory, client_factory, ranks):
    port = free_port()
    d = daemon_factory("--socket", f"tcp://127.0.0.1:{port}", "--insecure-tcp")
    d.endpoint = f"tcp://127.0.0.1:{port}"  # the fixture's ipc path was overridden
    c = client_factory(d)
    rank = ranks(GroupGeom("full"))
    c.register("t", rank.layout())
    k = keys(1)[0]
    assert c.store("t", [chunk(k, range(4))]).results == ["stored"]
    assert c.retrieve("t", [chunk(k, range(8, 12))]).ok == [True]
    np.testing.assert_array_equal(rank.kv[0][:, 8:12], rank.kv[0][:, 0:4])
    assert d.status()["socket"] == d.endpoint


@pytest.mark.parametrize("workers", ["1", "2"])
def test_shared_copy_lanes(daemon_factory, client_factory, ranks, workers):
    d = daemon_factory("--workers", workers)
    geoms = [
        GroupGeom("full", layers=3, block_bytes=4096),
        GroupGeom("state", block_bytes=8192, block_tokens=16),
    ]
    rs = [ranks(*geoms, rank=i, world_size=3, fingerprint="w") for i in range(3)]
    cs = [client_factory(d) for _ in rs]
    for i, (c, r) in enumerate(zip(cs, rs)):
        c.register(f"w{i}", r.layout())
    ks = keys(8)
    body = [chunk(k, range(4 * j, 4 * j + 4), [j]) for j, k in enumerate(ks)]
    futs = [c.store_async(f"w{i}", body[:4]) for i, c in enumerate(cs)] + [
        c.store_async(f"w{i}", body[4:]) for i, c in enumerate(cs)
    ]
    assert all(f.result().results == ["stored"] * 4 for f in futs)
    assert cs[0].lookup(rs[0].ns, ks, rs[0].specs(), 16, lease=False).chunks == 8
    back = [chunk(k, range(32 + 4 * j, 36 + 4 * j), [40 + j]) for j, k in enumerate(ks)]
    futs = [c.retrieve_async(f"w{i}", back) for i, c in enumerate(cs)]
    assert all(f.result().ok == [True] * 8 for f in futs)
    for r in rs:
        np.testing.assert_array_equal(r.kv[0][:, 32:64], r.kv[0][:, 0:32])
        np.testing.assert_array_equal(r.kv[1][:, 40:48], r.kv[1][:, 0:8])
