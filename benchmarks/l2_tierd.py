#!/usr/bin/env python3
"""L2 put and get GB/s through tierd (two real daemons) next to Mooncake's own client, same bytes, same run.

Question answered: what does going through tierd cost on top of calling Mooncake's
``batch_put_from`` / ``batch_get_into`` directly, for the bytes a STORE spills and a cross-node
LOOKUP + RETRIEVE brings back?

Method. One ``mooncake_master`` in a private network namespace (the script re-runs itself under
``unshare -n``: Mooncake's servers bind 0.0.0.0). Rounds alternate raw and tierd, each with fresh
processes that contribute ``--segment-gb`` each:

- raw: two tests/l2_node.py processes in raw mode (Mooncake's client, called synchronously, a
  memfd buffer registered). P puts ``--chunks`` x ``--chunk-mb`` in calls of 32 MiB (what tierd's
  write-through puts per call); G gets them all in one call (what a LOOKUP's prefetch asks).
  GB/s = bytes / summed call time.
- tierd: daemon A (``--l2-policy write-through``) and daemon B, real ``tierd serve`` processes,
  a FakeRank of shared memory each. put: from the first STORE (16 chunks per request) until A's
  /status says every object was put; that includes the copies into A's L1, which overlap the
  puts. get: B (empty L1) LOOKUP (which starts the fetch) + RETRIEVE of every chunk, until the
  RETRIEVE reply: the exists call, the get into B's L1 and the copy to the rank. Both are also
  given as the tier's own call time (``l2.latency_s`` sums: submission to answer of each put/get).

Bytes are random; B's destination blocks held other bytes; every chunk is compared by digest.

    python benchmarks/l2_tierd.py                        # 64 x 2 MiB, 3 rounds
    python benchmarks/l2_tierd.py --chunks 32 --chunk-mb 8 --json
"""

from __future__ import annotations

import argparse
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
INSIDE = "TIERD_L2_TIERD_BENCH_INSIDE"
MIB = 1 << 20


def raw_round(workdir: Path, tag: str, args) -> dict:
    from l2_harness import Node
    from l2_scenarios import keys

    size = args.chunk_mb * MIB
    url = f"mooncake://127.0.0.1?segment_gb={args.segment_gb}&timeout_ms=60000"
    nodes = []
    try:
        p = Node(workdir, f"{tag}-p", url, mb=args.chunks * args.chunk_mb + 16, mode="raw")
        nodes.append(p)
        g = Node(workdir, f"{tag}-g", url, mb=args.chunks * args.chunk_mb + 16, mode="raw")
        nodes.append(g)
        ks, offs = keys(tag, args.chunks), [i * size for i in range(args.chunks)]
        src = [p("fill", offset=o, size=size, seed=i)["digest"] for i, o in enumerate(offs)]
        per_call = max(1, (32 * MIB) // size)
        put_s = 0.0
        for lo in range(0, args.chunks, per_call):
            r = p(
                "put",
                keys=ks[lo : lo + per_call],
                offsets=offs[lo : lo + per_call],
                sizes=[size] * len(ks[lo : lo + per_call]),
                wait_s=120,
            )
            assert all(r["ok"]), r
            put_s += r["elapsed"]
        r = g("get", keys=ks, offsets=offs, sizes=[size] * args.chunks, wait_s=120)
        assert all(r["ok"]), r
        assert [g("digest", offset=o, size=size)["digest"] for o in offs] == src, "raw: bytes differ"
        total = args.chunks * size
        return {"mode": "raw", "put_gbps": total / put_s / 1e9, "get_gbps": total / r["elapsed"] / 1e9}
    finally:
        for n in reversed(nodes):
            n.stop()


def tierd_round(workdir: Path, tag: str, args) -> dict:
    from kv import GroupGeom
    from l2_daemons import Daemon, Rank, keys

    size = args.chunk_mb * MIB
    url = f"mooncake://127.0.0.1?segment_gb={args.segment_gb}&timeout_ms=60000"
    geom = GroupGeom("full", layers=2, block_bytes=size // 8, block_tokens=4)  # 4 blocks x 2 layers a chunk
    pool_mb = 2 * args.chunks * args.chunk_mb + 64
    started = []
    try:
        backed = ("--l1-init-size-gb", f"{pool_mb / 1024:.6f}")  # backed (and registered) before the traffic
        a = Daemon(workdir, f"a{tag}", "--l2-policy", "write-through", *backed, url=url, pool_mb=pool_mb)
        started.append(a)
        b = Daemon(workdir, f"b{tag}", *backed, url=url, pool_mb=pool_mb)
        started.append(b)
        for d in (a, b):
            d.wait(
                lambda s: s["l2"]["connected"] and s["l2"]["registered_bytes"] >= pool_mb * MIB,
                60,
                "registered",
            )
        ra = Rank(a, "a0", f"bench-{tag}", seed=1, num_blocks=4 * args.chunks, geom=geom)
        rb = Rank(b, "b0", f"bench-{tag}", seed=2, num_blocks=4 * args.chunks, geom=geom)
        started += [ra, rb]
        ks = keys(f"bench/{tag}", args.chunks)
        t0 = time.monotonic()
        for lo in range(0, args.chunks, 16):
            assert set(ra.store(ks[lo : lo + 16], first_block=4 * lo)) == {"stored"}
        deadline = time.monotonic() + 300
        while (sa := a.status())["l2"]["writeback_puts"] < args.chunks:
            if sa["l2"]["writeback_failed"] or time.monotonic() > deadline:  # no put rate from a failed put
                raise RuntimeError(f"A's write-through did not put every object: {sa['l2']}")
            time.sleep(0.01)
        put_s = time.monotonic() - t0
        t0 = time.monotonic()
        hit = rb.lookup(ks)
        lookup_s = time.monotonic() - t0
        got = rb.retrieve(ks, lease=hit["lease"])
        get_s = time.monotonic() - t0
        assert hit["chunks"] == args.chunks and all(got["ok"]) and not got["failed"], (hit, got)
        assert rb.digests(args.chunks) == ra.digests(args.chunks), "tierd: bytes differ"
        sb = b.status()
        total = args.chunks * size
        return {
            "mode": "tierd",
            "put_gbps": total / put_s / 1e9,
            "get_gbps": total / get_s / 1e9,
            "put_call_gbps": sa["l2"]["put_bytes"] / sa["l2"]["latency_s"]["put"]["sum"] / 1e9,
            "get_call_gbps": sb["l2"]["get_bytes"] / sb["l2"]["latency_s"]["get"]["sum"] / 1e9,
            "lookup_ms": 1e3 * lookup_s,
            "lookup_exists_ms": 1e3 * sb["l2"]["latency_s"]["exists"]["sum"],
        }
    finally:
        for thing in reversed(started):
            thing.stop()


def inside(args) -> dict:
    from l2_harness import Master

    workdir = Path(tempfile.mkdtemp(prefix="tierd-l2-tierd-bench-"))
    master = Master(workdir).start()
    rounds = []
    try:
        for r in range(args.rounds):
            rounds.append(raw_round(workdir, f"raw{r}", args))
            rounds.append(tierd_round(workdir, f"{r}", args))
            print(json.dumps(rounds[-2:]), file=sys.stderr, flush=True)
    finally:
        master.stop()
    out = {"chunks": args.chunks, "chunk_mb": args.chunk_mb, "rounds": args.rounds}
    for mode in ("raw", "tierd"):
        mine = [r for r in rounds if r["mode"] == mode]
        for key in mine[0]:
            if key != "mode":
                vals = [r[key] for r in mine]
                out[f"{mode}_{key}"] = round(statistics.median(vals), 3)
                out[f"{mode}_{key}_all"] = [round(v, 3) for v in vals]
    for d in ("put", "get"):
        out[f"{d}_ratio"] = round(out[f"tierd_{d}_gbps"] / out[f"raw_{d}_gbps"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-mb", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--segment-gb", type=float, default=0.5, help="each process's contribution to the store")
    ap.add_argument("--json", action="store_true", help="one JSON line on stdout")
    args = ap.parse_args()
    if os.environ.get(INSIDE):
        print(json.dumps(inside(args)), flush=True)
        return
    from l2_harness import unshare_prefix

    prefix = unshare_prefix()
    if prefix is None:
        sys.exit("needs unshare -n (root) or -rn: Mooncake's servers must not bind 0.0.0.0 on the host")
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
    r = subprocess.run(cmd, env=dict(os.environ, **{INSIDE: "1"}), stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(r.returncode)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"{args.chunks} x {args.chunk_mb} MiB, {args.rounds} rounds ({time.monotonic() - t0:.0f} s), "
        "medians [all rounds]:"
    )
    for d in ("put", "get"):
        print(
            f"{d}: Mooncake client {out[f'raw_{d}_gbps']:.3f} GB/s {out[f'raw_{d}_gbps_all']}  "
            f"tierd {out[f'tierd_{d}_gbps']:.3f} GB/s {out[f'tierd_{d}_gbps_all']}  "
            f"ratio {out[f'{d}_ratio']:.3f}  (tier calls alone {out[f'tierd_{d}_call_gbps']:.3f} GB/s)"
        )
    print(
        f"B's LOOKUP (answered once L2 said what it holds): {out['tierd_lookup_ms']:.2f} ms, of which its "
        f"exists call {out['tierd_lookup_exists_ms']:.2f} ms"
    )


if __name__ == "__main__":
    main()
