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
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import zmq

from tierd.protocol import codec
from tierd.protocol.errors import ProtocolError
from tierd_client.errors import DaemonUnavailable, DeadlineExceeded, TierdError

log = logging.getLogger("tierd_client")


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


class Transport:
    """Subclasses react through three hooks, all called on the I/O thread: ``_on_connect`` (a
    ZMTP handshake completed), ``_on_reply`` (a reply matched a request) and ``_tick`` (every
    loop turn, at least every 50 ms). ``_front`` holds requests to send before anything waiting."""

    def __init__(self, url: str, timeout_s: float, name: str):
        self.url = url
        self.timeout_s = timeout_s
        self.name = name
        self._ctx = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._pending: dict[int, Pending] = {}
        self._front: list[Pending] = []
        self._closed = threading.Event()
        self._connected = False  # a ZMTP handshake with the daemon completed and no disconnect since
        self._ever_connected = False
        self._thread = threading.Thread(target=self._loop, name=f"tierd-client-{name}", daemon=True)

    # ---- any thread -----------------------------------------------------------------------------
    def _request(self, op: str, body: dict, timeout: float | None = None, **kw) -> Pending:
        timeout = self.timeout_s if timeout is None else timeout
        return Pending(op, body, time.monotonic() + timeout, timeout, **kw)

    def _submit(self, p: Pending) -> None:
        if self._closed.is_set():
            raise TierdError("CLOSED", "client is closed")
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
        sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a daemon that is not connected
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.url)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        waiting: list[Pending] = []  # not yet sent: no connection so far
        try:
            while not self._closed.is_set():
                events = dict(poller.poll(50))
                if monitor in events:
                    self._on_monitor(monitor)
                if sock in events:
                    self._recv_all(sock)
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                while True:
                    try:
                        waiting.append(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                if self._front:
                    waiting, self._front = self._front + waiting, []
                waiting = self._expire(self._send_waiting(sock, waiting))
                self._tick()
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            for p in list(self._pending.values()) + waiting + self._front:
                self._fail(p, TierdError("CLOSED", "client closed"))
            self._pending.clear()

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
            try:
                sock.send(codec.encode_request(p.op, req_id, p.body), zmq.NOBLOCK)
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
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                req_id, ok, body = codec.decode_reply(frame, 1 << 31)
            except ProtocolError as exc:
                log.warning("undecodable reply from tierd: %s", exc)
                continue
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

    def _fail(self, p: Pending, exc: TierdError) -> None:
        self._unpublish(p)
        if p.callback is not None:
            try:
                p.callback(False, {"code": exc.code, "message": exc.message})
            except Exception:  # noqa: BLE001
                log.exception("client callback raised")
        elif p.future is not None and not p.future.done():
            p.future.set_exception(exc)

    @staticmethod
    def _unpublish(p: Pending) -> None:
        if p.publish is not None:
            try:
                p.publish.close()
            except OSError as exc:
                log.warning(
                    "tierd: withdrawing the shared-memory names of %s failed: %s", p.body.get("instance"), exc
                )
