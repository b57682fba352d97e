"""Frame codec: one msgpack array per ZeroMQ frame, no extension types, no pickle.

Request frame: ``[op: str, req_id: int, body: map]``.
Reply frame:   ``[req_id: int, ok: bool, body: map]``; when ``ok`` is false the body is
``{"code": <ErrorCode name>, "message": str}``.
"""

from __future__ import annotations

from typing import Any

import msgpack

from tierd.protocol.errors import ErrorCode, ProtocolError

# Limits handed to msgpack so a hostile frame cannot make the decoder allocate without bound.
_MAX_CONTAINER = 1 << 20
_PEEK_BYTES = 4096  # how much of an undecodable frame is read to find its req_id


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(ErrorCode.BAD_REQUEST, f"msgpack extension type {code} is not allowed")


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(frame: bytes, max_bytes: int) -> Any:
    if len(frame) > max_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
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
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable frame: {type(exc).__name__}: {exc}") from None


def encode_request(op: str, req_id: int, body: dict) -> bytes:
    return pack([op, req_id, body])


def _peek_req_id(frame: bytes) -> int | None:
    """The req_id of a frame that does not decode whole (too large, a bad body), read from its
    head alone, so that the error still reaches the caller waiting on it."""
    unpacker = msgpack.Unpacker(raw=False, ext_hook=_reject_ext, max_buffer_size=_PEEK_BYTES)
    unpacker.feed(frame[:_PEEK_BYTES])
    try:
        if unpacker.read_array_header() != 3:
            return None
        unpacker.skip()  # op
        req_id = unpacker.unpack()
    except Exception:  # noqa: BLE001 - any failure just means "not recoverable"
        return None
    if isinstance(req_id, int) and not isinstance(req_id, bool) and 0 <= req_id < 2**63:
        return req_id
    return None


def decode_request(frame: bytes, max_bytes: int) -> tuple[str, int, dict]:
    """Decode a request frame. Raises ProtocolError; ``req_id`` is recovered when possible."""
    try:
        msg = unpack(frame, max_bytes)
    except ProtocolError as exc:
        exc.req_id = _peek_req_id(frame)
        raise
    if not isinstance(msg, list) or len(msg) != 3:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a request is a 3-element array [op, req_id, body]")
    op, req_id, body = msg
    if not isinstance(req_id, int) or isinstance(req_id, bool) or not 0 <= req_id < 2**63:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "req_id must be a non-negative integer")
    if not isinstance(op, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "op must be a string", req_id=req_id)
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "body must be a map", req_id=req_id)
    return op, req_id, body


def encode_reply(req_id: int, body: dict) -> bytes:
    return pack([req_id, True, body])


def encode_error(req_id: int, code: ErrorCode, message: str) -> bytes:
    return pack([req_id, False, {"code": code.name, "message": message}])


def decode_reply(frame: bytes, max_bytes: int) -> tuple[int, bool, dict]:
    msg = unpack(frame, max_bytes)
    if not isinstance(msg, list) or len(msg) != 3 or not isinstance(msg[0], int) or not isinstance(msg[2], dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "malformed reply frame")
    return msg[0], bool(msg[1]), msg[2]
