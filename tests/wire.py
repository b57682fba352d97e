"""A raw ZeroMQ DEALER that speaks the wire protocol by hand: for malformed input, silent clients
and deadlines the real client would never send."""

from __future__ import annotations

import itertools
import os
import time
import uuid

import msgpack
import zmq

from tierd.protocol import PROTOCOL_VERSION


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def request(op, req_id, body) -> bytes:
    return pack([op, req_id, body])


class Raw:
    """One DEALER connection. ``call`` sends a request and returns ``(ok, body)`` of its reply."""

    def __init__(self, endpoint: str, identity: bytes | None = None):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity or uuid.uuid4().bytes)
        self.sock.connect(endpoint)
        self.ids = itertools.count(1000)

    def send(self, frame: bytes) -> None:
        self.sock.send(frame)

    def send_request(self, op, body, req_id: int | None = None) -> int:
        req_id = next(self.ids) if req_id is None else req_id
        self.send(request(op, req_id, body))
        return req_id

    def recv(self, timeout: float = 10.0) -> list:
        """The next reply, decoded: ``[req_id, ok, body]``."""
        msg = msgpack.unpackb(self.next_frame(timeout), raw=False)
        assert isinstance(msg, list) and len(msg) == 3, msg
        assert isinstance(msg[1], bool) and isinstance(msg[2], dict), msg
        if not msg[1]:
            assert set(msg[2]) == {"code", "message"}, msg
            assert isinstance(msg[2]["message"], str) and msg[2]["message"], msg
        return msg

    def next_frame(self, timeout: float) -> bytes:
        """The next reply's frame (TimeoutError if none comes within ``timeout``)."""
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no reply within {timeout} s")
        parts = self.sock.recv_multipart()
        assert len(parts) == 1, f"a reply is one frame, got {len(parts)}"
        return parts[0]

    def quiet(self, timeout: float = 0.2) -> bool:
        """Whether nothing more arrives within ``timeout``."""
        return not self.sock.poll(int(timeout * 1000))

    def call(self, op, body, timeout: float = 10.0) -> tuple[bool, dict]:
        req_id = self.send_request(op, body)
        got, ok, reply = self.recv(timeout)
        assert got == req_id, f"reply to {got}, expected {req_id}"
        return ok, reply

    def ok(self, op, body, timeout: float = 10.0) -> dict:
        ok, reply = self.call(op, body, timeout)
        assert ok, f"{op} failed: {reply}"
        return reply

    def error(self, op, body, timeout: float = 10.0) -> str:
        ok, reply = self.call(op, body, timeout)
        assert not ok, f"{op} unexpectedly succeeded: {reply}"
        return reply["code"]

    def hello(self, **extra) -> dict:
        return self.ok(
            "HELLO", {"protocol": PROTOCOL_VERSION, "client": "raw-test", "pid": os.getpid(), **extra}
        )

    def close(self) -> None:
        self.sock.close(linger=0)


def wait_for(pred, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Poll ``pred`` until it returns something truthy; returns that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
