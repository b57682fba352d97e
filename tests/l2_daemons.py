"""Two ``tierd serve`` daemons sharing one ``mooncake_master``: scenarios run by tests/l2_harness.py.

Hazard first: everything that listens (the master, its metadata server, the daemons' Mooncake
agents and HTTP ports) lives in the harness's own network namespace (see tests/l2_harness.py);
the daemons, their clients and the master die with the harness (PR_SET_PDEATHSIG).

Daemons A and B stand in for two nodes: separate processes, separate pools, separate Mooncake
clients, each contributing a segment. Ranks are tests/kv.py FakeRanks (real shared memory): A's
rank holds random bytes, B's rank other random bytes, so a block B did not receive cannot match.
Each scenario returns a JSON-able dict that tests/e2e/test_l2_daemon.py asserts on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import numpy as np
from kv import FakeRank, GroupGeom
from l2_harness import ROOT, Master, tail

from tierd.tools.testing import ServeProcess, die_with_parent
from tierd_client import TierdClient

GEOM = GroupGeom("full", layers=2, block_bytes=32 << 10, block_tokens=4)  # 256 KiB objects
URL = "mooncake://127.0.0.1?segment_gb=0.25&timeout_ms=2000&retry_s=0.5&fail_after=1"


class Daemon(ServeProcess):
    """A real ``python -m tierd serve`` with --l2-url (tierd/tools/testing.py's launcher), on an ipc socket
    in the work dir, with a client bound to it."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        *args: str,
        url: str = URL,
        pool_mb: int = 64,
        env: dict[str, str] | None = None,
    ):
        self.name, self.workdir = name, workdir
        super().__init__(
            workdir,
            "--l1-segment-mb",
            str(min(pool_mb, 64)),
            "--l2-url",
            url,
            *args,
            name=name,
            http_port=19800 + ord(name[0]),  # inside the namespace every port is ours
            pool_mb=pool_mb,
            log=workdir / f"daemon-{name}.log",
            cwd=ROOT,
            env=env,
            preexec_fn=die_with_parent(),
        )
        self.port = self.http_port
        self.client = TierdClient(self.endpoint, timeout_s=20, name=f"test-{name}")
        self.client.wait_ready(20)

    def wait(self, ok, timeout: float, what: str) -> dict:
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon {self.name} exited {self.proc.returncode}: {tail(self.log)}")
            try:
                s = self.status()
                if ok(s):
                    return s
            except OSError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"daemon {self.name}: no {what} after {timeout} s: {tail(self.log)}")
            time.sleep(0.05)

    def connected(self, timeout: float = 30) -> dict:
        return self.wait(lambda s: s["l2"]["connected"], timeout, "L2 connection")

    def drained(self, timeout: float = 30) -> dict:
        """Until no put waits or runs."""
        return self.wait(
            lambda s: not s["l2"]["writeback_queued"] and not s["l2"]["writeback_inflight_bytes"],
            timeout,
            "drained write-back",
        )

    def stop(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass
        try:
            super().stop(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()


class Rank:
    """A FakeRank registered with a daemon; chunk i of a prompt uses blocks 4i..4i+3."""

    def __init__(
        self,
        daemon: Daemon,
        inst: str,
        fingerprint: str,
        seed: int,
        num_blocks: int = 64,
        geom: GroupGeom = GEOM,
    ):
        self.d = daemon
        self.fake = FakeRank([geom], num_blocks=num_blocks, fingerprint=fingerprint)
        self.fake.kv[0][:] = np.random.default_rng(seed).integers(
            0, 256, self.fake.kv[0].shape, dtype=np.uint8
        )
        self.inst = inst
        daemon.client.register(inst, self.fake.layout())

    def chunks(self, ks: list[bytes], first_block: int = 0) -> list[dict]:
        n = self.fake.num_blocks
        return [
            {"key": k, "blocks": [[(first_block + 4 * i + b) % n for b in range(4)]]}
            for i, k in enumerate(ks)
        ]

    def store(self, ks, first_block: int = 0) -> list[str]:
        return self.d.client.store(self.inst, self.chunks(ks, first_block)).results

    # the scenarios' records are plain data: the typed replies as maps
    def lookup(self, ks, lease: bool = True, fingerprint: str | None = None) -> dict:
        ns = self.fake.ns if fingerprint is None else {**self.fake.ns, "fingerprint": fingerprint}
        reply = self.d.client.lookup(ns, ks, self.fake.specs(), self.fake.chunk_tokens, lease=lease)
        return msgspec.to_builtins(reply)

    def retrieve(self, ks, lease: int = 0, first_block: int = 0) -> dict:
        reply = self.d.client.retrieve(self.inst, self.chunks(ks, first_block), lease=lease)
        return msgspec.to_builtins(reply)

    def digests(self, n: int, first_block: int = 0) -> list[str]:
        """Per chunk, the digest of its 4 blocks (both layers)."""
        import hashlib

        kv = self.fake.kv[0]
        return [
            hashlib.blake2b(
                kv[:, [(first_block + 4 * i + b) % self.fake.num_blocks for b in range(4)]].tobytes(),
                digest_size=12,
            ).hexdigest()
            for i in range(n)
        ]

    def stop(self) -> None:
        self.fake.close()


def keys(tag: str, n: int) -> list[bytes]:
    import hashlib

    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def start(workdir: Path, started: list, *daemons: tuple) -> tuple:
    """A master, then daemons given as (name, args[, pool MiB[, env]]), each connected."""
    master = Master(workdir).start()
    started.append(master)
    out = [master]
    for name, args, *more in daemons:
        d = Daemon(workdir, name, *args, pool_mb=more[0] if more else 64, env=more[1] if more[1:] else None)
        started.append(d)
        d.connected()
        out.append(d)
    return tuple(out)


def shared(workdir: Path, started: list) -> dict:
    """A (write-through) stores; B (empty L1, another process) serves it byte-exact from L2."""
    _, a, b = start(workdir, started, ("a", ("--l2-policy", "write-through")), ("b", ()))
    ra, rb = Rank(a, "a0", "fp-shared", seed=1), Rank(b, "b0", "fp-shared", seed=2)
    started += [ra, rb]
    ks = keys("shared", 8)
    out = {"store": ra.store(ks), "src": ra.digests(8)}
    out["a_drained"] = a.drained()["l2"]
    out["b_before"] = rb.digests(8)
    out["other_tenant"] = rb.lookup(ks, lease=False, fingerprint="fp-other")  # another namespace: nothing
    t0 = time.monotonic()
    out["lookup"] = rb.lookup(ks)
    out["lookup_s"] = time.monotonic() - t0
    out["retrieve"] = rb.retrieve(ks, lease=out["lookup"]["lease"])
    out["dst"] = rb.digests(8)
    out["lookup_again"] = rb.lookup(ks, lease=False)  # now from B's own L1
    out["status_a"], out["status_b"] = a.status(), b.status()
    out["metrics_b"] = b.metrics()
    from tierd.tools.report import status_table

    out["table_b"] = status_table(out["status_b"])
    return out


def evicted(workdir: Path, started: list) -> dict:
    """A (write-back, an 8 MiB pool: 32 objects) stores 3 pools' worth; its first chunks, evicted from
    L1 long ago, come back from L2 byte-exact, through A itself and through B."""
    _, a, b = start(workdir, started, ("a", ("--l2-backlog-mb", "4"), 8), ("b", ()))
    ra, rb = Rank(a, "a0", "fp-evict", seed=3), Rank(b, "b0", "fp-evict", seed=4)
    started += [ra, rb]
    waves = [keys(f"evict/{w}", 8) for w in range(12)]
    out = {"stores": [], "src": [ra.digests(8, first_block=32 * (w % 2)) for w in range(2)]}
    for w, ks in enumerate(waves):
        out["stores"].append(ra.store(ks, first_block=32 * (w % 2)))
        time.sleep(0.15)  # past the write-back's scan interval (an eviction scans at once)
        a.drained()
    out["status_a_full"] = a.status()
    out["lookup_a"] = ra.lookup(waves[0])
    out["retrieve_a"] = ra.retrieve(waves[0], lease=out["lookup_a"]["lease"], first_block=32)
    out["dst_a"] = ra.digests(8, first_block=32)
    out["lookup_b"] = rb.lookup(waves[1])
    out["retrieve_b"] = rb.retrieve(waves[1], lease=out["lookup_b"]["lease"])
    out["dst_b"] = rb.digests(8)
    out["status_a"], out["status_b"] = a.status(), b.status()
    return out


# Loaded (as sitecustomize) before tierd by a daemon of ``other_formats``: a tierd of the next key
# derivation (its PAGE hashes and namespace ids mean something else) or of the next object byte
# layout, as a node upgraded before the others would run.
NEXT_VERSION = """
import tierd.{module}

tierd.{module}.{name} += 1
"""


def next_version_env(workdir: Path, module: str, name: str) -> dict[str, str]:
    folder = workdir / f"next-{name.lower()}"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(NEXT_VERSION.format(module=module, name=name))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(folder) + (os.pathsep + path if path else "")}


def other_formats(workdir: Path, started: list) -> dict:
    """K runs the next key derivation, O the next object layout, C this version; each writes
    through 8 chunks of one namespace. B (this version, empty L1) serves C's chunks from L2
    byte-exact and never K's or O's (O's objects hold the very key bytes B asks for)."""
    through = ("--l2-policy", "write-through")
    _, k, o, c, b = start(
        workdir,
        started,
        ("k", through, 64, next_version_env(workdir, "protocol.keys", "KEY_VERSION")),
        ("o", through, 64, next_version_env(workdir, "state.planner", "OBJECT_LAYOUT_VERSION")),
        ("c", through),
        ("b", ()),
    )
    writers = {d.name: Rank(d, f"{d.name}0", "fp-format", seed=5 + i) for i, d in enumerate((k, o, c))}
    rb = Rank(b, "b0", "fp-format", seed=9)
    started += [*writers.values(), rb]
    ks = {name: keys(f"format/{name}", 8) for name in writers}
    out = {f"store_{name}": r.store(ks[name]) for name, r in writers.items()}
    out["src_c"] = writers["c"].digests(8)
    out["drained"] = {d.name: d.drained()["l2"] for d in (k, o, c)}
    out["lookup_k_keys"] = rb.lookup(ks["k"], lease=False)
    out["lookup_o_keys"] = rb.lookup(ks["o"], lease=False)
    out["lookup_c_keys"] = rb.lookup(ks["c"])
    out["retrieve_c_keys"] = rb.retrieve(ks["c"], lease=out["lookup_c_keys"]["lease"])
    out["dst"] = rb.digests(8)
    out["status_b"] = b.status()
    out["l2_lines"] = {
        d.name: [ln for ln in d.log.read_text().splitlines() if "objects named" in ln] for d in (k, o, c, b)
    }
    return out
