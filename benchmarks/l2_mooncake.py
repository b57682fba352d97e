#!/usr/bin/env python3
"""L2 put and get GB/s through tierd's MooncakeTier next to Mooncake's own client, same bytes, same run.

Question answered: what does the tier (a worker thread, a deadline per call, and the agent process
that holds the Mooncake client, see tierd/tier2/agent.py) cost on top of calling
``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into`` directly?

Method. One ``mooncake_master`` (its own HTTP metadata server, TCP over loopback) in a private
network namespace: the script re-runs itself under ``unshare -n`` (Mooncake's servers bind
0.0.0.0). Each round starts two fresh node processes (tests/l2_node.py), a writer P and a reader
G, each with its own memfd buffer registered with Mooncake and its own ``segment_gb`` segment. P
fills ``--chunks`` chunks of ``--chunk-mb`` MiB with random bytes and puts them, ``--batch``
keys per call; G gets them into its own buffer, same batches; a sample of chunks is checked byte
for byte (digests). Each node times its own calls (put: submit to answer); GB/s = bytes / summed
call time. Modes alternate raw, tier, raw, tier... for ``--rounds``; medians are reported, and
the ratio tier / raw for each direction. Both nodes share the host's cores with the master.

    python benchmarks/l2_mooncake.py                    # 128 x 2 MiB, batches of 16, 3 rounds
    python benchmarks/l2_mooncake.py --chunk-mb 8 --chunks 64 --json

Recorded 2026-12-01, 2-core VM, mooncake-transfer-engine-non-cuda 0.3.13.post1, TCP on loopback,
medians of 5 rounds (every round in brackets shows the spread of a shared 2-core host):

    --rounds 5:  128 x 2 MiB, 16 keys per call
                 Mooncake client                        MooncakeTier                          tier/raw
    put  1.000 GB/s [1.611, 1.379, 0.802, 1.0, 0.539]   1.061 GB/s [1.575, 1.061, 0.913, 0.578, 1.066]  1.061
    get  1.451 GB/s [1.383, 1.86, 2.185, 1.451, 1.239]  1.868 GB/s [2.448, 1.669, 1.657, 2.192, 1.868]  1.287
    --rounds 5 --chunks 32 --chunk-mb 8 --batch 4
    put  1.171 GB/s [0.657, 1.171, 1.566, 0.973, 1.366] 1.497 GB/s [1.012, 1.497, 1.61, 1.387, 1.504]   1.278
    get  2.055 GB/s [1.639, 3.352, 2.055, 1.622, 3.141] 2.328 GB/s [2.481, 2.04, 1.947, 2.821, 2.328]   1.133

Reading: the tier costs nothing measurable here (ratios 1.06-1.29, inside a round-to-round spread
of 2-3x). Before the agent mapped buffers with MAP_POPULATE, gets ran at 0.62 of raw: each first
touch of a 4 KiB page of a fresh mapping took a minor fault.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from l2_harness import Master, Node, unshare_prefix  # noqa: E402

MIB = 1 << 20
INSIDE = "TIERD_L2_BENCH_INSIDE"


def keys(tag: str, n: int) -> list[str]:
    return [hashlib.blake2b(f"bench/{tag}/{i}".encode(), digest_size=24).hexdigest() for i in range(n)]


def one_round(workdir: Path, mode: str, tag: str, args) -> dict:
    size = args.chunk_mb * MIB
    mb = args.chunks * args.chunk_mb + 16
    url = f"mooncake://127.0.0.1?segment_gb={args.segment_gb}&timeout_ms=60000"
    nodes = []
    try:
        p = Node(workdir, f"{tag}-p", url, mb=mb, mode=mode)
        nodes.append(p)
        g = Node(workdir, f"{tag}-g", url, mb=mb, mode=mode)
        nodes.append(g)
        ks = keys(tag, args.chunks)
        offs = [i * size for i in range(args.chunks)]
        sample = sorted({0, args.chunks // 2, args.chunks - 1})
        src = {i: p("fill", offset=offs[i], size=size, seed=i)["digest"] for i in range(args.chunks)}
        put_s = get_s = 0.0
        for lo in range(0, args.chunks, args.batch):
            batch = slice(lo, lo + args.batch)
            r = p("put", keys=ks[batch], offsets=offs[batch], sizes=[size] * len(ks[batch]), wait_s=120)
            assert all(r["ok"]), f"{mode} put failed: {r}"
            put_s += r["elapsed"]
        for lo in range(0, args.chunks, args.batch):
            batch = slice(lo, lo + args.batch)
            r = g("get", keys=ks[batch], offsets=offs[batch], sizes=[size] * len(ks[batch]), wait_s=120)
            assert all(r["ok"]), f"{mode} get failed: {r}"
            get_s += r["elapsed"]
        for i in sample:
            assert g("digest", offset=offs[i], size=size)["digest"] == src[i], f"{mode}: chunk {i} differs"
        total = args.chunks * size
        return {
            "mode": mode,
            "put_gbps": total / put_s / 1e9,
            "get_gbps": total / get_s / 1e9,
            "bytes": total,
        }
    finally:
        for n in reversed(nodes):
            n.stop()


def inside(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="tierd-l2-bench-"))
    master = Master(workdir).start()
    rounds = []
    try:
        for r in range(args.rounds):
            for mode in ("raw", "tier"):
                rounds.append(one_round(workdir, mode, f"{mode}{r}", args))
                print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
    finally:
        master.stop()
    out = {"chunks": args.chunks, "chunk_mb": args.chunk_mb, "batch": args.batch, "rounds": args.rounds}
    for mode in ("raw", "tier"):
        mine = [r for r in rounds if r["mode"] == mode]
        for d in ("put", "get"):
            vals = [r[f"{d}_gbps"] for r in mine]
            out[f"{mode}_{d}_gbps"] = round(statistics.median(vals), 3)
            out[f"{mode}_{d}_gbps_all"] = [round(v, 3) for v in vals]
    for d in ("put", "get"):
        out[f"{d}_ratio"] = round(out[f"tier_{d}_gbps"] / out[f"raw_{d}_gbps"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--chunk-mb", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="keys per put/get call")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--segment-gb", type=float, default=0.5, help="each node's contribution to the pool")
    ap.add_argument("--json", action="store_true", help="one JSON line on stdout")
    args = ap.parse_args()
    if os.environ.get(INSIDE):
        print(json.dumps(inside(args)), flush=True)
        return
    prefix = unshare_prefix()
    if prefix is None:
        sys.exit("needs unshare -n (root) or -rn: Mooncake's servers must not bind 0.0.0.0 on the host")
    env = dict(os.environ, **{INSIDE: "1"})
    cmd = [
        *prefix,
        "sh",
        "-c",
        'ip link set lo up && exec "$0" "$@"',
        sys.executable,
        __file__,
        *sys.argv[1:],
    ]
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(r.returncode)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"{args.chunks} x {args.chunk_mb} MiB, {args.batch} keys per call, {args.rounds} rounds "
        f"({time.monotonic() - t0:.0f} s), medians (all rounds):"
    )
    print(f"{'':6} {'Mooncake client':>26} {'MooncakeTier':>26} {'tier/raw':>9}")
    for d in ("put", "get"):
        raw, tier = out[f"raw_{d}_gbps"], out[f"tier_{d}_gbps"]
        print(
            f"{d:6} {raw:>8.3f} GB/s {str(out[f'raw_{d}_gbps_all']):>16} "
            f"{tier:>8.3f} GB/s {str(out[f'tier_{d}_gbps_all']):>16} {out[f'{d}_ratio']:>9.3f}"
        )


if __name__ == "__main__":
    main()
