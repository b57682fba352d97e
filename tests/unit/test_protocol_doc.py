"""docs/protocol.md stays complete: every op, error code, counter, /status key, /metrics series,
reply field and `tierd serve` flag the code has is named there, and no line is over 100 columns.
What the daemon produces comes from its objects in this process (tests/inproc.py): /status, its
Prometheus registry as /metrics scrapes it, each op's reply as tierd_client decodes it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
from kv import FakeRank, GroupGeom, keys
from protocol_doc import DOC, field_names, missing

from tierd.base.stats import COUNTERS
from tierd.protocol import messages
from tierd.protocol.errors import ErrorCode
from tierd.tools.cli import serve

MAX_COLUMNS = 100


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def section(doc: str, op: str) -> str:
    """The text of ``### OP`` up to the next heading."""
    m = re.search(rf"^### {op}$(.*?)(?=^##)", doc, re.M | re.S)
    assert m, f"docs/protocol.md has no '### {op}' section"
    return m.group(1)


def tables(text: str) -> list[list[list[str]]]:
    """Markdown tables in ``text``: per table its rows (header first), cells stripped."""
    out, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("- ") for c in cells):
                rows.append(cells)
        elif rows:
            out.append(rows)
            rows = []
    return out


def doc_fields(text: str, reply: bool) -> dict[str, str]:
    """``{field: doc type}`` of an op section's request table or its reply table."""
    want = "Reply:" if reply else None
    if want:
        if want not in text:
            return {}
        text = text.split(want, 1)[1]
    for t in tables(text):
        if t[0][:2] == ["field", "type"] and (reply or t[0][2].startswith("range")):
            return {row[0].strip("`"): row[1] for row in t[1:]}
    return {}


# a msgspec type, as the doc's type column names it
def doc_type(t) -> str:
    import msgspec.inspect as mi

    info = mi.type_info(t)
    if isinstance(info, mi.UnionType):
        kinds = {doc_type_info(x) for x in info.types if not isinstance(x, mi.NoneType)}
        return kinds.pop() if len(kinds) == 1 else "|".join(sorted(kinds))
    return doc_type_info(info)


def doc_type_info(info) -> str:
    import msgspec.inspect as mi

    simple = {
        mi.IntType: "int",
        mi.FloatType: "float",
        mi.StrType: "str",
        mi.BoolType: "bool",
        mi.BytesType: "bin",
    }
    for k, v in simple.items():
        if isinstance(info, k):
            return v
    if isinstance(info, (mi.StructType, mi.DictType)):
        return "map"
    if isinstance(info, (mi.ListType, mi.TupleType, mi.VarTupleType)):
        return "array"
    return type(info).__name__


def serve_flags() -> list[str]:
    """Every flag of ``tierd serve`` (both spellings of a switch), without --help."""
    flags = []
    for param in serve.params:
        flags += [o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")]
    return [f for f in flags if f != "--help"]


# ---- static: the code's own lists ------------------------------------------------------------
def test_every_op_has_a_section(doc):
    ops = list(messages.REQUESTS)
    assert len(ops) >= 11
    absent = [op for op in ops if not re.search(rf"^### {op}$", doc, re.M)]
    assert not absent, f"docs/protocol.md has no '### OP' section for {absent}"


@pytest.mark.parametrize("op", list(messages.REQUESTS))
def test_each_ops_request_and_reply_tables_match_its_message_definitions(doc, op):
    """The doc's field tables name exactly the fields tierd.protocol.messages defines, with their types."""
    text = section(doc, op)
    for reply, typ in ((False, messages.REQUESTS[op]), (True, messages.REPLIES[op])):
        if typ is None:
            continue
        want = {f.encode_name: doc_type(f.type) for f in msgspec.structs.fields(typ)}
        got = doc_fields(text, reply)
        if not want and not got:
            continue
        names = {k: v.split()[0] for k, v in got.items()}
        assert set(names) == set(want), (
            f"{op} {'reply' if reply else 'request'}: doc {sorted(names)} != {sorted(want)}"
        )
        wrong = {
            k: (names[k], t)
            for k, t in want.items()
            if names[k] not in (t, "map") or (t == "map") != (names[k] == "map")
        }
        assert not wrong, f"{op} {'reply' if reply else 'request'}: doc type != message type: {wrong}"


def test_every_error_code_is_listed_with_its_description(doc):
    assert not missing(doc, [c.name for c in ErrorCode])
    flat = " ".join(doc.split())
    undescribed = [c.name for c in ErrorCode if c.value not in flat]
    assert not undescribed, f"the description of {undescribed} differs from tierd/protocol/errors.py"


def test_every_counter_is_listed_for_status_and_metrics(doc):
    names = [name for name, _ in COUNTERS]
    assert not missing(doc, names)
    assert not missing(doc, [f"tierd_{name}_total" for name in names])


def test_every_store_result_is_listed(doc):
    results = set(messages.STORE_RESULTS)
    assert {"stored", "exists", "rejected", "empty"} <= results
    assert not missing(doc, results)


def test_every_serve_flag_is_listed(doc):
    flags = serve_flags()
    assert "--l1-size-gb" in flags and "--no-separate-object-groups" in flags
    assert not missing(doc, flags)


def test_no_line_is_wider_than_100_columns(doc):
    wide = [(i, len(line)) for i, line in enumerate(doc.splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not wide, f"lines over {MAX_COLUMNS} columns (line, width): {wide}"


# ---- live: what the daemon's objects produce -------------------------------------------------------
def _traffic(inclient) -> FakeRank:
    """One of everything: a registration, a stored and a retrieved chunk, a lease and an error."""
    rank = FakeRank([GroupGeom("full"), GroupGeom("state", block_tokens=16)])
    inclient.register("doc-r0", rank.layout())
    ks = keys(2)
    inclient.store(
        "doc-r0",
        [{"key": k, "blocks": [[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], [i]]} for i, k in enumerate(ks)],
    )
    hit = inclient.lookup(rank.ns, ks, rank.specs(), rank.chunk_tokens)
    inclient.retrieve("doc-r0", [{"key": ks[1], "blocks": [[8, 9, 10, 11], [9]]}], lease=hit.lease)
    with pytest.raises(Exception):
        inclient.release(10**9)
    return rank


# /status maps whose keys are data (group labels, error codes), not field names


def test_every_status_key_is_listed(doc, inproc, inclient):
    rank = _traffic(inclient)
    status = inproc.status()
    assert status["instances"], "the daemon should report the registered instance"
    assert not missing(doc, field_names(status)), "add these /status keys to docs/protocol.md"
    assert sorted(inclient.status()) == sorted(status), "STATUS and /status should be one object"
    rank.close()


def test_every_metrics_series_is_listed(doc, inproc, inclient):
    rank = _traffic(inclient)
    text = inproc.metrics()
    families = re.findall(r"^# TYPE (\S+) \S+$", text, re.M)
    assert "tierd_op_seconds" in families and "tierd_errors_total" in families
    assert not missing(doc, families), "add these /metrics series to docs/protocol.md"
    rank.close()


def test_every_reply_field_is_listed(doc, inproc, inclient):
    rank = FakeRank([GroupGeom("full")])
    replies = {
        "HELLO": inclient.server,
        "REGISTER": inclient.register("doc-r1", rank.layout()),
    }
    k = keys(1)
    chunk = {"key": k[0], "blocks": [[0, 1, 2, 3]]}
    replies["STORE"] = inclient.store("doc-r1", [chunk])
    replies["LOOKUP"] = inclient.lookup(rank.ns, k, rank.specs(), rank.chunk_tokens)
    replies["RETRIEVE"] = inclient.retrieve("doc-r1", [chunk], lease=replies["LOOKUP"].lease)
    replies["PING"] = inclient.ping()
    replies["CLEAR"] = inclient.clear()
    replies["UNREGISTER"] = inclient.unregister("doc-r1")
    replies = {op: msgspec.to_builtins(reply) for op, reply in replies.items()}  # the fields as sent
    absent = {op: missing(doc, body) for op, body in replies.items() if missing(doc, body)}
    assert not absent, f"reply fields missing from docs/protocol.md: {json.dumps(absent)}"
    rank.close()
