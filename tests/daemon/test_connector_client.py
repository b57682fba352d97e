"""The engine client's session as a connector meets it, against a real ``tierd serve``: a refused
HELLO says why, a clean close frees the session at once (BYE), an older daemon's UNKNOWN_OP for
BYE is harmless, and a client started before its daemon gets a session when the daemon comes up."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq
from conftest import ROOT, DaemonProcess

from tierd.protocol import codec, messages
from tierd.protocol.errors import ErrorCode
from tierd.tools.testing import serve_argv
from tierd_client import DaemonUnavailable, TierdClient, TierdError
from tierd_client.session import Session


def speak_a_later_protocol(monkeypatch) -> None:
    """Clients made from now on say HELLO as a client from a later release: with a protocol version
    this daemon does not speak."""
    hello_body = Session.hello_body

    def later(session: Session) -> messages.Hello:
        return msgspec.structs.replace(hello_body(session), protocol=999)

    monkeypatch.setattr(Session, "hello_body", later)


def wait_for(pred, timeout: float = 5.0, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    return pred()


def test_a_refused_hello_reaches_the_caller_as_the_daemons_error(daemon, monkeypatch):
    speak_a_later_protocol(monkeypatch)
    c = TierdClient(daemon.endpoint, timeout_s=3)
    try:
        with pytest.raises(TierdError) as err:
            c.wait_ready(5)
        assert not isinstance(err.value, DaemonUnavailable)
        assert err.value.code == ErrorCode.UNSUPPORTED_VERSION.name and "999" in err.value.message
        assert c.refusal is err.value
        # a request without a session says why there is none, not "unknown session"
        with pytest.raises(TierdError) as call_err:
            c.status(timeout=3)
        assert call_err.value.code == ErrorCode.UNSUPPORTED_VERSION.name
    finally:
        c.close()


def test_no_daemon_at_all_is_still_daemon_unavailable(tmp_path):
    c = TierdClient(f"ipc://{tmp_path}/nobody.sock", timeout_s=1, connect_timeout_s=0.2)
    try:
        with pytest.raises(DaemonUnavailable):
            c.wait_ready(1)
        assert c.refusal is None
    finally:
        c.close()


def test_close_says_bye_and_the_daemon_drops_the_session_and_its_leases_at_once(daemon, client_factory):
    admin = client_factory(daemon)
    before = daemon.status()
    c = TierdClient(daemon.endpoint, timeout_s=5)
    c.wait_ready(5)
    ns = {"model": "bye-test", "fingerprint": "f", "world_size": 1, "salt": ""}
    c.lookup(ns, [b"k" * 16], [{"kind": "full", "block_tokens": 16, "window_tokens": 0}], 64)
    assert daemon.status()["sessions"] == before["sessions"] + 1
    t0 = time.monotonic()
    c.close()
    closed_in = time.monotonic() - t0
    # the session is gone at once, not after the 30 s heartbeat timeout (bounds of a few seconds:
    # a CI machine's shared cores stall a process for a second at times)
    assert wait_for(lambda: daemon.status()["sessions"] == before["sessions"], timeout=10)
    assert daemon.status()["sessions_reaped"] == before["sessions_reaped"]
    assert closed_in < 5
    admin.ping()


def _old_daemon(endpoint: str, stop: threading.Event, seen: list[str]) -> None:
    """A daemon from before BYE: HELLO works, BYE is an unknown op."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    try:
        while not stop.is_set():
            if not sock.poll(20):
                continue
            ident, frame = sock.recv_multipart()
            op, req_id, _ = codec.decode_request(frame, 1 << 20)
            seen.append(op)
            if op == "HELLO":  # the fields of a HELLO reply, but for the lookup channel's (it has none)
                hello = messages.HelloReply(1, "0.0.1", "0" * 32, 1, -1, 30.0, 30.0, 1 << 20, "", False)
                body = msgspec.structs.asdict(hello)
                del body["channel_max_bytes"]
                reply = codec.encode_reply(req_id, body)
            else:
                reply = codec.encode_error(req_id, ErrorCode.UNKNOWN_OP, f"unknown op {op!r}")
            sock.send_multipart([ident, reply])
    finally:
        sock.close(linger=0)


def test_close_tolerates_a_daemon_that_does_not_know_bye(tmp_path):
    endpoint, stop, seen = f"ipc://{tmp_path}/old.sock", threading.Event(), []
    t = threading.Thread(target=_old_daemon, args=(endpoint, stop, seen), daemon=True)
    t.start()
    try:
        c = TierdClient(endpoint, timeout_s=2)
        c.wait_ready(5)
        t0 = time.monotonic()
        c.close()  # must neither raise nor hang (its BYE waits 0.5 s at most)
        assert time.monotonic() - t0 < 5
        assert "BYE" in seen
    finally:
        stop.set()
        t.join(5)


def test_a_client_started_before_its_daemon_gets_a_session_when_the_daemon_comes_up(tmp_path):
    """The first HELLO expires (no daemon); a daemon started later must still be greeted."""
    folder = tmp_path / "late"
    folder.mkdir()
    c = TierdClient(f"ipc://{folder}/tierd.sock", timeout_s=3, connect_timeout_s=0.3)
    d = None
    try:
        with pytest.raises(DaemonUnavailable):
            c.wait_ready(1.0)  # the first HELLO has expired by now
        d = DaemonProcess(folder)
        assert wait_for(lambda: c.server is not None, timeout=10), "the late daemon never got a HELLO"
        assert c.ping(timeout=3).boot_id == c.server.boot_id
        assert d.status()["sessions"] == 1
    finally:
        c.close()
        if d is not None:
            d.kill()


def test_a_client_that_connects_while_the_daemon_backs_its_pool_gets_a_session(tmp_path, caplog):
    """A daemon binds its socket first, then backs (and on CUDA hosts pins) its pool: seconds for
    GiBs. A HELLO sent in between expires on a live connection; the client must ask again, and
    wait_ready wait for that answer, instead of reporting no daemon (and never having a session)."""
    sock = tmp_path / "tierd.sock"
    cmd = serve_argv(
        "--l1-size-gb", "4", "--l1-init-size-gb", "4", endpoint=f"ipc://{sock}", http_port=-1
    )  # backing 4 GiB: 0.4 s at 10 GB/s, the handshake answered within 0.1 s meanwhile
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(sock.exists, timeout=30), "the daemon never bound its socket"
        caplog.set_level(logging.INFO, "tierd_client")
        c = TierdClient(f"ipc://{sock}", timeout_s=10, connect_timeout_s=0.1)
        try:
            assert c.wait_ready(60).pid == proc.pid
            assert c.ping().boot_id == c.server.boot_id
        finally:
            c.close()
        assert any("has not answered HELLO yet" in r.getMessage() for r in caplog.records)
    finally:
        proc.terminate()
        proc.wait(15)


def test_wait_ready_waits_through_a_connection_dropped_under_its_hello(tmp_path):
    """The connection closes while the first HELLO is unanswered (a daemon at its connection cap
    closes a new one; a daemon restarting): the socket reconnects by itself and says HELLO again,
    so wait_ready must wait for that answer instead of reporting no daemon at the first close.
    The first peer is a bare ROUTER that takes the HELLO and closes without a word."""
    folder = tmp_path / "dropped"
    folder.mkdir()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{folder}/tierd.sock")
    c = TierdClient(f"ipc://{folder}/tierd.sock", timeout_s=5, connect_timeout_s=30)
    d = None
    try:
        assert router.poll(10_000), "the client never sent its HELLO"
        router.recv_multipart()
        router.close()  # the connection drops with the HELLO in flight
        d = DaemonProcess(folder)
        assert c.wait_ready(20).boot_id == d.status()["boot_id"]
        assert c.ping(timeout=3).boot_id == c.server.boot_id
    finally:
        c.close()
        ctx.term()
        if d is not None:
            d.kill()
