"""The frame codec: a request decoded in one step into its typed message (no extension types,
bounded sizes), typed errors, and the req_id recovered from the head of a frame that does not
decode whole."""

import time

import msgpack
import pytest

from tierd.protocol import codec, messages
from tierd.protocol.errors import ErrorCode, ProtocolError

MAX = 1 << 16


def fails(frame, max_bytes=MAX):
    with pytest.raises(ProtocolError) as err:
        codec.decode_request(frame, max_bytes)
    return err.value.code, err.value.req_id


def test_round_trip():
    frame = codec.encode_request(
        "STORE", 12, {"instance": "x", "chunks": [{"key": b"k" * 16, "blocks": [[1, -1]]}]}
    )
    op, req_id, msg = codec.decode_request(frame, MAX)
    assert (op, req_id) == ("STORE", 12)
    assert msg == messages.Store("x", [messages.Chunk(b"k" * 16, [[1, -1]])])
    assert codec.decode_reply(codec.encode_reply(12, {"a": 1}), MAX) == (12, True, {"a": 1})
    rid, ok, body = codec.decode_reply(codec.encode_error(3, ErrorCode.EXPIRED, "late"), MAX)
    assert (rid, ok, body) == (3, False, {"code": "EXPIRED", "message": "late"})


def test_too_large_keeps_req_id():
    frame = codec.encode_request("PING", 99, {"pad": b"x" * MAX})
    assert fails(frame) == (ErrorCode.TOO_LARGE, 99)


def test_bad_body_keeps_req_id():
    ext = msgpack.ExtType(1, b"")
    assert fails(msgpack.packb(["RELEASE", 7, {"lease": ext}], use_bin_type=True)) == (
        ErrorCode.BAD_REQUEST,
        7,
    )
    assert fails(msgpack.packb(["PING", 8, {1: 2}])) == (ErrorCode.BAD_REQUEST, 8)
    assert fails(msgpack.packb(["PING", 9, []])) == (ErrorCode.BAD_REQUEST, 9)
    assert fails(msgpack.packb([1, 10, {}])) == (ErrorCode.BAD_REQUEST, 10)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        b"\x93",
        msgpack.packb(["PING", -1, {}]),
        msgpack.packb(["PING", True, {}]),
        msgpack.packb(["PING", "5", {}]),
        msgpack.packb([b"x" * 5000, 5, {1: 2}]),
        msgpack.packb(["PING", 1]),
        msgpack.packb({"op": "PING"}),
    ],
)
def test_unrecoverable_req_id(frame):
    code, req_id = fails(frame)
    assert code is ErrorCode.BAD_REQUEST and req_id is None


def test_limits_bound_allocation():
    # a header announcing a huge array: refused without allocating it
    assert fails(b"\x93\xa4PING\x01\xdd\xff\xff\xff\xff")[0] is ErrorCode.BAD_REQUEST
    # more chunks than a STORE may carry
    chunk = {"key": b"k" * 16, "blocks": [[1]]}
    frame = msgpack.packb(["STORE", 1, {"instance": "x", "chunks": [chunk] * (messages.MAX_CHUNKS + 1)}])
    assert fails(frame, 1 << 26)[0] is ErrorCode.BAD_REQUEST
    # a huge field the op does not have is refused by its name, its value never built
    frame = msgpack.packb(["PING", 1, {"a": list(range(1 << 20))}])
    t0 = time.perf_counter()
    with pytest.raises(ProtocolError) as err:
        codec.decode_request(frame, 1 << 24)
    assert err.value.code is ErrorCode.BAD_REQUEST and "unknown field `a`" in err.value.message
    assert time.perf_counter() - t0 < 0.5


def test_containers_nested_too_deeply_are_a_bad_request_that_keeps_its_req_id():
    """Was: a PING body nested a million arrays deep was answered INTERNAL (RecursionError), req_id 0.
    A field no request has is refused by its name, a known one by the type its value lacks; a
    frame whose nesting the decoder gives up on says so."""
    for depth in (10_000, 1_000_000):
        for op, field, why in ((b"PING", b"x", "unknown field `x`"), (b"RELEASE", b"lease", "`$.lease`")):
            # [op, 5, {field: [[[...]]]}]
            head = b"\x93" + bytes([0xA0 | len(op)]) + op + b"\x05\x81" + bytes([0xA0 | len(field)]) + field
            with pytest.raises(ProtocolError) as err:
                codec.decode_request(head + b"\x91" * depth + b"\xc0", 1 << 26)
            assert err.value.code is ErrorCode.BAD_REQUEST and err.value.req_id == 5
            assert why in err.value.message or "nested too deeply" in err.value.message, err.value.message
    with pytest.raises(ProtocolError) as err:  # control: 100 deep is judged by its fields, not its depth
        codec.decode_request(b"\x93\xa4PING\x05\x81\xa1x" + b"\x91" * 100 + b"\xc0", 1 << 26)
    assert err.value.req_id == 5 and "unknown field `x`" in err.value.message
