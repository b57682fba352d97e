"""What the docs point a reader at exists: every source path they name, every module of tierd/ in
the package map (tierd/__init__.py's docstring), and every constant the limits table of
docs/protocol.md cites, with the value the table gives. Static reads; no daemon.

Stale pointers were found in review: protocol.md named tierd/ops.py, tierd/sessions.py and
``fields.MAX_NAME_LEN`` long after the modules were gone."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import tierd
from tierd.protocol.errors import ErrorCode

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"`((?:tierd|client|benchmarks|scripts|tests|deploy|native|docs)/[\w./-]*)`")


def named_paths(text: str) -> set[str]:
    return {m.rstrip("/") for m in PATH.findall(text)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_name_only_files_that_exist(doc):
    missing = sorted(p for p in named_paths(doc.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def map_entries() -> set[str]:
    return set(re.findall(r"^\s+(tierd/[\w/.]+)", tierd.__doc__, re.M))


def test_the_package_map_names_every_module_of_tierd_and_only_those():
    entries = map_entries()
    # a layer's folder is named whole when it says its modules itself (pool, transfer, second tier,
    # protocol), else module by module
    named = {e for e in entries if e.count("/") == 2 and e.endswith("/")}
    here = set()
    for layer in (p for p in (ROOT / "tierd").iterdir() if (p / "__init__.py").exists()):
        if f"tierd/{layer.name}/" in named:
            here.add(f"tierd/{layer.name}/")
            continue
        for p in layer.iterdir():
            if (p / "__init__.py").exists():
                here.add(f"tierd/{layer.name}/{p.name}/")
            elif p.suffix == ".py" and p.name != "__init__.py":
                here.add(f"tierd/{layer.name}/{p.name}")
    assert entries - here == set(), "the map names modules that are gone"
    assert here - entries == set(), "the map misses modules (add each where a request meets it)"


def limits_rows(doc: str) -> list[tuple[str, str]]:
    """(value cell, source cell) of each row of protocol.md's section 19."""
    section = doc.split("## 19. Limits", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("limit", "---"):
            rows.append((cells[1], cells[2]))
    return rows


# not where limits live (L2's imports need the mooncake extra); __main__ would run the CLI
SKIP = ("tierd.tier2.", "tierd.tools.bench.")


def resolve(name: str):
    """The value of a constant named ``module.NAME`` (a module of tierd by its last components) or
    ``NAME`` (defined by exactly one module of tierd)."""
    *mod, attr = name.split(".")
    found = []
    for info in pkgutil.walk_packages(tierd.__path__, "tierd."):
        if info.name.startswith(SKIP) or info.name.endswith("__main__"):
            continue
        if mod and info.name.split(".")[-len(mod) :] != mod:
            continue
        module = importlib.import_module(info.name)
        if attr in vars(module):
            found.append(vars(module)[attr])
    assert found, f"no module of tierd defines {name}"
    assert len(set(map(repr, found))) == 1, f"{name} is ambiguous: {found}"
    return found[0]


UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "s": 1}


def documented(value: str) -> float | None:
    """The number a value cell starts with, in the constant's own unit (bytes for KiB/MiB)."""
    m = re.match(r"^(2\^(\d+)|\d+(?:\.\d+)?)\s*(KiB|MiB|s|characters|bytes)?\b", value)
    if m is None:
        return None
    number = 2 ** int(m.group(2)) if m.group(2) else float(m.group(1))
    return number * UNITS.get(m.group(3) or "", 1)


def test_the_limits_table_cites_constants_that_exist_with_the_value_it_gives():
    rows = limits_rows((ROOT / "docs" / "protocol.md").read_text())
    assert len(rows) > 10
    checked = 0
    for value, source in rows:
        names = [
            n
            for n in re.findall(r"`((?:[a-z_]+\.)*[A-Z][A-Z0-9_]+)`", source)
            if n not in ErrorCode.__members__  # "`TOO_LARGE` beyond": the error, not a constant
        ]
        values = [resolve(n) for n in names]
        number = documented(value)
        if len(names) == 1 and number is not None:
            assert values[0] == number, f"section 19 says {value!r} for {names[0]}, the code {values[0]}"
            checked += 1
    assert checked >= 8, checked


# a folder of one machine (a home, root's home, a workspace) or a command that starts from one
# virtual environment's interpreter instead of the README's activated environment's `python`
MACHINE_PATH = re.compile(
    r"(?<![\w.~])/(?:work|root|home/(?!\.\.\.))[/\w]|(?<![\w.~])/tmp/[\w.-]*venv|\S*venv/bin/python3?\s+\S+\.py"
)
# where a path stands for what it is: the CI entry checks for the README's .venv; a systemd unit
# needs its interpreter's absolute path (deploy/tierd.service says where it comes from)
MACHINE_PATH_OK = {".ci/run", "deploy/tierd.service"}


def tracked_text_files() -> list[str]:
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [
        p for p in out.splitlines() if p.endswith((".md", ".py", ".sh", ".toml", ".txt", ".cfg", ".service"))
    ]


def test_no_command_or_path_of_one_machine_is_in_the_repository():
    """Was: benchmarks/README.md and benchmarks/vllm_ttft.py started their examples with the
    absolute virtual-environment path of the machine that wrote them."""
    me = str(Path(__file__).relative_to(ROOT))
    found = [
        f"{path}:{n}: {line.strip()}"
        for path in tracked_text_files()
        if path not in MACHINE_PATH_OK and path != me and (ROOT / path).is_file()
        for n, line in enumerate((ROOT / path).read_text(errors="replace").splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not found, "write `python benchmarks/...` from the README's environment:\n" + "\n".join(found)


def test_the_machine_path_check_would_see_the_paths_it_refuses():
    for line in (
        "/work/venv/bin/python benchmarks/vllm_ttft.py --configs none",
        ".venv/bin/python benchmarks/l2_tierd.py --rounds 5",
        'build_tiny_llama() -> "/home/alice/.cache/tierd/tiny-llama-v1"',
        "cd /root/tierd && make",
        "/tmp/lmcache-venv/bin/lmcache server",
    ):
        assert MACHINE_PATH.search(line), line
    for line in (
        "python benchmarks/vllm_ttft.py",
        "~/.cache/tierd/ci-venv",
        "/dev/shm/tierd-pool",
        "a/work/b",
    ):
        assert not MACHINE_PATH.search(line), line
