"""One ZMTP connection: its greeting and READY, its frames read into messages (a message's first
frame held, later parts only counted), and its writes (what the kernel does not take at once is
queued). The wire (https://rfc.zeromq.org/spec/37/): a frame is one flags byte (MORE, LONG,
COMMAND), a size (one byte, or eight when LONG) and that many bytes."""

from __future__ import annotations

import collections
import logging
import mmap
import select
import socket
from collections.abc import Callable

from tierd.edge.peer import Peer

log = logging.getLogger("tierd")

MORE, LONG, COMMAND = 1, 2, 4  # a frame's flags
NULL_MECHANISM = b"NULL".ljust(20, b"\0")
GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 1]) + NULL_MECHANISM + bytes(32)
PEER_TYPES = (b"DEALER", b"REQ", b"ROUTER")  # the socket types a ROUTER talks to
MAX_COMMAND = 64 << 10  # a command frame (READY's properties) at most
READ_BYTES = 256 << 10  # read from one connection per turn
LAZY_BYTES = 64 << 10  # a frame larger than this is held in memory backed as it arrives
GREETING_WAIT, READY_WAIT, OPEN = 0, 1, 2  # a connection's state
_FIRST, _PART, _COMMAND = 1, 2, 3  # what the frame being read is


def frame_head(size: int, flags: int = 0) -> bytes:
    if size <= 255:
        return bytes((flags, size))
    return bytes((flags | LONG,)) + size.to_bytes(8, "big")


def command(name: bytes, data: bytes = b"") -> bytes:
    """One command frame (flags, size, body): the name, then ``data``."""
    body = bytes([len(name)]) + name + data
    return frame_head(len(body), COMMAND) + body


def properties(values: dict[bytes, bytes]) -> bytes:
    """ZMTP metadata: name-size, name, 4-byte value-size, value; repeated."""
    return b"".join(bytes([len(k)]) + k + len(v).to_bytes(4, "big") + v for k, v in values.items())


def parse_properties(data: memoryview) -> dict[bytes, bytes] | None:
    """ZMTP metadata as a dict (names lower-cased); None if malformed."""
    out, i, n = {}, 0, len(data)
    while i < n:
        k = data[i]
        if i + 1 + k + 4 > n:
            return None
        key = bytes(data[i + 1 : i + 1 + k]).lower()
        i += 1 + k
        v = int.from_bytes(data[i : i + 4], "big")
        if i + 4 + v > n:
            return None
        out[key] = bytes(data[i + 4 : i + 4 + v])
        i += 4 + v
    return out


READY = command(b"READY", properties({b"Socket-Type": b"ROUTER"}))


class Conn:
    """One connection. ``read`` takes one turn of its bytes, appending each message it completes
    to ``out`` as ``(identity, first frame, peer, extra)``; False when the connection must close.
    ``on_ready(conn, identity)`` is called when its handshake completes (``identity`` as the peer
    named it, maybe empty)."""

    __slots__ = (
        "sock", "fd", "peer", "epoll", "cap", "on_ready", "state", "since", "identity", "head", "kind",
        "body", "have", "left", "more", "first", "parts", "nbytes", "out", "queued", "writing",
    )  # fmt: skip

    def __init__(self, sock: socket.socket, peer: Peer, epoll, cap: int, on_ready: Callable, now: float):
        self.sock, self.fd, self.peer, self.epoll = sock, sock.fileno(), peer, epoll
        self.cap, self.on_ready = cap, on_ready
        self.state, self.since = GREETING_WAIT, now
        self.identity: bytes | None = None  # None before READY, and once another took it over
        self.head = bytearray()  # the greeting or a frame's head, while incomplete
        self.kind, self.body, self.have, self.left, self.more = _PART, None, 0, 0, False
        self.first = None  # the message's first frame once read (later parts are only counted)
        self.parts = self.nbytes = 0
        self.out: collections.deque = collections.deque()  # what the kernel did not take yet
        self.queued = 0  # its bytes
        self.writing = False  # registered for EPOLLOUT

    # ---- reading --------------------------------------------------------------------------------------
    def read(self, buf: bytearray, view: memoryview, out: list) -> bool:
        try:
            if self.left >= LAZY_BYTES and self.body is not None:  # straight into the frame
                n = self.sock.recv_into(self.body[self.have :], min(self.left, 4 * READ_BYTES))
                if n:
                    self.have += n
                    self.left -= n
                    return bool(self.left) or self._frame_done(out)
            else:
                n = self.sock.recv_into(buf, READ_BYTES)
                if n:
                    return self._feed(view[:n], out)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        return False  # the end

    def _feed(self, data: memoryview, out: list) -> bool:
        i, n = 0, len(data)
        while i < n:
            if self.left:  # in a frame's body
                take = min(self.left, n - i)
                if self.body is not None:
                    self.body[self.have : self.have + take] = data[i : i + take]
                self.have += take
                self.left -= take
                i += take
                if not self.left and not self._frame_done(out):
                    return False
                continue
            if self.state == GREETING_WAIT:
                take = min(64 - len(self.head), n - i)
                self.head += data[i : i + take]
                i += take
                if len(self.head) == 64 and not self._greeted():
                    return False
                continue
            if not self.head and n - i >= 2 and (not data[i] & LONG or n - i >= 9):
                flags = data[i]
                if flags & LONG:
                    size, i = int.from_bytes(data[i + 1 : i + 9], "big"), i + 9
                else:
                    size, i = data[i + 1], i + 2
            else:
                self.head.append(data[i])  # a head split across reads
                i += 1
                if len(self.head) < (9 if self.head[0] & LONG else 2):
                    continue
                flags, size = self.head[0], int.from_bytes(self.head[1:], "big")
                self.head.clear()
            if not self._frame_start(flags, size, out):
                return False
        return True

    def _greeted(self) -> bool:
        g = self.head
        if g[0] != 0xFF or not g[9] & 1 or g[10] < 3 or bytes(g[12:32]) != NULL_MECHANISM:
            log.debug("zmtp: closed a connection whose greeting is not ZMTP 3 with NULL security")
            return False
        self.head.clear()
        self.state = READY_WAIT
        return True

    def _frame_start(self, flags: int, size: int, out: list) -> bool:
        self.more = bool(flags & MORE)
        if flags & COMMAND:
            if size > MAX_COMMAND:
                return False
            self.kind, self.body = _COMMAND, bytearray(size)
        elif self.state != OPEN:
            log.debug("zmtp: closed a connection that sent data before its READY")
            return False
        elif self.first is None:
            if size > self.cap:  # never read: the connection goes, as libzmq's MAXMSGSIZE did
                log.debug("zmtp: closed a connection that sent a frame of %d bytes (cap %d)", size, self.cap)
                return False
            lazy = size > LAZY_BYTES
            self.kind, self.body = _FIRST, memoryview(mmap.mmap(-1, size)) if lazy else bytearray(size)
            self.nbytes += size
        else:
            self.kind, self.body = _PART, None  # counted, never held
            self.nbytes += size
        self.have, self.left = 0, size
        return bool(size) or self._frame_done(out)

    def _frame_done(self, out: list) -> bool:
        kind, body = self.kind, self.body
        self.body = None
        if kind == _COMMAND:
            return self._command(memoryview(body))
        if kind == _FIRST:
            self.first = memoryview(body)
        self.parts += 1
        if not self.more:
            if self.identity is not None:  # (an orphan's messages go nowhere)
                extra = None if self.parts == 1 else (self.parts, self.nbytes)
                out.append((self.identity, self.first, self.peer, extra))
            self.first, self.parts, self.nbytes = None, 0, 0
        return True

    def _command(self, body: memoryview) -> bool:
        name = bytes(body[1 : 1 + body[0]]) if body else b""
        if self.state == READY_WAIT:
            props = parse_properties(body[1 + len(name) :]) if name == b"READY" else None
            if props is None or props.get(b"socket-type") not in PEER_TYPES:
                log.debug("zmtp: closed a connection whose handshake is no READY of a DEALER, REQ or ROUTER")
                return False
            self.state = OPEN
            self.on_ready(self, props.get(b"identity", b""))
            return self.write(READY)
        if name == b"PING" and len(body) >= 7:  # name, a 2-byte TTL, then up to 16 bytes of context
            return self.write(command(b"PONG", bytes(body[7:23])))
        return True

    # ---- writing --------------------------------------------------------------------------------------
    def write(self, head: bytes, frame: bytes = b"") -> bool:
        """Send ``head`` and ``frame`` as one message; what the kernel does not take is queued
        (as one entry). False if the connection is gone."""
        if self.out:
            self.out.append(head + frame)
            self.queued += len(head) + len(frame)
            return True
        try:
            if frame:
                n = self.sock.sendmsg((head, frame), (), socket.MSG_NOSIGNAL)
            else:
                n = self.sock.send(head, socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:  # gone: its reads see the end
            return False
        if n < len(head) + len(frame):
            self.out.append(memoryview(head + frame)[n:])
            self.queued += len(head) + len(frame) - n
            self._want_writes(True)
        return True

    def flush(self) -> bool:
        """Write what waits; False if the connection is gone."""
        while self.out:
            data = self.out[0]
            try:
                n = self.sock.send(data, socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            self.queued -= n
            if n < len(data):
                self.out[0] = memoryview(data)[n:]
                return True
            self.out.popleft()
        self._want_writes(False)
        return True

    def _want_writes(self, on: bool) -> None:
        if self.writing != on:
            self.writing = on
            self.epoll.modify(self.fd, select.EPOLLIN | select.EPOLLOUT if on else select.EPOLLIN)
