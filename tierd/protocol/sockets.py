"""Where a daemon listens, and what its two side sockets expect (docs/protocol.md sections 2.1
and 21). Both sides derive every path from the one ``--socket`` URL: the ZeroMQ ipc:// endpoint
``PATH``, the lookup channel ``PATH.lookup`` (tierd.edge.channel serves it), the descriptor inbox
``PATH.fds`` (tierd.edge.fdinbox serves it)."""

from __future__ import annotations

import os


def default_socket() -> str:
    """ipc:// under $XDG_RUNTIME_DIR/tierd (systemd's RuntimeDirectory), else /tmp/tierd-<uid>."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = os.path.join(base, "tierd") if base else f"/tmp/tierd-{os.getuid()}"
    return f"ipc://{folder}/tierd.sock"


# ---- the lookup channel: LOOKUP and PING over a Unix seqpacket socket, without ZeroMQ -------------
CHANNEL_OPS = ("LOOKUP", "PING")
CHANNEL_SUFFIX = ".lookup"


def channel_path(socket_file: str) -> str:
    return socket_file + CHANNEL_SUFFIX


# ---- the descriptor inbox: MAGIC + a ticket, with the descriptors as SCM_RIGHTS ---------------------
INBOX_SUFFIX = ".fds"
MAGIC = b"TDF1"
TICKET_BYTES = 16
MAX_FDS_PER_MESSAGE = 250  # the kernel's SCM_MAX_FD is 253


def inbox_path(socket_file: str) -> str:
    return socket_file + INBOX_SUFFIX
