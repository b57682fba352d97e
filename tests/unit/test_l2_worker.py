"""The L2 deadline worker and buffer table, with real blocking calls (threads, events) and no Mooncake.

What is pinned: a call answers by its deadline even while it is still running; its memory is free
only when ``finished`` resolves; calls queued behind a stuck one are dropped unstarted once their
deadline passes; nothing raised inside a call escapes; buffer ranges outside what was registered
are refused.
"""

import os
import threading
import time

import pytest

from tierd.tier2.buffers import Buffers
from tierd.tier2.worker import DeadlineWorker, Op


@pytest.fixture
def worker():
    w = DeadlineWorker("test")
    yield w
    w.close(2.0)


def op(kind="get", timeout=1.0, nbytes=0):
    return Op(kind, nbytes, time.monotonic() + timeout)


def test_a_call_in_time_gets_its_value_and_finished_resolves_first(worker):
    seen = []
    o = op()
    o.done.add_done_callback(lambda _: seen.append(o.finished.done()))
    worker.submit(o, lambda: [True, False], [False, False])
    assert o.result(2) == [True, False] and not o.timed_out
    assert seen == [True]


def test_a_stuck_call_answers_by_its_deadline_and_holds_its_memory_until_it_returns(worker):
    release = threading.Event()
    timeouts = []
    o = op(timeout=0.2)
    t0 = time.monotonic()
    worker.submit(o, lambda: release.wait(10) and [True], [False], on_timeout=timeouts.append)
    assert o.result(2) == [False]
    assert 0.18 < time.monotonic() - t0 < 0.6
    assert o.timed_out and timeouts == [o] and not o.finished.done()
    assert worker.backlog()[0] == 1 and worker.backlog()[2] > 0.15 and not worker.idle
    release.set()
    o.finished.result(2)
    assert o.result() == [False]  # the late value never replaces the answer given
    time.sleep(0.05)
    assert worker.idle


def test_calls_queued_behind_a_stuck_one_are_dropped_unstarted_past_their_deadline(worker):
    release = threading.Event()
    started = []
    first = worker.submit(op(timeout=0.1), lambda: release.wait(10), None)
    second = worker.submit(op(timeout=0.2, nbytes=4096), lambda: started.append(1) or "ran", "dropped")
    assert worker.backlog()[:2] == (2, 4096)
    assert second.result(2) == "dropped" and second.timed_out
    release.set()
    first.finished.result(2)
    second.finished.result(2)
    assert started == []


def test_an_exception_inside_a_call_becomes_the_fallback_and_the_worker_goes_on(worker):
    bad = worker.submit(op(), lambda: 1 / 0, "fallback")
    good = worker.submit(op(), lambda: "next", None)
    assert bad.result(2) == "fallback" and good.result(2) == "next"


def test_periodic_callbacks_run_on_the_clock(worker):
    ticks = []
    worker.every(0.05, lambda: ticks.append(time.monotonic()))
    time.sleep(0.4)
    assert len(ticks) >= 4


def test_close_answers_what_is_queued_and_reports_a_stuck_worker():
    w = DeadlineWorker("test")
    release, running = threading.Event(), threading.Event()
    stuck = w.submit(op(timeout=30), lambda: running.set() or release.wait(10), "closed")
    queued = w.submit(op(timeout=30), lambda: "ran", "closed")
    assert running.wait(2)
    assert w.close(0.2) is False
    assert stuck.result(1) == "closed" and queued.result(1) == "closed"
    late = w.submit(op(), lambda: "ran", "closed")
    assert late.result(1) == "closed"
    release.set()


def test_answered_ops_are_resolved_both_ways():
    o = Op.answered("put", [False, False])
    assert o.done.result(0) == [False, False] and o.finished.done() and not o.timed_out


def test_buffers_place_ranges_and_refuse_what_is_outside():
    fd = os.memfd_create("t")
    try:
        b = Buffers()
        a = b.add(0x10000, 4096, fd)
        c = b.add(0x20000, 8192, fd, offset=4096)
        assert b.place([0x10000, 0x10800, 0x21000], [4096, 2048, 4096]) == (
            [a.ident, a.ident, c.ident],
            [0, 0x800, 0x1000],
        )
        for addr, size in ((0x10000, 4097), (0x0F000, 16), (0x30000, 1), (0x10000, 0), (0x20000 + 8192, 1)):
            with pytest.raises(ValueError, match="not inside a registered buffer"):
                b.place([addr], [size])
        with pytest.raises(ValueError, match="overlaps"):
            b.add(0x10800, 4096, fd)
        with pytest.raises(ValueError, match="overlaps"):
            b.add(0x1F000, 8192, fd)
        assert b.totals() == (2, 12288)
        gone = b.remove(0x10000)
        os.close(gone.fd)
        with pytest.raises(ValueError, match="not inside"):
            b.place([0x10000], [1])
        b.close()
        assert b.totals() == (0, 0)
    finally:
        os.close(fd)
