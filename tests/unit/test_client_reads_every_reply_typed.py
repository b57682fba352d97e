"""The client reads every reply through one codec (tierd_client.wire) into its op's reply type
(tierd.protocol.messages.REPLIES): every reply the daemon can send comes back field for field,
an error reply as ErrorReply, a field a newer daemon added is skipped, and a known field of the
wrong type fails instead of reaching the caller. The reply types are taken from the protocol's
own table, so a new op's reply is checked too."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from msgspec import inspect

from tierd.protocol import codec, messages
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd_client import wire


def sample(cls: type) -> msgspec.Struct:
    """An instance of reply type ``cls`` with every field set, none at its default, no two
    values of a type alike (a field read into another field's place would show)."""
    n = itertools.count(3)

    def value(t: inspect.Type):
        if isinstance(t, inspect.UnionType):
            return value(next(x for x in t.types if not isinstance(x, inspect.NoneType)))
        if isinstance(t, inspect.ListType):
            return [value(t.item_type), value(t.item_type)]
        if isinstance(t, inspect.TupleType):
            return tuple(value(x) for x in t.item_types)
        if isinstance(t, inspect.BoolType):
            return next(n) % 2 == 0
        if isinstance(t, inspect.IntType):
            return next(n)
        if isinstance(t, inspect.FloatType):
            return next(n) + 0.5
        if isinstance(t, inspect.StrType):
            return f"s{next(n)}"
        if isinstance(t, inspect.BytesType):
            return bytes([next(n)]) * 16
        raise AssertionError(f"{cls.__name__}: no sample of {t} (teach sample this type)")

    info = inspect.type_info(cls)
    return cls(**{f.name: value(f.type) for f in info.fields})


TYPED = {op: t for op, t in messages.REPLIES.items() if t is not None}


def read(op: str, frame: bytes):
    req_id, ok, body = wire.split_reply(frame)
    return req_id, ok, wire.decode_body(op, ok, body)


@pytest.mark.parametrize("op", sorted(TYPED))
def test_every_reply_the_daemon_encodes_is_read_back_as_its_op_reply_type(op):
    reply = sample(TYPED[op])
    req_id, ok, got = read(op, codec.encode_reply(41, reply))  # the daemon's own encoder
    assert (req_id, ok) == (41, True)
    assert type(got) is TYPED[op]
    assert got == reply


def test_an_op_without_a_reply_type_is_read_as_a_map():
    untyped = [op for op, t in messages.REPLIES.items() if t is None]
    assert untyped == ["STATUS"]  # the /status object
    body = {"uptime_s": 1.5, "instances": [{"instance": "a"}]}
    assert read("STATUS", codec.encode_reply(2, body)) == (2, True, body)


def test_an_error_reply_is_read_as_error_reply_whatever_the_op():
    for op in messages.REPLIES:
        frame = codec.encode_error(9, ErrorCode.UNKNOWN_LEASE, "lease 4 is gone")
        assert read(op, frame) == (9, False, messages.ErrorReply("UNKNOWN_LEASE", "lease 4 is gone"))


def test_a_reply_field_the_client_does_not_know_is_skipped():
    body = {**msgspec.structs.asdict(sample(messages.LookupReply)), "added_later": [1, 2]}
    assert read("LOOKUP", codec.encode_reply(1, body))[2] == messages.LookupReply(
        **{k: v for k, v in body.items() if k != "added_later"}
    )


def test_a_reply_field_of_the_wrong_type_fails_naming_it():
    body = {**msgspec.structs.asdict(sample(messages.StoreReply)), "results": "stored"}
    with pytest.raises(ProtocolError) as err:
        read("STORE", codec.encode_reply(1, body))
    assert err.value.code is ErrorCode.BAD_REQUEST and "$.results" in err.value.message
    with pytest.raises(ProtocolError):
        read("LOOKUP", codec.encode_reply(1, {"chunks": 1}))  # a field it needs is missing
    with pytest.raises(ProtocolError):
        wire.split_reply(msgspec.msgpack.encode([1, True]))  # not [req_id, ok, body]


def test_the_codec_encodes_a_typed_request_as_the_daemon_decodes_it():
    req = messages.Release(17)
    assert codec.decode_request(wire.encode_request("RELEASE", 5, req), 1 << 20) == ("RELEASE", 5, req)
