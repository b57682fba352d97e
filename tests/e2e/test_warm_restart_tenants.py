"""Tenants across a warm restart: a tenant's namespace comes back with its tenant (its objects are
kept under the tenant-scoped id, so only that tenant hits them), after a planned stop and after a
SIGKILL (the journal names it too)."""

from __future__ import annotations

import signal

import pytest
from conftest import free_port
from kv import FakeRank, keys
from pool_dirs import shm_dir  # noqa: F401 - fixture
from tenancy import GEOM, NS_FP, SPECS, ns, store_body, tokens_file
from wire import Raw

OPEN: list[Raw] = []


def session(endpoint: str, token: str) -> Raw:
    raw = Raw(endpoint)
    OPEN.append(raw)
    ok, hi = raw.call("HELLO", {"protocol": 1, "token": token})
    assert ok, hi
    return raw


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
def test_a_tenants_namespace_survives_a_restart_as_that_tenants_only(daemon_factory, tmp_path, shm_dir, stop):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = daemon_factory(
        "--socket", endpoint, "--tcp-token-file", str(tokens_file(tmp_path)), "--pool-dir", shm_dir
    )
    d.endpoint = endpoint
    ks = keys(2)
    rank = FakeRank([GEOM], fingerprint=NS_FP)
    try:
        alice = session(endpoint, "alice-token-0123456789")
        alice.ok("REGISTER", {"instance": "r0", "layout": rank.layout()})
        assert alice.ok("STORE", store_body(ks))["results"] == ["stored"] * 2
        before = d.status()["namespaces"]
        assert [n["tenant"] for n in before] == ["tcp:alice"]
        if stop == signal.SIGTERM:
            assert d.stop(stop) == 0
            d.start()
        else:
            d.restart()
        st = d.status()
        assert st["warm_restart"]["warm"] and st["namespaces"] == before
        lookup = {"namespace": ns(), "keys": ks, "chunk_tokens": 16, "groups": SPECS, "lease": False}
        assert session(endpoint, "bob-token-0123456789ab").ok("LOOKUP", lookup)["chunks"] == 0
        assert session(endpoint, "alice-token-0123456789").ok("LOOKUP", lookup)["chunks"] == 2  # control
    finally:
        rank.close()
        while OPEN:
            OPEN.pop().close()
