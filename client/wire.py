"""The client's one codec (docs/protocol.md sections 3 and 4): every request a client sends is
encoded here, and every reply it reads is decoded here, with msgspec alone.

A reply is read in two steps: ``split_reply`` takes a frame's ``[req_id, ok, body]`` apart and
leaves the body undecoded (a reply to a request that already timed out is never decoded at all);
once its request is found, ``decode_body`` turns the body into the op's typed reply
(``tierd.protocol.messages.REPLIES``; STATUS's ``/status`` object stays a map) or, for an error,
into ``ErrorReply``. Reply types ignore fields they do not know (a newer daemon may add some); a
body whose known fields have the wrong type fails as ``ProtocolError`` (``BAD_REQUEST``), and
the caller's request with the client-side code ``BAD_REPLY``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tierd.protocol import messages
from tierd.protocol.errors import ErrorCode, ProtocolError, convert
from tierd_client.errors import TierdError

RawReply = tuple[int, bool, msgspec.Raw]  # a reply frame taken apart: (req_id, ok, undecoded body)

_encoder = msgspec.msgpack.Encoder()
_frame = msgspec.msgpack.Decoder(RawReply)
_error = msgspec.msgpack.Decoder(messages.ErrorReply)
_plain = msgspec.msgpack.Decoder(dict[str, Any])  # STATUS's /status object; an op the client does not know
_replies = {op: _plain if t is None else msgspec.msgpack.Decoder(t) for op, t in messages.REPLIES.items()}
_ACK = (0, True)  # the daemon's acknowledgement of a lookup channel: [0, true, {}]


def encode_request(op: str, req_id: int, body: Any) -> bytes:
    """A request frame ``[op, req_id, body]``: ``body`` the op's typed request (a plain map is sent
    as it is: tools, and tests of the daemon's own checks)."""
    return _encoder.encode((op, req_id, body))


def typed(part: Any, typ: type, path: str) -> Any:
    """A request's part (a namespace, a layout, a group spec, a chunk) as its type: itself, or a
    plain map of its fields converted with the daemon's own checks. What the daemon would refuse
    (a field it does not know, a wrong type, a layout that does not fit together) raises
    TierdError here with the code and message the daemon would answer."""
    if type(part) is typ:
        return part
    try:
        return convert(part, typ, path)
    except ProtocolError as exc:
        raise TierdError(exc.code.name, exc.message) from None


def split_reply(frame: bytes) -> RawReply:
    """A reply frame's ``(req_id, ok, body)``, the body left undecoded; raises ProtocolError."""
    try:
        return _frame.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"malformed reply frame: {exc}") from None
    except RecursionError:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "reply frame: containers nested too deeply") from None


def decode_body(op: str, ok: bool, body: msgspec.Raw | bytes) -> Any:
    """The reply to ``op``: its typed reply (messages.REPLIES), or ``ErrorReply`` when not ``ok``;
    raises ProtocolError."""
    dec = _replies.get(op, _plain) if ok else _error
    try:
        return dec.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        what = op if ok else f"{op} error"
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable {what} reply: {exc}") from None
    except RecursionError:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{op} reply: containers nested too deeply") from None


def acknowledged(frame: bytes) -> bool:
    """Whether ``frame`` is the daemon's acknowledgement of a lookup channel's identity."""
    try:
        req_id, ok, body = split_reply(frame)
        return (req_id, ok) == _ACK and _plain.decode(body) == {}
    except (ProtocolError, msgspec.ValidationError, msgspec.DecodeError):
        return False
