"""The lookup channel (docs/protocol.md section 2.1): a Unix seqpacket socket ``PATH.lookup`` next to
the ipc:// endpoint ``PATH`` that carries LOOKUP and PING round trips without ZeroMQ.

Why: a ZeroMQ ipc:// message crosses a libzmq I/O thread on each side, each way, so a bare pyzmq
echo of a LOOKUP's frame takes longer at p50 and at p99 than the same frame over a seqpacket socket
(``benchmarks/lookup_latency.py`` prints both floors, ``floor_echo_*`` and ``floor_channel_echo_*``).
The engine's scheduler waits on LOOKUP; everything else stays on the ROUTER.

Wire: a connection's first message is the ZeroMQ routing identity of the client's session
(1..255 bytes), answered with the reply frame ``[0, true, {}]`` once accepted. Every later
message is one request frame ``[op, req_id, body]``, answered on the same connection with one
reply frame, exactly as on the ROUTER. The kernel names the sender (SO_PEERCRED), and each
request is held to the session it names as a ROUTER message is (UNKNOWN_SESSION, FORBIDDEN).
Only CHANNEL_OPS are served; any other op is answered BAD_REQUEST.

Bounds: at most ``max_conns`` connections (one more is closed unanswered), messages of at most
``max_bytes`` (a longer one is answered TOO_LARGE), and non-blocking both ways: a reply the
client's queue cannot take is dropped and counted (its deadline covers it), as the ROUTER
drops one past its high-water mark. Everything runs on the daemon's main loop, which polls the
listening socket and every connection with its ROUTER.
"""

from __future__ import annotations

import logging
import socket

import zmq

from tierd.edge.endpoint import listen_seqpacket, unlink_socket
from tierd.edge.peer import Peer, socket_peer
from tierd.protocol import codec
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.sockets import CHANNEL_OPS, channel_path  # noqa: F401 - channel_path: re-exported

log = logging.getLogger("tierd")

MAX_BYTES = 256 << 10  # a 2048-key LOOKUP is ~40 KiB; clients send larger frames on the ROUTER
MAX_IDENTITY = 255  # ZeroMQ's limit for a routing identity
ATTACHED = codec.encode_reply(0, {})


class Channel:
    """One connection: its kernel credentials and the session identity its first message named."""

    __slots__ = ("sock", "fd", "peer", "identity")

    def __init__(self, sock: socket.socket, peer: Peer):
        self.sock, self.fd, self.peer = sock, sock.fileno(), peer
        self.identity: bytes | None = None

    def send(self, frame: bytes) -> bool:
        """Queue one reply without waiting; False if the client's queue is full or it is gone."""
        try:
            self.sock.send(frame, socket.MSG_NOSIGNAL)  # (a peer gone: EPIPE, never SIGPIPE)
            return True
        except OSError:  # full (BlockingIOError) or gone: its reads see the end
            return False


class ChannelServer:
    def __init__(self, path: str, mode: int, max_conns: int, max_bytes: int = MAX_BYTES):
        self.path, self.max_conns, self.max_bytes = path, max_conns, max_bytes
        self.sock = listen_seqpacket(path, mode)
        self.fd = self.sock.fileno()
        self.conns: dict[int, Channel] = {}  # fd -> channel
        self._buf = bytearray(max_bytes)
        self._view = memoryview(self._buf)
        self._poller = None
        self.requests = 0  # request frames read
        self.refused = self.dropped = 0  # connections over the cap; replies nobody could take

    def watch(self, poller) -> None:
        """Poll the listening socket (and every connection from now on) with ``poller``."""
        self._poller = poller
        poller.register(self.fd, zmq.POLLIN)

    def accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the backlog waits, the loop goes on
                log.warning("lookup channel: accept failed: %s", exc.strerror)
                return
            if len(self.conns) >= self.max_conns:
                self.refused += 1
                conn.close()
                continue
            conn.setblocking(False)
            channel = Channel(conn, socket_peer(conn))
            self.conns[channel.fd] = channel
            if self._poller is not None:
                self._poller.register(channel.fd, zmq.POLLIN)

    def receive(self, channel: Channel, limit: int) -> list[bytes | ProtocolError]:
        """Up to ``limit`` request frames read from ``channel``, a frame over ``max_bytes`` as its
        TOO_LARGE error (its identity message is answered here). A connection that ended, or whose
        first message is no identity, is closed."""
        frames: list[bytes | ProtocolError] = []
        while len(frames) < limit:
            try:
                n = channel.sock.recv_into(self._buf, self.max_bytes, socket.MSG_TRUNC)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                n = 0
            if n == 0:  # the end (or an empty message, which no client sends)
                self.close_channel(channel)
                break
            if channel.identity is None:
                if n > MAX_IDENTITY:
                    self.close_channel(channel)
                    break
                channel.identity = bytes(self._view[:n])
                channel.send(ATTACHED)
                continue
            if n > self.max_bytes:  # read in part: answered by its head's req_id
                frames.append(
                    ProtocolError(
                        ErrorCode.TOO_LARGE,
                        f"a lookup channel message is at most {self.max_bytes} bytes, got {n}: "
                        "send it on the ZeroMQ socket",
                        req_id=codec.peek_req_id(self._buf),
                    )
                )
                continue
            frames.append(bytes(self._view[:n]))
            self.requests += 1
        return frames

    def close_channel(self, channel: Channel) -> None:
        if self.conns.pop(channel.fd, None) is None:
            return
        if self._poller is not None:
            self._poller.unregister(channel.fd)
        channel.sock.close()

    def close(self) -> None:
        for channel in list(self.conns.values()):
            self.close_channel(channel)
        if self._poller is not None:
            self._poller.unregister(self.fd)
        self.sock.close()
        unlink_socket(self.path)
