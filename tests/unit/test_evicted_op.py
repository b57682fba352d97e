"""EVICTED (docs/protocol.md section 14): what stopped being servable from the daemon's pool, for
the connectors' router events. Against the daemon's objects in this process (tests/inproc.py),
requests as a client frames them: evictions under pressure and CLEAR show up with their exact
keys, oldest first; cursors page with ``since``/``max``; a ring overflow and a cursor of another
boot say ``missed``; a partial object replaced by a fuller copy is not an eviction. Then the ring
itself (tierd.pool.evlog) and the pool's hooks, as pure functions. (That a tenant sees only its
own namespaces' evictions needs real local users: tests/daemon/test_tenants.py.)

A 2 MiB pool with 256 KiB objects (2 layers x 4 blocks x 32 KiB) holds a handful of chunks."""

from __future__ import annotations

import pytest
from kv import GroupGeom, keys
from util import NULL, chunk, ranks  # noqa: F401 - fixtures

from tierd.pool.evlog import EvictionLog
from tierd.pool.pool import EXISTS, Pool

OBJ = 256 << 10
GEOM = GroupGeom("full", layers=2, block_bytes=32 << 10, block_tokens=4)


def src(i: int) -> list[int]:
    b = 4 * (i % 8)
    return list(range(b, b + 4))


class Tight:
    """A 2 MiB daemon, one rank registered by hand-built requests."""

    def __init__(self, d, r, rank):
        self.d, self.r, self.rank = d, r, rank
        self.cap = d.status()["memory_configured_bytes"] // OBJ
        assert 6 <= self.cap <= 8

    def store(self, ks, first=0, blocks=None) -> list[str]:
        chunks = [chunk(k, blocks if blocks is not None else src(first + i)) for i, k in enumerate(ks)]
        return self.r.ok("STORE", {"instance": "r", "chunks": chunks})["results"]

    def evicted(self, **body) -> dict:
        reply = self.r.ok("EVICTED", {"namespace": self.rank.ns, **body})
        assert set(reply) == {"seq", "keys", "missed", "boot_id"}
        return reply

    def present(self, k) -> bool:
        body = {
            "namespace": self.rank.ns,
            "keys": [k],
            "groups": self.rank.specs(),
            "chunk_tokens": 16,
            "lease": False,
        }
        return self.r.ok("LOOKUP", body)["chunks"] == 1


@pytest.fixture
def tight_factory(inproc_factory, inraw, ranks):
    def make(*flags) -> Tight:
        d = inproc_factory(*flags, pool_mb=2)
        r = inraw(d)
        r.hello()
        rank = ranks(GEOM, num_blocks=64)
        r.ok("REGISTER", {"instance": "r", "layout": rank.layout()})
        return Tight(d, r, rank)

    return make


@pytest.fixture
def tight(tight_factory):
    return tight_factory()


# ---- against the daemon's objects ------------------------------------------------------------
def test_evictions_under_pressure_are_reported_with_their_keys_oldest_first(tight):
    t = tight
    start = t.evicted(since=-1)
    assert start["seq"] == 0 and start["keys"] == [] and not start["missed"]
    assert start["boot_id"] == t.d.status()["boot_id"]
    a = keys(t.cap)
    assert t.store(a) == ["stored"] * t.cap
    assert t.evicted()["keys"] == []  # nothing evicted yet
    b = keys(3)
    assert t.store(b) == ["stored"] * 3
    assert t.d.status()["evictions"] == 3
    gone = [k for k in a if not t.present(k)]
    reply = t.evicted(since=start["seq"])
    # the prefix's tail goes first (the first chunk of a STORE ends up most recent)
    assert reply["keys"] == [a[-1], a[-2], a[-3]] == gone[::-1]
    assert reply["seq"] == 3 and not reply["missed"]
    again = t.evicted(since=reply["seq"])
    assert again["keys"] == [] and again["seq"] == 3 and not again["missed"]
    st = t.d.status()
    assert st["eviction_log"] == {"capacity": 65536, "records": 3, "seq": 3, "dropped": 0}
    assert st["evicted_polls"] == 4 and st["evicted_keys"] == 3 and st["evicted_missed"] == 0


def test_each_chunk_is_recorded_once_however_many_of_its_objects_go(inproc_factory, inraw, ranks):
    """Two ranks' objects of each chunk go: one record per chunk. A chunk stored again and then
    evicted again is recorded again, and a reply names it once."""
    d = inproc_factory(pool_mb=2)
    r = inraw(d)
    r.hello()
    r0 = ranks(GEOM, num_blocks=64, world_size=2, rank=0, fingerprint="two-ranks")
    r1 = ranks(GEOM, num_blocks=64, world_size=2, rank=1, fingerprint="two-ranks")
    a = keys(3)
    for name, rank in (("r0", r0), ("r1", r1)):
        r.ok("REGISTER", {"instance": name, "layout": rank.layout()})
        chunks = [chunk(k, src(i)) for i, k in enumerate(a)]
        assert r.ok("STORE", {"instance": name, "chunks": chunks})["results"] == ["stored"] * 3
    assert r.ok("CLEAR", {})["evicted"] == 6
    first = r.ok("EVICTED", {"namespace": r0.ns})
    assert first["seq"] == 3 and sorted(first["keys"]) == sorted(a)
    # rank 1 stores a[0] again (rank 0's object of it is still gone), then it is cleared again
    assert r.ok("STORE", {"instance": "r1", "chunks": [chunk(a[0], src(0))]})["results"] == ["stored"]
    assert r.ok("CLEAR", {})["evicted"] == 1
    reply = r.ok("EVICTED", {"namespace": r0.ns})
    assert reply["seq"] == 4 and sorted(reply["keys"]) == sorted(a)  # a[0] once
    assert r.ok("EVICTED", {"namespace": r0.ns, "since": 3})["keys"] == [a[0]]


def test_clear_shows_up_for_its_namespace_only(tight, ranks):
    t = tight
    other = ranks(GEOM, num_blocks=64)
    t.r.ok("REGISTER", {"instance": "o", "layout": other.layout()})
    a, o = keys(2), keys(2)
    assert t.store(a) == ["stored"] * 2
    chunks = [chunk(k, src(i)) for i, k in enumerate(o)]
    assert t.r.ok("STORE", {"instance": "o", "chunks": chunks})["results"] == ["stored"] * 2
    assert t.r.ok("CLEAR", {"namespace": t.rank.ns})["evicted"] == 2
    assert sorted(t.evicted()["keys"]) == sorted(a)
    assert t.r.ok("EVICTED", {"namespace": other.ns})["keys"] == []  # its objects are all there
    assert t.r.ok("CLEAR", {})["evicted"] == 2
    reply = t.r.ok("EVICTED", {"namespace": other.ns})
    assert sorted(reply["keys"]) == sorted(o) and reply["seq"] == 4
    assert t.d.status()["evictions"] == 0  # CLEAR is not counted as evictions, but it is reported


def test_a_namespace_at_its_quota_reports_what_it_evicted_of_its_own(inproc_factory, inraw, ranks):
    d = inproc_factory("--namespace-quota-gb", f"{3 * OBJ / 2**30:.9f}", pool_mb=4)
    r = inraw(d)
    r.hello()
    rank = ranks(GEOM, num_blocks=64)
    r.ok("REGISTER", {"instance": "r", "layout": rank.layout()})
    a, b = keys(3), keys(2)
    for ks in (a, b):
        chunks = [chunk(k, src(i)) for i, k in enumerate(ks)]
        assert r.ok("STORE", {"instance": "r", "chunks": chunks})["results"] == ["stored"] * len(ks)
    assert d.status()["memory_used_bytes"] == 3 * OBJ  # the pool had room: the quota evicted
    assert r.ok("EVICTED", {"namespace": rank.ns})["keys"] == [a[2], a[1]]


def test_since_and_max_page_through_the_records(tight):
    t = tight
    a = keys(t.cap)
    t.store(a)
    t.r.ok("CLEAR", {})
    every = t.evicted()["keys"]
    assert sorted(every) == sorted(a)
    seen, since = [], 0
    for _ in range(t.cap):
        page = t.evicted(since=since, max=2)
        assert len(page["keys"]) == min(2, t.cap - len(seen))
        seen += page["keys"]
        since = page["seq"]
        if len(seen) == t.cap:
            break
    assert seen == every and since == t.cap
    assert t.evicted(since=since, max=2)["keys"] == []
    assert t.r.error("EVICTED", {"namespace": t.rank.ns, "max": 0}) == "BAD_REQUEST"
    assert t.r.error("EVICTED", {"namespace": t.rank.ns, "since": -2}) == "BAD_REQUEST"
    assert t.r.error("EVICTED", {"since": 0}) == "BAD_REQUEST"  # namespace is required


def test_a_ring_overflow_says_missed(tight_factory):
    t = tight_factory("--eviction-log", "2")
    a = keys(t.cap)
    t.store(a)
    t.r.ok("CLEAR", {})
    reply = t.evicted()
    assert reply["missed"] and len(reply["keys"]) == 2 and reply["seq"] == t.cap
    # a cursor no record after which fell out is not missed
    newer = t.evicted(since=t.cap - 2)
    assert not newer["missed"] and newer["keys"] == reply["keys"]
    st = t.d.status()
    assert st["eviction_log"] == {"capacity": 2, "records": 2, "seq": t.cap, "dropped": t.cap - 2}
    assert st["evicted_missed"] == 1


def test_no_eviction_log_says_missed_once_anything_was_evicted(tight_factory):
    t = tight_factory("--eviction-log", "0")
    first = t.evicted()
    assert not first["missed"] and first["seq"] == 0
    t.store(keys(2))
    t.r.ok("CLEAR", {})
    reply = t.evicted(since=first["seq"])
    assert reply["missed"] and reply["keys"] == [] and reply["seq"] == 2
    assert not t.evicted(since=reply["seq"])["missed"]


def test_a_cursor_from_another_boot_says_missed_and_restarts_the_cursor(tight_factory, inraw, ranks):
    t = tight_factory()
    a = keys(3)
    t.store(a)
    t.r.ok("CLEAR", {})
    old = t.evicted()
    assert old["seq"] == 3
    t.d.restart()
    r = inraw(t.d)
    r.hello()
    r.ok("REGISTER", {"instance": "r", "layout": t.rank.layout()})
    chunks = [chunk(k, src(i)) for i, k in enumerate(keys(1))]
    assert r.ok("STORE", {"instance": "r", "chunks": chunks})["results"] == ["stored"]
    assert r.ok("CLEAR", {})["evicted"] == 1
    new = r.ok("EVICTED", {"namespace": t.rank.ns, "since": old["seq"], "boot_id": old["boot_id"]})
    assert new["boot_id"] != old["boot_id"]
    # the old cursor (3) is past this boot's seq (1) and from another boot: read from this boot's start
    assert new["missed"] and new["seq"] == 1 and new["keys"] == [chunks[0]["key"]]
    # an old cursor below this boot's seq is caught by boot_id alone
    assert r.ok("EVICTED", {"namespace": t.rank.ns, "since": 1, "boot_id": old["boot_id"]})["missed"]
    assert not r.ok("EVICTED", {"namespace": t.rank.ns, "since": 1, "boot_id": new["boot_id"]})["missed"]
    # without boot_id, a cursor past this boot's seq is another boot's too
    assert r.ok("EVICTED", {"namespace": t.rank.ns, "since": 7})["missed"]


def test_a_partial_object_replaced_by_a_fuller_copy_is_not_reported(tight):
    t = tight
    k = keys(1)
    assert t.store(k, blocks=[0, NULL, NULL, NULL]) == ["stored"]
    assert t.store(k, blocks=[0, 1, 2, 3]) == ["stored"]  # replaces the partial copy
    assert t.d.status()["objects"] == 1
    assert t.present(k[0])
    reply = t.evicted()
    assert reply["keys"] == [] and reply["seq"] == 0
    # control: the same key does show up once it is really gone
    t.r.ok("CLEAR", {})
    assert t.evicted()["keys"] == k


def test_evicted_needs_a_session(inproc, inraw):
    r = inraw(inproc)
    ns = {"model": "m", "fingerprint": "f", "world_size": 1}
    assert r.error("EVICTED", {"namespace": ns}) == "UNKNOWN_SESSION"


# ---- the ring, pure -----------------------------------------------------------------------------
def test_the_ring_returns_each_namespaces_keys_oldest_first_and_pages():
    log = EvictionLog(100)
    for i in range(6):
        log.gone(b"A" if i % 2 == 0 else b"B", b"k%d" % i)
    assert log.seq == 6 and len(log) == 6 and log.oldest == 1
    assert log.since(b"A", 0, 10) == (6, [b"k0", b"k2", b"k4"], False)
    assert log.since(b"B", 0, 10) == (6, [b"k1", b"k3", b"k5"], False)
    assert log.since(b"A", 0, 2) == (3, [b"k0", b"k2"], False)  # the cursor: the last seq returned
    assert log.since(b"A", 3, 2) == (6, [b"k4"], False)
    assert log.since(b"A", 5, 2) == (6, [], False)
    assert log.since(b"C", 0, 10) == (6, [], False)


def test_the_ring_records_a_chunk_once_until_it_is_committed_again():
    log = EvictionLog(100)
    log.gone(b"A", b"k")
    log.gone(b"A", b"k")  # another object of the same chunk
    assert log.seq == 1
    log.back(b"A", b"k")  # stored again
    log.gone(b"A", b"k")
    assert log.seq == 2
    assert log.since(b"A", 0, 10) == (2, [b"k"], False)  # once per reply
    assert log.since(b"A", 1, 10) == (2, [b"k"], False)


def test_the_ring_says_missed_when_records_fell_out():
    log = EvictionLog(3)
    for i in range(5):
        log.gone(b"A", b"k%d" % i)
    assert log.dropped == 2 and len(log) == 3 and log.oldest == 3
    assert log.since(b"A", 0, 10) == (5, [b"k2", b"k3", b"k4"], True)
    assert log.since(b"A", 1, 10)[2] is True
    assert log.since(b"A", 2, 10) == (5, [b"k2", b"k3", b"k4"], False)
    # B's records push A's out: A's reader is told, B's is not
    for i in range(3):
        log.gone(b"B", b"b%d" % i)
    assert log.since(b"B", 0, 10) == (8, [b"b0", b"b1", b"b2"], False)
    assert log.since(b"A", 5, 10) == (8, [], False)  # A's cursor was past all of them
    assert log.since(b"A", 4, 10) == (8, [], True)  # k4 (seq 5) fell out unread
    # a namespace forgotten is over-reported for any cursor older than what was forgotten
    assert log.since(b"C", 4, 10)[2] is True and log.since(b"C", 5, 10)[2] is False


def test_a_ring_of_capacity_zero_only_counts():
    log = EvictionLog(0)
    log.gone(b"A", b"k0")
    log.gone(b"A", b"k1")
    assert log.seq == 2 and len(log) == 0
    assert log.since(b"A", 0, 10) == (2, [], True)
    assert log.since(b"A", 2, 10) == (2, [], False)


def test_the_ring_stays_bounded_and_compacts():
    log = EvictionLog(1000)
    for i in range(100_000):
        log.gone(bytes([i % 7]), i.to_bytes(8, "little"))
    assert len(log) == 1000 and log.dropped == 99_000
    assert sum(len(s.seqs) for s in log._spaces.values()) <= 2 * 1000 + 7 * 64
    assert len(log._open) == 1000
    seq, got, missed = log.since(bytes([3]), log.seq - 70, 10_000)
    assert missed is False and len(got) == 10 and seq == log.seq


# ---- the pool's hooks, pure ---------------------------------------------------------------------
NS = b"namespace-0"


@pytest.fixture
def pool():
    p = Pool(ceiling=1 << 20, initial=0, align=4096, segment_bytes=1 << 20, eviction_log=100)
    yield p
    p.close()


def _put(pool, key, mask=0b1111, commit=True, nbytes=64 << 10):
    obj = pool.begin_write(NS, key, {0: (0, 0)}, 0, nbytes, mask, "g0")
    assert obj is not None and obj is not EXISTS
    if commit:
        pool.commit([obj])
    return obj


def test_pool_eviction_and_clear_are_recorded_aborted_fresh_writes_are_not(pool):
    for i in range(16):  # 16 x 64 KiB fills the 1 MiB pool
        _put(pool, b"key-%02d" % i)
    assert pool.evlog.seq == 0
    _put(pool, b"key-new")  # evicts the least recent: key-00
    assert pool.evlog.since(NS, 0, 10)[1] == [b"key-00"]
    pool.abort([_put(pool, b"key-aborted", commit=False)])  # evicts key-01; the aborted write is no loss
    assert pool.evlog.since(NS, 0, 10)[1] == [b"key-00", b"key-01"]
    assert pool.clear(NS) == 15
    assert len(pool.evlog.since(NS, 0, 100)[1]) == 17


def test_pool_replacement_is_recorded_only_when_the_fuller_write_is_discarded(pool):
    _put(pool, b"a", mask=0b0001)
    _put(pool, b"a", mask=0b1111)  # replaced, committed: no loss
    assert pool.evlog.seq == 0
    _put(pool, b"b", mask=0b0001)
    pool.abort([_put(pool, b"b", mask=0b1111, commit=False)])  # the partial copy went with it
    assert pool.evlog.since(NS, 0, 10)[1] == [b"b"]
    assert not pool._replacing
