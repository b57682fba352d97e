"""The index's objects leave the cyclic GC's sight (a full collection would otherwise rescan every
one of them: 0.4 s per million), and stay freed by reference counting when evicted or cleared."""

from kv import FakeRank, GroupGeom, keys
from wire import wait_for


def test_index_objects_are_frozen_out_of_the_cyclic_gc_and_still_freed(daemon, client):
    rank = FakeRank([GroupGeom("full")], num_blocks=4096)
    try:
        client.register("r", rank.layout())
        ks = keys(1000)
        res = client.store(
            "r", [{"key": k, "blocks": [[4 * (i % 1000) + j for j in range(4)]]} for i, k in enumerate(ks)]
        )
        assert res.results.count("stored") == 1000
        wait_for(
            lambda: daemon.status()["gc_frozen_objects"] >= 1000, 15, what="a gc.freeze after the stores"
        )
        assert client.clear().evicted == 1000
        st = daemon.status()
        assert st["objects"] == 0 and st["memory_used_bytes"] == 0
        assert client.lookup(rank.ns, ks[:4], rank.specs(), 16, lease=False).chunks == 0
    finally:
        rank.close()
