"""Start-up as an engine meets it: the connector finds the daemon where the daemon's default puts
it, a missing daemon costs at most ``tierd.connect_timeout_s`` per rank and no request waits for
it, the tier turns on when the daemon appears later, and the connector's lines are in vLLM's log."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierd.tools.testing import serve_argv

pytest.importorskip("vllm")

import torch  # noqa: E402
from conftest import ROOT, DaemonProcess, free_port  # noqa: E402
from vllm_sim import GroupDef, SimEngine, make_vllm_config  # noqa: E402

CHUNK = 64
HERE = Path(__file__).resolve().parents[1]  # tests/


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def test_the_default_url_is_where_the_daemons_default_socket_is(tmp_path, monkeypatch):
    """No tierd.url, no --socket: with XDG_RUNTIME_DIR set (a login session) both sides resolve
    $XDG_RUNTIME_DIR/tierd/tierd.sock; without it both resolve /tmp/tierd-$UID/tierd.sock."""
    from tierd_client import TierdClient
    from tierd_client.vllm_connector.config import ConnectorConfig

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert ConnectorConfig.from_extra({}).url == f"ipc:///tmp/tierd-{os.getuid()}/tierd.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    url = ConnectorConfig.from_extra({}).url
    assert url == f"ipc://{tmp_path}/tierd/tierd.sock"
    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen(
        serve_argv(http_port=free_port(), pool_mb=256),
        cwd=ROOT,
        env=dict(os.environ),
        stdout=log,
        stderr=log,
    )
    try:
        client = TierdClient(url, timeout_s=5, connect_timeout_s=20)
        try:
            assert client.wait_ready(20).protocol >= 1
        finally:
            client.close()
    finally:
        daemon.terminate()
        daemon.wait(15)
        log.close()


def _worker(tiny_model: str, url: str, **extra):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from tierd_client.vllm_connector import TierdConnector

    vc = make_vllm_config(tiny_model, url, 16, CHUNK, extra={"tierd.timeout_s": 10, **extra})
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=4, dtype=torch.int8)
    kcc = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return TierdConnector(vc, KVConnectorRole.WORKER, kcc)


def test_a_missing_daemon_costs_a_rank_at_most_connect_timeout_at_start_up(tiny_model, tmp_path):
    w = _worker(tiny_model, f"ipc://{tmp_path}/nobody.sock")  # tierd.timeout_s=10 (calls), connect 1 s
    try:
        t0 = time.monotonic()
        w.register_kv_caches({"l0": torch.zeros((32, 16, 8), dtype=torch.int8)})
        took = time.monotonic() - t0
        assert took < 1.0 + 3.0, f"register_kv_caches held start-up {took:.1f} s without a daemon"
    finally:
        w.shutdown()


def test_without_a_daemon_requests_run_at_once_without_the_tier(tiny_model, tmp_path):
    e = SimEngine(tiny_model, f"ipc://{tmp_path}/nobody.sock", [GroupDef("full")], chunk_tokens=CHUNK)
    try:
        e.add("a", prompt(200, seed=71))
        e.step()
        assert e.computed.get("a"), "the first step did not schedule the request (it waited for a lookup)"
        e.run()
        assert "a" in e.finished and e.first_computed("a") == 0
    finally:
        e.close()


def test_a_restarted_engines_first_request_is_served_from_the_tier(tiny_model, tmp_path):
    """vLLM builds the scheduler after its workers registered and schedules at once: the first
    request must not race the scheduler's HELLO (it did, and was computed in full, on CI)."""
    folder = tmp_path / "d"
    folder.mkdir()
    d = DaemonProcess(folder)
    a = b = None
    try:
        tokens = prompt(200, seed=74)
        a = SimEngine(tiny_model, d.endpoint, [GroupDef("full")], chunk_tokens=CHUNK)
        a.add("a", tokens)
        a.run()
        assert a.first_computed("a") == 0
        a.close()
        a = None
        for n in range(3):  # each a fresh engine whose first step is its first request's lookup
            b = SimEngine(tiny_model, d.endpoint, [GroupDef("full")], chunk_tokens=CHUNK)
            b.add(f"b{n}", tokens)
            b.run()
            assert b.first_computed(f"b{n}") == 3 * CHUNK, f"engine {n}: first request missed the tier"
            b.assert_restored(f"b{n}", tokens, 3 * CHUNK)
            b.close()
            b = None
    finally:
        for e in (a, b):
            if e is not None:
                e.close()
        d.kill()


def test_the_tier_turns_on_when_the_daemon_comes_up_after_the_engine(tiny_model, tmp_path):
    folder = tmp_path / "late"
    folder.mkdir()
    url = f"ipc://{folder}/tierd.sock"
    extra = {"tierd.register_retry_s": 0.2}
    a = SimEngine(tiny_model, url, [GroupDef("full")], chunk_tokens=CHUNK, extra=extra)
    d = b = None
    try:
        a.add("before", prompt(200, seed=72))
        a.run()
        d = DaemonProcess(folder)
        deadline = time.monotonic() + 20
        n = 0
        while not d.status()["instances"] or a.connector.client.server is None:
            assert time.monotonic() < deadline, "the engine never registered with the late daemon"
            a.add(f"warm{n}", prompt(70, seed=100 + n))  # steps with stores retry the REGISTER
            a.run()
            n += 1
            time.sleep(0.1)
        tokens = prompt(200, seed=73)
        a.add("a", tokens)
        a.run()
        b = SimEngine(tiny_model, url, [GroupDef("full")], chunk_tokens=CHUNK)
        b.add("b", tokens)
        b.run()
        assert b.first_computed("b") == 3 * CHUNK
        b.assert_restored("b", tokens, 3 * CHUNK)
    finally:
        for e in (a, b):
            if e is not None:
                e.close()
        if d is not None:
            d.kill()


LOG_SCRIPT = r"""
import sys, time
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # what vLLM's engine does when it starts
sys.path.insert(0, {tests!r})
from vllm_sim import GroupDef, SimEngine
from conftest import DaemonProcess
from pathlib import Path
e = SimEngine({model!r}, "ipc://{folder}/tierd.sock", [GroupDef("full")], chunk_tokens=64)
e.close()
d = DaemonProcess(Path({folder!r}))
e = SimEngine({model!r}, d.endpoint, [GroupDef("full")], chunk_tokens=64)
e.close()
d.kill()
"""


def test_the_connector_says_once_per_rank_in_vllms_log_which_daemon_and_whether_it_registered(
    tiny_model, tmp_path
):
    folder = tmp_path / "d"
    folder.mkdir()
    code = LOG_SCRIPT.format(tests=str(HERE), model=tiny_model, folder=str(folder))
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    vllm_line = r"\(\S+ pid=\d+\) {level} \d\d-\d\d [\d:]+ \[{file}:\d+\] "
    down = re.findall(
        vllm_line.format(level="WARNING", file=r"registration\.py")
        + r"tierd: rank 0 runs without the tier for now: no answer from a tierd within 1 s.*at ipc://",
        out,
    )
    up = re.findall(
        vllm_line.format(level="INFO", file=r"registration\.py")
        + r"tierd: rank 0 registered with ipc://\S+ as \S+/0 .*the tier is on",
        out,
    )
    hello = re.findall(
        vllm_line.format(level="INFO", file=r"connector\.py") + r"TierdConnector \(worker\) -> ipc://", out
    )
    assert len(down) == 1 and len(up) == 1 and len(hello) == 2, out[-4000:]
    assert "runs without the tier" not in "".join(
        ln for ln in out.splitlines() if not re.match(r"\(\S+ pid=", ln)
    )
