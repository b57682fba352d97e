"""The eviction policies as pure functions of a pool without a daemon: which object each store
evicts, in what order, at what level a new object enters, and the estimates the ``reuse`` policy
learns from, each with exact object ids and numbers.

A pool of CAP one-block objects (64-byte slots) holds exactly CAP of them: every store past that
evicts one, chosen by the pool's policy (tierd.pool.policy)."""

import math

import pytest

from tierd.base.config import Settings
from tierd.pool import policy as policies
from tierd.pool import shadow as shadows
from tierd.pool.index import Span
from tierd.pool.pool import Pool
from tierd.protocol.layout import GroupKind, GroupSpec
from tierd.tools.trace import block_key

CAP, SLOT, NS = 4, 64, b"ns"
SPAN = Span({0: (0, 0)}, {0: 1})
FULL = GroupSpec(GroupKind.FULL, 16)


def key(i: int) -> bytes:
    return b"k%03d" % i


def make(policy: str, cap: int = CAP) -> Pool:
    return Pool(cap * SLOT, 0, SLOT, cap * SLOT, eviction_policy=policy)


def store(pool: Pool, *ids: int) -> list:
    """One STORE of ``ids`` as a prefix: committed together, the first ends up most recent."""
    with pool.writes() as w:
        objs = [w.begin(NS, key(i), SPAN, 0, SLOT, 1, "g0") for i in ids]
    made = [o for o in objs if o is not None]
    pool.commit(made)
    return objs


def lookup(pool: Pool, *ids: int) -> int:
    """A LOOKUP of ``ids``, its touch applied as the daemon does after the reply."""
    hit, _ = pool.lookup(NS, [key(i) for i in ids], [FULL], 16, [0])
    pool.settle()
    return hit


def held(pool: Pool) -> list[int]:
    return sorted(int(k[1:]) for k in pool.index.spaces.get(NS, {}))


def order(pool: Pool) -> list[int]:
    """Every object, first to be evicted first."""
    return [int(o.key[1:]) for o in pool.coldest(1 << 30)]


def test_config_offers_exactly_the_policies_with_reuse_the_default():
    assert Settings().eviction_policy == policies.DEFAULT == "reuse"
    from dataclasses import fields

    f = next(f for f in fields(Settings) if f.name == "eviction_policy")
    assert set(f.metadata["choices"]) == set(policies.POLICIES)
    with pytest.raises(ValueError, match="eviction policy must be one of"):
        make("arc")


@pytest.mark.parametrize("name", ["lru", "reuse"])
def test_stores_evict_the_least_recent_one_at_a_time(name):
    pool = make(name)
    for i in range(CAP):
        store(pool, i)
    assert order(pool) == [0, 1, 2, 3]
    store(pool, 4)
    assert held(pool) == [1, 2, 3, 4] and pool.evictions == 1
    assert lookup(pool, 1) == 1  # found: most recent
    store(pool, 5)
    assert held(pool) == [1, 3, 4, 5]  # 2 went, not 1
    assert order(pool) == [3, 4, 1, 5]


@pytest.mark.parametrize("name", ["lru", "reuse"])
def test_a_prefix_goes_tail_first_and_a_hit_keeps_its_head(name):
    pool = make(name)
    store(pool, 0, 1, 2, 3)  # one prefix: 0 is its head
    assert order(pool) == [3, 2, 1, 0]
    assert lookup(pool, 0, 1, 2, 3) == 4
    pool.policy.bonus = [0, 100, 150, 200] if name == "reuse" else None  # (lru has none)
    store(pool, 10, 11)
    assert held(pool) == [0, 1, 10, 11]
    assert lookup(pool, 0, 1, 2, 3) == 2  # a shorter head, no hole


def test_reuse_keeps_an_object_found_before_for_its_bonus():
    pool = make("reuse")
    for i in range(CAP):
        store(pool, i)  # ticks 1..4
    assert lookup(pool, 0) == 1  # 0: found once (level 1), tick 5
    assert [o.hits for o in pool.coldest(1 << 30)] == [0, 0, 0, 1]
    pool.policy.bonus = [0, 10, 15, 20]  # keys: 1..3 (level 0), 5 + 10 = 15 (object 0)
    store(pool, 4)  # tick 6
    store(pool, 5)  # tick 7
    store(pool, 6)  # tick 8
    assert held(pool) == [0, 4, 5, 6]  # LRU would have evicted 0 before 1, 2 and 3
    assert order(pool) == [4, 5, 6, 0]  # keys 6, 7, 8, 15
    gone_at = None
    for i in range(7, 30):  # store i commits at tick i + 2
        store(pool, i)
        if 0 not in held(pool):
            gone_at = i
            break
    # store 16 met 13 and 0 both at key 15 (the less found goes first at equal keys); store 17
    # took 0 (LRU would have at store 7: its tick 5 was the oldest then)
    assert gone_at == 17 and held(pool) == [14, 15, 16, 17]
    assert pool.policy.reasons == {"unused": 13, "aged": 1, "displaced": 0}  # 0 went once its bonus ran out


def test_reuse_levels_count_lookups_up_to_three_and_order_by_level_bonus():
    pool = make("reuse")
    store(pool, 0)
    store(pool, 1)
    store(pool, 2)
    store(pool, 3)
    for _ in range(5):
        lookup(pool, 0)
    lookup(pool, 1)
    lookup(pool, 1)
    lookup(pool, 2)
    assert {int(o.key[1:]): o.hits for o in pool.coldest(1 << 30)} == {3: 0, 2: 1, 1: 2, 0: 3}
    # ticks now: 3 -> 4, 0 -> 9, 1 -> 11, 2 -> 12
    pool.policy.bonus = [0, 4, 6, 8]  # keys: 3 -> 4, 2 -> 16, 1 -> 17, 0 -> 17
    assert order(pool) == [3, 2, 1, 0]  # at equal keys the less found goes first
    pool.policy.bonus = [0, 1, 2, 3]  # keys: 4, 13, 13, 12
    assert order(pool) == [3, 0, 2, 1]


def test_reuse_never_evicts_a_pinned_object_whatever_its_key():
    pool = make("reuse")
    for i in range(CAP):
        store(pool, i)
    first = next(o for o in pool.coldest(1 << 30) if o.key == key(0))
    pool.pin([first])  # leased
    store(pool, 4)
    assert held(pool) == [0, 2, 3, 4]  # 1 went in 0's place
    pool.unpin([first])
    store(pool, 5)
    assert held(pool) == [0, 3, 4, 5]  # the search that passed 0 touched it (tick 5): 2 is older
    assert order(pool) == [3, 0, 4, 5]


def test_reuse_admits_a_key_it_evicted_at_the_next_level():
    """Admission: a new object enters level 0, unless the pool remembers evicting its key: then it
    enters one level above the one it left at (a store of a key is its next use)."""
    pool = make("reuse")
    store(pool, 0)
    lookup(pool, 0)
    lookup(pool, 0)  # level 2
    for i in range(1, CAP + 1):
        store(pool, i)  # bonus 0: 0 goes first (LRU order)
    assert 0 not in held(pool)
    assert pool.policy.ghost[key(0)] == [NS, 2, 3, False]  # its level and last tick when evicted
    store(pool, 0)  # evicts 1 (level 0, tick 4), commits 0 at tick 8: a distance of 5
    obj = next(o for o in pool.coldest(1 << 30) if o.key == key(0))
    assert obj.hits == 3
    # each lookup measured the distance of what it found (1, 1); the store measured 5
    assert pool.policy.samples == [(1, 1), (1, 1), (5, 1)]
    # chunks evicted from level 0 (1) and from higher levels (0), and of those stored again (0)
    assert pool.policy.outcomes == [[0.0, 1.0], [1.0, 1.0]]
    assert pool.policy.ghost[key(1)] == [NS, 0, 4, False]
    store(pool, 1)
    assert next(o for o in pool.coldest(1 << 30) if o.key == key(1)).hits == 1
    store(pool, 20)
    assert next(o for o in pool.coldest(1 << 30) if o.key == key(20)).hits == 0


def test_reuse_estimates_the_distance_three_quarters_of_reuses_fall_under():
    p = policies.Reuse()
    # four distances of 1024 objects each (4096 = PERIOD): 3/4 of the weight is reached at 300
    for d, n in ((300, 1024), (100, 1024), (200, 1024), (400, 1024)):
        p._sample(d, n)
    assert p.B == 300.0 and p.bonus == [0, 300, 450, 600] and p.samples == []
    for d, n in ((1000, 3072), (2000, 1024)):
        p._sample(d, n)
    assert p.B == (300 + 1000) / 2 and p.bonus == [0, 650, 975, 1300]  # the mean of the estimates


def test_reuse_scales_its_bonus_by_how_often_evicted_objects_come_back():
    p = policies.Reuse()
    p.outcomes = [[10.0, 40.0], [30.0, 40.0]]  # of 40 evicted each: 1 in 4 came back; 3 in 4
    p._sample(1000, policies.PERIOD)
    want = math.exp(policies.STEP * (0.75 - 0.25) / (0.75 + 0.25))
    assert p.s == pytest.approx(want) and p.bonus == [
        0,
        round(1000 * want),
        round(1500 * want),
        round(2000 * want),
    ]
    assert p.outcomes == [[8.75, 35.0], [26.25, 35.0]]  # decayed by 1 - 1/HISTORY
    for _ in range(40):  # the other way: the bonus was wasted on what it kept
        p.outcomes = [[30.0, 40.0], [1.0, 40.0]]
        p._sample(1000, policies.PERIOD)
    assert p.s == policies.S_RANGE[0]  # bounded below: LRU-like, never negative
    p.outcomes = [[3.0, 10.0], [1.0, 20.0]]  # too few evictions of one kind (16 needed): no change
    s = p.s
    p._sample(1000, policies.PERIOD)
    assert p.s == s


def test_reuse_counts_evictions_by_reason():
    pool = make("reuse")
    for i in range(CAP):
        store(pool, i)
    lookup(pool, 0)  # tick 5
    pool.policy.bonus = [0, 100, 150, 200]
    pool.pin([o for o in pool.coldest(1 << 30) if o.key != key(0)])  # only 0 may go
    store(pool, 4)
    assert held(pool) == [1, 2, 3, 4]
    assert pool.policy.status()["evictions_by_reason"] == {"unused": 0, "aged": 0, "displaced": 1}


def test_quota_evicts_the_namespaces_own_objects_in_policy_order():
    pool = Pool(8 * SLOT, 0, SLOT, 8 * SLOT, ns_quota_bytes=3 * SLOT, eviction_policy="reuse")
    for i in range(3):
        store(pool, i)
    lookup(pool, 0)
    pool.policy.bonus = [0, 100, 150, 200]
    store(pool, 3)
    assert held(pool) == [0, 2, 3]  # 1 is the namespace's first in order; 0 kept by its bonus
    queue = pool.nslru[NS, next(iter(pool.lru))]
    assert [int(o.key[1:]) for o in pool.policy.victims(queue)] == [2, 3, 0]  # keys 3, 5, 104


def test_reuse_remembers_an_evicted_key_for_its_own_namespace_only():
    """Another namespace's (another tenant's or model's) chunk of the same key starts at level 0."""
    pool = make("reuse")
    store(pool, 0)
    lookup(pool, 0)
    lookup(pool, 0)
    for i in range(1, CAP + 1):
        store(pool, i)
    assert 0 not in held(pool) and pool.policy.ghost[key(0)][:2] == [NS, 2]
    with pool.writes() as w:
        other = w.begin(b"other", key(0), SPAN, 0, SLOT, 1, "g0")
    pool.commit([other])
    assert other.hits == 0
    store(pool, 0)
    assert next(o for o in pool.coldest(1 << 30) if o.key == key(0) and o.ns == NS).hits == 3


# ---- the LRU shadow that guards ``reuse`` --------------------------------------------------
def shadowed(held_keys: int = 100) -> policies.Reuse:
    """A ``reuse`` policy whose pool has evicted once, with a learned bonus (B = 1,000 ticks)."""
    r = policies.Reuse()
    r.guard.full = True
    r.B = 1000.0
    r.bonus = [round(r.s * r.B * x) for x in policies.SHAPE]
    r.observe(NS, [], 0, held_keys)
    r.flush()  # sets the sampling from the pool's keys
    return r


def window(r: policies.Reuse, keys: list[bytes], hit: int, held_keys: int = 100) -> None:
    """LOOKUPs of ``keys``, each found ``hit`` deep in the pool, until one comparison is made."""
    for _ in range(-(-shadows.WINDOW // len(keys))):
        r.observe(NS, keys, hit, held_keys)
    r.flush()


def test_reuse_guard_takes_lookups_through_its_shadow_in_batches_in_order():
    r = shadowed()
    keys = [key(i) for i in range(4)]
    for _ in range(shadows.BATCH - 1):
        r.observe(NS, keys, 0, 100)
    assert not r.guard.shadow and len(r.guard.pending) == shadows.BATCH - 1
    r.observe(NS, keys[:2], 0, 100)  # the batch is full: all of it goes through, in order
    assert not r.guard.pending and list(r.guard.shadow) == [NS + key(i) for i in (3, 2, 1, 0)]
    assert r.guard.duel == [4 * (shadows.BATCH - 1) + 2, 0, 4 * (shadows.BATCH - 2) + 2]


def test_reuse_guard_halves_its_bonus_while_an_lru_shadow_hits_more_and_restores_it_after():
    r = shadowed()
    keys = [key(i) for i in range(8)]
    window(r, keys, 0)  # the shadow (LRU, 100 keys) holds all 8 after their first LOOKUP; the pool none
    assert r.guard.gate == 0.5 and r.bonus == [0, 500, 750, 1000]
    window(r, keys, 0)
    assert r.guard.gate == 0.25 and r.bonus == [0, 250, 375, 500]
    window(r, keys, 8)  # the pool finds all of them: as many as the shadow
    assert r.guard.gate == 0.5
    window(r, keys, 8)
    assert r.guard.gate == 1.0 and r.bonus == [0, 1000, 1500, 2000]
    window(r, keys, 8)
    assert r.guard.gate == 1.0  # whole at most


def test_reuse_guard_moves_nothing_while_the_pool_hits_a_little_less_than_lru():
    r = shadowed()
    r.guard.gate = 0.5
    keys = [key(i) for i in range(64)]
    r.observe(NS, keys, 0, 100)
    r.flush()  # the shadow holds them all from now on
    r.guard.duel = [0, 0, 0]
    window(r, keys, 62)  # 496 of 512 against the shadow's 512: within the noise
    assert r.guard.gate == 0.5


def test_reuse_guard_counts_the_shadows_hit_as_a_prefix_like_the_pools():
    """A key the shadow holds past one it lacks is no hit: the pool's hit ends there too."""
    r = shadowed(held_keys=4)
    keys = [key(i) for i in range(6)]
    r.observe(NS, keys, 0, 4)  # tail first, so the tail goes first: the shadow keeps the head
    r.flush()
    assert list(r.guard.shadow) == [NS + key(i) for i in (3, 2, 1, 0)]
    r.guard.duel = [0, 0, 0]
    r.observe(NS, keys[:4], 0, 4)
    r.flush()
    assert r.guard.duel == [4, 0, 4]
    r.guard.duel = [0, 0, 0]
    r.observe(NS, [key(9)] + keys[:4], 0, 4)  # 9 is missing: no hit, though 0..3 are there
    r.flush()
    assert r.guard.duel == [5, 0, 0]


def test_reuse_guard_samples_one_key_in_two_to_the_k_of_a_large_pool():
    r = policies.Reuse()
    keys = [block_key(i.to_bytes(8, "little")) for i in range(2048)]  # hashes, as chunk keys are
    r.observe(NS, keys, 0, 10_000)
    r.flush()
    assert not r.guard.shadow and r.guard.duel == [0, 0, 0]  # nothing evicted yet: nothing to judge
    r.guard.full = True
    r.observe(NS, keys, 0, 10_000)  # 10,000 keys held: 1 in 8 sampled, the shadow holds 1,250
    r.flush()
    assert r.guard.shift == 3 and r.status()["shadow_sampling"] == 0.125
    sampled = [k for k in keys if int.from_bytes(k[-2:], "big") % 8 == 0]
    assert r.guard.duel[0] == len(sampled) and 200 < len(sampled) < 320
    assert list(r.guard.shadow) == [NS + k for k in reversed(sampled)]
    # keys of other lengths (a tool's) are sampled by the same rule, key by key
    odd = [k[: 2 + i % 5] for i, k in enumerate(keys)]
    assert shadows.sample(odd, 3) == [i for i, k in enumerate(odd) if int.from_bytes(k[-2:], "big") % 8 == 0]


def test_reuse_guard_samples_fewer_keys_once_the_pool_holds_many_more():
    """A pool that first evicts while it holds few keys (a namespace at its quota) must not sample
    every key for good: past twice the keys, the shadow keeps the sparser sample's keys only."""
    r = policies.Reuse()
    r.guard.full = True
    keys = [block_key(i.to_bytes(8, "little")) for i in range(1500)]
    r.observe(NS, keys, 0, 1_500)
    r.flush()
    assert r.guard.shift == 0 and len(r.guard.shadow) == 1_500
    r.observe(NS, [], 0, 3_000)
    r.flush()  # 3,000 keys: 1 in 2 would do, but one step is within the hysteresis
    assert r.guard.shift == 0 and len(r.guard.shadow) == 1_500
    r.observe(NS, [], 0, 10_000)
    r.flush()  # 1 in 8: the shadow keeps exactly the keys that sample takes, in their order
    kept = [NS + k for k in reversed(keys) if int.from_bytes(k[-2:], "big") % 8 == 0]
    assert r.guard.shift == 3 and list(r.guard.shadow) == kept and r.guard.duel == [0, 0, 0]
    r.observe(NS, [], 0, 1_000)
    r.flush()  # far fewer keys again: every key, the shadow started over
    assert r.guard.shift == 0 and not r.guard.shadow


def test_reuse_guard_forgets_a_cleared_namespaces_keys_and_keeps_the_others():
    """After a CLEAR the pool holds none of that namespace's keys: the shadow must not count a
    LOOKUP of them as an LRU hit (that would halve the bonus for nothing)."""
    other = b"o" * len(NS)
    r = shadowed()
    keys = [key(i) for i in range(4)]
    r.observe(NS, keys, 0, 100)
    r.observe(other, keys, 0, 100)
    r.flush()
    r.observe(NS, keys[:1], 0, 100)  # pending when the CLEAR comes
    r.forget(NS)
    assert set(r.guard.shadow) == {other + k for k in keys} and not r.guard.pending
    r.guard.duel = [0, 0, 0]
    r.observe(NS, keys, 0, 100)
    r.flush()
    assert r.guard.duel == [4, 0, 0]  # no shadow hit on the cleared namespace's keys
    r.forget(None)
    assert not r.guard.shadow


def test_clearing_a_namespace_clears_it_from_the_policys_shadow():
    from tierd.pool.pool import Pool

    pool = Pool(ceiling=1 << 20, initial=0, align=4096, segment_bytes=1 << 20, eviction_policy="reuse")
    try:
        pool.policy.guard.full = True  # as once the pool has evicted
        pool.policy.observe(NS, [key(1)], 0, 100)
        pool.policy.flush()
        assert pool.policy.guard.shadow
        pool.clear(NS)
        assert not pool.policy.guard.shadow
    finally:
        pool.close()


def test_reuse_guard_keeps_only_the_sampled_keys_of_lookups_waiting_for_its_shadow():
    """A LOOKUP's keys are sampled when it is observed: the batch waiting for the shadow holds
    1 key in 2**k of it, not the whole key list."""
    r = policies.Reuse()
    r.guard.full = True
    keys = [block_key(i.to_bytes(8, "little")) for i in range(2048)]
    r.observe(NS, keys, 1024, 10_000)  # 1 in 8 sampled
    sampled = [i for i, k in enumerate(keys) if int.from_bytes(k[-2:], "big") % 8 == 0]
    assert r.guard.pending == [([NS + keys[i] for i in sampled], sum(i < 1024 for i in sampled))]
    r.flush()
    assert not r.guard.pending and r.guard.duel[0] == len(sampled)
