"""Test files import no test file of another layer (tests/unit, tests/daemon, tests/e2e): what
layers share lives in a helper module beside them (tests/*.py), so a layer's tests run, move or
change without another's. Static: read with ast, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
LAYERS = ("unit", "daemon", "e2e")


def crossings(files: dict[str, dict[str, str]]) -> list[str]:
    """``layer/file imports other_layer/module`` for every import (in a function too), in ``files``
    (layer -> file name -> source), of a test module that lives in another layer."""
    where = {Path(name).stem: layer for layer, named in files.items() for name in named}
    out = []
    for layer, named in files.items():
        for name, source in sorted(named.items()):
            for node in ast.walk(ast.parse(source)):
                mods = (
                    [node.module]
                    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    else [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else []
                )
                for mod in mods:
                    other = where.get(mod)
                    if other is not None and other != layer:
                        out.append(f"{layer}/{name} imports {other}/{mod}")
    return out


def test_no_test_file_imports_a_test_file_of_another_layer():
    files = {
        layer: {p.name: p.read_text() for p in sorted((TESTS / layer).glob("test_*.py"))} for layer in LAYERS
    }
    assert all(files.values())
    found = crossings(files)
    assert not found, "move what both use into a helper module in tests/:\n" + "\n".join(found)


def test_the_check_finds_a_crossing():
    files = {
        "unit": {"test_a.py": "from test_b import x\nimport test_c\n", "test_c.py": ""},
        "daemon": {"test_b.py": "from tenancy import y\nfrom test_c import z\n"},
    }
    assert sorted(crossings(files)) == [
        "daemon/test_b.py imports unit/test_c",
        "unit/test_a.py imports daemon/test_b",
    ]
