"""What one ZeroMQ message of many parts costs a real ``tierd serve`` (docs/protocol.md sections 2
and 19): a request is one frame, so a message of more parts is refused, TOO_LARGE when its parts
sum past the message cap (2 x --max-frame-mb). The daemon reads the wire itself (tierd.edge.zmtp): it
holds a message's first frame and counts the later parts as they stream past, so a message of
any number of parts costs it at most one cap. The control: a bare libzmq ROUTER given the same
message holds all of it before its first part can be read (ZeroMQ delivers messages whole;
MAXMSGSIZE bounds each part, not their sum). The lookup channel and the fd inbox read each
message into a buffer of their own fixed size: a message far over it costs the daemon nothing.
And tierd_client keeps within what one request may ask (section 19): a STORE or RETRIEVE of more
than MAX_REQUEST_PARTS goes as several requests (the bounds themselves: tests/unit/test_request_bounds.py)."""

from __future__ import annotations

import socket
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import zmq
from kv import FakeRank, GroupGeom, keys
from util import chunk, raw  # noqa: F401 - fixture
from wire import request

from tierd.edge.channel import MAX_BYTES
from tierd.protocol import MAX_REQUEST_PARTS, messages
from tierd.protocol.sockets import CHANNEL_SUFFIX, MAGIC

MIB = 1 << 20
CAP = 2 * 16 * MIB  # the message cap of a default daemon (--max-frame-mb 16)
PING = request("PING", 7, {})
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)  # Linux's number; Python names it from 3.12

BARE_ROUTER = """
import sys, zmq
r = zmq.Context().socket(zmq.ROUTER)
r.setsockopt(zmq.MAXMSGSIZE, int(sys.argv[2]))
r.bind(sys.argv[1])
def kib(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
print(kib("VmRSS:"), flush=True)
assert r.poll(120000), "no message"
print(kib("VmHWM:"), flush=True)  # the whole message is in libzmq's hands; no part was read
"""


def kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


def reset_peak(pid: int) -> int:
    """VmHWM starts again from VmRSS (the kernel's clear_refs 5); returns it, KiB."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return kib(pid, "VmHWM:")


def message(parts: int, part_bytes: int) -> list:
    part = zmq.Frame(b"\0" * part_bytes)  # one buffer, sent ``parts`` times: cheap for the sender
    return [part] * parts + [PING]


def send(endpoint: str, msg: list) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send_multipart(msg, copy=False)
    return s


def libzmq_copy_kib(tmp_path, msg: list) -> int:
    """What a bare libzmq ROUTER (same MAXMSGSIZE) holds once the message has arrived, KiB."""
    url = f"ipc://{tmp_path}/bare.sock"
    bare = subprocess.Popen(
        [sys.executable, "-c", BARE_ROUTER, url, str(CAP)], stdout=subprocess.PIPE, text=True
    )
    try:
        before = int(bare.stdout.readline())
        s = send(url, msg)
        after = int(bare.stdout.readline())
        s.close()
    finally:
        bare.kill()
        bare.wait(10)
    return after - before


def daemon_cost_kib(d, msg: list) -> tuple[list, int]:
    """The daemon's reply to ``msg`` and how far its peak memory rose over it, KiB."""
    pid = d.proc.pid
    before = reset_peak(pid)
    s = send(d.endpoint, msg)
    assert s.poll(120_000), "no reply"
    reply = msgpack.unpackb(s.recv(), raw=False)
    s.close()
    return reply, kib(pid, "VmHWM:") - before


def serves_on(d) -> bool:
    """The daemon answers the next request (a PING outside any session: UNKNOWN_SESSION)."""
    s = send(d.endpoint, [request("PING", 8, {})])
    try:
        return bool(s.poll(10_000)) and msgpack.unpackb(s.recv(), raw=False)[0] == 8
    finally:
        s.close()


@pytest.mark.parametrize("parts", [3, 12])
def test_a_message_over_the_cap_in_parts_is_too_large_and_costs_at_most_one_cap(daemon, tmp_path, parts):
    """30 MiB parts and a PING frame: each part under the cap, their sum several times it."""
    msg = message(parts, 30 * MIB)
    reply, rise = daemon_cost_kib(daemon, msg)
    assert reply[:2] == [0, False] and reply[2]["code"] == "TOO_LARGE", reply
    total = parts * 30 * MIB + len(PING)
    assert reply[2]["message"] == (
        f"a message is one frame of at most {CAP} bytes, got {parts + 1} frames, {total} bytes"
    )
    libzmq = libzmq_copy_kib(tmp_path, msg)
    print(
        f"\n{parts} x 30 MiB parts: daemon peak +{rise / 1024:.0f} MiB, "
        f"a bare libzmq ROUTER's copy {libzmq / 1024:.0f} MiB"
    )
    assert libzmq >= parts * 28 * 1024, "the control: libzmq holds the whole message"
    assert rise <= CAP // 1024, f"+{rise} KiB for a message of {parts} x 30 MiB (cap {CAP} bytes)"
    assert serves_on(daemon)


def test_a_message_of_many_empty_parts_costs_the_daemon_nothing(daemon, tmp_path):
    """400,000 empty parts: libzmq keeps ~64 bytes per part (25 MiB); the daemon counts them."""
    msg = message(400_000, 0)
    reply, rise = daemon_cost_kib(daemon, msg)
    assert reply[:2] == [0, False] and reply[2] == {
        "code": "BAD_REQUEST",
        "message": "a request is one frame, got 400001",
    }
    libzmq = libzmq_copy_kib(tmp_path, msg)
    print(f"\n400,000 empty parts: daemon peak +{rise / 1024:.0f} MiB, libzmq's copy {libzmq / 1024:.0f} MiB")
    assert libzmq >= 16 * 1024, "the control: libzmq holds every part"
    assert rise <= 4 * 1024, f"+{rise} KiB for 400,000 empty parts"
    assert serves_on(daemon)


def seqpacket(path: str, sndbuf: int) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, sndbuf)  # past wmem_max (root)
    except PermissionError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    if s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < sndbuf:
        s.close()
        pytest.skip("cannot raise a socket's send buffer here (not root, wmem_max too small)")
    s.settimeout(5)
    s.connect(path)
    return s


def test_a_lookup_channel_message_far_over_its_limit_costs_the_daemon_nothing(daemon, raw):
    """The channel reads each message into one buffer of MAX_BYTES; the kernel drops the rest."""
    r = raw(daemon, b"channel-peer")
    r.hello()
    with seqpacket(str(daemon.socket_file) + CHANNEL_SUFFIX, 8 * MIB) as s:
        s.send(b"channel-peer")
        assert msgpack.unpackb(s.recv(1 << 16), raw=False)[:2] == [0, True]
        before = reset_peak(daemon.proc.pid)
        s.send(request("PING", 41, {"pad": b"\0" * (3 * MIB)}))
        req_id, ok, err = msgpack.unpackb(s.recv(1 << 16), raw=False)
        assert (req_id, ok, err["code"]) == (41, False, "TOO_LARGE")
        rise = kib(daemon.proc.pid, "VmHWM:") - before
        s.send(request("PING", 42, {}))
        assert msgpack.unpackb(s.recv(1 << 16), raw=False)[:2] == [42, True]
    print(f"\na 3 MiB lookup channel message: daemon peak +{rise} KiB")
    assert rise < 2 * MAX_BYTES // 1024, f"+{rise} KiB for a 3 MiB message"


def test_an_fd_inbox_message_far_over_its_size_costs_the_daemon_nothing(daemon):
    """The inbox reads 64 bytes of a message; a 3 MiB one is refused, and nothing of it is kept."""
    with seqpacket(str(daemon.socket_file) + ".fds", 8 * MIB) as s:
        before = reset_peak(daemon.proc.pid)
        s.send(MAGIC + b"\0" * (3 * MIB))
        assert s.recv(512).startswith(b"er")
        rise = kib(daemon.proc.pid, "VmHWM:") - before
    print(f"\na 3 MiB fd inbox message: daemon peak +{rise} KiB")
    assert rise < 1024, f"+{rise} KiB for a 3 MiB message"
    assert daemon.status()["fd_inbox"]["refused"] == 1


SPLIT_BLOCKS = 4 * (MAX_REQUEST_PARTS + 300)  # one block per chunk below: 4-token chunks and blocks


def test_a_store_and_a_retrieve_larger_than_one_request_are_split_by_the_client(
    client_factory, daemon_factory
):
    d = daemon_factory(pool_mb=64)
    client = client_factory(d)
    geom = GroupGeom("full", layers=1, block_bytes=64)
    r = FakeRank([geom], num_blocks=2 * SPLIT_BLOCKS, chunk_tokens=4)
    try:
        client.register("big", r.layout())
        n = MAX_REQUEST_PARTS + 300
        ks = keys(n)
        before = d.status()["stores"]
        res = client.store("big", [chunk(k, [i]) for i, k in enumerate(ks)])
        assert res.results == ["stored"] * n
        assert d.status()["stores"] - before == 2  # two requests
        r.kv[0][:, SPLIT_BLOCKS:] = 0
        out = client.retrieve("big", [chunk(k, [SPLIT_BLOCKS + i]) for i, k in enumerate(ks)])
        assert out == messages.RetrieveReply([True] * n, [])
        np.testing.assert_array_equal(r.kv[0][:, SPLIT_BLOCKS : SPLIT_BLOCKS + n], r.kv[0][:, :n])
    finally:
        r.close()
