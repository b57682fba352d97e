"""Handing shared memory to the daemon as file descriptors (the daemon side: tierd.edge.fdinbox; the
socket's path and message format: tierd.protocol.sockets).

Memory this process holds open but has no name for (torch's unlinked /dev/shm storages, memfds)
cannot be named by a path the daemon may follow; its descriptors are sent instead, over the Unix
seqpacket socket next to the daemon's ipc:// socket (``PATH.fds``), with a random ticket. The
REGISTER then names them ``{"kind": "fd", "ticket": ticket, "index": i, "offset": ...}``. The
kernel tells the daemon who sent them; only this user's REGISTER can use them.
"""

from __future__ import annotations

import os
import socket

from tierd.protocol.sockets import MAGIC, MAX_FDS_PER_MESSAGE, TICKET_BYTES, inbox_path


def socket_file(url: str) -> str | None:
    """The daemon's socket file for ``url`` (None for tcp:// and abstract ipc://@ names)."""
    if not url.startswith("ipc://") or url.startswith("ipc://@"):
        return None
    return os.path.abspath(url[len("ipc://") :])


def fd_socket_path(url: str) -> str | None:
    """The daemon's descriptor socket for ``url`` (None for tcp:// and abstract ipc://@ names)."""
    path = socket_file(url)
    return None if path is None else inbox_path(path)


def new_ticket() -> bytes:
    return os.urandom(TICKET_BYTES)


def send_fds(url: str, ticket: bytes, fds: list[int], timeout_s: float = 5.0) -> None:
    """Send ``fds`` (in order) under ``ticket``; raises OSError with the daemon's reason."""
    path = fd_socket_path(url)
    if path is None:
        raise OSError(f"{url}: descriptors can only be handed over on an ipc:// socket with a path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        for i in range(0, len(fds), MAX_FDS_PER_MESSAGE):
            socket.send_fds(s, [MAGIC + ticket], fds[i : i + MAX_FDS_PER_MESSAGE])
            reply = s.recv(512)
            if not reply.startswith(b"ok"):
                raise OSError(
                    f"the daemon refused the descriptors: {reply[2:].decode(errors='replace') or 'closed'}"
                )
