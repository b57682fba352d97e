"""The descriptor inbox (tierd.edge.fdinbox) outlives anything one connection does to it.

It is one thread; if it ended, no engine could hand its CPU KV memory over until the daemon
restarts. Hostile messages (credentials instead of descriptors, too many descriptors, an empty or
oversized message, a socket passed to itself, a connection that closes at once) are each refused
or dropped, and a good client is served afterwards, through a real daemon. An exception while
serving one connection drops that connection and closes that message's descriptors; the thread
serves on.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import time

from conftest import DaemonProcess  # noqa: F401 - fixtures from conftest
from test_fd_inbox import memfds, open_fds, round_trip_by_descriptor
from wire import wait_for

from tierd.edge.fdinbox import MAGIC, MAX_FDS_PER_MESSAGE, FdInbox
from tierd_client import fdpass

GOOD = MAGIC + bytes(16)


def hostile(path: str, send) -> bytes:
    """Connect to the inbox at ``path``, let ``send`` do its worst, return what came back (b"" if
    the inbox closed the connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(5)
        s.connect(path)
        send(s)
        try:
            return s.recv(512)
        except (TimeoutError, ConnectionResetError):
            return b"<no reply>"


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_hostile_messages_are_refused_and_the_inbox_serves_a_good_client_after(daemon):
    path = fdpass.fd_socket_path(daemon.endpoint)
    ok, why = round_trip_by_descriptor(daemon.endpoint)  # the daemon's descriptors settle
    assert ok, why
    before = daemon_fds(daemon.proc.pid)
    (fd,) = memfds([4096])
    creds = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())
    too_many = array.array("i", [fd] * (MAX_FDS_PER_MESSAGE + 1))
    cases = {
        "credentials, no descriptors": lambda s: s.sendmsg(
            [GOOD], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)]
        ),
        "one descriptor more than a message may carry": lambda s: s.sendmsg(
            [GOOD], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, too_many)]
        ),
        "a message over the read size": lambda s: socket.send_fds(s, [b"x" * 100_000], [fd]),
        "its own socket as the descriptor": lambda s: socket.send_fds(s, [b"X" + GOOD[1:]], [s.fileno()]),
        "an empty message": lambda s: s.send(b""),
    }
    got = {name: hostile(path, send) for name, send in cases.items()}
    os.close(fd)
    assert got["credentials, no descriptors"] == b"erno descriptors came with the message"
    assert got["one descriptor more than a message may carry"] == (
        f"ermore than {MAX_FDS_PER_MESSAGE} descriptors in one message".encode()
    )
    assert got["a message over the read size"].startswith(b"era message is")
    assert got["its own socket as the descriptor"].startswith(b"era message is")
    assert got["an empty message"] == b""  # (read as the end: the connection is closed)
    for _ in range(20):  # connections that end at once
        socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).connect(path)
    inbox = daemon.status()["fd_inbox"]
    assert inbox["waiting"] == 0 and inbox["refused"] == 4, inbox
    assert wait_for(lambda: daemon_fds(daemon.proc.pid) <= before, timeout=5), (
        "the daemon kept descriptors of refused messages open"
    )
    ok, why = round_trip_by_descriptor(daemon.endpoint)  # a good client, served
    assert ok, why


class FaultyInbox(FdInbox):
    """The inbox with one fault planted: a message whose ticket is POISON raises in its handler, as
    a bug in it would (no message a client can send raises there today)."""

    POISON = b"\xff" * 16

    def _deposit(self, uid, data, fds, flags):
        if data == MAGIC + self.POISON:
            raise RuntimeError("a handler bug")
        return super()._deposit(uid, data, fds, flags)


def test_an_exception_serving_one_connection_drops_it_and_the_inbox_serves_on(tmp_path):
    url = f"ipc://{tmp_path}/t.sock"
    box = FaultyInbox(fdpass.fd_socket_path(url), 0o600)
    try:
        before = open_fds()
        for _ in range(3):
            (fd,) = memfds([4096])
            got = hostile(box.path, lambda s, fd=fd: socket.send_fds(s, [MAGIC + FaultyInbox.POISON], [fd]))
            os.close(fd)
            assert got == b"", "the connection whose message raised was not dropped"
        assert wait_for(lambda: box.failed == 3, timeout=5)
        assert wait_for(lambda: open_fds() <= before, timeout=5), "the raising message's descriptor leaked"
        fds = memfds([4096, 8192])
        ticket = fdpass.new_ticket()
        fdpass.send_fds(url, ticket, fds)  # raises unless answered "ok"
        for fd in fds:
            os.close(fd)
        got = box.claim(os.getuid(), ticket)
        assert got is not None and [os.fstat(fd).st_size for fd in got] == [4096, 8192]
        for fd in got:
            os.close(fd)
    finally:
        t0 = time.monotonic()
        box.close()
        assert time.monotonic() - t0 < 5
