"""The client's transport work done on the caller's thread (docs/protocol.md section 14): the
caller's own thread does the socket work where it can, two thread hand-offs less per call.
Whoever holds the transport's ``lock`` owns the socket, and the I/O thread polls the socket's
notification descriptor, not the socket, so it never touches it without the lock.
- A request with nothing queued ahead of it is sent by the thread that makes it (``send_now``).
- A thread waiting on a reply's ``result()`` reads the socket itself for up to FAST_WAIT_S
  (``pump``); a success for its own request resolves there. Every other reply it reads (and its
  own errors, which may be retried) goes to the I/O thread, so callbacks and retries still run
  only there. Past FAST_WAIT_S it waits for the I/O thread like any other caller.
- A thread that polls a reply's future (``poll``: an engine's step loop asking whether a load
  came back) reads what the socket holds at that moment the same way, never waiting.
- A request made to be waited for at once (``wait=True``: ``call()``, the verbs' blocking forms)
  is *claimed* for FAST_WAIT_S (``Transport.request``): while every request in flight is claimed,
  the I/O thread does not watch the socket at all, so a reply wakes only the thread waiting for
  it. A claim that runs out (its caller never waited) hands the request to the I/O thread.
- ZeroMQ's descriptor is edge-triggered: whoever sent or read drains the socket to EAGAIN, or
  wakes the I/O thread, before letting the lock go.

The fast path has no state of its own (it is the transport's socket, lock, queues and requests in
flight, used on another thread), so it is functions handed the tierd_client.transport.Transport
explicitly, kept in a module of their own only for the transport module's size.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future

import zmq

from tierd_client import wire
from tierd_client.pending import Pending, decode_reply

FAST_WAIT_S = 0.005  # a caller reads the socket for its own reply this long before the I/O thread does
SEND_WAIT_S = 0.001  # a caller waits this long for the lock to send on its own thread
POLL_WAIT_S = 0.0002  # a poll waits this long for the lock (``poll``)
# plain ints: pyzmq's enum flags make each ``EVENTS & POLLIN`` test a Python-level __and__
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def send_now(t, p: Pending) -> bool:
    """Send ``p`` on this thread through transport ``t`` if the socket is free and connected and
    nothing is queued ahead of it (the order of one thread's requests is kept); else (False) the
    I/O thread sends it."""
    if not t.connected:
        return False
    # the I/O thread holds the lock for microseconds a turn: worth a short wait, as the other
    # way (the outbox, then waking that thread) costs a thread switch
    lock = t.lock
    if threading.current_thread() is t.thread:
        if not lock.acquire(blocking=False):
            return False
    elif not lock.acquire(timeout=SEND_WAIT_S):
        return False
    try:
        sock = t.sock
        ahead = t.waiting or t.front or not t.outbox.empty()
        if sock is None or not t.connected or ahead:
            return False
        req_id = next(t.ids)
        frame = wire.encode_request(p.op, req_id, p.body)
        if not t.channel.send(p, frame):
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                return False
        t.pending[req_id] = p
        if not p.channel and sock.getsockopt(_EVENTS) & _POLLIN:
            t.wake()  # the send took in a reply: the descriptor will not say so again
        elif not t.watching and p.claimed_until <= time.monotonic():
            t.wake()  # nobody would read its reply: the I/O thread watches the socket again
        return True
    finally:
        lock.release()


def pump(t, fut: Future, limit: float | None) -> None:
    """Read transport ``t``'s sockets on this thread until ``fut`` (a request's own future) is
    resolved, for at most FAST_WAIT_S (and ``limit``). Only a success of ``fut``'s own request
    resolves here."""
    wait = FAST_WAIT_S if limit is None else min(FAST_WAIT_S, limit)
    if wait > 0:
        _read_own(t, fut, wait)


def poll(t, fut: Future) -> None:
    """Read what transport ``t``'s sockets hold now on this thread, without waiting: a success of
    ``fut``'s own request resolves here, every other reply goes to the I/O thread. For a thread that
    polls a future again and again and holds the interpreter's lock between polls (an engine's step
    loop): its reply is then not left waiting for the I/O thread's turn at that lock, up to the
    interpreter's switch interval (5 ms by default). Claims are left as they are (no one waits)."""
    _read_own(t, fut, 0.0)


def _read_own(t, fut: Future, wait: float) -> None:
    """``pump`` (``wait`` > 0: ``fut``'s request claimed until then) or ``poll`` (0)."""
    claim = wait > 0
    end = time.monotonic() + wait
    lock = t.lock
    # a poll that finds the lock taken waits a moment too: the I/O thread may hold it while it
    # waits for the interpreter's lock this thread holds (up to the switch interval), and waiting
    # lets it have that; briefly, as an engine's step pays for the wait
    if not lock.acquire(timeout=wait if claim else POLL_WAIT_S):
        return
    mine, handed = None, False
    own = getattr(fut, "pending", None)  # (``p`` below: whatever request a reply answers)
    pending, stash = t.pending, t.stash
    try:
        sock = t.sock
        if sock is None or fut.done() or own is None:
            return
        if own.channel:
            mine, handed = t.channel.pump(own, end, pending, stash)
            return
        if claim:
            own.claimed_until = max(own.claimed_until, end)
        for i, (req_id, ok, _body) in enumerate(stash):  # read by another caller
            if pending.get(req_id) is own:
                if ok:
                    mine = (pending.pop(req_id), stash.pop(i)[2])
                return  # else an error: the I/O thread (woken below) may retry it
        while True:
            if not sock.getsockopt(_EVENTS) & _POLLIN:
                if mine is not None or handed:
                    return  # drained: the descriptor is armed again
                left = end - time.monotonic()
                if left <= 0 or not zmq.zmq_poll([(sock, zmq.POLLIN)], math.ceil(left * 1000)):
                    return
                continue
            try:
                reply = decode_reply(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                continue
            if reply is None:
                continue
            req_id, ok, body = reply
            p = pending.get(req_id)
            if ok and p is own and mine is None:
                mine = (pending.pop(req_id), body)
            else:  # someone else's, or an error the I/O thread may retry
                stash.append((req_id, ok, body))
                handed = handed or p is own
    finally:
        if claim and mine is None and own is not None:
            own.claimed_until = 0.0  # not answered yet: the I/O thread reads it from now on
        if t.stash or (claim and mine is None and not fut.done()):
            t.wake()
        lock.release()
        if mine is not None:
            t.answer(mine[0], True, mine[1])
