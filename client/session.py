"""A client's session with the daemon (docs/protocol.md sections 5-7): HELLO, heartbeats,
recovery after a daemon restart, BYE, and the request/deadline API the verbs are built on.

- Every call has a deadline; a call the daemon does not answer in time fails with
  ``DeadlineExceeded`` and its reply, should it come later, is ignored.
- STORE and RETRIEVE carry the wall-clock deadline too, so the daemon never commits a store
  (or starts a retrieve) after the client gave up on it: a late copy can never publish bytes
  from blocks the engine has already reused.
- Heartbeats (PING) start with the session. A daemon restart shows as a new connection or an
  ``UNKNOWN_SESSION`` answer; the client then says HELLO again, re-registers its ranks and
  re-sends the request once. A daemon that comes up only after the first HELLO expired is
  greeted when its connection comes up, so a client started before its daemon still gets a
  session (and its ranks registered) later.
- A HELLO that expires on a connection that is up (a daemon still backing and pinning its pool
  after binding its socket) is sent again, until one is answered; ``wait_ready`` waits on.
- A HELLO the daemon refuses (e.g. ``UNSUPPORTED_VERSION``) is not "no daemon": ``wait_ready``
  raises the daemon's own error, and requests that fail for want of a session carry it too.
- ``close`` says BYE (bounded; an older daemon's ``UNKNOWN_OP`` is fine), so the daemon drops
  the session, its leases and its instances at once instead of at the heartbeat timeout.
- A REGISTER may carry a *publication* (``register_async(publish=)``): ``open()`` runs on the
  I/O thread right before every REGISTER of that instance is sent (re-registrations after a
  daemon restart included) and ``close()`` once it is answered. The CPU path uses it to give
  its shared memory a /dev/shm name only while the daemon maps it (``tierd_client.shm``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec

from tierd.protocol import PROTOCOL_VERSION, messages
from tierd.protocol.errors import ErrorCode
from tierd.protocol.layout import PageLayout
from tierd.protocol.sockets import default_socket
from tierd_client.errors import DaemonUnavailable, TierdError
from tierd_client.futures import failed
from tierd_client.pending import Pending, Reply
from tierd_client.transport import SPIN_S, Transport
from tierd_client.wire import typed

log = logging.getLogger("tierd_client")

_DEADLINE_OPS = ("STORE", "RETRIEVE")
_NOT_REFUSALS = ("DEADLINE", "UNAVAILABLE", "CLOSED")  # a HELLO that got no answer was not refused


@dataclass
class _Registration:
    instance: str
    layout: PageLayout
    publish: object | None = None


class Connection(Transport):
    def __init__(
        self,
        url: str | None = None,
        *,
        timeout_s: float = 10.0,
        heartbeat_interval_s: float | None = None,
        name: str = "tierd-client",
        connect_timeout_s: float = 5.0,
        token: str | None = None,
        lookup_channel: bool = True,
        spin_s: float = SPIN_S,
    ):
        """``lookup_channel``: send LOOKUP and PING on the daemon's lookup channel when it has one
        (docs/protocol.md section 2.1); False: everything on the ZeroMQ socket. ``spin_s``: how
        long a caller reads the channel for its reply before it sleeps in poll() (SPIN_S; 0: sleep
        at once)."""
        if not spin_s >= 0:
            raise ValueError(f"spin_s must be >= 0, got {spin_s}")
        super().__init__(url or default_socket(), timeout_s, name, lookup_channel, spin_s)
        # tcp://: the tenant token the daemon's --tcp-token-file lists (default $TIERD_TOKEN)
        self._token = os.environ.get("TIERD_TOKEN", "") if token is None else token
        self._heartbeat = heartbeat_interval_s
        self._registrations: dict[str, _Registration] = {}
        self._hello: messages.HelloReply | None = None
        self._hello_event = threading.Event()
        self._hello_error: TierdError | None = None  # the daemon refused our last HELLO
        self._recovering = True  # a HELLO is in flight (the first one is submitted below)
        self._leaving = False  # saying BYE: no heartbeats, no recovery
        self._bye_queued = False  # leave_now() queued one
        self._next_ping = 0.0
        self._thread.start()
        self._submit(self._request("HELLO", self._hello_body(), connect_timeout_s, callback=self._on_hello))

    # ---- requests -------------------------------------------------------------------------------
    def call_async(
        self,
        op: str,
        body: messages.Message | dict | None = None,
        timeout: float | None = None,
        wait: bool = False,
    ) -> Future:
        """``body``: the op's typed request (tierd.protocol.messages); a plain map is sent as it is
        (tools, and tests of the daemon's own checks). STORE and RETRIEVE get their ``deadline``
        here. ``wait``: the caller asks for the result at once; its thread then reads the reply
        itself (tierd_client.transport: one wake-up of another thread less each way). The future's
        result is the op's typed reply (messages.REPLIES; STATUS's a map), its error a TierdError."""
        timeout = self.timeout_s if timeout is None else timeout
        fut: Future = Reply(self)
        body = with_deadline(op, {} if body is None else body, timeout)
        self._submit(self._request(op, body, timeout, future=fut, wait=wait))
        return fut

    def call(self, op: str, body: messages.Message | dict | None = None, timeout: float | None = None):
        return self.call_async(op, body, timeout, wait=True).result()

    def wait_ready(self, timeout: float | None = None) -> messages.HelloReply:
        """Block until HELLO was answered; returns its reply. Raises the daemon's own error when it
        refused the HELLO (e.g. ``UNSUPPORTED_VERSION``), ``DaemonUnavailable`` when none answered."""
        self._hello_event.wait(self.timeout_s if timeout is None else timeout)
        if self._hello_error is not None:
            raise self._hello_error
        if self._hello is None:
            raise DaemonUnavailable(self.url)
        return self._hello

    @property
    def server(self) -> messages.HelloReply | None:
        """The last HELLO reply (protocol, version, boot_id, null_block_id, ...)."""
        return self._hello

    @property
    def connected(self) -> bool:
        """Whether the daemon is there now: a HELLO answered and the connection not lost since."""
        return self._hello is not None and self._connected

    @property
    def refusal(self) -> TierdError | None:
        """The daemon's error if it refused our last HELLO (e.g. UNSUPPORTED_VERSION), else None."""
        return self._hello_error

    def register_async(
        self,
        instance: str,
        layout: PageLayout | dict,
        timeout: float | None = None,
        publish: object | None = None,
    ) -> Future:
        """REGISTER a rank's page layout (a plain map is converted, tierd_client.wire.typed); once
        accepted it is re-sent after a daemon restart. ``publish`` (optional): ``open()``/``close()``
        around every REGISTER of it (module doc)."""
        try:
            layout = typed(layout, PageLayout, "layout")
        except TierdError as exc:
            return failed(exc)
        done: Future = Future()

        def finish(f: Future) -> None:
            exc = f.exception()
            if exc is not None:
                done.set_exception(exc)
                return
            self._registrations[instance] = _Registration(instance, layout, publish)
            done.set_result(f.result())

        fut: Future = Future()
        fut.add_done_callback(finish)
        self._submit(
            self._request(
                "REGISTER", messages.Register(instance, layout), timeout, future=fut, publish=publish
            )
        )
        return done

    @property
    def leaving(self) -> bool:
        """Whether ``leave_now`` or ``close`` began saying goodbye."""
        return self._leaving

    def leave_now(self, unregister: tuple[str, ...] = ()) -> None:
        """Queue UNREGISTERs of ``unregister`` (any session may drop any instance) and a BYE, and
        return at once: safe in a signal handler (lock-free queue puts, a pipe write). No
        heartbeats or recovery after it; ``close`` then only lets the queue drain and stops."""
        if self._leaving or self._hello is None or self._closed.is_set():
            return
        self._leaving = self._bye_queued = True
        for instance in unregister:
            self._outbox.put(
                self._request("UNREGISTER", messages.Unregister(instance), 1.0, callback=_ignore)
            )
        self._outbox.put(self._request("BYE", messages.Bye(), 1.0, callback=_ignore))
        self._wake()

    def close(self, bye_timeout: float = 0.5) -> None:
        """Say BYE (at most ``bye_timeout`` s), then stop the I/O thread."""
        if self._closed.is_set():
            return
        if self._bye_queued:
            deadline = time.monotonic() + bye_timeout  # let the queued BYE go out
            while not self._outbox.empty() and time.monotonic() < deadline:
                time.sleep(0.005)
        elif self._hello is not None and self._connected:
            self._leaving = True
            try:
                self.call("BYE", messages.Bye(), timeout=bye_timeout)
            except TierdError:
                pass  # UNKNOWN_OP (older daemon), gone, or slow: the heartbeat timeout reaps us
        self._stop()

    # ---- I/O thread -----------------------------------------------------------------------------
    def _hello_body(self) -> messages.Hello:
        # tcp://: the tenant token (--tcp-token-file); left out of the frame when empty
        return messages.Hello(PROTOCOL_VERSION, self.name, os.getpid(), self._token)

    def _resync(self, then: Pending | None = None) -> None:
        """HELLO, every accepted REGISTER, then ``then``: ahead of anything else waiting."""
        self._recovering = True
        self._front.append(self._request("HELLO", self._hello_body(), callback=self._on_hello))
        self._front += [self._reregister(reg) for reg in list(self._registrations.values())]
        if then is not None:
            self._front.append(then)

    def _reregister(self, reg: _Registration) -> Pending:
        return self._request(
            "REGISTER",
            messages.Register(reg.instance, reg.layout),
            callback=self._on_reregister,
            publish=reg.publish,
        )

    def _on_connect(self, reconnect: bool) -> None:
        # a new daemon (or the same one after a blip, or one that came up after our first HELLO
        # expired): new session, same registrations
        if (reconnect or self._hello is None) and not self._recovering and not self._leaving:
            log.info(
                "connected to tierd at %s; saying HELLO%s",
                self.url,
                " and re-registering" if self._registrations else "",
            )
            self._resync()

    def _on_reply(self, p: Pending, ok: bool, body) -> None:
        code = None if ok else body.code
        internal = p.op == "HELLO" or (p.op == "REGISTER" and p.callback is not None)
        if code is not None and not p.retried and not internal and not self._leaving:
            if code == ErrorCode.UNKNOWN_SESSION.name:
                p.retried = True  # the daemon lost us (restart): HELLO, re-REGISTER, then p once
                if self._recovering:
                    self._front.append(p)
                else:
                    log.info("tierd at %s lost this session; saying HELLO and re-registering", self.url)
                    self._resync(then=p)  # STORE/RETRIEVE keep their wall-clock deadline
                return
            reg = self._registrations.get(p.instance) if code == ErrorCode.UNKNOWN_INSTANCE.name else None
            if reg is not None:  # the daemon dropped this rank only (e.g. UNREGISTER elsewhere)
                p.retried = True
                self._front += [self._reregister(reg), p]
                return
        if code == ErrorCode.UNKNOWN_SESSION.name and self._hello_error is not None:
            self._fail(p, self._hello_error)  # no session because the daemon refused our HELLO: say why
        else:
            super()._on_reply(p, ok, body)

    def _on_hello(self, ok: bool, body: messages.HelloReply | messages.ErrorReply) -> None:
        self._recovering = False
        if not ok and body.code == "UNAVAILABLE" and not self._leaving and not self._closed.is_set():
            # the daemon dropped the connection under this HELLO (over its connection cap, or a
            # restart): the socket reconnects by itself and _on_connect asks again; wait_ready waits on
            return
        if not ok and body.code == "DEADLINE" and self._connected and not self._leaving:
            # connected, yet no answer in time: the daemon is still opening (backing and pinning its
            # pool comes after it binds its socket) or busy. Ask again; wait_ready waits on.
            log.info("tierd at %s has not answered HELLO yet; asking again", self.url)
            self._resync()
            return
        if ok:
            self._hello_error = None
            self._hello = body
            if self._heartbeat is None:
                self._heartbeat = max(0.05, min(5.0, body.heartbeat_timeout_s / 4))
            self._next_ping = time.monotonic() + self._heartbeat
            self._open_channel(body.channel_max_bytes)
        elif body.code not in _NOT_REFUSALS:
            self._hello_error = TierdError(body.code, body.message)
            log.error("tierd at %s refused HELLO: %s", self.url, self._hello_error)
        self._hello_event.set()

    def _on_reregister(self, ok: bool, body) -> None:
        if not ok:
            log.error("re-registering with tierd failed: %s", body)

    def _tick(self) -> None:
        """Heartbeat: a PING every interval once a HELLO was answered."""
        if self._hello is None or self._heartbeat is None or self._leaving:
            return
        now = time.monotonic()
        if now >= self._next_ping:
            self._next_ping = now + self._heartbeat
            self._front.append(
                self._request("PING", messages.Ping(), max(self._heartbeat * 2, 1.0), callback=_ignore)
            )


def with_deadline(op: str, body: messages.Message | dict, timeout: float) -> messages.Message | dict:
    """``body`` with the wall-clock ``deadline`` STORE and RETRIEVE carry (``timeout`` from now)."""
    if op not in _DEADLINE_OPS:
        return body
    deadline = time.time() + timeout
    if isinstance(body, messages.Message):
        return msgspec.structs.replace(body, deadline=deadline)
    return {**body, "deadline": deadline}


def _ignore(ok: bool, body) -> None:
    """Heartbeat answers need no handling: a lost session shows as UNKNOWN_SESSION or a disconnect."""
