"""Malformed input, frames as a raw DEALER sends them: every request gets exactly one reply
carrying a typed error (never INTERNAL), the reply names the request's req_id whenever the frame
lets it be read, and the daemon keeps serving (PING, and a fresh client's round trip) afterwards.
The daemon's objects in this process (tests/inproc.py): each frame handed to its loop as its
ROUTER hands it one (that a client's call fails promptly on a TOO_LARGE answer is
tests/daemon/test_client_deadlines.py's)."""

import os

import msgpack
import numpy as np
import pytest
from inproc import InProcessClient, InProcessRaw
from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures
from wire import pack, request

from tierd.protocol import PROTOCOL_VERSION
from tierd.protocol.errors import ErrorCode

CODES = {c.name for c in ErrorCode}


def one_reply(r, frame):
    r.send(frame)
    msg = r.recv()
    assert r.quiet(0.1), "more than one reply"
    assert msg[1] or msg[2]["code"] in CODES
    return msg


def still_serving(d, ranks):
    r = InProcessRaw(d)
    r.hello()
    assert "time" in r.ok("PING", {})
    c = InProcessClient(d)
    rank = ranks(GroupGeom("full"))
    c.register("fresh", rank.layout())
    k = keys(1)[0]
    assert c.store("fresh", [chunk(k, range(4))]).results == ["stored"]
    assert c.retrieve("fresh", [chunk(k, range(8, 12))]).ok == [True]
    np.testing.assert_array_equal(rank.kv[0][:, 8:12], rank.kv[0][:, 0:4])
    c.unregister("fresh")


UNDECODABLE = [
    b"",
    b"\xc1",  # a byte msgpack never uses
    b"\x93\xa4PING",  # truncated
    bytes(range(256)),
    pack({"op": "PING"}),
    pack(["PING", 1]),
    pack(["PING", 1, {}, 4]),
    pack(["PING", -1, {}]),
    pack(["PING", 2**64 - 1, {}]),
    pack(["PING", "1", {}]),
    pack(["PING", True, {}]),
    pack(["PING", 1.0, {}]),
    pack("PING"),
    pack(None),
    pack(["PING", 1, {1: 2}]),  # non-string map key
    pack(["PING", 1, {}]) + b"\x00",  # trailing data
]


def test_undecodable_frames_get_bad_request(inproc, inraw):
    r = inraw(inproc)
    for frame in UNDECODABLE:
        msg = one_reply(r, frame)
        assert msg[1] is False and msg[2]["code"] == "BAD_REQUEST", frame
    assert r.call("PING", {})[1]["code"] == "UNKNOWN_SESSION"  # still answering
    assert inproc.status()["errors_by_code"]["BAD_REQUEST"] == len(UNDECODABLE)


def test_bad_fields_echo_req_id(inproc, inraw):
    r = inraw(inproc)
    msg = one_reply(r, pack([7, 41, {}]))
    assert msg[0] == 41 and msg[2]["code"] == "BAD_REQUEST"
    msg = one_reply(r, pack(["PING", 42, []]))
    assert msg[0] == 42 and msg[2]["code"] == "BAD_REQUEST"
    msg = one_reply(r, pack(["NOPE", 43, {}]))
    assert msg[0] == 43 and msg[2]["code"] == "UNKNOWN_OP"


def test_requests_before_hello_are_unknown_session(inproc, inraw, ranks):
    r = inraw(inproc)
    rank = ranks(GroupGeom("full"))
    for op, body in [
        ("PING", {}),
        ("STATUS", {}),
        ("CLEAR", {}),
        ("REGISTER", {"instance": "x", "layout": rank.layout()}),
        ("LOOKUP", {"namespace": rank.ns, "keys": keys(1), "groups": rank.specs(), "chunk_tokens": 16}),
        ("STORE", {"instance": "x", "chunks": []}),
        ("RELEASE", {"lease": 1}),
    ]:
        assert r.error(op, body) == "UNKNOWN_SESSION", op
    assert inproc.status()["instances"] == []


def test_hello_with_wrong_protocol_version(inproc, inraw):
    r = inraw(inproc)
    for version in (PROTOCOL_VERSION + 1, 0, 99):
        assert r.error("HELLO", {"protocol": version}) == "UNSUPPORTED_VERSION"
    assert r.error("HELLO", {}) == "BAD_REQUEST"
    assert r.error("HELLO", {"protocol": str(PROTOCOL_VERSION)}) == "BAD_REQUEST"
    assert r.error("PING", {}) == "UNKNOWN_SESSION"  # a refused HELLO opens no session
    assert r.hello()["protocol"] == PROTOCOL_VERSION


def test_oversized_frame_is_too_large_and_answered_to_its_req_id(inproc_factory, inraw, ranks):
    d = inproc_factory("--max-frame-mb", "1")
    r = inraw(d)
    r.hello()
    msg = one_reply(r, request("PING", 77, {"pad": b"x" * (1 << 20)}))
    assert msg[1] is False and msg[2]["code"] == "TOO_LARGE"
    assert msg[0] == 77
    assert r.ok("PING", {})  # the session survives
    # a frame just under the cap is served: a LOOKUP of as many 64-byte keys as fit in it
    rank = ranks(GroupGeom("full"))
    body = {"namespace": rank.ns, "groups": rank.specs(), "chunk_tokens": 16, "lease": False}
    n = ((1 << 20) - 100) // 66
    while len(frame := request("LOOKUP", 78, {**body, "keys": [b"k" * 64] * n})) > (1 << 20) - 100:
        n -= 1
    assert one_reply(r, frame)[1] is True
    still_serving(d, ranks)


def test_msgpack_ext_types_are_rejected(inproc, inraw):
    r = inraw(inproc)
    r.hello()
    for ext in (msgpack.ExtType(5, b"abc"), msgpack.Timestamp(1, 0)):
        msg = one_reply(r, pack(["RELEASE", 55, {"lease": ext}]))
        assert msg[1] is False and msg[2]["code"] == "BAD_REQUEST" and msg[0] == 55
        msg = one_reply(r, pack([ext, 56, {}]))
        assert msg[2]["code"] == "BAD_REQUEST"


def test_out_of_range_block_ids_store_nothing(inproc, inraw, ranks):
    r = inraw(inproc)
    r.hello()
    rank = ranks(GroupGeom("full"), num_blocks=16)
    r.ok("REGISTER", {"instance": "r", "layout": rank.layout()})
    k = keys(1)[0]
    for bad in (
        [0, 1, 2, 16],
        [0, 1, 2, -2],
        [0, 1, 2, 2**40],
        [0, 1, 2, 1.0],
        [0, 1, 2, True],
        [0, 1, 2, "3"],
        [0, 1, 2],
        [0, 1, 2, 3, 4],
        [None] * 4,
    ):
        for op in ("STORE", "RETRIEVE"):
            assert r.error(op, {"instance": "r", "chunks": [chunk(k, bad)]}) == "BAD_REQUEST", (op, bad)
    assert (
        r.error("STORE", {"instance": "r", "chunks": [{"key": b"short", "blocks": [[0, 1, 2, 3]]}]})
        == "BAD_REQUEST"
    )
    assert (
        r.error("STORE", {"instance": "r", "chunks": [{"key": k, "blocks": [[0, 1, 2, 3], [0]]}]})
        == "BAD_REQUEST"
    )
    assert r.error("STORE", {"instance": "nobody", "chunks": []}) == "UNKNOWN_INSTANCE"
    st = inproc.status()
    assert st["objects"] == 0 and st["stores"] == 0
    still_serving(inproc, ranks)
