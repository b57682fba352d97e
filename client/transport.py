"""The wire under a tierd client: one DEALER socket owned by one I/O thread; every request is a
future (or an internal callback) with a deadline.

Hazards handled here:
- ZeroMQ sockets are not thread-safe: only the I/O thread touches the socket. Other threads hand
  requests over through a queue and wake the thread with a pipe.
- ``IMMEDIATE``: nothing is queued inside ZeroMQ for a daemon that is not connected. Before the
  first connection a request waits (up to its deadline) for one; after a connection was lost,
  requests fail at once with ``DaemonUnavailable`` (a dead daemon never answers, and nothing it
  had not committed is committed later), and so does everything in flight at the disconnect.
- Every call has a deadline; a call the daemon does not answer in time fails with
  ``DeadlineExceeded`` and its reply, should it come later, is dropped: the caller has moved on.
- STORE and RETRIEVE carry the wall-clock deadline too (``with_deadline``), so the daemon never
  commits a store (or starts a retrieve) after the client gave up on it: a late copy can never
  publish bytes from blocks the engine has already reused.
- A request with a ``publish`` hook has ``publish.open(url)`` called right before it is sent and
  ``publish.close()`` once it ends, whichever way it ends (reply, deadline, disconnect, close).

The caller's own thread does the socket work where it can (tierd_client.fast_path): whoever holds
``lock`` owns the socket and the state it guards (the requests in flight, the queues, the stash).
The lookup channel (LOOKUP and PING without ZeroMQ) is tierd_client.lookup_channel's object, held
as ``channel``; a request and its future are tierd_client.pending's. The session on top
(tierd_client.session) reacts through the ``Hooks`` handed to ``start``.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Protocol

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from tierd.protocol import messages
from tierd.protocol.errors import ProtocolError
from tierd_client import fast_path, wire
from tierd_client.errors import BadReply, DaemonUnavailable, DeadlineExceeded, TierdError
from tierd_client.lookup_channel import LookupChannel
from tierd_client.pending import Pending, Reply, decode_reply, fail, resolve

log = logging.getLogger("tierd_client")

TICK_MS = 50  # the I/O thread's longest sleep: heartbeats, deadlines and claims checked this often
# A caller waiting for its lookup-channel reply reads the socket without sleeping this long first:
# waking a thread that sleeps in poll() costs, on a VM's vCPU, about a PING's whole work
# (benchmarks/lookup_latency.py: the channel's figures against ``no_spin``'s).
SPIN_S = 0.0003
_DEADLINE_OPS = ("STORE", "RETRIEVE")


def routing_identity() -> bytes:
    """A random 16-byte routing identity that does not start with a zero byte: ZeroMQ reserves
    those for identities a ROUTER makes up itself."""
    return b"t" + uuid.uuid4().bytes[1:]


class Hooks(Protocol):
    """How the layer above (tierd_client.session.Session) reacts to the transport; called on the I/O
    thread with ``lock`` held, but for ``on_reply`` of a success a caller read for its own request
    (tierd_client.fast_path): on that caller's thread, after it let the lock go."""

    def on_connect(self, reconnect: bool) -> None:
        """A ZMTP handshake completed (``reconnect``: not the first one)."""

    def on_reply(self, p: Pending, ok: bool, body) -> bool:
        """A reply matched ``p`` (``body``: ``p.op``'s typed reply, or a messages.ErrorReply when not
        ``ok``). True: the hook took ``p`` over (retried or ended it); False: ``p`` ends with it."""

    def tick(self) -> None:
        """Every loop turn, at least every TICK_MS."""


class Transport:
    """Owns the DEALER socket (``sock``, the I/O thread's), the I/O thread, and under ``lock`` the
    requests in flight (``pending``), those not sent yet (``outbox``, then ``waiting``; ``front``
    before anything waiting: the hooks put HELLOs, re-REGISTERs and retries there), the replies a
    caller read for the I/O thread (``stash``) and whether that thread watches the socket; and the
    lookup channel (``channel``). Its public names are for tierd_client.fast_path and the session;
    what the lock guards is touched only with it held (the outbox is a thread-safe queue)."""

    def __init__(self, url: str, timeout_s: float, name: str, channel: bool = True, spin_s: float = SPIN_S):
        self.url = url
        self.timeout_s = timeout_s
        self.name = name
        self._ctx = zmq.Context.instance()
        self.ids = itertools.count(1)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.pending: dict[int, Pending] = {}
        self.front: list[Pending] = []
        self.waiting: list[Pending] = []  # taken from the outbox, not yet sent: no connection so far
        self.lock = threading.Lock()  # owns the socket and the state above (module doc)
        self.sock: zmq.Socket | None = None
        self.stash: list[wire.RawReply] = []  # replies a caller read for the I/O thread
        self.watching = True  # the I/O thread's poll includes the socket's descriptor
        self.closed = threading.Event()
        self.connected = False  # a ZMTP handshake with the daemon completed and no disconnect since
        self._ever_connected = False
        self.identity = routing_identity()  # the DEALER's, named on the lookup channel too
        self.channel = LookupChannel(url, channel, self.identity, spin_s, self._channel_lost)
        self._hooks: Hooks | None = None
        self.thread = threading.Thread(target=self._loop, name=f"tierd-client-{name}", daemon=True)

    def start(self, hooks: Hooks) -> None:
        """Start the I/O thread, ``hooks`` reacting to what it sees."""
        self._hooks = hooks
        self.thread.start()

    # ---- any thread -----------------------------------------------------------------------------
    def request(self, op: str, body, timeout: float | None = None, wait: bool = False, **kw) -> Pending:
        """A request (not sent yet); ``wait``: claimed for its caller (tierd_client.fast_path)."""
        timeout = self.timeout_s if timeout is None else timeout
        now = time.monotonic()
        p = Pending(op, body, now + timeout, timeout, **kw)
        if wait:
            p.claimed_until = now + fast_path.FAST_WAIT_S
        if isinstance(p.future, Reply):
            p.future.pending = p
        return p

    def call_async(
        self,
        op: str,
        body: messages.Message | dict | None = None,
        timeout: float | None = None,
        wait: bool = False,
    ) -> Future:
        """``op`` with ``body`` sent, its future returned (module doc: deadlines; ``wait``: the
        caller reads its reply itself, tierd_client.fast_path)."""
        timeout = self.timeout_s if timeout is None else timeout
        fut: Future = Reply(self)
        body = with_deadline(op, {} if body is None else body, timeout)
        self.submit(self.request(op, body, timeout, future=fut, wait=wait))
        return fut

    def call(self, op: str, body: messages.Message | dict | None = None, timeout: float | None = None):
        return self.call_async(op, body, timeout, wait=True).result()

    def submit(self, p: Pending) -> None:
        if self.closed.is_set():
            raise TierdError("CLOSED", "client is closed")
        if p.publish is None and p.callback is None and fast_path.send_now(self, p):
            return
        self.outbox.put(p)
        self.wake()

    def enqueue(self, *requests: Pending) -> None:
        """Hand ``requests`` to the I/O thread: lock-free queue puts and a pipe write, safe in a
        signal handler."""
        for p in requests:
            self.outbox.put(p)
        self.wake()

    def pump(self, fut: Future, limit: float | None) -> None:
        """Read the reply of ``fut`` (a request's Reply) on this thread (tierd_client.fast_path)."""
        fast_path.pump(self, fut, limit)

    def poll(self, fut: Future) -> None:
        """Read what the sockets hold for ``fut`` (a request's Reply) on this thread, without
        waiting (tierd_client.fast_path)."""
        fast_path.poll(self, fut)

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def stop(self) -> None:
        self.closed.set()
        self.wake()
        self.thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- I/O thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
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
        with self.lock:
            self.sock = sock
        timeout_ms = TICK_MS
        polled = None  # the lookup channel's socket, while registered
        channel, hooks = self.channel, self._hooks
        try:
            while not self.closed.is_set():
                events = dict(poller.poll(timeout_ms))
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                with self.lock:
                    if monitor in events:
                        self._on_monitor(monitor)
                    stash, self.stash = self.stash, []
                    for req_id, ok, body in stash:
                        self._dispatch(req_id, ok, body)
                    self._recv_all(sock)
                    channel.poll(self._dispatch)
                    while True:
                        try:
                            self.waiting.append(self.outbox.get_nowait())
                        except queue.Empty:
                            break
                    if self.front:
                        self.waiting, self.front = self.front + self.waiting, []
                    if self.waiting:
                        self.waiting = self._send_waiting(sock, self.waiting)
                        self._recv_all(sock)  # a send may have taken in replies (edge-triggered descriptor)
                    self.waiting = self._expire(self.waiting)
                    hooks.tick()
                    watch, timeout_ms = self.watch_socket()
                    if watch != self.watching:
                        self.watching = watch
                        if watch:
                            poller.register(fd, zmq.POLLIN)
                        else:
                            poller.unregister(fd)
                    polled = channel.sync(poller, polled, watch)
        finally:
            with self.lock:
                self.sock = None
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)
                for p in list(self.pending.values()) + self.waiting + self.front:
                    fail(p, TierdError("CLOSED", "client closed"))
                self.pending.clear()
                channel.drop("the client closed")
                channel.sync(poller, polled, False)

    def watch_socket(self) -> tuple[bool, int]:
        """Whether the I/O thread watches the socket (some request in flight is not claimed by a
        caller reading its reply), and its poll's timeout in ms (until the next claim runs out)."""
        if self.stash or self.waiting or self.front:
            return True, TICK_MS
        now, until = time.monotonic(), None
        for p in self.pending.values():
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
                    fail(p, TierdError("LAYOUT_INVALID", f"cannot publish {p.instance}: {exc}"))
                    continue
            req_id = next(self.ids)
            frame = wire.encode_request(p.op, req_id, p.body)
            if self.channel.send(p, frame):
                self.pending[req_id] = p
                continue
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                if self._ever_connected and not self.connected:
                    # the daemon went away: answer now rather than at the deadline
                    for q in waiting[i:]:
                        fail(q, DaemonUnavailable(self.url))
                    return left
                left.extend(waiting[i:])  # first connection still being made: wait for it
                break
            self.pending[req_id] = p
        return left

    def _on_monitor(self, monitor) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.channel.drop("the daemon disconnected")
                lost, self.pending = list(self.pending.values()), {}
                if lost:
                    log.warning(
                        "tierd at %s disconnected; failing %d requests in flight", self.url, len(lost)
                    )
                for p in lost:
                    fail(p, DaemonUnavailable(self.url))
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                reconnect = self._ever_connected
                self.connected = self._ever_connected = True
                self._hooks.on_connect(reconnect)

    def _channel_lost(self) -> None:
        """The lookup channel ended (lock held): what is in flight on it fails."""
        lost = [req_id for req_id, p in self.pending.items() if p.channel]
        for req_id in lost:
            fail(self.pending.pop(req_id), DaemonUnavailable(self.url))
        self.wake()

    def _recv_all(self, sock) -> None:
        while True:
            try:
                reply = decode_reply(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if reply is not None:
                self._dispatch(*reply)

    def _dispatch(self, req_id: int, ok: bool, body: msgspec.Raw) -> None:
        p = self.pending.pop(req_id, None)
        if p is not None:  # else: the answer to a request that already timed out
            self.answer(p, ok, body)

    def answer(self, p: Pending, ok: bool, body: msgspec.Raw) -> None:
        """``p``'s reply, its body decoded into ``p.op``'s reply type (tierd_client.wire), handed to
        the hooks, then (unless they took ``p`` over) ending ``p``."""
        try:
            reply = wire.decode_body(p.op, ok, body)
        except ProtocolError as exc:
            log.warning("tierd at %s sent a reply this client cannot read: %s", self.url, exc.message)
            fail(p, BadReply(exc.message))
            return
        if self._hooks.on_reply(p, ok, reply):
            return
        if ok:
            resolve(p, reply)
        else:
            fail(p, TierdError(reply.code, reply.message))

    def _expire(self, waiting: list[Pending]) -> list[Pending]:
        now = time.monotonic()
        for req_id, p in list(self.pending.items()):
            if now >= p.deadline:
                del self.pending[req_id]
                fail(p, DeadlineExceeded(p.op, p.timeout))
        keep = []
        for p in waiting:
            if now >= p.deadline:
                fail(p, DeadlineExceeded(p.op, p.timeout))
            else:
                keep.append(p)
        return keep


def with_deadline(op: str, body: messages.Message | dict, timeout: float) -> messages.Message | dict:
    """``body`` with the wall-clock ``deadline`` STORE and RETRIEVE carry (``timeout`` from now)."""
    if op not in _DEADLINE_OPS:
        return body
    deadline = time.time() + timeout
    if isinstance(body, messages.Message):
        return msgspec.structs.replace(body, deadline=deadline)
    return {**body, "deadline": deadline}
