"""docs/protocol.md stays complete: every op, error code, counter, /status key, /metrics series,
reply field and `tierd serve` flag the code has is named there, and no line is over 100 columns."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from kv import FakeRank, GroupGeom, keys
from tierd.cli import serve
from tierd.protocol.errors import ErrorCode
from tierd.stats import COUNTERS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "protocol.md"
OPS = ROOT / "tierd" / "ops.py"
MAX_COLUMNS = 100


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def named(doc: str, word: str) -> bool:
    """The doc names ``word`` as code (backticks), not just somewhere in a sentence."""
    return f"`{word}`" in doc


def missing(doc: str, words) -> list[str]:
    return sorted({w for w in words if not named(doc, w)})


def _ops_tree() -> ast.Module:
    return ast.parse(OPS.read_text())


def op_names() -> list[str]:
    """The keys of ``self.table = {...}`` in tierd/ops.py, read without building a daemon."""
    for node in ast.walk(_ops_tree()):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Attribute) and t.attr == "table" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            return [k.value for k in node.value.keys]
    raise AssertionError("tierd/ops.py has no `self.table = {...}`")


def store_results() -> set[str]:
    """The strings Ops.store puts in a STORE reply's ``results``."""
    fn = next(
        n for n in ast.walk(_ops_tree()) if isinstance(n, ast.FunctionDef) and n.name == "store"
    )
    out: set[str] = set()
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "status" for t in node.targets)
            and isinstance(node.value, ast.Constant)
        ):
            out.add(node.value.value)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "append"
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "results"
        ):
            out.update(a.value for a in node.args if isinstance(a, ast.Constant))
        elif isinstance(node, ast.BinOp) and isinstance(node.left, ast.List):
            out.update(e.value for e in node.left.elts if isinstance(e, ast.Constant))
    return {s for s in out if isinstance(s, str)}


def serve_flags() -> list[str]:
    """Every flag of ``tierd serve`` (both spellings of a switch), without --help."""
    flags = []
    for param in serve.params:
        flags += [o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")]
    return [f for f in flags if f != "--help"]


# ---- static: the code's own lists ------------------------------------------------------------
def test_every_op_has_a_section(doc):
    ops = op_names()
    assert len(ops) >= 10
    absent = [op for op in ops if not re.search(rf"^### {op}$", doc, re.M)]
    assert not absent, f"docs/protocol.md has no '### OP' section for {absent}"


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
    results = store_results()
    assert {"stored", "exists", "rejected", "empty"} <= results
    assert not missing(doc, results)


def test_every_serve_flag_is_listed(doc):
    flags = serve_flags()
    assert "--l1-size-gb" in flags and "--no-separate-object-groups" in flags
    assert not missing(doc, flags)


def test_no_line_is_wider_than_100_columns(doc):
    wide = [(i, len(line)) for i, line in enumerate(doc.splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not wide, f"lines over {MAX_COLUMNS} columns (line, width): {wide}"


# ---- live: what a running daemon produces -------------------------------------------------------
def _traffic(client) -> FakeRank:
    """One of everything: a registration, a stored and a retrieved chunk, a lease and an error."""
    rank = FakeRank([GroupGeom("full"), GroupGeom("state", block_tokens=16)])
    client.register("doc-r0", rank.layout())
    ks = keys(2)
    client.store("doc-r0", [{"key": k, "blocks": [[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], [i]]}
                            for i, k in enumerate(ks)])
    hit = client.lookup(rank.ns, ks, rank.specs(), rank.chunk_tokens)
    client.retrieve("doc-r0", [{"key": ks[1], "blocks": [[8, 9, 10, 11], [9]]}], lease=hit["lease"])
    with pytest.raises(Exception):
        client.release(10**9)
    return rank


# /status maps whose keys are data (group labels, error codes), not field names
DATA_KEYED = ("group_objects", "errors_by_code")


def field_names(value) -> set[str]:
    """Every map key in a JSON value, nested maps and arrays of maps included."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(k)
            if k not in DATA_KEYED:
                out |= field_names(v)
    elif isinstance(value, list):
        for v in value:
            out |= field_names(v)
    return out


def test_every_status_key_is_listed(doc, daemon, client):
    rank = _traffic(client)
    status = daemon.status()
    assert status["instances"], "the daemon should report the registered instance"
    assert not missing(doc, field_names(status)), "add these /status keys to docs/protocol.md"
    assert sorted(client.status()) == sorted(status), "STATUS and /status should be one object"
    rank.close()


def test_every_metrics_series_is_listed(doc, daemon, client):
    rank = _traffic(client)
    code, text = daemon.get("/metrics")
    assert code == 200
    families = re.findall(r"^# TYPE (\S+) \S+$", text.decode(), re.M)
    assert "tierd_op_seconds" in families and "tierd_errors_total" in families
    assert not missing(doc, families), "add these /metrics series to docs/protocol.md"
    rank.close()


def test_every_reply_field_is_listed(doc, daemon, client):
    rank = FakeRank([GroupGeom("full")])
    replies = {
        "HELLO": client.server,
        "REGISTER": client.register("doc-r1", rank.layout()),
    }
    k = keys(1)
    chunk = {"key": k[0], "blocks": [[0, 1, 2, 3]]}
    replies["STORE"] = client.store("doc-r1", [chunk])
    replies["LOOKUP"] = client.lookup(rank.ns, k, rank.specs(), rank.chunk_tokens)
    replies["RETRIEVE"] = client.retrieve("doc-r1", [chunk], lease=replies["LOOKUP"]["lease"])
    replies["PING"] = client.ping()
    replies["CLEAR"] = client.clear()
    replies["UNREGISTER"] = client.unregister("doc-r1")
    absent = {op: missing(doc, body) for op, body in replies.items() if missing(doc, body)}
    assert not absent, f"reply fields missing from docs/protocol.md: {json.dumps(absent)}"
    rank.close()
