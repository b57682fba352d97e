"""The default eviction policy on traces of other shapes than Mooncake's conversations, replayed
through the daemon's pool (tierd.replay): where frequency tells (popular shared documents; a hot
set with one-off long documents streaming past it) it hits well above LRU, and where it does not
(quick multi-turn chats, a working set that changes every phase) it loses no more than 0.01 of
the infinite pool's hit ratio to LRU: a frequency bonus would keep a finished phase's objects a
while, and the policy's LRU shadow takes the bonus back once LRU would hit more. Seeded traces,
so the numbers are exact and a change of the policy that loses to LRU somewhere fails here."""

from __future__ import annotations

import random

import pytest

from tierd import replay
from tierd.trace import block_key


def trace(requests: list[list[int]]) -> replay.Trace:
    t = replay.Trace(
        "synthetic", [(b"", [block_key(i.to_bytes(8, "little")) for i in r]) for r in requests], 512
    )
    replay._count_infinite(t)
    return t


class Ids:
    def __init__(self):
        self.next = 1

    def new(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


def documents(n: int = 3000, docs: int = 1500, alpha: float = 0.9, seed: int = 1) -> list[list[int]]:
    """Questions on shared documents of Zipf popularity: system block, document, 1-3 own blocks."""
    rng, ids = random.Random(seed), Ids()
    texts = [ids.new(rng.randint(4, 24)) for _ in range(docs)]
    weights = [1 / (i + 1) ** alpha for i in range(docs)]
    return [[0] + rng.choices(texts, weights)[0] + ids.new(rng.randint(1, 3)) for _ in range(n)]


def chats(n: int = 6000, gap: int = 40, go_on: float = 0.8, seed: int = 2) -> list[list[int]]:
    """Conversations whose next turn comes ~gap requests later (its prompt: the last one but its
    last block, then 1-4 new blocks), continued with probability ``go_on``."""
    rng, ids, due, out = random.Random(seed), Ids(), {}, []
    for i in range(n):
        prev = due.pop(i, None)
        req = prev[:-1] + ids.new(rng.randint(1, 4)) if prev else [0] + ids.new(rng.randint(4, 20))
        out.append(req)
        if rng.random() < go_on:
            at = i + max(1, int(rng.expovariate(1 / gap)))
            while at in due:
                at += 1
            due[at] = req
    return out


def scans(n: int = 6000, hot: int = 100, scan: float = 0.3, seed: int = 6) -> list[list[int]]:
    """A hot set of prefixes asked again and again, and between them (share ``scan``) one-off long
    documents (20-60 blocks) that are never asked again: a scan."""
    rng, ids = random.Random(seed), Ids()
    hots = [ids.new(rng.randint(4, 12)) for _ in range(hot)]
    return [
        [0] + ids.new(rng.randint(20, 60)) if rng.random() < scan else [0] + rng.choice(hots) + ids.new(1)
        for _ in range(n)
    ]


def phases(n: int = 6000, phase: int = 1000, prefixes: int = 150, seed: int = 3) -> list[list[int]]:
    """A working set of prefixes reused uniformly, replaced by a new one every ``phase`` requests."""
    rng, ids, out = random.Random(seed), Ids(), []
    for i in range(n):
        if i % phase == 0:
            live = [ids.new(rng.randint(4, 16)) for _ in range(prefixes)]
        out.append([0] + rng.choice(live) + ids.new(1))
    return out


def shares(requests: list[list[int]], capacity: int) -> tuple[float, float]:
    t = trace(requests)
    return tuple(replay.replay(t, p, capacity).share(t) for p in ("lru", "reuse"))


@pytest.mark.parametrize("make, capacity", [(documents, 1000), (scans, 1000)], ids=["documents", "scans"])
def test_where_frequency_tells_it_hits_well_above_lru(make, capacity):
    lru, reuse = shares(make(), capacity)
    assert reuse >= lru + 0.1, (lru, reuse)


@pytest.mark.parametrize(
    "make, capacity",
    [
        (chats, 1000),
        (phases, 1000),
        (phases, 1500),
        (lambda: phases(phase=2000, prefixes=300, seed=12), 3000),
    ],
    ids=["chats", "phases-1000", "phases-1500", "long-phases"],
)
def test_where_frequency_does_not_tell_it_loses_little_to_lru(make, capacity):
    lru, reuse = shares(make(), capacity)
    assert reuse >= lru - 0.01, (lru, reuse)
