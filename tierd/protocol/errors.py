"""Typed error codes. Every failed request is answered with one of these (docs/protocol.md)."""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class ErrorCode(enum.Enum):
    BAD_REQUEST = "malformed frame, wrong field type or value out of range"
    UNSUPPORTED_VERSION = "HELLO named a protocol version this daemon does not speak"
    UNKNOWN_OP = "the op name is not a request this daemon knows"
    TOO_LARGE = "the frame is larger than --max-frame-mb"
    UNKNOWN_SESSION = "no HELLO was received from this connection (or the daemon restarted)"
    UNKNOWN_INSTANCE = "the instance named was never registered or was unregistered"
    LAYOUT_INVALID = "a REGISTER layout is inconsistent or its memory cannot be mapped"
    LAYOUT_MISMATCH = "the instance is registered with a different layout"
    UNKNOWN_LEASE = "the lease does not exist (released, expired or never granted)"
    EXPIRED = "the request's deadline passed before it completed; nothing was committed"
    SHUTTING_DOWN = "the daemon is stopping and takes no new work"
    DEVICE_ERROR = "a copy failed on the device or host (bytes not trusted)"
    FORBIDDEN = "the caller may not do this: another tenant's object, or an operator-only op"
    LIMIT = "a per-client limit was reached; the message names the flag that sets it"
    INTERNAL = "a handler raised; the message carries the exception"


class ProtocolError(Exception):
    """Raised inside the daemon (and the client) for a request that must fail with ``code``."""

    def __init__(self, code: ErrorCode, message: str, req_id: int | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.req_id = req_id


def validation_error(exc: msgspec.ValidationError) -> ProtocolError:
    """msgspec says "<what> - at `$.chunks[3].blocks[1][0]`"; we say "chunks[3].blocks[1][0]: <what>".
    A tensor handle that does not decode is a memory the daemon cannot map: LAYOUT_INVALID."""
    text = str(exc)
    what, sep, where = text.rpartition(" - at `")
    if sep:
        path = where.rstrip("`").removeprefix("$").lstrip(".")
        code = ErrorCode.LAYOUT_INVALID if ".handle" in path else ErrorCode.BAD_REQUEST
        return ProtocolError(code, f"{path or 'body'}: {what}")
    return ProtocolError(ErrorCode.BAD_REQUEST, text)


def convert(obj: Any, typ: type, path: str = "") -> Any:
    """``obj`` (plain data, as a test or tool builds it) as ``typ``, with the edge's error codes."""
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as exc:
        err = validation_error(exc)
        raise ProtocolError(err.code, f"{path}.{err.message}" if path else err.message) from None
