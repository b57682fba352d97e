"""No import circles in tierd/ or client/ (issue 8): the graph of every import statement, at module
level or inside a function (a lazy import that only hides a circle is still one), between the
project's own modules, has no cycle; and no module reads another's private attributes (``x._name``
where the module defines no ``_name`` itself). Static: read with ast, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"tierd": ROOT / "tierd", "tierd_client": ROOT / "client"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((pkg, *parts))] = path
    return out


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    g = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                deps.update(subs)
                if len(subs) < len(node.names):  # names from the module itself
                    deps.add(node.module)
        g[name] = {d for d in deps if d in mods and d != name}
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_project_has_no_import_circles():
    mods = modules()
    assert "tierd.server" in mods and "tierd_client.vllm_connector.worker" in mods
    found = cycles(graph(mods))
    assert found == [], f"import circles: {found}"


def test_the_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# Private attributes of other libraries the project relies on, each for a reason:
FOREIGN_PRIVATE = {
    "_exit",  # os._exit: a forked helper ends without running the parent's atexit handlers
    # torch's storage sharing (what torch.multiprocessing's reductions call); torch has no public
    # way to hand a tensor's memory to another process as a descriptor or a CUDA IPC handle
    "_share_cuda_",
    "_new_shared_cuda",
    "_get_shared_fd",
}


def private_reaches(path: Path) -> list[str]:
    """``x._name`` in ``path`` where ``x`` is not self/cls and the module defines no ``_name``
    itself (as a def, a class, an attribute it assigns, a slot or a class-level name)."""
    tree = ast.parse(path.read_text())
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            own.add(node.value)  # __slots__ entries, setattr/getattr names
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.endswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if node.attr not in own and node.attr not in FOREIGN_PRIVATE:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_module_reaches_into_another_modules_private_attributes():
    found = [hit for path in modules().values() for hit in private_reaches(path)]
    assert not found, "use (or add) a public name instead:\n" + "\n".join(found)
