"""A field the daemon does not know is refused, not ignored: in a request's body and in every map
nested in it (a namespace, a layout and its parts, a group spec, a chunk, a tensor handle), with
an error naming the field and where it is. Every request type is taken from the protocol's own
list (tierd.protocol.messages.REQUESTS) and its body built from its fields' types, so a new
request type is walked too without a line here. The daemon's objects in this process
(tests/inproc.py): each request the frame a client sends, decoded and answered as the daemon does."""

from __future__ import annotations

import copy
import re

from kv import GroupGeom
from msgspec import inspect
from util import ranks  # noqa: F401 - fixtures

from tierd.protocol import PROTOCOL_VERSION, messages
from tierd.protocol.layout import GroupSpec, Namespace, PageLayout

UNKNOWN = "surely_not_a_field"
DECODE_REFUSALS = ("BAD_REQUEST", "LAYOUT_INVALID")


def body_of(op: str, rank) -> dict:
    """A body the daemon decodes as ``op``'s request: its required fields, each from its type
    (the layout's parts from a real rank: their fields must fit together)."""
    whole = {PageLayout: rank.layout(), Namespace: rank.ns, GroupSpec: rank.specs()[0]}
    fields = {"protocol": PROTOCOL_VERSION, "chunk_tokens": rank.chunk_tokens}

    def value(t: inspect.Type):
        if isinstance(t, inspect.StructType):
            if t.cls in whole:
                return copy.deepcopy(whole[t.cls])
            return {
                f.encode_name: fields[f.name] if f.name in fields else value(f.type)
                for f in t.fields
                if f.required
            }
        if isinstance(t, inspect.UnionType):
            return value(next(x for x in t.types if not isinstance(x, inspect.NoneType)))
        if isinstance(t, (inspect.ListType, inspect.VarTupleType)):
            # one element where it is a map, so that the walk below reaches it
            n = max(t.min_length or 0, 1 if isinstance(t.item_type, inspect.StructType) else 0)
            return [value(t.item_type) for _ in range(n)]
        if isinstance(t, inspect.TupleType):
            return [value(x) for x in t.item_types]
        if isinstance(t, inspect.IntType):
            return t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else 0)
        if isinstance(t, inspect.FloatType):
            return t.ge if t.ge is not None else 0.0
        if isinstance(t, inspect.StrType):
            return "x" * (t.min_length or 0)
        if isinstance(t, inspect.BytesType):
            return b"k" * (t.min_length or 0)
        if isinstance(t, inspect.BoolType):
            return False
        if isinstance(t, inspect.EnumType):
            return next(iter(t.cls)).value
        raise AssertionError(f"{op}: no example of {t} (teach body_of this type)")

    return value(inspect.type_info(messages.REQUESTS[op]))


def maps_in(obj, path: str = ""):
    """``(path, map)`` of every map in ``obj``, itself first; paths as the daemon writes them."""
    if isinstance(obj, dict):
        yield path, obj
        for k, v in obj.items():
            yield from maps_in(v, f"{path}.{k}" if path else k)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from maps_in(v, f"{path}[{i}]")


def with_unknown_field(body: dict, at: int) -> dict:
    """``body`` with UNKNOWN added to its ``at``-th map (maps_in's order)."""
    out = copy.deepcopy(body)
    _, target = list(maps_in(out))[at]
    target[UNKNOWN] = 1
    return out


def test_a_request_with_a_field_the_daemon_does_not_know_is_refused_naming_it(inproc, inraw, ranks):
    rank = ranks(GroupGeom("full", layers=1))
    walked = []
    for op in messages.REQUESTS:
        body = body_of(op, rank)
        r = inraw(inproc)
        if op != "HELLO":
            r.hello()
        for at, (path, _) in enumerate(maps_in(body)):
            ok, reply = r.call(op, with_unknown_field(body, at))
            where = f"{op} with `{UNKNOWN}` in {path or 'its body'}"
            assert not ok, f"{where} was accepted: {reply}"
            # the daemon's code for a map that does not decode: a tensor handle's is LAYOUT_INVALID
            assert reply["code"] == ("LAYOUT_INVALID" if ".handle" in path else "BAD_REQUEST"), where
            assert f"unknown field `{UNKNOWN}`" in reply["message"], (where, reply["message"])
            assert reply["message"].startswith(f"{path}: " if path else "Object"), (where, reply["message"])
            walked.append((op, path))
        # the same body without it is no decoding failure: the field alone was refused
        ok, reply = r.call(op, body)
        assert ok or reply["code"] not in DECODE_REFUSALS, (op, body, reply)
    assert {op for op, _ in walked} == set(messages.REQUESTS)
    nested = {re.sub(r"\[\d+\]", "", path).split(".")[-1] for _, path in walked if path}
    assert {"namespace", "layout", "groups", "layers", "tensors", "handle", "chunks"} <= nested, nested
    bad = sum(".handle" not in path for _, path in walked)
    assert inproc.status()["errors_by_code"]["BAD_REQUEST"] == bad


def test_a_hello_of_another_protocol_is_unsupported_version_whatever_its_fields(inproc, inraw):
    r = inraw(inproc)
    ok, reply = r.call("HELLO", {"protocol": PROTOCOL_VERSION + 1, "a_later_field": 1})
    assert not ok and reply["code"] == "UNSUPPORTED_VERSION", reply
    ok, reply = r.call("HELLO", {"protocol": PROTOCOL_VERSION, "a_later_field": 1})
    assert not ok and reply["code"] == "BAD_REQUEST" and "`a_later_field`" in reply["message"], reply
