"""Same-run A/B of the STORE/RETRIEVE handler cost: this tree's planner against the planner of an
older revision (its tierd/planner.py, read with ``git show``), interleaved request by request in
one process over one pool, so both see the same machine. In-process, no socket, no copy.

    python scripts/planner_ab.py --rev 7877fa5 [--chunks 16] [--repeats 4000]

Each request: decode the frame into its typed request, check it against the layout, plan it
(what ``benchmarks/handler_cost.py`` times). The older planner runs over today's pool, whose
``begin_write``/``abort`` kept their meaning.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from tierd import handlers, planner  # noqa: E402
from tierd.config import Settings  # noqa: E402
from tierd.handlers import Call  # noqa: E402
from tierd.protocol import codec, messages  # noqa: E402
from tierd.server import Daemon  # noqa: E402
from tierd_client.layouts import block_span, group, layout, namespace  # noqa: E402
from tierd_client.shm import SharedBuffer  # noqa: E402

LAYERS, BLOCK_BYTES, BLOCK_TOKENS, CHUNK = 32, 8192, 16, 256


def old_planner(rev: str) -> types.ModuleType:
    source = subprocess.run(
        ["git", "-C", ROOT, "show", f"{rev}:tierd/planner.py"], check=True, capture_output=True, text=True
    ).stdout
    mod = types.ModuleType(f"planner_{rev}")
    sys.modules[mod.__name__] = mod  # (dataclasses look their module up)
    exec(compile(source, f"{rev}:tierd/planner.py", "exec"), mod.__dict__)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the older revision (a commit or tag)")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=4000)
    args = ap.parse_args()
    variants = {"this tree": planner, args.rev: old_planner(args.rev)}
    nb = 2 * args.chunks * CHUNK // BLOCK_TOKENS
    d = Daemon(
        Settings(socket=f"ipc://{tempfile.mkdtemp(prefix='tierd-ab-')}/h.sock", l1_size_gb=4, http_port=-1)
    )
    buf = SharedBuffer(LAYERS * nb * BLOCK_BYTES)
    try:
        spans = [
            block_span((nb, BLOCK_BYTES), (BLOCK_BYTES, 1), 1, 0, tensor=0, offset=li * nb * BLOCK_BYTES)
            for li in range(LAYERS)
        ]
        lay = layout(
            namespace("ab", uuid.uuid4().hex), 0, CHUNK, [buf.ref()], [group("full", BLOCK_TOKENS, spans)]
        )
        ident = b"a" * 16
        handlers.hello(d.tier, Call(ident, None, [ident], 0, 0.0), messages.Hello(1))
        call = Call(ident, d.registry.session(ident), [ident], 0, 0.0)
        handlers.register(d.tier, call, messages.convert({"instance": "i", "layout": lay}, messages.Register))
        inst = d.registry.instance("i", call.tenant)
        pool, bpc = d.pool, CHUNK // BLOCK_TOKENS
        times: dict[str, dict[str, list[float]]] = {v: {"STORE": [], "RETRIEVE": []} for v in variants}
        for rep in range(args.repeats):
            chunks = [
                {"key": uuid.uuid4().bytes, "blocks": [list(range(j * bpc, (j + 1) * bpc))]}
                for j in range(args.chunks)
            ]
            body = {"instance": "i", "chunks": chunks, "deadline": time.time() + 60}
            order = list(variants)
            random.shuffle(order)
            for name in order:
                mod = variants[name]
                geo = mod.Geometry(inst.layout, d.settings.separate_object_groups, d.settings.null_block_id)
                for op in ("STORE", "RETRIEVE"):
                    frame = codec.encode_request(op, rep, body)
                    t0 = time.perf_counter()
                    _, _, msg = codec.decode_request(frame, 1 << 26)
                    blocks = geo.check(msg.chunks)
                    plan_fn = mod.plan_store if op == "STORE" else mod.plan_retrieve
                    if mod is planner:
                        plan = plan_fn(geo, msg.chunks, pool, inst.ns, inst.rank_key, None, blocks)
                    else:
                        plan = plan_fn(geo, msg.chunks, pool, inst.ns, inst.rank_key, None)
                    times[name][op].append(time.perf_counter() - t0)
                    if op == "STORE":
                        assert plan.results == ["stored"] * args.chunks, plan.results[:3]
                        pool.commit(plan.objs)
                    else:
                        assert plan.results == [True] * args.chunks
                pool.clear()
        print(
            f"{args.chunks} chunks x 1 full group x {LAYERS} layers, "
            f"{args.repeats} requests each, interleaved:"
        )
        base = {
            op: statistics.median(times[args.rev][op][len(times[args.rev][op]) // 10 :])
            for op in ("STORE", "RETRIEVE")
        }
        for name in variants:
            for op in ("STORE", "RETRIEVE"):
                t = sorted(times[name][op][len(times[name][op]) // 10 :])
                p50 = statistics.median(t)
                print(
                    f"  {name:>10} {op:8} p50 {p50 * 1e3:.3f} ms  p90 {t[int(len(t) * 0.9)] * 1e3:.3f} ms"
                    f"  ({p50 / base[op]:.2f}x of {args.rev})"
                )
    finally:
        d.close()
        buf.close()


if __name__ == "__main__":
    main()
