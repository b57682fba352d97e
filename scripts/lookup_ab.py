"""Same-run A/B of LOOKUP round trips: a ``tierd serve`` of this tree against one of an older
revision (its ``tierd`` package, exported with ``git archive``), both filled with the same index,
then looked up alternately request by request, so both see the same machine at the same moment.

    python scripts/lookup_ab.py --rev HEAD [--objects 1000000] [--repeats 1000] [--burst 1]

The index and the prompts are benchmarks/lookup_latency.py's: ``--objects`` one-block objects, a
32k-token prompt as 2048 keys (16-token chunks) and as 128 keys (256-token chunks). Per case and
variant: client-side round trip p50/p99 (ms) and the daemon's own mean (its ``tierd_op_seconds``
over /metrics); the last column is this tree's p50 over the older one's. ``--burst N``: each
daemon gets N requests back to back before the other's turn (an engine's lookups arriving
together, or several engines'), so what a daemon does after a reply meets its next request.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from lookup_latency import BLOCK_BYTES, NBLOCKS, SPECS, fill, fill_256, free_port, op_seconds, percentiles  # noqa: E402

from tierd.tools.bench.common import private_daemon  # noqa: E402
from tierd_client import TierdClient  # noqa: E402
from tierd_client.layouts import namespace  # noqa: E402
from tierd_client.shm import SharedBuffer  # noqa: E402


def export(rev: str, into: str) -> str:
    """The ``tierd`` package of ``rev``, unpacked under ``into``; checked to be the one imported."""
    archive = os.path.join(into, "src.tar")
    subprocess.run(["git", "-C", ROOT, "archive", "-o", archive, rev, "tierd"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    env = {**os.environ, "PYTHONPATH": into}
    where = subprocess.run(
        [sys.executable, "-c", "import tierd; print(tierd.__file__)"],
        env=env,
        cwd=into,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert where.startswith(os.path.realpath(into)) or where.startswith(into), where
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the older revision (a commit or tag)")
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=1000)
    ap.add_argument("--burst", type=int, default=1, help="requests to one daemon before the other's turn")
    args = ap.parse_args()
    if args.burst < 1:
        ap.error("--burst must be at least 1")
    folder = tempfile.mkdtemp(prefix="tierd-lookup-ab-")
    pool = args.objects * BLOCK_BYTES * 2 + (64 << 20)
    keys = [uuid.uuid4().bytes for _ in range(args.prompt_tokens // 16)]
    keys128 = [uuid.uuid4().bytes for _ in range(args.prompt_tokens // 256)]
    variants = {"this tree": None, args.rev: export(args.rev, folder)}
    try:
        with contextlib.ExitStack() as stack:
            ends = {}
            buf = SharedBuffer(NBLOCKS * BLOCK_BYTES)
            stack.callback(buf.close)
            for name, source in variants.items():
                port = free_port()
                extra = ("--l1-align-bytes", "64", "--l1-segment-mb", "256", "--http-port", str(port))
                endpoint = stack.enter_context(private_daemon(pool, extra, source=source))
                client = TierdClient(endpoint, timeout_s=120, name=f"lookup-ab-{name}")
                stack.callback(client.close)
                client.wait_ready(30)
                ns = namespace("lookup-ab", uuid.uuid4().hex[:8])
                ns2 = namespace("lookup-ab-256", uuid.uuid4().hex[:8])
                print(f"{name}: ", end="", file=sys.stderr, flush=True)
                fill(client, buf, ns, keys, args.objects, 8192)
                fill_256(client, buf, ns2, keys128)
                ends[name] = (client, port, ns, ns2)
            cases = {
                "2048 keys, hit": lambda c, ns, ns2: c.lookup(ns, keys, SPECS, 16, lease=False),
                "2048 keys, hit, lease": lambda c, ns, ns2: c.lookup(ns, keys, SPECS, 16, lease=True),
                "128 keys, hit": lambda c, ns, ns2: c.lookup(ns2, keys128, SPECS, 256, lease=False),
            }
            print(f"{'case':24} {'variant':12} {'p50 ms':>8} {'p99 ms':>8} {'daemon ms':>10} {'ratio':>6}")
            for case, call in cases.items():
                lat = {name: [] for name in ends}
                before = {name: op_seconds(port, "LOOKUP") for name, (_, port, _, _) in ends.items()}
                order = list(ends)
                for i in range(args.repeats + 50):
                    for name in order if i % 2 else reversed(order):
                        client, _, ns, ns2 = ends[name]
                        for _ in range(args.burst):
                            t = time.perf_counter()
                            r = call(client, ns, ns2)
                            dt = time.perf_counter() - t
                            if r.lease:
                                client.release(r.lease)
                            if i >= 50:
                                lat[name].append(dt)
                stats = {}
                for name, (_, port, _, _) in ends.items():
                    s1, n1, _ = op_seconds(port, "LOOKUP")
                    s0, n0, _ = before[name]
                    stats[name] = {**percentiles(lat[name]), "daemon": (s1 - s0) / max(1, n1 - n0) * 1e3}
                base = stats[args.rev]["p50_ms"]
                for name, st in stats.items():
                    ratio = f"{st['p50_ms'] / base:.2f}x" if name != args.rev else ""
                    print(
                        f"{case:24} {name[:12]:12} {st['p50_ms']:8.3f} {st['p99_ms']:8.3f} "
                        f"{st['daemon']:10.3f} {ratio:>10}"
                    )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
