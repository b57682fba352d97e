"""L1 slots under an L2 call stay Mooncake's until it let go: a put's object is pinned (never evicted,
its slot never reused) until the put's ``finished``, also when its answer came first (a timeout);
a get's slot is an unready pinned object until then, committed whole on success, freed only at
``finished`` on failure. Write-back takes L1's cold end, in eviction order, and counts what
eviction took before its put.

The pool, planner and Op futures are the real ones; the tier is a stand-in that records calls and
lets the test answer them (``answer``), as tierd.tier2's worker would, in either order."""

from __future__ import annotations

from collections import Counter

import pytest
from planning import plan_store

from tierd.pool.pool import Pool
from tierd.protocol.layout import PageLayout
from tierd.protocol.messages import Chunk
from tierd.state.planner import Geometry
from tierd.tier2.fetch import Fetches
from tierd.tier2.parts import Part
from tierd.tier2.spill import Spill
from tierd.tier2.worker import Op

NS = b"n" * 16
OBJ = 64 << 10  # 4 blocks x 16 KiB, one layer
CAP = 8  # objects the pool holds


class Tier:
    state = "connected"

    def __init__(self):
        self.calls: list[tuple[str, list, Op]] = []

    def put(self, keys, addrs, sizes, timeout_s=None):
        return self._call("put", keys)

    def get(self, keys, addrs, sizes, timeout_s=None):
        return self._call("get", keys)

    def _call(self, kind, keys):
        op = Op(kind)
        self.calls.append((kind, list(keys), op))
        return op


def answer(op: Op, value, finished: bool = True) -> None:
    if finished:
        op.finished.set_result(None)
    op.done.set_result(value)


@pytest.fixture
def world():
    layout = PageLayout.from_wire(
        {
            "namespace": {"model": "m", "fingerprint": "f", "world_size": 1},
            "rank": 0,
            "chunk_tokens": 16,
            "tensors": [{"handle": {"kind": "shm", "path": "/dev/shm/x"}, "nbytes": 64 * 16384}],
            "groups": [
                {
                    "kind": "full",
                    "block_tokens": 4,
                    "layers": [
                        {
                            "tensor": 0,
                            "offset": 0,
                            "block_stride": 16384,
                            "num_blocks": 64,
                            "run_bytes": 16384,
                        }
                    ],
                }
            ],
        }
    )
    geo = Geometry(layout, True, -1)
    pool = Pool(ceiling=CAP * OBJ, initial=0, align=4096, segment_bytes=CAP * OBJ)
    tier, events, counts = Tier(), [], Counter()
    spill = Spill(tier, pool, "write-back", 3 * OBJ, events.append, counts, lambda: None)
    fetches = Fetches(tier, pool, events.append, counts, lambda: None, spill.landed)
    spill.learn(NS, geo)

    def handle():
        while events:
            kind, *args = events.pop(0)
            {"put": spill.put_done, "put_freed": spill.put_freed, "got": fetches.got, "freed": fetches.freed}[
                kind
            ](*args)

    yield geo, pool, tier, spill, fetches, counts, handle
    pool.close()


def store(pool, geo, i: int):
    plan = plan_store(geo, [Chunk(b"key-%08d" % i, [[0, 1, 2, 3]])], pool, NS, 0)
    pool.commit(plan.objs)
    return plan.objs[0] if plan.objs else None


def test_write_back_puts_the_cold_end_and_pins_it_until_mooncake_let_go(world):
    geo, pool, tier, spill, fetches, counts, handle = world
    objs = [store(pool, geo, i) for i in range(6)]
    spill.pump(1.0)  # 6 of 8 used, backlog 3: within the backlog of full
    ((kind, keys, op),) = tier.calls
    assert kind == "put" and [k[16:-4] for k in keys] == [b"key-%08d" % i for i in range(3)]  # the 3 coldest
    assert [o.pins for o in objs] == [1, 1, 1, 0, 0, 0]
    answer(op, [False, False, False], finished=False)  # the put timed out: Mooncake may still read
    handle()
    assert [o.pins for o in objs[:3]] == [1, 1, 1] and counts["writeback_failed"] == 3
    new = [store(pool, geo, i) for i in range(6, 11)]  # 5 more into 2 free slots: evicts, never the pinned
    assert all(o.ready for o in objs[:3]) and not any(o.ready for o in objs[3:6])
    spill.settle()  # (what eviction took is read back before the queue is, or the counters shown)
    assert None not in new[:5] and counts["writeback_lost"] == 3  # 3 dirty objects went without a put
    op.finished.set_result(None)
    handle()
    assert [o.pins for o in objs[:3]] == [0, 0, 0]


def test_regression_a_put_answered_in_time_is_not_put_again_and_its_clean_eviction_is_not_lost(world):
    """Regression: its slots freed (finished) before its answer (done), the next put started first
    and put the same objects again, not yet marked clean."""
    geo, pool, tier, spill, fetches, counts, handle = world
    objs = [store(pool, geo, i) for i in range(6)]
    spill.pump(1.0)
    answer(tier.calls[0][2], [True, True, True])
    handle()
    assert counts["writeback_puts"] == 3 and all(o in spill.clean for o in objs[:3])
    assert len(tier.calls) == 1  # the cold end is clean: nothing more to put
    for i in range(6, 9):
        store(pool, geo, i)  # evicts objs[0..] which L2 holds
    spill.settle()
    assert counts["writeback_lost"] == 0 and not objs[0].ready


def test_a_get_lands_in_an_unready_pinned_slot_and_commits_whole(world):
    geo, pool, tier, spill, fetches, counts, handle = world
    parts = [Part(b"key-%08d" % i, 0, 0) for i in range(2)]
    got = fetches.start(NS, geo, parts, 1.0)
    objs = [got[p].obj for p in parts]
    assert [(o.ready, o.pins) for o in objs] == [(False, 1), (False, 1)]
    assert pool.find_ready(NS, parts[0].key, 0, 0) is None  # not served while Mooncake writes it
    assert fetches.start(NS, geo, parts, 1.0) == got and len(tier.calls) == 1  # one fetch per part
    answer(tier.calls[0][2], [True, False])  # the second missed
    handle()
    assert objs[0].ready and objs[0].pins == 0 and objs[0].mask == 0b1111 and objs[0] in spill.clean
    assert not objs[1].ready and pool.entry(NS, parts[1].key) is None  # aborted: its slot is free
    assert (counts["fetched"], counts["fetch_failed"], counts["fetched_bytes"]) == (1, 1, OBJ)


def test_a_timed_out_get_keeps_its_slot_until_mooncake_let_go(world):
    geo, pool, tier, spill, fetches, counts, handle = world
    part = Part(b"key-late", 0, 0)
    obj = fetches.start(NS, geo, [part], 1.0)[part].obj
    op = tier.calls[0][2]
    answer(op, [False], finished=False)
    handle()
    assert fetches.get(NS, part) is None and pool.entry(NS, part.key) == {(0, 0): obj}  # still held
    for i in range(CAP + 2):
        store(pool, geo, i)  # pressure: never this slot
    assert pool.entry(NS, part.key) == {(0, 0): obj} and obj.pins == 1 and not obj.ready
    op.finished.set_result(None)
    handle()
    assert pool.entry(NS, part.key) is None


def test_no_room_is_no_fetch(world):
    geo, pool, tier, spill, fetches, counts, handle = world
    held = [store(pool, geo, i) for i in range(CAP)]
    pool.pin(held)  # all leased
    assert fetches.start(NS, geo, [Part(b"key-x", 0, 0)], 1.0) == {} and counts["fetch_no_room"] == 1
    assert not tier.calls
