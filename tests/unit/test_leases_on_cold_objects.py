"""Leases on a class's coldest objects do not stop its stores from evicting the rest (found by a
hostile client: leases on the 1100 coldest of 3000 objects, 34% of the pool,
left a victim's 500 new stores rejected 428 times with 0 evictions, because each eviction search
gave up after passing SCAN pinned objects). Pool-level, exact counts."""

from tierd.pool import evict
from tierd.pool.pool import EXISTS, Pool

NS = b"ns"
OBJ = 16 << 10


def key(i: int) -> bytes:
    return b"key-%06d" % i


def put(pool, i):
    obj = pool.begin_write(NS, key(i), {0: (0, 0)}, 0, OBJ, 1, "g0")
    if obj is None or obj is EXISTS:
        return None
    pool.commit([obj])
    return obj


def test_stores_evict_unpinned_objects_behind_more_than_scan_pinned_ones():
    n = 3000
    pool = Pool(ceiling=n * OBJ, initial=0, align=4096, segment_bytes=n * OBJ)
    try:
        objs = [put(pool, i) for i in range(n)]
        assert None not in objs and pool.evictions == 0
        leased = objs[: evict.SCAN + 76]  # the coldest, more than one search passes
        for o in leased:
            o.pins += 1  # as a lease pins them
        stored = [put(pool, n + i) for i in range(500)]
        assert None not in stored, f"{stored.count(None)} of 500 stores found no room"
        assert pool.evictions == 500
        assert all(pool.find_ready(NS, key(i), 0, 0) is not None for i in range(len(leased)))  # leased stay
        assert all(pool.find_ready(NS, key(i), 0, 0) is None for i in range(len(leased), len(leased) + 500))
    finally:
        pool.close()
