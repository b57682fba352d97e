"""Every request and reply, as typed messages. The edge of the daemon decodes a request frame
straight into one of these (msgspec), so a handler never sees a raw map: every type, length and
range below is checked on the way in, and a failure names the field by its path (``BAD_REQUEST``,
or ``LAYOUT_INVALID`` for a layout whose fields are fine but do not fit together). Limits that
depend on a registered layout (block ids below its ``num_blocks``, the right number of groups and
blocks per chunk) are checked by the planner against that layout before anything is planned.

docs/protocol.md's request tables are checked against these definitions (tests/unit/test_protocol_doc.py).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from tierd.protocol import MAX_REQUEST_PARTS, PROTOCOL_VERSION
from tierd.protocol.errors import ErrorCode, ProtocolError, convert, validation_error  # noqa: F401 - convert: re-exported
from tierd.protocol.keys import MAX_KEY_BYTES, MIN_KEY_BYTES
from tierd.protocol.layout import (
    MAX_BLOCKS_PER_CHUNK,
    MAX_GROUPS,
    ChunkTokens,
    GroupSpec,
    Name,
    Namespace,
    NonEmptyName,
    PageLayout,
)

MAX_CHUNKS = 1 << 16  # chunks per STORE/RETRIEVE, keys per LOOKUP
IPC_EVENT_BYTES = 64  # cudaIpcEventHandle_t

Key = Annotated[bytes, Meta(min_length=MIN_KEY_BYTES, max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], Meta(max_length=MAX_CHUNKS)]
Count = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Deadline = Annotated[float, Meta(ge=0.0)]


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Base of every request body. A field the daemon does not know is refused (``BAD_REQUEST``
    naming it), in the body and in every map nested in it: a misspelt optional field would
    otherwise take its default without a word. The client encodes its requests as these too; a
    field at its default is left out of the frame."""


# ---- requests ------------------------------------------------------------------------------------
class Hello(Message):
    protocol: int
    client: Name = ""
    pid: Count = 0  # informational: on ipc:// the daemon takes the pid from the kernel
    token: Annotated[str, Meta(max_length=256)] = ""  # tcp://: the tenant token (--tcp-token-file)


class Bye(Message):
    pass


class Register(Message):
    instance: NonEmptyName
    layout: PageLayout


class Unregister(Message):
    instance: Name


class Lookup(Message):
    namespace: Namespace
    keys: Keys
    chunk_tokens: ChunkTokens
    groups: Annotated[tuple[GroupSpec, ...], Meta(min_length=1, max_length=MAX_GROUPS)]
    replicated: bool = False
    lease: bool = True


class Release(Message):
    lease: Count


class Chunk(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One chunk of a STORE or RETRIEVE: its key and, per engine group, its block ids."""

    key: Key
    blocks: Annotated[
        list[Annotated[list[int], Meta(max_length=MAX_BLOCKS_PER_CHUNK)]], Meta(max_length=MAX_GROUPS)
    ]


Chunks = Annotated[list[Chunk], Meta(max_length=MAX_REQUEST_PARTS)]  # a chunk is at least one part


Event = Annotated[bytes, Meta(min_length=IPC_EVENT_BYTES, max_length=IPC_EVENT_BYTES)]


class Store(Message):
    instance: Name
    chunks: Chunks
    touch: Keys = msgspec.field(default_factory=list)
    event: Event | None = None  # cuda: wait for it (on the GPU) before reading the engine's bytes
    staged_at: Count | None = None  # cuda: where in the rank's staging buffer the chunks lie
    deadline: Deadline = 0.0


class Retrieve(Message):
    instance: Name
    chunks: Chunks
    lease: Count = 0
    event: Event | None = None  # cuda: wait for it before writing the staging bytes
    staged_at: Count | None = None  # cuda: where in the rank's staging buffer to put the chunks
    deadline: Deadline = 0.0


class Ping(Message):
    pass


class Status(Message):
    pass


class Clear(Message):
    namespace: Namespace | None = None  # only this namespace's objects; all when absent
    tenant: Name | None = (
        None  # whose namespace (an operator clearing another tenant's); default: the caller's
    )


class Evicted(Message):
    namespace: Namespace
    since: Annotated[int, Meta(ge=-1, le=(1 << 63) - 1)] = 0  # -1: from now on (the cursor only)
    max: Annotated[int, Meta(ge=1, le=(1 << 63) - 1)] = 4096  # at most 65536 are returned
    boot_id: Annotated[str, Meta(max_length=64)] = ""  # the boot of ``since`` (another: missed)


REQUESTS: dict[str, type[Message]] = {
    "HELLO": Hello,
    "BYE": Bye,
    "REGISTER": Register,
    "UNREGISTER": Unregister,
    "LOOKUP": Lookup,
    "RELEASE": Release,
    "STORE": Store,
    "RETRIEVE": Retrieve,
    "PING": Ping,
    "STATUS": Status,
    "CLEAR": Clear,
    "EVICTED": Evicted,
}


# ---- replies -------------------------------------------------------------------------------------
class HelloReply(msgspec.Struct):
    protocol: int
    version: str
    boot_id: str
    pid: int
    null_block_id: int
    heartbeat_timeout_s: float
    lease_ttl_s: float
    max_frame_bytes: int
    tenant: str  # what the daemon takes this session to be ("" = the daemon's own user)
    operator: bool  # may CLEAR
    channel_max_bytes: int = 0  # the lookup channel's largest frame (docs/protocol.md 2.1); 0: none


class RegisterReply(msgspec.Struct):
    instance: str
    namespace_id: bytes
    object_bytes: list[int]


class LookupReply(msgspec.Struct):
    chunks: int
    lease: int
    lease_ttl_s: float


class StoreReply(msgspec.Struct):
    results: list[str]  # per chunk: "stored" | "exists" | "empty" | "rejected"


class RetrieveReply(msgspec.Struct, omit_defaults=True):
    ok: list[bool]
    failed: list[tuple[int, int]]  # [group, block id] not restored
    event: bytes | None = None  # cuda: the engine waits for it (on the GPU) before reading staging


class PingReply(msgspec.Struct):
    time: float
    boot_id: str


class ClearReply(msgspec.Struct):
    evicted: int


class EvictedReply(msgspec.Struct):
    seq: int  # the cursor to send next time
    keys: list[bytes]  # chunk keys evicted after ``since``, oldest first, each once
    missed: bool  # records after ``since`` are gone (ring overflow, another boot): removals may be lost
    boot_id: str


class Empty(msgspec.Struct):
    pass


class ErrorReply(msgspec.Struct):
    """The body of every error reply (``ok`` false): ``code`` an ErrorCode's name, ``message`` text."""

    code: str
    message: str


STORE_RESULTS = ("stored", "exists", "empty", "rejected")

REPLIES: dict[str, type | None] = {
    "HELLO": HelloReply,
    "BYE": Empty,
    "REGISTER": RegisterReply,
    "UNREGISTER": Empty,
    "LOOKUP": LookupReply,
    "RELEASE": Empty,
    "STORE": StoreReply,
    "RETRIEVE": RetrieveReply,
    "PING": PingReply,
    "STATUS": None,  # the /status object (docs/protocol.md section 16)
    "CLEAR": ClearReply,
    "EVICTED": EvictedReply,
}

_DECODERS = {op: msgspec.msgpack.Decoder(t) for op, t in REQUESTS.items()}


class _Protocol(msgspec.Struct):
    """A HELLO's protocol alone, whatever else it carries."""

    protocol: Any = None


_PROTOCOL = msgspec.msgpack.Decoder(_Protocol)


def decode(op: str, body: bytes | memoryview) -> Message:
    """The typed request of ``op`` from its msgpack body; raises ProtocolError."""
    dec = _DECODERS.get(op)
    if dec is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}")
    try:
        return dec.decode(body)
    except msgspec.ValidationError as exc:
        if op == "HELLO":
            _other_protocol(body)
        raise validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable body: {exc}") from None
    except RecursionError:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "body: containers nested too deeply") from None


def _other_protocol(body: bytes | memoryview) -> None:
    """A HELLO that does not decode because it names another protocol (whose fields this daemon
    need not know) is answered UNSUPPORTED_VERSION, as one that decodes is."""
    try:
        protocol = _PROTOCOL.decode(body).protocol
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return
    if type(protocol) is int and protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"this daemon speaks protocol {PROTOCOL_VERSION}, the client {protocol}",
        )
