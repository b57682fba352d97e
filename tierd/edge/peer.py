"""Who sent a message, as the kernel says (not as the client claims).

On an ``ipc://`` endpoint the daemon reads the connecting process's credentials with
SO_PEERCRED when it accepts the connection (tierd.edge.zmtp, the lookup channel, the fd inbox), and
every message read on it carries them. A client cannot forge them. On
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
