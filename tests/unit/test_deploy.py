"""deploy/: the systemd unit, its environment file and the sample vLLM launch stay valid against
the `tierd serve` they start."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from tierd.base.config import Settings
from tierd.daemon.server import SHUTDOWN_GRACE_S
from tierd.tools.cli import serve

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "tierd.service"
ENV = DEPLOY / "tierd.env"
LAUNCH = DEPLOY / "vllm-launch.sh"
SYSUSERS = DEPLOY / "tierd.sysusers"
SOCKET = "ipc:///run/tierd/tierd.sock"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def unit() -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#", ";"))
    cp.optionxform = str  # systemd keys are case-sensitive
    cp.read_string(UNIT.read_text())
    return cp


def env_file(text: str) -> dict[str, str]:
    """The subset of systemd's EnvironmentFile syntax deploy/tierd.env may use: comments, KEY=value
    and KEY="value" where a backslash-newline continues the line (and is dropped)."""
    out: dict[str, str] = {}
    text = text.replace("\\\n", "")
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=value: {line!r}"
        value = value.strip()
        if value[:1] == value[-1:] == '"' and len(value) >= 2:
            value = value[1:-1]
        out[key.strip()] = value
    return out


def tierd_args() -> list[str]:
    return env_file(ENV.read_text())["TIERD_ARGS"].split()


@pytest.fixture(scope="module")
def help_flags() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "tierd", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    return set(FLAG.findall(out))


def test_unit_has_the_required_keys():
    svc = unit()["Service"]
    assert svc["Type"] == "simple"
    assert svc["EnvironmentFile"].lstrip("-") == "/etc/tierd/tierd.env"
    exec_start = svc["ExecStart"].split()
    assert Path(exec_start[0]).name == "tierd" and exec_start[1] == "serve"
    assert "$TIERD_ARGS" in exec_start, "flags come from the environment file"
    assert exec_start[exec_start.index("--socket") + 1] == SOCKET
    assert svc["RuntimeDirectory"] == "tierd" and svc["RuntimeDirectoryMode"] == "0750"
    assert SOCKET.startswith(f"ipc:///run/{svc['RuntimeDirectory']}/")
    assert svc["Restart"] == "on-failure"
    assert svc["LimitMEMLOCK"] == "infinity", "CUDA host registration pins the pool"
    assert int(svc["LimitNOFILE"]) >= 65536
    assert svc["KillSignal"] == "SIGTERM"
    assert int(svc["TimeoutStopSec"]) == 30 > SHUTDOWN_GRACE_S + 10  # the grace, then the pool's index
    assert unit()["Install"]["WantedBy"] == "multi-user.target"


def test_unit_keeps_a_pool_dir_across_restarts_and_says_how_to_drop_it():
    svc = unit()["Service"]
    assert svc["KillMode"] == "control-group"
    for key in ("DynamicUser", "RemoveIPC", "PrivateDevices"):  # each would remove or hide /dev/shm files
        assert key not in svc, key
    exec_start = svc["ExecStart"].split()
    pool_dir = exec_start[exec_start.index("--pool-dir") + 1]
    assert pool_dir.startswith("/dev/shm/") and not pool_dir.startswith(f"/run/{svc['RuntimeDirectory']}")
    assert f"rm -rf {pool_dir}" in UNIT.read_text() and "rm -rf DIR" in ENV.read_text()
    assert "--pool-dir" not in tierd_args(), "the pool folder is the unit's"


def test_unit_runs_as_the_tierd_system_user_not_root():
    svc = unit()["Service"]
    assert svc["User"] == "tierd" and svc["Group"] == "tierd"
    assert "DynamicUser" not in svc, "a dynamic user's /dev/shm files (engines' KV, group tierd) go at stop"
    text = UNIT.read_text()
    assert "deploy/tierd.sysusers" in text and "usermod -aG tierd" in text and "docs/security.md" in text


def test_sysusers_snippet_creates_the_user():
    rows = [line.split() for line in SYSUSERS.read_text().splitlines() if line.strip() and line[0] != "#"]
    assert [row[:3] for row in rows] == [["u", "tierd", "-"]], rows  # a system user and its group
    assert "useradd --system" in SYSUSERS.read_text()


def test_socket_admits_group_tierd_and_its_folder_passes_the_daemons_check():
    svc = unit()["Service"]
    exec_start = svc["ExecStart"].split()
    mode = int(exec_start[exec_start.index("--socket-mode") + 1], 8)
    assert mode == 0o660, "owner and group tierd read-write, others nothing"
    folder_mode = int(svc["RuntimeDirectoryMode"], 8)
    assert folder_mode & 0o022 == 0, (
        "tierd.edge.endpoint refuses a socket folder its group or others can write"
    )
    assert folder_mode & 0o050 == 0o050 and folder_mode & 0o007 == 0, "group tierd may enter, others not"
    assert "--socket-mode" not in tierd_args(), "the socket's mode is the unit's"


def test_hardening_leaves_dev_shm_and_gpus_alone():
    svc = unit()["Service"]
    want = {
        "NoNewPrivileges": "yes",
        "CapabilityBoundingSet": "",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes",
        "UMask": "0077",
    }
    assert {k: svc.get(k) for k in want} == want
    # each of these breaks the daemon (reasons in the unit's comments): GPU device nodes hidden or
    # denied, engines' uids remapped, CUDA IPC cut off, engines' /dev/shm files deleted at stop
    for key in (
        "PrivateDevices",
        "ProtectClock",
        "DeviceAllow",
        "DevicePolicy",
        "PrivateUsers",
        "PrivateIPC",
        "ProtectProc",
        "RemoveIPC",
        "DynamicUser",
        "MemoryDenyWriteExecute",
    ):
        assert key not in svc, key
        assert f"{key}=" in UNIT.read_text(), f"the unit should say why {key}= is left out"


def test_systemd_analyze_security_rates_the_unit_ok(tmp_path):
    """systemd's own exposure score (0 safe .. 10 unsafe): the unit as root scored 9.6."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    path = tmp_path / "tierd.service"
    path.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable}", UNIT.read_text(), flags=re.M))
    run = subprocess.run(
        [analyze, "security", "--offline=yes", "--threshold=40", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "--offline" in run.stderr or "unrecognized option" in run.stderr:
        pytest.skip("systemd-analyze security has no --offline (systemd < 250)")
    score = re.search(r"Overall exposure level for \S+: ([\d.]+)", run.stdout)
    assert score and run.returncode == 0 and float(score.group(1)) <= 4.0, run.stdout[-3000:] + run.stderr


def test_every_flag_in_deploy_exists_in_serve_help(help_flags):
    assert "--l1-size-gb" in help_flags
    used = set(FLAG.findall(ENV.read_text())) | set(FLAG.findall(unit()["Service"]["ExecStart"]))
    assert used, "no flags found"
    assert not used - help_flags, f"not flags of `tierd serve`: {sorted(used - help_flags)}"


def test_env_documents_every_flag_at_its_default(help_flags):
    text = ENV.read_text()
    undocumented = sorted(f for f in help_flags - {"--help"} if f not in text)
    assert not undocumented, f"deploy/tierd.env does not mention {undocumented}"
    params = serve.make_context("serve", ["--socket", SOCKET, *tierd_args()]).params
    defaults = {f.name: f.default for f in fields(Settings) if f.name not in ("socket", "socket_mode")}
    differs = {k: (params[k], v) for k, v in defaults.items() if params[k] != v}
    assert not differs, f"TIERD_ARGS values that are not the defaults (given, default): {differs}"
    assert "--socket" not in tierd_args(), "the socket is the unit's (RuntimeDirectory)"
    Settings(**params)  # and they validate


def test_env_file_reads_the_same_in_sh():
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    out = subprocess.run(
        [sh, "-c", 'set -a; . "$1"; printf %s "$TIERD_ARGS"', "sh", str(ENV)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == tierd_args()


def test_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    exe = Path(sys.executable).with_name("tierd")
    if not exe.exists():
        exe = Path(shutil.which("tierd") or "")
    if not exe.name or not exe.exists():
        pytest.skip("no tierd console script to stand in for the unit's ExecStart")
    # verify checks that ExecStart's program exists: point it at this checkout's tierd.
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={exe}", UNIT.read_text(), flags=re.M)
    path = tmp_path / "tierd.service"
    path.write_text(text)
    run = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    ours = [line for line in (run.stdout + run.stderr).splitlines() if "tierd.service" in line]
    assert run.returncode == 0 and not ours, run.stdout + run.stderr


def test_vllm_launch_is_a_valid_script_with_the_connector_config():
    assert LAUNCH.stat().st_mode & 0o111, "deploy/vllm-launch.sh should be executable"
    bash = shutil.which("bash")
    if bash is not None:
        subprocess.run([bash, "-n", str(LAUNCH)], check=True)
    text = LAUNCH.read_text()
    cfg = json.loads(re.search(r"^KV_TRANSFER_CONFIG='([^']*)'", text, re.M).group(1))
    assert cfg["kv_connector"] == "TierdConnector"
    assert cfg["kv_connector_module_path"] == "tierd_client.vllm_connector"
    assert cfg["kv_role"] == "kv_both"
    assert cfg["kv_load_failure_policy"] == "recompute"
    assert cfg["kv_connector_extra_config"]["tierd.url"] == SOCKET
    assert '--kv-transfer-config "$KV_TRANSFER_CONFIG"' in text
