"""The pool without a daemon: objects become visible only when committed, LRU eviction takes a
prefix's tail first, pinned objects (in flight, leased, being read) are never evicted, whole slabs
move between size classes under pressure, and LOOKUP folds groups and ranks (evicting a state
shortens the hit, never corrupts it)."""

import pytest

from tierd.pool.pool import EXISTS, Pool
from tierd.protocol.layout import GroupKind, GroupSpec

KIB = 1 << 10
NS = b"namespace-0"
FULL = GroupSpec(GroupKind.FULL, 4)
STATE = GroupSpec(GroupKind.STATE, 16)
SLIDE = GroupSpec(GroupKind.SLIDING, 4, window_tokens=8)


def key(i: int) -> bytes:
    return b"key-%08d" % i


@pytest.fixture
def pool():
    p = Pool(ceiling=1 << 20, initial=0, align=4 * KIB, segment_bytes=1 << 20)
    yield p
    p.close()


def put(pool, i, group=0, rank=0, nbytes=64 * KIB, mask=0b1111, commit=True):
    obj = pool.begin_write(NS, key(i), {group: (0, 0)}, rank, nbytes, mask, f"g{group}")
    assert obj is not None and obj is not EXISTS
    if commit:
        pool.commit([obj])
    return obj


def hit(pool, n, specs=(FULL,), ranks=(0,)):
    return pool.lookup(NS, [key(i) for i in range(n)], list(specs), 16, list(ranks))[0]


def test_uncommitted_objects_are_invisible(pool):
    obj = put(pool, 0, commit=False)
    assert hit(pool, 1) == 0 and pool.find_ready(NS, key(0), 0, 0) is None
    assert pool.begin_write(NS, key(0), {0: (0, 0)}, 0, 64 * KIB, 0b1111, "g0") is EXISTS
    pool.commit([obj])
    assert hit(pool, 1) == 1 and pool.find_ready(NS, key(0), 0, 0) is obj


def test_abort_frees_everything(pool):
    objs = [put(pool, i, commit=False) for i in range(4)]
    assert pool.objects == 4 and pool.used_bytes == 4 * 64 * KIB
    pool.abort(objs)
    assert pool.objects == 0 and pool.used_bytes == 0 and pool.per_group == {}
    assert hit(pool, 4) == 0
    put(pool, 0)  # the key is free again


def test_lru_evicts_a_prefix_tail_first(pool):
    objs = [pool.begin_write(NS, key(i), {0: (0, 0)}, 0, 64 * KIB, 0b1111, "g0") for i in range(16)]
    pool.commit(objs)  # one store of a 16-chunk prefix fills the pool
    assert pool.backed_bytes == 1 << 20
    extra = pool.begin_write(b"other", b"other-key", {0: (0, 0)}, 0, 64 * KIB, 0b1111, "g0")
    assert extra is not None and pool.evictions == 1
    assert hit(pool, 16) == 15  # the last chunk went, not the first
    pool.touch(NS, [key(i) for i in range(15)][::-1])  # touch in reverse: chunk 14 now most recent
    pool.commit([extra])
    put(pool, 100)
    assert hit(pool, 15) == 0  # chunk 0 was the least recent


def test_pinned_objects_are_never_evicted(pool):
    objs = [put(pool, i) for i in range(16)]
    pool.pin(objs)
    assert pool.begin_write(NS, key(99), {0: (0, 0)}, 0, 64 * KIB, 0b1111, "g0") is None
    assert pool.clear() == 0 and pool.evictions == 0
    pool.unpin(objs[5:6])
    got = pool.begin_write(NS, key(99), {0: (0, 0)}, 0, 64 * KIB, 0b1111, "g0")
    assert got is not None and pool.evictions == 1
    assert pool.find_ready(NS, key(5), 0, 0) is None
    assert all(pool.find_ready(NS, key(i), 0, 0) is objs[i] for i in range(16) if i != 5)


def test_in_flight_objects_are_never_evicted(pool):
    [put(pool, i, commit=False) for i in range(16)]
    assert pool.begin_write(NS, key(99), {0: (0, 0)}, 0, 64 * KIB, 0b1111, "g0") is None
    assert pool.evictions == 0


def test_slab_reclaim_moves_memory_across_size_classes(pool):
    small = [put(pool, i, nbytes=64 * KIB) for i in range(16)]
    assert pool.used_bytes == 1 << 20
    big = pool.begin_write(NS, key(500), {1: (0, 0)}, 0, 256 * KIB, 1, "g1")
    assert big is not None and big is not EXISTS
    gone = [o for o in small if pool.find_ready(NS, o.key, 0, 0) is None]
    assert len(gone) == pool.evictions >= 4  # a whole slab's worth of small objects went
    assert pool.used_bytes <= pool.backed_bytes <= pool.configured_bytes


def test_slab_reclaim_spares_slabs_with_pinned_objects(pool):
    small = [put(pool, i, nbytes=64 * KIB) for i in range(16)]
    pool.pin(small[:1])  # one pinned object keeps its whole (single) slab
    assert pool.begin_write(NS, key(500), {1: (0, 0)}, 0, 256 * KIB, 1, "g1") is None
    assert pool.find_ready(NS, key(0), 0, 0) is small[0]
    assert pool.evictions == 0 and all(pool.find_ready(NS, o.key, 0, 0) is o for o in small)  # none went


def test_slots_are_reused_after_eviction(pool):
    first = [put(pool, i) for i in range(16)]
    slots = {(id(o.slab), o.slot) for o in first}
    last = [put(pool, i) for i in range(16, 48)][-16:]
    assert pool.evictions == 32 and pool.objects == 16
    assert {(id(o.slab), o.slot) for o in last} == slots
    assert pool.backed_bytes == 1 << 20  # no growth: the same slots were reused


def test_evicting_a_state_shortens_the_hit(pool, monkeypatch):
    monkeypatch.setattr("tierd.pool.slabs.SLAB_TARGET_BYTES", 256 * KIB)  # room for both size classes
    states = {}
    for i in range(4):
        put(pool, i, group=0, mask=0b1111)
        states[i] = put(pool, i, group=1, nbytes=8 * KIB, mask=1)
    assert hit(pool, 4, (FULL, STATE)) == 4
    pool._evict(states[3])
    assert hit(pool, 4, (FULL, STATE)) == 3
    pool._evict(states[1])
    assert hit(pool, 4, (FULL, STATE)) == 3  # the state after chunk 2 is what boundary 3 needs
    pool._evict(states[2])
    assert hit(pool, 4, (FULL, STATE)) == 1
    hit_, objs = pool.lookup(NS, [key(i) for i in range(4)], [FULL, STATE], 16, [0])
    assert objs == [pool.find_ready(NS, key(0), 0, 0), states[0]]


def test_lookup_folds_ranks_and_leases_only_what_is_needed(pool):
    for i in range(3):
        put(pool, i, rank=0)
    assert hit(pool, 3, ranks=(0, 1)) == 0
    for i in range(2):
        put(pool, i, rank=1)
    assert hit(pool, 3, ranks=(0, 1)) == 2
    # sliding window 8: boundary 3 needs only chunk 2's last two blocks
    put(pool, 10, group=0, mask=0b1100)
    for i in (8, 9):
        put(pool, i, group=0, mask=0b0000 | 0b0011)
    n, objs = pool.lookup(NS, [key(8), key(9), key(10)], [SLIDE], 16, [0])
    assert n == 3 and objs == [pool.find_ready(NS, key(10), 0, 0)]


def test_partial_full_attention_chunk_is_not_a_hit(pool):
    put(pool, 0, mask=0b1111)
    put(pool, 1, mask=0b0111)
    assert hit(pool, 2) == 1


def test_clear_counts(pool):
    objs = [put(pool, i) for i in range(6)]
    pool.pin(objs[:2])
    assert pool.clear() == 4
    assert pool.objects == 2 and pool.used_bytes == 2 * 64 * KIB
