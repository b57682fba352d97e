"""A real vLLM OpenAI server (vllm-cpu, its default multi-process engine) with TierdConnector,
stopped the ways engines stop: SIGTERM, Ctrl-C (SIGINT to the process group), SIGKILL of the
server, SIGKILL of its whole process group (what systemd, docker and kubernetes do) and SIGKILL
of its EngineCore helper. After each: no /dev/shm file of the engine exists, and no session (nor
the daemon's mapping of the engine's KV memory) outlives the process that held it: at once for
signals a process sees (BYE), within the daemon's heartbeat timeout for SIGKILL.

``TIERD_RECORD_STOPS=FILE`` appends each stop's figures to FILE (JSON lines)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")

from conftest import DaemonProcess, free_port  # noqa: E402
from conftest_vllm import SERVER_CPU_ENV, VLLM_CPU_ENV  # noqa: E402
from tiny_model import build_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow(seconds=240)]

HEARTBEAT_S = 3.0


def shm_files(pids=()) -> list[str]:
    """Named /dev/shm files of these processes: torch and tierd_client name theirs torch_<pid>_...
    and tierd-kv-<pid>-...; files of other processes (tests running beside this one) are not the
    engine's."""
    prefixes = tuple(p for pid in pids for p in (f"torch_{pid}_", f"tierd-kv-{pid}-"))
    return sorted(n for n in os.listdir("/dev/shm") if prefixes and n.startswith(prefixes))


def vllm_shm_files() -> set[str]:
    """vLLM's own shared memory (Python SharedMemory rings, semaphores): not tierd's, recorded."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "sem.mp-"))}


def unmapped(names: set[str]) -> set[str]:
    maps = ""
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps += f.read()
        except OSError:
            pass
    return {n for n in names if n not in maps}


def shmem_mib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("Shmem:"))


def daemon_shm_fds(d: DaemonProcess) -> int:
    """/dev/shm files the daemon holds (it copies with preadv/pwritev on one fd per file, no mapping)."""
    held = 0
    for fd in os.listdir(f"/proc/{d.proc.pid}/fd"):
        try:
            held += os.readlink(f"/proc/{d.proc.pid}/fd/{fd}").startswith("/dev/shm/")
        except OSError:
            pass
    return held


def figures(d: DaemonProcess, pids=()) -> dict:
    s = d.status()
    return {
        "shm_files": shm_files(pids),
        "sessions": s["sessions"],
        "daemon_shm_fds": daemon_shm_fds(d),
        "shmem_mib": shmem_mib(),
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProcess(tmp_path_factory.mktemp("stops"), "--heartbeat-timeout-s", str(HEARTBEAT_S))
    yield d
    d.kill()


def start_server(d: DaemonProcess, tmp: Path):
    port = free_port()
    cfg = {
        "kv_connector": "TierdConnector",
        "kv_connector_module_path": "tierd_client.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tierd.url": d.endpoint},
    }
    env = {**os.environ, **VLLM_CPU_ENV, **SERVER_CPU_ENV}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server's default: EngineCore and Worker processes
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            build_tiny_llama(),
            "--port",
            str(port),
            "--max-model-len",
            "2048",
            "--block-size",
            "32",
            "--enforce-eager",
            "--max-num-seqs",
            "4",
            "--kv-transfer-config",
            json.dumps(cfg),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "server.log").read_text()[
                -4000:
            ]
            time.sleep(0.5)
    rng = random.Random(port)
    body = json.dumps(
        {"model": build_tiny_llama(), "prompt": [rng.randrange(3, 1000) for _ in range(600)], "max_tokens": 4}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    json.loads(urllib.request.urlopen(req, timeout=120).read())
    return proc, log


def wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


STOPS = ["SIGTERM", "SIGINT-group", "SIGKILL", "SIGKILL-group", "SIGKILL-EngineCore"]


@pytest.mark.parametrize("stop", STOPS)
def test_no_file_session_or_mapping_outlives_an_engine_process(daemon, tmp_path, stop):
    before = figures(daemon)
    vllm_before = vllm_shm_files()
    proc, log = start_server(daemon, tmp_path)
    try:
        stop_and_check(daemon, proc, log, stop, before, vllm_before)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        # vLLM 0.32 leaves its own rings behind when SIGKILLed; remove those nobody maps. Only rings:
        # a live semaphore is mapped under glibc's temporary name, not its own, so "unmapped" cannot
        # tell a leftover semaphore from another process's live one (removing that one kills the
        # other process's next spawn).
        for name in unmapped({n for n in vllm_shm_files() - vllm_before if n.startswith("psm_")}):
            os.unlink(f"/dev/shm/{name}")


def stop_and_check(daemon, proc, log, stop, before, vllm_before) -> None:
    helpers = psutil.Process(proc.pid).children(recursive=True)
    core = [p for p in helpers if "EngineCore" in p.name()]
    pids = [proc.pid, *(p.pid for p in helpers)]
    time.sleep(0.5)
    during = figures(daemon, pids)
    assert during["shm_files"] == before["shm_files"], "the running engine has named /dev/shm files"
    assert during["sessions"] == before["sessions"] + 2
    assert during["daemon_shm_fds"] == before["daemon_shm_fds"] + 1
    sig = signal.SIGKILL if "KILL" in stop else getattr(signal, stop.split("-")[0])
    t0 = time.monotonic()
    if stop.endswith("-group"):
        os.killpg(proc.pid, sig)
    else:
        os.kill(core[0].pid if stop.endswith("EngineCore") else proc.pid, sig)
    try:
        proc.wait(60)
    finally:
        log.close()
    exit_s = time.monotonic() - t0
    time.sleep(0.3)
    alive = [p for p in helpers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    at_exit = figures(daemon, pids)
    # sessions of dead processes: gone at once when they could say BYE, else after the heartbeat timeout
    settle = HEARTBEAT_S + 2.0
    assert wait_for(lambda: daemon.status()["sessions"] <= before["sessions"] + 2 * bool(alive), settle)
    settled = figures(daemon, pids)
    orphans = [(p.pid, p.name()) for p in alive]
    for p in (
        alive
    ):  # vLLM 0.32 leaves its EngineCore running when the server is SIGKILLed: clean up as a supervisor would
        p.kill()
    psutil.wait_procs(alive, timeout=30)
    assert wait_for(lambda: daemon.status()["sessions"] == before["sessions"], settle)
    assert wait_for(lambda: daemon_shm_fds(daemon) == before["daemon_shm_fds"], 2.0)
    final = figures(daemon, pids)
    vllm_left = sorted(unmapped(vllm_shm_files() - vllm_before))
    assert final["shm_files"] == before["shm_files"] and at_exit["shm_files"] == before["shm_files"]
    if stop == "SIGINT-group":  # every process saw the signal: every session said BYE
        assert at_exit["sessions"] == before["sessions"], "a stop every process saw left a session behind"
    if stop == "SIGTERM":  # vLLM kills the helpers right after: the engine core let go of the KV memory
        assert at_exit["daemon_shm_fds"] == before["daemon_shm_fds"]
        assert at_exit["sessions"] <= before["sessions"] + 1  # at most the killed worker's empty session
    record = os.environ.get("TIERD_RECORD_STOPS")
    if record:
        with open(record, "a") as f:
            f.write(
                json.dumps(
                    {
                        "stop": stop,
                        "exit_s": round(exit_s, 2),
                        "orphans": orphans,
                        "vllm_shm_left": vllm_left,
                        "before": before,
                        "during": during,
                        "at_exit": at_exit,
                        "settled": settled,
                        "final": final,
                    }
                )
                + "\n"
            )
