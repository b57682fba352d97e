"""The wire under a tierd client: one DEALER socket owned by one I/O thread; every request is a
future (or an internal callback) with a deadline.

Hazards handled here:
- ZeroMQ sockets are not thread-safe: only the I/O thread touches the socket. Other threads hand
  requests over through a queue and wake the thread with a pipe.
- ``IMMEDIATE``: nothing is queued inside ZeroMQ for a daemon that is not connected. Before the
  first connection a request waits (up to its deadline) for one; after a connection was lost,
  requests fail at once with ``DaemonUnavailable`` (a dead daemon never answers, and nothing it
  had not committed is committed later), and so does everything in flight at the disconnect.
- A reply that comes after its request's deadline is dropped: the caller has moved on.
- A request with a ``publish`` hook has ``publish.open(url)`` called right before it is sent and
  ``publish.close()`` once it ends, whichever way it ends (reply, deadline, disconnect, close).

The caller's own thread does the socket work where it can (two thread hand-offs less per call;
docs/protocol.md section 14): whoever holds ``_lock`` owns the socket, and the I/O thread polls
the socket's notification descriptor, not the socket, so it never touches it without the lock.
- A request with nothing queued ahead of it is sent by the thread that makes it (``_send_now``).
- A thread waiting on a reply's ``result()`` reads the socket itself for up to FAST_WAIT_S
  (``_pump``); a success for its own request resolves there. Every other reply it reads (and its
  own errors, which may be retried) goes to the I/O thread, so callbacks and retries still run
  only there. Past FAST_WAIT_S it waits for the I/O thread like any other caller.
- A request made to be waited for at once (``wait=True``: ``call()``, the verbs' blocking forms)
  is *claimed* for FAST_WAIT_S: while every request in flight is claimed, the I/O thread does not
  watch the socket at all, so a reply wakes only the thread waiting for it. A claim that runs out
  (its caller never waited) hands the request to the I/O thread.
- ZeroMQ's descriptor is edge-triggered: whoever sent or read drains the socket to EAGAIN, or
  wakes the I/O thread, before letting the lock go.

The lookup channel (tierd.channel; docs/protocol.md section 2.1): once a HELLO is answered with
``channel_max_bytes`` the I/O thread connects the daemon's ``PATH.lookup`` seqpacket socket and
names this socket's identity on it; once the daemon acknowledges it, callers' LOOKUP and PING
go there (a round trip without ZeroMQ's I/O threads), everything else (heartbeats too) on the
DEALER. A frame the channel cannot take at once goes on the DEALER; a channel that ends fails
what is in flight on it (``DaemonUnavailable``) and is not used again until the next HELLO. The
same lock, claims and watching rules cover both sockets; only the I/O thread registers,
unregisters and closes the channel's socket (``_sync_channel``).
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import zmq

from tierd.protocol import codec
from tierd.protocol.errors import ProtocolError
from tierd.protocol.sockets import CHANNEL_OPS, channel_path
from tierd_client.errors import DaemonUnavailable, DeadlineExceeded, TierdError
from tierd_client.fdpass import socket_file

log = logging.getLogger("tierd_client")

FAST_WAIT_S = 0.005  # a caller reads the socket for its own reply this long before the I/O thread does
SEND_WAIT_S = 0.001  # a caller waits this long for the lock to send on its own thread
TICK_MS = 50  # the I/O thread's longest sleep: heartbeats, deadlines and claims checked this often
# plain ints: pyzmq's enum flags make each ``EVENTS & POLLIN`` test a Python-level __and__ (1 µs)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
CHANNEL_REPLY_BYTES = 1 << 16  # LOOKUP and PING replies are a few hundred bytes
# A caller waiting for its lookup-channel reply reads the socket without sleeping this long first:
# waking a thread that sleeps in poll() costs 30-40 µs on a VM's vCPU (a bare seqpacket echo, this
# repository's 2-core VM: p50 74 µs sleeping, 36 µs with the reply read spinning), a PING's whole work.
SPIN_S = 0.0003


class Reply(Future):
    """A request's future whose ``result()``/``exception()`` first read the socket on the waiting
    thread (``Transport._pump``), then wait for the I/O thread as a plain future does."""

    def __init__(self, transport: Transport):
        super().__init__()
        self._transport = transport
        self.pending: Pending | None = None  # set by Transport._request

    def result(self, timeout: float | None = None):
        return super().result(self._pumped(timeout))

    def exception(self, timeout: float | None = None):
        return super().exception(self._pumped(timeout))

    def _pumped(self, timeout: float | None) -> float | None:
        """Pump, and return what is left of ``timeout``."""
        if self.done() or timeout == 0:
            return timeout
        t0 = time.monotonic()
        self._transport._pump(self, timeout)
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))


@dataclass(eq=False)
class Pending:
    op: str
    body: dict
    deadline: float  # monotonic
    timeout: float
    future: Future | None = None
    callback: Callable[[bool, dict], None] | None = None
    retried: bool = False
    publish: object | None = None  # .open() before it is sent, .close() once it ends
    claimed_until: float = 0.0  # monotonic: its caller reads its reply until then (module doc)
    channel: bool = False  # sent on the lookup channel (module doc), not on the DEALER


class Transport:
    """Subclasses react through three hooks, all called on the I/O thread: ``_on_connect`` (a
    ZMTP handshake completed), ``_on_reply`` (a reply matched a request) and ``_tick`` (every
    loop turn, at least every TICK_MS). ``_front`` holds requests to send before anything waiting."""

    def __init__(self, url: str, timeout_s: float, name: str, channel: bool = True, spin_s: float = SPIN_S):
        self.url = url
        self.spin_s = spin_s  # SPIN_S: how long a caller reads a lookup-channel reply before sleeping
        self.timeout_s = timeout_s
        self.name = name
        self._ctx = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._pending: dict[int, Pending] = {}
        self._front: list[Pending] = []
        self._waiting: list[Pending] = []  # taken from the outbox, not yet sent: no connection so far
        self._lock = threading.Lock()  # owns the socket and the state above (module doc)
        self._sock: zmq.Socket | None = None
        self._stash: list[tuple[int, bool, dict]] = []  # replies a caller read for the I/O thread
        self._watching = True  # the I/O thread's poll includes the socket's descriptor
        self._closed = threading.Event()
        self._connected = False  # a ZMTP handshake with the daemon completed and no disconnect since
        self._ever_connected = False
        self._identity = uuid.uuid4().bytes  # the DEALER's, named on the lookup channel too
        path = socket_file(url) if channel else None
        self._channel_path = channel_path(path) if path else None
        self._channel: socket.socket | None = None  # attached: LOOKUP and PING go here
        self._channel_max = 0  # the largest frame it takes (HELLO's channel_max_bytes)
        self._opening: socket.socket | None = None  # connected, its identity not yet acknowledged
        self._dead: list[socket.socket] = []  # to unregister and close (I/O thread)
        self._thread = threading.Thread(target=self._loop, name=f"tierd-client-{name}", daemon=True)

    # ---- any thread -----------------------------------------------------------------------------
    def _request(
        self, op: str, body: dict, timeout: float | None = None, wait: bool = False, **kw
    ) -> Pending:
        timeout = self.timeout_s if timeout is None else timeout
        now = time.monotonic()
        p = Pending(op, body, now + timeout, timeout, **kw)
        if wait:
            p.claimed_until = now + FAST_WAIT_S
        if isinstance(p.future, Reply):
            p.future.pending = p
        return p

    def _submit(self, p: Pending) -> None:
        if self._closed.is_set():
            raise TierdError("CLOSED", "client is closed")
        if p.publish is None and p.callback is None and self._send_now(p):
            return
        self._outbox.put(p)
        self._wake()

    def _send_now(self, p: Pending) -> bool:
        """Send ``p`` on this thread if the socket is free and connected and nothing is queued ahead
        of it (the order of one thread's requests is kept); else the I/O thread sends it."""
        if not self._connected:
            return False
        # the I/O thread holds the lock for microseconds a turn: worth a short wait, as the other
        # way (the outbox, then waking that thread) costs a thread switch (~0.2 ms measured)
        if threading.current_thread() is self._thread:
            if not self._lock.acquire(blocking=False):
                return False
        elif not self._lock.acquire(timeout=SEND_WAIT_S):
            return False
        try:
            sock = self._sock
            ahead = self._waiting or self._front or not self._outbox.empty()
            if sock is None or not self._connected or ahead:
                return False
            req_id = next(self._ids)
            frame = codec.encode_request(p.op, req_id, p.body)
            if not self._send_on_channel(p, frame):
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    return False
            self._pending[req_id] = p
            if not p.channel and sock.getsockopt(_EVENTS) & _POLLIN:
                self._wake()  # the send took in a reply: the descriptor will not say so again
            elif not self._watching and p.claimed_until <= time.monotonic():
                self._wake()  # nobody would read its reply: the I/O thread watches the socket again
            return True
        finally:
            self._lock.release()

    def _pump(self, fut: Future, limit: float | None) -> None:
        """Read the socket on this thread until ``fut`` (a request's own future) is resolved, for at
        most FAST_WAIT_S (and ``limit``). Only a success of ``fut``'s own request resolves here."""
        wait = FAST_WAIT_S if limit is None else min(FAST_WAIT_S, limit)
        end = time.monotonic() + wait
        if wait <= 0 or not self._lock.acquire(timeout=wait):
            return
        mine, handed = None, False
        own = getattr(fut, "pending", None)  # (``p`` below: whatever request a reply answers)
        try:
            sock = self._sock
            if sock is None or fut.done() or own is None:
                return
            if own.channel:
                if self._channel is not None:
                    mine, handed = self._pump_channel(self._channel, own, end)
                return
            own.claimed_until = max(own.claimed_until, end)
            for i, (req_id, ok, _body) in enumerate(self._stash):  # read by another caller
                if self._pending.get(req_id) is own:
                    if ok:
                        mine = (self._pending.pop(req_id), self._stash.pop(i)[2])
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
                    reply = _decode(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    continue
                if reply is None:
                    continue
                req_id, ok, body = reply
                p = self._pending.get(req_id)
                if ok and p is own and mine is None:
                    mine = (self._pending.pop(req_id), body)
                else:  # someone else's, or an error the I/O thread may retry
                    self._stash.append((req_id, ok, body))
                    handed = handed or p is own
        finally:
            if mine is None and own is not None:
                own.claimed_until = 0.0  # not answered yet: the I/O thread reads it from now on
            if self._stash or (mine is None and not fut.done()):
                self._wake()
            self._lock.release()
            if mine is not None:
                self._on_reply(mine[0], True, mine[1])

    def _pump_channel(self, channel: socket.socket, own: Pending, end: float):
        """``_pump`` for a request sent on the lookup channel (level-triggered: nothing to drain)."""
        own.claimed_until = max(own.claimed_until, end)
        handed = False
        spin_end = min(end, time.monotonic() + self.spin_s)
        while True:
            reply = self._channel_recv(channel)
            if reply is None:
                now = time.monotonic()
                if handed or self._channel is not channel:
                    return None, handed
                if now < spin_end:
                    os.sched_yield()  # (SPIN_S) a daemon runnable on this CPU runs first
                    continue
                left = end - now
                if left <= 0 or not zmq.zmq_poll([(channel, zmq.POLLIN)], math.ceil(left * 1000)):
                    return None, handed
                continue
            req_id, ok, body = reply
            p = self._pending.get(req_id)
            if ok and p is own:
                return (self._pending.pop(req_id), body), handed
            self._stash.append((req_id, ok, body))
            handed = handed or p is own

    def _send_on_channel(self, p: Pending, frame: bytes) -> bool:
        """Whether ``p`` went on the lookup channel (``p.channel``): a caller's LOOKUP or PING
        (heartbeats have callbacks) the channel takes; else the DEALER carries it. Lock held."""
        channel = self._channel
        p.channel = (
            channel is not None
            and p.op in CHANNEL_OPS
            and p.callback is None
            and self._channel_send(channel, frame)
        )
        return p.channel

    def _channel_send(self, channel: socket.socket, frame: bytes) -> bool:
        """Whether ``frame`` went on the lookup channel; False (the DEALER carries it) when it is
        too large for it, its queue is full, or it ended (then it is dropped)."""
        if len(frame) > self._channel_max:
            return False
        try:
            channel.send(frame, socket.MSG_NOSIGNAL)
            return True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if exc.errno != errno.EMSGSIZE:
                self._drop_channel(f"sending failed: {exc.strerror}")
            return False

    def _channel_recv(self, channel: socket.socket) -> tuple[int, bool, dict] | None:
        """One reply read from the lookup channel, or None (nothing there, or it ended)."""
        while True:
            try:
                frame = channel.recv(CHANNEL_REPLY_BYTES)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                self._drop_channel(f"reading failed: {exc.strerror}")
                return None
            if not frame:
                self._drop_channel("the daemon closed it")
                return None
            reply = _decode(frame)
            if reply is not None:
                return reply

    def _open_channel(self, max_bytes: int) -> None:
        """After a HELLO: connect the daemon's lookup channel (0: it has none) and name our identity;
        it is used once the daemon acknowledges that (``_channel_poll``). Lock held."""
        self._drop_channel("a new session")
        if not max_bytes or self._channel_path is None:
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        s.setblocking(False)
        try:
            s.connect(self._channel_path)
            s.send(self._identity, socket.MSG_NOSIGNAL)
        except OSError as exc:  # none there, not ours to connect, or its backlog full: the DEALER it is
            log.debug("tierd lookup channel %s not opened: %s", self._channel_path, exc)
            s.close()
            return
        self._opening, self._channel_max = s, max_bytes

    def _drop_channel(self, why: str) -> None:
        """Stop using the lookup channel; what is in flight on it fails. Lock held."""
        if self._channel is not None:
            log.debug("tierd lookup channel dropped: %s", why)
            self._dead.append(self._channel)
            self._channel = None
            lost = [req_id for req_id, p in self._pending.items() if p.channel]
            for req_id in lost:
                self._fail(self._pending.pop(req_id), DaemonUnavailable(self.url))
            self._wake()
        if self._opening is not None:
            self._dead.append(self._opening)
            self._opening = None

    def _channel_poll(self) -> None:
        """I/O thread, lock held: take the acknowledgement of an opening channel, and any reply."""
        if self._opening is not None:
            s = self._opening
            try:
                frame = s.recv(CHANNEL_REPLY_BYTES)
            except (BlockingIOError, InterruptedError):
                frame = None
            except OSError:
                frame = b""
            if frame is not None:
                self._opening = None
                if frame and _decode(frame) == (0, True, {}):
                    self._channel = s
                else:  # over the daemon's cap, or not a channel: the DEALER it is
                    self._dead.append(s)
        channel = self._channel
        while channel is not None and self._channel is channel:
            reply = self._channel_recv(channel)
            if reply is None:
                return
            self._dispatch(*reply)

    def _sync_channel(self, poller: zmq.Poller, polled: socket.socket | None, watch: bool):
        """Register the channel socket the I/O thread should poll (an opening one always, an attached
        one while the DEALER is watched too), close dropped ones; returns what is registered now."""
        want = self._opening or (self._channel if watch else None)
        if polled is not None and polled is not want:
            poller.unregister(polled)
            polled = None
        for s in self._dead:
            s.close()
        self._dead.clear()
        if want is not None and polled is None:
            poller.register(want, zmq.POLLIN)
            polled = want
        return polled

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _stop(self) -> None:
        self._closed.set()
        self._wake()
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- hooks ----------------------------------------------------------------------------------
    def _on_connect(self, reconnect: bool) -> None:
        pass

    def _on_reply(self, p: Pending, ok: bool, body: dict) -> None:
        if ok:
            self._resolve(p, body)
        else:
            self._fail(p, TierdError(str(body.get("code")), str(body.get("message"))))

    def _tick(self) -> None:
        pass

    # ---- I/O thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a daemon that is not connected
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.url)
        poller = zmq.Poller()
        fd = sock.getsockopt(zmq.FD)  # watched, not the socket: callers use the socket too
        poller.register(fd, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        with self._lock:
            self._sock = sock
        timeout_ms = TICK_MS
        polled = None  # the lookup channel's socket, while registered
        try:
            while not self._closed.is_set():
                events = dict(poller.poll(timeout_ms))
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                with self._lock:
                    if monitor in events:
                        self._on_monitor(monitor)
                    stash, self._stash = self._stash, []
                    for req_id, ok, body in stash:
                        self._dispatch(req_id, ok, body)
                    self._recv_all(sock)
                    self._channel_poll()
                    while True:
                        try:
                            self._waiting.append(self._outbox.get_nowait())
                        except queue.Empty:
                            break
                    if self._front:
                        self._waiting, self._front = self._front + self._waiting, []
                    if self._waiting:
                        self._waiting = self._send_waiting(sock, self._waiting)
                        self._recv_all(sock)  # a send may have taken in replies (edge-triggered descriptor)
                    self._waiting = self._expire(self._waiting)
                    self._tick()
                    watch, timeout_ms = self._watch_socket()
                    if watch != self._watching:
                        self._watching = watch
                        if watch:
                            poller.register(fd, zmq.POLLIN)
                        else:
                            poller.unregister(fd)
                    polled = self._sync_channel(poller, polled, watch)
        finally:
            with self._lock:
                self._sock = None
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)
                for p in list(self._pending.values()) + self._waiting + self._front:
                    self._fail(p, TierdError("CLOSED", "client closed"))
                self._pending.clear()
                self._drop_channel("the client closed")
                self._sync_channel(poller, polled, False)

    def _watch_socket(self) -> tuple[bool, int]:
        """Whether the I/O thread watches the socket (some request in flight is not claimed by a
        caller reading its reply), and its poll's timeout in ms (until the next claim runs out)."""
        if self._stash or self._waiting or self._front:
            return True, TICK_MS
        now, until = time.monotonic(), None
        for p in self._pending.values():
            if p.claimed_until <= now:
                return True, TICK_MS
            until = p.claimed_until if until is None else min(until, p.claimed_until)
        return False, TICK_MS if until is None else max(1, math.ceil((until - now) * 1000))

    def _send_waiting(self, sock, waiting: list[Pending]) -> list[Pending]:
        left = []
        for i, p in enumerate(waiting):
            if p.future is not None and p.future.done():
                continue
            if p.publish is not None:
                try:
                    p.publish.open(self.url)
                except OSError as exc:
                    self._fail(
                        p, TierdError("LAYOUT_INVALID", f"cannot publish {p.body.get('instance')}: {exc}")
                    )
                    continue
            req_id = next(self._ids)
            frame = codec.encode_request(p.op, req_id, p.body)
            if self._send_on_channel(p, frame):
                self._pending[req_id] = p
                continue
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                if self._ever_connected and not self._connected:
                    # the daemon went away: answer now rather than at the deadline
                    for q in waiting[i:]:
                        self._fail(q, DaemonUnavailable(self.url))
                    return left
                left.extend(waiting[i:])  # first connection still being made: wait for it
                break
            self._pending[req_id] = p
        return left

    def _on_monitor(self, monitor) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._connected = False
                self._drop_channel("the daemon disconnected")
                lost, self._pending = list(self._pending.values()), {}
                if lost:
                    log.warning(
                        "tierd at %s disconnected; failing %d requests in flight", self.url, len(lost)
                    )
                for p in lost:
                    self._fail(p, DaemonUnavailable(self.url))
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                reconnect = self._ever_connected
                self._connected = self._ever_connected = True
                self._on_connect(reconnect)

    def _recv_all(self, sock) -> None:
        while True:
            try:
                reply = _decode(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if reply is not None:
                self._dispatch(*reply)

    def _dispatch(self, req_id: int, ok: bool, body: dict) -> None:
        p = self._pending.pop(req_id, None)
        if p is not None:  # else: the answer to a request that already timed out
            self._on_reply(p, ok, body)

    def _expire(self, waiting: list[Pending]) -> list[Pending]:
        now = time.monotonic()
        for req_id, p in list(self._pending.items()):
            if now >= p.deadline:
                del self._pending[req_id]
                self._fail(p, DeadlineExceeded(p.op, p.timeout))
        keep = []
        for p in waiting:
            if now >= p.deadline:
                self._fail(p, DeadlineExceeded(p.op, p.timeout))
            else:
                keep.append(p)
        return keep

    def _resolve(self, p: Pending, body: dict) -> None:
        self._unpublish(p)
        if p.callback is not None:
            p.callback(True, body)
        elif p.future is not None and not p.future.done():
            p.future.set_result(body)
        _release(p)

    def _fail(self, p: Pending, exc: TierdError) -> None:
        self._unpublish(p)
        if p.callback is not None:
            try:
                p.callback(False, {"code": exc.code, "message": exc.message})
            except Exception:  # noqa: BLE001
                log.exception("client callback raised")
        elif p.future is not None and not p.future.done():
            p.future.set_exception(exc)
        _release(p)

    @staticmethod
    def _unpublish(p: Pending) -> None:
        if p.publish is not None:
            try:
                p.publish.close()
            except OSError as exc:
                log.warning(
                    "tierd: withdrawing the shared-memory names of %s failed: %s", p.body.get("instance"), exc
                )


def _release(p: Pending) -> None:
    """An answered request's Reply lets go of it: the two refer to each other, and a cycle is freed
    only by Python's cyclic GC, whose collections then walk every answered request's body (a
    LOOKUP's list of keys): ~1 ms each, every ~50 LOOKUPs of 2048 keys, on the caller's thread."""
    if isinstance(p.future, Reply):
        p.future.pending = None


def _decode(frame: bytes) -> tuple[int, bool, dict] | None:
    """A reply's (req_id, ok, body); None (logged) if it cannot be decoded."""
    try:
        return codec.decode_reply(frame, 1 << 31)
    except ProtocolError as exc:
        log.warning("undecodable reply from tierd: %s", exc)
        return None
