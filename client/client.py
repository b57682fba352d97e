"""The thin engine client: one DEALER socket owned by an I/O thread, futures with deadlines.

- Every call has a deadline; a call the daemon does not answer in time fails with
  ``DeadlineExceeded`` and its reply, should it come later, is ignored.
- STORE and RETRIEVE carry the wall-clock deadline too, so the daemon never commits a store
  (or starts a retrieve) after the client gave up on it: a late copy can never publish bytes
  from blocks the engine has already reused.
- Heartbeats (PING) start with the session; a daemon restart is noticed by an
  ``UNKNOWN_SESSION`` answer, upon which the client says HELLO again, re-registers its ranks
  and re-sends the request once.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import zmq

from tierd.config import default_socket
from tierd.protocol import PROTOCOL_VERSION, codec
from tierd.protocol.errors import ErrorCode, ProtocolError

log = logging.getLogger("tierd_client")

_DEADLINE_OPS = ("STORE", "RETRIEVE")


class TierdError(Exception):
    """The daemon answered with a typed error."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class DeadlineExceeded(TierdError):
    def __init__(self, op: str, timeout: float):
        super().__init__("DEADLINE", f"{op} got no answer within {timeout:g} s")


class DaemonUnavailable(TierdError):
    def __init__(self, url: str):
        super().__init__("UNAVAILABLE", f"no tierd is connected at {url}")


@dataclass(eq=False)
class _Pending:
    op: str
    body: dict
    deadline: float  # monotonic
    timeout: float
    future: Future | None = None
    callback: Callable[[bool, dict], None] | None = None
    retried: bool = False


@dataclass
class _Registration:
    instance: str
    layout: dict


class TierdClient:
    def __init__(
        self,
        url: str | None = None,
        *,
        timeout_s: float = 10.0,
        heartbeat_interval_s: float | None = None,
        name: str = "tierd-client",
        connect_timeout_s: float = 5.0,
    ):
        self.url = url or default_socket()
        self.timeout_s = timeout_s
        self.name = name
        self._heartbeat = heartbeat_interval_s
        self._ctx = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._pending: dict[int, _Pending] = {}
        self._registrations: dict[str, _Registration] = {}
        self._closed = threading.Event()
        self._hello: dict | None = None
        self._hello_event = threading.Event()
        self._recovering = False
        self._connected = False  # a ZMTP handshake with the daemon completed and no disconnect since
        self._ever_connected = False
        self._next_ping = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"tierd-client-{name}", daemon=True)
        self._thread.start()
        self._send_internal("HELLO", self._hello_body(), self._on_hello, timeout=connect_timeout_s)

    # ---- public API ---------------------------------------------------------------------------
    def call_async(self, op: str, body: dict | None = None, timeout: float | None = None) -> Future:
        if self._closed.is_set():
            raise TierdError("CLOSED", "client is closed")
        timeout = self.timeout_s if timeout is None else timeout
        fut: Future = Future()
        body = dict(body or {})
        if op in _DEADLINE_OPS:
            body["deadline"] = time.time() + timeout
        self._submit(_Pending(op, body, time.monotonic() + timeout, timeout, future=fut))
        return fut

    def call(self, op: str, body: dict | None = None, timeout: float | None = None) -> dict:
        fut = self.call_async(op, body, timeout)
        return fut.result()

    def wait_ready(self, timeout: float | None = None) -> dict:
        """Block until HELLO was answered; returns its reply (or raises DaemonUnavailable)."""
        if not self._hello_event.wait(self.timeout_s if timeout is None else timeout) or self._hello is None:
            raise DaemonUnavailable(self.url)
        return self._hello

    @property
    def server(self) -> dict | None:
        """The last HELLO reply (protocol, version, boot_id, null_block_id, ...)."""
        return self._hello

    def register_async(self, instance: str, layout: dict, timeout: float | None = None) -> Future:
        """REGISTER a rank's page layout; once accepted it is re-sent after a daemon restart."""
        done: Future = Future()

        def finish(f: Future) -> None:
            exc = f.exception()
            if exc is not None:
                done.set_exception(exc)
                return
            self._registrations[instance] = _Registration(instance, layout)
            done.set_result(f.result())

        self.call_async("REGISTER", {"instance": instance, "layout": layout}, timeout).add_done_callback(finish)
        return done

    def register(self, instance: str, layout: dict, timeout: float | None = None) -> dict:
        return self.register_async(instance, layout, timeout).result()

    def unregister(self, instance: str, timeout: float | None = None) -> dict:
        self._registrations.pop(instance, None)
        return self.call("UNREGISTER", {"instance": instance}, timeout)

    def lookup_async(self, namespace: dict, keys: list[bytes], groups: list[dict], chunk_tokens: int,
                     *, replicated: bool = False, lease: bool = True, timeout: float | None = None) -> Future:
        body = {"namespace": namespace, "keys": keys, "groups": groups, "chunk_tokens": chunk_tokens,
                "replicated": replicated, "lease": lease}
        return self.call_async("LOOKUP", body, timeout)

    def lookup(self, *args, **kwargs) -> dict:
        return self.lookup_async(*args, **kwargs).result()

    def release(self, lease: int, timeout: float | None = None) -> dict:
        return self.call("RELEASE", {"lease": lease}, timeout)

    def store_async(self, instance: str, chunks: list[dict], touch: list[bytes] | None = None,
                    timeout: float | None = None, event: bytes | None = None) -> Future:
        body = {"instance": instance, "chunks": chunks}
        if touch:
            body["touch"] = touch
        if event is not None:
            body["event"] = event  # CUDA: IPC event the daemon's gather waits on
        return self.call_async("STORE", body, timeout)

    def store(self, *args, **kwargs) -> dict:
        return self.store_async(*args, **kwargs).result()

    def retrieve_async(self, instance: str, chunks: list[dict], lease: int = 0, timeout: float | None = None) -> Future:
        return self.call_async("RETRIEVE", {"instance": instance, "chunks": chunks, "lease": lease}, timeout)

    def retrieve(self, *args, **kwargs) -> dict:
        return self.retrieve_async(*args, **kwargs).result()

    def ping(self, timeout: float | None = None) -> dict:
        return self.call("PING", {}, timeout)

    def status(self, timeout: float | None = None) -> dict:
        return self.call("STATUS", {}, timeout)

    def clear(self, timeout: float | None = None) -> dict:
        return self.call("CLEAR", {}, timeout)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake()
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- I/O thread ---------------------------------------------------------------------------
    def _hello_body(self) -> dict:
        return {"protocol": PROTOCOL_VERSION, "client": self.name, "pid": os.getpid()}

    def _submit(self, p: _Pending) -> None:
        self._outbox.put(p)
        self._wake()

    def _send_internal(self, op: str, body: dict, callback, timeout: float | None = None) -> None:
        timeout = self.timeout_s if timeout is None else timeout
        self._submit(_Pending(op, body, time.monotonic() + timeout, timeout, callback=callback))

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

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
        waiting: list[_Pending] = []  # not yet sent: no connection so far
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
                waiting = self._expire(self._send_waiting(sock, waiting))
                self._maybe_ping()
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            for p in list(self._pending.values()) + waiting:
                self._fail(p, TierdError("CLOSED", "client closed"))
            self._pending.clear()

    def _send_waiting(self, sock, waiting: list[_Pending]) -> list[_Pending]:
        left = []
        for i, p in enumerate(waiting):
            if p.future is not None and p.future.done():
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
                    log.warning("tierd at %s disconnected; failing %d requests in flight", self.url, len(lost))
                for p in lost:  # a dead daemon never answers; nothing it did is committed after our deadline
                    self._fail(p, DaemonUnavailable(self.url))
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                reconnect = self._ever_connected
                self._connected = self._ever_connected = True
                if reconnect and not self._recovering:
                    # a new daemon (or the same one after a blip): new session, same registrations
                    self._recovering = True
                    log.info("reconnected to tierd at %s; saying HELLO and re-registering", self.url)
                    self._send_internal("HELLO", self._hello_body(), self._on_hello)
                    for reg in list(self._registrations.values()):
                        self._send_internal("REGISTER", {"instance": reg.instance, "layout": reg.layout},
                                            self._on_reregister)

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
            if p is None:
                continue  # answer to a request that already timed out
            if not ok and not p.retried and p.op not in ("HELLO", "REGISTER"):
                code = body.get("code")
                if code == ErrorCode.UNKNOWN_SESSION.name:
                    self._recover(p)
                    continue
                reg = self._registrations.get(p.body.get("instance")) if code == ErrorCode.UNKNOWN_INSTANCE.name else None
                if reg is not None:  # the daemon dropped this rank only (e.g. UNREGISTER elsewhere): re-register it
                    p.retried = True
                    self._send_internal("REGISTER", {"instance": reg.instance, "layout": reg.layout}, self._on_reregister)
                    self._outbox.put(p)
                    continue
            if ok:
                self._resolve(p, body)
            else:
                self._fail(p, TierdError(str(body.get("code")), str(body.get("message"))))

    def _recover(self, p: _Pending) -> None:
        """The daemon lost us (restart): HELLO, re-REGISTER, then re-send ``p`` once, in order."""
        p.retried = True
        if not self._recovering:
            self._recovering = True
            log.info("tierd at %s lost this session; reconnecting and re-registering", self.url)
            self._send_internal("HELLO", self._hello_body(), self._on_hello)
            for reg in list(self._registrations.values()):
                self._send_internal("REGISTER", {"instance": reg.instance, "layout": reg.layout}, self._on_reregister)
        self._outbox.put(p)  # STORE/RETRIEVE keep their wall-clock deadline

    def _on_hello(self, ok: bool, body: dict) -> None:
        self._recovering = False
        if ok:
            self._hello = body
            if self._heartbeat is None:
                self._heartbeat = max(0.05, min(5.0, body.get("heartbeat_timeout_s", 30.0) / 4))
            self._next_ping = time.monotonic() + self._heartbeat
        self._hello_event.set()

    def _on_reregister(self, ok: bool, body: dict) -> None:
        if not ok:
            log.error("re-registering with tierd failed: %s", body)

    def _maybe_ping(self) -> None:
        if self._hello is None or self._heartbeat is None:
            return
        now = time.monotonic()
        if now >= self._next_ping:
            self._next_ping = now + self._heartbeat
            self._outbox.put(_Pending("PING", {}, now + max(self._heartbeat * 2, 1.0), self._heartbeat * 2,
                                      callback=_ignore))

    def _expire(self, waiting: list[_Pending]) -> list[_Pending]:
        now = time.monotonic()
        for req_id, p in list(self._pending.items()):
            if now >= p.deadline:
                del self._pending[req_id]
                self._timeout(p)
        keep = []
        for p in waiting:
            if now >= p.deadline:
                self._timeout(p)
            else:
                keep.append(p)
        return keep

    def _timeout(self, p: _Pending) -> None:
        if p.op == "HELLO" and p.callback is self._on_hello:
            self._recovering = False
            self._hello_event.set()
        self._fail(p, DeadlineExceeded(p.op, p.timeout))

    def _resolve(self, p: _Pending, body: dict) -> None:
        if p.callback is not None:
            p.callback(True, body)
        elif p.future is not None and not p.future.done():
            p.future.set_result(body)

    def _fail(self, p: _Pending, exc: TierdError) -> None:
        if p.callback is not None:
            try:
                p.callback(False, {"code": exc.code, "message": exc.message})
            except Exception:  # noqa: BLE001
                log.exception("client callback raised")
        elif p.future is not None and not p.future.done():
            p.future.set_exception(exc)


def _ignore(ok: bool, body: dict) -> None:
    """Heartbeat answers need no handling: a lost session shows as UNKNOWN_SESSION or a disconnect."""
