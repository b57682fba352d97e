"""The client's end of the daemon's lookup channel (tierd.edge.channel; docs/protocol.md section 2.1).

Once a HELLO is answered with
``channel_max_bytes`` the I/O thread connects the daemon's ``PATH.lookup`` seqpacket socket and
names this socket's identity on it; once the daemon acknowledges it, callers' LOOKUP and PING
go there (a round trip without ZeroMQ's I/O threads), everything else (heartbeats too) on the
DEALER. A frame the channel cannot take at once goes on the DEALER; a channel that ends fails
what is in flight on it (``DaemonUnavailable``) and is not used again until the next HELLO. The
same lock, claims and watching rules cover both sockets; only the I/O thread registers,
unregisters and closes the channel's socket (``sync``).

``LookupChannel`` owns the channel's sockets (the attached one, the one being opened, the dead
ones to close), its path, the largest frame it takes and how long a caller spins for its reply.
The transport owns the requests in flight: every method that reads a reply is handed what it
needs (the requests in flight and the replies a caller read for the I/O thread, or where to
dispatch a reply), and a channel that ends calls ``on_lost`` (the transport fails what was in
flight on it). Every method runs with the transport's lock held; ``open``, ``poll`` and ``sync``
only on the I/O thread.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import socket
import time
from collections.abc import Callable

import msgspec
import zmq

from tierd.protocol.sockets import CHANNEL_OPS, channel_path
from tierd_client import wire
from tierd_client.fdpass import socket_file
from tierd_client.pending import Pending, decode_reply

log = logging.getLogger("tierd_client")

CHANNEL_REPLY_BYTES = 1 << 16  # LOOKUP and PING replies are a few hundred bytes


class LookupChannel:
    def __init__(self, url: str, enabled: bool, identity: bytes, spin_s: float, on_lost: Callable[[], None]):
        """``identity``: the DEALER's routing identity, named on the channel. ``spin_s``: how long a
        caller reads the channel for its reply before it sleeps in poll(). ``on_lost``: called (lock
        held) when an attached channel ends, after it is no longer used."""
        path = socket_file(url) if enabled else None
        self.path = channel_path(path) if path else None
        self.identity = identity
        self.spin_s = spin_s
        self.sock: socket.socket | None = None  # attached: LOOKUP and PING go here
        self.max_bytes = 0  # the largest frame it takes (HELLO's channel_max_bytes)
        self._opening: socket.socket | None = None  # connected, its identity not yet acknowledged
        self._dead: list[socket.socket] = []  # to unregister and close (I/O thread)
        self._on_lost = on_lost

    # ---- callers' threads and the I/O thread, lock held -----------------------------------------
    def pump(self, own: Pending, end: float, pending: dict[int, Pending], stash: list[wire.RawReply]):
        """Read the channel for ``own``'s reply until ``end`` (level-triggered: nothing to drain).
        Returns ``((own, body), handed)`` when its success came (popped from ``pending``), else
        ``(None, handed)``; every other reply read (and ``own``'s error) goes on ``stash`` for the
        I/O thread, ``handed`` telling whether ``own``'s did."""
        channel = self.sock
        if channel is None:
            return None, False
        own.claimed_until = max(own.claimed_until, end)
        handed = False
        spin_end = min(end, time.monotonic() + self.spin_s)
        while True:
            reply = self._recv(channel)
            if reply is None:
                now = time.monotonic()
                if handed or self.sock is not channel:
                    return None, handed
                if now < spin_end:
                    os.sched_yield()  # (SPIN_S) a daemon runnable on this CPU runs first
                    continue
                left = end - now
                if left <= 0 or not zmq.zmq_poll([(channel, zmq.POLLIN)], math.ceil(left * 1000)):
                    return None, handed
                continue
            req_id, ok, body = reply
            p = pending.get(req_id)
            if ok and p is own:
                return (pending.pop(req_id), body), handed
            stash.append((req_id, ok, body))
            handed = handed or p is own

    def send(self, p: Pending, frame: bytes) -> bool:
        """Whether ``p`` went on the lookup channel (``p.channel``): a caller's LOOKUP or PING
        (heartbeats have callbacks) the channel takes; else the DEALER carries it."""
        channel = self.sock
        p.channel = (
            channel is not None and p.op in CHANNEL_OPS and p.callback is None and self._send(channel, frame)
        )
        return p.channel

    def _send(self, channel: socket.socket, frame: bytes) -> bool:
        """Whether ``frame`` went on the lookup channel; False (the DEALER carries it) when it is
        too large for it, its queue is full, or it ended (then it is dropped)."""
        if len(frame) > self.max_bytes:
            return False
        try:
            channel.send(frame, socket.MSG_NOSIGNAL)
            return True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if exc.errno != errno.EMSGSIZE:
                self.drop(f"sending failed: {exc.strerror}")
            return False

    def _recv(self, channel: socket.socket) -> wire.RawReply | None:
        """One reply read from the lookup channel, or None (nothing there, or it ended)."""
        while True:
            try:
                frame = channel.recv(CHANNEL_REPLY_BYTES)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                self.drop(f"reading failed: {exc.strerror}")
                return None
            if not frame:
                self.drop("the daemon closed it")
                return None
            reply = decode_reply(frame)
            if reply is not None:
                return reply

    def drop(self, why: str) -> None:
        """Stop using the lookup channel; ``on_lost`` fails what is in flight on it."""
        if self.sock is not None:
            log.debug("tierd lookup channel dropped: %s", why)
            self._dead.append(self.sock)
            self.sock = None
            self._on_lost()
        if self._opening is not None:
            self._dead.append(self._opening)
            self._opening = None

    # ---- I/O thread -----------------------------------------------------------------------------
    def open(self, max_bytes: int) -> None:
        """After a HELLO: connect the daemon's lookup channel (0: it has none) and name our identity;
        it is used once the daemon acknowledges that (``poll``). Lock held."""
        self.drop("a new session")
        if not max_bytes or self.path is None:
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        s.setblocking(False)
        try:
            s.connect(self.path)
            s.send(self.identity, socket.MSG_NOSIGNAL)
        except OSError as exc:  # none there, not ours to connect, or its backlog full: the DEALER it is
            log.debug("tierd lookup channel %s not opened: %s", self.path, exc)
            s.close()
            return
        self._opening, self.max_bytes = s, max_bytes

    def poll(self, dispatch: Callable[[int, bool, msgspec.Raw], None]) -> None:
        """Lock held: take the acknowledgement of an opening channel, and hand every reply there is
        to ``dispatch``."""
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
                if frame and wire.acknowledged(frame):
                    self.sock = s
                else:  # over the daemon's cap, or not a channel: the DEALER it is
                    self._dead.append(s)
        channel = self.sock
        while channel is not None and self.sock is channel:
            reply = self._recv(channel)
            if reply is None:
                return
            dispatch(*reply)

    def sync(self, poller: zmq.Poller, polled: socket.socket | None, watch: bool):
        """Register the channel socket the I/O thread should poll (an opening one always, an attached
        one while the DEALER is watched too), close dropped ones; returns what is registered now."""
        want = self._opening or (self.sock if watch else None)
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
