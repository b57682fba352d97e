"""STORE's ``event`` field (the CUDA fence): validated as a 64-byte IPC event handle, ignored for
cpu layouts, which have nothing to wait on. The daemon's objects in this process (tests/inproc.py)."""

import pytest
from kv import FakeRank, GroupGeom, keys

from tierd_client import TierdError


def test_cpu_store_accepts_and_ignores_an_event(inclient):
    rank = FakeRank([GroupGeom("full", layers=2, block_bytes=256)])
    inclient.register("r0", rank.layout())
    [k] = keys(1)
    res = inclient.store("r0", [{"key": k, "blocks": [[0, 1, 2, 3]]}], event=bytes(64))
    assert res.results == ["stored"]
    rank.close()


@pytest.mark.parametrize("event", [b"short", bytes(65), "not-bytes", 7])
def test_store_rejects_a_malformed_event(inclient, event):
    rank = FakeRank([GroupGeom("full", layers=2, block_bytes=256)])
    inclient.register("r0", rank.layout())
    [k] = keys(1)
    with pytest.raises(TierdError) as err:
        inclient.call(
            "STORE", {"instance": "r0", "chunks": [{"key": k, "blocks": [[0, 1, 2, 3]]}], "event": event}
        )
    assert err.value.code == "BAD_REQUEST"
    assert "event" in str(err.value)
    rank.close()
