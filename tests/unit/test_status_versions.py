"""``tierd status`` and /status name the versions an operator matches a daemon, its pool and its
engines by: tierd's, the key format's, the vLLM of the daemon's environment and the vLLM releases
tierd is tested with (pyproject.toml's ``vllm`` extra, read back from the installed metadata).
/status from the daemon's objects in this process (tests/inproc.py); what ``tierd status`` prints
of them is tests/daemon/test_cli.py's."""

from __future__ import annotations

from vllm_versions import pyproject_vllm_range, vllm_here

import tierd
from tierd.protocol.keys import KEY_VERSION


def test_status_names_the_versions_of_tierd_the_key_format_and_vllm(inproc, inclient):
    versions = inproc.status()["versions"]
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
    assert inclient.status()["versions"] == want  # STATUS is the same object
