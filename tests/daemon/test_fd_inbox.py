"""Shared memory handed to the daemon as descriptors (tierd.edge.fdinbox, tierd_client.fdpass).

The inbox alone (real Unix seqpacket sockets, real memfds, no daemon): what it keeps, for whom,
for how long and how much. Then through a real daemon: a REGISTER by descriptor copies the bytes,
and a ticket is good only for the user whose process sent it (the kernel's SO_PEERCRED), with the
sender's own REGISTER as the negative control.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest
from conftest import DaemonProcess  # noqa: F401 - fixtures from conftest
from kv import keys
from users import make_user, run_as, shared_socket_dir  # noqa: F401 - fixture
from wire import Raw, wait_for

from tierd.edge.fdinbox import FdInbox
from tierd.protocol.sockets import MAGIC
from tierd_client import fdpass
from tierd_client.layouts import block_span, group, layout, namespace

BLOCKS, BLOCK = 32, 256
NBYTES = BLOCKS * BLOCK


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def memfds(sizes: list[int]) -> list[int]:
    out = []
    for n in sizes:
        fd = os.memfd_create("tierd-test", os.MFD_CLOEXEC)
        os.ftruncate(fd, n)
        out.append(fd)
    return out


@pytest.fixture
def inbox(tmp_path):
    made = []

    def make(**kw) -> tuple[FdInbox, str]:
        sock = str(tmp_path / f"t{len(made)}.sock")
        box = FdInbox(fdpass.fd_socket_path("ipc://" + sock), 0o600, **kw)
        made.append(box)
        return box, "ipc://" + sock

    yield make
    for box in made:
        box.close()


# ---- the inbox ----------------------------------------------------------------------------------
def test_descriptors_come_back_in_order_across_messages_to_their_senders_uid_only(inbox):
    box, url = inbox()
    sizes = [4096 * (i + 1) for i in range(600)]  # more than one message's worth (250)
    fds = memfds(sizes)
    ticket = fdpass.new_ticket()
    try:
        fdpass.send_fds(url, ticket, fds)
        assert wait_for(lambda: box.waiting == 600)
        assert box.claim(os.getuid() + 1, ticket) is None  # another uid: nothing, and nothing taken
        assert box.claim(os.getuid(), fdpass.new_ticket()) is None  # another ticket
        got = box.claim(os.getuid(), ticket)
        assert got is not None and [os.fstat(fd).st_size for fd in got] == sizes
        assert box.claim(os.getuid(), ticket) is None  # claimed once
        assert box.waiting == 0
        for fd in got:
            os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("payload", [b"", b"TDF1", b"XXXX" + bytes(16), MAGIC + bytes(15), MAGIC + bytes(17)])
def test_a_malformed_message_is_refused_and_its_descriptors_closed(inbox, payload):
    box, url = inbox()
    before = open_fds()
    (fd,) = memfds([4096])
    path = fdpass.fd_socket_path(url)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(5)
        s.connect(path)
        socket.send_fds(s, [payload or b"\0"], [fd])
        reply = s.recv(512)
    os.close(fd)
    assert reply.startswith(b"er"), reply
    assert box.waiting == 0 and box.refused == 1
    assert wait_for(lambda: open_fds() <= before), "the inbox kept a refused descriptor open"
    # control: the same descriptor with a proper message is kept
    (fd,) = memfds([4096])
    fdpass.send_fds(url, fdpass.new_ticket(), [fd])
    os.close(fd)
    assert box.waiting == 1


def test_unclaimed_descriptors_are_closed_when_their_ticket_expires(inbox):
    box, url = inbox(ttl_s=0.3)
    before = open_fds()
    fds = memfds([4096] * 3)
    ticket = fdpass.new_ticket()
    fdpass.send_fds(url, ticket, fds)
    for fd in fds:
        os.close(fd)
    assert box.waiting == 3
    assert wait_for(lambda: box.waiting == 0), "the ticket never expired"
    assert box.claim(os.getuid(), ticket) is None
    assert wait_for(lambda: open_fds() <= before), "expired descriptors are still open"


def test_a_user_holding_too_many_unclaimed_descriptors_is_refused_more(inbox):
    box, url = inbox(max_per_uid=4)
    fds = memfds([4096] * 5)
    try:
        fdpass.send_fds(url, fdpass.new_ticket(), fds[:3])
        with pytest.raises(OSError, match="already has 3 unclaimed descriptors"):
            fdpass.send_fds(url, fdpass.new_ticket(), fds[3:5])
        assert box.waiting == 3
        fdpass.send_fds(url, fdpass.new_ticket(), fds[3:4])  # within the cap: kept
        assert box.waiting == 4
    finally:
        for fd in fds:
            os.close(fd)


def test_the_descriptor_socket_is_no_more_open_than_the_daemons_socket(inbox):
    box, url = inbox()
    assert os.stat(fdpass.fd_socket_path(url)).st_mode & 0o777 == 0o600
    assert fdpass.fd_socket_path("tcp://127.0.0.1:5555") is None
    assert fdpass.fd_socket_path("ipc://@abstract") is None


# ---- through a daemon ---------------------------------------------------------------------------
def kv_layout(ticket: bytes) -> dict:
    spans = [block_span((BLOCKS, BLOCK), (BLOCK, 1), 1, 0, tensor=0, offset=0)]
    tensors = [{"handle": {"kind": "fd", "ticket": ticket, "index": 0, "offset": 0}, "nbytes": NBYTES}]
    return layout(namespace("fd-model", "fd-test"), 0, 4, tensors, [group("full", 4, spans)])


def round_trip_by_descriptor(endpoint: str) -> tuple[bool, str]:
    """An engine's unnamed memory (a memfd): sent, REGISTERed, block 3 stored and restored into 20."""
    fd = os.memfd_create("kv", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, NBYTES)
        data = np.random.default_rng(os.getpid()).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
        os.pwrite(fd, data, 3 * BLOCK)
        ticket = fdpass.new_ticket()
        fdpass.send_fds(endpoint, ticket, [fd])
        r = Raw(endpoint)
        try:
            r.hello()
            ok, reply = r.call("REGISTER", {"instance": "kv", "layout": kv_layout(ticket)})
            if not ok:
                return False, str(reply)
            key = keys(1)[0]
            r.ok("STORE", {"instance": "kv", "chunks": [{"key": key, "blocks": [[3]]}]})
            got = r.ok("RETRIEVE", {"instance": "kv", "chunks": [{"key": key, "blocks": [[20]]}]})
            return got["ok"] == [True] and os.pread(fd, BLOCK, 20 * BLOCK) == data, "bytes differ"
        finally:
            r.close()
    finally:
        os.close(fd)


def test_a_register_by_descriptor_copies_the_engines_bytes(daemon):
    ok, why = round_trip_by_descriptor(daemon.endpoint)
    assert ok, why


def send_only(endpoint: str) -> bytes:
    fd = os.memfd_create("kv", os.MFD_CLOEXEC)
    os.ftruncate(fd, NBYTES)
    ticket = fdpass.new_ticket()
    fdpass.send_fds(endpoint, ticket, [fd])
    os.close(fd)
    return ticket


def register_ticket(endpoint: str, ticket: bytes) -> tuple[bool, dict]:
    r = Raw(endpoint)
    try:
        r.hello()
        return r.call("REGISTER", {"instance": "kv", "layout": kv_layout(ticket)})
    finally:
        r.close()


def test_another_users_ticket_cannot_be_used(xdaemon, make_user):
    """Descriptors are a capability of the user who sent them; naming their ticket is not enough."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run clients as throwaway users")
    owner, thief = make_user(), make_user()
    ticket = run_as(owner, send_only, xdaemon.endpoint)
    ok, reply = run_as(thief, register_ticket, xdaemon.endpoint, ticket)
    assert not ok and reply["code"] == "LAYOUT_INVALID" and "no descriptors were sent" in reply["message"], (
        reply
    )
    ok, reply = run_as(owner, register_ticket, xdaemon.endpoint, ticket)  # control: its owner may
    assert ok, reply
    ok, why = run_as(thief, round_trip_by_descriptor, xdaemon.endpoint)  # and the other user its own
    assert ok, why


def test_a_descriptor_of_a_disk_file_or_a_read_only_one_is_refused(daemon, tmp_path):
    cases = []
    disk = os.open(tmp_path / "kv", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(disk, NBYTES)
    cases.append((disk, "not tmpfs"))
    mem = os.memfd_create("kv", os.MFD_CLOEXEC)
    os.ftruncate(mem, NBYTES)
    ro = os.open(f"/proc/self/fd/{mem}", os.O_RDONLY)
    cases.append((ro, "not open read-write"))
    rd, wr = os.pipe()
    cases.append((rd, "is on an unlisted mount and is not a memfd"))
    try:
        for fd, why in cases:
            ticket = fdpass.new_ticket()
            fdpass.send_fds(daemon.endpoint, ticket, [fd])
            ok, reply = register_ticket(daemon.endpoint, ticket)
            assert not ok and reply["code"] == "LAYOUT_INVALID" and why in reply["message"], (why, reply)
        ok, why = round_trip_by_descriptor(daemon.endpoint)  # control
        assert ok, why
    finally:
        for fd in (disk, mem, ro, rd, wr):
            os.close(fd)
