"""One small store never evicts a slab's worth of unrelated objects (a hostile client's store of
a new size: in a full 128 MiB pool of 4 KiB objects one 8 KiB store of a new size evicted 16,384
objects, a whole 64 MiB slab). Slabs are sized to their class, so a new class takes one small window: at most
window / victim size objects, here 64 KiB / 4 KiB = 16. Memory then follows use: a class whose
objects are newer than another's takes that class's coldest windows, one slab at a time."""

import pytest

from tierd.pool.pool import EXISTS, Pool
from tierd.pool.slabs import SLAB_WASTE

KIB, MIB = 1 << 10, 1 << 20
NS = b"ns"
SMALL = 128 * MIB // (4 * KIB)  # 32768 objects fill the pool


def key(i: int) -> bytes:
    return b"key-%06d" % i


def put(pool, i, nbytes):
    obj = pool.begin_write(NS, key(i), {0: (0, 0)}, 0, nbytes, 1, "g0")
    assert obj is not None and obj is not EXISTS
    pool.commit([obj])
    return obj


def gone(pool, ids) -> list[int]:
    return [i for i in ids if pool.find_ready(NS, key(i), 0, 0) is None]


@pytest.fixture(scope="module")
def full():
    pool = Pool(ceiling=128 * MIB, initial=0, align=4 * KIB, segment_bytes=1 << 30)
    for i in range(SMALL):
        put(pool, i, 4 * KIB)
    assert pool.evictions == 0 and pool.used_bytes == pool.backed_bytes == 128 * MIB
    yield pool
    pool.close()


def test_one_8k_store_in_a_full_pool_of_4k_objects_evicts_16(full):
    put(full, 100_000, 8 * KIB)
    assert full.evictions == 16  # the old allocator: 16,384
    assert full.evictions <= 2 * SLAB_WASTE * (8 * KIB) // (4 * KIB)  # the bound, whatever the sizes
    assert gone(full, range(SMALL)) == list(range(16))  # the coldest window: the first 16 stored


def test_the_new_class_grows_by_the_coldest_windows_of_the_old(full):
    for i in range(1, 64):  # 8 slabs of 8 slots
        put(full, 100_000 + i, 8 * KIB)
    assert gone(full, range(100_000, 100_064)) == []
    assert gone(full, range(SMALL)) == list(range(128))  # 8 windows of 16, coldest first
    assert full.evictions == 128


def test_a_class_colder_than_the_new_one_keeps_its_memory(full):
    full.touch(NS, [key(i) for i in range(128, SMALL)])  # the small objects are now the most recent
    before = full.evictions
    put(full, 100_064, 8 * KIB)
    assert full.evictions == before + 1
    assert gone(full, range(100_000, 100_065)) == [100_000]  # the 8 KiB class's own least recent
    assert gone(full, range(SMALL)) == list(range(128))
