"""A LOOKUP's bookkeeping applied in parts (the daemon applies it between requests, a few
hundred objects at a time, tierd.pool.recency) leaves the pool exactly as applying it at once
does: the same eviction order, levels, evictions and policy estimates, whatever the parts and
whenever a store's lock applies the rest. Pure: pools without a daemon, exact ids."""

import random

import pytest
from test_eviction_policy import FULL, NS, key, make, order, store


def state(pool) -> tuple:
    objs = pool.coldest(1 << 30)
    return (
        [int(o.key[1:]) for o in objs],
        [o.hits for o in objs],
        [o.tick for o in objs],
        pool.evictions,
        pool.policy.status(),
    )


def workload(seed: int, n: int = 1500, keys: int = 160) -> list[tuple[str, list[int]]]:
    """Stores of short prefixes and LOOKUPs of prefixes of them, of every length."""
    rng = random.Random(seed)
    heads = [list(range(s, s + rng.randrange(2, 20))) for s in range(0, keys, 20)]
    out = []
    for _ in range(n):
        prefix = rng.choice(heads)[: rng.randrange(1, 20)]
        out.append((rng.choice(["store", "lookup", "lookup"]), prefix))
    return out


@pytest.mark.parametrize("policy", ["reuse", "lru"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_touches_applied_in_parts_leave_the_order_of_touches_applied_at_once(policy, seed):
    at_once, in_parts = make(policy, 48), make(policy, 48)
    rng = random.Random(seed + 100)
    for op, ids in workload(seed):
        for pool in (at_once, in_parts):
            if op == "store":
                store(pool, *[i for i in ids if key(i) not in pool.index.spaces.get(NS, {})])
            else:
                pool.lookup(NS, [key(i) for i in ids], [FULL], 16, [0])
        if op == "lookup":
            at_once.settle()
            if rng.random() < 0.7:  # else the next store's lock applies it
                while in_parts.settle(rng.randrange(1, 8)):
                    pass
        assert in_parts.unsettled == 0 or op == "lookup"
    at_once.settle()
    in_parts.settle()
    assert state(in_parts) == state(at_once)
    assert len(order(at_once)) == 48 and at_once.evictions > 100  # the workload did evict


def test_a_part_takes_the_lookups_tail_first_and_the_rest_stays_pending():
    pool = make("reuse", 8)
    objs = store(pool, 0, 1, 2, 3, 4)  # 0 the most recent
    assert [o.tick for o in objs] == [5, 4, 3, 2, 1]
    pool.lookup(NS, [key(i) for i in range(5)], [FULL], 16, [0])
    assert pool.unsettled == 5 + 5  # five objects to touch, five keys to observe
    assert pool.settle(2)  # the tail: 4, then 3
    assert pool.unsettled == 8 and pool.policy.weight == 5  # the LOOKUP's distance counted once, for all 5
    assert [o.tick for o in objs] == [5, 4, 3, 7, 6] and [o.hits for o in objs] == [0, 0, 0, 1, 1]
    assert not pool.settle(3 + 5)  # the rest, and the observation
    assert pool.unsettled == 0 and pool.policy.weight == 5
    assert [o.tick for o in objs] == [10, 9, 8, 7, 6] and [o.hits for o in objs] == [1] * 5


@pytest.mark.parametrize("policy", ["reuse", "lru"])
def test_a_lookup_across_size_classes_touches_each_object_in_its_own_classs_queue(policy):
    """A prefix whose objects alternate between two size classes (a hybrid model's groups): each
    touch lands in the object's own class's queue, at its level, in tick order."""
    from test_eviction_policy import SPAN

    pool = make(policy, 64)
    with pool.writes() as w:  # 64-byte and 128-byte objects: two size classes
        objs = [w.begin(NS, key(i), SPAN, 0, 64 * (1 + i % 2), 1, "g0") for i in range(8)]
    pool.commit(objs)
    assert len({o.slab.cls for o in objs}) == 2
    for n in range(1, 6):
        pool.lookup(NS, [key(i) for i in range(8)], [FULL], 16, [0])
        pool.settle()
        assert [o.hits for o in objs] == [min(n, 3) if policy == "reuse" else 0] * 8
        assert [o.tick for o in objs] == sorted((o.tick for o in objs), reverse=True)  # the head most recent
        for cls, q in pool.lru.items():
            levels = q.q if policy == "reuse" else [q]
            for level, lq in enumerate(levels):
                assert all(o.slab.cls is cls and (policy == "lru" or o.hits == level) for o in lq)
                ticks = [o.tick for o in lq]
                assert ticks == sorted(ticks)  # each queue in tick order, oldest first
    assert order(pool)[-1] == 0  # the head goes last
