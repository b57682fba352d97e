"""LOOKUP leases: RELEASE frees them, the TTL frees them (counted in leases_expired), the last
rank's RETRIEVE spends them; while held they keep their objects from eviction. The daemon's
objects in this process (tests/inproc.py); its loop's housekeeping, which reaps expired leases,
is run by the test."""

import pytest
from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures
from wire import wait_for

from tierd.protocol import messages
from tierd_client import TierdError

GEOM = GroupGeom("full", layers=2, block_bytes=32 << 10, block_tokens=4)  # 256 KiB objects


def fill(d, c, rank):
    """Store as many chunks as the pool holds; returns their keys."""
    cap = d.status()["memory_configured_bytes"] // (256 << 10)
    ks = keys(cap)
    assert (
        c.store("r", [chunk(k, range(4 * (i % 8), 4 * (i % 8) + 4)) for i, k in enumerate(ks)]).results
        == ["stored"] * cap
    )
    return ks


def lease(c, rank, ks):
    reply = c.lookup(rank.ns, ks, rank.specs(), 16)
    assert reply.chunks == len(ks) and reply.lease > 0
    return reply.lease


def test_release_frees_the_lease_and_its_objects(inproc_factory, inclient_factory, ranks):
    d = inproc_factory("--max-lease-share", "1", pool_mb=2)  # this test leases the whole pool
    c = inclient_factory(d)
    rank = ranks(GEOM)
    c.register("r", rank.layout())
    ks = fill(d, c, rank)
    lid = lease(c, rank, ks)
    st = d.status()
    assert st["leases_active"] == 1 and st["leases_granted"] == 1
    assert c.store("r", [chunk(keys(1)[0], range(4))]).results == ["rejected"]
    assert c.release(lid) == messages.Empty()
    assert d.status()["leases_active"] == 0
    assert c.store("r", [chunk(keys(1)[0], range(4))]).results == ["stored"]
    with pytest.raises(TierdError) as err:
        c.release(lid)
    assert err.value.code == "UNKNOWN_LEASE"


def test_lease_ttl_expiry_frees_objects(inproc_factory, inclient_factory, ranks):
    d = inproc_factory("--lease-ttl-s", "0.5", "--max-lease-share", "1", pool_mb=2)
    c = inclient_factory(d)
    rank = ranks(GEOM)
    c.register("r", rank.layout())
    ks = fill(d, c, rank)
    reply = c.lookup(rank.ns, ks, rank.specs(), 16)
    assert reply.lease_ttl_s == 0.5
    assert c.clear().evicted == 0  # pinned while the lease lives
    assert d.status()["leases_active"] == 1
    wait_for(lambda: d.housekeeping() or d.status()["leases_active"] == 0, 5, what="the lease to expire")
    assert d.status()["leases_expired"] == 1
    with pytest.raises(TierdError) as err:
        c.release(reply.lease)
    assert err.value.code == "UNKNOWN_LEASE"
    assert c.clear().evicted == len(ks)


def test_lookup_without_lease_or_hit_grants_none(inproc, inclient, ranks):
    rank = ranks(GroupGeom("full"))
    inclient.register("r", rank.layout())
    ks = keys(2)
    assert inclient.lookup(rank.ns, ks, rank.specs(), 16).lease == 0  # nothing stored: no lease
    inclient.store("r", [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)])
    reply = inclient.lookup(rank.ns, ks, rank.specs(), 16, lease=False)
    assert reply == messages.LookupReply(chunks=2, lease=0, lease_ttl_s=reply.lease_ttl_s)
    st = inproc.status()
    assert st["leases_active"] == 0 and st["leases_granted"] == 0


def test_retrieve_spends_the_lease(inproc, inclient, ranks):
    rank = ranks(GroupGeom("full"))
    inclient.register("r", rank.layout())
    ks = keys(2)
    inclient.store("r", [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)])
    lid = lease(inclient, rank, ks)
    inclient.retrieve("r", [chunk(k, range(40 + 4 * i, 44 + 4 * i)) for i, k in enumerate(ks)], lease=lid)
    assert inproc.status()["leases_active"] == 0
    with pytest.raises(TierdError) as err:
        inclient.release(lid)
    assert err.value.code == "UNKNOWN_LEASE"
