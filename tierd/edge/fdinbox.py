"""File descriptors handed to the daemon, instead of paths (docs/protocol.md section 21).

An engine's CPU KV memory is shared memory it holds open (torch's unlinked /dev/shm files, or
memfds). A path to it would be a name another process could swap, a symlink, or a /proc entry
only its own user may follow. So the engine passes the descriptors themselves: next to the
ipc:// socket ``PATH`` the daemon listens on a Unix seqpacket socket ``PATH.fds``; a client sends
``MAGIC + ticket (16 random bytes)`` with up to 250 descriptors per message (SCM_RIGHTS), then
names them in REGISTER as ``{"kind": "fd", "ticket": ticket, "index": i}``. The kernel says who
sent them (SO_PEERCRED): only that uid's REGISTER can claim them. Holding a read-write
descriptor is the capability, so no path, owner or permission of the daemon's user is involved
(a daemon running as its own user serves engines of any user in its socket's group).

Bounds: at most ``max_per_uid`` unclaimed descriptors per uid (more are refused, the message
answered ``er``), each ticket expires ``ttl_s`` after its last message (its descriptors are
closed), at most ``max_conns`` connections at once, each closed after ``idle_s`` of silence. One
thread serves the socket with a selector; nothing here touches the main loop's state. Since that
one thread is the only way in, nothing a connection does may end it: an error while serving one
connection drops that connection (the descriptors of its message are closed) and is counted.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time

from tierd.edge.endpoint import listen_seqpacket, unlink_socket
from tierd.edge.peer import socket_peer
from tierd.protocol.sockets import MAGIC, MAX_FDS_PER_MESSAGE, TICKET_BYTES, inbox_path  # noqa: F401

log = logging.getLogger("tierd")


class FdInbox:
    def __init__(
        self,
        path: str,
        mode: int,
        max_per_uid: int = 4096,
        ttl_s: float = 60.0,
        max_conns: int = 64,
        idle_s: float = 5.0,
    ):
        self.path = path
        self.max_per_uid, self.ttl_s, self.max_conns, self.idle_s = max_per_uid, ttl_s, max_conns, idle_s
        self._lock = threading.Lock()
        self._held: dict[tuple[int, bytes], tuple[list[int], float]] = {}  # (uid, ticket) -> (fds, last)
        self._count: dict[int, int] = {}  # uid -> unclaimed descriptors
        self.received = self.refused = self.failed = 0  # failed: connections dropped on an exception
        self._conns: dict[socket.socket, tuple[int, float]] = {}  # -> (uid, last heard)
        self._sock = listen_seqpacket(path, mode)
        self._stop_r, self._stop_w = os.pipe()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ)
        self._sel.register(self._stop_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="tierd-fdinbox", daemon=True)
        self._thread.start()

    # ---- the main loop's side ---------------------------------------------------------------------
    def claim(self, uid: int, ticket: bytes) -> list[int] | None:
        """The descriptors ``uid`` sent under ``ticket`` (the caller owns them now), or None."""
        with self._lock:
            got = self._held.pop((uid, ticket), None)
            if got is None:
                return None
            self._count[uid] -= len(got[0])
            if not self._count[uid]:
                del self._count[uid]
            return got[0]

    @property
    def waiting(self) -> int:
        with self._lock:
            return sum(self._count.values())

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(5)
        for conn in list(self._conns):
            conn.close()
        self._sel.close()
        self._sock.close()
        os.close(self._stop_r)
        os.close(self._stop_w)
        with self._lock:
            for fds, _ in self._held.values():
                for fd in fds:
                    os.close(fd)
            self._held.clear()
            self._count.clear()
        unlink_socket(self.path)

    # ---- the inbox thread ------------------------------------------------------------------------
    def _serve(self) -> None:
        """Serve until ``close``. Nothing a connection sends may end this thread: an exception while
        serving one connection is logged and that connection dropped (its descriptors of that
        message closed); one anywhere else is logged and the loop goes on."""
        while True:
            try:
                events = self._sel.select(timeout=1.0)
            except Exception:
                log.exception("fd inbox: select failed; serving on")
                time.sleep(0.1)
                continue
            for key, _ in events:
                if key.fileobj == self._stop_r:
                    return
                try:
                    if key.fileobj is self._sock:
                        self._accept()
                    else:
                        self._read(key.fileobj)
                except Exception:
                    log.exception("fd inbox: serving a connection failed; it is dropped")
                    if key.fileobj is not self._sock:
                        self._drop(key.fileobj)
                    self.failed += 1
            try:
                self._expire(time.monotonic())
            except Exception:
                log.exception("fd inbox: expiring tickets failed; serving on")

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of descriptors: drop it, keep serving
            log.warning("fd inbox: accept failed: %s", exc.strerror)
            time.sleep(0.1)
            return
        if len(self._conns) >= self.max_conns:
            conn.close()
            self.refused += 1
            return
        uid = socket_peer(conn).uid
        conn.setblocking(False)
        self._conns[conn] = (uid, time.monotonic())
        self._sel.register(conn, selectors.EVENT_READ)

    def _drop(self, conn: socket.socket) -> None:
        self._conns.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _read(self, conn: socket.socket) -> None:
        uid, _ = self._conns[conn]
        try:
            data, fds, flags, _ = socket.recv_fds(conn, 64, MAX_FDS_PER_MESSAGE + 3)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data and not fds:  # the client closed
            self._drop(conn)
            return
        self._conns[conn] = (uid, time.monotonic())
        kept = False
        try:
            reply, kept = self._deposit(uid, data, fds, flags)
        finally:
            if not kept:  # refused, or the deposit raised: the message's descriptors are closed here
                for fd in fds:
                    os.close(fd)
        try:
            conn.send(reply)
        except OSError:
            self._drop(conn)

    def _deposit(self, uid: int, data: bytes, fds: list[int], flags: int) -> tuple[bytes, bool]:
        """The reply to one message, and whether its descriptors were kept (else the caller closes
        them)."""

        def refuse(why: str) -> tuple[bytes, bool]:
            self.refused += 1
            return b"er" + why.encode(), False

        if flags & socket.MSG_CTRUNC:
            return refuse(f"more than {MAX_FDS_PER_MESSAGE} descriptors in one message")
        if len(data) != len(MAGIC) + TICKET_BYTES or not data.startswith(MAGIC):
            return refuse(f"a message is {MAGIC!r} + a {TICKET_BYTES}-byte ticket")
        if not fds:
            return refuse("no descriptors came with the message")
        if len(fds) > MAX_FDS_PER_MESSAGE:  # the receive buffer has room for a few more, to see them
            return refuse(f"more than {MAX_FDS_PER_MESSAGE} descriptors in one message")
        ticket = data[len(MAGIC) :]
        with self._lock:
            have = self._count.get(uid, 0)
            if have + len(fds) > self.max_per_uid:
                return refuse(
                    f"uid {uid} already has {have} unclaimed descriptors here (--max-files-per-tenant "
                    f"{self.max_per_uid})"
                )
            held, _ = self._held.get((uid, ticket), ([], 0.0))
            held.extend(fds)
            self._held[(uid, ticket)] = (held, time.monotonic())
            self._count[uid] = have + len(fds)
            self.received += len(fds)
            n = len(held)
        return b"ok" + n.to_bytes(4, "little"), True

    def _expire(self, now: float) -> None:
        for conn, (_, last) in list(self._conns.items()):
            if now - last > self.idle_s:
                self._drop(conn)
        with self._lock:
            old = [k for k, (_, last) in self._held.items() if now - last > self.ttl_s]
            for key in old:
                fds, _ = self._held.pop(key)
                for fd in fds:
                    os.close(fd)
                self._count[key[0]] -= len(fds)
                if not self._count[key[0]]:
                    del self._count[key[0]]
        if old:
            log.info("fd inbox: %d tickets expired unclaimed", len(old))
