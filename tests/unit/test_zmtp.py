"""The daemon's ZeroMQ endpoint (tierd/zmtp) in this process, with real sockets: libzmq DEALERs
and raw Unix streams that speak ZMTP byte by byte. What a client sees of it (a libzmq ROUTER),
and what a client cannot make it do (hold a message past one cap, keep a half-made connection,
talk to it as another socket type)."""

from __future__ import annotations

import os
import select
import socket
import threading
import time

import pytest
import zmq

from tierd.edge.zmtp import Router
from tierd.edge.zmtp.conn import GREETING, MORE, OPEN, READY, command, frame_head, properties
from tierd.edge.zmtp.router import HANDSHAKE_S, SEND_QUEUE, SEND_QUEUE_BYTES, TURN_EVENTS

CAP = 1 << 20


@pytest.fixture
def router(tmp_path):
    r = Router(CAP)
    r.path = str(tmp_path / "z.sock")
    r.bind(f"ipc://{r.path}")
    yield r
    r.close()


def turns(router: Router, seconds: float, until=None) -> list:
    """Run the router's turns for ``seconds`` (or until ``until(messages)``); the messages read."""
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        select.select([router.fd], [], [], 0.01)
        got += router.messages()
        if until is not None and until(got):
            break
    return got


def dealer(router: Router, identity: bytes = b"", **options) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if identity:
        s.setsockopt(zmq.IDENTITY, identity)
    for name, value in options.items():
        s.setsockopt(getattr(zmq, name), value)
    s.connect(f"ipc://{router.path}")
    return s


def raw(router: Router, socket_type: bytes = b"DEALER", identity: bytes = b"") -> socket.socket:
    """A Unix stream that has sent its greeting and READY (nothing read yet)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(router.path)
    s.sendall(GREETING + command(b"READY", properties({b"Socket-Type": socket_type, b"Identity": identity})))
    return s


def closed_by_peer(s: socket.socket, router: Router, seconds: float = 2.0) -> bool:
    """The router closed ``s`` (what it sent before is read and ignored)."""
    end = time.monotonic() + seconds
    s.settimeout(0.01)
    while time.monotonic() < end:
        turns(router, 0.01)
        try:
            if s.recv(1 << 16) == b"":
                return True
        except TimeoutError:
            pass
        except ConnectionResetError:
            return True
    return False


def test_a_dealer_is_answered_with_its_identity_and_its_kernel_credentials(router):
    d = dealer(router, b"client-1")
    d.send(b"hello")
    ((identity, frame, peer, extra),) = turns(router, 5, until=bool)
    assert (identity, bytes(frame), extra) == (b"client-1", b"hello", None)
    assert (peer.uid, peer.gid, peer.pid) == (os.getuid(), os.getgid(), os.getpid())
    assert router.send(b"client-1", b"world")
    assert d.poll(5000) and d.recv() == b"world"
    anonymous = dealer(router)
    anonymous.send(b"x")
    ((made, *_),) = turns(router, 5, until=bool)
    assert len(made) == 5 and made[0] == 0  # made here, as libzmq makes them
    d.close()
    anonymous.close()


def test_frames_split_across_reads_byte_by_byte_are_read_whole(router):
    """Short and long (8-byte size) frames, and a message of two parts, one byte per send."""
    s = raw(router, identity=b"slow")
    long_body = os.urandom(300)
    wire = frame_head(5) + b"short" + frame_head(len(long_body)) + long_body
    wire += frame_head(1, MORE) + b"a" + frame_head(2) + b"bc"
    got = []
    for i in range(len(wire)):
        s.send(wire[i : i + 1])
        got += turns(router, 0.002)
    got += turns(router, 2, until=lambda m: len(got) + len(m) >= 3)
    assert [(bytes(f), extra) for _, f, _, extra in got] == [
        (b"short", None),
        (long_body, None),
        (b"a", (2, 3)),
    ]
    s.close()


def test_a_message_of_many_parts_is_counted_not_held(router):
    """Its first frame is kept; 64 later parts of 512 KiB each (64 caps in all) only counted."""
    s = raw(router)
    s.settimeout(None)
    part = bytes(512 << 10)
    sender = threading.Thread(
        target=lambda: s.sendall(
            frame_head(3, MORE) + b"one" + (frame_head(len(part), MORE) + part) * 64 + frame_head(0)
        )
    )
    sender.start()
    ((_, first, _, extra),) = turns(router, 30, until=bool)
    sender.join()
    assert bytes(first) == b"one" and extra == (66, 3 + 64 * len(part))
    s.close()


def test_a_frame_over_the_cap_closes_the_connection_before_it_is_read(router):
    s = raw(router)
    s.sendall(frame_head(CAP + 1))  # its size only: closed on that
    assert closed_by_peer(s, router)
    assert router.connections == 0


@pytest.mark.parametrize(
    "first_bytes",
    [b"GET / HTTP/1.1\r\n\r\n" + bytes(64), b"\xff" + bytes(8) + b"\x7f\x03\x01PLAIN" + bytes(64)],
    ids=["not-zmtp", "plain-security"],
)
def test_a_connection_that_does_not_greet_as_zmtp_3_with_null_security_is_closed(router, first_bytes):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(router.path)
    s.sendall(first_bytes)
    assert closed_by_peer(s, router)


def test_a_socket_type_a_router_does_not_talk_to_is_closed(router):
    s = raw(router, socket_type=b"PUB")
    assert closed_by_peer(s, router)
    control = raw(router, socket_type=b"REQ")
    assert not closed_by_peer(control, router, 0.3)


def test_a_connection_that_never_finishes_its_handshake_is_closed_after_the_handshake_time(router):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(router.path)
    s.sendall(GREETING)  # and no READY
    turns(router, 0.2)
    router.sweep(time.monotonic() + HANDSHAKE_S / 2)
    assert router.connections == 1
    router.sweep(time.monotonic() + HANDSHAKE_S + 1)
    assert router.connections == 0 and closed_by_peer(s, router)


def test_zmtp_heartbeats_are_answered(router):
    """A DEALER that pings every 100 ms and gives up after 1 s without an answer stays."""
    d = dealer(router, b"hb", HEARTBEAT_IVL=100, HEARTBEAT_TIMEOUT=1000)
    monitor = d.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    turns(router, 2.5)
    assert not monitor.poll(0), "the DEALER gave up on unanswered heartbeats"
    d.send(b"still")
    assert [bytes(f) for _, f, *_ in turns(router, 5, until=bool)] == [b"still"]
    d.disable_monitor()
    monitor.close(0)
    d.close()


def test_replies_the_kernel_cannot_take_at_once_are_queued_and_come_in_order(router):
    d = dealer(router, b"busy", RCVHWM=1, RCVBUF=4096)  # its libzmq thread stops reading at once
    d.send(b"go")
    turns(router, 5, until=bool)
    replies = [i.to_bytes(4, "big") * (16 << 10) for i in range(64)]  # 4 MiB in 64 KiB replies
    assert all(router.send(b"busy", r) for r in replies)
    assert router.conns[router.routes[b"busy"].fd].out, "nothing was queued: send more"
    got = []
    while len(got) < len(replies):
        turns(router, 0.01)
        while d.poll(0):
            got.append(d.recv())
    assert got == replies
    d.close()


@pytest.mark.parametrize("reply_bytes", [16 << 10, 1 << 20], ids=["count", "bytes"])
def test_a_reply_past_the_queue_bound_is_dropped(router, reply_bytes):
    """Small replies fill the queue's count first, large ones its bytes."""
    s = raw(router, identity=b"deaf")  # never reads
    turns(router, 0.2)
    sent = 0
    while router.send(b"deaf", bytes(reply_bytes)):
        sent += 1
        assert sent <= SEND_QUEUE + 4096, "the queue never filled"
    c = router.routes[b"deaf"]
    assert router.dropped == 1
    if reply_bytes < SEND_QUEUE_BYTES // SEND_QUEUE:
        assert len(c.out) == SEND_QUEUE and c.queued < SEND_QUEUE_BYTES
    else:
        assert len(c.out) < SEND_QUEUE and SEND_QUEUE_BYTES <= c.queued < SEND_QUEUE_BYTES + reply_bytes + 16
    assert not router.send(b"nobody", b"x") and router.dropped == 2
    s.close()


def test_a_new_connection_with_an_identity_in_use_takes_it_over_and_the_old_one_is_orphaned(router):
    old = dealer(router, b"same")
    old.send(b"from-old")
    turns(router, 5, until=bool)
    new = dealer(router, b"same")
    new.send(b"from-new")
    assert [bytes(f) for _, f, *_ in turns(router, 5, until=bool)] == [b"from-new"]
    old.send(b"orphaned")
    assert turns(router, 0.3) == []  # read and let go
    router.send(b"same", b"reply")
    assert new.poll(5000) and new.recv() == b"reply"
    old.close()
    turns(router, 0.3)
    assert router.ended() == []  # the identity lives on the new connection
    new.close()
    turns(router, 0.3)
    assert router.ended() == [(b"same", os.getuid())]


def test_handshakes_are_answered_while_the_daemon_is_busy_and_requests_wait_for_its_loop(router):
    d = dealer(router, b"early")
    monitor = d.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    seen = {}

    def busy() -> None:  # the daemon backing its pool
        seen["handshake"] = bool(monitor.poll(5000))
        d.send(b"hello")
        time.sleep(0.3)

    router.handshakes_during(busy)
    assert seen["handshake"], "no handshake while the daemon was busy"
    assert [bytes(f) for _, f, *_ in turns(router, 5, until=bool)] == [b"hello"]
    d.disable_monitor()
    monitor.close(0)
    d.close()


def test_the_router_answers_a_ready_with_its_own(router):
    s = raw(router)
    turns(router, 0.2)
    answer = s.recv(1 << 10)
    assert answer == GREETING + READY
    s.close()


def test_one_turn_reads_at_most_turn_events_connections_and_the_rest_the_next(router):
    """So a turn holds at most TURN_EVENTS x 256 KiB of new messages, however many connections."""
    n = TURN_EVENTS + 8
    socks = [raw(router, identity=b"c%d" % i) for i in range(n)]
    turns(
        router,
        1.0,
        until=lambda _: all(c.state == OPEN for c in router.conns.values()) and len(router.conns) == n,
    )
    for s in socks:
        s.sendall(frame_head(2) + b"hi")
    time.sleep(0.2)
    first = router.messages()
    assert 0 < len(first) <= TURN_EVENTS
    rest = turns(router, 2, until=lambda m: len(first) + len(m) >= n)
    assert sorted(i for i, *_ in first + rest) == sorted(b"c%d" % i for i in range(n))
    for s in socks:
        s.close()


def test_an_identity_a_peer_names_with_a_leading_zero_byte_is_its_own(router):
    """libzmq lets a DEALER name one (its clients' random identities start with zero 1 time in 256):
    replacing it would leave the client's lookup channel and fd inbox naming a session that is not
    there."""
    d = dealer(router, b"\0zero-led")
    d.send(b"x")
    ((identity, *_),) = turns(router, 5, until=bool)
    assert identity == b"\0zero-led"
    d.close()


def test_a_connection_that_ends_while_its_requests_wait_for_the_loop_is_closed_then(router):
    """While the daemon is busy, a client that sent a request and left is closed at once (not
    polled again and again until the loop runs); nothing of it is handed on."""
    s = raw(router, identity=b"leaver")
    seen = {}

    def busy() -> None:
        assert s.recv(len(GREETING) + len(READY)), "no handshake while busy"
        s.sendall(frame_head(2) + b"hi")
        time.sleep(0.1)
        s.close()
        end = time.monotonic() + 3
        while router.connections and time.monotonic() < end:
            time.sleep(0.02)
        seen["open"] = router.connections

    router.handshakes_during(busy)
    assert seen["open"] == 0
    assert turns(router, 0.3) == [] and router.ended() == [(b"leaver", os.getuid())]
