"""Hardening figures (issue 10, "Figures for the closing note"): each attack of the issue's "Why"
list, adapted to the current protocol, against a real ``tierd serve``, and a frame fuzzer.

    .venv/bin/python benchmarks/hardening.py [--quick] [--json PATH] [--fuzz N] [--only 3,5,fuzz]

For every attack (one row each):

- a fresh daemon (``python -m tierd serve`` on an ipc:// socket in a temp folder, HTTP on 127.0.0.1)
  per group of attacks, with the flags the attack needs;
- a **bystander**: a separate process with its own connection that PINGs the daemon every 2 ms and
  records each round trip; the row shows p50/p99/max of the PINGs that overlapped the attack
  (sent before it ended, answered after it began). The bystander's max is the measure of how long
  the daemon's main loop was held. The idle row is the same bystander on an idle daemon, same run;
- the daemon's RSS (``VmRSS``), its peak during the attack (``VmHWM`` after resetting it through
  ``/proc/PID/clear_refs``), its open fds (``/proc/PID/fd``) and threads (``Threads``), just before
  the attack and 0.2 s after it;
- what the daemon answered (error code or result), and whether it was still alive.

Rows (the issue's items 1-10, adapted): 1 symlink, /proc and non-tmpfs paths and descriptors in
REGISTER, as root and as another uid; 2 a /dev/shm file (by path) or a memfd (by fd) truncated
under a registered rank; 3 the largest LOOKUP the decode limits allow (65536 keys; a sliding group
with window 2^30; 64 groups; world_size 4096), the largest STORE, RETRIEVE and REGISTER;
4 an impossible STORE into a full pool; 5 large frames (empty maps, a 64M-int block list, nesting
depth), pipelined, multipart and over MAXMSGSIZE; 6 one 8 KiB STORE into a full pool of 4 KiB
objects; 7 exhaustion: tensors and files per REGISTER, unclaimed descriptors, instances, leases
(count, pool share, and leases on the coldest objects), idle HTTP connections; 8 tenants; 9 a
second daemon on a busy socket, a socket folder of another user; 10 sessions per uid; fuzz; 10b
(last: it kills that daemon) connections that never say HELLO, against a daemon whose
RLIMIT_NOFILE is 4096.

The machine is small (2 cores) and shared: PING figures include whatever else runs. Attacks that
need a second uid (tenants; REGISTER as another user; a socket folder of another user) create a
throwaway system user when run as root (removed at the end) and are skipped otherwise.
Everything binds loopback only. Results: the printed table, and the same as JSON
(benchmarks/results/hardening_cpu.json by default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402
from users import User, UserProcess, shared_socket_dir  # noqa: E402
from wire import Raw, pack  # noqa: E402

from tierd_client import fdpass  # noqa: E402

MIB, KIB = 1 << 20, 1 << 10
mono = time.monotonic
PING_INTERVAL_S = 0.002
OPS = [
    "HELLO",
    "REGISTER",
    "UNREGISTER",
    "LOOKUP",
    "RELEASE",
    "STORE",
    "RETRIEVE",
    "PING",
    "STATUS",
    "CLEAR",
    "BYE",
]


# ---- the bystander (a separate process: python hardening.py --bystander ENDPOINT) ---------------
def bystander_main(endpoint: str) -> None:
    r = Raw(endpoint)
    r.hello()
    samples: list[tuple[float, float]] = []  # (sent, round trip s)
    lock = threading.Lock()
    inflight: list[float | None] = [None]
    reaped: list[float] = []  # when a PING was answered UNKNOWN_SESSION (the bystander was reaped)
    stop = threading.Event()

    def commands() -> None:
        for line in sys.stdin:
            parts = line.split()
            if not parts or parts[0] == "quit":
                break
            t0, t1 = float(parts[1]), float(parts[2])
            deadline = mono() + 15
            while mono() < deadline:  # wait for a PING sent after the window: every overlapping one is in
                with lock:
                    if samples and samples[-1][0] >= t1:
                        break
                time.sleep(0.005)
            with lock:
                rtts = [rtt for sent, rtt in samples if sent < t1 and sent + rtt > t0]
                since = inflight[0]
                done = bool(samples) and samples[-1][0] >= t1
            out = summarize(rtts)
            with lock:
                out["unknown_session"] = sum(t0 <= t <= t1 + 1 for t in reaped)
            if not done and since is not None:  # a PING still unanswered: its wait so far is a lower bound
                out["unanswered_ms"] = round((mono() - since) * 1e3, 1)
                out["max"] = max(out.get("max") or 0.0, out["unanswered_ms"])
            print(json.dumps(out), flush=True)
        stop.set()

    threading.Thread(target=commands, daemon=True).start()
    print("ready", flush=True)
    while not stop.is_set():
        t = mono()
        inflight[0] = t
        try:
            rid = r.send_request("PING", {})
            while True:
                got, ok, body = r.recv(timeout=300)
                if got == rid:
                    break
        except (TimeoutError, zmq.ZMQError):
            inflight[0] = None
            continue
        rtt = mono() - t
        inflight[0] = None
        with lock:
            samples.append((t, rtt))
        if not ok and body.get("code") == "UNKNOWN_SESSION":
            with lock:
                reaped.append(t)
            with contextlib.suppress(Exception):
                r.hello()
        left = t + PING_INTERVAL_S - mono()
        if left > 0:
            time.sleep(left)
    r.close()


def summarize(rtts: list[float]) -> dict:
    if not rtts:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    s = sorted(rtts)
    q = lambda f: round(s[min(len(s) - 1, max(0, int(np.ceil(f * len(s))) - 1))] * 1e3, 3)
    return {"n": len(s), "p50": q(0.50), "p99": q(0.99), "max": round(s[-1] * 1e3, 3)}


class Bystander:
    def __init__(self, endpoint: str):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--bystander", endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"bystander did not start: {line!r}")

    def window(self, t0: float, t1: float) -> dict:
        self.proc.stdin.write(f"w {t0} {t1}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def idle(self, seconds: float) -> dict:
        t0 = mono()
        time.sleep(seconds)
        return self.window(t0, mono())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- the daemon --------------------------------------------------------------------------------------
def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """One ``tierd serve`` on ``ipc://<folder>/tierd.sock``; ``shared``: a folder (0711) and socket
    (0666) other local users can reach."""

    def __init__(self, *args: str, pool_mb: float = 256, shared: bool = False, nofile: int | None = None):
        self.folder = shared_socket_dir() if shared else tempfile.mkdtemp(prefix="tierd-hz-")
        self.endpoint = f"ipc://{self.folder}/tierd.sock"
        self.socket_file = f"{self.folder}/tierd.sock"
        self.http_port = free_port()
        extra = ("--socket-mode", "0666") if shared else ()
        self.args = ["--l1-size-gb", f"{pool_mb / 1024:.6f}", *extra, *args]
        self.log_path = os.path.join(self.folder, "daemon.log")
        self._log = open(self.log_path, "ab")
        cmd = [
            sys.executable,
            "-m",
            "tierd",
            "serve",
            "--socket",
            self.endpoint,
            "--http-port",
            str(self.http_port),
            *self.args,
        ]
        limit = None
        if nofile:
            import resource

            limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=limit
        )
        self.pid = self.proc.pid
        deadline = mono() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tierd exited with {self.proc.returncode}:\n{open(self.log_path).read()}")
            try:
                self.status()
                break
            except OSError:
                if mono() > deadline:
                    raise RuntimeError("tierd did not come up") from None
                time.sleep(0.05)

    def get(self, path: str, timeout: float = 10) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=timeout) as resp:
            return resp.read()

    def status(self) -> dict:
        return json.loads(self.get("/status"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def snapshot(self) -> dict:
        if not self.alive():
            return {"rss_mib": None, "peak_mib": None, "fds": None, "threads": None}
        try:
            st = dict(
                line.split(":", 1)
                for line in open(f"/proc/{self.pid}/status").read().splitlines()
                if ":" in line
            )
            kib = lambda k: int(st[k].split()[0])
            return {
                "rss_mib": round(kib("VmRSS") / 1024, 1),
                "peak_mib": round(kib("VmHWM") / 1024, 1),
                "fds": len(os.listdir(f"/proc/{self.pid}/fd")),
                "threads": int(st["Threads"]),
            }
        except (OSError, KeyError):
            return {"rss_mib": None, "peak_mib": None, "fds": None, "threads": None}

    def reset_peak(self) -> None:
        with contextlib.suppress(OSError), open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS

    def op_seconds(self, op: str) -> tuple[float, int]:
        """(sum, count) of tierd_op_seconds for ``op``: time from a request's arrival to its reply."""
        total, count = 0.0, 0
        for line in self.get("/metrics").decode().splitlines():
            if line.startswith(f'tierd_op_seconds_sum{{op="{op}"}}'):
                total = float(line.split()[-1])
            elif line.startswith(f'tierd_op_seconds_count{{op="{op}"}}'):
                count = int(float(line.split()[-1]))
        return total, count

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


# ---- ranks: KV memory in /dev/shm (by path) or in a memfd (handed over as a descriptor) --------------
class Rank:
    """One rank's KV: per group one buffer of ``layers`` x ``num_blocks`` x ``block_bytes``.
    ``groups``: tuples (kind, layers, block_bytes, block_tokens, window_tokens)."""

    def __init__(
        self,
        groups,
        num_blocks=16,
        chunk_tokens=16,
        world_size=1,
        rank=0,
        memfd=False,
        fingerprint=None,
        fill=None,
    ):
        self.groups, self.num_blocks, self.chunk_tokens = groups, num_blocks, chunk_tokens
        self.world_size, self.rank, self.memfd = world_size, rank, memfd
        self.fingerprint = fingerprint or uuid.uuid4().hex[:8]
        self.paths, self.fds, self.maps, self.sizes = [], [], [], []
        for _kind, layers, block_bytes, _bt, _w in groups:
            n = layers * num_blocks * block_bytes
            if memfd:
                fd = os.memfd_create("tierd-hz", os.MFD_CLOEXEC)
                path = None
            else:
                path = f"/dev/shm/tierd-hz-{os.getpid()}-{uuid.uuid4().hex[:12]}"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            os.ftruncate(fd, n)
            if fill is not None:
                os.pwrite(fd, bytes([fill]) * n if n <= 8 * MIB else b"", 0)
            elif n <= 8 * MIB:
                os.pwrite(
                    fd,
                    np.random.default_rng(len(self.sizes)).integers(0, 256, n, dtype=np.uint8).tobytes(),
                    0,
                )
            self.paths.append(path)
            self.fds.append(fd)
            self.sizes.append(n)
        self.ticket = None

    @property
    def ns(self) -> dict:
        return {
            "model": "hz-model",
            "fingerprint": self.fingerprint,
            "world_size": self.world_size,
            "salt": "",
        }

    def specs(self) -> list[dict]:
        return [{"kind": k, "block_tokens": bt, "window_tokens": w} for k, _l, _b, bt, w in self.groups]

    def bpc(self, gi: int) -> int:
        kind, _l, _b, bt, _w = self.groups[gi]
        return 1 if kind == "state" else self.chunk_tokens // bt

    def send_fds(self, endpoint: str) -> None:
        self.ticket = fdpass.new_ticket()
        fdpass.send_fds(endpoint, self.ticket, self.fds)

    def layout(self) -> dict:
        tensors, groups = [], []
        for gi, (kind, layers, block_bytes, bt, w) in enumerate(self.groups):
            if self.memfd:
                handle = {"kind": "fd", "ticket": self.ticket, "index": gi, "offset": 0}
            else:
                handle = {"kind": "shm", "path": self.paths[gi], "offset": 0}
            tensors.append({"handle": handle, "nbytes": self.sizes[gi]})
            spans = [
                {
                    "tensor": gi,
                    "offset": li * self.num_blocks * block_bytes,
                    "block_stride": block_bytes,
                    "num_blocks": self.num_blocks,
                    "runs": 1,
                    "run_stride": 0,
                    "run_bytes": block_bytes,
                }
                for li in range(layers)
            ]
            groups.append(
                {"kind": kind, "block_tokens": bt, "window_tokens": w, "dtype": "", "layers": spans}
            )
        return {
            "namespace": self.ns,
            "rank": self.rank,
            "replicated": False,
            "chunk_tokens": self.chunk_tokens,
            "device": "cpu",
            "tensors": tensors,
            "groups": groups,
        }

    def chunk(self, key: bytes, start: int = 0) -> dict:
        return {
            "key": key,
            "blocks": [list(range(start, start + self.bpc(gi))) for gi in range(len(self.groups))],
        }

    def read(self, gi: int) -> bytes:
        return os.pread(self.fds[gi], self.sizes[gi], 0)

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        for p in self.paths:
            if p:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
        self.fds, self.paths = [], []


def keys(n: int) -> list[bytes]:
    base = uuid.uuid4().bytes[:12]
    return [base + i.to_bytes(4, "little") for i in range(n)]


def connect(d: Daemon) -> Raw:
    r = Raw(d.endpoint)
    r.hello()
    return r


def call(r: Raw, op: str, body: dict, timeout: float = 60) -> tuple[bool, dict]:
    rid = r.send_request(op, body)
    while True:
        got, ok, reply = r.recv(timeout)
        if got == rid:
            return ok, reply


def code(result: tuple[bool, dict]) -> str:
    ok, reply = result
    return "ok" if ok else reply["code"]


def store_all(r: Raw, inst: str, rank: Rank, ks: list[bytes], batch: int = 4096) -> dict:
    """STORE every key (blocks 0.. of each group), in batches; counts of each result."""
    counts: dict[str, int] = {}
    for i in range(0, len(ks), batch):
        ok, reply = call(r, "STORE", {"instance": inst, "chunks": [rank.chunk(k) for k in ks[i : i + batch]]})
        if not ok:
            counts[reply["code"]] = counts.get(reply["code"], 0) + 1
            continue
        for res in reply["results"]:
            counts[res] = counts.get(res, 0) + 1
    return counts


def pipelined(
    r: Raw, frames: list[tuple[str, dict]], window: int = 200, timeout: float = 30
) -> list[tuple[bool, dict]]:
    """Requests sent ``window`` at a time (replies are dropped past ZeroMQ's high-water mark)."""
    out: dict[int, tuple[bool, dict]] = {}
    ids = []
    for i in range(0, len(frames), window):
        batch = [r.send_request(op, body) for op, body in frames[i : i + window]]
        ids += batch
        want = set(batch)
        while want:
            got, ok, reply = r.recv(timeout)
            if got in want:
                want.discard(got)
                out[got] = (ok, reply)
    return [out[i] for i in ids]


def short(msg: str, n: int = 90) -> str:
    return msg if len(msg) <= n else msg[: n - 3] + "..."


# ---- throwaway users (root only) ---------------------------------------------------------------------
def make_user() -> User | None:
    if os.geteuid() != 0:
        return None
    name = f"tierdhz{uuid.uuid4().hex[:8]}"
    res = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        print(f"useradd failed: {res.stderr.strip()}", file=sys.stderr)
        return None
    pw = pwd.getpwnam(name)
    return User(name, pw.pw_uid, pw.pw_gid)


def remove_user(user: User | None) -> None:
    if user is not None:
        subprocess.run(["userdel", user.name], capture_output=True)


# ---- the harness ---------------------------------------------------------------------------------
class Run:
    def __init__(self, args):
        self.args = args
        self.quick = args.quick
        self.rows: list[dict] = []
        self.idle: dict | None = None
        self.user: User | None = None
        self.only = set(args.only.split(",")) if args.only else None

    def wanted(self, group: str) -> bool:
        return self.only is None or group in self.only

    def measure(self, rid: str, title: str, d: Daemon, by: Bystander, fn, idle_s: float = 0.5) -> dict:
        idle = by.idle(idle_s) if idle_s else None
        before = d.snapshot()
        d.reset_peak()
        t0 = mono()
        try:
            res = fn()
        except Exception as exc:  # noqa: BLE001 - a harness failure is a row too
            import traceback

            traceback.print_exc()
            res = {"answer": f"HARNESS ERROR {type(exc).__name__}: {exc}"}
        t1 = mono()
        time.sleep(0.2)  # let the daemon finish answering (and freeing) before "after"
        after = d.snapshot()
        ping = by.window(t0, t1)
        row = {
            "id": rid,
            "attack": title,
            "answer": res.pop("answer"),
            "alive": d.alive(),
            "seconds": round(t1 - t0, 3),
            "ping_ms": ping,
            "idle_ping_ms": idle,
            "rss_mib": [before["rss_mib"], after["rss_mib"]],
            "peak_rss_mib": after["peak_mib"],
            "fds": [before["fds"], after["fds"]],
            "threads": [before["threads"], after["threads"]],
            "details": res,
        }
        if not row["alive"]:
            row["answer"] += f" -- DAEMON DIED (exit {d.proc.returncode})"
        self.rows.append(row)
        print_row(row)
        return row

    @contextlib.contextmanager
    def daemon(self, *args: str, pool_mb: float = 256, shared: bool = False, nofile: int | None = None):
        d = Daemon(*args, pool_mb=pool_mb, shared=shared, nofile=nofile)
        by = Bystander(d.endpoint)
        try:
            yield d, by
        finally:
            by.close()
            d.stop()


# ---- 1: paths the daemon must not follow --------------------------------------------------------------
NB_SMALL = 2 * 64 * 256  # a 2-layer, 64-block, 256-byte-block rank


def small_layout(handle: dict, nbytes: int = NB_SMALL) -> dict:
    spans = [
        {
            "tensor": 0,
            "offset": li * 64 * 256,
            "block_stride": 256,
            "num_blocks": 64,
            "runs": 1,
            "run_stride": 0,
            "run_bytes": 256,
        }
        for li in range(2)
    ]
    return {
        "namespace": {"model": "hz-model", "fingerprint": uuid.uuid4().hex[:8], "world_size": 1, "salt": ""},
        "rank": 0,
        "replicated": False,
        "chunk_tokens": 16,
        "device": "cpu",
        "tensors": [{"handle": handle, "nbytes": nbytes}],
        "groups": [{"kind": "full", "block_tokens": 4, "window_tokens": 0, "layers": spans}],
    }


def register_path(endpoint: str, path: str) -> tuple[bool, dict]:
    r = Raw(endpoint)
    try:
        r.hello()
        return call(
            r, "REGISTER", {"instance": "p", "layout": small_layout({"kind": "shm", "path": path})}, 10
        )
    finally:
        r.close()


def register_fd(endpoint: str, fd: int) -> tuple[bool, dict]:
    ticket = fdpass.new_ticket()
    try:
        fdpass.send_fds(endpoint, ticket, [fd])
    except OSError as exc:
        return False, {"code": "(fd socket refused)", "message": str(exc)}
    r = Raw(endpoint)
    try:
        r.hello()
        lay = small_layout({"kind": "fd", "ticket": ticket, "index": 0, "offset": 0})
        return call(r, "REGISTER", {"instance": "p", "layout": lay}, 10)
    finally:
        r.close()


def shm_file(path: str, nbytes: int = NB_SMALL, mode: int = 0o600, owner: User | None = None) -> str:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.ftruncate(fd, nbytes)
    if owner is not None:
        os.fchown(fd, owner.uid, owner.gid)
    os.fchmod(fd, mode)
    os.close(fd)
    return path


def u_paths(state, endpoint: str, cases: list[tuple[str, str]]) -> list[tuple[str, bool, dict]]:
    return [(name, *register_path(endpoint, path)) for name, path in cases]


def u_register_path(state, endpoint: str, path: str) -> tuple[bool, dict]:
    return register_path(endpoint, path)


def attack_1(run: Run) -> None:
    tag = f"/dev/shm/tierd-hz-acc-{uuid.uuid4().hex[:8]}"
    tmp = tempfile.mkdtemp(prefix="tierd-hz-files-")
    made: list[str] = []
    opened: list[int] = []
    try:
        with run.daemon(pool_mb=64, shared=True) as (d, by):
            seed = Rank([("full", 2, 256, 4, 0)], num_blocks=64)
            r = connect(d)
            call(r, "REGISTER", {"instance": "seed", "layout": seed.layout()})
            call(
                r, "STORE", {"instance": "seed", "chunks": [seed.chunk(keys(1)[0])]}
            )  # the pool has a segment now
            memfd = next(
                fd
                for fd in os.listdir(f"/proc/{d.pid}/fd")
                if os.readlink(f"/proc/{d.pid}/fd/{fd}").startswith("/memfd:")
            )
            secret = os.path.join(tmp, "root-only")
            with open(secret, "wb") as f:
                f.write(b"s" * NB_SMALL)
            os.chmod(secret, 0o600)

            def link(name, target):
                os.symlink(target, tag + name)
                made.append(tag + name)
                return tag + name

            own = shm_file(tag + "-own")
            made.append(own)
            cases = [
                ("symlink -> /etc/hostname", link("-l1", "/etc/hostname")),
                ("symlink -> a root-only 0600 file outside /dev/shm", link("-l2", secret)),
                ("symlink -> own /dev/shm file", link("-l3", own)),
                ("symlinked folder -> /etc", link("-d1", "/etc") + "/hostname"),
                ("/proc/<daemon>/fd/<pool memfd>", f"/proc/{d.pid}/fd/{memfd}"),
                ("/dev/shm/../proc/<daemon>/fd/<pool memfd>", f"/dev/shm/../proc/{d.pid}/fd/{memfd}"),
                ("/dev/shm link -> /proc/<daemon>/fd/<pool memfd>", link("-l4", f"/proc/{d.pid}/fd/{memfd}")),
                ("/proc/self/fd/0", "/proc/self/fd/0"),
                ("/etc/hostname (not under /dev/shm)", "/etc/hostname"),
            ]
            disk = os.path.join(tmp, "disk")
            shm_ro = shm_file(tag + "-ro")
            made.append(shm_ro)
            fd_cases = [
                ("fd: a regular file on disk, O_RDWR", os.open(disk, os.O_RDWR | os.O_CREAT, 0o600)),
                ("fd: a /dev/shm file opened O_RDONLY", os.open(shm_ro, os.O_RDONLY)),
                ("fd: /proc/self/mem, O_RDWR", os.open("/proc/self/mem", os.O_RDWR)),
                ("fd: a pipe", os.pipe()[0]),
            ]
            os.ftruncate(fd_cases[0][1], NB_SMALL)
            opened += [fd for _, fd in fd_cases]

            def go():
                results = [(name, *register_path(d.endpoint, p)) for name, p in cases]
                results += [(name, *register_fd(d.endpoint, fd)) for name, fd in fd_cases]
                control = register_path(d.endpoint, own)
                return summarize_refusals(results, control, "LAYOUT_INVALID")

            run.measure("1a", "symlink / /proc / non-tmpfs REGISTERs, same uid (root)", d, by, go)
            if run.user is not None:
                u = run.user
                theirs = shm_file(tag + "-root0666", mode=0o666)
                made.append(theirs)
                uown = shm_file(tag + "-uown", owner=u)
                made.append(uown)
                ucases = [
                    ("user's symlink -> /etc/shadow", link("-u1", "/etc/shadow")),
                    ("user's symlink -> root's /dev/shm file", link("-u2", theirs)),
                    ("root's 0666 /dev/shm file", theirs),
                    ("/proc/<daemon>/fd/<pool memfd>", f"/proc/{d.pid}/fd/{memfd}"),
                ]
                for name in ("-u1", "-u2"):
                    os.lchown(tag + name, u.uid, u.gid)

                def go_user():
                    p = UserProcess(u)
                    try:
                        results = p.call(u_paths, d.endpoint, ucases)
                        control = p.call(u_register_path, d.endpoint, uown)
                    finally:
                        p.close()
                    return summarize_refusals(results, control, "LAYOUT_INVALID")

                run.measure(
                    "1b", f"the same as another uid ({u.uid}): links, root's files, /proc", d, by, go_user
                )
            r.close()
            seed.close()
    finally:
        for fd in opened:
            with contextlib.suppress(OSError):
                os.close(fd)
        for p in made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        shutil.rmtree(tmp, ignore_errors=True)


def summarize_refusals(results, control, want: str) -> dict:
    codes = [ok and "ok" or reply["code"] for _, ok, reply in results]
    n_want = codes.count(want)
    answer = f"{want} {n_want}/{len(results)}"
    others = [f"{name}: {c}" for (name, _, _), c in zip(results, codes) if c != want]
    if others:
        answer += " (NOT refused: " + "; ".join(others) + ")"
    answer += f"; control (own file) {code(control)}"
    return {
        "answer": answer,
        "cases": [
            {"case": name, "code": c, "message": short(reply.get("message", ""), 200)}
            for (name, _, reply), c in zip(results, codes)
        ],
        "control": control[1] if not control[0] else "ok",
    }


# ---- 2: a buffer that shrinks under the daemon -----------------------------------------------------
def attack_2(run: Run) -> None:
    with run.daemon(pool_mb=64) as (d, by):
        a, b = connect(d), connect(d)
        other = Rank([("full", 2, 256, 4, 0)], num_blocks=64)
        call(b, "REGISTER", {"instance": "b", "layout": other.layout()})
        kb = keys(2)
        call(b, "STORE", {"instance": "b", "chunks": [other.chunk(kb[0])]})
        for variant in ("path", "memfd"):
            victim = Rank([("full", 2, 256, 4, 0)], num_blocks=64, memfd=variant == "memfd")
            full = victim.sizes[0]

            def go(victim=victim, full=full, variant=variant):
                got = {}
                k = keys(2)
                for op in ("STORE", "RETRIEVE"):
                    os.ftruncate(victim.fds[0], full)
                    if victim.memfd:
                        victim.send_fds(d.endpoint)
                    reg = call(a, "REGISTER", {"instance": "a", "layout": victim.layout()})
                    pre = call(a, "STORE", {"instance": "a", "chunks": [victim.chunk(k[0])]})
                    os.ftruncate(
                        victim.fds[0], full // 4
                    )  # the second layer and the end of the first are gone
                    key = k[0] if op == "RETRIEVE" else k[1]
                    try:
                        res = call(a, op, {"instance": "a", "chunks": [victim.chunk(key, 8)]}, timeout=10)
                        got[op] = code(res) + (f" ({short(res[1]['message'], 70)})" if not res[0] else "")
                    except TimeoutError:
                        got[op] = "NO REPLY"
                    got[f"{op}_setup"] = [code(reg), code(pre)]
                    after = call(a, op, {"instance": "a", "chunks": [victim.chunk(key, 8)]}, timeout=10)
                    got[f"{op}_then"] = code(after)
                # another client goes on: stores and gets its bytes back
                s = call(b, "STORE", {"instance": "b", "chunks": [other.chunk(kb[1], 4)]})
                t = call(b, "RETRIEVE", {"instance": "b", "chunks": [other.chunk(kb[0], 40)]})
                data = other.read(0)
                same = all(
                    data[li * 64 * 256 + 40 * 256 : li * 64 * 256 + 44 * 256]
                    == data[li * 64 * 256 : li * 64 * 256 + 4 * 256]
                    for li in range(2)
                )
                got["other_client"] = [
                    code(s),
                    code(t) if not t[0] else str(t[1]["ok"]),
                    "bytes ok" if same else "BAD",
                ]
                ans = (
                    f"STORE {got['STORE'].split(' (')[0]}, RETRIEVE {got['RETRIEVE'].split(' (')[0]}, "
                    f"then {got['STORE_then']}/{got['RETRIEVE_then']}; "
                    f"other client {'/'.join(got['other_client'])}"
                )
                return {"answer": ans, **got}

            run.measure(
                f"2{'ab'[variant == 'memfd']}",
                f"register a {'/dev/shm file by path' if variant == 'path' else 'memfd by fd'}, "
                "truncate it, STORE and RETRIEVE",
                d,
                by,
                go,
            )
            victim.close()
        st = d.status()
        run.rows[-1]["details"]["internal_errors"] = st["errors_by_code"].get("INTERNAL", 0)
        a.close()
        b.close()
        other.close()


# ---- 3: the largest requests the limits allow ----------------------------------------------------------
def lookup_attack(
    run: Run,
    d: Daemon,
    by: Bystander,
    rid: str,
    title: str,
    rank: Rank,
    nkeys: int,
    present: int,
    repeats: int,
) -> None:
    r = connect(d)
    call(r, "REGISTER", {"instance": f"i{rid}", "layout": rank.layout()})
    ks = keys(present)
    store_all(r, f"i{rid}", rank, ks, batch=256)
    ks += [os.urandom(16) for _ in range(nkeys - present)]
    body = {
        "namespace": rank.ns,
        "keys": ks,
        "chunk_tokens": rank.chunk_tokens,
        "groups": rank.specs(),
        "lease": False,
    }
    frame_mib = len(pack(["LOOKUP", 1, body])) / MIB

    def go():
        s0, c0 = d.op_seconds("LOOKUP")
        rtts, answers = [], set()
        for _ in range(repeats):
            t = mono()
            res = call(r, "LOOKUP", body, timeout=600)
            rtts.append(mono() - t)
            answers.add(f"chunks {res[1]['chunks']}" if res[0] else res[1]["code"])
        s1, c1 = d.op_seconds("LOOKUP")
        hold = (s1 - s0) / max(1, c1 - c0) * 1e3
        return {
            "answer": f"{'/'.join(sorted(answers))} x{repeats}; daemon LOOKUP {hold:.1f} ms each, "
            f"round trip max {max(rtts) * 1e3:.1f} ms",
            "lookup_ms_daemon_mean": round(hold, 2),
            "lookup_rtt_ms": [round(x * 1e3, 2) for x in rtts],
            "frame_mib": round(frame_mib, 2),
            "keys": nkeys,
            "present": present,
            "groups": len(rank.groups),
            "world_size": rank.world_size,
        }

    run.measure(rid, title, d, by, go)
    r.close()


def attack_3(run: Run) -> None:
    nkeys = 8192 if run.quick else 65536
    with run.daemon(pool_mb=256) as (d, by):
        slide = ("sliding", 1, 64, 4, 1 << 30)
        rank = Rank([slide])
        lookup_attack(
            run,
            d,
            by,
            "3a",
            f"LOOKUP {nkeys} keys, 1 sliding group window 2^30, 200 chunks held",
            rank,
            nkeys,
            200,
            10,
        )
        rank.close()
        rank = Rank([slide] * 64)
        lookup_attack(
            run,
            d,
            by,
            "3b",
            f"LOOKUP {nkeys} keys, 64 sliding groups window 2^30 (MAX_GROUPS)",
            rank,
            nkeys,
            200,
            3,
        )
        rank.close()
        world = 4096
        wkeys = 4096 if run.quick else nkeys
        rank = Rank([slide], world_size=world)
        lookup_attack(
            run,
            d,
            by,
            "3c",
            f"LOOKUP {wkeys} keys, 1 sliding group, world_size {world} (rank 0 registered, 200 held)",
            rank,
            wkeys,
            200,
            1,
        )
        rank.close()
        rank = Rank([slide] * 64, world_size=world)
        lookup_attack(
            run,
            d,
            by,
            "3c'",
            f"LOOKUP 256 keys, 64 sliding groups, world_size {world} (the product "
            "keys x groups x ranks as in 3c)",
            rank,
            256,
            200,
            1,
        )
        rank.close()
    nchunks = 8192 if run.quick else 65536
    with run.daemon("--l1-align-bytes", "256", pool_mb=64) as (d, by):
        rank = Rank([("full", 1, 64, 4, 0)])
        r = connect(d)
        call(r, "REGISTER", {"instance": "big", "layout": rank.layout()})
        ks = keys(nchunks)

        def store():
            s0, c0 = d.op_seconds("STORE")
            t = mono()
            res = call(r, "STORE", {"instance": "big", "chunks": [rank.chunk(k) for k in ks]}, timeout=600)
            rtt = mono() - t
            s1, c1 = d.op_seconds("STORE")
            n = res[1]["results"].count("stored") if res[0] else 0
            own = code(call(r, "PING", {}))  # silent for the whole STORE: reaped past --heartbeat-timeout-s?
            if own != "ok":
                r.hello()
                call(r, "REGISTER", {"instance": "big", "layout": rank.layout()})
            return {
                "answer": f"{code(res)}: {n} stored; round trip {rtt * 1e3:.0f} ms "
                f"(arrival to reply {(s1 - s0) / max(1, c1 - c0) * 1e3:.0f} ms); its own next PING: {own}"
            }

        def retrieve():
            t = mono()
            res = call(
                r, "RETRIEVE", {"instance": "big", "chunks": [rank.chunk(k, 4) for k in ks]}, timeout=600
            )
            rtt = mono() - t
            n = sum(res[1]["ok"]) if res[0] else 0
            return {"answer": f"{code(res)}: {n} ok; round trip {rtt * 1e3:.0f} ms"}

        run.measure("3d", f"STORE of {nchunks} chunks (MAX_CHUNKS), one request", d, by, store)
        run.measure("3e", f"RETRIEVE of {nchunks} chunks, one request", d, by, retrieve)
        r.close()
        rank.close()
    with run.daemon(pool_mb=64) as (d, by):
        r = connect(d)
        path = f"/dev/shm/tierd-hz-reg-{uuid.uuid4().hex[:8]}"
        per = 16 * 64
        shm_file(path, nbytes=4096 * per)
        tensors = [
            {"handle": {"kind": "shm", "path": path, "offset": t * per}, "nbytes": per} for t in range(4096)
        ]
        groups = [
            {
                "kind": "full",
                "block_tokens": 4,
                "layers": [
                    {
                        "tensor": (g * 1024 + li) % 4096,
                        "offset": 0,
                        "block_stride": 64,
                        "num_blocks": 16,
                        "run_bytes": 64,
                    }
                    for li in range(1024)
                ],
            }
            for g in range(64)
        ]
        lay = {
            "namespace": {"model": "m", "fingerprint": "largest", "world_size": 1},
            "rank": 0,
            "chunk_tokens": 16,
            "tensors": tensors,
            "groups": groups,
        }
        frame_mib = len(pack(["REGISTER", 1, {"instance": "largest", "layout": lay}])) / MIB

        def register():
            t = mono()
            res = call(r, "REGISTER", {"instance": "largest", "layout": lay}, timeout=600)
            return {
                "answer": f"{code(res)}; round trip {(mono() - t) * 1e3:.0f} ms ({frame_mib:.1f} MiB frame)"
            }

        run.measure(
            "3f", "REGISTER of the largest layout: 4096 tensors, 64 groups x 1024 layers", d, by, register
        )
        r.close()
        os.unlink(path)


# ---- 4 and 6: eviction ------------------------------------------------------------------------------------
def attack_4(run: Run) -> None:
    nfill = 3000
    with run.daemon("--l1-segment-mb", "64", pool_mb=64) as (d, by):
        small = Rank([("full", 1, 5 * KIB, 4, 0)])  # 20 KiB objects
        big = Rank([("full", 1, 32 * MIB, 4, 0)], num_blocks=4, fill=0)  # one 128 MiB object (a sparse file)
        r = connect(d)
        call(r, "REGISTER", {"instance": "small", "layout": small.layout()})
        call(r, "REGISTER", {"instance": "big", "layout": big.layout()})
        fill = store_all(r, "small", small, keys(nfill), batch=500)
        st0 = d.status()

        def go():
            res = call(r, "STORE", {"instance": "big", "chunks": [big.chunk(keys(1)[0])]})
            st1 = d.status()
            ev = st1["evictions"] - st0["evictions"]
            return {
                "answer": f"{res[1]['results'] if res[0] else res[1]['code']}; evicted {ev} "
                f"(objects {st0['objects']} -> {st1['objects']})",
                "fill": fill,
                "evictions_during_fill": st0["evictions"],
                "evicted": ev,
                "objects": [st0["objects"], st1["objects"]],
                "pool_used_mib": st0["memory_used_bytes"] / MIB,
            }

        run.measure("4", f"a 128 MiB STORE into a full 64 MiB pool ({nfill} x 20 KiB objects)", d, by, go)
        r.close()
        small.close()
        big.close()


def attack_6(run: Run) -> None:
    n = 128 * MIB // (4 * KIB)
    with run.daemon("--l1-segment-mb", "128", pool_mb=128) as (d, by):
        small = Rank([("full", 1, 1 * KIB, 4, 0)])  # 4 KiB objects
        new = Rank([("full", 1, 2 * KIB, 4, 0)])  # 8 KiB
        r = connect(d)
        call(r, "REGISTER", {"instance": "small", "layout": small.layout()})
        call(r, "REGISTER", {"instance": "new", "layout": new.layout()})
        fill = store_all(r, "small", small, keys(n))
        st0 = d.status()

        def go():
            res = call(r, "STORE", {"instance": "new", "chunks": [new.chunk(keys(1)[0])]})
            st1 = d.status()
            ev = st1["evictions"] - st0["evictions"]
            return {
                "answer": f"{res[1]['results'] if res[0] else res[1]['code']}; evicted {ev} "
                f"(objects {st0['objects']} -> {st1['objects']})",
                "fill": fill,
                "evictions_during_fill": st0["evictions"],
                "evicted": ev,
                "pool_used_mib": st0["memory_used_bytes"] / MIB,
                "pool_backed_mib": st0["memory_total_bytes"] / MIB,
            }

        run.measure("6", f"one 8 KiB STORE into a full 128 MiB pool of {n} x 4 KiB objects", d, by, go)
        r.close()
        small.close()
        new.close()


# ---- 5: memory per message --------------------------------------------------------------------------------
def array32(n: int, item: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + item * n


def fixmap1(key: str, value: bytes) -> bytes:
    return b"\x81" + pack(key) + value


def attack_5(run: Run) -> None:
    n32 = (8 if run.quick else 32) * MIB
    with run.daemon(pool_mb=64) as (d, by):
        rank = Rank([("full", 2, 256, 4, 0)], num_blocks=64)
        r = connect(d)
        call(r, "REGISTER", {"instance": "x", "layout": rank.layout()})
        nints = (16 if run.quick else 64) * MIB - 200  # the frame: --max-frame-mb (64) less its head

        def frame_attack(frame: bytes, what: str, timeout: float = 60):
            def go():
                r.send(frame)
                try:
                    got = r.recv(timeout)
                    ans = f"{'ok' if got[1] else got[2]['code']}"
                    if not got[1]:
                        ans += f" ({short(got[2]['message'], 60)})"
                    ans += f", req_id {got[0]}"
                except TimeoutError:
                    ans = f"no reply in {timeout:.0f} s"
                return {"answer": ans, "frame_mib": round(len(frame) / MIB, 1)}

            return go

        cases = [
            (
                "5a",
                f"{n32 // MIB} MiB frame of empty maps (an unknown field of a PING)",
                b"\x93" + pack("PING") + b"\x07" + fixmap1("x", array32(n32, b"\x80")),
            ),
            (
                "5b",
                f"{n32 // MIB} MiB frame of empty maps as LOOKUP keys",
                b"\x93" + pack("LOOKUP") + b"\x08" + fixmap1("keys", array32(n32, b"\x80")),
            ),
            (
                "5c",
                f"{(nints + 200) // MIB} MiB frame: one STORE chunk whose blocks list holds "
                f"{nints / 1e6:.0f}M ints",
                b"\x93"
                + pack("STORE")
                + b"\x09"
                + b"\x82"
                + pack("instance")
                + pack("x")
                + pack("chunks")
                + b"\x91"
                + b"\x82"
                + pack("key")
                + pack(b"k" * 16)
                + pack("blocks")
                + b"\x91"
                + array32(nints, b"\x00"),
            ),
            (
                "5d",
                "nesting depth 1,000,000 in a PING body (1 MiB frame)",
                b"\x93" + pack("PING") + b"\x0a" + fixmap1("x", b"\x91" * 1_000_000 + b"\xc0"),
            ),
        ]
        for rid, title, frame in cases:
            run.measure(rid, title, d, by, frame_attack(frame, title))
        store_frame = cases[2][2]
        del cases

        def pipelined_frames():
            t = mono()
            for _ in range(8):
                r.send(store_frame)
            got = [r.recv(300) for _ in range(8)]
            codes = {g[2]["code"] if not g[1] else "ok" for g in got}
            return {"answer": f"{'/'.join(sorted(codes))} x8, the last after {mono() - t:.1f} s"}

        run.measure("5c'", "the 5c frame x8, pipelined", d, by, pipelined_frames)
        part = (100 if not run.quick else 20) * MIB

        def multipart():
            parts = [b"\x00" * part] * 3
            r.sock.send_multipart(parts)
            try:
                if not r.sock.poll(60_000):
                    raise TimeoutError
                reply = r.sock.recv_multipart()
                msg = msgpack.unpackb(reply[-1], raw=False)
                ans = (
                    f"{msg[2].get('code', 'ok')} ({short(msg[2].get('message', ''), 50)}); "
                    f"reply {len(reply)} part(s), {sum(map(len, reply))} bytes"
                )
            except TimeoutError:
                ans = "no reply in 60 s"
            return {"answer": ans, "parts": 3, "part_mib": part // MIB}

        run.measure("5e", f"one message of 3 parts of {part // MIB} MiB", d, by, multipart)
        over = 200 * MIB

        def oversize():
            s = Raw(d.endpoint)
            try:
                s.hello()
                s.send(b"\x00" * over)
                quiet = s.quiet(3.0)
                return {"answer": "no reply (connection dropped by ZeroMQ)" if quiet else "a reply came"}
            finally:
                s.close()

        run.measure("5f", f"one {over // MIB} MiB frame (over ZeroMQ's MAXMSGSIZE)", d, by, oversize)
        r.close()
        rank.close()


# ---- 7: exhaustion --------------------------------------------------------------------------------------
def attack_7(run: Run) -> None:
    with run.daemon(pool_mb=64) as (d, by):
        r = connect(d)
        # 7a: 11 REGISTERs of 4096 tensors each, all in one file each (the old daemon: one fd per tensor)
        ranks: list[tuple[int, str]] = []
        per = 64 * 16

        def many_tensors():
            out = []
            for i in range(11):
                path = f"/dev/shm/tierd-hz-many-{uuid.uuid4().hex[:8]}"
                shm_file(path, nbytes=4096 * per)
                ranks.append((i, path))
                tensors = [
                    {"handle": {"kind": "shm", "path": path, "offset": t * per}, "nbytes": per}
                    for t in range(4096)
                ]
                spans = [
                    {
                        "tensor": t,
                        "offset": 0,
                        "block_stride": 64,
                        "num_blocks": 16,
                        "runs": 1,
                        "run_stride": 0,
                        "run_bytes": 64,
                    }
                    for t in range(4096)
                ]
                groups = [
                    {"kind": "full", "block_tokens": 4, "layers": spans[g * 1024 : (g + 1) * 1024]}
                    for g in range(4)
                ]
                lay = {
                    "namespace": {"model": "m", "fingerprint": uuid.uuid4().hex, "world_size": 1},
                    "rank": 0,
                    "chunk_tokens": 16,
                    "tensors": tensors,
                    "groups": groups,
                }
                out.append(code(call(r, "REGISTER", {"instance": f"t{i}", "layout": lay})))
            return {"answer": f"REGISTER x11: {summ(out)}"}

        run.measure("7a", "11 REGISTERs x 4096 tensors (one file each)", d, by, many_tensors)
        for i, path in ranks:
            call(r, "UNREGISTER", {"instance": f"t{i}"})
            os.unlink(path)
        # 7b: REGISTERs of 1024 files each, until the files cap
        folder = tempfile.mkdtemp(prefix="tierd-hz-files-", dir="/dev/shm")

        def many_files():
            out, msg = [], ""
            for i in range(5):
                paths = [shm_file(f"{folder}/r{i}-{t}", nbytes=per) for t in range(1024)]
                tensors = [{"handle": {"kind": "shm", "path": p, "offset": 0}, "nbytes": per} for p in paths]
                spans = [
                    {"tensor": t, "offset": 0, "block_stride": 64, "num_blocks": 16, "run_bytes": 64}
                    for t in range(1024)
                ]
                lay = {
                    "namespace": {"model": "m", "fingerprint": uuid.uuid4().hex, "world_size": 1},
                    "rank": 0,
                    "chunk_tokens": 16,
                    "tensors": tensors,
                    "groups": [{"kind": "full", "block_tokens": 4, "layers": spans}],
                }
                ok, reply = call(r, "REGISTER", {"instance": f"f{i}", "layout": lay})
                out.append("ok" if ok else reply["code"])
                if not ok:
                    msg = reply["message"]
            return {
                "answer": f"REGISTER x5 of 1024 files: {summ(out)}" + (f" ({short(msg, 60)})" if msg else ""),
                "message": msg,
            }

        run.measure(
            "7b", "REGISTERs of 1024 distinct files each, until --max-files-per-tenant", d, by, many_files
        )
        for i in range(5):
            with contextlib.suppress(Exception):
                call(r, "UNREGISTER", {"instance": f"f{i}"})
        shutil.rmtree(folder, ignore_errors=True)
        # 7c: descriptors sent to the fd socket and never claimed
        holder = os.open(shm_file(f"/dev/shm/tierd-hz-fdflood-{uuid.uuid4().hex[:8]}", nbytes=per), os.O_RDWR)
        flood_path = os.readlink(f"/proc/self/fd/{holder}")
        os.unlink(flood_path)

        def fd_flood():
            sent, refused, why = 0, 0, ""
            for _ in range(24):  # 24 x 250 = 6000 descriptors, each message its own ticket
                try:
                    fdpass.send_fds(d.endpoint, fdpass.new_ticket(), [holder] * 250)
                    sent += 250
                except OSError as exc:
                    refused += 250
                    why = str(exc)
            return {
                "answer": f"{sent} held, {refused} refused" + (f" ({short(why, 70)})" if why else ""),
                "message": why,
            }

        run.measure("7c", "6000 descriptors sent to <socket>.fds, never claimed", d, by, fd_flood)
        os.close(holder)
        # 7d: instances until --max-instances-per-tenant
        rank = Rank([("full", 1, 64, 4, 0)])
        n = 1100

        def instances():
            lay = rank.layout()
            res = pipelined(
                r, [("REGISTER", {"instance": f"n{i}", "layout": lay}) for i in range(n)], window=50
            )
            codes = [code(x) for x in res]
            first = next((i for i, c in enumerate(codes) if c != "ok"), None)
            msg = res[first][1]["message"] if first is not None else ""
            return {
                "answer": f"REGISTER x{n}: {summ(codes)}"
                + (f", first refusal #{first + 1}" if first is not None else ""),
                "message": msg,
            }

        run.measure("7d", f"{n} instances from one tenant", d, by, instances)
        pipelined(r, [("UNREGISTER", {"instance": f"n{i}"}) for i in range(n)], window=100)
        r.close()
        rank.close()

    nleases = 1200 if run.quick else 8300
    extra = ("--max-leases-per-session", "1024") if run.quick else ()
    with run.daemon("--l1-segment-mb", "64", *extra, pool_mb=64) as (d, by):
        r, victim = connect(d), connect(d)
        rank = Rank([("full", 1, 5 * KIB, 4, 0)])
        call(r, "REGISTER", {"instance": "a", "layout": rank.layout()})
        ks = keys(3000)
        store_all(r, "a", rank, ks, batch=500)
        look = {"namespace": rank.ns, "chunk_tokens": 16, "groups": rank.specs(), "lease": True}

        def leases():
            res = pipelined(r, [("LOOKUP", {**look, "keys": ks[:1]})] * nleases, window=200)
            codes = [code(x) for x in res]
            first = next((i for i, c in enumerate(codes) if c != "ok"), None)
            ans = f"LOOKUP+lease x{nleases}: {summ(codes)}" + (
                f", first refusal #{first + 1}" if first is not None else ""
            )
            return {"answer": ans, "message": res[first][1]["message"] if first is not None else ""}

        run.measure("7e", f"{nleases} leases from one session", d, by, leases)
        call(r, "BYE", {})
        r = connect(d)
        vrank = Rank([("full", 1, 5 * KIB, 4, 0)])
        call(victim, "REGISTER", {"instance": "v", "layout": vrank.layout()})

        def share():
            all_ = call(r, "LOOKUP", {**look, "keys": ks})
            st = d.status()
            return {
                "answer": f"LOOKUP+lease of all 3000 objects (58.6 MiB of 64): {code(all_)}; "
                f"leased_bytes {st['leased_bytes']}",
                "message": all_[1].get("message", ""),
            }

        run.measure("7f", "a lease pinning more than --max-lease-share 0.5 of the pool", d, by, share)
        npin = 1100

        def cold_pins():
            pin = call(r, "LOOKUP", {**look, "keys": ks[:npin]})
            touch = call(
                r, "LOOKUP", {**look, "keys": ks[npin:], "lease": False}
            )  # the leased ones are coldest now
            st0 = d.status()
            counts = store_all(victim, "v", vrank, keys(500), batch=1)
            st1 = d.status()
            return {
                "answer": f"lease on the {npin} coldest objects ({npin * 20 / 1024:.1f} MiB): {code(pin)} "
                f"(touch {code(touch)}); a victim's 500 new 20 KiB STOREs: {summ_counts(counts)}, "
                f"evicted {st1['evictions'] - st0['evictions']} of the "
                f"{3000 - npin} unpinned objects",
                "leased_mib": round(st0["leased_bytes"] / MIB, 1),
            }

        run.measure(
            "7g",
            f"leases on the {npin} coldest objects (under the share), then a victim stores",
            d,
            by,
            cold_pins,
        )
        r.close()
        victim.close()
        rank.close()
        vrank.close()

    nconn = 400
    with run.daemon("--http-timeout-s", "2", pool_mb=64) as (d, by):
        d.get("/status")

        def http_idle():
            conns = [socket.create_connection(("127.0.0.1", d.http_port), timeout=5) for _ in range(nconn)]
            try:
                time.sleep(0.5)
                during = d.snapshot()
                t = mono()
                d.status()
                status_ms = (mono() - t) * 1e3
                time.sleep(2.5)
                still = 0
                for s in conns:
                    s.settimeout(0.001)
                    try:
                        if s.recv(1) != b"":
                            still += 1
                    except (TimeoutError, BlockingIOError):
                        still += 1
                    except OSError:
                        pass
            finally:
                for s in conns:
                    s.close()
            return {
                "answer": f"/status meanwhile in {status_ms:.0f} ms; threads during {during['threads']}, "
                f"fds during {during['fds']}; open after 3 s: {still}/{nconn}",
                "during": during,
                "still_open_after_3s": still,
            }

        run.measure("7h", f"{nconn} idle HTTP connections (--http-timeout-s 2)", d, by, http_idle)


def summ(codes: list[str]) -> str:
    out: dict[str, int] = {}
    for c in codes:
        out[c] = out.get(c, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in out.items())


def summ_counts(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


# ---- 8: tenants --------------------------------------------------------------------------------------------
def u_hello(state, endpoint):
    state["c"] = Raw(endpoint)
    return state["c"].ok("HELLO", {"protocol": 1, "client": "hz-attacker"})


def u_register(state, fingerprint):
    rank = state["rank"] = Rank([("full", 2, 512, 4, 0)], num_blocks=64, fingerprint=fingerprint, fill=0xAB)
    return call(state["c"], "REGISTER", {"instance": "victim-rank", "layout": rank.layout()})


def u_call(state, op, body):
    return call(state["c"], op, body)


def attack_8(run: Run) -> None:
    if run.user is None:
        run.rows.append(
            {
                "id": "8",
                "attack": "tenant isolation",
                "answer": "SKIPPED: needs root to create a second uid",
                "skipped": True,
            }
        )
        print_row(run.rows[-1])
        return
    with run.daemon(pool_mb=64, shared=True) as (d, by):
        victim = connect(d)
        fp = "shared-fingerprint"
        vrank = Rank([("full", 2, 512, 4, 0)], num_blocks=64, fingerprint=fp)
        call(
            victim,
            "REGISTER",
            {
                "instance": "victim-rank",
                "layout": {**vrank.layout(), "namespace": {**vrank.ns, "salt": "s3cret"}},
            },
        )
        ns = {**vrank.ns, "salt": "s3cret"}
        ks = keys(4)
        call(
            victim,
            "STORE",
            {"instance": "victim-rank", "chunks": [vrank.chunk(k, 4 * i) for i, k in enumerate(ks)]},
        )
        look = {"namespace": ns, "keys": ks, "chunk_tokens": 16, "groups": vrank.specs()}
        ok, reply = call(victim, "LOOKUP", look)
        lease = reply["lease"]
        original = vrank.read(0)

        def go():
            p = UserProcess(run.user)
            got = {}
            try:
                hello = p.call(u_hello, d.endpoint)
                got["tenant"] = hello["tenant"]
                got["LOOKUP"] = p.call(u_call, "LOOKUP", {**look, "lease": False})
                got["RELEASE"] = p.call(u_call, "RELEASE", {"lease": lease})
                got["UNREGISTER"] = p.call(u_call, "UNREGISTER", {"instance": "victim-rank"})
                got["CLEAR"] = p.call(u_call, "CLEAR", {})
                got["CLEAR ns"] = p.call(u_call, "CLEAR", {"namespace": ns, "tenant": ""})
                # its own rank under the victim's instance name and namespace, poisoned bytes (0xAB)
                got["REGISTER"] = p.call(u_register, fp)
                poison = {
                    "instance": "victim-rank",
                    "chunks": [
                        {"key": k, "blocks": [list(range(4 * i, 4 * i + 4))]} for i, k in enumerate(ks)
                    ],
                }
                got["STORE"] = p.call(u_call, "STORE", poison)  # lands in its own namespace
                got["RETRIEVE+lease"] = p.call(u_call, "RETRIEVE", {**poison, "lease": lease})
                got["STATUS"] = p.call(u_call, "STATUS", {})
            finally:
                p.close()
            # the victim: still hits, its lease holds, its bytes come back unpoisoned
            hit = call(victim, "LOOKUP", {**look, "lease": False})
            back = call(
                victim,
                "RETRIEVE",
                {"instance": "victim-rank", "chunks": [vrank.chunk(k, 32 + 4 * i) for i, k in enumerate(ks)]},
            )
            data = vrank.read(0)
            half = 64 * 512
            same = all(
                data[li * half + 32 * 512 : li * half + 48 * 512]
                == original[li * half : li * half + 16 * 512]
                for li in range(2)
            )
            st = d.status()
            salt_shown = "s3cret" in json.dumps(got["STATUS"][1]) or "s3cret" in d.get("/status").decode()
            c = lambda k: f"chunks {got[k][1]['chunks']}" if k == "LOOKUP" and got[k][0] else code(got[k])
            stored = got["STORE"][1].get("results") if got["STORE"][0] else code(got["STORE"])
            ans = (
                f"as {got['tenant']}: LOOKUP of victim's keys {c('LOOKUP')}, RELEASE {c('RELEASE')}, "
                f"UNREGISTER {c('UNREGISTER')}, CLEAR {c('CLEAR')}, CLEAR of its namespace {c('CLEAR ns')}, "
                f"poisoned STORE under its names {stored} (own namespace), RETRIEVE w/ its lease "
                f"{c('RETRIEVE+lease')}; salt shown: {salt_shown}. "
                f"Victim after: LOOKUP chunks {hit[1].get('chunks')}, RETRIEVE {back[1].get('ok')}, bytes "
                f"{'intact' if same else 'POISONED'}, leases_active {st['leases_active']}, "
                f"instances {[i['instance'] for i in st['instances'] if not i.get('tenant')]}"
            )
            return {"answer": ans, "attacker": {k: (v if k != "STATUS" else code(v)) for k, v in got.items()}}

        run.measure("8", f"another uid ({run.user.uid}) against a victim's keys, lease, instance", d, by, go)
        victim.close()
        vrank.close()


# ---- 9: a second daemon on the same socket ----------------------------------------------------------------
def second_serve(endpoint: str) -> tuple[int | None, str]:
    cmd = [
        sys.executable,
        "-m",
        "tierd",
        "serve",
        "--socket",
        endpoint,
        "--http-port",
        "-1",
        "--l1-size-gb",
        "0.01",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return None, "SERVED (did not refuse within 20 s): " + err[-300:]
    text = " ".join(ln.strip() for ln in err.strip().splitlines() if ln.strip())
    return proc.returncode, text[text.find("Error:") :] if "Error:" in text else text[-300:]


def attack_9(run: Run) -> None:
    with run.daemon(pool_mb=64) as (d, by):

        def go():
            before = os.lstat(d.socket_file).st_ino
            d.proc.send_signal(signal.SIGSTOP)  # the busy daemon: answers nothing while the second starts
            try:
                rc, msg = second_serve(d.endpoint)
            finally:
                d.proc.send_signal(signal.SIGCONT)
            same = os.lstat(d.socket_file).st_ino == before
            c = connect(d)
            pid = c.ok("STATUS", {})["pid"]
            c.close()
            return {
                "answer": f"exit {rc}: {short(msg, 150)}; socket unchanged: {same}; first still serves: "
                f"{pid == d.pid}",
                "message": msg,
                "exit": rc,
            }

        run.measure(
            "9a", "a second tierd serve on the socket while the first is stopped (SIGSTOP, 'busy')", d, by, go
        )
        if run.user is not None:
            folder = f"/tmp/tierd-hz-owned-{uuid.uuid4().hex[:8]}"
            os.mkdir(folder, 0o700)
            os.chown(folder, run.user.uid, run.user.gid)

            def foreign():
                rc, msg = second_serve(f"ipc://{folder}/tierd.sock")
                return {"answer": f"exit {rc}: {short(msg, 150)}", "message": msg, "exit": rc}

            try:
                run.measure(
                    "9b", f"tierd serve in a socket folder owned by uid {run.user.uid}", d, by, foreign
                )
            finally:
                shutil.rmtree(folder, ignore_errors=True)


# ---- 10: sessions ------------------------------------------------------------------------------------------
def attack_10(run: Run) -> None:
    with run.daemon(pool_mb=64) as (d, by):
        n = 300
        socks: list[Raw] = []

        def go():
            codes, msg = [], ""
            for _ in range(n):
                s = Raw(d.endpoint)
                socks.append(s)
                res = call(s, "HELLO", {"protocol": 1, "client": "hz-flood"}, timeout=10)
                codes.append(code(res))
                if not res[0] and not msg:
                    msg = res[1]["message"]
            first = next((i for i, c in enumerate(codes) if c != "ok"), None)
            sessions = d.status()["sessions"]
            return {
                "answer": f"HELLO x{n}: {summ(codes)}"
                + (f", first refusal #{first + 1}" if first is not None else "")
                + f"; sessions {sessions} (incl. the bystander)",
                "message": msg,
            }

        run.measure("10", f"{n} sessions from one uid (--max-sessions-per-peer 256)", d, by, go)
        for s in socks:
            with contextlib.suppress(Exception):
                s.send_request("BYE", {})
            s.close()


def attack_10b(run: Run) -> None:
    """Connections that never say HELLO are not sessions: nothing caps them, each costs the daemon a
    descriptor. The daemon runs with RLIMIT_NOFILE 4096 here so that 4300 connections reach it (the
    shipped unit's LimitNOFILE=65536 needs 16 times as many; this shell's 20000, five times)."""
    nofile, n = 4096, 4300
    with run.daemon(pool_mb=64, nofile=nofile) as (d, by):
        ctx = zmq.Context()
        ctx.set(zmq.MAX_SOCKETS, n + 100)
        socks = []

        def go():
            peak_fds = 0
            for i in range(n):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(d.endpoint)
                socks.append(s)
                if i % 250 == 0:
                    time.sleep(0.1)
                    peak_fds = max(peak_fds, d.snapshot()["fds"] or 0)
                    if not d.alive():
                        break
            deadline = mono() + 5
            while d.alive() and mono() < deadline:
                peak_fds = max(peak_fds, d.snapshot()["fds"] or 0)
                time.sleep(0.1)
            alive = d.alive()
            tail = open(d.log_path, errors="replace").read().strip().splitlines()[-1:]
            ans = (
                f"{len(socks)} silent connections: daemon "
                f"{'alive' if alive else f'DIED, exit {d.proc.returncode}'}"
                f"; fds peak {peak_fds}; last log line: {short(tail[0] if tail else '', 80)}"
            )
            if alive:
                c = Raw(d.endpoint)
                try:
                    ans += f"; a new client's HELLO: {code(call(c, 'HELLO', {'protocol': 1}, timeout=5))}"
                except TimeoutError:
                    ans += "; a new client's HELLO: no reply in 5 s"
                finally:
                    c.close()
            return {"answer": ans, "nofile": nofile, "connections": len(socks), "peak_fds": peak_fds}

        try:
            run.measure(
                "10b", f"{n} connections that never say HELLO (daemon RLIMIT_NOFILE {nofile})", d, by, go
            )
        finally:
            for s in socks:
                s.close()
            ctx.term()


# ---- fuzz -------------------------------------------------------------------------------------------------
FIELDS = [
    "protocol",
    "instance",
    "layout",
    "keys",
    "namespace",
    "chunks",
    "groups",
    "chunk_tokens",
    "lease",
    "deadline",
    "touch",
    "tenant",
    "event",
    "staged_at",
    "client",
    "pid",
]


def rand_value(rnd: random.Random, depth: int = 0):
    k = rnd.random()
    if depth > 3 or k < 0.6:
        return rnd.choice(
            [
                lambda: None,
                lambda: rnd.random() < 0.5,
                lambda: rnd.randint(-(2**63), 2**64 - 1),
                lambda: rnd.randint(-3, 70000),
                lambda: rnd.choice([0.0, -1.0, 1e308, float("inf"), float("nan"), rnd.random() * 1e10]),
                lambda: "".join(chr(rnd.randint(0, 0x2FFF)) for _ in range(rnd.randint(0, 12))),
                lambda: rnd.randbytes(rnd.randint(0, 70)),
                lambda: rnd.choice(["full", "sliding", "state", "cpu", "fd"]),
            ]
        )()
    if k < 0.8:
        return [rand_value(rnd, depth + 1) for _ in range(rnd.randint(0, 6))]
    return {
        (
            rnd.choice(FIELDS)
            if rnd.random() < 0.6
            else rand_value(rnd, 4)
            if rnd.random() < 0.1
            else "".join(chr(rnd.randint(32, 126)) for _ in range(rnd.randint(0, 8)))
        ): rand_value(rnd, depth + 1)
        for _ in range(rnd.randint(0, 6))
    }


def safe_pack(obj) -> bytes | None:
    try:
        return pack(obj)
    except (TypeError, ValueError, OverflowError):
        return None


def mutate(rnd: random.Random, obj):
    """``obj`` with one value somewhere replaced by a random one (or removed from its map)."""
    import copy

    obj = copy.deepcopy(obj)
    paths: list[tuple] = []

    def walk(o, p):
        paths.append(p)
        if isinstance(o, dict):
            for k, v in o.items():
                walk(v, p + (k,))
        elif isinstance(o, list):
            for i, v in enumerate(o):
                walk(v, p + (i,))

    walk(obj, ())
    path = rnd.choice(paths[1:]) if len(paths) > 1 else ()
    if not path:
        return rand_value(rnd)
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    if isinstance(cur, dict) and rnd.random() < 0.15:
        del cur[path[-1]]
    else:
        cur[path[-1]] = rand_value(rnd)
    return obj


def special_frames() -> list[tuple[str, bytes]]:
    return [
        ("depth 100k in body", b"\x93" + pack("PING") + b"\x01" + fixmap1("x", b"\x91" * 100_000 + b"\xc0")),
        ("depth 1000 in body", b"\x93" + pack("PING") + b"\x01" + fixmap1("x", b"\x91" * 1000 + b"\xc0")),
        ("depth 100k as op", b"\x93" + b"\x91" * 100_000 + b"\xc0" + b"\x01\x80"),
        ("array32 claims 2^32-1", b"\x93" + pack("PING") + b"\x01" + fixmap1("x", b"\xdd\xff\xff\xff\xff")),
        ("map32 claims 2^32-1", b"\x93" + pack("PING") + b"\x01" + b"\xdf\xff\xff\xff\xff"),
        ("bin32 claims 2^32-1", b"\x93" + pack("PING") + b"\x01" + fixmap1("x", b"\xc6\xff\xff\xff\xff")),
        ("str32 claims 2^32-1 as op", b"\x93\xdb\xff\xff\xff\xff"),
        ("ext type", b"\x93" + pack("PING") + b"\x01" + fixmap1("x", b"\xd4\x01\x00")),
        ("timestamp ext", b"\x93" + pack("PING") + b"\x01" + fixmap1("x", b"\xd6\xff\x00\x00\x00\x00")),
        ("empty frame", b""),
        ("req_id 2^64-1", pack(["PING", 2**64 - 1, {}])),
        ("req_id -1", pack(["PING", -1, {}])),
        ("req_id float", pack(["PING", 1.5, {}])),
        ("op with NUL", pack(["PI\x00NG", 1, {}])),
        ("4-array", pack(["PING", 1, {}, 1])),
        ("bytes op", pack([b"PING", 1, {}])),
        ("map with int keys", b"\x93" + pack("PING") + b"\x01" + b"\x81\x01\x02"),
        ("map with array key", b"\x93" + pack("PING") + b"\x01" + b"\x81\x90\x02"),
        ("invalid utf-8 op", b"\x93\xa4\xff\xfe\xfd\xfc\x01\x80"),
        ("never-used 0xc1", b"\x93" + pack("PING") + b"\x01\xc1"),
        ("trailing bytes", pack(["PING", 1, {}]) + b"\x00\x00"),
    ]


def fuzz(run: Run) -> None:
    n = run.args.fuzz if run.args.fuzz is not None else (2000 if run.quick else 20000)
    rnd = random.Random(20261201)
    with run.daemon("--max-frame-mb", "1", pool_mb=16) as (d, by):
        rank = Rank(
            [("full", 2, 256, 4, 0), ("sliding", 2, 256, 4, 8), ("state", 1, 256, 16, 0)], num_blocks=16
        )
        main, side = Raw(d.endpoint), Raw(d.endpoint)
        ks = keys(4)

        def setup():
            main.hello()
            call(main, "REGISTER", {"instance": "fz", "layout": rank.layout()})
            call(
                main,
                "STORE",
                {
                    "instance": "fz",
                    "chunks": [
                        {"key": k, "blocks": [[0, 1, 2, 3], [-1, -1, 2, 3], [i]]} for i, k in enumerate(ks)
                    ],
                },
            )

        setup()
        lay = rank.layout()
        templates = {
            "REGISTER": {"instance": "fz2", "layout": lay},
            "UNREGISTER": {"instance": "ghost"},
            "LOOKUP": {
                "namespace": rank.ns,
                "keys": ks,
                "groups": rank.specs(),
                "chunk_tokens": 16,
                "lease": False,
            },
            "RELEASE": {"lease": 12345},
            "STORE": {
                "instance": "fz",
                "chunks": [{"key": ks[0], "blocks": [[0, 1, 2, 3], [-1, -1, 2, 3], [0]]}],
                "touch": ks[:1],
            },
            "RETRIEVE": {
                "instance": "fz",
                "chunks": [{"key": k, "blocks": [[8, 9, 10, 11], [-1] * 4, [-1]]} for k in ks[:2]],
                "lease": 0,
            },
            "PING": {},
            "STATUS": {},
            "CLEAR": {"namespace": {**rank.ns, "model": "other"}},
        }
        hello_t = {"protocol": 1, "client": "fuzz", "pid": 1}
        specials = special_frames()
        kinds = ["bytes", "shape", "truncated", "mutated", "flipped"]
        stats = {
            "frames": 0,
            "replies": 0,
            "ok": 0,
            "typed_errors": 0,
            "internal": 0,
            "hangs": 0,
            "crashes": 0,
            "bad_replies": 0,
            "by_kind": {k: 0 for k in [*kinds, "special", "hello"]},
            "codes": {},
        }
        samples: dict[str, list] = {"internal": [], "hangs": [], "crashes": [], "bad_replies": []}

        def frame_for(i: int) -> tuple[str, Raw, bytes]:
            if i < len(specials):
                return "special", main, specials[i][1]
            kind = rnd.choice(kinds)
            if kind == "bytes":
                return kind, main, rnd.randbytes(rnd.randint(0, 300))
            if rnd.random() < 0.08:  # HELLO: on its own connection (a re-HELLO drops the session)
                body = mutate(rnd, hello_t) if rnd.random() < 0.7 else rand_value(rnd)
                f = safe_pack(
                    ["HELLO", rnd.randint(0, 2**40), body if isinstance(body, dict) else {"x": body}]
                )
                return "hello", side, f or b"\xc1"
            op = rnd.choice(list(templates))
            if kind == "shape":
                o = rnd.choice([*OPS[1:], rand_value(rnd)]) if rnd.random() < 0.8 else rand_value(rnd)
                rid = rnd.choice([rnd.randint(0, 2**63 - 1), rand_value(rnd)])
                body = (
                    {rnd.choice(FIELDS): rand_value(rnd) for _ in range(rnd.randint(0, 6))}
                    if rnd.random() < 0.7
                    else rand_value(rnd)
                )
                return kind, main, safe_pack([o, rid, body]) or b"\xc1"
            base = pack([op, rnd.randint(1, 2**40), templates[op]])
            if kind == "truncated":
                return kind, main, base[: rnd.randrange(len(base))]
            if kind == "mutated":
                return (
                    kind,
                    main,
                    safe_pack([op, rnd.randint(1, 2**40), mutate(rnd, templates[op])]) or b"\xc1",
                )
            b = bytearray(base)
            for _ in range(rnd.randint(1, 4)):
                b[rnd.randrange(len(b))] = rnd.randrange(256)
            return kind, main, bytes(b)

        def go():
            for i in range(n + len(specials)):
                kind, sock, frame = frame_for(i)
                stats["frames"] += 1
                stats["by_kind"][kind] += 1
                sock.send(frame)
                if not sock.sock.poll(2000):
                    stats["hangs"] += 1
                    if len(samples["hangs"]) < 5:
                        samples["hangs"].append(frame[:200].hex())
                    if not d.alive():
                        stats["crashes"] += 1
                        samples["crashes"].append(
                            {"frame_hex": frame[:400].hex(), "len": len(frame), "exit": d.proc.returncode}
                        )
                        break
                    continue
                parts = sock.sock.recv_multipart()
                stats["replies"] += 1
                try:
                    msg = msgpack.unpackb(parts[-1], raw=False)
                    assert (
                        len(parts) == 1
                        and isinstance(msg, list)
                        and len(msg) == 3
                        and isinstance(msg[2], dict)
                    )
                except Exception:  # noqa: BLE001
                    stats["bad_replies"] += 1
                    samples["bad_replies"].append(parts[-1][:200].hex())
                    continue
                if msg[1]:
                    stats["ok"] += 1
                    continue
                c = msg[2].get("code", "?")
                stats["codes"][c] = stats["codes"].get(c, 0) + 1
                if c == "INTERNAL":
                    stats["internal"] += 1
                    if len(samples["internal"]) < 8:
                        label = specials[i][0] if i < len(specials) else kind
                        samples["internal"].append(
                            {
                                "kind": label,
                                "message": short(msg[2].get("message", ""), 150),
                                "frame_hex": frame[:120].hex(),
                                "len": len(frame),
                            }
                        )
                else:
                    stats["typed_errors"] += 1
                if i % 200 == 0:  # keep the session and its instance for the templates
                    res = call(main, "PING", {}, timeout=5)
                    if not res[0]:
                        setup()
            extra = 0
            for s in (main, side):
                while s.sock.poll(300):
                    s.sock.recv_multipart()
                    extra += 1
            stats["extra_replies"] = extra
            alive = d.alive()
            after = "not run"
            if alive:
                c2 = Raw(d.endpoint)
                try:
                    c2.hello()
                    r2 = Rank([("full", 2, 256, 4, 0)], num_blocks=64)
                    call(c2, "REGISTER", {"instance": "after", "layout": r2.layout()})
                    k = keys(1)[0]
                    s1 = call(c2, "STORE", {"instance": "after", "chunks": [r2.chunk(k)]})
                    s2 = call(c2, "RETRIEVE", {"instance": "after", "chunks": [r2.chunk(k, 8)]})
                    after = f"{s1[1].get('results')}/{s2[1].get('ok')}"
                    r2.close()
                finally:
                    c2.close()
            errs = d.status()["errors_by_code"] if alive else {}
            ans = (
                f"{stats['frames']} frames: {stats['replies']} replies ({stats['ok']} ok, "
                f"{stats['typed_errors']} typed errors, {stats['internal']} INTERNAL), "
                f"crashes {stats['crashes']}, hangs {stats['hangs']}, "
                f"extra replies {extra}; a client after: {after}"
            )
            return {"answer": ans, **stats, "samples": samples, "errors_by_code": errs}

        run.measure(
            "fuzz",
            f"fuzz: random bytes, msgpack shapes, truncated/mutated/flipped requests, "
            f"{len(specials)} special frames",
            d,
            by,
            go,
        )
        main.close()
        side.close()
        rank.close()


# ---- output ---------------------------------------------------------------------------------------
def fmt_ping(p: dict | None) -> str:
    if not p or not p.get("n"):
        return "-"
    s = f"{p['p50']:.2f}/{p['p99']:.2f}/{p['max']:.1f}"
    if p.get("unknown_session"):
        s += f" (bystander reaped: {p['unknown_session']} UNKNOWN_SESSION)"
    if "unanswered_ms" in p:
        s += " (unanswered)"
    return s


def fmt_pair(pair) -> str:
    if not pair or pair[0] is None:
        return "-"
    a, b = pair
    return f"{a:g}→{b:g}" if b is not None else f"{a:g}→dead"


def print_row(row: dict) -> None:
    if row.get("skipped"):
        print(f"| {row['id']} {row['attack']} | {row['answer']} | - | - | - | - |", flush=True)
        return
    rss = fmt_pair(row["rss_mib"])
    if row.get("peak_rss_mib") is not None and row["rss_mib"][0] is not None:
        rss += f" (peak {row['peak_rss_mib']:g})"
    print(
        f"| {row['id']} {row['attack']} | {row['answer']} | {fmt_ping(row['ping_ms'])} | {rss} | "
        f"{fmt_pair(row['fds'])} | {fmt_pair(row['threads'])} |",
        flush=True,
    )


HEADER = (
    "| attack | daemon answered | bystander PING p50/p99/max ms | RSS before→after MiB (peak) | "
    "fds before→after | threads before→after |\n|---|---|---|---|---|---|"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a minute or so)")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "hardening_cpu.json"))
    ap.add_argument("--fuzz", type=int, default=None, help="fuzz frames (default 20000, --quick 2000)")
    ap.add_argument("--only", default="", help="comma-separated groups: 1,2,3,4,5,6,7,8,9,10,fuzz,10b")
    ap.add_argument("--bystander", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bystander:
        bystander_main(args.bystander)
        return
    run = Run(args)
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT).stdout
    tree = {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "uncommitted": git("status", "--short", "--", "tierd", "client").splitlines(),
    }
    started = time.time()
    load = [round(x, 2) for x in os.getloadavg()]
    t0 = mono()
    print(HEADER, flush=True)
    run.user = make_user() if run.wanted("1") or run.wanted("8") or run.wanted("9") else None
    try:
        with run.daemon(pool_mb=64) as (d, by):
            snap = d.snapshot()
            idle = by.idle(3.0)
            run.idle = {"ping_ms": idle, **snap}
            print(
                f"| idle baseline (3 s, no attack) | - | {fmt_ping(idle)} | {snap['rss_mib']:g} | "
                f"{snap['fds']} | {snap['threads']} |",
                flush=True,
            )
        for group, fn in (
            ("1", attack_1),
            ("2", attack_2),
            ("3", attack_3),
            ("4", attack_4),
            ("5", attack_5),
            ("6", attack_6),
            ("7", attack_7),
            ("8", attack_8),
            ("9", attack_9),
            ("10", attack_10),
            ("fuzz", fuzz),
            ("10b", attack_10b),
        ):
            if run.wanted(group):
                fn(run)
    finally:
        remove_user(run.user)
    total = mono() - t0
    out = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": round(total, 1),
        "command": " ".join(
            [
                os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT) else sys.executable,
                *sys.argv,
            ]
        ),
        "quick": args.quick,
        "uid": os.geteuid(),
        "cpus": os.cpu_count(),
        **tree,
        "loadavg_start_end": [load, [round(x, 2) for x in os.getloadavg()]],
        "second_uid": run.user.uid if run.user else None,
        "ping_interval_ms": PING_INTERVAL_S * 1e3,
        "idle": run.idle,
        "rows": run.rows,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=lambda o: o.hex() if isinstance(o, bytes) else str(o))
    print(f"\n{len(run.rows)} rows in {total:.0f} s; JSON: {args.json}")
    print("\n" + HEADER)
    print(
        f"| idle baseline (3 s, no attack) | - | {fmt_ping(run.idle['ping_ms'])} | {run.idle['rss_mib']:g} | "
        f"{run.idle['fds']} | {run.idle['threads']} |"
        if run.idle
        else ""
    )
    for row in run.rows:
        print_row(row)


if __name__ == "__main__":
    main()
