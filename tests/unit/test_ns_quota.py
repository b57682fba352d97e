"""Per-namespace byte quotas (Pool(ns_quota_bytes=...), 0 = off): a namespace at its quota makes
room by evicting its own least recently used unpinned objects, never another namespace's; when
it cannot, the store is rejected and nothing is evicted anywhere. ``per_ns_bytes`` says how many
bytes (slots) each namespace holds."""

import pytest

from tierd.pool.pool import EXISTS, Pool

KIB, MIB = 1 << 10, 1 << 20
A, B = b"tenant-a", b"tenant-b"


def key(i: int) -> bytes:
    return b"key-%06d" % i


def put(pool, ns, i, nbytes=16 * KIB, mask=1):
    obj = pool.begin_write(ns, key(i), {0: (0, 0)}, 0, nbytes, mask, "g0")
    if obj is None or obj is EXISTS:
        return None
    pool.commit([obj])
    return obj


def held(pool, ns, ids) -> list[int]:
    return [i for i in ids if pool.find_ready(ns, key(i), 0, 0) is not None]


@pytest.fixture
def pool():
    p = Pool(ceiling=1 * MIB, initial=0, align=4 * KIB, segment_bytes=1 * MIB, ns_quota_bytes=256 * KIB)
    yield p
    p.close()


def test_a_namespace_at_its_quota_evicts_its_own_least_recent(pool):
    for i in range(16):
        assert put(pool, A, i) is not None
        assert put(pool, B, i) is not None
    assert pool.per_ns_bytes == {A: 256 * KIB, B: 256 * KIB} and pool.evictions == 0
    pool.touch(A, [key(0)])  # a's least recent is now 1
    assert put(pool, A, 16) is not None  # the pool has room, the namespace has not
    assert pool.evictions == 1 and held(pool, A, range(17)) == [0] + list(range(2, 17))
    assert held(pool, B, range(16)) == list(range(16))
    assert pool.per_ns_bytes[A] == 256 * KIB and pool.per_ns[A] == 16


def test_a_namespace_at_its_quota_with_everything_pinned_is_rejected(pool):
    objs = [put(pool, A, i) for i in range(16)]
    [put(pool, B, i) for i in range(16)]
    pool.pin(objs)
    assert put(pool, A, 16) is None
    assert pool.evictions == 0 and len(held(pool, A, range(16))) == 16 == len(held(pool, B, range(16)))
    pool.unpin(objs[3:4])
    assert put(pool, A, 16) is not None and held(pool, A, range(4)) == [0, 1, 2]


def test_a_larger_object_takes_as_many_of_its_own_as_it_needs(pool):
    for i in range(16):
        put(pool, A, i)
    put(pool, B, 0)
    assert put(pool, A, 100, nbytes=40 * KIB) is not None  # 40 KiB: the three least recent go
    assert held(pool, A, range(16)) == list(range(3, 16)) and held(pool, B, [0]) == [0]
    assert pool.per_ns_bytes[A] == 13 * 16 * KIB + 40 * KIB <= 256 * KIB


def test_only_the_namespace_over_quota_is_held_back_from_others():
    """Under its quota a namespace is served as without quotas: a full pool evicts its LRU."""
    q = Pool(ceiling=1 * MIB, initial=0, align=4 * KIB, segment_bytes=1 * MIB, ns_quota_bytes=768 * KIB)
    try:
        for i in range(48):
            put(q, B, i)  # b at its quota: 768 KiB
        for i in range(16):
            put(q, A, i)  # the pool is full
        assert q.evictions == 0
        assert put(q, A, 16) is not None  # a holds 256 KiB: the pool's least recent goes, b's
        assert held(q, B, range(48)) == list(range(1, 48)) and len(held(q, A, range(17))) == 17
        q.touch(B, [key(i) for i in range(1, 48)])  # b's now more recent than a's; its least recent: 47
        assert put(q, B, 48) is not None  # b back at 768 KiB, not over: the pool's least recent, a's
        assert held(q, A, range(17)) == list(range(1, 17)) and len(held(q, B, range(49))) == 48
        assert put(q, B, 49) is not None  # b over its quota: its own least recent, not a's older ones
        assert held(q, B, range(50)) == list(range(1, 47)) + [48, 49]
        assert held(q, A, range(17)) == list(range(1, 17))
    finally:
        q.close()


def test_a_full_pool_gives_a_namespace_at_quota_only_its_own_room():
    """The pool is full of both namespaces' 16 KiB objects in shared slabs: a's 64 KiB store (a
    new size) needs a 512 KiB window of a's objects alone; there is none, so nothing goes."""
    q = Pool(ceiling=1 * MIB, initial=0, align=4 * KIB, segment_bytes=1 * MIB, ns_quota_bytes=512 * KIB)
    try:
        for i in range(32):
            put(q, A, i)
            put(q, B, i)
        assert q.used_bytes == 1 * MIB and q.per_ns_bytes[A] == 512 * KIB
        assert put(q, A, 100, nbytes=64 * KIB) is None
        assert q.evictions == 0 and len(held(q, A, range(32))) == 32 == len(held(q, B, range(32)))
    finally:
        q.close()


def test_an_object_larger_than_the_quota_is_rejected(pool):
    put(pool, B, 0)
    assert put(pool, A, 0, nbytes=300 * KIB) is None and pool.evictions == 0


def test_a_fuller_copy_replaces_without_counting_twice(pool):
    for i in range(16):
        put(pool, A, i, mask=0b01)
    assert put(pool, A, 5, mask=0b11) is not None  # replaces key 5: no eviction for the quota
    assert pool.evictions == 0 and pool.per_ns_bytes[A] == 256 * KIB
    assert pool.find_ready(A, key(5), 0, 0).mask == 0b11


def test_bytes_per_namespace_follow_stores_and_drops(pool):
    objs = [put(pool, A, i, nbytes=n) for i, n in enumerate((4 * KIB, 16 * KIB, 20 * KIB))]
    put(pool, B, 0)
    assert pool.per_ns_bytes == {A: 40 * KIB, B: 16 * KIB} and pool.per_ns == {A: 3, B: 1}
    assert pool.clear(A) == 3 and pool.per_ns_bytes == {B: 16 * KIB} and A not in pool.per_ns
    assert all(not o.ready for o in objs)
    off = Pool(ceiling=1 * MIB, initial=0, align=4 * KIB, segment_bytes=1 * MIB)  # no quota: bytes too
    try:
        put(off, A, 0, nbytes=5 * KIB)
        assert off.per_ns_bytes == {A: 8 * KIB} and off.nslru == {}
    finally:
        off.close()
