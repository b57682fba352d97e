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

The caller's own thread does the socket work where it can: tierd_client.fast_path.

The lookup channel (LOOKUP and PING without ZeroMQ) is tierd_client.lookup_channel's half; a
request and its future are tierd_client.pending's.
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

import msgspec
import zmq

from tierd.protocol import messages
from tierd.protocol.errors import ProtocolError
from tierd_client import wire
from tierd_client.errors import BadReply, DaemonUnavailable, DeadlineExceeded, TierdError
from tierd_client.fast_path import FastPath
from tierd_client.lookup_channel import ChannelSide
from tierd_client.pending import Pending, decode_reply, release

log = logging.getLogger("tierd_client")

TICK_MS = 50  # the I/O thread's longest sleep: heartbeats, deadlines and claims checked this often
# A caller waiting for its lookup-channel reply reads the socket without sleeping this long first:
# waking a thread that sleeps in poll() costs, on a VM's vCPU, about a PING's whole work
# (benchmarks/lookup_latency.py: the channel's figures against ``no_spin``'s).
SPIN_S = 0.0003


def routing_identity() -> bytes:
    """A random 16-byte routing identity that does not start with a zero byte: ZeroMQ reserves
    those for identities a ROUTER makes up itself."""
    return b"t" + uuid.uuid4().bytes[1:]


class Transport(FastPath, ChannelSide):
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
        self._stash: list[tuple[int, bool, msgspec.Raw]] = []  # replies a caller read for the I/O thread
        self._watching = True  # the I/O thread's poll includes the socket's descriptor
        self._closed = threading.Event()
        self._connected = False  # a ZMTP handshake with the daemon completed and no disconnect since
        self._ever_connected = False
        self._identity = routing_identity()  # the DEALER's, named on the lookup channel too
        self._init_channel(url, channel)
        self._thread = threading.Thread(target=self._loop, name=f"tierd-client-{name}", daemon=True)

    # ---- any thread (and tierd_client.fast_path) ------------------------------------------------
    def _submit(self, p: Pending) -> None:
        if self._closed.is_set():
            raise TierdError("CLOSED", "client is closed")
        if p.publish is None and p.callback is None and self._send_now(p):
            return
        self._outbox.put(p)
        self._wake()

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

    def _on_reply(self, p: Pending, ok: bool, body) -> None:
        """``body``: ``p.op``'s typed reply, or a messages.ErrorReply when not ``ok``."""
        if ok:
            self._resolve(p, body)
        else:
            self._fail(p, TierdError(body.code, body.message))

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
                    self._fail(p, TierdError("LAYOUT_INVALID", f"cannot publish {p.instance}: {exc}"))
                    continue
            req_id = next(self._ids)
            frame = wire.encode_request(p.op, req_id, p.body)
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
                reply = decode_reply(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if reply is not None:
                self._dispatch(*reply)

    def _dispatch(self, req_id: int, ok: bool, body: msgspec.Raw) -> None:
        p = self._pending.pop(req_id, None)
        if p is not None:  # else: the answer to a request that already timed out
            self._answer(p, ok, body)

    def _answer(self, p: Pending, ok: bool, body: msgspec.Raw) -> None:
        """``p``'s reply, its body decoded into ``p.op``'s reply type (tierd_client.wire)."""
        try:
            reply = wire.decode_body(p.op, ok, body)
        except ProtocolError as exc:
            log.warning("tierd at %s sent a reply this client cannot read: %s", self.url, exc.message)
            self._fail(p, BadReply(exc.message))
            return
        self._on_reply(p, ok, reply)

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

    def _resolve(self, p: Pending, body) -> None:
        self._unpublish(p)
        if p.callback is not None:
            p.callback(True, body)
        elif p.future is not None and not p.future.done():
            p.future.set_result(body)
        release(p)

    def _fail(self, p: Pending, exc: TierdError) -> None:
        self._unpublish(p)
        if p.callback is not None:
            try:
                p.callback(False, messages.ErrorReply(exc.code, exc.message))
            except Exception:  # noqa: BLE001
                log.exception("client callback raised")
        elif p.future is not None and not p.future.done():
            p.future.set_exception(exc)
        release(p)

    @staticmethod
    def _unpublish(p: Pending) -> None:
        if p.publish is not None:
            try:
                p.publish.close()
            except OSError as exc:
                log.warning("tierd: withdrawing the shared-memory names of %s failed: %s", p.instance, exc)
