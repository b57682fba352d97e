"""A store that cannot fit even after eviction is rejected before anything is evicted (a hostile
client's impossible store: a 128 MiB object into a 64 MiB pool was answered "rejected" after evicting all 3000
other objects). What eviction could free is judged first: free slots and memory, unpinned
objects of the class, windows of other classes' slabs whose objects are all unpinned, unbacked
room under the ceiling; an object larger than any segment the ceiling allows never fits."""

import pytest

from tierd.pool.pool import EXISTS, Pool

KIB, MIB = 1 << 10, 1 << 20
NS = b"ns"


def key(i: int) -> bytes:
    return b"key-%06d" % i


def put(pool, i, nbytes, ns=NS):
    obj = pool.begin_write(ns, key(i), {0: (0, 0)}, 0, nbytes, 1, "g0")
    if obj is None or obj is EXISTS:
        return None
    pool.commit([obj])
    return obj


def held(pool, n, ns=NS) -> list[int]:
    return [i for i in range(n) if pool.find_ready(ns, key(i), 0, 0) is not None]


@pytest.fixture
def full64():
    """A 64 MiB pool holding 3000 objects of 20 KiB (256 KiB slabs of 12), all backed."""
    pool = Pool(ceiling=64 * MIB, initial=0, align=4 * KIB, segment_bytes=64 * MIB)
    for i in range(3000):
        assert put(pool, i, 20 * KIB) is not None
    assert pool.evictions == 0 and pool.backed_bytes == 64 * MIB
    yield pool
    pool.close()


def test_an_object_larger_than_the_pool_evicts_nothing(full64):
    assert put(full64, 9999, 128 * MIB) is None
    assert full64.evictions == 0 and held(full64, 3000) == list(range(3000))


def test_an_object_larger_than_any_segment_evicts_nothing():
    pool = Pool(ceiling=64 * MIB, initial=64 * MIB, align=4 * KIB, segment_bytes=16 * MIB)
    try:
        for i in range(100):
            put(pool, i, 64 * KIB)
        assert put(pool, 9999, 17 * MIB) is None  # every segment is backed, none holds 32 MiB
        assert pool.evictions == 0 and held(pool, 100) == list(range(100))
        assert put(pool, 9998, 16 * MIB) is not None  # a whole segment's worth does fit
    finally:
        pool.close()


def test_an_object_larger_than_a_segment_grows_a_larger_one_while_the_ceiling_allows():
    pool = Pool(ceiling=64 * MIB, initial=0, align=4 * KIB, segment_bytes=16 * MIB)
    try:
        assert put(pool, 0, 17 * MIB) is not None and pool.backed_bytes == 32 * MIB
    finally:
        pool.close()


def test_a_new_class_among_pinned_objects_evicts_nothing(full64):
    """Every slab holds a pinned object: no window of another class can be emptied."""
    for i in range(3000, 3072):  # the last 1.5 MiB: 256 slabs of 12
        put(full64, i, 20 * KIB)
    objs = [full64.find_ready(NS, key(i), 0, 0) for i in range(3072)]
    full64.pin(objs[::12])  # one object of each slab
    assert put(full64, 9999, 64 * KIB) is None  # its slab (512 KiB) would empty two of theirs
    assert full64.evictions == 0 and held(full64, 3072) == list(range(3072))
    full64.unpin(objs[24:25])  # the third slab may go now, but its buddy (the fourth) may not
    assert put(full64, 9999, 64 * KIB) is None and full64.evictions == 0
    full64.unpin(objs[36:37])  # the third and fourth: one 512 KiB window
    assert put(full64, 9999, 64 * KIB) is not None
    assert sorted(set(range(3072)) - set(held(full64, 3072))) == list(range(24, 48))


def test_a_class_whose_objects_are_all_pinned_evicts_nothing_of_others():
    pool = Pool(ceiling=1 * MIB, initial=0, align=4 * KIB, segment_bytes=1 * MIB)
    try:
        small = [put(pool, i, 4 * KIB) for i in range(128)]  # 512 KiB
        big = [put(pool, 1000 + i, 64 * KIB) for i in range(8)]  # the other 512 KiB
        pool.pin(big)
        pool.pin(small[8:])  # only the coldest 32 KiB slab of small objects is free to go...
        assert put(pool, 2000, 64 * KIB) is None  # ...and a 64 KiB slab needs 512 KiB
        assert pool.evictions == 0
        assert all(pool.find_ready(NS, o.key, 0, 0) is o for o in small + big)
    finally:
        pool.close()


def test_stored_means_room_was_found_and_rejected_means_nothing_moved():
    """A pool under mixed sizes and pins: every rejected store leaves every object in place."""
    import random

    rnd = random.Random(5)
    pool = Pool(ceiling=4 * MIB, initial=0, align=4 * KIB, segment_bytes=1 * MIB)
    try:
        live, pinned = {}, []
        for i in range(1500):
            before = {k: o for k, o in live.items() if pool.find_ready(NS, key(k), 0, 0) is o}
            evictions = pool.evictions
            o = put(pool, i, rnd.choice((4 * KIB, 12 * KIB, 36 * KIB, 100 * KIB, 300 * KIB, 5 * MIB)))
            if o is None:
                assert pool.evictions == evictions
                assert all(pool.find_ready(NS, key(k), 0, 0) is v for k, v in before.items())
            else:
                live[i] = o
            if rnd.random() < 0.05:
                pool.unpin(pinned)
                pinned = [v for v in before.values() if rnd.random() < 0.3]
                pool.pin(pinned)
        assert pool.evictions > 100 and pool.used_bytes <= pool.backed_bytes <= 4 * MIB
    finally:
        pool.close()
