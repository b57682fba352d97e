"""Typed error codes. Every failed request is answered with one of these (docs/protocol.md)."""

from __future__ import annotations

import enum


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
