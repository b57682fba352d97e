"""A benchmark or test stopped from outside leaves no server running: children started with
``die_with_parent`` end with the process that started them (even one SIGKILLed), and a process that
called ``close_on_sigterm`` runs its ``finally`` clauses on SIGTERM. Real processes; each test also
runs without the helper and sees the child outlive its parent (the control)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tierd.tools.testing import proc_stat

PARENT = """
import signal, subprocess, sys, time
from tierd.tools.testing import close_on_sigterm, die_with_parent
tied, closing = sys.argv[1] == "1", sys.argv[2] == "1"
if closing:
    close_on_sigterm()
kw = {"preexec_fn": die_with_parent(signal.SIGTERM)} if tied else {}
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
child = subprocess.Popen(sleeper, stdout=subprocess.DEVNULL, **kw)
try:
    print(child.pid, flush=True)
    time.sleep(120)
finally:
    child.terminate()
    child.wait(10)
    print("closed", flush=True)
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as ended)."""
    return (proc_stat(f"/proc/{pid}/stat") or ["Z"])[0] != "Z"


def start_parent(tied: bool, closing: bool) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(int(tied)), str(int(closing))], stdout=subprocess.PIPE, text=True
    )
    return parent, int(parent.stdout.readline())


def ended_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "control-untied"])
def test_a_server_started_by_a_killed_benchmark_does_not_outlive_it(tied):
    parent, child = start_parent(tied=tied, closing=False)
    try:
        parent.kill()  # SIGKILL: no finally runs in the parent
        parent.wait(10)
        assert ended_within(child, 5 if tied else 1) is tied
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("closing", [True, False], ids=["closing", "control-default"])
def test_a_benchmark_stopped_by_sigterm_closes_what_it_started(closing):
    parent, child = start_parent(tied=False, closing=closing)
    try:
        parent.send_signal(signal.SIGTERM)
        out, _ = parent.communicate(timeout=20)
        assert ("closed" in out) is closing
        assert ended_within(child, 5 if closing else 1) is closing
        assert parent.returncode == (1 if closing else -signal.SIGTERM)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
