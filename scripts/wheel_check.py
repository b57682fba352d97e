"""The install a user makes, proven: build the sdist and the wheel from this checkout (the wheel
from the sdist, as ``python -m build`` does), check that they hold every file of tierd/, client/
and native/ that git tracks (the .py files, and the C and CUDA sources compiled on first use),
install the wheel into a fresh virtual environment outside the checkout (its dependencies from
the package index, by default each at the lower bound the wheel declares: the test suite's
environment has the newest, so both ends of each range run in CI), and from an empty folder,
where the checkout is not importable, run what a user runs first: ``tierd serve``, ``tierd
status``, a short ``tierd bench``, a STORE and RETRIEVE through ``tierd_client``, the
connector's import, and ``tierd serve`` with the flags of deploy/tierd.service and
deploy/tierd.env (the unit's program being the venv's console script).

The connector needs vLLM, which the fresh environment does not have (a 2 GB install): there the
vLLM-free part of ``tierd_client.vllm_connector`` is imported and ``TierdConnector`` must fail on
vLLM alone; then the wheel's files alone (unpacked, without dependencies) are put in front of
the running interpreter's environment, and ``TierdConnector`` is imported from them against the
vLLM installed there. Without vLLM in this interpreter that step says it skipped.

    python scripts/wheel_check.py [--keep]

Exits 1 with a line naming each failure (and the daemon's log when it is the daemon); ``--keep``
leaves the work folder (printed) in place. Run by .ci/run before the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# where each source folder lands in the installed distribution
INSTALLED = {"tierd/": "tierd/", "client/": "tierd_client/", "native/": "tierd/native/"}
TOP_LEVEL = {"tierd", "tierd_client"}  # the wheel's only packages (never tests/, scripts/, ...)


class Failed(Exception):
    pass


def step(name: str):
    """Print the step's name, then its time; collect timings for the summary."""

    class _Step:
        def __enter__(self):
            self.t0 = time.monotonic()
            print(f"wheel check: {name} ...", flush=True)

        def __exit__(self, kind, exc, tb):
            dt = time.monotonic() - self.t0
            TIMES.append((name, dt, exc is None))
            return False

    return _Step()


TIMES: list[tuple[str, float, bool]] = []


def run(cmd: list[str], what: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if p.returncode != 0:
        out = (p.stdout + p.stderr).strip()
        raise Failed(f"{what} exited {p.returncode}: {' '.join(map(str, cmd))}\n{textwrap.indent(out, '  ')}")
    return p


def tracked() -> list[str]:
    """Files git tracks under the folders that are installed (a tree without git: every .py, .c
    and .cu file there)."""
    folders = list(INSTALLED)
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z", "--", *folders], capture_output=True, check=True
        ).stdout
        return sorted(p for p in out.decode().split("\0") if p)
    except (OSError, subprocess.CalledProcessError):
        exts = {".py", ".c", ".cu"}
        return sorted(
            str(p.relative_to(ROOT))
            for f in folders
            for p in (ROOT / f).rglob("*")
            if p.suffix in exts and "__pycache__" not in p.parts
        )


def installed_name(path: str) -> str:
    for src, dst in INSTALLED.items():
        if path.startswith(src):
            return dst + path[len(src) :]
    raise ValueError(path)


def build(dist: Path, isolation: bool) -> tuple[Path, Path]:
    cmd = [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)]
    if not isolation:
        cmd.insert(3, "--no-isolation")
    try:
        import build  # noqa: F401
    except ImportError as exc:
        raise Failed("python -m build needs the 'build' package: pip install -e '.[dev]'") from exc
    run(cmd, "python -m build", timeout=600)
    wheels, sdists = sorted(dist.glob("tierd-*.whl")), sorted(dist.glob("tierd-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise Failed(f"expected one wheel and one sdist in {dist}, found {os.listdir(dist)}")
    return wheels[0], sdists[0]


def lower_bounds(wheel: Path) -> list[tuple[str, str]]:
    """(name, version) of each dependency the wheel always needs, at the lower bound it declares;
    one without a lower bound fails (an untested floor is no floor)."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:") or ";" in line:  # a marker: an extra's or a platform's
            continue
        req = line.removeprefix("Requires-Dist:").strip()
        name = re.match(r"[A-Za-z0-9._-]+", req).group(0)
        low = re.search(r">=\s*([\w.]+)", req)
        if low is None:
            raise Failed(f"the dependency {req!r} declares no lower bound")
        out.append((name, low.group(1)))
    if not out:
        raise Failed("the wheel declares no dependencies")
    return out


def check_contents(wheel: Path, sdist: Path) -> list[str]:
    """What the wheel and the sdist miss of the tracked files, and any package of the wheel that
    is not one of ours."""
    problems = []
    with zipfile.ZipFile(wheel) as z:
        in_wheel = set(z.namelist())
    files = tracked()
    if not files:
        return ["no tracked files found under tierd/, client/, native/"]
    lost = [f"{p} (as {installed_name(p)})" for p in files if installed_name(p) not in in_wheel]
    if lost:
        problems.append("the wheel misses " + ", ".join(lost))
    tops = {n.split("/", 1)[0] for n in in_wheel if "/" in n and ".dist-info/" not in n}
    if tops - TOP_LEVEL:
        problems.append(
            f"the wheel installs folders that are not tierd's packages: {sorted(tops - TOP_LEVEL)}"
        )
    with tarfile.open(sdist) as t:
        names = t.getnames()
    prefix = names[0].split("/", 1)[0] + "/"
    in_sdist = {n[len(prefix) :] for n in names if n.startswith(prefix)}
    lost = [p for p in files + ["pyproject.toml", "README.md"] if p not in in_sdist]
    if lost:
        problems.append("the sdist misses " + ", ".join(lost))
    return problems


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(venv: Path | None) -> dict[str, str]:
    """This process's environment without anything that makes the checkout importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(venv)
    return env


ROUND_TRIP = """
import sys, uuid
import numpy as np
import tierd, tierd_client
from tierd_client import TierdClient
from tierd_client.layouts import block_span, group, layout, namespace
from tierd_client.shm import SharedBuffer
from tierd_client.native import source_path
from tierd.transfer import mapcopy

prefix = sys.argv[2]
for mod in (tierd, tierd_client):
    assert mod.__file__.startswith(prefix), f"{mod.__name__} imported from {mod.__file__}, not the wheel"
cu = source_path()
assert str(cu).startswith(prefix) and cu.is_file(), f"the CUDA source is not the wheel's: {cu}"
assert mapcopy.SOURCE.startswith(prefix), mapcopy.SOURCE
assert mapcopy.load() is not None or sys.argv[3] == "no-cc", "mapcopy.c did not build from the wheel"

layers, blocks, block_bytes, block_tokens, chunk_tokens = 2, 16, 256, 4, 16
buf = SharedBuffer(layers * blocks * block_bytes, prefix="tierd-wheel-check")
kv = buf.array.reshape(layers, blocks, block_bytes)
kv[:] = np.random.default_rng(1).integers(0, 255, kv.shape, dtype=np.uint8)
spans = [block_span((blocks, block_bytes), (block_bytes, 1), 1, 0, tensor=0, offset=l * blocks * block_bytes)
         for l in range(layers)]
ns = namespace("wheel-check", uuid.uuid4().hex[:8], 1)
lay = layout(ns, 0, chunk_tokens, [buf.ref()], [group("full", block_tokens, spans)])
keys = [uuid.uuid4().bytes for _ in range(2)]
with TierdClient(sys.argv[1]) as c:
    c.wait_ready(10)
    c.register("wheel-check", lay)
    chunks = lambda first: [{"key": k, "blocks": [list(range(first + i * 4, first + i * 4 + 4))]}
                            for i, k in enumerate(keys)]
    stored = c.store("wheel-check", chunks(0))
    assert stored.results == ["stored"] * 2, stored
    want = kv[:, 0:8].copy()
    out = c.retrieve("wheel-check", chunks(8))
    assert (out.ok, out.failed) == ([True, True], []), out
    assert (kv[:, 8:16] == want).all(), "retrieved bytes differ from the stored ones"
    c.unregister("wheel-check")
buf.close()
print("round trip: 2 chunks stored and retrieved byte-equal")
"""

CONNECTOR_WITHOUT_VLLM = """
import importlib.util, sys
import tierd_client.vllm_connector as pkg
assert pkg.__file__.startswith(sys.argv[1]), pkg.__file__
assert importlib.util.find_spec("vllm") is None, "this environment was meant to have no vLLM"
try:
    pkg.TierdConnector
except ModuleNotFoundError as exc:
    assert exc.name == "vllm" or (exc.name or "").startswith("vllm."), exc
else:
    raise AssertionError("TierdConnector imported without vLLM")
print("tierd_client.vllm_connector imports; TierdConnector needs vLLM alone")
"""

CONNECTOR_WITH_VLLM = """
import sys
import tierd, tierd_client
from tierd_client.vllm_connector import TierdConnector
import vllm
for mod in (tierd, tierd_client, sys.modules[TierdConnector.__module__]):
    assert mod.__file__.startswith(sys.argv[1]), f"{mod.__name__} imported from {mod.__file__}, not the wheel"
print("TierdConnector imported from the wheel's files with vLLM", vllm.__version__)
"""


def has_vllm() -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([sys.executable, "-c", probe], cwd=tempfile.gettempdir()).returncode == 0


def wait_healthy(daemon: subprocess.Popen, port: int, log_path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if daemon.poll() is not None:
            raise Failed(f"tierd serve exited {daemon.returncode} while starting:\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise Failed(
                    f"tierd serve did not answer in {timeout:.0f} s:\n{log_path.read_text()}"
                ) from None
            time.sleep(0.1)


def serve_and_use(work: Path, venv: Path, wheel_version: str) -> None:
    py, tierd = str(venv / "bin" / "python"), str(venv / "bin" / "tierd")
    here = work / "run"  # empty: nothing of the checkout is importable from here
    here.mkdir()
    env = clean_env(venv)
    site = run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], "the venv's python", env=env
    ).stdout.strip()
    url, port = f"ipc://{here}/tierd.sock", free_port()
    log_path = work / "daemon.log"
    with step("tierd serve"), open(log_path, "w") as log:
        daemon = subprocess.Popen(
            [tierd, "serve", "--socket", url, "--http-port", str(port), "--l1-size-gb", "0.25"],
            cwd=here,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        with step("tierd serve answers /healthz"):
            wait_healthy(daemon, port, log_path)
        with step("tierd status"):
            table = run([tierd, "status", "--socket", url], "tierd status", cwd=here, env=env).stdout
            print(textwrap.indent(table.strip(), "  "))
            raw = run(
                [tierd, "status", "--url", f"http://127.0.0.1:{port}", "--json"],
                "tierd status --json",
                cwd=here,
                env=env,
            ).stdout
            if json.loads(raw)["version"] != wheel_version:
                raise Failed(
                    f"tierd status names version {json.loads(raw)['version']}, the wheel {wheel_version}"
                )
        with step("tierd bench (short)"):
            bench = [tierd, "bench", "--socket", url, "--layers", "2", "--kv-heads", "2", "--head-dim", "64"]
            bench += ["--chunks", "4", "--batch", "2", "--rounds", "1", "--quiet", "--json"]
            out = run(bench, "tierd bench", cwd=here, env=env, timeout=120).stdout
            json.loads(out[out.index("{") :])
        with step("STORE and RETRIEVE through tierd_client"):
            cc = "cc" if shutil.which(os.environ.get("CC") or "cc") else "no-cc"
            out = run([py, "-c", ROUND_TRIP, url, site, cc], "the client round trip", cwd=here, env=env)
            print("  " + out.stdout.strip())
        with step("import tierd_client.vllm_connector (no vLLM)"):
            out = run([py, "-c", CONNECTOR_WITHOUT_VLLM, site], "the connector import", cwd=here, env=env)
            print("  " + out.stdout.strip())
        with step("tierd serve stops on SIGTERM"):
            daemon.send_signal(signal.SIGTERM)
            rc = daemon.wait(30)
            if rc != 0:
                raise Failed(f"tierd serve exited {rc} on SIGTERM:\n{log_path.read_text()}")
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


def deploy_argv(venv: Path, socket_url: str, pool_dir: str, port: int) -> list[str]:
    """deploy/tierd.service's ExecStart with deploy/tierd.env's TIERD_ARGS, as systemd runs it, the
    program being this venv's ``tierd`` and the socket, pool folder and HTTP port private ones."""
    unit = (ROOT / "deploy" / "tierd.service").read_text()
    (line,) = [ln for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    argv = line.removeprefix("ExecStart=").split()
    if Path(argv[0]).name != "tierd" or Path(argv[0]).parent.name != "bin":
        raise Failed(f"deploy/tierd.service's ExecStart is not a venv's console script: {argv[0]}")
    show = 'set -a; . "$1"; printf %s "$TIERD_ARGS"'
    env_file = str(ROOT / "deploy" / "tierd.env")
    args = run(["sh", "-c", show, "sh", env_file], "reading deploy/tierd.env").stdout.split()
    i = argv.index("$TIERD_ARGS")
    argv[i : i + 1] = args
    for flag, value in (("--socket", socket_url), ("--pool-dir", pool_dir), ("--http-port", str(port))):
        if flag not in argv:
            raise Failed(f"deploy's tierd serve has no {flag}")
        argv[argv.index(flag) + 1] = value
    return [str(venv / "bin" / "tierd"), *argv[1:]]


def serve_as_deployed(work: Path, venv: Path) -> None:
    """The wheel's daemon with deploy/'s flags (a pool folder on /dev/shm included)."""
    here = work / "deploy"
    here.mkdir()
    pool_dir = tempfile.mkdtemp(prefix="tierd-wheel-check-pool-", dir="/dev/shm")
    port = free_port()
    argv = deploy_argv(venv, f"ipc://{here}/tierd.sock", pool_dir, port)
    log_path = work / "deploy.log"
    with step("tierd serve as deploy/tierd.service starts it"), open(log_path, "w") as log:
        daemon = subprocess.Popen(argv, cwd=here, env=clean_env(venv), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(daemon, port, log_path)
            daemon.send_signal(signal.SIGTERM)
            if daemon.wait(30) != 0:
                raise Failed(
                    f"deploy's tierd serve exited {daemon.returncode} on SIGTERM:\n{log_path.read_text()}"
                )
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
            shutil.rmtree(pool_dir, ignore_errors=True)


def connector_with_vllm(work: Path, wheel: Path) -> None:
    if not has_vllm():
        print("wheel check: SKIPPED TierdConnector with vLLM: no vLLM in this interpreter's environment")
        return
    with step("TierdConnector from the wheel's files, with vLLM"):
        only = work / "wheel-only"
        with zipfile.ZipFile(wheel) as z:  # a pure wheel's packages sit at its root
            z.extractall(only)
        env = clean_env(None)
        env["PYTHONPATH"] = str(only)  # in front of this environment's site-packages (and its checkout)
        out = run(
            [sys.executable, "-c", CONNECTOR_WITH_VLLM, str(only)], "the connector import", cwd=work, env=env
        )
        print("  " + out.stdout.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="leave the work folder in place")
    ap.add_argument(
        "--no-isolation",
        action="store_true",
        help="build with this environment's setuptools (python -m build --no-isolation)",
    )
    ap.add_argument(
        "--deps",
        choices=["lowest", "newest"],
        default="lowest",
        help="the wheel's dependencies at the lower bounds it declares (default: the tested floors; the"
        " test suite's environment has the newest), or the newest the index has",
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tierd-wheel-check-"))
    t0 = time.monotonic()
    problems: list[str] = []
    try:
        with step("python -m build (sdist, then the wheel from it)"):
            wheel, sdist = build(work / "dist", isolation=not args.no_isolation)
        print(f"  {wheel.name}, {sdist.name}")
        with step("the wheel and the sdist hold every tracked file"):
            problems += check_contents(wheel, sdist)
        with step(f"a fresh venv outside the checkout, the wheel installed ({args.deps} dependencies)"):
            venv = work / "venv"
            run([sys.executable, "-m", "venv", str(venv)], "python -m venv")
            pip = [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "--no-compile"]
            if args.deps == "lowest":
                pins = work / "lowest.txt"
                pins.write_text("".join(f"{name}=={low}\n" for name, low in lower_bounds(wheel)))
                print(textwrap.indent(pins.read_text().strip(), "  "))
                pip += ["--only-binary", ":all:", "--constraint", str(pins)]
            run([*pip, str(wheel)], "pip install <wheel>", cwd=work, env=clean_env(venv))
        version = wheel.name.split("-")[1]
        serve_and_use(work, venv, version)
        serve_as_deployed(work, venv)
        connector_with_vllm(work, wheel)
    except (Failed, subprocess.TimeoutExpired) as exc:
        problems.append(str(exc))
    finally:
        if args.keep:
            print(f"wheel check: work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for name, dt, ok in TIMES:
        print(f"  {dt:6.1f} s  {'ok  ' if ok else 'FAIL'}  {name}")
    total = time.monotonic() - t0
    if problems:
        for p in problems:
            print(f"wheel check FAILED: {p}", file=sys.stderr)
        print(f"wheel check: FAILED after {total:.1f} s", file=sys.stderr)
        return 1
    print(f"wheel check: passed in {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
