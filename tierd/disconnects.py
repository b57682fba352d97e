"""Which client connections ended, so their sessions go at once (``--drop-on-disconnect``).

libzmq's own answer, ``ZMQ_ROUTER_NOTIFY`` (an empty message from a routing identity when its
peer disconnects), is a draft option: the libzmq that pyzmq's wheels bundle is built without
drafts and refuses it (EINVAL). So the daemon watches its ROUTER with a socket monitor instead:
the monitor reports each accepted connection and each disconnect by file descriptor, and every
message names the descriptor it came in on (``ZMQ_SRCFD``). A connection is ``(fd, generation)``,
the generation counting the connections accepted on that fd; each routing identity belongs to
the connection its last message came on.

Ordering, the hazard here: the monitor and the ROUTER are two sockets, read in turn. For one
fd the monitor's events are in order (a connection's disconnect is reported before its fd can
be reused by the next accept), and a connection's accept is reported before any of its
messages can arrive. So the daemon reads a batch of messages, then drains the monitor, then
attributes the batch's messages: every accept that happened before a message is then known,
and a message is never credited to an older connection that had the same fd. Drops are applied
after the batch: an identity whose connection ended is dropped only if no message of that
batch came from a new connection with the same identity (a client that reconnected, or one
whose routing identity a second connection took over with ``ROUTER_HANDOVER`` before the first
closed, keeps its session), and only if the ended connection was the session's own user's (a
connection of another uid that took the identity over and was refused ``FORBIDDEN`` does not
drop it). A disconnect the monitor missed leaves the session to the heartbeat timeout, as before.

Cost: one ``SRCFD`` read per message (a getsockopt) and a dict look-up; a dict update only when an
identity changes connection; one monitor drain per batch.

Connection caps (always on): every connection costs the daemon a file descriptor before it says
anything, and libzmq aborts the process when an accept fails for lack of descriptors (EMFILE).
So each accepted connection is counted, per peer (its uid from SO_PEERCRED on ipc://; all of
tcp:// together) and in all; one past ``max_per_peer`` or ``max_total`` is shut down at once
(``shutdown(2)`` on a duplicate of its descriptor: libzmq sees the end of the stream and closes
it; the descriptor itself is never closed here, so no other connection can be hit).
"""

from __future__ import annotations

import logging
import os
import socket
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from tierd.peer import NO_UID, socket_peer

log = logging.getLogger("tierd")

EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_INPROC = "inproc://tierd-router-monitor-{}"


class ConnectionWatch:
    def __init__(self, router: zmq.Socket, max_total: int = 1 << 30, max_per_peer: int = 1 << 30):
        self.router = router
        self.max_total, self.max_per_peer = max_total, max_per_peer
        self._open: dict[int, int] = {}  # fd -> its peer (uid, or NO_UID)
        self._per_peer: dict[int, int] = {}
        self.refused = 0
        self._said = 0.0
        addr = _INPROC.format(id(self))
        router.monitor(addr, EVENTS)
        self.monitor = router.context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.setsockopt(zmq.RCVHWM, 0)  # no event dropped (inproc: 0 on one side is unbounded)
        self.monitor.connect(addr)
        self._gen: dict[int, int] = {}  # fd -> connections accepted on it so far
        self._conn: dict[bytes, int] = {}  # identity -> connection (key) of its last message
        self._members: dict[int, tuple[int, set[bytes]]] = {}  # connection -> (uid, identities on it)
        self._ended: list[tuple[bytes, int, int]] = []  # (identity, connection, uid) to drop after the batch

    # ---- per message ----------------------------------------------------------------------------
    def saw(self, identity: bytes, frame: zmq.Frame, uid: int) -> None:
        """``identity``'s message ``frame`` (from a uid) arrived: it belongs to that connection."""
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            return
        key = (self._gen.get(fd, 0) << 32) | fd
        old = self._conn.get(identity)
        if old == key:
            return
        if old is not None:
            members = self._members.get(old)
            if members is not None:
                members[1].discard(identity)
                if not members[1]:
                    del self._members[old]
        self._conn[identity] = key
        members = self._members.get(key)
        if members is None:
            self._members[key] = (uid, {identity})
        else:
            members[1].add(identity)

    # ---- per batch ------------------------------------------------------------------------------
    def drain(self) -> None:
        """Take every event the monitor has (call after reading a batch, before attributing it)."""
        while True:
            try:
                msg = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = parse_monitor_message(msg)
            except Exception:  # noqa: BLE001 - not an event we know the shape of
                continue
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._gen[fd] = self._gen.get(fd, 0) + 1
                self._accepted(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._gone(fd)
                key = (self._gen.get(fd, 0) << 32) | fd
                members = self._members.pop(key, None)
                if members is not None:
                    uid, identities = members
                    self._ended += [(identity, key, uid) for identity in identities]

    # ---- caps -----------------------------------------------------------------------------------
    @property
    def connections(self) -> int:
        return len(self._open)

    def _accepted(self, fd: int) -> None:
        peer, dup = NO_UID, None
        try:
            dup = socket.socket(fileno=os.dup(fd))
            peer = socket_peer(dup).uid
            n = self._per_peer.get(peer, 0)
            if len(self._open) >= self.max_total or n >= self.max_per_peer:
                dup.shutdown(socket.SHUT_RDWR)  # libzmq reads the end and closes it (a DISCONNECTED follows)
                self.refused += 1
                now = time.monotonic()
                if now - self._said > 10:
                    self._said = now
                    who = "tcp://" if peer == NO_UID else f"uid {peer}"
                    log.warning(
                        "closed a new connection of %s: %d connections in all (--max-connections "
                        "%d), %d of its own (2 x --max-sessions-per-peer = %d)",
                        who,
                        len(self._open),
                        self.max_total,
                        n,
                        self.max_per_peer,
                    )
        except OSError:  # gone already, or no descriptor left to look: counted, its disconnect uncounts it
            pass
        finally:
            if dup is not None:
                dup.close()  # the duplicate only
        self._open[fd] = peer
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1

    def _gone(self, fd: int) -> None:
        peer = self._open.pop(fd, None)
        if peer is not None:
            n = self._per_peer[peer] - 1
            if n:
                self._per_peer[peer] = n
            else:
                del self._per_peer[peer]

    def ended(self) -> list[tuple[bytes, int]]:
        """``(identity, uid)`` of every identity whose connection ended and that no later message
        moved to another connection (call after the batch's messages were attributed)."""
        out = []
        for identity, key, uid in self._ended:
            if self._conn.get(identity) == key:
                del self._conn[identity]
                out.append((identity, uid))
        self._ended.clear()
        return out

    def close(self) -> None:
        try:
            self.router.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
