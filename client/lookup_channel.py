"""The lookup channel's half of the client's transport (tierd.edge.channel; docs/protocol.md section 2.1).

Once a HELLO is answered with
``channel_max_bytes`` the I/O thread connects the daemon's ``PATH.lookup`` seqpacket socket and
names this socket's identity on it; once the daemon acknowledges it, callers' LOOKUP and PING
go there (a round trip without ZeroMQ's I/O threads), everything else (heartbeats too) on the
DEALER. A frame the channel cannot take at once goes on the DEALER; a channel that ends fails
what is in flight on it (``DaemonUnavailable``) and is not used again until the next HELLO. The
same lock, claims and watching rules cover both sockets; only the I/O thread registers,
unregisters and closes the channel's socket (``_sync_channel``).

``ChannelSide`` is a part of tierd_client.transport.Transport, not a class of its own: it uses the
transport's requests in flight (``_pending``), the replies a caller read for the I/O thread
(``_stash``), ``_fail``, ``_dispatch`` and ``_wake``, all under the transport's lock.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import socket
import time

import msgspec
import zmq

from tierd.protocol.sockets import CHANNEL_OPS, channel_path
from tierd_client import wire
from tierd_client.errors import DaemonUnavailable
from tierd_client.fdpass import socket_file
from tierd_client.pending import Pending, decode_reply

log = logging.getLogger("tierd_client")

CHANNEL_REPLY_BYTES = 1 << 16  # LOOKUP and PING replies are a few hundred bytes


class ChannelSide:
    def _init_channel(self, url: str, enabled: bool) -> None:
        path = socket_file(url) if enabled else None
        self._channel_path = channel_path(path) if path else None
        self._channel: socket.socket | None = None  # attached: LOOKUP and PING go here
        self._channel_max = 0  # the largest frame it takes (HELLO's channel_max_bytes)
        self._opening: socket.socket | None = None  # connected, its identity not yet acknowledged
        self._dead: list[socket.socket] = []  # to unregister and close (I/O thread)

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

    def _channel_recv(self, channel: socket.socket) -> tuple[int, bool, msgspec.Raw] | None:
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
            reply = decode_reply(frame)
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
                if frame and wire.acknowledged(frame):
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
