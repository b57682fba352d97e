"""What LOOKUP reads, without a daemon: the index's per-part columns ((group, rank) -> column ->
key -> committed object, the column saying whether the object is whole) hold exactly the committed
objects through every way an object comes and goes (commit, abort, eviction, replacement by a
fuller copy, CLEAR), a LOOKUP over them answers what the fold over the chunk entries (every object
read and checked) answers, and a LOOKUP's LRU touch, left for after its reply, is applied by the
daemon's loop when no request waits (a part at a time while one does) and before anybody else
takes the pool's lock: eviction order is what it was with the touch applied at once."""

import random
import threading
import time

import pytest
import zmq
from test_pool import FULL, KIB, key, pool  # noqa: F401 - pool: fixture

from tierd.pool import fold
from tierd.pool.index import Span, column_of
from tierd.pool.pool import EXISTS, Pool
from tierd.protocol.layout import GroupKind, GroupSpec
from tierd.state.registry import OWN_PEER


def derived_columns(pool: Pool) -> dict:
    """The columns as the chunk entries say they must be: every committed object, by part and by
    whether it holds every block of its group there (its span's block count, else 0)."""
    out: dict = {}
    for ns, space in pool.index.spaces.items():
        for k, entry in space.items():
            for part, obj in entry.items():
                if obj.ready:
                    column = column_of(obj.span, part[0], obj.mask)
                    if column:
                        assert (obj.mask >> obj.span[part[0]][0]) & 0b1111 == 0b1111
                    out.setdefault(ns, {}).setdefault(part, {}).setdefault(column, {})[k] = obj
    return out


SLIDE = GroupSpec(GroupKind.SLIDING, 4, 8)  # a window of 8 tokens: two 4-token blocks
LOOKUPS = [  # (groups, chunk tokens): 16-token chunks read whole columns, 4-token ones check each object
    ([FULL, FULL], 16),
    ([FULL, FULL], 4),
    ([FULL, SLIDE], 16),
    ([SLIDE, GroupSpec(GroupKind.STATE, 16)], 16),
]


def test_columns_hold_exactly_the_committed_objects_through_random_churn(pool):
    rnd = random.Random(20261201)
    namespaces = [b"ns-a", b"ns-b"]
    writing: list = []
    checked = committed = lookups = 0
    for step in range(3000):
        op = rnd.random()
        ns = rnd.choice(namespaces)
        if op < 0.45:  # a STORE: one object per group of a rank, or one spanning both groups
            i, rank = rnd.randrange(12), rnd.randrange(2)
            if rnd.random() < 0.4:  # as a plan's Geometry passes them (4 blocks a group), or plain dicts
                spans = [Span({0: (0, 0), 1: (4, 4 * KIB)}, {0: 4, 1: 4})]
            else:
                spans = [Span({0: (0, 0)}, {0: 4}), Span({1: (0, 0)}, {1: 4})]
            if rnd.random() < 0.2:
                spans = [dict(span) for span in spans]
            for span in spans:
                nbits = 4 * len(span)
                mask = (1 << nbits) - 1 if rnd.random() < 0.7 else rnd.getrandbits(nbits) | 1
                obj = pool.begin_write(ns, key(i), span, rank, 16 * KIB * len(span), mask, "g")
                if obj is not None and obj is not EXISTS:
                    writing.append(obj)
        elif op < 0.75 and writing:  # its copy lands, or fails
            obj = writing.pop(rnd.randrange(len(writing)))
            if rnd.random() < 0.8:
                pool.commit([obj])
                committed += 1
            else:
                pool.abort([obj])
        elif op < 0.9:
            first = rnd.randrange(12)
            keys = [key(j) for j in range(first, first + rnd.randrange(1, 8))]
            specs, chunk = rnd.choice(LOOKUPS)
            ranks = rnd.choice([[0, 1], [0], [1]])
            got = pool.lookup(ns, keys, specs, chunk, ranks)
            with pool.lock:
                space = pool.index.spaces.get(ns, {})
                want = fold.lookup(space, keys, specs, chunk, ranks) if space else (0, [])
            assert got == want, step
            lookups += bool(got[0])
        elif op < 0.97:
            coldest = pool.coldest(64 * KIB)
            with pool.lock:
                for obj in coldest[:2]:
                    if not obj.pins:
                        pool._evict(obj)
        else:
            pool.clear(ns)
        with pool.lock:
            assert pool.index.columns == derived_columns(pool), step
        checked += 1
    assert committed > 500 and pool.evictions > 0 and lookups > 10  # the churn did what it says
    wholes = {c for ns in pool.index.columns.values() for part in ns.values() for c in part}
    assert wholes == {0, 4}, wholes  # both kinds of column took part


def test_a_lookups_touch_is_applied_before_the_lru_is_read(pool):
    """16 chunks fill the pool; a LOOKUP of the first 4 makes them the most recent, so pressure
    takes chunks 4.. first, as when the touch was applied inside the LOOKUP."""
    objs = [pool.begin_write(b"ns", key(i), {0: (0, 0)}, 0, 64 * KIB, 0b1111, "g0") for i in range(16)]
    pool.commit(objs)  # the last one given ends up least recent: key(15) first
    hit, got = pool.lookup(b"ns", [key(i) for i in range(4)], [FULL], 16, [0])
    assert hit == 4 and got == objs[:4]
    assert pool._untouched == [objs[:4]]  # left for after the reply
    order = pool.coldest(16 * 64 * KIB)
    assert order == objs[4:][::-1] + objs[:4][::-1]  # the LOOKUP's prefix, head most recent
    assert pool._untouched == []
    pool.lookup(b"ns", [key(i) for i in range(4, 6)], [FULL], 16, [0])
    pool.settle()  # what the daemon calls once the reply is sent
    assert pool._untouched == []
    assert pool.coldest(16 * 64 * KIB)[-2:] == [objs[5], objs[4]]


def test_a_touch_that_fails_leaves_the_pool_lock_free(pool, monkeypatch):
    obj = pool.begin_write(b"ns", key(0), {0: (0, 0)}, 0, 64 * KIB, 0b1111, "g0")
    pool.commit([obj])
    pool.lookup(b"ns", [key(0)], [FULL], 16, [0])

    def broken(objs, **_):
        raise RuntimeError("touch broke")

    monkeypatch.setattr(pool, "touch_objects", broken)
    with pytest.raises(RuntimeError, match="touch broke"):
        with pool.lock:
            pass
    acquired = threading.Event()

    def take():
        with pool.lock:
            acquired.set()

    t = threading.Thread(target=take, daemon=True)
    t.start()
    t.join(5)
    assert acquired.is_set()  # not left held by the failed acquire


def test_a_touch_of_an_object_gone_meanwhile_touches_the_rest(pool):
    objs = [pool.begin_write(b"ns", key(i), {0: (0, 0)}, 0, 64 * KIB, 0b1111, "g0") for i in range(3)]
    pool.commit(objs)
    pool.lookup(b"ns", [key(i) for i in range(3)], [FULL], 16, [0])
    pool._evict(objs[1])  # as only code bypassing the lock could
    assert pool.coldest(3 * 64 * KIB) == [objs[2], objs[0]]


@pytest.fixture
def stored(tmp_path):
    """An in-process Daemon (real handlers and pool) with one session and four committed chunks,
    the last one least recent; its ``replies.send`` records each reply and what was pending then."""
    from tierd.base.config import Settings
    from tierd.core import handlers
    from tierd.core.handlers import Call
    from tierd.daemon.server import Daemon
    from tierd.protocol import codec, messages
    from tierd_client.layouts import block_span, group, layout, namespace
    from tierd_client.shm import SharedBuffer

    d = Daemon(Settings(socket=f"ipc://{tmp_path}/t.sock", http_port=-1, l1_size_gb=0.0625))
    buf = SharedBuffer(8 * 4096)
    try:
        ns = namespace("m", "columns")
        spans = [block_span((8, 4096), (4096, 1), 1, 0, tensor=0, offset=0)]
        lay = layout(ns, 0, 16, [buf.ref()], [group("full", 16, spans)])
        ident = b"c" * 16
        handlers.hello(d.tier, Call(ident, None, [ident], 1, 0.0), messages.Hello(1))
        call = Call(ident, d.registry.session(ident), [ident], 2, 0.0)
        handlers.register(d.tier, call, messages.convert({"instance": "r", "layout": lay}, messages.Register))
        keys = [key(i) for i in range(4)]
        chunks = [{"key": k, "blocks": [[i]]} for i, k in enumerate(keys)]
        job = handlers.store(
            d.tier, call, messages.convert({"instance": "r", "chunks": chunks}, messages.Store)
        )
        d.pool.commit(job.plan.objs)
        sent: list = []

        def send(envelope, frame):
            pool = d.pool
            pins = [o.pins for o in job.plan.objs]
            sent.append((codec.decode_reply(frame, 1 << 20), list(pool._untouched), pins))

        d.replies.send = send

        def lookup(n: int, lease: bool) -> None:
            specs = [{"kind": "full", "block_tokens": 16, "window_tokens": 0}]
            body = {"namespace": ns, "keys": keys[:n], "groups": specs, "chunk_tokens": 16, "lease": lease}
            d._on_request(codec.encode_request("LOOKUP", 7, body), [ident], OWN_PEER, time.perf_counter())

        yield d, job.plan.objs, keys, lookup, sent
    finally:
        d.close()
        buf.close()


def waiting(d) -> zmq.Poller:
    """A poller over the daemon's ROUTER with a request waiting on it."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(d.settings.socket)
    sock.send(b"waiting")
    poller = zmq.Poller()
    poller.register(d.router.fd, zmq.POLLIN)
    deadline = time.monotonic() + 5
    while not poller.poll(10) and time.monotonic() < deadline:
        pass
    return poller


def test_the_daemon_applies_a_lookups_touch_after_its_reply_while_no_request_waits(stored):
    """The reply goes out and the next request is taken without waiting for the touch; the loop
    applies it when nothing waits, a part at a time while something does."""
    d, objs, keys, lookup, sent = stored
    lookup(2, lease=False)
    (req_id, ok, body), untouched_at_send, _ = sent[0]
    assert (req_id, ok, body["chunks"]) == (7, True, 2), sent
    assert untouched_at_send == [objs[:2]]  # the reply did not wait for the touch
    assert d.pool._untouched == [objs[:2]]  # ... nor does the next request
    lookup(3, lease=False)
    assert d.pool.unsettled == (2 + 2) + (3 + 3)  # per LOOKUP: objects to touch, keys to observe
    d.settings.lookup_settle_objects = 1
    d._settle(waiting(d))  # a request waits: one part, then back to the loop
    assert d.pool.unsettled == 9 and objs[1].tick > objs[0].tick  # the first LOOKUP's tail, alone
    d._settle(zmq.Poller())  # nothing waits: all of it
    assert d.pool.unsettled == 0 and d.pool._untouched == []
    order = [o.key for o in sorted(objs, key=lambda o: o.tick)]
    assert order == [keys[3], keys[2], keys[1], keys[0]]  # the looked-up head most recent


def test_the_daemon_applies_a_leases_pins_after_its_reply_before_anything_evicts(stored):
    """A LOOKUP's lease: the reply does not wait for its pins, which the loop applies when idle and
    the pool's lock applies first whoever takes it; the lease's objects then outlive a CLEAR, and
    its RELEASE frees them."""
    d, objs, keys, lookup, sent = stored
    lookup(3, lease=True)
    (req_id, ok, body), _, pins_at_send = sent[0]
    assert ok and body["chunks"] == 3 and body["lease"] > 0
    assert pins_at_send == [0, 0, 0, 0]  # the reply went first
    assert [o.pins for o in objs] == [0, 0, 0, 0]  # and the loop has not settled yet
    assert d.pool.clear() == 1 and [o.key for o in objs if o.ready] == keys[:3]  # CLEAR applied them first
    assert [o.pins for o in objs] == [1, 1, 1, 0] and [o.leases for o in objs] == [1, 1, 1, 0]
    assert d.registry.leased_bytes[""] == sum(o.nbytes for o in objs[:3])
    assert d.registry.release(body["lease"])
    assert [o.pins for o in objs[:3]] == [0, 0, 0] and not d.registry.leased_bytes


def test_whole_objects_are_served_from_their_column_and_partial_ones_are_checked(pool):
    """Objects of a Span with block counts go to their part's whole column (4: every block of the
    chunk) or the partial one (0); LOOKUP serves the whole ones as complete and checks the rest
    block by block, as it checks objects of a plain span dict (never whole)."""
    whole, plain = Span({0: (0, 0)}, {0: 4}), {0: (0, 0)}
    masks = [(whole, 0b1111), (whole, 0b1111), (plain, 0b1111), (whole, 0b0111), (whole, 0b1111)]
    objs = [pool.begin_write(b"ns", key(i), sp, 0, 4 * KIB, m, "g0") for i, (sp, m) in enumerate(masks)]
    pool.commit(objs)
    part = pool.index.columns[b"ns"][0, 0]
    assert {c: sorted(col) for c, col in part.items()} == {4: [key(0), key(1), key(4)], 0: [key(2), key(3)]}
    keys = [key(i) for i in range(5)]
    assert pool.lookup(b"ns", keys, [FULL], 16, [0]) == (3, objs[:3])  # key 3 lacks block 3
    # a sliding window of the last 8 tokens needs blocks 2-3 of the last chunk (key 4) only
    assert pool.lookup(b"ns", keys, [GroupSpec(GroupKind.SLIDING, 4, 8)], 16, [0]) == (5, [objs[4]])
    # 4-token chunks (one block a chunk): no whole column of 1 block, every object is checked
    assert pool.lookup(b"ns", keys, [FULL], 4, [0]) == (5, objs)
    pool.settle()
