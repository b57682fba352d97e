"""The wheel holds every package of the source tree: a folder with an ``__init__.py`` under tierd/,
client/ (installed as tierd_client) or native/ (as tierd.native) that the build leaves out makes
an install whose daemon or client fails at its first import of it. The wheel is built from a copy
of the checkout with this environment's setuptools (``python -m build --wheel --no-isolation``,
about 2 s); scripts/wheel_check.py (run by CI) goes on to install and run it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = {"tierd": "tierd", "client": "tierd_client", "native": "tierd/native"}
LEFT_BEHIND = shutil.ignore_patterns(
    ".git", "__pycache__", "build", "dist", "*.egg-info", ".venv", ".pytest_cache", ".hypothesis"
)


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    pytest.importorskip("build", reason="python -m build (the dev extra) builds the wheel")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=LEFT_BEHIND, symlinks=True)
    cmd = [
        sys.executable,
        "-m",
        "build",
        "--wheel",
        "--no-isolation",
        "--outdir",
        str(tmp / "dist"),
        str(src),
    ]
    p = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"the wheel did not build:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    (wheel,) = (tmp / "dist").glob("tierd-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def package_folders() -> dict[str, str]:
    """{source folder: where the wheel must hold it} for every folder with an __init__.py."""
    out = {}
    for src, dst in INSTALLED.items():
        for init in (ROOT / src).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / src).as_posix()
            out[init.parent.relative_to(ROOT).as_posix()] = dst if rel == "." else f"{dst}/{rel}"
    return out


def test_every_module_folder_is_in_the_wheel(wheel_names):
    folders = package_folders()
    assert "tierd/protocol" in folders and "client/vllm_connector" in folders  # the walk found them
    lost = sorted(
        f"{src} (as {dst})" for src, dst in folders.items() if f"{dst}/__init__.py" not in wheel_names
    )
    assert not lost, f"the wheel leaves out these packages: {lost}"


def test_only_tierds_packages_are_in_the_wheel(wheel_names):
    tops = {n.split("/", 1)[0] for n in wheel_names if "/" in n and ".dist-info/" not in n}
    assert tops == {"tierd", "tierd_client"}, f"the wheel installs top-level folders {sorted(tops)}"
    wanted = {f"{dst}/__init__.py" for dst in package_folders().values()}
    extra = sorted(n for n in wheel_names if n.endswith("/__init__.py") and n not in wanted)
    assert not extra, f"the wheel holds packages that are no package folder of the source: {extra}"
