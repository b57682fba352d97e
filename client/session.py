"""A client's session with the daemon (docs/protocol.md sections 5-7): HELLO, registrations,
heartbeats, recovery after a daemon restart, BYE.

``Session`` owns the session's state (the last HELLO reply or refusal, the accepted
registrations, the heartbeat's schedule, whether it is recovering or leaving) and is composed
with a tierd_client.transport.Transport: it sends through the transport, and the transport calls
it back through the transport's ``Hooks`` (``on_connect``, ``on_reply``, ``tick``), on the I/O
thread with the transport's lock held, so the state the hooks change is the I/O thread's (a
success may reach ``on_reply`` on a caller's thread too; it changes nothing there).

- Heartbeats (PING) start with the session. A daemon restart shows as a new connection or an
  ``UNKNOWN_SESSION`` answer; the client then says HELLO again, re-registers its ranks and
  re-sends the request once. A daemon that comes up only after the first HELLO expired is
  greeted when its connection comes up, so a client started before its daemon still gets a
  session (and its ranks registered) later.
- A HELLO that expires on a connection that is up (a daemon still backing and pinning its pool
  after binding its socket) is sent again, until one is answered; ``wait_ready`` waits on.
- A HELLO the daemon refuses (e.g. ``UNSUPPORTED_VERSION``) is not "no daemon": ``wait_ready``
  raises the daemon's own error, and requests that fail for want of a session carry it too.
- ``bye`` (the client's ``close``) says BYE (bounded; an older daemon's ``UNKNOWN_OP`` is fine),
  so the daemon drops the session, its leases and its instances at once instead of at the
  heartbeat timeout.
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

from tierd.protocol import PROTOCOL_VERSION, messages
from tierd.protocol.errors import ErrorCode
from tierd.protocol.layout import PageLayout
from tierd_client.errors import DaemonUnavailable, TierdError
from tierd_client.futures import failed
from tierd_client.pending import Pending, fail
from tierd_client.transport import Transport
from tierd_client.wire import typed

log = logging.getLogger("tierd_client")

_NOT_REFUSALS = ("DEADLINE", "UNAVAILABLE", "CLOSED")  # a HELLO that got no answer was not refused


@dataclass
class _Registration:
    instance: str
    layout: PageLayout
    publish: object | None = None


class Session:
    def __init__(
        self, transport: Transport, token: str | None = None, heartbeat_interval_s: float | None = None
    ):
        self.transport = transport
        # tcp://: the tenant token the daemon's --tcp-token-file lists (default $TIERD_TOKEN)
        self._token = os.environ.get("TIERD_TOKEN", "") if token is None else token
        self._heartbeat = heartbeat_interval_s
        self._registrations: dict[str, _Registration] = {}
        self._hello: messages.HelloReply | None = None
        self._hello_event = threading.Event()
        self._hello_error: TierdError | None = None  # the daemon refused our last HELLO
        self._recovering = True  # a HELLO is in flight (the first one is submitted by ``greet``)
        self._leaving = False  # saying BYE: no heartbeats, no recovery
        self._bye_queued = False  # leave_now() queued one
        self._next_ping = 0.0

    # ---- callers' threads -----------------------------------------------------------------------
    def greet(self, timeout: float) -> None:
        """Send the first HELLO (the transport started): answered or not within ``timeout``."""
        t = self.transport
        t.submit(t.request("HELLO", self.hello_body(), timeout, callback=self._on_hello))

    def wait_ready(self, timeout: float | None = None) -> messages.HelloReply:
        """Block until HELLO was answered; returns its reply. Raises the daemon's own error when it
        refused the HELLO (e.g. ``UNSUPPORTED_VERSION``), ``DaemonUnavailable`` when none answered."""
        self._hello_event.wait(self.transport.timeout_s if timeout is None else timeout)
        if self._hello_error is not None:
            raise self._hello_error
        if self._hello is None:
            raise DaemonUnavailable(self.transport.url)
        return self._hello

    @property
    def server(self) -> messages.HelloReply | None:
        """The last HELLO reply (protocol, version, boot_id, null_block_id, ...)."""
        return self._hello

    @property
    def connected(self) -> bool:
        """Whether the daemon is there now: a HELLO answered and the connection not lost since."""
        return self._hello is not None and self.transport.connected

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
        t = self.transport
        t.submit(
            t.request("REGISTER", messages.Register(instance, layout), timeout, future=fut, publish=publish)
        )
        return done

    def forget(self, instance: str) -> None:
        """Stop re-registering ``instance`` (it is being unregistered)."""
        self._registrations.pop(instance, None)

    @property
    def leaving(self) -> bool:
        """Whether ``leave_now`` or ``bye`` began saying goodbye."""
        return self._leaving

    def leave_now(self, unregister: tuple[str, ...] = ()) -> None:
        """Queue UNREGISTERs of ``unregister`` (any session may drop any instance) and a BYE, and
        return at once: safe in a signal handler (lock-free queue puts, a pipe write). No
        heartbeats or recovery after it; ``bye`` then only lets the queue drain."""
        t = self.transport
        if self._leaving or self._hello is None or t.closed.is_set():
            return
        self._leaving = self._bye_queued = True
        byes = [t.request("UNREGISTER", messages.Unregister(i), 1.0, callback=_ignore) for i in unregister]
        t.enqueue(*byes, t.request("BYE", messages.Bye(), 1.0, callback=_ignore))

    def bye(self, bye_timeout: float) -> None:
        """Say BYE (at most ``bye_timeout`` s), or let the one ``leave_now`` queued go out; the
        transport is stopped next."""
        t = self.transport
        if self._bye_queued:
            deadline = time.monotonic() + bye_timeout  # let the queued BYE go out
            while not t.outbox.empty() and time.monotonic() < deadline:
                time.sleep(0.005)
        elif self._hello is not None and t.connected:
            self._leaving = True
            try:
                t.call("BYE", messages.Bye(), timeout=bye_timeout)
            except TierdError:
                pass  # UNKNOWN_OP (older daemon), gone, or slow: the heartbeat timeout reaps us

    def hello_body(self) -> messages.Hello:
        # tcp://: the tenant token (--tcp-token-file); left out of the frame when empty
        return messages.Hello(PROTOCOL_VERSION, self.transport.name, os.getpid(), self._token)

    # ---- the transport's hooks: I/O thread, its lock held ---------------------------------------
    def on_connect(self, reconnect: bool) -> None:
        # a new daemon (or the same one after a blip, or one that came up after our first HELLO
        # expired): new session, same registrations
        if (reconnect or self._hello is None) and not self._recovering and not self._leaving:
            log.info(
                "connected to tierd at %s; saying HELLO%s",
                self.transport.url,
                " and re-registering" if self._registrations else "",
            )
            self._resync()

    def on_reply(self, p: Pending, ok: bool, body) -> bool:
        """Take over ``p`` when the daemon lost this session or its instance (HELLO and re-REGISTER
        first, then ``p`` once more), or when it has no session because it refused our HELLO (then
        ``p`` fails with that refusal). A success is never taken over: that also runs on a caller's
        thread (tierd_client.transport.Hooks)."""
        if ok:
            return False
        code = body.code
        internal = p.op == "HELLO" or (p.op == "REGISTER" and p.callback is not None)
        if not p.retried and not internal and not self._leaving:
            if code == ErrorCode.UNKNOWN_SESSION.name:
                p.retried = True  # the daemon lost us (restart): HELLO, re-REGISTER, then p once
                if self._recovering:
                    self.transport.front.append(p)
                else:
                    log.info(
                        "tierd at %s lost this session; saying HELLO and re-registering", self.transport.url
                    )
                    self._resync(then=p)  # STORE/RETRIEVE keep their wall-clock deadline
                return True
            reg = self._registrations.get(p.instance) if code == ErrorCode.UNKNOWN_INSTANCE.name else None
            if reg is not None:  # the daemon dropped this rank only (e.g. UNREGISTER elsewhere)
                p.retried = True
                self.transport.front += [self._reregister(reg), p]
                return True
        if code == ErrorCode.UNKNOWN_SESSION.name and self._hello_error is not None:
            fail(p, self._hello_error)  # no session because the daemon refused our HELLO: say why
            return True
        return False

    def tick(self) -> None:
        """Heartbeat: a PING every interval once a HELLO was answered."""
        if self._hello is None or self._heartbeat is None or self._leaving:
            return
        now = time.monotonic()
        if now >= self._next_ping:
            self._next_ping = now + self._heartbeat
            t = self.transport
            t.front.append(
                t.request("PING", messages.Ping(), max(self._heartbeat * 2, 1.0), callback=_ignore)
            )

    def _resync(self, then: Pending | None = None) -> None:
        """HELLO, every accepted REGISTER, then ``then``: ahead of anything else waiting."""
        self._recovering = True
        front = self.transport.front
        front.append(self.transport.request("HELLO", self.hello_body(), callback=self._on_hello))
        front += [self._reregister(reg) for reg in list(self._registrations.values())]
        if then is not None:
            front.append(then)

    def _reregister(self, reg: _Registration) -> Pending:
        return self.transport.request(
            "REGISTER",
            messages.Register(reg.instance, reg.layout),
            callback=self._on_reregister,
            publish=reg.publish,
        )

    def _on_hello(self, ok: bool, body: messages.HelloReply | messages.ErrorReply) -> None:
        self._recovering = False
        t = self.transport
        if not ok and body.code == "UNAVAILABLE" and not self._leaving and not t.closed.is_set():
            # the daemon dropped the connection under this HELLO (over its connection cap, or a
            # restart): the socket reconnects by itself and on_connect asks again; wait_ready waits on
            return
        if not ok and body.code == "DEADLINE" and t.connected and not self._leaving:
            # connected, yet no answer in time: the daemon is still opening (backing and pinning its
            # pool comes after it binds its socket) or busy. Ask again; wait_ready waits on.
            log.info("tierd at %s has not answered HELLO yet; asking again", t.url)
            self._resync()
            return
        if ok:
            self._hello_error = None
            self._hello = body
            if self._heartbeat is None:
                self._heartbeat = max(0.05, min(5.0, body.heartbeat_timeout_s / 4))
            self._next_ping = time.monotonic() + self._heartbeat
            t.channel.open(body.channel_max_bytes)
        elif body.code not in _NOT_REFUSALS:
            self._hello_error = TierdError(body.code, body.message)
            log.error("tierd at %s refused HELLO: %s", t.url, self._hello_error)
        self._hello_event.set()

    def _on_reregister(self, ok: bool, body) -> None:
        if not ok:
            log.error("re-registering with tierd failed: %s", body)


def _ignore(ok: bool, body) -> None:
    """Heartbeat answers need no handling: a lost session shows as UNKNOWN_SESSION or a disconnect."""
