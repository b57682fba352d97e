"""What fits is decided by slabs, not by free bytes, and /status says it: ``largest_free_bytes``
(the largest new object a STORE places now without evicting) and ``largest_storable_bytes``
(evicting unpinned objects too), also in ``tierd status``.

The case that hid it: a 64 MiB pool holding one leased 40 MiB object (its slab is the pool's one
64 MiB block) rejects a 24 MiB store, nothing evicted, while 24 MiB look free. Buddy slabs keep
that (an object takes a power-of-two block; tierd.pool.segments), so the operator is told instead.
The pool's own objects, then the daemon's in this process (tests/inproc.py), its /status rendered
as ``tierd status`` renders it (that the command reads it over HTTP or the socket and prints it is
tests/daemon/test_cli.py's)."""

from __future__ import annotations

import operator

from kv import FakeRank, GroupGeom, keys
from util import chunk

from tierd.pool.pool import Pool
from tierd.tools.report import status_table

KIB, MIB = 1 << 10, 1 << 20
NS = b"namespace-0"


def put(pool: Pool, i: int, nbytes: int, commit: bool = True):
    obj = pool.begin_write(NS, b"key-%08d" % i, {0: (0, 0)}, 0, nbytes, 1, "g0")
    if obj is not None and commit:
        pool.commit([obj])
    return obj


def test_a_leased_object_beside_its_free_bytes_leaves_no_room_and_the_pool_says_so():
    pool = Pool(ceiling=64 * MIB, initial=0, align=4 * KIB, segment_bytes=64 * MIB)
    try:
        leased = put(pool, 0, 40 * MIB)
        pool.pin([leased])
        assert pool.room() == (0, 0)
        assert put(pool, 1, 24 * MIB) is None and pool.evictions == 0 and pool.objects == 1
        pool.unpin([leased])
        assert pool.room() == (0, 64 * MIB)  # evicting the 40 MiB object frees the whole block
        assert put(pool, 2, 64 * MIB + 4 * KIB) is None and pool.evictions == 0
        assert put(pool, 3, 64 * MIB) is not None and pool.evictions == 1
    finally:
        pool.close()


def test_room_is_the_largest_object_whose_new_slab_fits_a_window_without_pinned_objects():
    """A full 64 MiB pool of 1 MiB objects (8 MiB slabs), one pinned in its first half: a new
    object's slab must fit the clean 32 MiB half, so it holds 8 slots of at most 4 MiB."""
    pool = Pool(ceiling=64 * MIB, initial=0, align=4 * KIB, segment_bytes=64 * MIB)
    try:
        objs = [put(pool, i, 1 * MIB) for i in range(64)]
        assert pool.backed_bytes == 64 * MIB and pool.room() == (0, 64 * MIB)
        pool.pin([objs[0]])
        assert pool.room() == (0, 4 * MIB)
        assert put(pool, 100, 4 * MIB + 4 * KIB) is None and pool.evictions == 0  # its slab: 64 MiB
        assert put(pool, 101, 4 * MIB) is not None and pool.evictions == 32  # the clean half
        assert pool.room() == (0, 4 * MIB)
    finally:
        pool.close()


def test_past_its_work_bound_the_search_gives_a_lower_bound_from_what_it_looked_at():
    """Each slab and object looked at costs one unit; what the bound leaves unseen counts as pinned."""
    pool = Pool(ceiling=64 * MIB, initial=0, align=4 * KIB, segment_bytes=64 * MIB)
    try:
        for i in range(64):
            put(pool, i, 1 * MIB)  # eight 8 MiB slabs of eight objects
        pins = operator.attrgetter("pins")
        assert pool.slabs.clean_order(pins, 1 << 15) == 26  # the whole segment
        assert pool.slabs.clean_order(pins, 2 * 9) == 24  # two slabs seen: [0, 16 MiB)
        assert pool.slabs.clean_order(pins, 9) == 23  # one
        assert pool.slabs.clean_order(pins, 0) == -1  # none
    finally:
        pool.close()


def test_room_without_evicting_counts_free_blocks_and_growth():
    pool = Pool(ceiling=96 * MIB, initial=0, align=4 * KIB, segment_bytes=64 * MIB, grow_bytes=16 * MIB)
    try:
        assert pool.room() == (64 * MIB, 64 * MIB)  # a whole segment could be grown
        objs = [put(pool, 0, 1 * MIB)]  # a 16 MiB segment, an 8 MiB slab in it
        assert [s.nbytes for s in pool.segments.segments] == [16 * MIB]
        assert pool.room() == (64 * MIB, 64 * MIB)  # 80 MiB could still be grown
        pool.pin(objs)
        objs += [put(pool, i, 1 * MIB) for i in range(1, 96)]  # full: 96 MiB of 1 MiB objects
        assert (
            pool.evictions == 0
            and [s.nbytes // MIB for s in pool.segments.segments] == [16, 16, 32, 32]
            and pool.objects == 96
        )
        assert pool.room() == (0, 4 * MIB)  # a clean 32 MiB segment holds a new slab of 8 x 4 MiB
    finally:
        pool.close()


def test_status_shows_why_a_store_beside_a_leased_object_is_rejected(inproc_factory, inclient_factory):
    d = inproc_factory("--max-lease-share", "1", pool_mb=64)
    c = inclient_factory(d)
    big, small = (FakeRank([GroupGeom("full", layers=n, block_bytes=1 * MIB)], num_blocks=4) for n in (10, 6))
    try:
        c.register("r40", big.layout())  # 40 MiB chunks: 4 blocks x 10 layers x 1 MiB
        c.register("r24", small.layout())  # 24 MiB chunks
        k40, k24 = keys(1)[0], keys(2)[1]
        assert c.store("r40", [chunk(k40, range(4))]).results == ["stored"]
        lease = c.lookup(big.ns, [k40], big.specs(), 16).lease
        assert lease > 0
        st = d.status()
        assert (st["largest_free_bytes"], st["largest_storable_bytes"]) == (0, 0)
        table = status_table(d.status())  # what `tierd status` prints
        rows = [" ".join(line.split()) for line in table.splitlines()]
        assert "room largest new object storable now 0 B (0 B without evicting)" in rows, table
        assert c.store("r24", [chunk(k24, range(4))]).results == ["rejected"]
        assert d.status()["evictions"] == 0

        c.release(lease)
        st = d.status()  # what `tierd status --json` prints
        assert (st["largest_free_bytes"], st["largest_storable_bytes"]) == (0, 64 * MIB)
        assert c.store("r24", [chunk(k24, range(4))]).results == ["stored"]
        assert d.status()["evictions"] == 1
    finally:
        big.close()
        small.close()
