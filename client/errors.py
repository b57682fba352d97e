"""Errors a tierd client call can end in: the daemon's typed errors (``TierdError.code`` is the
name of a ``tierd.protocol.errors.ErrorCode``) and the client-side ones (``DEADLINE``,
``UNAVAILABLE``, ``CLOSED``, ``BAD_REPLY``), see docs/protocol.md section 7."""

from __future__ import annotations


class TierdError(Exception):
    """The daemon answered with a typed error."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class DeadlineExceeded(TierdError):
    def __init__(self, op: str, timeout: float):
        super().__init__("DEADLINE", f"{op} got no answer within {timeout:g} s")


class DaemonUnavailable(TierdError):
    def __init__(self, url: str):
        super().__init__("UNAVAILABLE", f"no tierd is connected at {url}")


class BadReply(TierdError):
    """The daemon's reply does not decode into the op's reply type (tierd_client.wire)."""

    def __init__(self, message: str):
        super().__init__("BAD_REPLY", message)
