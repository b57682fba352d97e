"""No import circles in tierd/ or client/: the graph of every import statement, at module
level or inside a function (a lazy import that only hides a circle is still one), between the
project's own modules, has no cycle; and no module reads another's private attributes (``x._name``
where the module defines no ``_name`` itself). Static: read with ast, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
    assert "tierd.daemon.server" in mods and "tierd_client.vllm_connector.worker" in mods
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


# The daemon's layers, top first, each a folder of tierd/: a module may import (at module level,
# in a function, or for type checking only) modules of its own layer and of the layers below it,
# never above. So a request's path goes down, daemon -> core -> (second tier) -> state (and the
# planner) -> pool -> transfer, over the edge's sockets, and comes back as returned values, never
# as a call from below into a module it left.
LAYERS = [
    ("operator's tools", ("tierd.__main__", "tierd.tools")),
    ("daemon", ("tierd.daemon",)),
    ("request core", ("tierd.core",)),
    ("second tier", ("tierd.tier2",)),
    ("state and planner", ("tierd.state",)),
    ("pool", ("tierd.pool",)),
    ("transfer", ("tierd.transfer",)),
    ("edge", ("tierd.edge",)),
    ("wire and settings", ("tierd.protocol", "tierd.base", "tierd")),
]


def test_every_layer_is_a_folder_and_every_folder_a_layer():
    """tierd/'s folders are its layers: no module beside them but the package's own two."""
    folders = {p.name for p in PACKAGES["tierd"].iterdir() if (p / "__init__.py").exists()}
    listed = {p.split(".")[1] for _, prefixes in LAYERS for p in prefixes if p.count(".") == 1}
    assert folders - {"native"} == listed - {"__main__"}
    loose = {p.name for p in PACKAGES["tierd"].glob("*.py")}
    assert loose == {"__init__.py", "__main__.py"}, f"put these in a layer's folder: {loose}"


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index of ``module``'s layer (its longest listed prefix), None outside tierd."""
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and p.count(".") > depth:
                best, depth = i, p.count(".")
    return best


def upward(g: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Imports from a lower layer's module of a higher layer's."""
    out = []
    for mod, deps in g.items():
        here = layer_of(mod, layers)
        if here is None:
            continue
        for dep in deps:
            there = layer_of(dep, layers)
            if there is not None and there < here:
                out.append(f"{mod} ({layers[here][0]}) imports {dep} ({layers[there][0]})")
    return sorted(out)


def test_every_daemon_module_has_a_layer():
    missing = [m for m in modules() if m.split(".")[0] == "tierd" and layer_of(m) is None]
    assert not missing, f"add these to LAYERS: {missing}"


def test_no_lower_layer_imports_a_higher_one():
    found = upward(graph(modules()))
    assert not found, "a lower layer reaches up (return a value instead):\n" + "\n".join(found)


def test_the_layer_check_finds_an_upward_import():
    layers = [("top", ("t",)), ("mid", ("m",)), ("low", ("l", "m.leaf"))]
    assert upward({"t.a": {"m.b", "l.c"}, "m.b": {"l.c"}, "l.c": set()}, layers) == []
    assert upward({"m.b": {"t.a"}, "m.leaf": {"m.b"}}, layers) == [
        "m.b (mid) imports t.a (top)",
        "m.leaf (low) imports m.b (mid)",
    ]


def object_hooks(path: Path) -> list[str]:
    """Attributes annotated ``object`` (or ``object | None``) in a class, or on ``self``: a hook
    whose type says nothing, through which anything could be handed in and called."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.AnnAssign):
            continue
        ann = node.annotation
        bare = isinstance(ann, ast.Name) or (isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr))
        names = {
            n.id if isinstance(n, ast.Name) else n.value
            for n in ast.walk(ann)
            if isinstance(n, (ast.Name, ast.Constant))
        }
        if bare and "object" in names and names <= {"object", "None", None}:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node.target)}")
    return out


def test_no_daemon_hook_is_typed_object():
    found = [
        hit for name, path in modules().items() if name.startswith("tierd.") for hit in object_hooks(path)
    ]
    assert not found, "type these (a Protocol, or the class itself):\n" + "\n".join(found)


def callbacks_up(root, root_module: str, depth: int = 3) -> list[str]:
    """Callables reachable from ``root``'s attributes (through dicts, lists and tuples, ``depth``
    objects deep) whose code lives in a higher layer than ``root_module``'s: a lower layer that
    would call back up at run time."""
    here = layer_of(root_module)
    seen, out = set(), []

    def code_module(value) -> str | None:
        func = getattr(value, "__func__", None) or getattr(value, "func", None) or value
        if callable(func) and hasattr(func, "__module__") and not isinstance(func, type):
            return getattr(func, "__module__", None)
        return None

    def walk(value, where: str, left: int) -> None:
        if id(value) in seen or left < 0:
            return
        seen.add(id(value))
        mod = code_module(value)
        if mod is not None and mod.startswith("tierd"):
            there = layer_of(mod)
            if there is not None and there < here:
                out.append(f"{where}: {mod}")
        if isinstance(value, dict):
            items = list(value.items())[:64]
            for k, v in items:
                walk(v, f"{where}[{k!r}]", left - 1)
        elif isinstance(value, (list, tuple, set)):
            for i, v in enumerate(list(value)[:64]):
                walk(v, f"{where}[{i}]", left - 1)
        elif hasattr(value, "__dict__") and type(value).__module__.startswith("tierd"):
            for k, v in vars(value).items():
                walk(v, f"{where}.{k}", left - 1)

    walk(root, root_module, depth)
    return out


def test_the_pool_and_registry_of_a_running_daemon_hold_no_callback_into_a_higher_layer(tmp_path):
    """A daemon in process, a lease granted but its pins not applied yet (the pool holds them
    as data), then the pool's and the registry's attributes are walked for callables of a
    higher layer."""
    from tierd.base.config import Settings
    from tierd.daemon.server import Daemon

    d = Daemon(Settings(socket=f"ipc://{tmp_path}/t.sock", http_port=-1, l1_size_gb=0.0625))
    try:
        session = d.registry.open_session(b"i" * 16, "c", 1)
        d.registry.grant(session, [], 1)
        found = callbacks_up(d.pool, "tierd.pool.pool") + callbacks_up(d.registry, "tierd.state.registry")
        assert not found, "a lower layer holds a callback into a higher one:\n" + "\n".join(found)
    finally:
        d.close()


def test_the_callback_walk_finds_one():
    from functools import partial

    from tierd.core import handlers

    class Holder:
        __module__ = "tierd.pool.pool"

    h = Holder()
    h.hooks = {"evict": partial(handlers.hello, None)}
    assert callbacks_up(h, "tierd.pool.pool") == ["tierd.pool.pool.hooks['evict']: tierd.core.handlers"]


# What a module may import inside a function: an optional dependency (an extra of pyproject, or one
# a user may lack), which a module-level import would make every user install. Anything else is
# imported at module level, where the graph and a reader see it.
# (tierd_client.vllm_connector.connector imports vLLM at module level: its package reaches it on
# first access, so the rest of the package imports without vLLM. tierd.tier2 is the optional
# second tier over Mooncake Store: a daemon without --l2-url imports none of it,
# tests/e2e/test_l2_daemon.py.)
OPTIONAL = (
    "tierd.tier2",
    "torch",
    "vllm",
    "mooncake",
    "matplotlib",
    "packaging",
    "tierd.native",
    "tierd_client.vllm_connector.connector",
)


def lazy_imports(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every import inside a function of ``source`` that is not OPTIONAL."""
    out = set()
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            out.update(
                (node.lineno, n) for n in names if not any(n == o or n.startswith(o + ".") for o in OPTIONAL)
            )
    return sorted(out)


def test_nothing_but_an_optional_dependency_is_imported_inside_a_function():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in modules().values()
        for line, name in lazy_imports(path.read_text())
    ]
    assert not found, "import these at module level:\n" + "\n".join(found)


def test_the_lazy_import_check_finds_one():
    source = "import os\n\ndef f():\n    import torch\n    from tierd.pool import pool\n    import json\n"
    assert lazy_imports(source) == [(5, "tierd.pool"), (6, "json")]
