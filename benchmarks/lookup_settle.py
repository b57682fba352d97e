"""LOOKUP round trips with the daemon's bookkeeping after a reply applied in parts while it is idle
(the default, ``--lookup-settle-objects 256``) against applied whole right after each reply
(``--lookup-settle-objects 0``), in one run.

    python benchmarks/lookup_settle.py [--objects 200000] [--rounds 5] [--repeats 200] [--json]

Two private ``tierd serve`` processes, one per setting, are filled alike through the protocol
(``--objects`` one-block objects, as benchmarks/lookup_latency.py fills its daemon); then one
client, its heap frozen as an engine's, sends back-to-back LOOKUPs of a 32k-token prompt to each
in turn, ten back to back at a time, so both see the same machine at the same moment: 2,048 keys
(16-token chunks) with and without a lease (released untimed), and 128 keys (256-token chunks),
alone and beside a second client (another engine, a thread here) that sends 2,048-key LOOKUPs to
the same daemon back to back: its requests arrive while the other's bookkeeping is applied.
Per round and case, each daemon's p50 and p99; printed: the median over rounds of each, and
parts/whole, the per-round ratio's median with its min..max (this run's noise).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lookup_latency import BLOCK_BYTES, SPECS, fill, fill_256, percentiles  # noqa: E402

from tierd.base.config import Settings  # noqa: E402
from tierd.tools.bench.common import private_daemon  # noqa: E402
from tierd_client import TierdClient  # noqa: E402
from tierd_client.layouts import namespace  # noqa: E402
from tierd_client.shm import SharedBuffer  # noqa: E402

VARIANTS = ("parts", "whole")  # --lookup-settle-objects: --parts (the default: the daemon's), 0
CASES = ("2048_keys_hit", "2048_keys_hit_with_lease", "128_keys_hit", "128_keys_beside_2048")
# LOOKUPs sent to one daemon back to back before the other's turn: what a daemon does after a
# reply delays its next request only if that request comes to it (alternating request by request,
# each daemon would settle while the other answers)
BLOCK = 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=200_000)
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=200, help="LOOKUPs per case, daemon and round")
    ap.add_argument("--parts", type=int, default=Settings().lookup_settle_objects, help="objects a part")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pool = args.objects * BLOCK_BYTES * 2 + (64 << 20)
    extra = ("--l1-align-bytes", "64", "--l1-segment-mb", "256", "--http-port", "-1")
    keys = [uuid.uuid4().bytes for _ in range(args.prompt_tokens // 16)]
    keys128 = [uuid.uuid4().bytes for _ in range(args.prompt_tokens // 256)]
    with contextlib.ExitStack() as stack:
        clients, spaces = {}, {}
        for name, part in zip(VARIANTS, (str(args.parts), "0")):
            endpoint = stack.enter_context(private_daemon(pool, (*extra, "--lookup-settle-objects", part)))
            client = TierdClient(endpoint, timeout_s=120, name=f"settle-bench-{name}")
            stack.callback(client.close)
            client.wait_ready(30)
            buf = SharedBuffer(4096 * BLOCK_BYTES)
            stack.callback(buf.close)
            ns, ns2 = namespace("settle-bench", name), namespace("settle-bench-256", name)
            fill(client, buf, ns, keys, args.objects, 8192, show=not args.json)
            fill_256(client, buf, ns2, keys128)
            clients[name], spaces[name] = client, (ns, ns2)
        gc.collect()
        gc.freeze()

        def lookup(name: str, case: str) -> float:
            client, (ns, ns2) = clients[name], spaces[name]
            lease = case.endswith("lease")
            t = time.perf_counter()
            if case == "128_keys_hit":
                r = client.lookup(ns2, keys128, SPECS, 256, lease=False)
            else:
                r = client.lookup(ns, keys, SPECS, 16, lease=lease)
            took = time.perf_counter() - t
            assert r.chunks == (len(keys128) if case == "128_keys_hit" else len(keys)), r.chunks
            if r.lease:
                client.release(r.lease)
            return took

        others = {}
        for name in VARIANTS:
            others[name] = TierdClient(clients[name].url, timeout_s=120, name=f"settle-bench-{name}-beside")
            stack.callback(others[name].close)
            others[name].wait_ready(30)
        beside = {"name": None, "n": 0}
        go = threading.Event()
        stop = threading.Event()

        def other_engine() -> None:
            while not stop.is_set():
                if not go.wait(0.1):
                    continue
                name = beside["name"]
                r = others[name].lookup(spaces[name][0], keys, SPECS, 16, lease=False)
                assert r.chunks == len(keys), r.chunks
                beside["n"] += 1

        thread = threading.Thread(target=other_engine, daemon=True)
        thread.start()
        stack.callback(thread.join, 10)
        stack.callback(stop.set)

        def timed(name: str, case: str, n: int) -> list[float]:
            if not case.endswith("beside_2048"):
                return [lookup(name, case) for _ in range(n)]
            beside["name"] = name
            go.set()
            try:
                return [lookup(name, "128_keys_hit") for _ in range(n)]
            finally:
                go.clear()

        rounds: dict = {case: {name: [] for name in VARIANTS} for case in CASES}
        for i in range(args.rounds):
            for case in CASES:
                lat: dict = {name: [] for name in VARIANTS}
                for name in VARIANTS:  # warm-up, untimed
                    timed(name, case, 20)
                for _ in range(args.repeats // BLOCK):
                    for name in VARIANTS:
                        lat[name].extend(timed(name, case, BLOCK))
                for name in VARIANTS:
                    rounds[case][name].append(percentiles(lat[name]))
            if not args.json:
                print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    results: dict = {
        "objects": args.objects,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "parts": args.parts,
    }
    results["lookups_beside"] = beside["n"]
    for case in CASES:
        per = rounds[case]
        out: dict = {}
        for q in ("p50_ms", "p99_ms"):
            for name in VARIANTS:
                out[f"{name}_{q}"] = round(statistics.median(r[q] for r in per[name]), 4)
            ratios = [p[q] / w[q] for p, w in zip(per["parts"], per["whole"])]
            out[f"parts_over_whole_{q}"] = round(statistics.median(ratios), 3)
            out[f"parts_over_whole_{q}_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
        results[f"lookup_{case}"] = out
    if args.json:
        print(json.dumps(results))
        return
    for k, v in results.items():
        print(f"{k:34} {v}")


if __name__ == "__main__":
    main()
