"""The client's fast path (tierd_client.transport): a blocking call is sent and its reply read on
the calling thread; a claim nobody waits on is handed to the I/O thread; threads that call at once,
blocking and not, each get their own answer. Real daemon, real sockets."""

import gc
import signal
import sys
import threading
import time

import pytest
import zmq
from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures
from wire import wait_for

from tierd_client import TierdError, fast_path, transport
from tierd_client.fast_path import FAST_WAIT_S
from tierd_client.futures import polled
from tierd_client.pending import decode_reply


def _resolved_on(fut) -> list[int]:
    seen: list[int] = []
    fut.add_done_callback(lambda _f: seen.append(threading.get_ident()))
    return seen


def test_blocking_call_reads_its_reply_on_the_calling_thread(daemon, client_factory):
    c = client_factory(daemon)
    c.ping()
    io_thread = c.transport.thread.ident
    me = threading.get_ident()
    on = []
    for _ in range(50):
        fut = c.call_async("PING", {}, wait=True)
        seen = _resolved_on(fut)
        assert fut.result(timeout=5).time > 0
        on += seen
    # Many of them. The I/O thread still reads some: a call slower than its 5 ms claim (a loaded
    # machine), or one the I/O thread reaches first when it wakes for its own reasons. Without
    # the caller reading its own reply, none.
    assert on.count(me) >= 10 and set(on) <= {me, io_thread}
    fut = c.call_async("PING", {})  # not claimed, and nobody in result(): the I/O thread reads it
    seen = _resolved_on(fut)
    deadline = time.monotonic() + 5
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert seen == [io_thread]


def test_claimed_request_nobody_waits_on_is_answered_by_the_io_thread(daemon, client_factory):
    c = client_factory(daemon)  # calls time out after 10 s: the answer must come long before
    c.ping()
    for _ in range(5):
        fut = c.call_async("PING", {}, wait=True)  # claimed, but result() is never called
        deadline = time.monotonic() + 2
        while not fut.done() and time.monotonic() < deadline:
            time.sleep(FAST_WAIT_S / 5)
        assert fut.done()
        assert fut.result(timeout=0).time > 0


def test_threads_calling_at_once_each_get_their_own_answer(daemon, client_factory, ranks):
    c = client_factory(daemon)
    rank = ranks(GroupGeom("full"))
    c.register("r", rank.layout())
    ks = keys(8)
    assert (
        c.store("r", [chunk(k, range(4 * j, 4 * j + 4)) for j, k in enumerate(ks)]).results == ["stored"] * 8
    )
    errors: list[str] = []

    def worker(n: int) -> None:
        # prefix of n stored keys then an unknown one: the answer says n, and only this thread's
        probe = ks[:n] + keys(1)
        for i in range(150):
            blocking = i % 3 != 0
            if blocking:
                got = c.lookup(rank.ns, probe, rank.specs(), 16, lease=False).chunks
            else:
                got = c.lookup_async(rank.ns, probe, rank.specs(), 16, lease=False).result(5).chunks
            if got != n:
                errors.append(f"thread {n} call {i}: {got}")
                return

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    assert c.ping().time > 0


def test_a_caller_that_stops_waiting_hands_its_own_request_back_to_the_io_thread(
    daemon, client_factory, ranks
):
    """A caller whose wait runs out before its reply (here: after reading someone else's reply)
    gives up its own claim, not the other request's, so the I/O thread reads its reply at once.
    The slow request is a 64 MiB STORE (its reply follows the copy); the other a PING sent after
    it, which the daemon answers meanwhile."""
    c = client_factory(daemon)
    rank = ranks(GroupGeom("full", layers=8, block_bytes=1 << 20), num_blocks=16)
    c.register("big", rank.layout())
    checked = 0
    for _ in range(5):
        chunks = [chunk(k, range(4 * j, 4 * j + 4)) for j, k in enumerate(keys(2))]
        slow = c.store_async("big", chunks, wait=True)
        other = c.call_async("PING", {}, wait=True)  # claimed, nobody waits on it
        try:
            slow.result(timeout=FAST_WAIT_S / 2)  # reads ``other``'s reply, then gives up
        except TimeoutError:
            assert slow.pending.claimed_until == 0.0, "the caller gave up another request's claim"
            checked += 1
        assert slow.result(timeout=10).results == ["stored", "stored"]
        assert other.result(timeout=10).time > 0
    assert checked, "every STORE was answered within the wait: nothing was checked"


def test_a_caller_whose_error_reply_another_caller_read_hands_it_on_at_once(
    daemon, client_factory, monkeypatch
):
    """Another caller read this request's error reply and left it for the I/O thread (which may
    retry errors): the waiting caller hands it on at once instead of waiting out its read of the
    socket. Claims and waits are stretched to 6 s, so waiting them out shows above a loaded machine's
    stalls. The daemon is held (SIGSTOP) until this test owns the socket: on a loaded machine the
    reply otherwise came back while the sending thread still drained the socket, every time."""
    monkeypatch.setattr(fast_path, "FAST_WAIT_S", 6.0)
    c = client_factory(daemon)
    c.ping()
    checked = 0
    for _ in range(5):
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            fut = c.call_async("RELEASE", {"lease": 987654321}, wait=True)  # answered UNKNOWN_LEASE
            time.sleep(0.2)  # sent (by this thread or the I/O thread); no answer can come yet
            # as another pumping caller: read the reply and stash it for the I/O thread
            with c.transport.lock:
                daemon.proc.send_signal(signal.SIGCONT)
                if fut.done() or not c.transport.sock.poll(5000, zmq.POLLIN):
                    continue  # the I/O thread read it first: try again
                c.transport.stash.append(decode_reply(c.transport.sock.recv()))
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        t0 = time.monotonic()
        with pytest.raises(TierdError, match="UNKNOWN_LEASE"):
            fut.result(timeout=10)
        assert time.monotonic() - t0 < 3.0, "the caller waited out its read with its reply in the stash"
        checked += 1
    assert checked


def test_a_caller_sends_on_its_own_thread_while_the_io_thread_takes_its_turns(daemon, client_factory):
    """Back-to-back blocking calls: a caller that finds the I/O thread holding the lock (a tick, a
    claim's end) waits out its brief turn and sends on its own thread, rather than queueing the
    request for the I/O thread. Before, one call in five went through the outbox and a thread
    switch, each such wake-up making the next call meet the lock again (~280 turns a second of the
    I/O thread's loop instead of ~20 ticks)."""
    c = client_factory(daemon)
    c.ping()
    turns, queued = [], []
    watch, outbox = c.transport.watch_socket, c.transport.outbox
    c.transport.watch_socket = lambda: (turns.append(1), watch())[1]  # once a turn of the I/O thread's loop

    class Counted:  # the outbox, counting what callers leave to the I/O thread
        def put(self, p):
            queued.append(p.op)
            outbox.put(p)

        def __getattr__(self, name):
            return getattr(outbox, name)

    c.transport.outbox = Counted()
    t0 = time.monotonic()
    calls = 0
    while time.monotonic() - t0 < 1.0:
        assert c.ping().time > 0
        calls += 1
    elapsed = time.monotonic() - t0
    ticks = elapsed / (transport.TICK_MS / 1000)
    assert calls > 200  # (the loop did run calls back to back)
    # a claim that runs out before its caller reads (a loaded 2-core machine: 31 turns in 1 s seen)
    # wakes the I/O thread now and then; the fault this guards against took ~280 turns a second
    assert len(turns) <= 2 * ticks + 10, (len(turns), ticks, calls)
    assert len(queued) <= calls // 50, (queued[:5], calls)


def test_an_answered_request_leaves_nothing_for_the_cyclic_gc(daemon, client_factory):
    """A request and its Reply refer to each other until it is answered; then the Reply lets go, so
    reference counting frees both. Before, every request stayed behind as a cycle (with its body:
    a LOOKUP's 2048 keys) for Python's cyclic GC, whose collections then took ~1 ms every ~50
    LOOKUPs on the engine's scheduler thread."""
    c = client_factory(daemon)
    c.ping()
    gc.collect()
    gc.disable()
    try:
        for _ in range(100):
            assert c.ping().time > 0  # read on this thread
        for _ in range(100):
            fut = c.call_async("PING", {})  # read by the I/O thread
            assert fut.result(timeout=5).time > 0
        del fut
        time.sleep(0.2)  # the I/O thread's own turn ends
        found = gc.collect()
    finally:
        gc.enable()
    assert found < 20, found


@pytest.mark.parametrize("op", ["STATUS", "PING"])  # the DEALER's reply, and the lookup channel's
def test_a_thread_polling_its_request_sees_the_reply_without_waiting_out_the_gil_switch_interval(
    daemon, client_factory, op
):
    """An engine's step loop polls whether a load came back and runs Python between polls, holding
    the interpreter's lock: the I/O thread that would read the reply waits for it up to the switch
    interval (5 ms by default) each time, and may hold the transport's lock meanwhile. A poll reads
    what the sockets hold on the polling thread, and lets an I/O thread holding the transport's
    lock finish its turn. Here the interval is 2 s and each round's loop gives up after 1 s."""
    c = client_factory(daemon)
    if op == "PING":
        wait_for(lambda: c.transport.channel.sock is not None, 5, what="the client's lookup channel")
    c.ping()
    c.call(op, {})
    interval = sys.getswitchinterval()
    slow = []
    for _ in range(20):  # the I/O thread holding the transport's lock was a race: about 1 round in 13
        sys.setswitchinterval(2.0)
        try:
            fut = c.call_async(op, {})  # not claimed: nobody waits in result()
            sent = fut.pending
            t0 = time.perf_counter()
            while not polled(fut) and time.perf_counter() - t0 < 1.0:
                pass
            elapsed = time.perf_counter() - t0
        finally:
            sys.setswitchinterval(interval)
        if not fut.done():
            slow.append(round(elapsed, 3))
        assert fut.result(timeout=10) is not None
        assert sent.channel == (op == "PING")  # (each path the one meant)
    assert not slow, slow
