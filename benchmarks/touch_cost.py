"""What a LOOKUP's bookkeeping costs the daemon's main loop: the eviction order's touch of every
object a LOOKUP found, per policy, in a pool of ``--objects`` one-block objects, without a daemon
(the pool's own code, as ``tierd replay`` drives it).

    python benchmarks/touch_cost.py [--objects 200000] [--keys 2048] [--repeats 400] [--json]

Per policy: the median microseconds of ``--repeats`` touches of the same ``--keys`` objects (a
prefix found again and again: the top level of the reuse policy), and of the LOOKUP's read of the
index before it. To compare two trees, run it in each, alternately.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tierd.pool.index import Span  # noqa: E402
from tierd.pool.policy import POLICIES  # noqa: E402
from tierd.pool.pool import Pool  # noqa: E402
from tierd.protocol.layout import GroupKind, GroupSpec  # noqa: E402

SLOT = 64
NS = b"touch-bench"


def measure(policy: str, objects: int, keys: int, repeats: int) -> dict:
    pool = Pool(objects * SLOT * 2, 0, SLOT, objects * SLOT * 2, eviction_policy=policy)
    span, full = Span({0: (0, 0)}, {0: 1}), [GroupSpec(GroupKind.FULL, 16)]
    names = [b"k%09d" % i for i in range(objects)]
    for start in range(0, objects, 8192):
        with pool.writes() as w:
            made = [w.begin(NS, k, span, 0, SLOT, 1, "g0") for k in names[start : start + 8192]]
        pool.commit(made)
    prefix = names[:keys]
    lookups, touches = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        hit, _ = pool.lookup(NS, prefix, full, 16, [0])
        lookups.append(time.perf_counter() - t)
        assert hit == keys, hit
        t = time.perf_counter()
        pool.settle()
        touches.append(time.perf_counter() - t)
    pool.close()
    us = lambda xs: round(statistics.median(xs) * 1e6, 1)  # noqa: E731
    return {"lookup_us": us(lookups), "touch_us": us(touches)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=200_000)
    ap.add_argument("--keys", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not 0 < args.keys <= args.objects:
        ap.error(f"--keys must be between 1 and --objects ({args.objects}), got {args.keys}")
    results = {"objects": args.objects, "keys": args.keys, "repeats": args.repeats}
    for policy in POLICIES:
        results[policy] = measure(policy, args.objects, args.keys, args.repeats)
    if args.json:
        print(json.dumps(results))
        return
    print(f"{args.objects:,} objects, a LOOKUP of {args.keys:,} keys found again, {args.repeats} times")
    for policy in POLICIES:
        r = results[policy]
        print(f"  {policy:6} lookup {r['lookup_us']:8.1f} us   touch (settle) {r['touch_us']:8.1f} us")


if __name__ == "__main__":
    main()
