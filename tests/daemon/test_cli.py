"""The command line: invalid settings exit 2 with a message naming the flag, serve --help shows
units and defaults, ``tierd status`` prints a table (or the raw object with --json), and
``tierd bench --json`` prints one JSON object of figures with every byte verified; ``tierd status``
names the versions of tierd, the key format and vLLM; ``tierd serve`` refuses an unknown eviction
policy."""

import json
import re
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures
from vllm_versions import pyproject_vllm_range, vllm_here

from tierd import __version__
from tierd.protocol.keys import KEY_VERSION
from tierd.tools.testing import serve_argv


def tierd(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "tierd", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


BAD = [
    (["--l1-size-gb", "-1"], "--l1-size-gb"),
    (["--l1-size-gb", "lots"], "--l1-size-gb"),
    (["--socket", "foo://x"], "--socket"),
    (["--socket-mode", "999"], "--socket-mode"),
    (["--socket-mode", "1777"], "--socket-mode"),
    (["--l1-size-gb", "1", "--l1-init-size-gb", "2"], "--l1-init-size-gb"),
    (["--l1-align-bytes", "1000"], "--l1-align-bytes"),
    (["--l1-align-bytes", "32"], "--l1-align-bytes"),
    (["--http-port", "70000"], "--http-port"),
    (["--heartbeat-timeout-s", "0"], "--heartbeat-timeout-s"),
    (["--max-frame-mb", "0"], "--max-frame-mb"),
    (["--log-level", "loud"], "--log-level"),
    (["--no-such-flag"], "--no-such-flag"),
]


def test_invalid_settings_exit_2_with_a_clear_message(tmp_path):
    sock = f"ipc://{tmp_path}/never.sock"
    for args, flag in BAD:
        full = (
            ["serve", "--http-port", "-1", "--socket", sock, *args]
            if "--socket" not in args
            else ["serve", "--http-port", "-1", *args]
        )
        res = tierd(*full)
        assert res.returncode == 2, (args, res.returncode, res.stderr)
        assert flag in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr and "Error" in res.stderr
    assert not (tmp_path / "never.sock").exists()


def test_serve_help_shows_units_and_defaults():
    res = tierd("serve", "--help")
    assert res.returncode == 0
    out = " ".join(res.stdout.split())  # undo click's wrapping
    for needle in [
        "--l1-size-gb",
        "GiB",
        "[default: 8.0]",
        "--l1-init-size-gb",
        "[default: 0.0]",
        "MiB",
        "[default: 4096]",
        "--heartbeat-timeout-s",
        "Seconds",
        "[default: 30.0]",
        "[default: 60.0]",
        "--separate-object-groups / --no-separate-object-groups",
        "[default: -1]",
        "[default: 0600]",
        "[default: 64]",
        "[default: 9800]",
        "ipc://",
        "tcp://",
    ]:
        assert needle in out, needle
    assert tierd("--version").stdout.startswith("tierd")


def test_status_prints_a_table_and_json(daemon, client, ranks):
    rank = ranks(GroupGeom("full"))
    client.register("rank-zero", rank.layout())
    client.store("rank-zero", [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(keys(3))])
    res = tierd("status", "--url", daemon.http)
    assert res.returncode == 0, res.stderr
    for needle in [
        "memory",
        "objects",
        "lookups",
        "stores",
        "evictions",
        "instances (1)",
        "rank-zero",
        "test-model",
        "rank 0/1",
        " shm ",  # how the daemon copies this rank's bytes
        "store stages",  # where its copies' time went: mean ms per stage
        "(ms per copy, mean of 1)",
        "groups full ",
        daemon.endpoint,
    ]:
        assert needle in res.stdout, needle
    res = tierd("status", "--url", daemon.http, "--json")
    assert res.returncode == 0
    data = json.loads(res.stdout)
    assert data["objects"] == 3 and data["instances"][0]["instance"] == "rank-zero"
    assert set(data) == set(daemon.status())
    res = tierd("status", "--socket", daemon.endpoint, "--json")  # STATUS over the daemon's own socket
    assert json.loads(res.stdout)["boot_id"] == data["boot_id"]


def test_status_without_a_daemon_fails_clearly(tmp_path):
    from conftest import free_port

    res = tierd("status", "--url", f"http://127.0.0.1:{free_port()}")
    assert res.returncode == 1
    assert "no tierd answers" in res.stderr and "Traceback" not in res.stderr


def test_status_with_no_socket_file_fails_within_the_start_grace_saying_how_to_start_one(tmp_path):
    """Regression: with no daemon (not even a socket file) ``tierd status`` waited its full 5 s
    STATUS deadline, then said only 'DEADLINE'."""
    from click.testing import CliRunner

    from tierd.tools.cli import STARTING_S, main

    sock = f"ipc://{tmp_path}/tierd.sock"
    t0 = time.monotonic()
    res = CliRunner().invoke(main, ["status", "--socket", sock])
    waited = time.monotonic() - t0
    assert res.exit_code == 1, res.output
    assert f"{tmp_path}/tierd.sock does not exist" in res.output
    assert f"`tierd serve --socket {sock}`" in res.output
    assert STARTING_S <= waited < STARTING_S + 1.5  # the grace for a daemon started just before, no more


def test_status_finds_a_daemon_started_in_the_same_breath(tmp_path):
    """README step 2: ``tierd serve &`` then ``tierd status`` at once (the socket file is not there yet)."""
    sock = f"ipc://{tmp_path}/tierd.sock"
    serve = subprocess.Popen(
        serve_argv(endpoint=sock, http_port=-1, pool_mb=10.24),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        res = tierd("status", "--socket", sock, "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["pid"] == serve.pid
    finally:
        serve.terminate()
        serve.wait(15)


def test_bench_json():
    res = tierd("bench", "--json", "--chunks", "8", "--rounds", "1", "--layers", "2", timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stdout
    data = json.loads(lines[0])
    for key in ("store_gbps", "retrieve_gbps", "baseline_gbps"):
        assert isinstance(data[key], (int, float)) and data[key] > 0, key
    assert data["verified"] is True
    assert data["layers"] == 2 and data["chunks"] == 8


@pytest.mark.parametrize("args", [["--chunk-tokens", "250"]])
def test_bench_rejects_bad_geometry(args):
    res = tierd("bench", "--json", "--chunks", "2", "--rounds", "1", *args)
    assert res.returncode == 1 and "multiple of" in res.stderr


def test_serve_with_http_port_0_logs_the_port_it_picked(tmp_path):
    import signal
    import urllib.request

    proc = subprocess.Popen(
        serve_argv(endpoint=f"ipc://{tmp_path}/t.sock", http_port=0, pool_mb=10.24, log_level="warning"),
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        line = proc.stderr.readline()
        assert "HTTP on http://127.0.0.1:" in line, line
        url = line.rsplit("HTTP on ", 1)[1].strip()
        assert not url.endswith(":0")
        with urllib.request.urlopen(url + "/healthz", timeout=5) as resp:
            assert resp.read().strip() == b"ok"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


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
        rf"version +tierd {re.escape(__version__)}, key format {KEY_VERSION} \(pid \d+, up ",
        rows["version"],
    ), rows["version"]
    here = vllm_here()
    if here is None:
        pytest.skip("no vLLM in this environment: the vllm row says none")  # checked below in words
    assert rows["vllm"].split(None, 1)[1] == (
        f"{here} in the daemon's environment; tierd is tested with vLLM {pyproject_vllm_range()}"
    ), rows["vllm"]


def test_an_unknown_eviction_policy_is_refused_at_start():
    import subprocess
    import sys

    out = subprocess.run(
        serve_argv("--eviction-policy", "arc", http_port=-1),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "'arc' is not one of 'reuse', 'lru'" in out.stderr
