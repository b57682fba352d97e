"""Who sent a message, as the kernel says (not as the client claims).

On an ``ipc://`` endpoint libzmq reads the connecting process's credentials with SO_PEERCRED
when the connection is accepted and attaches them to every message it receives on it as the
``Peer-Address`` property: ``"<host>:<uid>:<gid>:<pid>"``. A client cannot forge them. On
``tcp://`` there are none: the peer is only an address, and the tenant comes from a token.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

NO_UID = -1  # a tcp:// peer: no kernel credentials


@dataclass(frozen=True)
class Peer:
    uid: int
    gid: int
    pid: int
    address: str = ""

    @property
    def local(self) -> bool:
        """Credentials from the kernel (an ipc:// connection)."""
        return self.uid != NO_UID


UNKNOWN = Peer(NO_UID, NO_UID, 0)
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_peer(sock: socket.socket) -> Peer:
    """The credentials of a Unix socket's other end (SO_PEERCRED); UNKNOWN for other sockets."""
    if sock.family != socket.AF_UNIX:
        return UNKNOWN
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return Peer(uid, gid, pid)


def parse_peer_address(text: str | None, ipc: bool = True) -> Peer:
    """``Peer-Address`` as libzmq sets it: ``host:uid:gid:pid`` on ipc://, an address on tcp://
    (never parsed for credentials: an IPv6 address has colons too)."""
    if not text:
        return UNKNOWN
    if not ipc:
        return Peer(NO_UID, NO_UID, 0, text)
    parts = text.rsplit(":", 3)
    if len(parts) == 4:
        try:
            uid, gid, pid = int(parts[1]), int(parts[2]), int(parts[3])
        except ValueError:
            return Peer(NO_UID, NO_UID, 0, text)
        if uid >= 0 and gid >= 0 and pid > 0:
            return Peer(uid, gid, pid, parts[0])
    return Peer(NO_UID, NO_UID, 0, text)
