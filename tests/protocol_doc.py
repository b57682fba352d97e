"""What tests read of docs/protocol.md: whether it names a word as code, and every key of a
/status document (the daemon's tests check each is documented)."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
DATA_KEYED = ("group_objects", "errors_by_code")  # maps keyed by data, not by field names


def named(doc: str, word: str) -> bool:
    """The doc names ``word`` as code (backticks), not just somewhere in a sentence."""
    return f"`{word}`" in doc


def missing(doc: str, words) -> list[str]:
    return sorted({w for w in words if not named(doc, w)})


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
