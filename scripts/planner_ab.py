"""Same-run A/B of the STORE/RETRIEVE handler cost: this tree's daemon code against an older
revision's (its whole ``tierd`` package, taken with ``git archive`` and imported under another
name), interleaved request by request in one process, so both see the same machine. Each side
has its own in-process daemon and pool; no socket, no copy.

    python scripts/planner_ab.py --rev 0ba0d30 [--chunks 16] [--groups 1|2] [--repeats 4000]

Each request: decode the frame into its typed request, run the handler (check it against the
layout, plan it: what ``benchmarks/handler_cost.py`` times). Every STORE is then committed and
RETRIEVEd, and the pool cleared. ``--groups 2``: a full and a sliding group, one object each
(the default ``--separate-object-groups``), as a hybrid model stores them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import os
import random
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from tierd_client.layouts import block_span, group, layout, namespace  # noqa: E402
from tierd_client.shm import SharedBuffer  # noqa: E402

LAYERS, BLOCK_BYTES, BLOCK_TOKENS, CHUNK = 32, 8192, 16, 256
_IMPORT = re.compile(r"^(\s*)(from|import) tierd(?=[.\s])", re.MULTILINE)


def old_tree(rev: str) -> str:
    """Import name of ``rev``'s ``tierd`` package, unpacked into a temporary folder on sys.path."""
    tar = subprocess.run(["git", "-C", ROOT, "archive", rev, "tierd"], check=True, capture_output=True).stdout
    folder = Path(tempfile.mkdtemp(prefix="tierd-ab-"))
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(folder, filter="data")
    name = "tierd_" + re.sub(r"\W", "_", rev)
    (folder / "tierd").rename(folder / name)
    for py in (folder / name).rglob("*.py"):
        py.write_text(_IMPORT.sub(rf"\1\2 {name}", py.read_text()))
    sys.path.insert(0, str(folder))
    return name


def module(package: str, *names: str):
    """The first of ``names`` under ``package`` that exists: a module's place in this tree, then
    where a revision from before the layer folders kept it."""
    for name in names:
        if importlib.util.find_spec(f"{package}.{name.split('.')[0]}") is not None:
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError:
                continue
    raise ModuleNotFoundError(f"none of {names} in {package}")


class Side:
    """One daemon of one tree, with the bench's layout registered."""

    def __init__(self, package: str, groups: int, nb: int):
        self.handlers = module(package, "core.handlers", "handlers")
        self.codec = importlib.import_module(f"{package}.protocol.codec")
        messages = importlib.import_module(f"{package}.protocol.messages")
        settings = module(package, "base.config", "config").Settings
        daemon = module(package, "daemon.server", "server").Daemon
        sock = f"ipc://{tempfile.mkdtemp(prefix='tierd-ab-')}/h.sock"
        self.d = daemon(settings(socket=sock, l1_size_gb=4, http_port=-1))
        self.bufs = [SharedBuffer(LAYERS * nb * BLOCK_BYTES) for _ in range(groups)]
        gs = []
        for gi in range(groups):
            spans = [
                block_span((nb, BLOCK_BYTES), (BLOCK_BYTES, 1), 1, 0, tensor=gi, offset=li * nb * BLOCK_BYTES)
                for li in range(LAYERS)
            ]
            kind, window = ("full", 0) if gi == 0 else ("sliding", 512)
            gs.append(group(kind, BLOCK_TOKENS, spans, window_tokens=window))
        lay = layout(namespace("ab", uuid.uuid4().hex), 0, CHUNK, [b.ref() for b in self.bufs], gs)
        self.ident = b"a" * 16
        self.handlers.hello(self.d.tier, self.call(None, 0), messages.Hello(1))
        body = messages.convert({"instance": "i", "layout": lay}, messages.Register)
        self.handlers.register(self.d.tier, self.call(self.d.registry.session(self.ident), 0), body)

    def call(self, session, req_id: int, t0: float = 0.0):
        return self.handlers.Call(self.ident, session, [self.ident], req_id, t0)

    def timed(self, op: str, rep: int, body: dict):
        frame = self.codec.encode_request(op, rep, body)
        t0 = time.perf_counter()
        _, rid, msg = self.codec.decode_request(frame, 1 << 26)
        handler = self.handlers.store if op == "STORE" else self.handlers.retrieve
        job = handler(self.d.tier, self.call(self.d.registry.session(self.ident), rid, t0), msg)
        return time.perf_counter() - t0, job

    def close(self) -> None:
        self.d.close()
        for b in self.bufs:
            b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the older revision (a commit or tag)")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--groups", type=int, default=1, choices=(1, 2), help="1: full; 2: full + sliding")
    ap.add_argument("--repeats", type=int, default=4000)
    args = ap.parse_args()
    nb = 2 * args.chunks * CHUNK // BLOCK_TOKENS
    sides = {"this tree": Side("tierd", args.groups, nb), args.rev: Side(old_tree(args.rev), args.groups, nb)}
    try:
        times = {name: {"STORE": [], "RETRIEVE": []} for name in sides}
        bpc = CHUNK // BLOCK_TOKENS
        for rep in range(args.repeats):
            chunks = [
                {"key": uuid.uuid4().bytes, "blocks": [list(range(j * bpc, (j + 1) * bpc))] * args.groups}
                for j in range(args.chunks)
            ]
            body = {"instance": "i", "chunks": chunks, "deadline": time.time() + 60}
            order = list(sides)
            random.shuffle(order)
            for name in order:
                side = sides[name]
                took, job = side.timed("STORE", rep, body)
                times[name]["STORE"].append(took)
                assert job.plan.results == ["stored"] * args.chunks, job.plan.results[:3]
                side.d.pool.commit(job.plan.objs)
                took, job = side.timed("RETRIEVE", rep, body)
                times[name]["RETRIEVE"].append(took)
                assert job.plan.results == [True] * args.chunks
                side.d.pool.unpin(job.plan.objs)
                side.d.pool.clear()
        print(
            f"{args.chunks} chunks x {args.groups} group(s) x {LAYERS} layers, "
            f"{args.repeats} requests each, interleaved:"
        )
        warm = {n: {op: sorted(t[len(t) // 10 :]) for op, t in ops.items()} for n, ops in times.items()}
        for name, ops in warm.items():
            for op, t in ops.items():
                p50, p90 = statistics.median(t), t[int(len(t) * 0.9)]
                ratio = p50 / statistics.median(warm[args.rev][op])
                print(
                    f"  {name:>10} {op:8} p50 {p50 * 1e3:.3f} ms  p90 {p90 * 1e3:.3f} ms"
                    f"  ({ratio:.2f}x of {args.rev})"
                )
    finally:
        for side in sides.values():
            side.close()


if __name__ == "__main__":
    main()
