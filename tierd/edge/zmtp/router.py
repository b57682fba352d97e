"""The ROUTER: the listening socket, its connections (accepted under the caps, each handshake
timed), routing identities (handover), replies, and which identities' connections ended."""

from __future__ import annotations

import errno
import logging
import select
import socket
import threading
import time

from tierd.edge.peer import NO_UID, Peer, socket_peer
from tierd.edge.zmtp.conn import GREETING, OPEN, READ_BYTES, Conn, frame_head

log = logging.getLogger("tierd")

HANDSHAKE_S = 10.0  # greeting and READY must both have arrived by then
SEND_QUEUE = 1000  # replies queued per connection that the kernel did not take at once
SEND_QUEUE_BYTES = 64 << 20  # ... and their bytes
TURN_EVENTS = 32  # connections served per turn: at most 32 x 256 KiB read into messages at once


class Router:
    """``messages()`` gives ``(identity, first frame, peer, extra)`` per message read: ``extra``
    is None for a message of one frame, else ``(frames, bytes in all)``. ``send(identity, frame)``
    replies. ``fd`` is readable whenever there is anything to do (an epoll descriptor)."""

    def __init__(self, cap_bytes: int, max_total: int = 1 << 30, max_per_peer: int = 1 << 30):
        self.cap, self.max_total, self.max_per_peer = cap_bytes, max_total, max_per_peer
        self.epoll = select.epoll()
        self.fd = self.epoll.fileno()
        self.listener: socket.socket | None = None
        self._ipc = True
        self.conns: dict[int, Conn] = {}  # fd -> connection
        self.routes: dict[bytes, Conn] = {}  # identity -> its connection
        self._per_peer: dict[int, int] = {}
        self._ended: list[tuple[bytes, int]] = []
        self._next_id = 1
        self._buf = bytearray(READ_BYTES)
        self._view = memoryview(self._buf)
        self._held: set[Conn] | None = None  # (handshakes_during) open connections not read yet
        self.refused = self.dropped = 0  # connections over a cap; replies nobody could take
        self._said = 0.0

    # ---- endpoint ---------------------------------------------------------------------------------
    def bind(self, url: str) -> None:
        """Listen on ``ipc://PATH``, ``ipc://@NAME`` (abstract) or ``tcp://HOST:PORT`` (``*``: any
        host; port 0 or ``*``: one the kernel picks). Raises OSError."""
        if url.startswith("ipc://"):
            where = url[len("ipc://") :]
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            address = "\0" + where[1:] if where.startswith("@") else where
        elif url.startswith("tcp://"):
            host, _, port = url[len("tcp://") :].rpartition(":")
            host = "" if host in ("*", "") else host.strip("[]")
            port = 0 if port in ("*", "") else int(port)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            address = (host, port)
            self._ipc = False
        else:
            raise OSError(errno.EPROTONOSUPPORT, f"not an ipc:// or tcp:// endpoint: {url}")
        try:
            sock.bind(address)
            sock.listen(256)
        except BaseException:
            sock.close()
            raise
        sock.setblocking(False)
        self.listener = sock
        self.epoll.register(sock.fileno(), select.EPOLLIN)

    @property
    def connections(self) -> int:
        return len(self.conns)

    # ---- reading ------------------------------------------------------------------------------------
    def messages(self) -> list[tuple[bytes, memoryview, Peer, tuple | None]]:
        """Accept, write what waits, and read one turn of up to TURN_EVENTS ready connections."""
        out: list = []
        now = time.monotonic()
        listen_fd = self.listener.fileno() if self.listener is not None else -1
        for fd, events in self.epoll.poll(0, TURN_EVENTS):  # (the others stay ready for the next turn)
            if fd == listen_fd:
                self._accept(now)
                continue
            c = self.conns.get(fd)
            if c is None:
                continue
            if events & select.EPOLLOUT and not c.flush():
                self.close_conn(c)
                continue
            if not events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                continue
            if self._held is not None and c.state == OPEN:  # its requests wait for the main loop
                if events & (select.EPOLLHUP | select.EPOLLERR):  # gone: nobody to answer
                    self.close_conn(c)
                    continue
                self._held.add(c)
                self.epoll.modify(fd, select.EPOLLOUT if c.writing else 0)
            elif not c.read(self._buf, self._view, out):
                self.close_conn(c)
        return out

    def handshakes_during(self, work):
        """``work()``, while a thread answers handshakes, so that clients connecting meanwhile
        (the daemon backs and pins its pool after it binds) see a daemon that is there; their
        requests are read once the main loop runs."""
        self._held, stop = set(), threading.Event()

        def answer() -> None:
            while not stop.is_set():
                select.select([self.fd], [], [], 0.05)
                if not stop.is_set():
                    self.messages()

        thread = threading.Thread(target=answer, name="tierd-handshakes", daemon=True)
        thread.start()
        try:
            return work()
        finally:
            stop.set()
            thread.join()
            for c in self._held:
                if self.conns.get(c.fd) is c:  # (not closed since; its fd not another's now)
                    self.epoll.modify(c.fd, select.EPOLLIN | select.EPOLLOUT if c.writing else select.EPOLLIN)
            self._held = None

    def _route(self, c: Conn, identity: bytes) -> None:
        if not identity:
            while True:
                identity = b"\0" + self._next_id.to_bytes(4, "big")
                self._next_id = self._next_id % 0xFFFFFFFF + 1
                if identity not in self.routes:
                    break
        old = self.routes.get(identity)
        c.identity = identity
        self.routes[identity] = c
        if old is not None:  # taken over: the old connection stays open, orphaned, as libzmq leaves it
            old.identity = None

    # ---- accepting ------------------------------------------------------------------------------------
    def _accept(self, now: float) -> None:
        while True:
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the backlog waits, the loop goes on
                self._warn(f"accept failed: {exc.strerror}")
                return
            peer = socket_peer(sock) if self._ipc else Peer(NO_UID, NO_UID, 0, str(address[0]))
            n = self._per_peer.get(peer.uid, 0)
            if len(self.conns) >= self.max_total or n >= self.max_per_peer:
                self.refused += 1
                who = "tcp://" if peer.uid == NO_UID else f"uid {peer.uid}"
                self._warn(
                    f"closed a new connection of {who}: {len(self.conns)} connections in all "
                    f"(--max-connections {self.max_total}), {n} of its own "
                    f"(2 x --max-sessions-per-peer = {self.max_per_peer})"
                )
                sock.close()
                continue
            sock.setblocking(False)
            c = Conn(sock, peer, self.epoll, self.cap, self._route, now)
            self.conns[c.fd] = c
            self._per_peer[peer.uid] = n + 1
            self.epoll.register(c.fd, select.EPOLLIN)
            c.write(GREETING)

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._said > 10:
            self._said = now
            log.warning("%s", message)

    def sweep(self, now: float) -> None:
        """Close connections whose handshake did not finish within HANDSHAKE_S."""
        for c in [c for c in self.conns.values() if c.state != OPEN and now - c.since > HANDSHAKE_S]:
            log.debug("zmtp: closed a connection whose handshake took over %.0f s", HANDSHAKE_S)
            self.close_conn(c)

    # ---- writing ----------------------------------------------------------------------------------------
    def send(self, identity: bytes, frame: bytes) -> bool:
        """Reply ``frame`` to ``identity`` without waiting; False if it was dropped."""
        c = self.routes.get(identity)
        full = c is not None and (len(c.out) >= SEND_QUEUE or c.queued >= SEND_QUEUE_BYTES)
        if c is None or full or not c.write(frame_head(len(frame)), frame):
            self.dropped += 1
            return False
        return True

    # ---- ending -----------------------------------------------------------------------------------------
    def close_conn(self, c: Conn) -> None:
        if self.conns.pop(c.fd, None) is None:
            return
        self.epoll.unregister(c.fd)
        c.sock.close()
        n = self._per_peer[c.peer.uid] - 1
        if n:
            self._per_peer[c.peer.uid] = n
        else:
            del self._per_peer[c.peer.uid]
        if c.identity is not None and self.routes.get(c.identity) is c:
            del self.routes[c.identity]
            self._ended.append((c.identity, c.peer.uid))
        c.body = c.first = None

    def ended(self) -> list[tuple[bytes, int]]:
        """``(identity, uid)`` of each routing identity whose connection ended since the last call
        (an identity another connection took over is not among them)."""
        out, self._ended = self._ended, []
        return out

    def close(self, linger_s: float = 0.0) -> None:
        """Write what waits for up to ``linger_s``, then close every connection and the listener."""
        deadline = time.monotonic() + linger_s
        waiting = [c for c in self.conns.values() if c.out]
        while waiting and time.monotonic() < deadline:
            time.sleep(0.005)
            waiting = [c for c in waiting if c.flush() and c.out]
        for c in list(self.conns.values()):
            self.close_conn(c)
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self.epoll.close()
