"""Mooncake Store on loopback inside a network namespace: a master and daemon-like nodes.

Hazard first: Mooncake's HTTP metadata server, its metrics port and the transfer engine's ports
bind 0.0.0.0 whatever host they are given. So nothing here may run in the host's namespace:
``python tests/l2_harness.py SCENARIO`` is started by :func:`namespaced` (``unshare -n``, then
``ip link set lo up``), and the master and nodes it starts share that namespace and nothing else.
Inside, the master keeps Mooncake's default ports (RPC 50051, metadata 8080), so the URL
defaults are exercised. Every child gets SIGKILL when the harness dies (PR_SET_PDEATHSIG), and
every wait has a timeout: no server outlives a run.

The scenarios live in ``tests/l2_scenarios.py``; each prints one JSON line that the test asserts on.
"""

from __future__ import annotations

import importlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tierd.tools.testing import die_with_parent, proc_stat

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
MASTER_PORTS = (50051, 8080)


def master_binary() -> str | None:
    """``mooncake_master`` beside this interpreter (the package installs it there), else on PATH."""
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def unshare_prefix() -> list[str] | None:
    """``unshare -n`` (root), else ``unshare -rn`` (an unprivileged user namespace), else None."""
    for flags in ("-n", "-rn"):
        try:
            r = subprocess.run(
                ["unshare", flags, "sh", "-c", "ip link set lo up"], capture_output=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if r.returncode == 0:
            return ["unshare", flags]
    return None


def namespaced(args: list[str], timeout: float, prefix: list[str] | None = None) -> dict:
    """Run ``python tests/l2_harness.py *args`` in a fresh network namespace; its JSON result."""
    prefix = prefix or unshare_prefix()
    script = f"ip link set lo up && exec {sys.executable} {TESTS / 'l2_harness.py'} " + " ".join(args)
    r = subprocess.run(
        [*prefix, "sh", "-c", script], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise AssertionError(
            f"harness {args} exited {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
        )
    return json.loads(lines[-1])


def wait_port(port: int, timeout: float, host: str = "127.0.0.1") -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), 0.2).close()
            return
        except OSError:
            if time.monotonic() > end:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s") from None
            time.sleep(0.05)


class Master:
    """``mooncake_master`` on 127.0.0.1 with its own HTTP metadata server, default ports."""

    def __init__(self, workdir: Path, *flags: str):
        self.workdir = workdir
        self.flags = flags
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 20.0) -> Master:
        self.starts += 1
        cmd = [
            master_binary(),
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server",
            "--http_metadata_server_host=127.0.0.1",
            "--metrics_host=127.0.0.1",
            *self.flags,
        ]
        log = open(self.workdir / f"master-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
        for port in MASTER_PORTS:
            wait_port(port, timeout)
        return self

    def kill(self) -> float:
        """SIGKILL; returns the monotonic time it was sent."""
        t = time.monotonic()
        self.proc.kill()
        self.proc.wait(10)
        return t

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP, then wait until every thread of the master is stopped: the signal is delivered
        asynchronously, and a request sent before a thread stops would still be answered."""
        self.proc.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.proc.pid}/task")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [(proc_stat(t / "stat") or [""])[0] for t in tasks.iterdir()]
            if states and all(st in ("T", "t", "") for st in states):
                return
            time.sleep(0.01)
        raise RuntimeError(f"mooncake_master (pid {self.proc.pid}) did not stop within {timeout} s")

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.kill()
            self.proc.wait(10)


class Node:
    """A ``tests/l2_node.py`` process: its own memory and its own Mooncake client."""

    def __init__(
        self, workdir: Path, name: str, url: str, mb: int = 128, mode: str = "tier", timeout: float = 60.0
    ):
        self.name = name
        self.log = workdir / f"node-{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "l2_node.py"), mode, url, str(mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "wb"),
            text=True,
            preexec_fn=die_with_parent(),
            cwd=ROOT,
        )
        self.ready = self._read(timeout)

    def __call__(self, op: str, wait_s: float = 60.0, **kw) -> dict:
        self.send(op, **kw)
        return self._read(wait_s)

    def send(self, op: str, **kw) -> None:
        """Start a command without reading its reply (``reply()`` reads it)."""
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def reply(self, wait_s: float = 60.0) -> dict:
        return self._read(wait_s)

    def _read(self, timeout: float) -> dict:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise RuntimeError(f"node {self.name}: no reply in {timeout} s; log tail:\n{tail(self.log)}")
        return json.loads(line)

    def stop(self) -> None:
        """Ask it to leave the store (its segment unmounted at once), then make sure it is gone."""
        if self.proc.poll() is None:
            try:
                self("quit", wait_s=15)
                self.proc.wait(15)
            except (RuntimeError, BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
            self.proc.kill()
        self.proc.wait(10)


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def main() -> None:
    import tempfile

    import l2_scenarios

    scenario, args = sys.argv[1], sys.argv[2:]
    for name in ("l2_daemons", "l2_faults", "l2_e2e"):  # scenarios of real daemons, faults, engines
        if hasattr(l2_scenarios, scenario):
            break
        l2_scenarios = importlib.import_module(name)
    workdir = Path(tempfile.mkdtemp(prefix=f"tierd-l2-{scenario}-"))
    started: list = []
    try:
        result = getattr(l2_scenarios, scenario)(workdir, started, *args)
    except Exception as e:
        logs = {p.name: tail(p, 1500) for p in sorted(workdir.glob("*.log"))}
        result = {"error": f"{type(e).__name__}: {e}", "logs": logs}
    finally:
        for thing in reversed(started):
            thing.stop()
    if "error" not in result:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
