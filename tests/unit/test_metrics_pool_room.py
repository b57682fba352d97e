"""/metrics exports the pool's room and backing as /status reports them: ``largest_free_bytes``,
``largest_storable_bytes``, ``leased_bytes``, the bytes and segments backed, the next growth, and
the pinned bytes, as Prometheus gauges of the same values: the daemon's objects in this process
(tests/inproc.py), its registry scraped as /metrics scrapes it.

The case: a 64 MiB pool holding one leased 40 MiB object has no room for a new object either way
(its slab is the pool's one 64 MiB block); released, the whole pool is storable by evicting it."""

from __future__ import annotations

from kv import FakeRank, GroupGeom, keys
from prometheus_client.parser import text_string_to_metric_families
from util import chunk

from tierd.pool import pages

MIB = 1 << 20
ROOM = (
    "memory_total_bytes",
    "memory_segments",
    "memory_next_segment_bytes",
    "memory_ahead_bytes",
    "memory_pinned_bytes",
    "largest_free_bytes",
    "largest_storable_bytes",
    "leased_bytes",
)


def gauges(daemon) -> dict[str, float]:
    text = daemon.metrics()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        if f.type == "gauge"
        for s in f.samples
        if not s.labels
    }


def test_the_pools_room_and_backing_are_gauges_equal_to_status(inproc_factory, inclient_factory):
    d = inproc_factory("--max-lease-share", "1", pool_mb=64)
    c = inclient_factory(d)
    rank = FakeRank([GroupGeom("full", layers=10, block_bytes=1 * MIB)], num_blocks=4)
    try:
        c.register("r40", rank.layout())
        (k,) = keys(1)
        assert c.store("r40", [chunk(k, range(4))]).results == ["stored"]
        lease = c.lookup(rank.ns, [k], rank.specs(), 16).lease
        st, got = d.status(), gauges(d)
        assert {n: got.get(f"tierd_{n}") for n in ROOM} == {n: st[n] for n in ROOM}
        assert (got["tierd_largest_free_bytes"], got["tierd_largest_storable_bytes"]) == (0, 0)
        assert got["tierd_leased_bytes"] == 40 * MIB  # the leased object: 4 blocks x 10 layers x 1 MiB
        assert got["tierd_memory_total_bytes"] == 64 * MIB and got["tierd_memory_segments"] >= 1
        assert st["memory_huge_pages"] == pages.huge_pages()  # a memfd pool: the kernel's shmem setting

        c.release(lease)
        st, got = d.status(), gauges(d)
        assert {n: got.get(f"tierd_{n}") for n in ROOM} == {n: st[n] for n in ROOM}
        assert (got["tierd_largest_free_bytes"], got["tierd_largest_storable_bytes"]) == (0, 64 * MIB)
        assert got["tierd_leased_bytes"] == 0
    finally:
        rank.close()
