"""Frame codec: one msgpack array per ZeroMQ frame, no extension types, no pickle.

Request frame: ``[op: str, req_id: int, body: map]``.
Reply frame:   ``[req_id: int, ok: bool, body: map]``; when ``ok`` is false the body is
``{"code": <ErrorCode name>, "message": str}``.

The daemon splits a request frame into its op, its req_id and the body's raw bytes (no Python
object is built for the body here); ``messages.decode`` then turns the body into its typed
request in one pass. A frame that does not split still gets its req_id back when its head is
readable, so the error reaches the caller waiting on it.
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec

from tierd.protocol import messages
from tierd.protocol.errors import ErrorCode, ProtocolError

_PEEK_BYTES = 4096  # how much of an undecodable frame is read to find its req_id
_MAX_CONTAINER = 1 << 20  # plain (untyped) decoding: the client side and tools
_MAX_REQ_ID = (1 << 63) - 1

_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(tuple[str, int, msgspec.Raw])


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(ErrorCode.BAD_REQUEST, f"msgpack extension type {code} is not allowed")


def pack(obj: Any) -> bytes:
    return _encoder.encode(obj)


def unpack(frame: bytes, max_bytes: int) -> Any:
    """Plain decoding with bounded containers (replies on the client side, tools)."""
    if len(frame) > max_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}"
        )
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=_MAX_CONTAINER,
            max_map_len=_MAX_CONTAINER,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"undecodable frame: {type(exc).__name__}: {exc}"
        ) from None


def encode_request(op: str, req_id: int, body: Any) -> bytes:
    return _encoder.encode((op, req_id, body))


def peek_req_id(frame: bytes) -> int | None:
    """The req_id of a frame that does not split, read from its head alone."""
    unpacker = msgpack.Unpacker(raw=False, ext_hook=_reject_ext, max_buffer_size=_PEEK_BYTES)
    unpacker.feed(frame[:_PEEK_BYTES])
    try:
        if unpacker.read_array_header() != 3:
            return None
        unpacker.skip()  # op
        req_id = unpacker.unpack()
    except Exception:  # noqa: BLE001 - any failure just means "not recoverable"
        return None
    if isinstance(req_id, int) and not isinstance(req_id, bool) and 0 <= req_id <= _MAX_REQ_ID:
        return req_id
    return None


def split_request(frame: bytes, max_bytes: int) -> tuple[str, int, msgspec.Raw]:
    """``(op, req_id, raw body)`` of a request frame; raises ProtocolError (req_id set when known)."""
    if len(frame) > max_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}",
            req_id=peek_req_id(frame),
        )
    try:
        op, req_id, body = _envelope.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"a request is a 3-element array [op: str, req_id: int, body: map]: {exc}",
            req_id=peek_req_id(frame),
        ) from None
    except RecursionError:  # containers nested thousands deep: the decoder's recursion gives out
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "containers nested too deeply", req_id=peek_req_id(frame)
        ) from None
    if not 0 <= req_id <= _MAX_REQ_ID:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "req_id must be a non-negative 63-bit integer")
    return op, req_id, body


def decode_request(frame: bytes, max_bytes: int):
    """``(op, req_id, typed request)``: the edge's one step (see tierd.protocol.messages)."""
    op, req_id, body = split_request(frame, max_bytes)
    try:
        return op, req_id, messages.decode(op, body)
    except ProtocolError as exc:
        exc.req_id = req_id
        raise


def encode_reply(req_id: int, body: Any) -> bytes:
    return _encoder.encode((req_id, True, body))


def encode_error(req_id: int, code: ErrorCode, message: str) -> bytes:
    return _encoder.encode((req_id, False, {"code": code.name, "message": message}))


def decode_reply(frame: bytes, max_bytes: int) -> tuple[int, bool, dict]:
    msg = unpack(frame, max_bytes)
    if (
        not isinstance(msg, list)
        or len(msg) != 3
        or not isinstance(msg[0], int)
        or not isinstance(msg[2], dict)
    ):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "malformed reply frame")
    return msg[0], bool(msg[1]), msg[2]
