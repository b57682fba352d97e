"""The engine side and the daemon share one wire contract, ``tierd.protocol``, and nothing else:
``tierd_client`` imports no other ``tierd`` module (a daemon module's constant, class or helper
would make the client depend on the daemon's internals, and its copy of an arithmetic drift from
the daemon's). Static: every import statement under client/, at module level or inside a
function, read with ast; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "client"
# What the client may import of tierd: the wire contract, and the package that carries the CUDA
# kernels' source (native/, installed as ``tierd.native``: data both sides build, no daemon code).
ALLOWED = (("tierd", "protocol"), ("tierd", "native"))


def forbidden_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of each import of a ``tierd`` module outside ALLOWED, in line order."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "tierd":  # ``from tierd import x``: x is a module or a name of tierd
                names = [f"tierd.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = tuple(name.split("."))
            if parts[0] == "tierd" and parts[:2] not in ALLOWED:
                out.append((node.lineno, name))
    return sorted(out)


def test_the_client_imports_nothing_of_the_daemon_but_its_protocol():
    files = sorted(CLIENT.rglob("*.py"))
    assert any(p.name == "transport.py" for p in files)
    found = [
        f"{path.relative_to(CLIENT.parent)}:{line}: {name}"
        for path in files
        for line, name in forbidden_imports(path.read_text())
    ]
    assert not found, "tierd_client may import only tierd.protocol:\n" + "\n".join(found)


def test_the_check_tells_the_protocol_from_the_rest_of_the_daemon():
    src = (
        "import tierd.protocol.codec\n"
        "from tierd.protocol import MAX_REQUEST_PARTS\n"
        "from tierd.protocol.layout import GroupKind\n"
        "from tierd import protocol\n"
        "import tierd_client.shm\n"
        "def f():\n"
        "    from tierd.edge.channel import channel_path\n"
        "import tierd.base.config\n"
        "from tierd.edge import fdinbox\n"
        "from tierd.protocolx import y\n"
        "import tierd.native\n"
        "import tierd\n"
    )
    assert forbidden_imports(src) == [
        (7, "tierd.edge.channel"),
        (8, "tierd.base.config"),
        (9, "tierd.edge"),
        (10, "tierd.protocolx"),
        (12, "tierd"),
    ]
